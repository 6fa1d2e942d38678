"""Token augmentation, the ``@triton.jit`` code: one program per BLOCK tokens of the flat batch.

The operation, its math and the reference are in ``augment_ref.py`` beside this file; the
launcher is ``augment_triton.py``. Per token the kernel loads the id (and label,
and attention mask when given), gathers the tag byte and, only for tokens whose tag allows a
swap, the two CSR offsets; evaluates Philox4x32-10 on (flat index, step) keyed by the seed in
uint32 registers; gathers one candidate for swapped tokens; and writes the new id (and label).
No atomics, no reductions, no host synchronisation; the only allocations are the outputs.

Expected performance (H200: HBM3e 4.8 TB/s peak, ~4.0-4.3 TB/s for a device-to-device copy):

- Bytes per token from HBM: id read 8 + label read 8 + id write 8 = 24 B when labels are kept
  (the input labels tensor is returned, not copied); 32 B when labels follow or masked positions
  are dropped (label write 8); + 8 B for an int64 attention_mask (padded batches). The tables are
  gathered, not streamed: tags (1 B/id), offsets (4 B/id) and candidates for a 128k vocabulary
  with ~100k synonym entries total ~1 MB and stay in the 50 MB L2 after the first touches.
- Copy-bound rate at 24 B/token: 4.1e12 / 24 = 1.7e11 tokens/s (0.2 us for a 32k-token batch,
  far below the ~5 us launch, so at training batch sizes the call is launch-bound; the rate
  matters for large batches and for the ratio the benchmark reports).
- Integer work: Philox-10 is per round 2 umulhi + 2 mul.lo (or 2 IMAD.WIDE) + 2 three-input XORs
  (LOP3), the key schedule is uniform (scalar) work: ~6 instructions x 10 rounds = 60, plus ~40
  for addresses, the tag bit test, the threshold compares and the multiply-shift: ~100 integer
  instructions per token. At 64 integer lanes/clk/SM x 132 SMs x 1.98 GHz = 1.7e13 /s that is
  ~1.7e11 tokens/s, the same as the copy-bound rate at 24 B/token: the kept-labels mode sits at
  the compute/bandwidth ridge (expect 70-90 % of copy bandwidth), the 32 B/token modes are
  bandwidth-bound (1.3e11 tokens/s at copy speed). Fewer Philox rounds would cut the integer
  work by up to 30 % (Philox4x32-7 passes BigCrush) if a measurement shows the kernel issue-bound.
- Block: 1024 tokens and 4 warps = 8 tokens per thread, so each int64 stream is read as two
  16-byte vector loads per thread; ~32 KB in flight per program; a 32k-token batch is 32
  programs, a 16M-token one 16k programs (many waves on 132 SMs). The result does not depend on
  BLOCK or the grid (the counter is the flat index), so the benchmark can sweep both.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .augment_ref import MAX_TAG, PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1, PROTECTED_TAG

__all__: list[str] = []

_PM0: tl.constexpr = tl.constexpr(PHILOX_M0)
_PM1: tl.constexpr = tl.constexpr(PHILOX_M1)
_PW0: tl.constexpr = tl.constexpr(PHILOX_W0)
_PW1: tl.constexpr = tl.constexpr(PHILOX_W1)
_ROUNDS: tl.constexpr = tl.constexpr(PHILOX_ROUNDS)
_MAXTAG: tl.constexpr = tl.constexpr(MAX_TAG)
_PROT: tl.constexpr = tl.constexpr(PROTECTED_TAG)


@triton.jit
def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    # Random123's Philox4x32 round: (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)),
    # then the Weyl key bump; all in uint32 (products wrap, umulhi gives the high word).
    for _ in tl.static_range(_ROUNDS):
        _c0, _c2 = c0, c2
        c0 = tl.umulhi(_c2, _PM1) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, _PM0) ^ c3 ^ k1
        c1 = tl.mul(_c2, _PM1, sanitize_overflow=False)
        c3 = tl.mul(_c0, _PM0, sanitize_overflow=False)
        k0 = tl.add(k0, _PW0, sanitize_overflow=False)
        k1 = tl.add(k1, _PW1, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit(do_not_specialize=["n_tokens", "seed_lo", "seed_hi", "step_lo", "step_hi", "swap_thr",
                               "mask_thr", "swap_bits", "mask_bits", "mask_id", "pad_id"])
def _augment_kernel(
    ids_ptr, labels_ptr, amask_ptr, out_ids_ptr, out_labels_ptr,
    tags_ptr, offsets_ptr, cands_ptr,
    n_tokens, vocab_size,
    seed_lo, seed_hi, step_lo, step_hi,
    swap_thr, mask_thr, swap_bits, mask_bits, mask_id, pad_id,
    HAS_LABELS: tl.constexpr, HAS_AMASK: tl.constexpr, HAS_PAD: tl.constexpr,
    PROTECT_UNLABELED: tl.constexpr, FOLLOW: tl.constexpr, DROP_MASKED: tl.constexpr,
    WRITE_LABELS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) int64 flat token index: the RNG counter
    inb = offs < n_tokens
    v = tl.load(ids_ptr + offs, mask=inb, other=-1).to(tl.int64)
    in_vocab = (v >= 0) & (v < vocab_size)
    vv = tl.where(in_vocab, v, 0)
    tag = tl.load(tags_ptr + vv, mask=inb & in_vocab, other=_PROT).to(tl.int64)  # uint8: zero-extended
    ok = inb & in_vocab & (tag <= _MAXTAG)
    if HAS_LABELS:
        lab = tl.load(labels_ptr + offs, mask=inb, other=-100).to(tl.int64)
        if PROTECT_UNLABELED:
            ok = ok & (lab != -100)
    if HAS_AMASK:
        am = tl.load(amask_ptr + offs, mask=inb, other=0)
        ok = ok & (am != 0)
    if HAS_PAD:
        ok = ok & (v != pad_id)
    t = tl.where(ok, tag, _MAXTAG + 1)
    swap_tag = ((swap_bits.to(tl.int64) >> t) & 1) == 1
    mask_tag = ((mask_bits.to(tl.int64) >> t) & 1) == 1
    # CSR offsets only for tokens whose tag allows a swap (others never read the synonym table).
    want = ok & swap_tag
    start = tl.load(offsets_ptr + vv, mask=want, other=0)
    count = tl.load(offsets_ptr + vv + 1, mask=want, other=0) - start

    c0 = (offs & 0xFFFFFFFF).to(tl.uint32)
    c1 = (offs >> 32).to(tl.uint32)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    c2 = zero + step_lo.to(tl.uint32)
    c3 = zero + step_hi.to(tl.uint32)
    r0, r1, r2, r3 = _philox4x32_10(c0, c1, c2, c3, seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))

    swap = want & (count > 0) & (r0.to(tl.int64) < swap_thr.to(tl.int64))
    j = tl.umulhi(r2, count.to(tl.uint32))  # (r2 * count) >> 32, in [0, count)
    cand = tl.load(cands_ptr + (start.to(tl.int64) + j.to(tl.int64)), mask=swap, other=0).to(tl.int64)
    masked = ok & (~swap) & mask_tag & (r1.to(tl.int64) < mask_thr.to(tl.int64))
    new = tl.where(swap, cand, tl.where(masked, mask_id.to(tl.int64), v))
    tl.store(out_ids_ptr + offs, new.to(out_ids_ptr.dtype.element_ty), mask=inb)
    if WRITE_LABELS:
        new_lab = lab
        if FOLLOW:
            new_lab = tl.where((swap | masked) & (lab != -100), new, new_lab)
        if DROP_MASKED:
            new_lab = tl.where(masked, -100, new_lab)
        tl.store(out_labels_ptr + offs, new_lab.to(out_labels_ptr.dtype.element_ty), mask=inb)
