"""Each rank forks three children that each hold 900 MB: every process under the memory limit counts,
not only the ranks themselves."""
# expect-status: failed
# expect-problem: memory limit
# grade-args: --timeout 60 --memory-limit 512

import os
import time

import torch.distributed as dist


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    for _ in range(3):
        if os.fork() == 0:
            hoard = bytearray(900 * 2**20)
            for i in range(0, len(hoard), 4096):
                hoard[i] = 1
            time.sleep(600)
            os._exit(0)
    time.sleep(600)


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
