"""Context parallelism (ftlib.distributed.context_parallel): the zigzag layout and its segment attention (local
queries over the gathered keys, one varlen call with separate key segments) equal one process's varlen attention, and the tiny LoRA model trained over 2 and 4 gloo ranks equals one process.

The layout tests run every rank of a group in one process (the all-gather is a concatenation); the
torchrun tests run the real collectives and also check that two bugs put in on purpose go red.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ftlib.distributed.context_parallel as cp
from ftlib.distributed import (
    ZigzagLayout,
    context_parallel_attention,
    context_parallel_loss,
    zigzag_indices,
    zigzag_shard,
)
from ftlib.kernels.attention_ref import attention_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cp_common import build, mirrored_off_by_one, one_process, packed_batch, skip_first_block  # noqa: E402

WORKER = Path(__file__).with_name("_cp_worker.py")


def _docs(total: int, cuts: list[int]) -> torch.Tensor:
    bounds = sorted({0, total, *(c % total for c in cuts)})
    return torch.tensor(bounds, dtype=torch.int32)


def _all_ranks(q, k, v, cu, world, **kw):
    """Every rank's output of the zigzag attention, put back in global order ([T, Hq, D])."""
    total = q.shape[0]
    batch = {"input_ids": torch.zeros(1, total, dtype=torch.long), "labels": torch.zeros(1, total, dtype=torch.long),
             "cu_seqlens": cu}
    out = torch.empty_like(q)
    for r in range(world):
        layout = zigzag_shard(batch, world=world, rank=r)["layout"]
        gathered = layout.gathered_indices()
        idx = layout.indices()
        o = _one_rank(q, k, v, layout, idx, gathered, **kw)
        out = out.index_put((idx,), o)
    return out


def _one_rank(q, k, v, layout, idx, gathered, **kw):
    # the "all-gather" of this rank: the global K / V in the gathered (rank-major) order, differentiable in them
    src = {"k": k, "v": v}
    calls = iter(("k", "v"))
    return context_parallel_attention(q[idx], k[idx], v[idx], layout,
                                      gather=lambda x: src[next(calls)][gathered], **kw)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), chunk=st.integers(1, 5), cuts=st.lists(st.integers(0, 200), max_size=4),
       extra=st.sampled_from([{}, {"sliding_window": 3}, {"softcap": 2.0}]))
def test_zigzag_attention_equals_one_process(world, chunk, cuts, extra):
    """float64, GQA 4/2, documents cut anywhere (across chunks and ranks): output and dq, dk, dv."""
    total = 2 * world * chunk
    g = torch.Generator().manual_seed(total + len(cuts))
    q, k, v = (torch.randn(total, h, 3, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    cu = _docs(total, cuts)
    want = attention_ref(q, k, v, causal=True, cu_seqlens=cu, softmax_scale=0.7, **extra)
    got = _all_ranks(q, k, v, cu, world, softmax_scale=0.7, **extra)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    gw = torch.autograd.grad(want, (q, k, v), dout)
    gg = torch.autograd.grad(got, (q, k, v), dout)
    for a, b, name in zip(gg, gw, "qkv"):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=f"d{name}")


def _case(world=2, chunk=3):
    total = 2 * world * chunk
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, 3, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, total], dtype=torch.int32)  # a document across the first chunk boundary
    return q, k, v, cu, attention_ref(q, k, v, causal=True, cu_seqlens=cu)


def test_a_skipped_block_is_caught(monkeypatch):
    q, k, v, cu, want = _case()
    plan = cp._segment_plan
    monkeypatch.setattr(cp, "_segment_plan", lambda layout, w: skip_first_block(plan(layout, w), layout.chunk))
    got = _all_ranks(q, k, v, cu, 2)
    assert (got - want).abs().max() > 1e-2


def test_an_off_by_one_mirrored_mask_is_caught(monkeypatch):
    q, k, v, cu, want = _case()
    plan = cp._segment_plan
    monkeypatch.setattr(cp, "_segment_plan", lambda layout, w: mirrored_off_by_one(plan(layout, w), layout.total))
    got = _all_ranks(q, k, v, cu, 2)
    assert (got - want).abs().max() > 1e-2


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_zigzag_balances_the_causal_pairs(world):
    """One document: every rank scores the same number of causal (query, key) pairs, its segments end where their
    keys end (bottom-right), and the chunks tile the sequence."""
    total, c = 4 * world * 3, 3 * 2
    doc = torch.zeros(total, dtype=torch.long)
    pairs = []
    for r in range(world):
        plan = cp._segment_plan(ZigzagLayout(total, world, r, doc), None)
        assert [(h, q0, q1) for h, q0, q1, _, _ in plan] == [(h, cp._chunk_id(world, r, h) * c,
                                                              (cp._chunk_id(world, r, h) + 1) * c) for h in range(2)]
        assert all(k0 == 0 and k1 == q1 for _, _, q1, k0, k1 in plan)
        pairs.append(sum((q1 - q0) * (k1 - k0 - (q1 - q0)) + (q1 - q0) * (q1 - q0 + 1) // 2
                         for _, q0, q1, k0, k1 in plan))
    assert pairs == [c * c * (2 * world - 1) + c * (c + 1)] * world
    idx = torch.cat([zigzag_indices(4 * world, world, r) for r in range(world)])
    assert sorted(idx.tolist()) == list(range(4 * world))


def test_the_window_trims_the_key_segments():
    """With a window W the keys start at the first one a segment's queries can see: q0 - W + 1 (not before d0)."""
    doc = torch.tensor([0] * 5 + [1] * 11)
    plan = cp._segment_plan(ZigzagLayout(16, 2, 1, doc), 3)  # rank 1: chunks 1 [4, 8) and 2 [8, 12)
    assert plan == [(0, 4, 5, 2, 5), (0, 5, 8, 5, 8), (1, 8, 12, 6, 12)]


@pytest.mark.parametrize("memory", [None, "checkpoint", "offload+chunks", "qlora"])
def test_one_rank_equals_the_model_loss(memory):
    """world 1 through the same path (padding to an even length included): loss and every gradient; also with
    the blocks checkpointed, or offloaded-checkpointed with a chunked MLP, whose recomputation in backward
    must attend through the shard again; and on an NF4 (QLoRA) base."""
    from ftlib.long_context import chunk_mlp, offload_checkpoints

    model, batch = build(qlora=memory == "qlora"), packed_batch()
    ref_loss, ref_grads = one_process(model, batch)
    if memory == "checkpoint":
        model.set_gradient_checkpointing(1)
    elif memory == "offload+chunks":
        offload_checkpoints(chunk_mlp(model, 3), copy_cpu=True)
    model.zero_grad(set_to_none=True)
    shard = zigzag_shard(batch, world=1, rank=0)
    assert shard["layout"].pad == 1  # 47 tokens -> 48
    loss, n = context_parallel_loss(model, shard)
    (loss / n).backward()
    assert abs(float((loss / n).detach()) - ref_loss) < 1e-6
    for name, g in ref_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, g, rtol=0, atol=1e-6, msg=name)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="one packed row"):
        zigzag_shard({"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)},
                     world=2, rank=0)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T=4"):
        zigzag_shard({"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long),
                      "cu_seqlens": torch.tensor([0, 3])}, world=2, rank=0)
    layout = ZigzagLayout(8, 2, 0, torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="this rank's 4 tokens"):
        context_parallel_attention(torch.zeros(8, 2, 3), torch.zeros(8, 1, 3), torch.zeros(8, 1, 3), layout)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_equal_one_process(tmp_path, world):
    """gloo, fp32: loss and every gradient (LoRA adapters and all) within 1e-5 of one process, also with
    checkpointing, offloaded checkpoints + chunked MLP, and FSDP2 over all ranks with context groups of 2
    (world / 2 sequences: 2 x 2 on 4 ranks); the bugs far off."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _torchrun import run_torchrun

    run_torchrun(WORKER, tmp_path, timeout=120, nproc=world)
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["world"] == world
    for case in ("exact", "checkpointed", "offload_chunks", "fsdp2"):
        d = r[case]
        assert d["n_grads"] == 2 * 7 * 2 and d["loss"] <= 1e-5 and d["grad"] <= 1e-5, (case, d)
    assert r["adapter"] <= 1e-5, r["adapter"]  # the exported adapter after one step
    for bug in ("skip_block", "mirrored_off_by_one"):
        assert r[bug]["loss"] > 1e-4 or r[bug]["grad"] > 1e-3, (bug, r[bug])


def test_the_dispatch_stays_out_of_compiled_models():
    """Once context parallel has wrapped the model's attention (it stays wrapped for the process), a
    compiled model without a live shard still compiles whole; with a live shard marker compiling is
    refused with a clear error (the marker cannot be looked up inside a graph)."""
    import gc

    from ftlib.models import llama

    cp._install_dispatch()
    assert getattr(llama.attention, "zigzag_dispatch", False)
    gc.collect()
    assert cp._LIVE[0] == 0
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)

    def f(q):
        return llama.attention(q, q, q, causal=True, cu_seqlens=cu, max_seqlen=5)

    explain = torch._dynamo.explain(f)(q)
    assert explain.graph_break_count == 0, explain.break_reasons
    cp._LIVE[0] += 1  # as a live shard_segments marker does
    try:
        torch._dynamo.reset()
        with pytest.raises(Exception, match="context parallel does not run under torch.compile"):
            torch.compile(f, backend="eager", fullgraph=True)(q)
    finally:
        cp._LIVE[0] -= 1
        torch._dynamo.reset()
