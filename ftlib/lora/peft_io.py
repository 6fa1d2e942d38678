"""Adapters on disk in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Format (PEFT >= 0.7, the one ``peft.PeftModel.from_pretrained`` reads): the config is
``LoraConfig``'s fields as JSON (``peft_type: "LORA"``, ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ``use_dora``, ``modules_to_save``, ...); tensors are
keyed ``base_model.model.<module path>.lora_A.weight`` [r, in], ``.lora_B.weight``
[out, r], ``.lora_magnitude_vector`` [out] (DoRA), and ``base_model.model.<path>.<param>``
for ``modules_to_save`` modules (PEFT drops its internal ``.default`` / ``modules_to_save``
segments when saving). ``<module path>`` is the name inside the ``transformers`` model
(``model.layers.0.self_attn.q_proj``), which ftlib's Llama shares.

Tied weights, as PEFT 0.21 writes them: a ``modules_to_save`` weight kept tied with
``ensure_weight_tying`` is stored under each of its names (``lm_head.weight`` and
``model.embed_tokens.weight``); a LoRA target PEFT counts as an embedding layer
(``lm_head``, ``embed_tokens``) may come with its ``base_layer.weight``, which is checked
against the model's and loaded into it when it differs (as PEFT does).

Stacked MoE experts adapted through ``target_parameters`` are stored as PEFT's ``ParamWrapper``
stores them (``ftlib.lora.experts``): ``<experts>[.base_layer].lora_A.weight`` [E*r, in] and
``.lora_B.weight`` [out, r*E], converted from and to ftlib's [E, r, in] / [E, out, r] factors.

Loading checks everything before copying anything: every adapter tensor the model
expects must be in the file (one name of a tied weight is enough; several must agree),
every tensor in the file must belong to an adapted or saved module of this model, and
every shape must fit, otherwise a ValueError names the file and key. Files are written
to a temporary name and renamed into place. ``save_adapter`` records ``task_type``
(default ``"CAUSAL_LM"``, so ``PeftModel.from_pretrained`` returns a causal-LM model)
and the base's ``name_or_path`` (``load_pretrained`` sets it).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._atomic import atomic_write
from .._fields import json_str
from ._match import matches_any
from .apply import LORA_CONFIG_ATTR, apply_lora, get_lora_config, lora_layers, names_by_param, plan_lora
from .config import LoRAConfig
from .experts import LoRAExperts, expert_peft_keys, expert_targets, from_peft_layout, to_peft_layout

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_state_dict", "load_adapter", "save_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2): gather the full value
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous().clone()


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's keys (CPU copies)."""
    out = {PEFT_PREFIX + k: _full(p) for k, p in adapter_params(model).items()}
    for key, (mod, pname, which, _) in _expert_entries(model, get_lora_config(model)).items():
        a, b = to_peft_layout(model.get_submodule(mod).adapters[pname])
        out[PEFT_PREFIX + key] = _full(a if which == "A" else b)
    return out


def _expert_entries(model: nn.Module, cfg: LoRAConfig) -> dict[str, tuple[str, str, str, tuple[int, int]]]:
    """``{PEFT key: (experts module, stacked parameter, "A" | "B", shape in the file)}`` for expert adapters."""
    out = {}
    for (mod, pname), stem in expert_peft_keys(expert_targets(model, cfg.target_parameters)).items():
        m = model.get_submodule(mod)
        e, o, i = getattr(m.base_layer if isinstance(m, LoRAExperts) else m, pname).shape
        r = m.adapters[pname].r if isinstance(m, LoRAExperts) else cfg.rank_for(f"{mod}.{pname}")
        out[f"{stem}.lora_A.weight"] = (mod, pname, "A", (e * r, i))
        out[f"{stem}.lora_B.weight"] = (mod, pname, "B", (o, r * e))
    return out


def _saved_module_names(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    return [n for n, _ in model.named_modules() if n and matches_any(n, cfg.modules_to_save)]


def model_name_or_path(model: nn.Module) -> str | None:
    for obj in (model, getattr(model, "config", None)):
        for attr in ("name_or_path", "_name_or_path"):
            v = getattr(obj, attr, None) if obj is not None else None
            if isinstance(v, str) and v:
                return v
    return None


def save_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    task_type: str | None = "CAUSAL_LM",
) -> Path:
    """Write ``model``'s adapter to directory ``path`` in PEFT's format; returns the directory.

    ``base_model_name_or_path`` defaults to the model's ``name_or_path`` when it has one;
    ``task_type`` is what ``PeftModel.from_pretrained`` uses to pick its wrapper class:
    ``"CAUSAL_LM"`` by default (``PeftModelForCausalLM``), ``None`` for a plain ``PeftModel``.
    """
    from safetensors.torch import save_file

    cfg = get_lora_config(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = adapter_state_dict(model)
    if isinstance(cfg.target_modules, str):
        targets: list[str] | str = cfg.target_modules
    else:
        targets = sorted(set(cfg.target_modules))
    d = cfg.to_peft_dict(targets, base_model_name_or_path or model_name_or_path(model), task_type)
    atomic_write(path / ADAPTER_WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    text = json.dumps(d, indent=2, sort_keys=True) + "\n"
    atomic_write(path / ADAPTER_CONFIG, lambda p: p.write_text(text))
    return path


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    """Parse ``<path>/adapter_config.json`` with clear errors."""
    f = Path(path) / ADAPTER_CONFIG
    if not f.is_file():
        raise FileNotFoundError(f"{f}: no adapter config (expected PEFT's {ADAPTER_CONFIG})")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(d).__name__}")
    return d


def _target_differences(model_cfg: LoRAConfig, file_cfg: LoRAConfig) -> list[str]:
    """``"field: model's value -> file's value"`` for each setting that changes what the adapter computes."""
    keys = ("r", "alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern")
    return [f"{k}: {getattr(model_cfg, k)!r} -> {getattr(file_cfg, k)!r}" for k in keys
            if getattr(model_cfg, k) != getattr(file_cfg, k)]


def load_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    check_base: bool = True,
    **config_overrides: Any,
) -> nn.Module:
    """Load a PEFT-format adapter from directory ``path`` into ``model`` and return it.

    A plain model is first adapted with ``apply_lora`` using the file's config (plus
    ``config_overrides``, e.g. ``quantize="nf4"``); an already adapted model must have a
    matching config and no merged adapter (RuntimeError otherwise). With ``check_base``, an adapter whose ``base_model_name_or_path``
    differs from the model's ``name_or_path`` (when both are known) is refused.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    d = read_adapter_config(path)
    cfg = LoRAConfig.from_peft_dict(d, source=str(path / ADAPTER_CONFIG), **config_overrides)
    wfile = path / ADAPTER_WEIGHTS
    if not wfile.is_file():
        other = " (a pickle adapter_model.bin is not loaded, convert it to safetensors)" if (
            path / "adapter_model.bin").exists() else ""
        raise FileNotFoundError(f"{wfile}: adapter weights not found{other}")
    if check_base:
        want = json_str(d, "base_model_name_or_path", str(path / ADAPTER_CONFIG), default=None, nullable=True)
        have = model_name_or_path(model)
        if want and have and not _same_base(want, have):
            msg = (f"{path / ADAPTER_CONFIG}: adapter was trained on base {want!r} but the model is {have!r} "
                   "(pass check_base=False to load anyway)")
            if _is_local(want) or _is_local(have):
                # a local directory's name says little (a copy of a hub model, a checkpoint folder)
                warnings.warn(msg, stacklevel=2)
            else:
                raise ValueError(msg)

    # expected key -> shape, from the adapted model or from what apply_lora would build
    existing = getattr(model, LORA_CONFIG_ATTR, None)
    if existing is None:
        try:
            resolved, targets, save_names = plan_lora(model, cfg)
        except TypeError as e:
            raise ValueError(f"{path}: {e}") from None
        except ValueError as e:
            raise ValueError(f"{path}: adapter does not fit this model (another base?): {e}") from None
        shapes: dict[str, tuple[int, ...]] = {}
        aliases: dict[str, str] = {}  # name -> the first name of its (tied) tensor
        # "<target>.base_layer.<p>" -> (the model's tensor or None, whether a different one can be loaded)
        bases: dict[str, tuple[torch.Tensor | None, bool]] = {}
        names = names_by_param(model)
        for name, mod in targets:
            r = resolved.rank_for(name)
            shapes[f"{name}.lora_A.weight"] = (r, mod.in_features)
            shapes[f"{name}.lora_B.weight"] = (mod.out_features, r)
            if resolved.use_dora:
                shapes[f"{name}.lora_magnitude_vector"] = (mod.out_features,)
            nf4 = resolved.quantize == "nf4" and isinstance(mod, nn.Linear)
            for pname, p in mod.named_parameters():
                bases[f"{name}.base_layer.{pname}"] = (p, not nf4)
        for mod_name in save_names:
            for pname, p in model.get_submodule(mod_name).named_parameters():
                key = f"{mod_name}.{pname}"
                shapes[key] = tuple(p.shape)
                aliases[key] = key
                if resolved.ensure_weight_tying:  # kept tied: PEFT stores it under every name
                    for other in names[id(p)]:
                        shapes[other], aliases[other] = tuple(p.shape), key
    else:
        merged = [name for name, layer in lora_layers(model) if layer.merged]
        if merged:
            # the base weights hold the current update: new adapter values would make unmerge wrong
            raise RuntimeError(f"load_adapter({path}): adapters are merged into the base weights "
                               f"({merged[0]}, ...); call ftlib.lora.unmerge_lora(model) first")
        existing = get_lora_config(model)  # with the layers' current ranks (rank decay changes them)
        diff = _target_differences(existing, cfg)
        if diff:
            raise ValueError(f"{path / ADAPTER_CONFIG}: the adapter differs from the one the model has "
                             f"(model -> file): {'; '.join(diff)}")
        params = adapter_params(model)
        shapes = {k: tuple(p.shape) for k, p in params.items()}
        first: dict[int, str] = {}
        aliases = {k: first.setdefault(id(p), k) for k, p in params.items()}
        bases = {}
        for name, layer in lora_layers(model):
            for pname, p in layer.base_layer.named_parameters():
                bases[f"{name}.base_layer.{pname}"] = (None, False) if layer.is_quantized else (p, True)

    experts = _expert_entries(model, cfg)
    shapes.update({k: v[3] for k, v in experts.items()})
    try:
        with safe_open(str(wfile), framework="pt") as f:
            loaded = {}
            for key in f.keys():
                if not key.startswith(PEFT_PREFIX):
                    raise ValueError(f"{wfile}: key {key!r} lacks PEFT's {PEFT_PREFIX!r} prefix")
                k = key[len(PEFT_PREFIX):]
                if k.endswith("lora_magnitude_vector.weight"):  # PEFT < 0.12 layout
                    k = k[: -len(".weight")]
                loaded[k] = f.get_tensor(key)
    except SafetensorError as e:
        raise ValueError(f"{wfile}: unreadable safetensors file: {e}") from None

    base_loaded = {k: loaded.pop(k) for k in [k for k in loaded if k in bases]}
    unexpected = sorted(set(loaded) - set(shapes))
    missing = sorted({aliases.get(k, k) for k in shapes} - {aliases.get(k, k) for k in loaded})
    if unexpected:
        raise ValueError(f"{wfile}: tensors for modules this model lacks (adapter for another base?): "
                         f"{[PEFT_PREFIX + k for k in unexpected[:5]]}")
    if missing:
        raise ValueError(f"{wfile}: missing adapter tensors {[PEFT_PREFIX + k for k in missing[:5]]}")
    for k, t in loaded.items():
        if tuple(t.shape) != shapes[k]:
            raise ValueError(f"{wfile}: {PEFT_PREFIX + k} has shape {tuple(t.shape)}, the model needs "
                             f"{shapes[k]} (adapter for another base or rank?)")
        a = aliases.get(k, k)
        if a != k and a in loaded and not torch.equal(loaded[a], t):
            raise ValueError(f"{wfile}: {PEFT_PREFIX + a} and {PEFT_PREFIX + k} are one tied weight but differ")
    for k, t in list(base_loaded.items()):
        have, loadable = bases[k]
        if have is not None and tuple(t.shape) != tuple(have.shape):
            raise ValueError(f"{wfile}: {PEFT_PREFIX + k} has shape {tuple(t.shape)}, the model's is {tuple(have.shape)}")
        if have is not None and torch.equal(t.to(have.dtype), have.detach()):
            del base_loaded[k]  # the base this adapter was saved with is this model's: nothing to load
        elif not loadable:
            raise ValueError(f"{wfile}: {PEFT_PREFIX + k} differs from this model's base weight, and an NF4 base "
                             "cannot take it (load without quantize, or on the base the adapter was trained on)")
    # everything checked: only now change the model
    if existing is None:
        apply_lora(model, cfg)
    params = adapter_params(model)
    layers = dict(lora_layers(model))
    with torch.no_grad():
        pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for k, t in loaded.items():
            if k in experts:
                mod, pname, which, _ = experts[k]
                pairs.setdefault((mod, pname), {})[which] = t
                continue
            params[k].copy_(t.to(params[k].dtype))
        for (mod, pname), ab in pairs.items():
            adapter = model.get_submodule(mod).adapters[pname]
            a, b = from_peft_layout(ab["A"], ab["B"], adapter.lora_A.shape[0])
            adapter.lora_A.copy_(a.to(adapter.lora_A.dtype))
            adapter.lora_B.copy_(b.to(adapter.lora_B.dtype))
        for k, t in base_loaded.items():  # as PEFT: the file's base weight replaces the model's
            target, _, pname = k.partition(".base_layer.")
            p = layers[target].base_layer.get_parameter(pname)
            p.copy_(t.to(p.dtype))
    return model


def _is_local(name: str) -> bool:
    return os.path.isabs(name) or name.startswith(".") or os.path.exists(name)


def _same_base(a: str, b: str) -> bool:
    """Same base model: equal names, or a local directory named like the hub repo (``.../Llama-3.2-1B``)."""
    if a == b:
        return True
    if _is_local(a) or _is_local(b):
        return Path(a.rstrip("/")).name.lower() == Path(b.rstrip("/")).name.lower()
    return False


def adapter_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter and ``modules_to_save`` parameters under their PEFT key (without the prefix).

    A saved weight still tied to another module (``ensure_weight_tying``) appears under each of
    its names, as PEFT writes it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model):
        out[f"{name}.lora_A.weight"] = layer.lora_A.weight
        out[f"{name}.lora_B.weight"] = layer.lora_B.weight
        if layer.use_dora:
            out[f"{name}.lora_magnitude_vector"] = layer.lora_magnitude_vector
    names = names_by_param(model)
    for mod_name in _saved_module_names(model, get_lora_config(model)):
        for pname, p in model.get_submodule(mod_name).named_parameters():
            out[f"{mod_name}.{pname}"] = p
            for other in names[id(p)]:
                out.setdefault(other, p)
    return out
