"""The script the grader starts under torchrun for exercise 04.

    python -m torch.distributed.run --standalone --nproc_per_node=N torchrun_entry.py LEARNER_FILE FOLDER

Imports the learner's file and calls its launch_from_env with ``record``, which
writes what it received and what torchrun set into FOLDER (one JSON file per
call). If launch_from_env raises, the error goes to FOLDER too.
"""

import importlib.util
import json
import os
import sys
import traceback
import uuid


def record(*received) -> None:
    """The fn given to launch_from_env: write down the call."""
    out = {
        "received": [v if isinstance(v, (int, float, str, type(None))) else repr(v)[:200] for v in received],
        "pid": os.getpid(),
        "env_rank": os.environ.get("RANK"),
        "env_local_rank": os.environ.get("LOCAL_RANK"),
        "env_world_size": os.environ.get("WORLD_SIZE"),
    }
    name = f"call-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder = os.environ["DDP_GRADE_EX04_TORCHRUN_DIR"]
    with open(os.path.join(folder, f".{name}.tmp"), "w") as f:
        json.dump(out, f)
    os.replace(os.path.join(folder, f".{name}.tmp"), os.path.join(folder, f"{name}.json"))


def import_learner(path: str):
    path = os.path.abspath(path)
    sys.path.insert(0, os.path.dirname(path))
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    learner_path, folder = sys.argv[1], sys.argv[2]
    # Processes the learner may start from here find the folder through the environment.
    os.environ["DDP_GRADE_EX04_TORCHRUN_DIR"] = folder
    try:
        import_learner(learner_path).launch_from_env(record)
    except BaseException as exc:
        lines = traceback.format_exception_only(type(exc), exc)
        with open(os.path.join(folder, f"rank{os.environ.get('RANK')}.error"), "w") as f:
            f.write("".join(lines).strip())
        raise
    os._exit(0)  # the record is written: skip seconds of interpreter teardown


if __name__ == "__main__":
    main()
