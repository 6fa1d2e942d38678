"""This process's place in a torch.distributed job, and small JSON collectives: one home for both.

Every query works without torch.distributed (or before ``init_process_group``): then this is
rank 0 of a world of 1, ``local_rank`` comes from ``LOCAL_RANK`` (0 when unset), and the
collectives return at once. ``all_gather_json`` sends JSON text, not pickles (DESIGN: no pickle,
on the wire either): each rank's object is encoded to UTF-8 bytes, the byte counts are
all-gathered, then the bytes, padded to the longest. The tensors travel on ``comm_device``: the
current CUDA device for an NCCL-only group, the CPU otherwise (gloo, or a mixed
``cpu:gloo,cuda:nccl`` backend, which routes CPU tensors to gloo).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_json",
    "comm_device",
    "from_rank0",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_distributed",
]


def is_distributed() -> bool:
    """True once torch.distributed is available and its default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (the default group when None); 0 without torch.distributed."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group=None) -> int:
    """The number of ranks in ``group`` (the default group when None); 1 without torch.distributed."""
    return dist.get_world_size(group) if is_distributed() else 1


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, which torchrun sets; 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def comm_device(group=None) -> torch.device:
    """Where tensors for collectives on ``group`` must live: the current CUDA device under NCCL alone, else the CPU."""
    if not is_distributed():
        return torch.device("cpu")
    backend = dist.get_backend(group)
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj: Any, group=None) -> list:
    """Every rank's ``obj`` (JSON-able), in rank order; collective over ``group``. ``[obj]`` alone."""
    if get_world_size(group) == 1:
        return [json.loads(json.dumps(obj))]
    device, world = comm_device(group), get_world_size(group)
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: data.numel()] = data
    outs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(outs, buf, group=group)
    return [json.loads(bytes(o[: int(s)].cpu().numpy())) for o, s in zip(outs, sizes)]


def from_rank0(obj: Any, group=None) -> Any:
    """Rank 0's ``obj`` on every rank (collective; also a barrier: no rank returns before rank 0 sent it)."""
    return all_gather_json(obj, group)[0]
