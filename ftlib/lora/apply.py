"""Turning a model into an adapted one and back: apply, freeze, count, merge, disable, export.

``apply_lora(model, config)`` swaps every targeted ``nn.Linear`` for a ``LoRALinear``
(optionally with an NF4 base, i.e. QLoRA), freezes every other parameter except
those of ``modules_to_save`` (trained in place), and logs the trainable count. It
works on any ``nn.Module`` with ``nn.Linear`` children. Module swap with a filter as
the entry point follows torchao's ``convert_to_float8_training``.

LoRA+ (Hayou et al., arXiv:2402.12354) trains B with a learning rate ``ratio`` times
that of A (ratio ~ 16); :func:`lora_plus_param_groups` returns the optimizer groups.

``disable_adapters(model)`` runs the base model with no copy of any weight (the DPO
reference model at zero memory cost). Modules in ``modules_to_save`` are trained in
place, so inside the context they keep their trained values; a warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._match import in_modules_to_save, is_target, matches_any, resolve_all_linear
from .config import LoRAConfig
from .layers import LoRALinear
from .nf4 import NF4Linear

__all__ = [
    "ParamCount",
    "apply_lora",
    "count_params",
    "disable_adapters",
    "get_lora_config",
    "lora_layers",
    "lora_plus_param_groups",
    "merge_and_unload",
    "merge_lora",
    "plan_lora",
    "trainable_params",
    "unmerge_lora",
]

log = logging.getLogger("ftlib.lora")
_CONFIG_ATTR = "_ftlib_lora_config"


@dataclass(frozen=True)
class ParamCount:
    """Trainable and total parameter counts (NF4 weights counted as their logical out*in elements)."""

    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return f"trainable params: {self.trainable:,} / {self.total:,} ({100 * self.fraction:.4f}%)"


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """``(name, layer)`` for every ``LoRALinear`` in ``model``."""
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            yield name, mod


def get_lora_config(model: nn.Module) -> LoRAConfig:
    """The config ``apply_lora`` used on ``model``; raises if the model has no adapters."""
    cfg = getattr(model, _CONFIG_ATTR, None)
    if cfg is None:
        raise ValueError("model has no LoRA adapters: call ftlib.lora.apply_lora(model, config) first")
    return cfg


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, NF4Linear))]


def plan_lora(model: nn.Module, config: LoRAConfig) -> tuple[LoRAConfig, list[tuple[str, nn.Module]], list[str]]:
    """What :func:`apply_lora` would do, without touching the model.

    Returns (config with ``"all-linear"`` resolved, ``[(name, linear)]`` targets, names of
    ``modules_to_save`` modules); raises as :func:`apply_lora` does.
    """
    if config.target_modules == "all-linear":
        config = config.replace(target_modules=resolve_all_linear(model))
    targets = [(n, m) for n, m in model.named_modules() if n and is_target(n, config)]
    if not targets:
        linears = _linear_names(model)
        raise ValueError(
            f"apply_lora: target_modules={config.target_modules!r} matched no module; "
            f"linear layers in this model include {linears[:8]}{' ...' if len(linears) > 8 else ''}"
        )
    for name, mod in targets:
        if not isinstance(mod, (nn.Linear, NF4Linear)):
            raise TypeError(f"apply_lora: target {name!r} is a {type(mod).__name__}; only linear layers can be adapted")
    save_names: list[str] = []
    for pat in config.modules_to_save:
        found = [n for n, _ in model.named_modules() if n and matches_any(n, [pat])]
        if not found:
            raise ValueError(f"apply_lora: modules_to_save entry {pat!r} matched no module")
        save_names += found
    return config, targets, save_names


def apply_lora(model: nn.Module, config: LoRAConfig, *, verbose: bool = True) -> nn.Module:
    """Adapt ``model`` in place as ``config`` says and return it.

    Every parameter is frozen except the adapters and the floating-point parameters of
    ``modules_to_save`` (trained in place; a tied weight, e.g. an ``lm_head`` sharing the
    embedding matrix, is trained for both). The trainable count and fraction are logged on
    the ``ftlib.lora`` logger; :func:`count_params` returns them.

    Raises ValueError when a target or ``modules_to_save`` pattern matches nothing, TypeError
    when a matched module is not a linear layer, RuntimeError when the model is already adapted.
    """
    if any(True for _ in lora_layers(model)) or getattr(model, _CONFIG_ATTR, None) is not None:
        raise RuntimeError("apply_lora: model already has LoRA adapters (one adapter per model)")
    config, targets, save_names = plan_lora(model, config)

    quantize = config.quantize == "nf4"
    qkw = dict(blocksize=config.quant_blocksize, double_quant=config.double_quant)
    others: list[str] = []  # non-target linears quantized with quantize_modules="all"
    if quantize and config.quantize_modules == "all":
        target_set = {n for n, _ in targets}
        for name in _linear_names(model):
            mod = model.get_submodule(name)
            if (name in target_set or not isinstance(mod, nn.Linear) or in_modules_to_save(name, config.modules_to_save)
                    or matches_any(name, config.quantize_skip)):
                continue
            others.append(name)
    if quantize:
        # checked before anything changes: NF4 would spread a NaN/Inf over its whole block, and a
        # failure half-way would leave a half-converted model
        for name in others + [n for n, m in targets if isinstance(m, nn.Linear)]:
            w = model.get_submodule(name).weight
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"apply_lora: {name}.weight has non-finite values; cannot quantize it to NF4")

    for p in model.parameters():
        p.requires_grad_(False)
    for name in others:
        _set_module(model, name, NF4Linear.from_linear(model.get_submodule(name), **qkw))
    n_targets = len(targets)
    targets.reverse()
    while targets:
        # pop: once swapped out, a full-precision weight must be unreachable, so quantizing an 8B
        # model peaks at the model plus one layer, not the model plus its whole NF4 copy
        name, mod = targets.pop()
        base = NF4Linear.from_linear(mod, **qkw) if (quantize and isinstance(mod, nn.Linear)) else mod
        layer = LoRALinear(
            base, config.rank_for(name), config.alpha_for(name), config.dropout,
            use_rslora=config.use_rslora, use_dora=config.use_dora, init=config.init,
        )
        _set_module(model, name, layer)
    for name in save_names:
        for p in model.get_submodule(name).parameters():
            if p.is_floating_point():
                p.requires_grad_(True)
    object.__setattr__(model, _CONFIG_ATTR, config)
    if verbose:
        log.info("apply_lora: %d layers adapted; %s", n_targets, count_params(model))
    return model


def trainable_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: parameter}`` of everything that requires grad (adapters and ``modules_to_save``)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def count_params(model: nn.Module) -> ParamCount:
    """Trainable / total parameter counts, NF4 weights counted as out*in elements."""
    trainable = total = 0
    nf4_ids = set()
    for mod in model.modules():
        if isinstance(mod, NF4Linear):
            total += mod.in_features * mod.out_features + (mod.bias.numel() if mod.bias is not None else 0)
            nf4_ids.update(id(p) for p in mod.parameters())
    for p in model.parameters():
        if id(p) in nf4_ids:
            continue
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return ParamCount(trainable, total)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight in place (fp32 math); undo with :func:`unmerge_lora`."""
    for _, layer in lora_layers(model):
        layer.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_lora`."""
    for _, layer in lora_layers(model):
        layer.unmerge()
    return model


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block ``model`` computes with its base weights only (no weights are copied)."""
    layers = [layer for _, layer in lora_layers(model)]
    if any(layer.merged for layer in layers):
        raise RuntimeError("disable_adapters: adapters are merged into the base weights; call unmerge_lora first")
    cfg = getattr(model, _CONFIG_ATTR, None)
    if cfg is not None and cfg.modules_to_save:
        warnings.warn(
            f"disable_adapters: modules_to_save {cfg.modules_to_save} are trained in place and keep their "
            "trained values inside this context", stacklevel=3,
        )
    before = [layer.disabled for layer in layers]
    for layer in layers:
        layer.disabled = True
    try:
        yield model
    finally:
        for layer, b in zip(layers, before):
            layer.disabled = b


def merge_and_unload(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> nn.Module:
    """Replace each ``LoRALinear`` by an ``nn.Linear`` with the merged weight and each remaining
    ``NF4Linear`` by its dequantized ``nn.Linear``, in ``dtype`` (``None``: the base dtype).

    The merge is computed in fp32 from the unmerged (dequantized) base. Other parameters keep
    their dtype. The result has no ftlib-specific modules, ready for ``save_pretrained``.
    """
    # by name, one module at a time: a replaced layer must be unreachable before the next merged
    # weight is built, or a bf16 model would briefly be held twice
    for name in [n for n, _ in lora_layers(model)]:
        _set_module(model, name, model.get_submodule(name).to_linear(dtype))
    for name in [n for n, m in model.named_modules() if isinstance(m, NF4Linear)]:
        _set_module(model, name, model.get_submodule(name).to_linear(dtype))
    if getattr(model, _CONFIG_ATTR, None) is not None:
        object.__delattr__(model, _CONFIG_ATTR)
    return model


def lora_plus_param_groups(
    model: nn.Module, lr: float, ratio: float = 16.0, weight_decay: float = 0.0
) -> list[dict[str, Any]]:
    """Optimizer parameter groups for LoRA+ (Hayou et al. 2024): ``lora_B`` at ``lr * ratio``.

    A shorthand for ``ftlib.optim.param_groups(model, lr=lr, weight_decay=weight_decay,
    lora_plus_ratio=ratio)``: every trainable parameter once; no weight decay for DoRA
    magnitudes, biases and norms; each group lists its ``param_names``. Pass the list to any
    ``torch.optim`` optimizer.
    """
    from ftlib.optim import param_groups

    if not lr > 0:
        raise ValueError(f"lora_plus_param_groups: lr must be > 0, got {lr}")
    return param_groups(model, lr=lr, weight_decay=weight_decay, lora_plus_ratio=ratio)
