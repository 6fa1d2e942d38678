"""torchrun worker for tests/distributed/test_multinode.py: HSDP over 2 "nodes" x 2 ranks (gloo, CPU).

Launched as two torchrun agents met by the c10d rendezvous (``tests/_torchrun.py:torchrun_nodes``),
as on two machines. The mesh is the multi-node recipe's: shard within a node
(``device_mesh(shard=LOCAL_WORLD_SIZE)``), replicate across nodes. Checked here, where all four
ranks are: every shard group is one node's ranks, the two replicas hold equal shards and the
two ranks of a node different ones. Per case (``_dist_common``: LoRA; QLoRA with NF4, DoRA and
activation checkpointing) rank 0 writes the per-step records, the trained tensors and the
exported PEFT adapter under ``out/<case>/`` for the test to compare with one process.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _dist_common import build, parts, saved_weights, train
from safetensors.torch import save_file

from ftlib._dist import all_gather_json
from ftlib.distributed import device_mesh, export_adapter, init_distributed, shard_model


def local_digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_case(case: str, out: Path, rank: int, world: int, node_size: int) -> None:
    mesh = device_mesh(shard=node_size)
    node = int(os.environ["GROUP_RANK"])  # this agent's node rank, given by the rendezvous
    groups = all_gather_json([node, dist.get_process_group_ranks(mesh.get_group("shard")),
                              dist.get_process_group_ranks(mesh.get_group("replicate"))])
    for r, (n, shard, _) in enumerate(groups):
        assert shard == [i for i, g in enumerate(groups) if g[0] == n], f"rank {r}: shard group {shard} is not node {n}"
    module = shard_model(build(case), mesh=mesh)
    digests = all_gather_json(local_digest(module))
    for r in range(world):
        assert digests[r] == digests[r % node_size], f"{case}: rank {r}'s shards differ from its replica's"
    assert digests[0] != digests[1], f"{case}: the two ranks of a node hold the same shards"
    opt, sched, clip, loader = parts(case, module, rank, world)
    records = train(module, opt, sched, clip, loader)
    views = all_gather_json([r["loss"] for r in records])
    assert all(v == views[0] for v in views), f"{case}: ranks report different losses {views}"
    final = saved_weights(module)
    export_adapter(module, out / "adapter")  # collective; rank 0 writes
    if rank == 0:
        (out / "records.json").write_text(json.dumps({"records": records, "groups": groups}, indent=1))
        save_file({k: v.contiguous() for k, v in final.items()}, str(out / "final.safetensors"))


def main(out_dir: str, *cases: str) -> None:
    env = init_distributed()
    node_size = int(os.environ["LOCAL_WORLD_SIZE"])
    assert env.world_size == 4 and node_size == 2, (env.world_size, node_size)
    out = Path(out_dir)
    for case in cases:
        run_case(case, out / case, env.rank, env.world_size, node_size)
    dist.barrier()
    if env.rank == 0:
        (out / "ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
