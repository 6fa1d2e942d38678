"""QLoRA under FSDP2: NF4 codes and scales are sharded like any parameter, adapter grads match one process.

Two CPU processes with gloo; the gradient of each adapter must equal the single-process
gradient of the mean loss over both ranks' batches, in fp32 and (at bf16 tolerance) under
a bf16 ``MixedPrecisionPolicy``.
"""

import queue as queue_mod
import time
import traceback

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

    try:
        # the test's store (as torchrun's ranks use the agent's): no port to pick and lose before a rank binds it
        store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
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
    except BaseException:
        queue.put((rank, traceback.format_exc()))  # the test reports the rank and its traceback
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _results(procs, queue, timeout: float) -> list:
    """Each rank's result; a rank that raised fails the test with its traceback, one that died or hung
    with its exit code. Every process is gone afterwards."""
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < len(procs):
            try:
                rank, out = queue.get(timeout=1)
            except queue_mod.Empty:
                # a rank that exited 0 has put its result (it may still be in the pipe), a failed one its
                # traceback before it exited: a failed rank without one, or the deadline, ends the wait
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if not dead and time.monotonic() < deadline:
                    continue
                try:
                    rank, out = queue.get(timeout=5)
                except queue_mod.Empty:
                    raise AssertionError(f"ranks without a result: {dead or 'none exited'} (rank, exit code); "
                                         f"{timeout:g} s passed: {time.monotonic() > deadline}") from None
            if isinstance(out, str):
                raise AssertionError(f"rank {rank} failed:\n{out}")
            got[rank] = out
    finally:
        for p in procs:  # a rank done is let exit (slowly on a loaded machine) until the deadline
            p.join(timeout=max(deadline - time.monotonic(), 5))
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return sorted(got.items())


def test_fsdp2_shards_nf4_and_matches_single_process():
    pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)  # the OS picks the port
    procs = [ctx.Process(target=_worker, args=(r, store.port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = _results(procs, queue, timeout=240)
    del store

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
