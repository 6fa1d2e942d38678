"""torchrun worker for test_multinode.py: rank 3 (node 1) fails after the group formed, the others wait in a
collective that never completes, as a real failed rank leaves them."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 3:
    raise SystemExit(f"rank 3 on node {os.environ['GROUP_RANK']} gives up")
dist.all_reduce(torch.ones(1))  # never completes: rank 3 is gone
