"""Activation offloading: keep the tensors saved for backward in pinned CPU memory instead of on the GPU.

Autograd saves activations in the forward pass for use in the backward pass; with
``torch.autograd.graph.saved_tensors_hooks`` every saved tensor goes through ``pack`` when it is
saved and ``unpack`` when backward needs it. Here ``pack`` starts a copy of a large CUDA tensor
into pinned host memory on a side stream (``d2h``) and hands autograd a small handle; the GPU
memory is released as soon as the forward no longer needs the tensor and the copy is done
(``record_stream`` tells the allocator). In backward, ``unpack`` of one handle also starts copying
back the next ``prefetch`` handles (the ones saved just before it, which backward reaches next)
on a second side stream (``h2d``), so transfers overlap with the backward compute; the compute
stream waits only on the event of the tensor it needs now.

Skipped (kept as they are): tensors smaller than ``min_bytes`` (moving them costs more in launch
latency than they save), parameters and views of parameters (they stay on the GPU anyway), and
tensors not on a CUDA device: on CPU the hooks return each tensor unchanged, a correct no-op
(``offload_cpu_tensors=True`` copies CPU tensors through the same bookkeeping instead, which saves
nothing and exists so the logic runs in tests without a GPU). A tensor saved by several ops (the
normed input of q/k/v and of their LoRA factors) is moved once and brought back once per use
count.

Per block, combined with activation checkpointing: :func:`offload_modules` installs the hooks
around chosen modules only (forward pre-hook pushes, forward hook pops, also on an exception).
Non-reentrant checkpointing installs its own hooks inside a checkpointed region, which win there,
so e.g. ``model.set_gradient_checkpointing`` on most blocks plus ``offload_modules`` on the others,
or ``part="attn"`` on a block whose MLP activations are offloaded, each do what they say.

Memory and bandwidth, Llama-3-8B (H = 4096, I = 14336, 32 layers, GQA 32/8, bf16, LoRA r = 16 on
every linear layer, no dropout), counted with :func:`saved_bytes_per_token` on ftlib's decoder block
(``benchmarks/bench_offload.py --count-8b``): a block saves 181,128 bytes per token with the
PyTorch reference attention (plus its T^2 scores), of which 28,800 are the reference's fp32 copies
of q/k/v; flash-attn saves bf16 q, k, v and the log-sum-exp instead (12,416), so on a GPU a block
saves about 165 KB per token, all but ~0.2% of it in tensors above the 1 MiB threshold at 8k
tokens: 5.3 MB per token for the 32 blocks, 43 GB for an 8k-token micro-batch. Offloading moves
those bytes to the host in forward and back in backward. A block's forward costs about
2 x 218M = 436 MFLOP per token (plus ~67 for causal attention at 8k); at 400 TFLOP/s (an H100 at
~40% of peak) that is ~1.25 us, so hiding the copies of every block needs ~130 GB/s each way,
about 2.6x what PCIe 5.0 x16 gives (~50 GB/s per direction measured, 64 theoretical; PCIe 4.0 ~25).
So offload about a third of the blocks on PCIe 5.0 (a sixth on 4.0) and checkpoint the rest, or
offload everything when the step is memory-bound rather than compute-bound (long sequences on a
small GPU). Host memory: the offloaded bytes, pinned.

References: ``torch.autograd.graph.save_on_cpu`` (the synchronous baseline, every tensor);
torchtune's ``OffloadActivations`` (streams and a size threshold); Rhu et al. 2016 "vDNN".
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["ActivationOffload", "offload_modules", "saved_bytes_per_token"]


def _identity(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(root tensor, key): equal keys with a live root mean the same elements. F.linear on a [B, T, H]
    input saves a fresh [B*T, H] view per call, so q/k/v (and their LoRA A) save three view objects
    of one normed input; keying on the root tensor (the view's ``_base``) and the view's geometry
    moves it once. A freed tensor's address can be reused, so the root is checked through a weakref."""
    root = t._base if t._base is not None else t
    return root, (id(root), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)


class _Handle:
    """What autograd holds instead of an offloaded tensor."""

    __slots__ = ("cpu", "device", "d2h", "gpu", "h2d", "uses", "unpacked", "pos", "__weakref__")

    def __init__(self, cpu: torch.Tensor, device: torch.device, d2h, pos: int):
        self.cpu, self.device, self.d2h, self.pos = cpu, device, d2h, pos
        self.gpu: torch.Tensor | None = None  # brought back (or being brought back)
        self.h2d = None
        self.uses, self.unpacked = 1, 0


class ActivationOffload:
    """``with ActivationOffload(): loss = model(batch)`` then ``loss.backward()`` outside the block.

    ``min_bytes``: smaller saved tensors stay where they are (default 1 MiB); ``prefetch``: how many
    handles to bring back ahead of the one backward asks for; ``use_streams=False`` copies on the
    compute stream (no overlap; for debugging). ``stats`` counts what was moved and kept.
    """

    def __init__(self, *, min_bytes: int = 1 << 20, prefetch: int = 2, use_streams: bool = True,
                 offload_cpu_tensors: bool = False):
        if min_bytes < 0 or prefetch < 0:
            raise ValueError(f"min_bytes and prefetch must be >= 0, got {min_bytes}, {prefetch}")
        self.min_bytes, self.prefetch, self.use_streams = int(min_bytes), int(prefetch), use_streams
        self.offload_cpu_tensors = offload_cpu_tensors
        self._order: list[weakref.ref] = []  # handles in pack order (backward walks it downwards)
        self._live: dict[tuple, tuple] = {}  # (id, version) -> (weakref to the tensor, to its handle)
        self._compact_at = 256
        self._streams: dict[torch.device, tuple] = {}
        self._ctx: list = []
        self.stats = {"offloaded_tensors": 0, "offloaded_bytes": 0, "kept_tensors": 0, "kept_bytes": 0,
                      "prefetched": 0, "fetched_on_demand": 0}

    # -- the hooks --------------------------------------------------------------------------------

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A fresh ``saved_tensors_hooks`` context using this offloader."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> ActivationOffload:
        ctx = self.hooks()
        ctx.__enter__()
        self._ctx.append(ctx)
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.pop().__exit__(*exc)

    def _keep(self, t: torch.Tensor) -> bool:
        if t.device.type != "cuda" and not (self.offload_cpu_tensors and t.device.type == "cpu"):
            return True
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.layout != torch.strided:
            return True
        return t.numel() * t.element_size() < self.min_bytes or t.numel() == 0

    def _pack(self, t: torch.Tensor):
        if self._keep(t):
            self.stats["kept_tensors"] += 1
            self.stats["kept_bytes"] += t.numel() * t.element_size()
            return t
        root, key = _identity(t)
        entry = self._live.get(key)
        if entry is not None:
            root_ref, h_ref = entry
            h = h_ref()
            if root_ref() is root and h is not None:  # saved again by another op: one copy, one more use
                h.uses += 1
                return h
        h = self._offload(t)
        self._live[key] = (weakref.ref(root), weakref.ref(h))
        self._order.append(weakref.ref(h))
        self.stats["offloaded_tensors"] += 1
        self.stats["offloaded_bytes"] += t.numel() * t.element_size()
        if len(self._order) >= self._compact_at:  # drop dead entries; amortised O(1) per pack
            self._compact()
            self._compact_at = 2 * len(self._order) + 256
        return h

    def _unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        if h.gpu is None:
            self.stats["fetched_on_demand"] += 1
            self._fetch(h)
        t = self._ready(h)
        for nxt in self._next(h.pos):  # backward reaches these next
            self._fetch(nxt)
            self.stats["prefetched"] += 1
        h.unpacked += 1
        if h.unpacked >= h.uses:  # no other saver still needs the GPU copy: let it go after use
            h.gpu = h.h2d = None
        return t

    def _next(self, pos: int):
        out, i = [], pos - 1
        while i >= 0 and len(out) < self.prefetch and i >= pos - 8 * max(self.prefetch, 1):
            h = self._order[i]()
            if h is not None and h.gpu is None and h.unpacked < h.uses:
                out.append(h)
            i -= 1
        return out

    def _compact(self) -> None:
        self._live = {k: (tr, hr) for k, (tr, hr) in self._live.items() if tr() is not None and hr() is not None}
        keep = [r for r in self._order if r() is not None]
        for i, r in enumerate(keep):
            r().pos = i
        self._order = keep

    # -- transport --------------------------------------------------------------------------------

    def _cuda_streams(self, device: torch.device):
        if device not in self._streams:
            if self.use_streams:
                self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            else:
                cur = torch.cuda.current_stream(device)
                self._streams[device] = (cur, cur)
        return self._streams[device]

    def _offload(self, t: torch.Tensor) -> _Handle:
        pos = len(self._order)
        if t.device.type != "cuda":  # offload_cpu_tensors: the same bookkeeping, a plain copy
            return _Handle(t.detach().clone(), t.device, None, pos)
        d2h, _ = self._cuda_streams(t.device)
        compute = torch.cuda.current_stream(t.device)
        d2h.wait_stream(compute)  # t is complete once the work queued so far is
        with torch.cuda.stream(d2h):
            cpu = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            cpu.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(d2h)
        t.record_stream(d2h)  # the allocator reuses t's memory only after the copy is done
        return _Handle(cpu, t.device, ev, pos)

    def _fetch(self, h: _Handle) -> None:
        if h.device.type != "cuda":
            h.gpu = h.cpu.clone()
            return
        _, h2d = self._cuda_streams(h.device)
        h2d.wait_event(h.d2h)
        with torch.cuda.stream(h2d):
            h.gpu = torch.empty(h.cpu.shape, dtype=h.cpu.dtype, device=h.device)
            h.gpu.copy_(h.cpu, non_blocking=True)
            h.h2d = torch.cuda.Event()
            h.h2d.record(h2d)

    def _ready(self, h: _Handle) -> torch.Tensor:
        t = h.gpu
        if h.device.type == "cuda":
            compute = torch.cuda.current_stream(h.device)
            compute.wait_event(h.h2d)
            t.record_stream(compute)  # allocated on the h2d stream, used (and freed) on the compute stream
        return t


def offload_modules(modules: Iterable[nn.Module], offload: ActivationOffload | None = None, **kwargs):
    """Offload the activations saved inside each of ``modules`` (e.g. ``model.model.layers[-8:]``).

    Returns ``(offload, remove)``: the :class:`ActivationOffload` in use (made from ``kwargs`` when
    not given) and a function that removes the hooks. Hooks act only when gradients are enabled.
    """
    off = offload if offload is not None else ActivationOffload(**kwargs)
    handles = []
    for mod in modules:
        stack: list = []

        def pre(module, args, stack=stack):
            if torch.is_grad_enabled():
                ctx = off.hooks()
                ctx.__enter__()
                stack.append(ctx)
            else:
                stack.append(None)

        def post(module, args, output, stack=stack):
            ctx = stack.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))

    def remove() -> None:
        for h in handles:
            h.remove()

    return off, remove


def saved_bytes_per_token(module: nn.Module, inputs_for, tokens: tuple[int, int] = (64, 128),
                          min_bytes_at: int | None = None) -> dict:
    """Bytes saved for backward per token by ``module(*inputs_for(T))``, from two token counts.

    Counts every distinct saved tensor except parameters (through pack hooks; only the forward runs,
    nothing is moved). Saved bytes are ``a T + b T^2`` (the T^2 part: a reference attention's scores),
    solved from the two counts; returns ``{"per_token": a, "quadratic": b}`` and, with
    ``min_bytes_at`` (tokens per micro-batch), the per-token bytes in tensors that would reach the
    offload threshold of 1 MiB at that size. Works on the ``meta`` device (no memory, any size).
    """
    def count(t_len: int):
        seen: dict[tuple, torch.Tensor] = {}  # a tensor saved by several ops (or views) is stored once

        def pack(t):
            if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
                seen.setdefault(_identity(t)[1], t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(*inputs_for(t_len))
        sizes = [t.numel() * t.element_size() for t in seen.values()]
        return sum(sizes), sizes

    (t1, t2) = tokens
    c1, s1 = count(t1)
    c2, _ = count(t2)
    # c = a t + b t^2  ->  b = (c2/t2 - c1/t1) / (t2 - t1)
    b = (c2 / t2 - c1 / t1) / (t2 - t1)
    a = c1 / t1 - b * t1
    out = {"per_token": a, "quadratic": b}
    if min_bytes_at is not None:
        big = sum(x for x in s1 if x / t1 * min_bytes_at >= (1 << 20))  # linear-in-T tensors only
        out["per_token_offloadable"] = big / t1 - b * t1
    return out
