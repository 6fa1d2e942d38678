"""Token augmentation: the Triton kernel against the PyTorch reference, bit for bit, and the
properties of the operation (which tokens may change, into what, how often).

Kernel runs use the Triton interpreter on CPU (small shapes; the interpreter runs each program
in NumPy) and natively on CUDA for the ``gpu`` tests. Rates are checked with a binomial test
whose false-failure probability is bounded below (see ``_binom_ok``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.kernels import augment as K
from ftlib.kernels import augment_ref as R
from ftlib.kernels.augment import augment_tokens
from ftlib.kernels.augment_ref import (
    MAX_TAG,
    PROTECTED_TAG,
    AugmentParams,
    augment_tokens_ref,
    philox4x32_10,
    probability_threshold,
)

pytest.importorskip("triton")

from ftlib.kernels.augment_triton import augment_tokens_triton  # noqa: E402

U64 = st.integers(0, 2**64 - 1)


# ----------------------------------------------------------------------------------------------
# Philox
# ----------------------------------------------------------------------------------------------

# Random123 tests/kat_vectors, "philox4x32 10": counter[4] key[2] -> result[4].
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    got = philox4x32_10(*[torch.tensor([c], dtype=torch.int64) for c in ctr], *key)
    assert tuple(int(g) for g in got) == want


# ----------------------------------------------------------------------------------------------
# Random cases
# ----------------------------------------------------------------------------------------------

def _case(g: torch.Generator, *, vocab, n_rows, n_cols, n_tags=4, empty_table=False, p_protected=0.1,
          ids_dtype=torch.int64, with_labels=True, mask_kind=None):
    """Random tables over ``vocab`` ids and a batch that includes both vocabulary edges and ids outside it."""
    tags = torch.randint(0, n_tags, (vocab,), generator=g).to(torch.uint8)
    tags[torch.rand(vocab, generator=g) < p_protected] = PROTECTED_TAG
    counts = torch.randint(0, 4, (vocab,), generator=g)
    counts[torch.rand(vocab, generator=g) < 0.3] = 0  # many empty synonym lists
    if empty_table or vocab == 1:
        counts.zero_()
    owner = torch.repeat_interleave(torch.arange(vocab), counts)
    cands = ((owner + torch.randint(1, max(vocab, 2), owner.shape, generator=g)) % vocab).to(torch.int32)  # never v
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    ids = torch.randint(-2, vocab + 2, (n_rows, n_cols), generator=g)
    flat = ids.view(-1)
    flat[: min(4, flat.numel())] = torch.tensor([0, vocab - 1, 0, vocab - 1])[: min(4, flat.numel())]
    ids = ids.to(ids_dtype)
    labels = None
    if with_labels:
        labels = torch.where(torch.rand(n_rows, n_cols, generator=g) < 0.3, -100, ids.long())
    amask = None
    if mask_kind is not None:
        amask = (torch.rand(n_rows, n_cols, generator=g) < 0.8).to(mask_kind)
    return ids, labels, amask, tags, offsets, cands


@st.composite
def _params(draw, vocab):
    mask_id = draw(st.integers(-1, vocab - 1))
    return AugmentParams(
        seed=draw(U64), step=draw(U64),
        swap_threshold=probability_threshold(draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))),
        mask_threshold=0 if mask_id < 0 else probability_threshold(draw(st.sampled_from([0.0, 0.25, 1.0]))),
        swap_tag_bits=draw(st.integers(0, 15)), mask_tag_bits=draw(st.integers(0, 15)),
        mask_token_id=mask_id, pad_id=draw(st.integers(-1, vocab - 1)),
        protect_unlabeled=draw(st.booleans()), follow_labels=draw(st.booleans()), drop_masked=draw(st.booleans()),
    )


def _assert_same(got, want, what):
    if got is None or want is None:
        assert got is None and want is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    bad = torch.nonzero(got != want)
    if bad.numel():
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} positions differ, first at {i}: got {got[i].item()}, "
                             f"want {want[i].item()}")


# ----------------------------------------------------------------------------------------------
# Kernel == reference
# ----------------------------------------------------------------------------------------------

@settings(max_examples=20)
@given(data=st.data(), case_seed=st.integers(0, 2**31 - 1), vocab=st.integers(1, 40),
       shape=st.sampled_from([(1, 1), (1, 17), (3, 29), (2, 64), (5, 41)]),
       empty_table=st.booleans(), ids_dtype=st.sampled_from([torch.int64, torch.int32]),
       with_labels=st.booleans(), mask_kind=st.sampled_from([None, torch.bool, torch.int64]),
       block=st.sampled_from([16, 32, 128]))
def test_kernel_matches_reference_bitwise(data, case_seed, vocab, shape, empty_table, ids_dtype, with_labels,
                                          mask_kind, block):
    g = torch.Generator().manual_seed(case_seed)
    ids, labels, amask, tags, offsets, cands = _case(g, vocab=vocab, n_rows=shape[0], n_cols=shape[1],
                                                     empty_table=empty_table, ids_dtype=ids_dtype,
                                                     with_labels=with_labels, mask_kind=mask_kind)
    params = data.draw(_params(vocab))
    want = augment_tokens_ref(ids, labels, amask, tags, offsets, cands, params)
    got = augment_tokens_triton(ids, labels, amask, tags, offsets, cands, params, block=block)
    _assert_same(got[0], want[0], "input_ids")
    _assert_same(got[1], want[1], "labels")


def test_result_does_not_depend_on_block_or_grid():
    g = torch.Generator().manual_seed(3)
    ids, labels, amask, tags, offsets, cands = _case(g, vocab=37, n_rows=3, n_cols=111, mask_kind=torch.bool)
    params = AugmentParams(seed=2**63 + 12345, step=2**40 + 3, swap_threshold=probability_threshold(0.5),
                           mask_threshold=probability_threshold(0.5), mask_token_id=5, follow_labels=True)
    want = augment_tokens_ref(ids, labels, amask, tags, offsets, cands, params)
    assert int((want[0] != ids).sum()) > 30  # a case where much changes
    for block in (16, 128, 1024):
        got = augment_tokens_triton(ids, labels, amask, tags, offsets, cands, params, block=block)
        _assert_same(got[0], want[0], f"input_ids, block {block}")
        _assert_same(got[1], want[1], f"labels, block {block}")


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 16])
def test_reference_host_chunks_give_the_same_result(monkeypatch, chunk):
    g = torch.Generator().manual_seed(4)
    ids, labels, amask, tags, offsets, cands = _case(g, vocab=37, n_rows=3, n_cols=50, mask_kind=torch.int64)
    params = AugmentParams(seed=9, step=2**32 + 1, swap_threshold=probability_threshold(0.5),
                           mask_threshold=probability_threshold(0.5), mask_token_id=5, follow_labels=True)
    want = augment_tokens_triton(ids, labels, amask, tags, offsets, cands, params, block=256)  # one program
    monkeypatch.setattr(R, "_HOST_CHUNK", chunk)
    got = augment_tokens_ref(ids, labels, amask, tags, offsets, cands, params)
    _assert_same(got[0], want[0], f"input_ids, chunk {chunk}")
    _assert_same(got[1], want[1], f"labels, chunk {chunk}")


def test_empty_batch_and_single_id_vocabulary():
    tags = torch.zeros(1, dtype=torch.uint8)
    offsets = torch.zeros(2, dtype=torch.int32)
    cands = torch.zeros(0, dtype=torch.int32)
    params = AugmentParams(seed=1, step=2, swap_threshold=2**32, mask_threshold=2**32, mask_token_id=0)
    empty = torch.zeros(0, 5, dtype=torch.int64)
    for fn in (augment_tokens_ref, augment_tokens_triton):
        out, lab = fn(empty, empty.clone(), None, tags, offsets, cands, params)
        assert out.shape == (0, 5) and lab.shape == (0, 5)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    a = augment_tokens_ref(ids, None, None, tags, offsets, cands, params)
    b = augment_tokens_triton(ids, None, None, tags, offsets, cands, params)
    assert torch.equal(a[0], b[0]) and a[1] is None and b[1] is None
    assert torch.equal(a[0], ids)  # masked to token 0 = itself: no change


def test_keep_mode_returns_the_labels_tensor_itself():
    g = torch.Generator().manual_seed(0)
    ids, labels, _, tags, offsets, cands = _case(g, vocab=20, n_rows=2, n_cols=30)
    params = AugmentParams(seed=0, step=0, swap_threshold=2**31)
    for fn in (augment_tokens_ref, augment_tokens_triton):
        assert fn(ids, labels, None, tags, offsets, cands, params)[1] is labels


# ----------------------------------------------------------------------------------------------
# Properties (on the reference: the kernel equals it bit for bit)
# ----------------------------------------------------------------------------------------------

def _synonyms(offsets, cands, v):
    return set(cands[int(offsets[v]):int(offsets[v + 1])].tolist())


@settings(max_examples=40)
@given(data=st.data(), case_seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 40),
       mask_kind=st.sampled_from([None, torch.bool]))
def test_only_allowed_tokens_change_and_into_allowed_values(data, case_seed, vocab, mask_kind):
    g = torch.Generator().manual_seed(case_seed)
    ids, labels, amask, tags, offsets, cands = _case(g, vocab=vocab, n_rows=4, n_cols=50, mask_kind=mask_kind)
    mask_id = vocab - 1
    tags[mask_id] = PROTECTED_TAG  # the mask token is special, and never a synonym:
    keep = cands != mask_id
    owner = torch.repeat_interleave(torch.arange(vocab), (offsets[1:] - offsets[:-1]).long())
    cands, owner = cands[keep], owner[keep]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64),
                         torch.bincount(owner, minlength=vocab).cumsum(0)]).to(torch.int32)
    p = data.draw(_params(vocab))
    params = AugmentParams(**{**p.__dict__, "mask_token_id": mask_id,
                              "mask_threshold": probability_threshold(data.draw(st.sampled_from([0.0, 0.4, 1.0])))})
    new, new_lab = augment_tokens_ref(ids, labels, amask, tags, offsets, cands, params)

    in_vocab = (ids >= 0) & (ids < vocab)
    tag = torch.where(in_vocab, tags.long()[ids.long().clamp(0, vocab - 1)], PROTECTED_TAG)
    protected = ~in_vocab | (tag > MAX_TAG) | (ids == params.pad_id)
    if params.protect_unlabeled:
        protected |= labels == -100
    if amask is not None:
        protected |= ~amask
    assert torch.equal(new[protected], ids[protected]), "a protected token changed"
    assert torch.equal(new_lab[protected], labels[protected]), "the label of a protected token changed"
    bit = lambda bits: ((bits >> tag.clamp(max=MAX_TAG + 1)) & 1) == 1  # noqa: E731
    changed = new != ids
    masked = changed & (new == mask_id)
    swapped = changed & ~masked
    assert bool(bit(params.mask_tag_bits)[masked].all()), "a token masked outside mask_tags"
    assert bool(bit(params.swap_tag_bits)[swapped].all()), "a token swapped outside swap_tags"
    for old, now in zip(ids[swapped].tolist(), new[swapped].tolist()):
        assert now in _synonyms(offsets, cands, old), (old, now)
    # labels: kept, followed, or dropped at masked positions
    if not params.writes_labels:
        assert new_lab is labels
    else:
        exp = labels.clone()
        if params.follow_labels:
            exp = torch.where(changed & (labels != -100), new, exp)
        if params.drop_masked:
            exp = torch.where(masked, -100, exp)
        # a token masked into itself is invisible in `changed`; the mask id is protected here, so none is
        assert torch.equal(new_lab, exp)


def _rate_case(n=2**15, seed=0):
    """64 ids: 0..31 tag 1 with 1..5 synonyms, 32..47 tag 2 (none), 48..61 tag 3, 62 protected, 63 mask."""
    vocab = 64
    tags = torch.tensor([1] * 32 + [2] * 16 + [3] * 14 + [PROTECTED_TAG] * 2, dtype=torch.uint8)
    lists = [[(v + 1 + j) % 32 for j in range(1 + v % 5)] for v in range(32)] + [[] for _ in range(32)]
    offsets = torch.tensor([0] + [len(x) for x in lists]).cumsum(0).to(torch.int32)
    cands = torch.tensor([u for x in lists for u in x], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (4, n // 4), generator=g)
    return ids, tags, offsets, cands, lists


def _binom_ok(k: int, n: int, p: float, delta: float) -> bool:
    """Binomial test of k successes in n trials at rate p; false-failure probability <= delta.

    Chernoff: P(X >= n x) <= exp(-n KL(x || p)) for x >= p, and the same for the lower tail, so
    rejecting when n KL(k/n || p) >= ln(2 / delta) rejects a true p with probability <= delta.
    """
    if p == 0.0 or p == 1.0 or n == 0:
        return k == round(n * p)
    x = k / n
    kl = (x * math.log(x / p) if x > 0 else 0.0) + ((1 - x) * math.log((1 - x) / (1 - p)) if x < 1 else 0.0)
    return n * kl < math.log(2 / delta)


# Per check 1e-9; 3 + 15 checks per example and 15 examples: <= 2.7e-7 < 1e-6 for the whole test.
DELTA = 1e-9


@settings(max_examples=15)
@given(seed=U64, step=U64, ps=st.sampled_from([0.05, 0.3, 0.5, 0.9]), pm=st.sampled_from([0.1, 0.5]))
def test_observed_rates_match_the_probabilities(seed, step, ps, pm):
    ids, tags, offsets, cands, lists = _rate_case()
    mask_id = 63
    params = AugmentParams(seed=seed, step=step, swap_threshold=probability_threshold(ps),
                           mask_threshold=probability_threshold(pm), swap_tag_bits=1 << 1,
                           mask_tag_bits=(1 << 1) | (1 << 2), mask_token_id=mask_id)
    new, _ = augment_tokens_ref(ids, None, None, tags, offsets, cands, params)
    ids, new = ids.view(-1), new.view(-1)
    ps_eff, pm_eff = params.swap_threshold / 2**32, params.mask_threshold / 2**32
    t1, t2, t3 = ids < 32, (ids >= 32) & (ids < 48), ids >= 48
    swapped, masked = (new != ids) & (new != mask_id), (new == mask_id) & (ids != mask_id)
    n1 = int(t1.sum())
    assert _binom_ok(int((swapped & t1).sum()), n1, ps_eff, DELTA), ("swap rate", int((swapped & t1).sum()), n1)
    assert _binom_ok(int((masked & t1).sum()), n1, (1 - ps_eff) * pm_eff, DELTA), "mask rate after no swap"
    assert _binom_ok(int((masked & t2).sum()), int(t2.sum()), pm_eff, DELTA), "mask rate, no synonyms"
    assert not bool((new != ids)[t3].any()), "tag 3 is in neither tag set"
    # the synonym is uniform over the list: each of k candidates ~ Binomial(swaps of v, 1/k)
    for v in (4, 9, 14):  # 5 candidates each
        sel = swapped & (ids == v)
        m = int(sel.sum())
        for c in lists[v]:
            assert _binom_ok(int((new[sel] == c).sum()), m, 1 / len(lists[v]), DELTA), ("choice", v, c)


def test_rate_test_detects_a_wrong_rate():
    # The test has power: the counts of a correct run fail against a probability 10 % off.
    ids, tags, offsets, cands, _ = _rate_case()
    params = AugmentParams(seed=7, step=1, swap_threshold=probability_threshold(0.3), swap_tag_bits=2)
    new, _ = augment_tokens_ref(ids, None, None, tags, offsets, cands, params)
    t1 = ids < 32
    k, n = int(((new != ids) & t1).sum()), int(t1.sum())
    assert _binom_ok(k, n, 0.3, DELTA) and not _binom_ok(k, n, 0.33, DELTA) and not _binom_ok(k, n, 0.27, DELTA)


@settings(max_examples=25)
@given(seed=U64, step=st.integers(0, 2**64 - 2))
def test_same_seed_and_step_same_output_other_step_differs(seed, step):
    ids, tags, offsets, cands, _ = _rate_case(n=2048)
    base = dict(seed=seed, swap_threshold=probability_threshold(0.5), swap_tag_bits=2)
    a = augment_tokens_ref(ids, None, None, tags, offsets, cands, AugmentParams(step=step, **base))[0]
    b = augment_tokens_ref(ids, None, None, tags, offsets, cands, AugmentParams(step=step, **base))[0]
    c = augment_tokens_ref(ids, None, None, tags, offsets, cands, AugmentParams(step=step + 1, **base))[0]
    d = augment_tokens_ref(ids, None, None, tags, offsets, cands, AugmentParams(step=step, **{**base, "seed": seed ^ 1}))[0]
    assert torch.equal(a, b)
    # ~1000 tokens with synonyms swapped at p = 0.5: equal outputs by chance have probability < 2^-900
    assert not torch.equal(a, c) and not torch.equal(a, d)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------

def _tables(vocab=10):
    return (torch.zeros(vocab, dtype=torch.uint8), torch.zeros(vocab + 1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32))


@pytest.mark.parametrize("kw,match", [
    (dict(swap_threshold=2**32 + 1), "swap_threshold"),
    (dict(mask_threshold=-1), "mask_threshold"),
    (dict(seed=-1), "seed"),
    (dict(step=2**64), "step"),
    (dict(swap_tag_bits=1 << 63), "swap_tag_bits"),
    (dict(mask_threshold=5), "needs a mask_token_id"),
    (dict(seed=True), "seed"),
])
def test_params_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        AugmentParams(**{"seed": 0, "step": 0, **kw})


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_probability_threshold_errors(p):
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        probability_threshold(p)


def test_probability_threshold_exact():
    assert probability_threshold(0) == 0 and probability_threshold(1.0) == 2**32
    assert probability_threshold(0.5) == 2**31 and probability_threshold(0.1) == 429496729


@pytest.mark.parametrize("fn", [augment_tokens_ref, augment_tokens_triton])
def test_input_errors(fn):
    tags, off, cand = _tables()
    ids = torch.zeros(2, 3, dtype=torch.int64)
    p = AugmentParams(seed=0, step=0)
    with pytest.raises(TypeError, match="input_ids must be an int64 or int32"):
        fn(ids.float(), None, None, tags, off, cand, p)
    with pytest.raises(ValueError, match=r"labels shape \(3, 2\)"):
        fn(ids, ids.view(3, 2), None, tags, off, cand, p)
    with pytest.raises(TypeError, match="attention_mask must be"):
        fn(ids, None, ids.float(), tags, off, cand, p)
    with pytest.raises(ValueError, match="vocab size \\+ 1 = 11"):
        fn(ids, None, None, tags, off[:-1], cand, p)
    with pytest.raises(TypeError, match="tags must be a 1-D torch.uint8"):
        fn(ids, None, None, tags.long(), off, cand, p)
    with pytest.raises(ValueError, match="mask_token_id 10 is outside the vocabulary of 10"):
        fn(ids, None, None, tags, off, cand, AugmentParams(seed=0, step=0, mask_token_id=10, mask_threshold=1))
    with pytest.raises(ValueError, match="table is on meta but the batch is on cpu"):
        fn(ids, None, None, tags.to("meta"), off, cand, p)


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("want,kw,expected", [
    ("auto", dict(is_cuda=True, have_triton=True), "triton"),
    ("auto", dict(is_cuda=True, have_triton=False), "torch"),
    ("auto", dict(is_cuda=False, have_triton=True, interpret=True), "torch"),  # never the interpreter
    ("torch", dict(is_cuda=True, have_triton=True), "torch"),
    ("triton", dict(is_cuda=False, have_triton=True, interpret=True), "triton"),
    ("triton", dict(is_cuda=True, have_triton=True), "triton"),
])
def test_backend_decision_table(want, kw, expected):
    assert K._choose(want, **{"interpret": False, **kw}) == expected


@pytest.mark.parametrize("want,kw,exc,match", [
    ("flash", dict(is_cuda=True, have_triton=True), ValueError, r"expected one of auto\|triton\|torch"),
    ("cuda", dict(is_cuda=True, have_triton=True), ValueError, "expected one of"),
    ("triton", dict(is_cuda=True, have_triton=False), RuntimeError, "triton is not installed"),
    ("triton", dict(is_cuda=False, have_triton=True), RuntimeError, "needs CUDA tensors"),
])
def test_backend_errors(want, kw, exc, match):
    with pytest.raises(exc, match=match):
        K._choose(want, **{"interpret": False, **kw})


def test_env_var_forces_a_backend(monkeypatch):
    g = torch.Generator().manual_seed(1)
    ids, labels, amask, tags, off, cand = _case(g, vocab=12, n_rows=2, n_cols=20)
    p = AugmentParams(seed=3, step=4, swap_threshold=2**31)
    want = augment_tokens_ref(ids, labels, amask, tags, off, cand, p)
    for backend in ("torch", "triton", "auto"):
        monkeypatch.setenv("FTLIB_AUGMENT_BACKEND", backend)
        assert K.augment_backend(ids) == ("triton" if backend == "triton" else "torch")
        _assert_same(augment_tokens(ids, labels, amask, tags, off, cand, p)[0], want[0], backend)
    monkeypatch.setenv("FTLIB_AUGMENT_BACKEND", "flash")
    with pytest.raises(ValueError, match="FTLIB_AUGMENT_BACKEND='flash'"):
        augment_tokens(ids, labels, amask, tags, off, cand, p)


# ----------------------------------------------------------------------------------------------
# GPU: the native kernel, and the reference on CUDA, equal the CPU reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("follow,amask", [(False, None), (True, torch.int64), (True, torch.bool)])
def test_gpu_kernel_and_gpu_reference_equal_cpu_reference(follow, amask):
    g = torch.Generator().manual_seed(11)
    vocab = 5000
    ids, labels, am, tags, off, cand = _case(g, vocab=vocab, n_rows=8, n_cols=4099, mask_kind=amask)
    p = AugmentParams(seed=2**50 + 1, step=2**33 + 9, swap_threshold=probability_threshold(0.3),
                      mask_threshold=probability_threshold(0.2), mask_token_id=7, pad_id=3,
                      follow_labels=follow, drop_masked=follow)
    want = augment_tokens_ref(ids, labels, am, tags, off, cand, p)
    cuda = [None if t is None else t.cuda() for t in (ids, labels, am, tags, off, cand)]
    for name, fn in (("triton", augment_tokens_triton), ("torch-cuda", augment_tokens_ref)):
        got = fn(*cuda, p)
        _assert_same(got[0].cpu(), want[0], f"{name} input_ids")
        _assert_same(None if got[1] is None else got[1].cpu(), want[1], f"{name} labels")
    for block, warps in ((256, 2), (4096, 8)):
        got = augment_tokens_triton(*cuda, p, block=block, num_warps=warps)
        _assert_same(got[0].cpu(), want[0], f"triton block {block}")
