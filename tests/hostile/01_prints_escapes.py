"""Prints terminal control sequences (OSC 52 sets a terminal's clipboard, CSI clears the screen, a
bell) and raises with more of them in its message: the report shows them as text, never raw."""
# expect-status: failed
# expect-problem: raised RuntimeError: clipboard set

import os

import torch.distributed as dist

OSC52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    print(f"{OSC52}\x1b[2J\x1b[H\x07\x9b31mhello\x1bP+q544e\x1b\\", flush=True)
    raise RuntimeError(f"clipboard set{OSC52}\x1b[31m and the screen cleared\x1b[0m")


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
