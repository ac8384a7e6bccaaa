"""An exception the learner's code raised in a rank, caught there to be judged, in words that keep the
learner's own frame: "RuntimeError: ... (31_fsdp2.py line 57, in train_step: `loss = loss_fn(...)`)".

Drivers that catch an exception to record it (so that what was seen before it can still be judged) record
this text, so that the report shows the file, the line and its text whichever check names it.
"""

from __future__ import annotations

import os

ERROR_CHARS = 500  # an exception's message is cut here (never its frame)


def learner_error(exc: BaseException, limit: int = ERROR_CHARS, learner_path: str | None = None) -> str:
    """``exc`` as "Type: message (file line N, in function: `the line`)", the message cut at ``limit``
    characters (never the frame); ``learner_path`` defaults to this rank's learner's file."""
    from grader.rank import child

    info = child.describe_exception(exc, learner_path or child._LEARNER_PATH or None)
    return error_words(info, learner_path or child._LEARNER_PATH, limit)


def learner_frame(exc: BaseException, learner_path: str | None = None) -> str:
    """Only the frame of :func:`learner_error`: " (file line N, in function: `the line`)", or ""."""
    from grader.rank import child

    path = learner_path or child._LEARNER_PATH
    return frame_words(child.describe_exception(exc, path or None).get("where"), path)


def error_words(info: dict, learner_path: str, limit: int = ERROR_CHARS) -> str:
    """The words of :func:`learner_error` from describe_exception's record."""
    text = f"{info.get('type')}: {str(info.get('message') or '')[:limit]}"
    return text + frame_words(info.get("where"), learner_path)


def frame_words(where: dict | None, learner_path: str) -> str:
    """" (31_fsdp2.py line 57, in train_step: `loss = ...`)", or "" when no frame of the learner's file was met."""
    if not isinstance(where, dict) or not where.get("line"):
        return ""
    code = f": `{where['code']}`" if where.get("code") else ""
    return f" ({os.path.basename(learner_path or '')} line {where['line']}, in {where.get('function')}{code})"
