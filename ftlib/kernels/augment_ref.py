"""Token augmentation over the flat token batch, the PyTorch reference: synonym swap and tag-aware masking.

One pass over the N = B*T tokens of a batch, each token decided on its own (no token looks at
another), so this reference and the Triton kernel (``_augment_kernels.py``, launched by
``augment_triton.py``) compute the same function element by element and agree bit for bit on
any device, block size or grid. ``augment.py`` chooses between them. This module also
holds what both backends share: the constants, ``AugmentParams`` and the input checks.

Inputs (all on one device): ``input_ids`` [...] int64/int32, ``labels`` (same shape, -100 = no
loss, or None), ``attention_mask`` (same shape, 0 = padding, or None), and three tables over a
vocabulary of V ids: ``tags`` uint8 [V] (tag id per token, 0 = unknown, ``PROTECTED_TAG`` =
never touched), ``offsets`` int32 [V + 1] and ``candidates`` int32 [nnz], the CSR synonym lists
(the synonyms of token v are ``candidates[offsets[v]:offsets[v + 1]]``).

Per token i with id v (the math both backends implement):

    r0, r1, r2, r3 = Philox4x32-10(counter = (i mod 2^32, i div 2^32, step mod 2^32, step div 2^32),
                                   key = (seed mod 2^32, seed div 2^32))
    eligible  = 0 <= v < V and tags[v] <= MAX_TAG and (labels[i] != -100 if protect_unlabeled)
                and attention_mask[i] != 0 and v != pad_id
    n         = offsets[v + 1] - offsets[v]
    swap      = eligible and tags[v] in swap_tags and n > 0 and r0 < swap_threshold
    mask      = eligible and not swap and tags[v] in mask_tags and r1 < mask_threshold
    j         = (r2 * n) >> 32                                  (Lemire's multiply-shift, in [0, n))
    out[i]    = candidates[offsets[v] + j] if swap else mask_token_id if mask else v
    labels    = kept, or (follow_labels) out[i] where a changed token had a label;
                (drop_masked) -100 where masked.

Probabilities enter as integer thresholds t = floor(p * 2^32), so P(r < t) = t / 2^32 exactly
(|t / 2^32 - p| < 2^-32; p = 1 gives t = 2^32, always) and no float rounding can differ between
backends. The multiply-shift choice gives each of n candidates probability floor(2^32/n)/2^32
or ceil(2^32/n)/2^32: a relative bias below n / 2^32 (2e-8 for 100 synonyms). A token that may be
both swapped and masked is swapped with probability p_s and masked with probability
(1 - p_s) p_m. Ids outside [0, V) (embedding rows the tables do not cover) are left unchanged.

Random numbers: Philox4x32 with 10 rounds (Salmon, Moraes, Dror, Shaw, "Parallel random numbers:
as easy as 1, 2, 3", SC 2011; the generator of cuRAND and of torch's CUDA RNG), keyed by the
seed, with the step and the flat token index as the counter: every (seed, step, token) draws
its own four 32-bit words, so the result depends on nothing else. The reference evaluates Philox
in int64 arithmetic, splitting the 32 x 32-bit products into 16-bit halves so that no
intermediate exceeds 2^49 (no overflow on any device); the kernel uses native uint32 and umulhi.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AugmentParams",
    "MAX_TAG",
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_ROUNDS",
    "PHILOX_W0",
    "PHILOX_W1",
    "PROTECTED_TAG",
    "augment_tokens_ref",
    "check_augment_inputs",
    "philox4x32_10",
    "probability_threshold",
]

MAX_TAG = 62  # tags 0..62 fit one int64 bit mask (bit 63 stays clear, so the mask is a positive int64)
PROTECTED_TAG = 255  # special tokens: no tag set can contain it
_ALL_TAGS = (1 << (MAX_TAG + 1)) - 1
_M32 = 0xFFFFFFFF
# Philox4x32 constants (Random123): round multipliers and the Weyl key increments.
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10


def probability_threshold(p: float) -> int:
    """floor(p * 2^32): a 32-bit draw r is below it with probability exactly threshold / 2^32."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"probability must be a number in [0, 1], got {p!r}")
    return int(float(p) * 2.0**32)  # exact: scaling by a power of two, then floor


@dataclass(frozen=True)
class AugmentParams:
    """The per-call scalars of the operation (see the module docstring), validated on creation.

    ``ftlib.augment.AugmentConfig`` resolves tag names and probabilities into one of these.
    """

    seed: int
    step: int
    swap_threshold: int = 0
    mask_threshold: int = 0
    swap_tag_bits: int = _ALL_TAGS
    mask_tag_bits: int = _ALL_TAGS
    mask_token_id: int = -1  # -1: no masking
    pad_id: int = -1  # -1: no pad id check (attention_mask and labels still protect padding)
    protect_unlabeled: bool = True
    follow_labels: bool = False
    drop_masked: bool = False

    def __post_init__(self):
        def check_int(name, lo, hi):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"AugmentParams.{name} must be an int in [{lo}, {hi}], got {v!r}")

        check_int("seed", 0, 2**64 - 1)
        check_int("step", 0, 2**64 - 1)
        check_int("swap_threshold", 0, 2**32)
        check_int("mask_threshold", 0, 2**32)
        check_int("swap_tag_bits", 0, _ALL_TAGS)
        check_int("mask_tag_bits", 0, _ALL_TAGS)
        check_int("mask_token_id", -1, 2**31 - 1)
        check_int("pad_id", -1, 2**31 - 1)
        if self.mask_threshold > 0 and self.mask_token_id < 0:
            raise ValueError("AugmentParams: masking (mask_threshold > 0) needs a mask_token_id")

    @property
    def writes_labels(self) -> bool:
        """Whether labels can change (else the input labels are returned as they are)."""
        return self.follow_labels or (self.drop_masked and self.mask_threshold > 0)


# ----------------------------------------------------------------------------------------------
# Philox4x32-10 in int64 arithmetic (values in [0, 2^32))
# ----------------------------------------------------------------------------------------------

def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * m) >> 32 and (a * m) mod 2^32 for a in [0, 2^32) and a constant m < 2^32.

    a * m = a * m_hi * 2^16 + a * m_lo with both partial products < 2^48; t = a * m_hi +
    (a * m_lo >> 16) < 2^49, and a * m = t * 2^16 + (a * m_lo mod 2^16).
    """
    x = a * (m & 0xFFFF)
    t = a * (m >> 16) + (x >> 16)
    return t >> 16, ((t & 0xFFFF) << 16) | (x & 0xFFFF)


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32 with 10 rounds on int64 tensors holding uint32 values; returns 4 such tensors.

    Counter (c0, c1, c2, c3) may be tensors or ints (broadcast); key (k0, k1) are ints. Matches
    Random123's known-answer vectors (tests/kernels/test_augment_kernel.py).
    """
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & _M32, (k1 + PHILOX_W1) & _M32
    return c0, c1, c2, c3


# ----------------------------------------------------------------------------------------------
# Input checks shared by both backends (shapes, dtypes, devices: no device synchronisation)
# ----------------------------------------------------------------------------------------------

_ID_DTYPES = (torch.int64, torch.int32)
_MASK_DTYPES = (torch.bool, torch.int64, torch.int32, torch.int8, torch.uint8)


def check_augment_inputs(input_ids, labels, attention_mask, tags, offsets, candidates, params) -> None:
    """Raise on arguments no backend accepts (types, dtypes, shapes, devices, vocabulary sizes).

    Reads only metadata, so it never synchronises with the device; every backend calls it first.
    """
    if not isinstance(params, AugmentParams):
        raise TypeError(f"params must be AugmentParams, got {type(params).__name__}")
    if not torch.is_tensor(input_ids) or input_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"input_ids must be an int64 or int32 tensor, got "
                        f"{input_ids.dtype if torch.is_tensor(input_ids) else type(input_ids).__name__}")
    dev = input_ids.device
    for name, t, dtypes in (("labels", labels, _ID_DTYPES), ("attention_mask", attention_mask, _MASK_DTYPES)):
        if t is None:
            continue
        if not torch.is_tensor(t) or t.dtype not in dtypes:
            raise TypeError(f"{name} must be a tensor of {[str(d) for d in dtypes]}, got "
                            f"{t.dtype if torch.is_tensor(t) else type(t).__name__}")
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != input_ids shape {tuple(input_ids.shape)}")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, input_ids on {dev}")
    for name, t, dtype in (("tags", tags, torch.uint8), ("offsets", offsets, torch.int32),
                           ("candidates", candidates, torch.int32)):
        if not torch.is_tensor(t) or t.dtype != dtype or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D {dtype} tensor, got "
                            f"{(t.dtype, tuple(t.shape)) if torch.is_tensor(t) else type(t).__name__}")
        if t.device != dev:
            raise ValueError(f"the {name} table is on {t.device} but the batch is on {dev}: move the tables "
                             "to the device once, before the loop")
    if offsets.numel() != tags.numel() + 1:
        raise ValueError(f"offsets has {offsets.numel()} entries, expected vocab size + 1 = {tags.numel() + 1} "
                         "(tags and the synonym table cover different vocabularies)")
    if params.mask_token_id >= tags.numel():
        raise ValueError(f"mask_token_id {params.mask_token_id} is outside the vocabulary of {tags.numel()} ids")


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous().view(-1)


# ----------------------------------------------------------------------------------------------
# The reference (vectorised; CPU or GPU)
# ----------------------------------------------------------------------------------------------

# On the host the reference runs in chunks of this many tokens: its ~200 element-wise int64 passes
# (Philox) then stay in cache instead of streaming N * 8 bytes through memory each time. 256k tokens,
# one thread: 0.112 s unchunked, 0.069 s in 64k chunks, 0.080 s in 16k, 0.140 s in 4k (CPU time,
# medians of 4 alternated runs on a loaded machine).
_HOST_CHUNK = 1 << 16


def augment_tokens_ref(input_ids, labels, attention_mask, tags, offsets, candidates, params: AugmentParams):
    """(new input_ids, new labels) by the rules of the module docstring; PyTorch ops only.

    Outputs have the inputs' shapes and dtypes; labels are returned as they are (the same tensor)
    when ``params`` cannot change them, and None stays None.
    """
    check_augment_inputs(input_ids, labels, attention_mask, tags, offsets, candidates, params)
    v, lab, am = _flat(input_ids), _flat(labels), _flat(attention_mask)
    write_labels = lab is not None and params.writes_labels
    out = torch.empty_like(v)
    out_lab = torch.empty_like(lab) if write_labels else None
    n = v.numel()
    chunk = max(n, 1) if v.is_cuda else _HOST_CHUNK
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        new, new_lab = _reference_chunk(v[s:e], None if lab is None else lab[s:e], None if am is None else am[s:e],
                                        s, tags, offsets, candidates, params, write_labels)
        out[s:e] = new
        if write_labels:
            out_lab[s:e] = new_lab
    return out.view(input_ids.shape), (out_lab.view(labels.shape) if write_labels else labels)


def _reference_chunk(ids, lab, am, first, tags, offsets, candidates, params, write_labels):
    """Tokens first .. first + len(ids) - 1 of the flat batch (the index is the Philox counter)."""
    v = ids.long()
    vocab = tags.numel()
    idx = torch.arange(first, first + v.numel(), device=v.device, dtype=torch.int64)
    in_vocab = (v >= 0) & (v < vocab)
    vv = torch.where(in_vocab, v, 0)
    tag = torch.where(in_vocab, tags[vv].long() if vocab else vv, PROTECTED_TAG)  # gather, then widen
    ok = in_vocab & (tag <= MAX_TAG)
    if lab is not None and params.protect_unlabeled:
        ok &= lab != -100
    if am is not None:
        ok &= am != 0
    if params.pad_id >= 0:
        ok &= v != params.pad_id
    t = torch.where(ok, tag, MAX_TAG + 1)  # a bit that no tag mask sets
    start = offsets[vv].long() if vocab else vv
    count = (offsets[vv + 1].long() if vocab else vv) - start

    r0, r1, r2, _ = philox4x32_10(idx & _M32, idx >> 32, params.step & _M32, params.step >> 32,
                                  params.seed & _M32, params.seed >> 32)
    swap_ok = ((torch.full_like(t, params.swap_tag_bits) >> t) & 1) == 1
    swap = ok & swap_ok & (count > 0) & (r0 < params.swap_threshold)
    pos = torch.where(swap, start + ((r2 * count) >> 32), 0)
    cand = candidates[pos].long() if candidates.numel() else torch.zeros_like(pos)
    mask_ok = ((torch.full_like(t, params.mask_tag_bits) >> t) & 1) == 1
    masked = ok & ~swap & mask_ok & (r1 < params.mask_threshold)
    new = torch.where(swap, cand, torch.where(masked, params.mask_token_id, v))
    if not write_labels:
        return new, None
    new_lab = lab.long()
    if params.follow_labels:
        new_lab = torch.where((swap | masked) & (new_lab != -100), new, new_lab)
    if params.drop_masked:
        new_lab = torch.where(masked, -100, new_lab)
    return new, new_lab
