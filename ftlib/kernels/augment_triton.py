"""Token augmentation, the Triton launcher: ``augment_tokens_triton``, with the reference's signature.

The function and its reference are in ``augment_ref.py``, the ``@triton.jit`` code (and its
expected performance) in ``_augment_kernels.py``. The launcher checks the arguments as the
reference does, flattens the batch, and runs one program per ``block`` tokens; the result does
not depend on ``block``, ``num_warps`` or the grid (the RNG counter is the flat token index), so
a benchmark may sweep them. Integer op: there is no gradient and no autograd function.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import triton

from . import _augment_kernels as _k
from .augment_ref import AugmentParams, check_augment_inputs

__all__ = ["DEFAULT_BLOCK", "DEFAULT_WARPS", "augment_tokens_triton"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEFAULT_BLOCK = 128 if _INTERPRET else 1024  # the interpreter runs each program in NumPy
DEFAULT_WARPS = 4
_M32 = 0xFFFFFFFF


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous().view(-1)


def augment_tokens_triton(input_ids, labels, attention_mask, tags, offsets, candidates, params: AugmentParams,
                          *, block: int | None = None, num_warps: int | None = None):
    """``augment_tokens_ref``'s result from the Triton kernel (same signature; block/warps to tune)."""
    check_augment_inputs(input_ids, labels, attention_mask, tags, offsets, candidates, params)
    if not input_ids.is_cuda and not _INTERPRET:
        raise RuntimeError("augment_tokens_triton: needs CUDA tensors (set TRITON_INTERPRET=1 before importing "
                           "ftlib to run the kernel on CPU for testing)")
    block = DEFAULT_BLOCK if block is None else block
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    ids = _flat(input_ids)
    lab = _flat(labels)
    am = _flat(attention_mask)
    if am is not None and am.dtype == torch.bool:
        am = am.view(torch.uint8)
    n = ids.numel()
    out_ids = torch.empty_like(ids)
    write_labels = lab is not None and params.writes_labels
    out_lab = torch.empty_like(lab) if write_labels else None
    if n == 0:
        return out_ids.view(input_ids.shape), (out_lab.view(labels.shape) if write_labels else labels)
    cands = candidates if candidates.numel() else offsets  # any valid pointer: no lane reads it
    with torch.cuda.device(ids.device) if ids.is_cuda else nullcontext():
        _k._augment_kernel[(triton.cdiv(n, block),)](
            ids, lab if lab is not None else ids, am if am is not None else ids, out_ids,
            out_lab if write_labels else out_ids,
            tags, offsets, cands,
            n, tags.numel(),
            params.seed & _M32, params.seed >> 32, params.step & _M32, params.step >> 32,
            params.swap_threshold, params.mask_threshold, params.swap_tag_bits, params.mask_tag_bits,
            params.mask_token_id, params.pad_id,
            HAS_LABELS=lab is not None, HAS_AMASK=am is not None, HAS_PAD=params.pad_id >= 0,
            PROTECT_UNLABELED=params.protect_unlabeled, FOLLOW=params.follow_labels,
            DROP_MASKED=params.drop_masked and params.mask_threshold > 0, WRITE_LABELS=write_labels,
            BLOCK=block, num_warps=DEFAULT_WARPS if num_warps is None else num_warps,
        )
    return out_ids.view(input_ids.shape), (out_lab.view(labels.shape) if write_labels else labels)

