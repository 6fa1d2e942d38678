"""torchrun worker for tests/distributed/test_torchrun_report.py: what the launcher shows of a failed
or a messy run.

``fail``: rank 1 raises a ValueError from a nested call while rank 0 waits for it in a barrier.
``hang OUT``: each rank writes its pid to ``OUT/rank-<rank>.pid``, then rank 1 sleeps for ten minutes
while rank 0 waits for it in a barrier.
``ok``: every rank meets the others in a barrier and exits.
``orphan OUT``: rank 0 starts a grandchild that would sleep for ten minutes and writes its pid to
``OUT/orphan.pid``; both ranks then exit cleanly, leaving it behind.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist


def fail_here(rank: int) -> None:
    raise ValueError(f"rank {rank} fails on purpose")


def main(mode: str, *args: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "fail" and rank == 1:
        fail_here(rank)
    if mode == "hang":
        Path(args[0], f"rank-{rank}.pid").write_text(str(os.getpid()))
        if rank == 1:
            print("rank 1 sleeps", flush=True)
            time.sleep(600)
    if mode == "orphan" and rank == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(args[0], "orphan.pid").write_text(str(child.pid))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
