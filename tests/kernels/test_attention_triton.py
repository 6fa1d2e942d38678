"""The Triton attention kernel against the float64 PyTorch reference.

Every check runs the kernel on fp32/fp16 inputs (bf16 on GPU only: the interpreter's bf16 dot
is broken) and the reference on the same values cast to float64, then compares the output, the
log-sum-exp and dQ, dK, dV for one random upstream gradient.

Tolerances are normwise, max|got - want| / max|want|, per dtype (u = unit roundoff):

- float32: 1e-5. The kernel computes in fp32 end to end (ieee dots); dots of length D <= 32 and
  sums over <= 70 keys leave a few ulp, observed < 1e-6.
- float16: 2e-3 (4u, u = 2^-11) for the output, 4e-3 for gradients. The kernel rounds P to
  fp16 before P V and dS before dS K and dS^T Q (as FlashAttention does), and rounds O, which
  also enters D = rowsum(dO * O): each is an O(u) normwise error, observed 3-5e-4.
- bfloat16: the same multiples of u = 2^-8: 1.6e-2 and 3.2e-2. A float64 emulation of exactly
  these roundings (P, dS, O to bf16) at T = 700, D = 128 gives normwise errors of 2-6e-3 (<= 1.5u).

An indexing or masking bug (a key from the next document, a missing tail tile, a wrong GQA
head) moves entries by O(1) of the scale, far above every tolerance.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ftlib.kernels.attention_ref import attention_ref

pytest.importorskip("triton")  # the kernel module needs it (installed on Linux x86-64)

from ftlib.kernels.attention_triton import attention_triton  # noqa: E402

TOL = {  # dtype -> (output and lse, gradients), normwise
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 3.2e-2),
}

PACK = [1, 17, 0, 40, 3]  # single-token doc, empty doc, ragged tails vs the 16-wide interpreter tiles


def _cu(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _assert_close(name, got, want, tol, floor=1e-6):
    got = got.double()
    diff = (got - want).abs()
    scale = max(want.abs().max().item(), floor)
    err = diff.max().item() / scale
    if not err <= tol:
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{name}: normwise error {err:.3g} > {tol:.3g}; worst at {idx}: got {got[idx].item():.6g}, "
            f"want {want[idx].item():.6g}"
        )


def _inputs(shape_q, shape_kv, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(shape_q, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(shape_kv, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(shape_kv, generator=g).to(device=device, dtype=dtype)
    do = torch.randn(shape_q, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do


def _run_triton(q, k, v, do, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_triton(*leaves, return_lse=True, **kw)
    o.backward(do)
    return o.detach(), lse, [t.grad for t in leaves]


def _run_ref64(q, k, v, do, **kw):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = attention_ref(*leaves, return_lse=True, **kw)
    o.backward(do.double())
    return o.detach(), lse, [t.grad for t in leaves]


def _check_against_reference(q, k, v, do, **kw):
    out_tol, grad_tol = TOL[q.dtype]
    o, lse, grads = _run_triton(q, k, v, do, **kw)
    o_ref, lse_ref, grads_ref = _run_ref64(q, k, v, do, **kw)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == torch.float32
    _assert_close("out", o, o_ref, out_tol)
    # lse: -inf exactly where the reference has it (rows that see no key), close elsewhere.
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), "lse: -inf rows differ"
    seen = torch.isfinite(lse_ref)
    if seen.any():
        _assert_close("lse", lse[seen], lse_ref[seen], out_tol)
    # A gradient can be exactly 0 in exact arithmetic (dq of a one-token document: the softmax over one
    # key has no slope), while the kernel sums terms of the other gradients' size to a rounding residue:
    # measure each gradient against the largest of the three.
    floor = max(max(w.abs().max().item() for w in grads_ref), 1e-6)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert got.dtype == q.dtype and got.shape == want.shape
        _assert_close(name, got, want, grad_tol, floor=floor)
    return o, lse, grads


# ---------------------------------------------------------------------------------------------
# CPU (TRITON_INTERPRET=1) and GPU alike
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "causal,hq,hkv",
    [(True, 1, 1), (True, 2, 1), (True, 4, 2), (True, 8, 1), (True, 8, 8), (False, 2, 1), (False, 8, 8)],
)
def test_varlen_matches_float64_reference(causal, hq, hkv):
    n = sum(PACK)
    q, k, v, do = _inputs((n, hq, 16), (n, hkv, 16), torch.float32, seed=hq * 10 + hkv)
    _check_against_reference(q, k, v, do, causal=causal, cu_seqlens=_cu(PACK), max_seqlen=max(PACK))


@pytest.mark.parametrize(
    "tq,tk,causal",
    [(37, 37, True), (37, 37, False), (19, 45, True), (19, 45, False), (45, 19, True)],
)
def test_dense_matches_float64_reference(tq, tk, causal):
    # head dim 24 runs in a 32-wide tile with masked columns (the path head dim 96 takes on GPU).
    q, k, v, do = _inputs((2, tq, 2, 24), (2, tk, 1, 24), torch.float32, seed=tq + tk)
    o, lse, grads = _check_against_reference(q, k, v, do, causal=causal)
    if causal and tq > tk:
        # Bottom-right alignment: the first tq - tk queries see no key at all.
        blind = tq - tk
        assert torch.all(o[:, :blind] == 0) and torch.isinf(lse[..., :blind]).all()
        assert torch.all(grads[0][:, :blind] == 0)


@pytest.mark.parametrize("layout", ["varlen", "dense"])
def test_float16_matches_float64_reference(layout):
    if layout == "varlen":
        n = sum(PACK)
        q, k, v, do = _inputs((n, 4, 32), (n, 2, 32), torch.float16, seed=3)
        _check_against_reference(q, k, v, do, causal=True, cu_seqlens=_cu(PACK), max_seqlen=max(PACK))
    else:
        q, k, v, do = _inputs((2, 33, 2, 32), (2, 45, 1, 32), torch.float16, seed=4)
        _check_against_reference(q, k, v, do, causal=False, softmax_scale=0.3)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_model_head_dims(head_dim):
    """The head dims of real models; 96 runs in a 128-wide tile with 32 masked columns."""
    lens = [5, 23]
    q, k, v, do = _inputs((28, 2, head_dim), (28, 1, head_dim), torch.float32, seed=head_dim)
    _check_against_reference(q, k, v, do, causal=True, cu_seqlens=_cu(lens), max_seqlen=23)


def test_empty_inputs():
    q = torch.randn(0, 2, 16, requires_grad=True)
    o = attention_triton(q, q, q, cu_seqlens=_cu([0]))
    assert o.shape == (0, 2, 16)
    o.sum().backward()
    assert q.grad.shape == q.shape
    qd = torch.randn(0, 5, 2, 16)
    assert attention_triton(qd, qd, qd).shape == qd.shape


def test_packed_equals_each_document_alone():
    """Packing changes nothing: the pack's rows and gradients equal per-document runs, bitwise."""
    lens = [1, 33, 5, 20]
    n = sum(lens)
    q, k, v, do = _inputs((n, 4, 16), (n, 2, 16), torch.float32, seed=5)
    cu = _cu(lens)
    o, _, (dq, dk, dv) = _run_triton(q, k, v, do, causal=True, cu_seqlens=cu, max_seqlen=max(lens))
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        o1, _, (dq1, dk1, dv1) = _run_triton(q[s:e], k[s:e], v[s:e], do[s:e], causal=True)
        for name, a, b in (("out", o, o1), ("dq", dq, dq1), ("dk", dk, dk1), ("dv", dv, dv1)):
            assert torch.equal(a[s:e], b), f"{name} of document [{s}, {e}) differs from its solo run"


def test_non_contiguous_inputs():
    """Strided views (fused qkv projection output, [B, H, T, D] transposes) give the same results."""
    n, hq, hkv, d = 29, 4, 2, 16
    qkv = torch.randn(n, hq + 2 * hkv, d)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    do = torch.randn(d, hq, n).permute(2, 1, 0)  # last dim not unit-stride: copied by the launcher
    assert not q.is_contiguous() and do.stride(-1) != 1
    kw = dict(causal=True, cu_seqlens=_cu([12, 17]), max_seqlen=17)
    strided = _run_triton(q, k, v, do, **kw)
    packed = _run_triton(q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), **kw)
    for a, b in zip([strided[0], *strided[2]], [packed[0], *packed[2]]):
        assert torch.equal(a, b)

    qd = torch.randn(2, hq, 21, d).transpose(1, 2)  # (B, T, H, D) view of a (B, H, T, D) tensor
    kd = torch.randn(2, hkv, 21, d).transpose(1, 2)
    vd = torch.randn(2, hkv, 21, d).transpose(1, 2)
    ref = attention_ref(qd.double(), kd.double(), vd.double(), causal=False)
    _assert_close("dense strided out", attention_triton(qd, kd, vd, causal=False), ref, TOL[torch.float32][0])


@pytest.mark.parametrize(
    "tiles,lens,dense_t",
    [
        # (fwd, dK/dV, dQ) (BLOCK_M, BLOCK_N): small unequal tiles, then the GPU defaults on
        # documents longer than one 128-row tile.
        (((32, 16), (16, 32), (32, 16)), PACK, (19, 45)),
        (((128, 64), (32, 128), (128, 32)), [1, 150, 0, 70, 260], (300, 170)),
    ],
    ids=["small", "gpu-default"],
)
def test_unequal_tile_shapes(monkeypatch, tiles, lens, dense_t):
    """GPU configurations use BLOCK_M != BLOCK_N: the diagonal/tail split must hold for them too."""
    import triton

    import ftlib.kernels.attention_triton as kernels

    if not kernels._INTERPRET:
        pytest.skip("natively the autotuner picks the tiles")
    for kernel, (bm, bn) in zip((kernels._fwd_kernel, kernels._bwd_dkdv_kernel, kernels._bwd_dq_kernel), tiles):
        monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn})])
    tq, tk = dense_t
    q, k, v, do = _inputs((1, tq, 4, 16), (1, tk, 2, 16), torch.float32, seed=8)
    _check_against_reference(q, k, v, do, causal=True)
    n = sum(lens)
    q, k, v, do = _inputs((n, 2, 16), (n, 1, 16), torch.float32, seed=9)
    _check_against_reference(q, k, v, do, causal=True, cu_seqlens=_cu(lens))


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=4).filter(lambda x: sum(x) > 0),
    group=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 16, 24]),
    causal=st.booleans(),
)
@example(lens=[1], group=1, head_dim=8, causal=False)  # dq is exactly 0: only rounding residue remains
def test_any_pack_matches_reference(lens, group, head_dim, causal):
    """Invariant: for any packing of documents, output and gradients equal the float64 reference."""
    n = sum(lens)
    q, k, v, do = _inputs((n, 2 * group, head_dim), (n, 2, head_dim), torch.float32, seed=n)
    # max_seqlen left out: computed from cu_seqlens.
    _check_against_reference(q, k, v, do, causal=causal, cu_seqlens=_cu(lens))


def test_bad_inputs_raise():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(TypeError, match="dtype"):
        attention_triton(q.double(), q.double(), q.double())
    with pytest.raises(TypeError, match="dtype"):
        attention_triton(q, q.half(), q)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_triton(torch.randn(1, 4, 3, 16), q, q)
    with pytest.raises(ValueError, match="head dim"):
        big = torch.randn(1, 4, 2, 512)
        attention_triton(big, big, big)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention_triton(q, q, q, cu_seqlens=_cu([4]))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D int32"):
        attention_triton(q[0], q[0], q[0], cu_seqlens=torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match="must be"):
        attention_triton(q, q[0], q[0])
    with pytest.raises(ValueError, match="rise from 0 to N=4"):
        attention_triton(q[0], q[0], q[0], cu_seqlens=_cu([1, 2]))
    with pytest.raises(ValueError, match="max_seqlen=2 < longest document"):
        attention_triton(q[0], q[0], q[0], cu_seqlens=_cu([1, 3]), max_seqlen=2)


def test_int32_offset_overflow_is_a_clear_error():
    """The kernels add int64 document/batch offsets to int32 row and head offsets: a shape whose
    in-document offset reaches 2^31 (here 2^19 + 1 tokens x 32 heads x 128) must raise, not read
    or write out of bounds. Meta tensors: no memory is allocated."""
    t = 2**19 + 1
    q = torch.empty(1, t, 32, 128, device="meta", dtype=torch.float16)
    kv = torch.empty(1, t, 8, 128, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="2\\^31"):
        attention_triton(q, kv, kv)
    # varlen: the same tokens as one document
    with pytest.raises(ValueError, match="2\\^31"):
        attention_triton(q[0], kv[0], kv[0], cu_seqlens=_cu([t]), max_seqlen=t)


# ---------------------------------------------------------------------------------------------
# GPU: the same checks natively, bf16/fp16, real head dims and longer sequences
# ---------------------------------------------------------------------------------------------

GPU_PACK = [1, 129, 700, 0, 63, 300]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen_matches_float64_reference(dtype, head_dim, causal):
    n = sum(GPU_PACK)
    q, k, v, do = _inputs((n, 8, head_dim), (n, 2, head_dim), dtype, device="cuda", seed=head_dim)
    _check_against_reference(q, k, v, do, causal=causal, cu_seqlens=_cu(GPU_PACK, "cuda"),
                             max_seqlen=max(GPU_PACK))


@pytest.mark.gpu
@pytest.mark.parametrize("tq,tk,causal", [(517, 517, True), (517, 517, False), (200, 517, True), (517, 200, True)])
@pytest.mark.parametrize("hq,hkv", [(8, 1), (8, 8)])
def test_gpu_dense_matches_float64_reference(tq, tk, causal, hq, hkv):
    q, k, v, do = _inputs((2, tq, hq, 128), (2, tk, hkv, 128), torch.bfloat16, device="cuda", seed=tq)
    _check_against_reference(q, k, v, do, causal=causal)


@pytest.mark.gpu
def test_gpu_float32_and_packed_equals_each_document_alone():
    n = sum(GPU_PACK)
    q, k, v, do = _inputs((n, 4, 64), (n, 2, 64), torch.float32, device="cuda", seed=7)
    cu = _cu(GPU_PACK, "cuda")
    _check_against_reference(q, k, v, do, causal=True, cu_seqlens=cu, max_seqlen=max(GPU_PACK))
    qb, kb, vb, dob = (t.bfloat16() for t in (q, k, v, do))
    o, _, (dq, dk, dv) = _run_triton(qb, kb, vb, dob, causal=True, cu_seqlens=cu, max_seqlen=max(GPU_PACK))
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        if e == s:
            continue
        o1, _, (dq1, dk1, dv1) = _run_triton(qb[s:e], kb[s:e], vb[s:e], dob[s:e], causal=True)
        for name, a, b in (("out", o, o1), ("dq", dq, dq1), ("dk", dk, dk1), ("dv", dv, dv1)):
            assert torch.equal(a[s:e], b), f"{name} of document [{s}, {e}) differs from its solo run"
