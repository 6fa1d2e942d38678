"""Long-context memory: the sequence-chunked MLP, and block checkpoints whose input waits in host memory.

Sequence-chunked MLP: each decoder block's MLP (with the LoRA products inside it) runs over K chunks of
the sequence, forward and backward, so its [T, intermediate] tensors never exist for the whole sequence.

A gated MLP is a function of one token at a time, ``M(x)_t = down(act(gate(x_t)) * up(x_t))``, so
splitting the T tokens into K chunks and concatenating the outputs is the same function, and its
gradients are the sums of the chunks' (the weights') or their concatenation (the input's)::

    y = cat_k M(x_k),      dL/dx = cat_k (dL/dy_k) dM/dx_k,      dL/dW = sum_k (dL/dy_k) dM/dW

What is saved. Forward runs every chunk without saving anything but the input x ([T, H], the
normed residual that autograd kept anyway for the block's own backward); backward recomputes one
chunk at a time under grad mode, back-propagates it and frees it before the next (per-chunk
recomputation, as reentrant activation checkpointing does: the parameters' gradients accumulate
from each chunk's own backward). Per token, in bytes with activations of a bytes (bf16: 2) and
LoRA rank r on the three projections (``peak_saved_bytes`` measures it, tests/test_long_context.py):

    unchunked, at once:  a H (x)  +  4 a I (gate, up, act(gate), act(gate) * up)  +  3 a r  (A's outputs)
    K chunks, at once:   a H      + (4 a I + 3 a r) / K                         (one chunk's, in backward)

so at Llama-3.1-8B sizes (H = 4096, I = 14336, r = 32, bf16) 123,072 -> 8,192 + 114,880 / K bytes a
token: K = 8 keeps 22,552 (at 342k tokens: 42 GB -> 7.7 GB for the layer being back-propagated).
Dropout in an adapter draws its mask from torch's generator: the generator's state before each
chunk is saved and restored for its recomputation, so the mask is the same both times (the masks
differ from an unchunked run's, with the same law). Autocast's state is replayed too.

    chunk_mlp(model, chunks=8)   # every ``*.mlp`` module; state_dict keys unchanged; undo: unchunk_mlp(model)
    chunk_norms(model, chunks=8) # every RMSNorm: its fp32 temporaries for T / K tokens (:func:`chunk_norms`)

The module keeps its identity and children (its class is swapped for a subclass whose forward
chunks, as ``torch.nn.utils.parametrize`` does), so adapters applied before or after, the state
dict and FSDP2 units are as they were.

Offloaded checkpoints (``offload_checkpoints(model)``): with activation checkpointing every
block keeps its input, L a H bytes a token (Llama-3.1-8B: 256 KiB, 87 GB at 342k tokens): the
largest term left once the MLP is chunked. Here each block is checkpointed by the same
recompute-in-backward as the chunks (RNG and autocast replayed), and its input is copied to
pinned host memory on a side stream in forward and back on another in backward, the previous
block's copy starting when a block's backward starts, so the transfer overlaps a block's
recomputation. At 8B sizes a block moves 8 KiB a token each way (0.33 us a token at PCIe 4's
~25 GB/s) against at least 3 x 436 MFLOP a token of recomputation and backward without attention
(2.6 us a token at 500 TFLOP/s), so the copies hide behind the compute; not yet measured on a GPU.

Reference: Liu et al. 2023 ("Blockwise Parallel Transformer": blockwise feed-forward over the
sequence); Unsloth's long-context notes (chunked MLP and offloaded checkpoints).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["chunk_mlp", "chunk_norms", "chunked_apply", "offload_checkpoints", "peak_saved_bytes", "unchunk_mlp",
           "unoffload_checkpoints"]

_CHUNKED: dict[type, type] = {}  # original MLP class -> its chunking subclass


class _ChunkedApply(torch.autograd.Function):
    """y = cat_k fn(x_k) over ``chunks`` pieces of dim -2; saves x only, recomputes chunk by chunk in backward."""

    @staticmethod
    def forward(ctx, x, fn, chunks, *params):
        pieces = [p for p in torch.tensor_split(x, chunks, dim=-2) if p.shape[-2]]
        states, outs = [], []
        ctx.autocast = _autocast_state(x.device)
        for piece in pieces:
            states.append(_rng_state(x.device))
            with torch.no_grad():
                outs.append(fn(piece))
        ctx.fn, ctx.chunks, ctx.states = fn, chunks, states
        ctx.save_for_backward(x)
        return torch.cat(outs, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        pieces = [p for p in torch.tensor_split(x, ctx.chunks, dim=-2) if p.shape[-2]]
        grads = torch.split(grad, [p.shape[-2] for p in pieces], dim=-2)
        dx = []
        for piece, g, state in zip(pieces, grads, ctx.states):  # each chunk's graph is freed before the next
            dx.append(_recompute_backward(ctx.fn, piece, g, state, ctx.autocast, ctx.needs_input_grad[0]))
        return (torch.cat(dx, dim=-2) if ctx.needs_input_grad[0] else None, None, None) + (None,) * (
            len(ctx.needs_input_grad) - 3)


def _recompute_backward(fn, x, grad, state, autocast, need_dx: bool):
    """Run ``fn(x)`` again under grad mode with the RNG state ``state`` and autocast ``(device type,
    enabled, dtype)`` of its forward, back-propagate ``grad`` through it (the parameters' gradients
    accumulate) and return dL/dx (zeros when x needs none but the caller's layout wants a tensor)."""
    dev, enabled, dtype = autocast
    xc = x.detach().requires_grad_(need_dx)
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        _set_rng_state(x.device, state)
        with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
            out = fn(xc)
    if out.requires_grad:
        torch.autograd.backward(out, grad)
    return xc.grad if xc.grad is not None else torch.zeros_like(x)


def _autocast_state(device: torch.device) -> tuple:
    dev = device.type
    return dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


def _rng_state(device: torch.device):
    cpu = torch.get_rng_state()
    return cpu, (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def chunked_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunks: int,
                  params=()) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn`` over ``chunks`` pieces of x's dim -2 (the sequence), saving x only.

    ``params``: the tensors ``fn`` reads that need gradients (passed so autograd runs the backward
    when only they, not x, require grad; their gradients come from the chunks' own backward).
    Without grad mode it is ``cat(fn(x_k))``.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if x.dim() < 2:
        raise ValueError(f"chunked_apply: x must have a sequence dim (-2), got shape {tuple(x.shape)}")
    params = tuple(p for p in params if p.requires_grad)
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return torch.cat([fn(p) for p in torch.tensor_split(x, chunks, dim=-2) if p.shape[-2]], dim=-2)
    return _ChunkedApply.apply(x, fn, chunks, *params)


def _chunked_class(cls: type) -> type:
    if cls not in _CHUNKED:
        def forward(self, x):
            run = super(sub, self).forward
            return chunked_apply(run, x, self.mlp_chunks, tuple(self.parameters()))

        sub = type(f"Chunked{cls.__name__}", (cls,), {"forward": forward, "_unchunked_class": cls,
                                                      "__doc__": f"{cls.__name__} over sequence chunks "
                                                                 f"(ftlib.long_context.chunk_mlp)."})
        _CHUNKED[cls] = sub
    return _CHUNKED[cls]


def _mlps(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name == "mlp" or name.endswith(".mlp")]


def chunk_mlp(model: nn.Module, chunks: int) -> nn.Module:
    """Run every ``*.mlp`` module of ``model`` over ``chunks`` sequence chunks (see the module doc); returns model.

    Calling it again changes K. A model without any ``mlp`` module is refused.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunk_mlp: chunks must be an int >= 1, got {chunks!r}")
    mlps = _mlps(model)
    if not mlps:
        raise ValueError(f"chunk_mlp: {type(model).__name__} has no module named 'mlp' (a decoder block's MLP)")
    for m in mlps:
        base = getattr(type(m), "_unchunked_class", type(m))
        m.__class__ = _chunked_class(base)
        m.mlp_chunks = chunks
    return model


def unchunk_mlp(model: nn.Module) -> nn.Module:
    """Undo :func:`chunk_mlp` and :func:`chunk_norms`: every chunked ``mlp`` and norm gets its own class back."""
    for m in model.modules():
        base = getattr(type(m), "_unchunked_class", None)
        if base is not None:
            m.__class__ = base
            for attr in ("mlp_chunks", "norm_chunks"):
                if attr in m.__dict__:
                    delattr(m, attr)
    return model


class _HostCopy:
    """A block's input waiting in host memory: pinned, copied on a side stream (CUDA); on CPU the tensor
    itself, or a clone when ``copy_cpu`` (which saves nothing and runs the bookkeeping in tests)."""

    _streams: dict = {}  # (device, "d2h" | "h2d") -> side stream

    def __init__(self, x: torch.Tensor, copy_cpu: bool):
        self.device, self.gpu, self.ready = x.device, None, None
        self.prev = None  # weakref to the copy of the block before this one (its backward comes next)
        x = x.detach()
        if x.is_cuda:
            stream = self._stream("d2h")
            stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written on the compute stream
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(x, non_blocking=True)
            x.record_stream(stream)  # the allocator reuses x's memory only after the copy
            self.copied = stream.record_event()
        else:
            self.host, self.copied = (x.clone() if copy_cpu else x), None

    def _stream(self, kind: str):
        key = (self.device, kind)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(self.device)
        return self._streams[key]

    def prefetch(self) -> None:
        """Start copying back (a no-op when started already or on CPU)."""
        if self.gpu is not None or self.host is None:
            return
        if self.copied is None:
            self.gpu = self.host
            return
        stream = self._stream("h2d")
        stream.wait_event(self.copied)
        with torch.cuda.stream(stream):
            self.gpu = self.host.to(self.device, non_blocking=True)
        self.ready = stream.record_event()

    def fetch(self) -> torch.Tensor:
        """The input, back on its device, for the compute stream; the host copy is dropped."""
        self.prefetch()
        x = self.gpu
        if self.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self.ready)
            x.record_stream(compute)
        self.gpu = self.host = None
        return x


class _OffloadedCheckpoint(torch.autograd.Function):
    """y = fn(x) keeping only a host copy of x; backward brings x back (and starts on the previous block's),
    recomputes fn and back-propagates through it."""

    @staticmethod
    def forward(ctx, x, fn, chain, copy_cpu, *params):
        ctx.state, ctx.autocast, ctx.fn = _rng_state(x.device), _autocast_state(x.device), fn
        with torch.no_grad():
            y = fn(x)
        ctx.copy = _HostCopy(x, copy_cpu)
        ctx.copy.prev, chain["last"] = chain.get("last"), weakref.ref(ctx.copy)
        return y

    @staticmethod
    def backward(ctx, grad):
        copy = ctx.copy
        x = copy.fetch()
        prev = copy.prev() if copy.prev is not None else None
        if prev is not None:
            prev.prefetch()  # overlaps this block's recomputation and backward
        dx = _recompute_backward(ctx.fn, x, grad, ctx.state, ctx.autocast, ctx.needs_input_grad[0])
        return (dx if ctx.needs_input_grad[0] else None, None, None, None) + (None,) * (len(ctx.needs_input_grad) - 4)


_OFFLOADED: dict[type, type] = {}  # decoder block class -> its offloaded-checkpoint subclass


def _offloaded_class(cls: type) -> type:
    if cls not in _OFFLOADED:
        def forward(self, x, plan):
            run = super(sub, self).forward
            if self.checkpoint_part is not None:
                raise RuntimeError(f"offload_checkpoints replaces the block's checkpointing; it has checkpoint_part="
                                   f"{self.checkpoint_part!r} (turn set_gradient_checkpointing off)")
            params = tuple(p for p in self.parameters() if p.requires_grad)
            if not torch.is_grad_enabled() or getattr(plan, "kv_cache", None) is not None or not (
                    x.requires_grad or params):
                return run(x, plan)
            return _OffloadedCheckpoint.apply(x, lambda t: run(t, plan), self.offload_chain, self.offload_copy_cpu,
                                              *params)

        sub = type(f"Offloaded{cls.__name__}", (cls,), {"forward": forward, "_unoffloaded_class": cls,
                                                        "__doc__": f"{cls.__name__} checkpointed with its input in "
                                                                   f"host memory (ftlib.long_context)."})
        _OFFLOADED[cls] = sub
    return _OFFLOADED[cls]


_NORMS: dict[type, type] = {}  # norm class -> its chunking subclass


def _chunked_norm_class(cls: type) -> type:
    if cls not in _NORMS:
        def forward(self, x):
            run = super(sub, self).forward
            if x.dim() < 3 or x.shape[1] < 2:
                return run(x)
            return torch.cat([run(p) for p in torch.tensor_split(x, self.norm_chunks, dim=1) if p.shape[1]], dim=1)

        sub = type(f"Chunked{cls.__name__}", (cls,), {"forward": forward, "_unchunked_class": cls,
                                                      "__doc__": f"{cls.__name__} over sequence chunks "
                                                                 f"(ftlib.long_context.chunk_norms)."})
        _NORMS[cls] = sub
    return _NORMS[cls]


def _norms(model: nn.Module) -> list[nn.Module]:
    from .models import RMSNorm

    return [m for m in model.modules() if isinstance(m, RMSNorm)]


def chunk_norms(model: nn.Module, chunks: int) -> nn.Module:
    """Run every ``RMSNorm`` of ``model`` over ``chunks`` chunks of the sequence (dim 1 of [B, T, ...]).

    A norm is row-wise, so the chunks' outputs concatenated are the same numbers; what changes is
    the float32 temporaries of the non-fused (GPU) path: x in fp32 and x r in forward (8 H bytes a
    token), n, g and the input gradient in backward (12 H), for T / K tokens at a time instead of T
    (Llama-3.1-8B: 48 KiB a token, 24 GB at 500k tokens, while a block back-propagates). The saved
    tensors stay the same (x, a view per chunk, and its 1 / rms). Undo: ``unchunk_mlp`` undoes both.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunk_norms: chunks must be an int >= 1, got {chunks!r}")
    norms = _norms(model)
    if not norms:
        raise ValueError(f"chunk_norms: {type(model).__name__} has no RMSNorm")
    for m in norms:
        m.__class__ = _chunked_norm_class(getattr(type(m), "_unchunked_class", type(m)))
        m.norm_chunks = chunks
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "checkpoint_part")]


def offload_checkpoints(model: nn.Module, *, copy_cpu: bool = False) -> nn.Module:
    """Checkpoint every decoder block (modules with a ``checkpoint_part``) with its input in pinned host memory.

    Forward runs each block without saving anything and copies its input to the host on a side
    stream; backward copies it back (the previous block's copy starts as this block's backward
    begins, on a second stream), recomputes the block and back-propagates through it. On the GPU
    a block's input then costs 2 a H bytes a token for the two blocks in flight instead of L a H
    (the "activation offload" rows of ``ftlib.distributed.memory``); the host holds L a H a token,
    pinned. Replaces ``set_gradient_checkpointing`` (which it turns off); combines with
    :func:`chunk_mlp`. CPU tensors stay where they are (``copy_cpu=True`` clones them: tests).
    """
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(f"offload_checkpoints: {type(model).__name__} has no decoder blocks (modules with a "
                         f"checkpoint_part)")
    chain: dict = {}
    for m in blocks:
        base = getattr(type(m), "_unoffloaded_class", type(m))
        m.__class__ = _offloaded_class(base)
        m.checkpoint_part = None
        m.offload_chain, m.offload_copy_cpu = chain, copy_cpu
    return model


def unoffload_checkpoints(model: nn.Module) -> nn.Module:
    """Undo :func:`offload_checkpoints` (blocks are then not checkpointed)."""
    for m in _blocks(model):
        base = getattr(type(m), "_unoffloaded_class", None)
        if base is not None:
            m.__class__ = base
            del m.offload_chain, m.offload_copy_cpu
    return model


def peak_saved_bytes(step: Callable[[], object]) -> int:
    """The largest number of bytes autograd held saved at once while ``step()`` ran (forward and backward).

    Every tensor saved for backward goes through ``saved_tensors_hooks``; one storage counts once
    (the views F.linear saves of one input), parameters count not, and a storage counts until the
    last thing that saved it is freed (backward drops a node's saved tensors after using them).
    Recomputations that run under the caller's hooks (``chunked_apply``'s) are counted when they save.
    """
    live: dict[int, list] = {}  # storage ptr -> [bytes, holders alive]
    state = {"now": 0, "peak": 0}

    class _Held:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def release(ptr):
        entry = live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            state["now"] -= entry[0]
            del live[ptr]

    def pack(t):
        if isinstance(t, nn.Parameter) or (t._base is not None and isinstance(t._base, nn.Parameter)):
            return t
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in live:
            live[ptr] = [s.nbytes(), 0]
            state["now"] += s.nbytes()
            state["peak"] = max(state["peak"], state["now"])
        live[ptr][1] += 1
        held = _Held(t)
        weakref.finalize(held, release, ptr)
        return held

    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        step()
    return state["peak"]
