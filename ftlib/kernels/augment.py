"""Token augmentation, the public op: ``augment_tokens`` and the choice of its backend.

``augment_tokens(input_ids, labels, attention_mask, tags, offsets, candidates, params)`` computes
the function of ``augment_ref.py`` (its docstring has the math) with the Triton kernel on CUDA
when Triton is installed, and with the PyTorch reference elsewhere; both agree bit for bit.
``FTLIB_AUGMENT_BACKEND=auto|triton|torch`` forces one, and forcing one that cannot run is an
error (``flash`` has no augmentation kernel and is refused by name). The Triton backend runs on
CPU tensors only under ``TRITON_INTERPRET=1`` (the test setup). The conventions are those of
``dispatch.py``: a pure decision function, an environment variable to force, errors not fallbacks.
Triton is imported only when the Triton backend is chosen.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ftlib._backends import BACKENDS, backend_choice

from .augment_ref import AugmentParams, augment_tokens_ref

__all__ = ["augment_backend", "augment_tokens"]

_VAR = "FTLIB_AUGMENT_BACKEND"
_BACKENDS = BACKENDS[_VAR]


def _choose(want: str, *, is_cuda: bool, have_triton: bool, interpret: bool) -> str:
    """The backend for one call; pure, so the whole decision table is testable without a GPU."""
    if want not in _BACKENDS:
        raise ValueError(f"{_VAR}={want!r}: expected one of {'|'.join(_BACKENDS)}")
    if want == "triton":
        if not have_triton:
            raise RuntimeError("FTLIB_AUGMENT_BACKEND=triton but triton is not installed (pip install triton)")
        if not (is_cuda or interpret):
            raise RuntimeError("FTLIB_AUGMENT_BACKEND=triton: the Triton kernel needs CUDA tensors "
                               "(or TRITON_INTERPRET=1 for CPU testing)")
        return "triton"
    if want == "torch" or not is_cuda:
        return "torch"
    return "triton" if have_triton else "torch"


def augment_backend(input_ids: torch.Tensor) -> str:
    """Name of the backend (``triton`` or ``torch``) ``augment_tokens`` uses for this batch."""
    return _choose(
        backend_choice(_VAR),
        is_cuda=input_ids.is_cuda, have_triton=importlib.util.find_spec("triton") is not None,
        interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
    )


def augment_tokens(input_ids, labels, attention_mask, tags, offsets, candidates, params: AugmentParams):
    """``augment_tokens_ref``'s result, from the Triton kernel on CUDA (see ``augment_backend``)."""
    if augment_backend(input_ids) == "triton":
        from .augment_triton import augment_tokens_triton

        return augment_tokens_triton(input_ids, labels, attention_mask, tags, offsets, candidates, params)
    return augment_tokens_ref(input_ids, labels, attention_mask, tags, offsets, candidates, params)
