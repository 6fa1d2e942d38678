"""Turning a model into an adapted one and back: apply, freeze, count, merge, disable, export.

``apply_lora(model, config)`` swaps every targeted ``nn.Linear`` for a ``LoRALinear``
(optionally with an NF4 base, i.e. QLoRA), freezes every other parameter except
those of ``modules_to_save`` (trained in place), and logs the trainable count. It
works on any ``nn.Module`` with ``nn.Linear`` children. Module swap with a filter as
the entry point follows torchao's ``convert_to_float8_training``.

Tied weights (an ``lm_head`` sharing the embedding matrix, Llama-3.2 / Qwen2 style) follow
PEFT 0.21. ``modules_to_save=["lm_head"]`` unties: the head trains its own copy, the
embedding keeps the frozen original (with ``ensure_weight_tying=True`` the shared matrix is
trained in place for both instead). LoRA on a tied ``lm_head`` leaves the shared base frozen;
merging it (``merge_lora``) first gives the head its own copy of the base, so the embedding
never takes the update (PEFT's merge writes it into the embedding too, changing the model's
outputs; ftlib's merged model computes what the adapted one did). ``unmerge_lora`` re-ties.
``merge_and_unload`` leaves such a head untied and sets ``config.tie_word_embeddings=False``
so ``save_pretrained`` keeps it.

LoRA+ (Hayou et al., arXiv:2402.12354) trains B with a learning rate ``ratio`` times
that of A (ratio ~ 16): ``ftlib.optim.param_groups(model, lr=..., lora_plus_ratio=16)`` returns
the optimizer groups (the one place parameter groups are built).

Stacked MoE experts (``target_parameters``) get a per-expert LoRA (``ftlib.lora.experts``): the
``experts`` module becomes a ``LoRAExperts``; merge, unmerge, ``merge_and_unload`` and
``disable_adapters`` treat it like the linear adapters. Naming ``gate_proj`` / ``up_proj`` /
``down_proj`` in ``target_modules`` of an MoE model adapts the dense and shared-expert MLPs only,
as in PEFT; a warning says the routed experts need ``target_parameters``. With ``quantize="nf4"`` the
adapted stacked weights (``quantize_modules="all"``: every one) are stored in NF4 per expert
(``ftlib.lora.nf4_experts``, QLoRA on the experts); a warning names those left in full precision.

``disable_adapters(model)`` runs the base model with no copy of any weight (the DPO
reference model at zero memory cost). Modules in ``modules_to_save`` are trained in
place, so inside the context they keep their trained values; a warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..models.moe import MoEExperts
from ._match import in_modules_to_save, is_target, matches_any, resolve_all_linear
from .config import LoRAConfig
from .experts import ExpertLoRA, LoRAExperts, expert_targets
from .layers import LoRALinear
from .nf4 import NF4Linear
from .nf4_experts import NF4Experts

__all__ = [
    "ParamCount",
    "apply_lora",
    "count_params",
    "disable_adapters",
    "expert_lora_modules",
    "get_lora_config",
    "lora_layers",
    "merge_and_unload",
    "merge_lora",
    "plan_lora",
    "trainable_params",
    "unmerge_lora",
]

log = logging.getLogger("ftlib.lora")
LORA_CONFIG_ATTR = "_ftlib_lora_config"


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


def names_by_param(model: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): every name it has in model}`` (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def _tied_outside(model: nn.Module, module_name: str) -> dict[str, list[str]]:
    """``{parameter name inside module_name: [its names outside that module]}`` for its tied weights."""
    names = names_by_param(model)
    out = {}
    for pname, p in model.get_submodule(module_name).named_parameters(remove_duplicate=False):
        others = [n for n in names[id(p)] if not n.startswith(module_name + ".")]
        if others:
            out[pname] = others
    return out


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """``(name, layer)`` for every ``LoRALinear`` in ``model``."""
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            yield name, mod


def get_lora_config(model: nn.Module) -> LoRAConfig:
    """The config of ``model``'s adapters, as its layers are now; raises if the model has no adapters.

    That is the config ``apply_lora`` used, unless a layer's rank or alpha changed since (rank decay,
    ``shrink_lora``): then ``rank_pattern`` / ``alpha_pattern`` hold one escaped full module name per
    layer that differs from ``r`` / ``alpha`` and no other pattern (PEFT and ftlib take the first
    matching pattern, and adapter_config.json is written with sorted keys, so a general user pattern
    could otherwise come first and shadow a changed layer). ``save_adapter`` writes this config, so
    the file describes the tensors beside it.
    """
    cfg = getattr(model, LORA_CONFIG_ATTR, None)
    if cfg is None:
        raise ValueError("model has no LoRA adapters: call ftlib.lora.apply_lora(model, config) first")
    layers = list(lora_layers(model))
    if all(layer.r == cfg.rank_for(name) and layer.alpha == float(cfg.alpha_for(name)) for name, layer in layers):
        return cfg
    ranks = {re.escape(name): layer.r for name, layer in layers if layer.r != cfg.r}
    alphas = {re.escape(name): layer.alpha for name, layer in layers if layer.alpha != float(cfg.alpha)}
    return cfg.replace(rank_pattern=ranks, alpha_pattern=alphas)


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
    if expert_targets(model, config.target_parameters):  # raises for an entry that matches nothing
        if config.dropout or config.use_dora:
            raise ValueError("apply_lora: LoRA on stacked experts (target_parameters) takes no dropout or DoRA "
                             "(as PEFT's ParamWrapper); set dropout=0, use_dora=False")
    elif not targets:
        linears = _linear_names(model)
        raise ValueError(
            f"apply_lora: target_modules={config.target_modules!r} matched no module; "
            f"linear layers in this model include {linears[:8]}{' ...' if len(linears) > 8 else ''}"
        )
    for name, mod in targets:
        if isinstance(mod, nn.Embedding):
            raise TypeError(f"apply_lora: target {name!r} is an Embedding; ftlib adapts linear layers only (LoRA on "
                            "embeddings, PEFT's lora_embedding_A/B, is not implemented): train it in full with "
                            "modules_to_save instead")
        if not isinstance(mod, (nn.Linear, NF4Linear)):
            raise TypeError(f"apply_lora: target {name!r} is a {type(mod).__name__}; only linear layers can be adapted")
        if config.ensure_weight_tying and (tied := _tied_outside(model, name)):
            raise ValueError(
                f"apply_lora: ensure_weight_tying=True with a LoRA target {name!r} whose weight is tied to "
                f"{sorted(n for v in tied.values() for n in v)}: PEFT then ties it to a LoRA adapter on the embedding "
                "(lora_embedding_A/B), which ftlib does not implement. Set ensure_weight_tying=False (LoRA on "
                f"{name} alone, the shared weight stays frozen) or train it in full with modules_to_save"
            )
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
    ``modules_to_save`` (trained in place). A weight of a ``modules_to_save`` module that is tied
    to another module (an ``lm_head`` sharing the embedding matrix) is untied: the module trains
    a copy, the other keeps the frozen original, as PEFT does (a warning says so); with
    ``config.ensure_weight_tying`` it stays shared and trains for both. The trainable count and
    fraction are logged on the ``ftlib.lora`` logger; :func:`count_params` returns them.

    Raises ValueError when a target or ``modules_to_save`` pattern matches nothing, TypeError
    when a matched module is not a linear layer, RuntimeError when the model is already adapted.
    """
    if any(True for _ in lora_layers(model)) or getattr(model, LORA_CONFIG_ATTR, None) is not None:
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
            if not w.is_meta and not bool(torch.isfinite(w).all()):  # meta: checked when it is filled
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
    _apply_expert_lora(model, config)
    for name in save_names:
        mod = model.get_submodule(name)
        tied = {} if config.ensure_weight_tying else _tied_outside(model, name)
        for pname, others in tied.items():
            owner, leaf = _owner(mod, pname)
            old = getattr(owner, leaf)
            # PEFT's ModulesToSaveWrapper trains a copy; the tied partner keeps the frozen original
            setattr(owner, leaf, nn.Parameter(old.detach().clone(), requires_grad=False))
            warnings.warn(
                f"apply_lora: modules_to_save {name!r}: {name}.{pname} is tied to {others}; training an untied copy "
                f"(as PEFT does), {others} stay frozen. Pass ensure_weight_tying=True to train the shared weight "
                "for both", stacklevel=2,
            )
        for p in mod.parameters():
            if p.is_floating_point():
                p.requires_grad_(True)
    _untie_config(model, "apply_lora")
    object.__setattr__(model, LORA_CONFIG_ATTR, config)
    if verbose:
        log.info("apply_lora: %d layers adapted; %s", n_targets, count_params(model))
    return model


def _apply_expert_lora(model: nn.Module, config: LoRAConfig) -> None:
    """Wrap each targeted ``MoEExperts`` in a ``LoRAExperts`` (one ``ExpertLoRA`` per selected weight)."""
    chosen = expert_targets(model, config.target_parameters)
    stacked = [n for n, m in model.named_modules() if isinstance(m, MoEExperts)]
    mlp_named = isinstance(config.target_modules, list) and any(
        matches_any(f"mlp.{p}", config.target_modules) for p in ("gate_proj", "up_proj", "down_proj"))
    if config.quantize == "nf4":
        _quantize_experts(model, config, stacked, chosen)
    if not chosen and stacked and mlp_named:
        names = stacked
        warnings.warn("apply_lora: target_modules adapt the dense / shared-expert MLPs only; the routed experts "
                      f"({names[0]}, ...) are stacked weights: add target_parameters=['mlp.experts.gate_up_proj', "
                      "'mlp.experts.down_proj'] to adapt them", stacklevel=3)
    by_module: dict[str, list[str]] = {}
    for mod_name, pname in chosen:
        by_module.setdefault(mod_name, []).append(pname)
    for mod_name, pnames in by_module.items():
        base = model.get_submodule(mod_name)
        adapters = {}
        for pname in pnames:
            w = getattr(base, pname)  # (E, out, in)
            full = f"{mod_name}.{pname}"
            adapters[pname] = ExpertLoRA(w.shape[0], w.shape[1], w.shape[2], config.rank_for(full),
                                         config.alpha_for(full), use_rslora=config.use_rslora, init=config.init,
                                         device=w.device, dtype=w.dtype)
        _set_module(model, mod_name, LoRAExperts(base, adapters))


def _quantize_experts(model: nn.Module, config: LoRAConfig, stacked: list[str], chosen: list[tuple[str, str]]) -> None:
    """QLoRA on the stacked experts: the adapted stacked weights (``quantize_modules="all"``: every one not
    in ``quantize_skip``) become ``NF4Stack``s; a warning names the ones that stay in full precision."""
    picked = {(m, p) for m, p in chosen}
    plan = {}
    for mod_name in stacked:
        names = [p for p in ("gate_up_proj", "down_proj")
                 if (mod_name, p) in picked or (config.quantize_modules == "all"
                                                and not matches_any(f"{mod_name}.{p}", config.quantize_skip))]
        for p in names:  # checked before anything changes, as for the linear layers
            w = getattr(model.get_submodule(mod_name), p)
            if not w.is_meta and not bool(torch.isfinite(w).all()):
                raise ValueError(f"apply_lora: {mod_name}.{p} has non-finite values; cannot quantize it to NF4")
        plan[mod_name] = names
    left = [f"{m}.{p}" for m, names in plan.items() for p in ("gate_up_proj", "down_proj") if p not in names]
    for mod_name, names in plan.items():
        if names:
            _set_module(model, mod_name, NF4Experts(model.get_submodule(mod_name), names,
                                                    blocksize=config.quant_blocksize, double_quant=config.double_quant))
    if left:
        warnings.warn(f"apply_lora: quantize='nf4' with quantize_modules={config.quantize_modules!r}: the stacked "
                      f"expert weights {left[0]}{f' and {len(left) - 1} more' if len(left) > 1 else ''} are not "
                      "adapted and stay in full precision (quantize_modules='all' quantizes them too)", stacklevel=4)


def expert_lora_modules(model: nn.Module) -> list[tuple[str, LoRAExperts]]:
    """``(name, module)`` for every ``LoRAExperts`` in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRAExperts)]


def _owner(module: nn.Module, pname: str) -> tuple[nn.Module, str]:
    owner_name, _, leaf = pname.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), leaf


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


_TIED_BASE = "_ftlib_tied_base"  # on a LoRALinear merged over a tied base: the shared original


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight in place (fp32 math); undo with :func:`unmerge_lora`.

    A base weight tied to another module (a LoRA ``lm_head`` sharing the embedding) is first
    replaced by a copy, so the update never reaches the other module; ``unmerge_lora`` puts the
    shared original back (exactly). That costs one copy of each such weight while merged.
    """
    layers = list(lora_layers(model))
    tied = {name for name, layer in layers if not layer.merged and not layer.is_quantized
            and _tied_outside(model, f"{name}.base_layer").get("weight")}
    for name, layer in layers:
        if name in tied:
            shared = layer.base_layer.weight
            layer.base_layer.weight = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
            object.__setattr__(layer, _TIED_BASE, shared)  # not registered: no state_dict entry
        layer.merge()
    for _, experts in expert_lora_modules(model):
        experts.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_lora` (a base that was tied gets the shared original back)."""
    for _, layer in lora_layers(model):
        layer.unmerge()
        shared = layer.__dict__.pop(_TIED_BASE, None)
        if shared is not None:
            layer.base_layer.weight = shared
    for _, experts in expert_lora_modules(model):
        experts.unmerge()
    return model


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block ``model`` computes with its base weights only (no weights are copied)."""
    layers = [layer for _, layer in lora_layers(model)] + [m for _, m in expert_lora_modules(model)]
    if any(layer.merged for layer in layers):
        raise RuntimeError("disable_adapters: adapters are merged into the base weights; call unmerge_lora first")
    cfg = getattr(model, LORA_CONFIG_ATTR, None)
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


def merge_and_unload(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace each ``LoRALinear`` by an ``nn.Linear`` with the merged weight and each remaining
    ``NF4Linear`` by its dequantized ``nn.Linear``; return the model.

    ``dtype=None`` (default): each new layer takes its base weight's dtype (an NF4 base: the dtype
    it was quantized from), so an fp32 model stays fp32 and a bf16 one bf16. A ``dtype`` converts
    the whole model: every floating parameter and persistent buffer (non-persistent buffers, such
    as a RoPE ``inv_freq`` kept in fp32, are left alone), one tensor at a time. The merge is
    computed in fp32 from the unmerged (dequantized) base. A head that no longer shares the
    embedding's weight gets ``config.tie_word_embeddings = False``. The result has no
    ftlib-specific modules, ready for ``save_pretrained``.
    """
    # by name, one module at a time: a replaced layer must be unreachable before the next merged
    # weight is built, or a bf16 model would briefly be held twice
    for name in [n for n, _ in lora_layers(model)]:
        layer = model.get_submodule(name)
        layer.__dict__.pop(_TIED_BASE, None)
        _set_module(model, name, layer.to_linear(dtype))
    for name, experts in expert_lora_modules(model):
        if isinstance(experts.base_layer, NF4Experts):  # dequantize, then merge in fp32 math
            experts.base_layer = experts.base_layer.to_experts(dtype)
        experts.merge()
        _set_module(model, name, experts.base_layer)
    for name in [n for n, m in model.named_modules() if isinstance(m, NF4Experts)]:
        _set_module(model, name, model.get_submodule(name).to_experts(dtype))
    for name in [n for n, m in model.named_modules() if isinstance(m, NF4Linear)]:
        _set_module(model, name, model.get_submodule(name).to_linear(dtype))
    if dtype is not None:
        with torch.no_grad():
            for mod in model.modules():
                for p in mod._parameters.values():
                    if p is not None and p.is_floating_point() and p.dtype != dtype:
                        p.data = p.data.to(dtype)  # in place of the Parameter: tied weights stay tied
                for key, b in mod._buffers.items():
                    if b is not None and b.is_floating_point() and key not in mod._non_persistent_buffers_set:
                        mod._buffers[key] = b.to(dtype)
    if getattr(model, LORA_CONFIG_ATTR, None) is not None:
        object.__delattr__(model, LORA_CONFIG_ATTR)
    _untie_config(model, "merge_and_unload")
    return model


def _word_embedding_weights(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input embedding weight, output head weight): transformers' accessors, or else the model's one
    ``nn.Embedding`` and its ``lm_head`` (ftlib's Llama)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if callable(get_in) and callable(get_out):
        emb, head = get_in(), get_out()
    else:
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        head = getattr(model, "lm_head", None)
        if len(embeddings) != 1 or head is None:
            return None
        emb = embeddings[0]
    if isinstance(head, LoRALinear):
        head = head.base_layer
    w_in, w_out = getattr(emb, "weight", None), getattr(head, "weight", None)
    return None if w_in is None or w_out is None else (w_in, w_out)


def _untie_config(model: nn.Module, who: str) -> None:
    """``config.tie_word_embeddings = False`` once the head no longer shares the embedding's weight, so
    a later ``tie_weights()`` cannot overwrite the head and ``save_pretrained`` stores it."""
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "tie_word_embeddings", False):
        return
    pair = _word_embedding_weights(model)
    if pair is not None and pair[0] is not pair[1]:
        log.info("%s: the output head no longer shares the embedding's weight; config.tie_word_embeddings=False", who)
        cfg.tie_word_embeddings = False
