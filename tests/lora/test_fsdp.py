"""QLoRA under FSDP2: NF4 codes and scales are sharded like any parameter, adapter grads match one process.

Two CPU processes with gloo; the gradient of each adapter must equal the single-process
gradient of the mean loss over both ranks' batches, in fp32 and (at bf16 tolerance) under
a bf16 ``MixedPrecisionPolicy``.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ftlib.lora import LoRAConfig, apply_lora, lora_layers

pytestmark = pytest.mark.distributed
WORLD = 2


def _build():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8))
    cfg = LoRAConfig(r=4, alpha=8, target_modules=["0", "2"], quantize="nf4", double_quant=True, use_dora=True)
    apply_lora(m, cfg, verbose=False)
    with torch.no_grad():
        for _, layer in lora_layers(m):
            layer.lora_B.weight.normal_(0, 0.1)
    return m


def _batch(rank):
    return torch.randn(6, 64, generator=torch.Generator().manual_seed(rank))


def _worker(rank, port, queue):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        out = []
        for mp_policy in (MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32)):
            m = _build()
            for name in ("0", "2"):
                fully_shard(m.get_submodule(name), mp_policy=mp_policy)
            fully_shard(m, mp_policy=mp_policy)
            codes = m[0].base_layer.codes
            m(_batch(rank)).float().pow(2).sum().backward()
            # numpy copies: torch tensors would travel as shared memory that dies with this process
            grads = {n: p.grad.full_tensor().float().numpy().copy() for n, p in m.named_parameters() if p.requires_grad}
            out.append((codes.to_local().numel(), codes.full_tensor().numel(), grads))
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_shards_nf4_and_matches_single_process():
    pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=240) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)

    ref = _build()
    sum(ref(_batch(r)).pow(2).sum() for r in range(WORLD)).backward()
    want = {n: p.grad / WORLD for n, p in ref.named_parameters() if p.requires_grad}
    for rank, out in results:
        # fp32, then bf16 mixed precision (NF4 scales are not floating point, so they stay exact)
        for (local, full, grads), tol in zip(out, (1e-5, 3e-2)):
            assert full == ref[0].base_layer.codes.numel() and local == full // WORLD, "NF4 codes were not sharded"
            assert set(grads) == set(want)
            for n, g in grads.items():
                torch.testing.assert_close(torch.from_numpy(g), want[n], atol=tol, rtol=tol,
                                           msg=lambda m, n=n, rank=rank: f"rank {rank} grad {n}: {m}")
