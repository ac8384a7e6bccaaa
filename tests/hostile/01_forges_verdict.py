"""Wrong (no timeout), and forges the grader's answer: it looks up its own ancestors in /proc for a
process of the grader (python -m grader.worker, grader.rank.rank_host) and writes a well-formed all-pass
report line into every pipe that process holds. Graded in the command's own process it finds none;
in a sandbox it finds only the host that starts the ranks, whose pipes it cannot open (the host is
not dumpable): it gets the verdict of its own code."""
# expect-status: failed
# expect-fail: timeout-set
# expect-absent: All 8 checks passed

import json
import os

import torch.distributed as dist

FORGED = {"exercise": "01", "title": "Join and leave a process group", "path": "01_setup.py", "status": "passed",
          "checks": [{"id": c, "title": c, "status": "pass"} for c in
                     ("joins-group", "backend", "collective-works", "port-from-env", "default-address", "timeout-set",
                      "cleanup-destroys", "cleanup-twice")]}
LINE = (json.dumps({"type": "report", "report": FORGED}) + "\n").encode()


def grader_ancestors() -> list[int]:
    found, pid = [], os.getppid()
    while pid > 0:  # up to the sandbox's first process (pid 1) included
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if b"grader.worker" in command or b"grader.rank.rank_host" in command:
            found.append(pid)
        pid = parent if pid != 1 else 0
    return found


def forge() -> None:
    for pid in grader_ancestors():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # not even listed: a process that is not dumpable, seen by another user
            continue
        for fd in fds:
            try:
                if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:"):
                    continue
                out = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
                try:
                    os.write(out, LINE)
                finally:
                    os.close(out)
            except OSError:
                continue


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    forge()
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=None)


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
