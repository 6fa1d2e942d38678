"""Adapters on disk in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Format (PEFT >= 0.7, the one ``peft.PeftModel.from_pretrained`` reads): the config is
``LoraConfig``'s fields as JSON (``peft_type: "LORA"``, ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ``use_dora``, ``modules_to_save``, ...); tensors are
keyed ``base_model.model.<module path>.lora_A.weight`` [r, in], ``.lora_B.weight``
[out, r], ``.lora_magnitude_vector`` [out] (DoRA), and ``base_model.model.<path>.<param>``
for ``modules_to_save`` modules (PEFT drops its internal ``.default`` / ``modules_to_save``
segments when saving). ``<module path>`` is the name inside the ``transformers`` model
(``model.layers.0.self_attn.q_proj``), which ftlib's Llama shares.

Loading checks everything before copying anything: every adapter tensor the model
expects must be in the file, every tensor in the file must belong to an adapted or
saved module of this model, and every shape must fit, otherwise a ValueError names
the file and key. Files are written to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._atomic import atomic_write
from ._match import matches_any
from .apply import _CONFIG_ATTR, apply_lora, get_lora_config, lora_layers, plan_lora
from .config import LoRAConfig

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_state_dict", "load_adapter", "save_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2): gather the full value
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous().clone()


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's keys (CPU copies)."""
    return {_PREFIX + k: _full(p) for k, p in _adapter_params(model).items()}


def _saved_module_names(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    return [n for n, _ in model.named_modules() if n and matches_any(n, cfg.modules_to_save)]


def _model_name_or_path(model: nn.Module) -> str | None:
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
    task_type: str | None = None,
) -> Path:
    """Write ``model``'s adapter to directory ``path`` in PEFT's format; returns the directory.

    ``base_model_name_or_path`` defaults to the model's ``name_or_path`` when it has one;
    ``task_type`` (e.g. ``"CAUSAL_LM"``) is what ``PeftModel.from_pretrained`` uses to pick
    its wrapper class.
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
    d = cfg.to_peft_dict(targets, base_model_name_or_path or _model_name_or_path(model), task_type)
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


def _same_targets(a: LoRAConfig, b: LoRAConfig) -> bool:
    keys = ("r", "alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


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
        want, have = d.get("base_model_name_or_path"), _model_name_or_path(model)
        if want and have and want != have:
            raise ValueError(
                f"{path / ADAPTER_CONFIG}: adapter was trained on base {want!r} but the model is {have!r} "
                "(pass check_base=False to load anyway)"
            )

    # expected key -> shape, from the adapted model or from what apply_lora would build
    existing = getattr(model, _CONFIG_ATTR, None)
    if existing is None:
        try:
            resolved, targets, save_names = plan_lora(model, cfg)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: adapter does not fit this model (another base?): {e}") from None
        shapes: dict[str, tuple[int, ...]] = {}
        for name, mod in targets:
            r = resolved.rank_for(name)
            shapes[f"{name}.lora_A.weight"] = (r, mod.in_features)
            shapes[f"{name}.lora_B.weight"] = (mod.out_features, r)
            if resolved.use_dora:
                shapes[f"{name}.lora_magnitude_vector"] = (mod.out_features,)
        for mod_name in save_names:
            for pname, p in model.get_submodule(mod_name).named_parameters():
                shapes[f"{mod_name}.{pname}"] = tuple(p.shape)
    else:
        merged = [name for name, layer in lora_layers(model) if layer.merged]
        if merged:
            # the base weights hold the current update: new adapter values would make unmerge wrong
            raise RuntimeError(f"load_adapter({path}): adapters are merged into the base weights "
                               f"({merged[0]}, ...); call ftlib.lora.unmerge_lora(model) first")
        if not _same_targets(existing, cfg):
            raise ValueError(f"{path / ADAPTER_CONFIG}: config {d} differs from the model's adapter config {existing}")
        shapes = {k: tuple(p.shape) for k, p in _adapter_params(model).items()}

    try:
        with safe_open(str(wfile), framework="pt") as f:
            loaded = {}
            for key in f.keys():
                if not key.startswith(_PREFIX):
                    raise ValueError(f"{wfile}: key {key!r} lacks PEFT's {_PREFIX!r} prefix")
                k = key[len(_PREFIX):]
                if k.endswith("lora_magnitude_vector.weight"):  # PEFT < 0.12 layout
                    k = k[: -len(".weight")]
                loaded[k] = f.get_tensor(key)
    except SafetensorError as e:
        raise ValueError(f"{wfile}: unreadable safetensors file: {e}") from None

    unexpected = sorted(set(loaded) - set(shapes))
    missing = sorted(set(shapes) - set(loaded))
    if unexpected:
        raise ValueError(f"{wfile}: tensors for modules this model lacks (adapter for another base?): "
                         f"{[_PREFIX + k for k in unexpected[:5]]}")
    if missing:
        raise ValueError(f"{wfile}: missing adapter tensors {[_PREFIX + k for k in missing[:5]]}")
    for k, t in loaded.items():
        if tuple(t.shape) != shapes[k]:
            raise ValueError(f"{wfile}: {_PREFIX + k} has shape {tuple(t.shape)}, the model needs "
                             f"{shapes[k]} (adapter for another base or rank?)")
    # everything checked: only now change the model
    if existing is None:
        apply_lora(model, cfg)
    params = _adapter_params(model)
    with torch.no_grad():
        for k, t in loaded.items():
            params[k].copy_(t.to(params[k].dtype))
    return model


def _adapter_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter and ``modules_to_save`` parameters under their PEFT key (without the prefix)."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model):
        out[f"{name}.lora_A.weight"] = layer.lora_A.weight
        out[f"{name}.lora_B.weight"] = layer.lora_B.weight
        if layer.use_dora:
            out[f"{name}.lora_magnitude_vector"] = layer.lora_magnitude_vector
    for mod_name in _saved_module_names(model, get_lora_config(model)):
        for pname, p in model.get_submodule(mod_name).named_parameters():
            out[f"{mod_name}.{pname}"] = p
    return out
