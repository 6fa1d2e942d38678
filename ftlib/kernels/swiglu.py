"""SwiGLU's gated product ``silu(g) * u`` as one op, with a fused CPU kernel (``ftlib.cpu.swiglu``).

    h = silu(g) * u = g s u,   s = sigmoid(g);     dg = dh u s (1 + g (1 - s)),   du = dh g s

(Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202; the Llama MLP's
``down(silu(gate(x)) * up(x))``.) The reference is ``F.silu(g) * u`` under autograd: two passes
over the [N, I] tensors forward, five backward, and silu(g) kept for backward beside g and u.
Backends (``FTLIB_SWIGLU_BACKEND=auto|cpu|torch``, ``ftlib._backends``): ``cpu``, the CPU wing's
kernel (``ftlib.cpu.swiglu``: fp32 on an AVX2 + FMA core, each direction in one pass, keeping only g
and u, one [N, I] tensor fewer per layer; its exp is within ~2 ulp of the reference's), taken by
``auto`` where it can run outside ``torch.compile`` (where inductor fuses the reference's ops);
``torch``, the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftlib._backends import cpu_or_torch
from ftlib.cpu import swiglu_cpu, swiglu_cpu_unsupported

__all__ = ["swiglu", "swiglu_backend"]


def swiglu_backend(g: torch.Tensor, u: torch.Tensor) -> str:
    """``cpu`` (the fused CPU kernel) or ``torch`` (``F.silu(g) * u``) for these inputs."""
    return cpu_or_torch("FTLIB_SWIGLU_BACKEND", lambda: swiglu_cpu_unsupported(g, u))


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` (same shapes), differentiable in both; see the module docstring for the backends."""
    if swiglu_backend(g, u) == "cpu":
        return swiglu_cpu(g, u)
    return F.silu(g) * u
