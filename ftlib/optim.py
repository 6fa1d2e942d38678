"""Optimizer wrapper: parameter groups, mixed precision, token-weighted accumulation, NaN trace.

Works with any ``torch.optim`` optimizer. One optimizer step closes one *accumulation window*
of micro-batches. The loss of a window is the mean over every target token in it, on every
rank::

    L = (1 / N) * sum_{ranks r} sum_{micro-batches m} S_{r,m},    N = sum_{r,m} n_{r,m}

where S is a micro-batch's *summed* token loss and n its target-token count (see
``ftlib.losses``). Averaging per micro-batch (mean of means) weights a short micro-batch's
tokens more than a long one's and makes the result depend on how the window is split; that is
the accumulation bug this wrapper exists to avoid.

Normalisation. ``backward(loss_sum, num_tokens)`` back-propagates the raw sum and counts
tokens; ``prepare_grads()`` (called by ``step()``) multiplies every gradient once by
``R / N``, with N all-reduced over ranks and R the world size when DDP/FSDP average gradients
over ranks (``grads_averaged=True``, their default) or 1 when they sum. Deferring the divide
means the loop never has to look ahead at the window to count its tokens, and it costs one
scalar all-reduce and one fused multiply per optimizer step. When the count is known up front
(packed batches of fixed size, or a loader that counts ahead) ``set_window_tokens(n_local)``
may be called before the first backward instead: the losses are then scaled by R / N before
backward, which keeps fp16 activation gradients in the same range as with a mean loss.

Mixed precision. ``precision="bf16"``: ``autocast()`` runs the forward in bf16, master
weights and gradients stay in their own dtype, no loss scaling. ``precision="fp16"``: dynamic
loss scaling on ``torch.amp.GradScaler`` (``ShardedGradScaler`` when torch.distributed is
initialised, so every rank agrees on overflow): the loss is multiplied by the scale s before
backward; on overflow the step is skipped and s <- s * backoff; after ``growth_interval``
clean steps s <- s * growth (Micikevicius et al. 2018, "Mixed Precision Training").

Precision fallback. ``precision="fp16", fallback="bf16" | "fp32"``: when ``fallback_after`` (K)
of the last ``fallback_window`` (W) optimizer steps were skipped for overflow, the wrapper switches
to the fallback from the next step on: ``autocast()`` uses the new dtype and loss scaling stops.
It is logged once (warning on the ``ftlib.optim`` logger), shown in ``StepResult.precision`` and
kept in ``state_dict()`` with the skip history, so a resumed run continues in the fallen-back
precision and falls back at the same step as an uninterrupted one. The loss scale's calibration
costs about log2(init_scale / the scale that fits) skips at the start (a few with token-summed
losses), so K must exceed it; the default (10 of 100) does. Parameter dtypes are the user's: the
fallback changes the autocast dtype only. ``precision="auto"`` picks bf16 on a GPU with native bf16
(Ampere and later) and on CPU, else fp16 with fallback to fp32 (e.g. V100, T4).

Non-finite gradients (any precision): the step is skipped and counted. So is a window without a
target token on any rank (every label -100): stepping there would move the weights through
momentum and weight decay alone. The check covers every
gradient the optimizer steps, whatever the clipper: it is the global norm before clipping (over
every shard, so every rank skips together), taken from the clipper's ``norm_before`` when the
clipper declares ``reports_global_norm`` (every ftlib clipper; AGC's ``exclude`` and per-layer
parameters without a bound are counted too) and computed here otherwise. Norms accumulate in
float32, or float64 when a gradient is float64.

Names: clippers that match parameter names (``PerLayerClipper``, ``AGCClipper(exclude=...)``)
get ``(name, tensor)`` pairs, named by the groups' ``param_names`` (``param_groups`` sets them)
or, for groups without them, by ``model=``'s ``named_parameters()``; a parameter with neither
is passed unnamed, and those clippers refuse it (TypeError) instead of matching nothing. A
``ftlib.nan_trace.NanTrace`` passed as ``nan_trace=`` (off by default) names the first module whose forward output or gradient went non-finite.

DDP ``no_sync`` / FSDP2 ``set_requires_gradient_sync``: wrap each micro-batch in
``grad_sync(model, enabled=is_last_micro_batch)`` so only the last backward of a window
communicates.
"""

from __future__ import annotations

import logging
import math
import re
from collections import deque
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ftlib._dist import get_world_size
from ftlib.clip import grad_norm, local_tensor
from ftlib.nan_trace import NanTrace

__all__ = ["StepResult", "TrainOptimizer", "make_adamw", "param_groups", "resolve_precision"]

_PRECISIONS = ("fp32", "bf16", "fp16")
_FALLBACKS = ("bf16", "fp32")
log = logging.getLogger("ftlib.optim")


def _native_bf16(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu"  # CPU autocast's own dtype


def resolve_precision(device_type: str, fallback: str | None = None) -> tuple[str, str | None]:
    """``precision="auto"``: (bf16, None) where the device has native bf16, else (fp16, fallback or fp32)."""
    if _native_bf16(device_type):
        return "bf16", None
    return "fp16", fallback or "fp32"


def _check_lr(lr: float) -> float:
    lr = float(lr)
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"learning rate must be finite and >= 0, got {lr}")
    return lr


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def param_groups(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    no_decay_embeddings: bool = False,
    lora_plus_ratio: float | None = None,
    no_decay: Iterable[str] = (),
) -> list[dict]:
    """Split trainable parameters into optimizer groups.

    No weight decay for: tensors with fewer than 2 dims (biases, norm gains), parameters of
    norm modules, DoRA magnitudes (``lora_magnitude_vector`` in the name), embeddings when
    ``no_decay_embeddings``, and names matching any regex in ``no_decay``. With
    ``lora_plus_ratio`` (LoRA+, Hayou et al. 2024), parameters named ``lora_B`` get
    ``lr * lora_plus_ratio``. Each group carries ``param_names`` and ``lr_multiplier``.
    """
    lr = _check_lr(lr)
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if lora_plus_ratio is not None and not lora_plus_ratio > 0:
        raise ValueError(f"lora_plus_ratio must be > 0, got {lora_plus_ratio}")
    patterns = [re.compile(p) for p in no_decay]
    groups: dict[tuple[bool, bool], dict] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue  # frozen, or tied to a parameter already placed
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            decay = not (
                p.ndim < 2
                or _is_norm(module)
                or "lora_magnitude_vector" in name
                or (no_decay_embeddings and isinstance(module, nn.Embedding))
                or any(r.search(name) for r in patterns)
            )
            plus = lora_plus_ratio is not None and "lora_B" in name
            key = (decay, plus)
            if key not in groups:
                mult = float(lora_plus_ratio) if plus else 1.0
                groups[key] = {
                    "params": [],
                    "param_names": [],
                    "lr": lr * mult,
                    "lr_multiplier": mult,
                    "weight_decay": float(weight_decay) if decay else 0.0,
                }
            groups[key]["params"].append(p)
            groups[key]["param_names"].append(name)
    if not groups:
        raise ValueError("model has no trainable parameters (all requires_grad=False)")
    return [groups[k] for k in sorted(groups)]


def make_adamw(
    params,
    *,
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    impl: str = "auto",
) -> torch.optim.Optimizer:
    """AdamW with the fastest implementation available.

    ``impl``: ``auto`` (fused kernel when every parameter is on CUDA, multi-tensor foreach
    otherwise), ``fused``, ``foreach``, ``loop``, or ``8bit`` (bitsandbytes AdamW8bit, block-wise
    quantised optimizer state; Dettmers et al. 2022).
    """
    lr = _check_lr(lr)
    params = list(params)
    tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
    if impl == "8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ImportError("make_adamw(impl='8bit') needs bitsandbytes: pip install bitsandbytes") from e
        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if impl == "auto":
        impl = "fused" if tensors and all(t.device.type == "cuda" for t in tensors) else "foreach"
    if impl not in ("fused", "foreach", "loop"):
        raise ValueError(f"unknown AdamW impl {impl!r}; choose auto, fused, foreach, loop or 8bit")
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        fused=impl == "fused" or None,
        foreach=impl == "foreach" or (False if impl == "loop" else None),
    )


@dataclass
class StepResult:
    """What one ``TrainOptimizer.step()`` did (plain Python values, ready to log)."""

    skipped: bool  # no update: gradients were non-finite, or the window had no target token
    loss: float  # mean token loss over the window, all ranks (NaN when it had no target token)
    num_tokens: int  # target tokens in the window, all ranks
    grad_norm: float  # global gradient norm before clipping (after normalisation)
    loss_scale: float | None  # fp16 loss scale after this step's update
    clip: dict[str, float] | None  # the clipper's stats
    nan_source: str | None  # NanTrace's finding when the step was skipped
    precision: str | None = None  # the precision of the next step (changes once on an fp16 fallback)
    skip_reason: str | None = None  # "non-finite gradients" or "no target tokens" when skipped


def _host_value(t: torch.Tensor) -> float:
    """A CPU tensor's value: a read with no device sync (what chunked_cross_entropy's count is on CUDA too)."""
    return float(t)


class TrainOptimizer:
    """Wrap a ``torch.optim`` optimizer for accumulation, precision and skip-on-non-finite.

    Loop::

        opt = TrainOptimizer(make_adamw(param_groups(model, lr=2e-4)), precision="bf16")
        for window in windows:                       # one window = one optimizer step
            for i, batch in enumerate(window):
                with opt.grad_sync(model, enabled=i == len(window) - 1):  # DDP/FSDP2: sync once
                    with opt.autocast():
                        logits = model(batch["input_ids"])
                    opt.backward(*cross_entropy_sum(logits, batch["labels"]))  # (loss_sum, n_tokens)
            result = opt.step(clipper)               # normalise by tokens, clip, step, zero grads
            sched.step()

    ``step()`` zeroes gradients: it closes the window. ``model`` (optional) names the parameters
    of groups that carry no ``param_names``, for clippers that match names.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        precision: str = "fp32",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        grads_averaged: bool = True,
        process_group=None,
        nan_trace: NanTrace | None = None,
        model: nn.Module | None = None,
        fallback: str | None = None,
        fallback_after: int = 10,
        fallback_window: int = 100,
    ):
        if precision not in _PRECISIONS + ("auto",):
            raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(_PRECISIONS)} or auto")
        for g in optimizer.param_groups:
            _check_lr(g["lr"])
        # names for groups without param_names (clippers match names); tied parameters keep their first name
        self._model_names = {} if model is None else {
            id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        if first is None:
            raise ValueError("optimizer has no parameters")
        self.device_type = local_tensor(first).device.type
        if precision == "auto":
            precision, fallback = resolve_precision(self.device_type, fallback)
        self._init_fallback(precision, fallback, fallback_after, fallback_window)
        self.optimizer, self.precision = optimizer, precision
        self.grads_averaged, self.process_group, self.nan_trace = grads_averaged, process_group, nan_trace
        self.scaler = None
        if precision == "fp16":
            if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
                raise ValueError(
                    "fp16 loss scaling needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                    f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}"
                )
            kw = dict(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
            )
            if self._world() > 1:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(self.device_type, process_group=process_group, **kw)
            else:
                self.scaler = torch.amp.GradScaler(self.device_type, **kw)
        self.steps = 0  # updates applied
        self.skipped_steps = 0  # windows skipped: non-finite gradients or no target token
        self._reset_window()

    # -- precision fallback ---------------------------------------------------------------

    def _init_fallback(self, precision: str, fallback: str | None, after: int, window: int) -> None:
        if fallback is not None:
            if precision != "fp16":
                raise ValueError(f"fallback={fallback!r} applies to precision='fp16' (or 'auto'), not {precision!r}")
            if fallback not in _FALLBACKS:
                raise ValueError(f"unknown fallback {fallback!r}; choose one of {', '.join(_FALLBACKS)}")
            if fallback == "bf16" and not _native_bf16(self.device_type):
                raise ValueError(f"fallback='bf16' but this {self.device_type} device has no native bf16; "
                                 "use fallback='fp32'")
            if not (isinstance(after, int) and isinstance(window, int) and 1 <= after <= window):
                raise ValueError(f"need 1 <= fallback_after <= fallback_window (integers), got {after}, {window}")
        self.requested_precision, self.fallback = precision, fallback
        self.fallback_after, self.fallback_window = after, window
        self._skip_calls: deque[int] = deque()  # step() call indices of recent skips (within the window)
        self.fell_back_at: int | None = None  # index of the first step() call in the fallback precision

    def _note_skip(self, call: int) -> None:
        """Record a skipped step() call; switch precision at the K-th skip within the last W calls."""
        if self.fallback is None or self.fell_back_at is not None:
            return
        self._skip_calls.append(call)
        while self._skip_calls and self._skip_calls[0] <= call - self.fallback_window:
            self._skip_calls.popleft()
        if len(self._skip_calls) >= self.fallback_after:
            scale = self.scaler.get_scale() if self.scaler is not None else None
            self._fall_back(call + 1)
            log.warning("TrainOptimizer: %d of the last %d steps overflowed in fp16 (loss scale now %s); "
                        "switching to %s without loss scaling from step %d on",
                        len(self._skip_calls), self.fallback_window, scale, self.fallback, call + 1)

    def _fall_back(self, at: int) -> None:
        self.precision, self.scaler, self.fell_back_at = self.fallback, None, at

    # -- window bookkeeping ---------------------------------------------------------------

    def _reset_window(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None  # the counts given as device tensors, summed
        self._host_tokens = 0.0  # the counts given as numbers or CPU tensors (known without a device sync)
        self._micro = 0  # backward() calls in this window
        self._host_total: float | None = None  # one process, every count on the host: the window's tokens
        self._pre_factor: float | None = None  # R / N when set_window_tokens was called
        self._window_local: int | None = None
        self._totals: torch.Tensor | None = None  # [tokens, loss_sum] over all ranks
        self._prepared = False

    def _world(self) -> int:
        return get_world_size(self.process_group)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._world() > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.process_group)
        return t

    def _params(self) -> list:
        """``(name or None, parameter)`` for every parameter the optimizer steps."""
        named = []
        for g in self.optimizer.param_groups:
            # param_names (from param_groups()) let name-matching clippers work through step()
            names = g.get("param_names") or [self._model_names.get(id(p)) for p in g["params"]]
            named.extend(zip(names, g["params"]))
        return named

    def autocast(self):
        """The forward-pass autocast context for this precision (a no-op for fp32)."""
        if self.precision == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    @contextmanager
    def grad_sync(self, model: nn.Module, enabled: bool):
        """Skip DDP / FSDP2 gradient communication in this block unless ``enabled``.

        Use ``enabled=True`` for the last micro-batch of a window, False for the others.
        """
        if enabled:
            yield
        elif hasattr(model, "no_sync"):  # DistributedDataParallel
            with model.no_sync():
                yield
        elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2 fully_shard
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:  # a plain module: nothing is synchronised anyway
            yield

    def set_window_tokens(self, num_tokens: int) -> None:
        """Declare this rank's target-token count for the coming window before its first backward."""
        if self._micro:
            raise RuntimeError("set_window_tokens() must come before the window's first backward()")
        if int(num_tokens) < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self._window_local = int(num_tokens)
        total = self._all_reduce(torch.tensor([float(num_tokens)], dtype=torch.float64, device=self._comm_device()))
        world = self._world() if self.grads_averaged else 1
        self._pre_factor = world / max(float(total[0]), 1.0)

    def _comm_device(self) -> torch.device:
        import torch.distributed as dist

        if self._world() > 1 and dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return local_tensor(self.optimizer.param_groups[0]["params"][0]).device

    def backward(self, loss_sum: torch.Tensor, num_tokens) -> None:
        """Back-propagate one micro-batch's summed token loss; count its target tokens."""
        if self._prepared:
            raise RuntimeError("backward() after prepare_grads(): call step() to close the window first")
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.ndim != 0:
            raise ValueError("loss_sum must be a 0-d tensor: the summed (not averaged) token loss")
        on_host = isinstance(num_tokens, (int, float)) or (isinstance(num_tokens, torch.Tensor)
                                                             and num_tokens.device.type == "cpu")
        n = torch.as_tensor(num_tokens, device="cpu" if on_host else loss_sum.device).to(torch.float64)
        if n.ndim != 0:
            raise ValueError(f"num_tokens must be a scalar, got shape {tuple(n.shape)}")
        loss = loss_sum if self._pre_factor is None else loss_sum * self._pre_factor
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        s = loss_sum.detach().to(torch.float64)
        self._loss_sum = s if self._loss_sum is None else self._loss_sum + s
        if on_host:
            self._host_tokens += _host_value(n)
        else:
            self._tokens = n if self._tokens is None else self._tokens + n
        self._micro += 1

    def prepare_grads(self) -> None:
        """Unscale (fp16) and divide gradients by the window's token count; idempotent.

        ``step()`` calls it; call it yourself to inspect or clip gradients before ``step()``.
        """
        if self._prepared:
            return
        if self._micro == 0:
            raise RuntimeError("no backward() in this window: nothing to step on")
        if self._window_local is not None:
            counted = round(self._host_tokens + (float(self._tokens) if self._tokens is not None else 0.0))
            if counted != self._window_local:
                msg = f"set_window_tokens({self._window_local}) but backward() calls counted {counted} tokens"
                self.zero_grad()  # drop the mis-normalised window
                raise ValueError(msg)
        if self._tokens is None and self._world() == 1:
            # every count on the host and no other rank: the window's tokens are known without a read,
            # and the loss sum joins step()'s one read of the norm and the clipper's statistics
            self._host_total = self._host_tokens
        else:
            tokens = self._host_tokens if self._tokens is None else self._tokens + self._host_tokens
            dev = self._comm_device()
            totals = torch.stack([torch.as_tensor(tokens, dtype=torch.float64).to(dev), self._loss_sum.to(dev)])
            self._totals = self._all_reduce(totals)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self._pre_factor is None:
            world = self._world() if self.grads_averaged else 1
            if self._host_total is not None:  # a Python number: no host-to-device copy
                factor = world / max(self._host_total, 1.0)
            else:
                factor = (world / self._totals[0].clamp(min=1.0)).double()
            by_bucket: dict = {}
            for _, p in self._params():
                if p.grad is not None:
                    g = local_tensor(p.grad)
                    by_bucket.setdefault((g.device, g.dtype == torch.float64), []).append(g)
            for (device, f64), grads in by_bucket.items():
                torch._foreach_mul_(grads, factor if isinstance(factor, float)
                                    else factor.to(device, torch.float64 if f64 else torch.float32))
        self._prepared = True

    def step(self, clipper=None) -> StepResult:
        """Normalise, clip (``clipper(named_params)``), update unless skipped, zero grads.

        A window is skipped (no update, counted in ``skipped_steps``, ``StepResult.skip_reason``
        says why) when its gradients are non-finite, or when it has no target token on any rank:
        an optimizer step there would still move the weights (momentum, weight decay) without a
        loss to follow, and its loss is undefined (``StepResult.loss`` is NaN). Only non-finite
        windows count towards the fp16 fallback, and the clipper is not called on an empty window
        (a clipper with a norm history would absorb its zero gradient norm).
        """
        self.prepare_grads()
        named = self._params()
        params = [p for _, p in named]
        # Host reads (device syncs on CUDA): the window's totals here, before the clipper (not called
        # on an empty window), then the norm and the clipper's statistics together below: two a step.
        # One process with its counts on the host (chunked_cross_entropy's): the totals are known, and
        # the loss sum is read with the norm: one a step
        if self._host_total is not None:
            tokens, loss_sum = self._host_total, None
        else:
            tokens, loss_sum = self._totals.double().tolist()
        empty = tokens == 0.0  # all ranks agree: the count is all-reduced
        if empty:
            norm, clip = grad_norm(params), None
        elif clipper is not None and getattr(clipper, "reports_global_norm", False):
            clip = clipper([(n, p) if n is not None else p for n, p in named])
            norm = clip.norm_before  # the norm of every gradient it was given: all of them
        else:
            norm = grad_norm(params)  # before clipping: the finiteness check sees every gradient
            clip = clipper([(n, p) if n is not None else p for n, p in named]) if clipper is not None else None
        read = norm.double().reshape(1)
        if clip is not None:
            read = torch.cat([read, clip.stacked().to(read.device)])
        if loss_sum is None:
            read = torch.cat([read, self._loss_sum.to(read.device, torch.float64).reshape(1)])
            *read_values, loss_sum = read.tolist()
        else:
            read_values = read.tolist()
        norm_v, *clip_values = read_values
        non_finite = not math.isfinite(norm_v)
        skipped = non_finite or empty
        skip_reason = "non-finite gradients" if non_finite else "no target tokens" if empty else None
        if skipped:
            self.skipped_steps += 1
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()
        if not skipped:
            self.steps += 1
        scale = None
        if self.scaler is not None:
            self.scaler.update()  # closes the scaler's iteration (unscale_ ran in prepare_grads)
            scale = float(self.scaler.get_scale())
        if non_finite:
            self._note_skip(self.steps + self.skipped_steps - 1)
        nan_source = None
        if self.nan_trace is not None:
            nan_source = self.nan_trace.first if non_finite else None
            self.nan_trace.reset()
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()
        return StepResult(
            skipped=skipped,
            loss=loss_sum / tokens if tokens > 0 else float("nan"),
            num_tokens=int(round(tokens)),
            grad_norm=norm_v,
            loss_scale=scale,
            clip=dict(zip(clip.names(), clip_values)) if clip is not None else None,
            nan_source=nan_source,
            precision=self.precision,
            skip_reason=skip_reason,
        )

    def zero_grad(self) -> None:
        """Drop the current window (gradients and counts) without stepping."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None and self._prepared:
            self.scaler.update()  # unscale_ happened: close the scaler's iteration too
        self._reset_window()

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Optimizer state, loss scaler state and counters (call between windows)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "precision": self.precision,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "fallback": {
                "requested_precision": self.requested_precision,
                "to": self.fallback,
                "skip_calls": list(self._skip_calls),
                "fell_back_at": self.fell_back_at,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"optimizer", "scaler", "precision", "steps", "skipped_steps"} - set(state)
        if missing:
            raise KeyError(f"TrainOptimizer state is missing {sorted(missing)}")
        fb = state.get("fallback") or {}
        if (fb.get("fell_back_at") is not None and self.fallback is not None and self.fell_back_at is None
                and state["precision"] == self.fallback and fb.get("requested_precision") == self.precision):
            self._fall_back(int(fb["fell_back_at"]))  # the saved run had fallen back: continue in its precision
            log.info("TrainOptimizer: resuming in %s (fell back from fp16 at step %d)", self.precision, self.fell_back_at)
        if state["precision"] != self.precision:
            fell = fb.get("fell_back_at")
            if fell is not None and fb.get("requested_precision") == self.precision:
                raise ValueError(
                    f"state was saved with precision={state['precision']!r}: the run started in "
                    f"{fb.get('requested_precision')} and fell back to {state['precision']} at step {fell}; this "
                    f"wrapper has fallback={self.fallback!r}. Resume it with TrainOptimizer(..., "
                    f"precision={self.precision!r}, fallback={state['precision']!r}) (it continues in "
                    f"{state['precision']})")
            raise ValueError(f"state was saved with precision={state['precision']!r}, this wrapper uses {self.precision!r}")
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.steps, self.skipped_steps = int(state["steps"]), int(state["skipped_steps"])
        if self.fallback is not None and fb.get("to") == self.fallback:
            self._skip_calls = deque(int(c) for c in fb.get("skip_calls", ()))
        self._reset_window()
