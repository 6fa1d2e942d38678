"""Module-name matching with PEFT's rules (private helper of ``ftlib.lora``)."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

__all__ = ["in_modules_to_save", "is_target", "matches_any", "pattern_value", "resolve_all_linear"]


def matches_any(name: str, spec: list[str] | str | None) -> bool:
    """A list matches ``name`` when an entry equals it or is a dotted suffix; a string must ``re.fullmatch``."""
    if not spec:
        return False
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == s or name.endswith("." + s) for s in spec)


def in_modules_to_save(name: str, modules_to_save: list[str]) -> bool:
    """PEFT never adapts a module inside (or equal to) a ``modules_to_save`` module."""
    return any(re.match(rf"(^|.*\.){re.escape(m)}($|\..*)", name) for m in modules_to_save)


def is_target(name: str, config: Any) -> bool:
    if matches_any(name, config.exclude_modules) or in_modules_to_save(name, config.modules_to_save):
        return False
    return matches_any(name, config.target_modules)


def pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first pattern ``p`` with ``(.*\\.)?(p)$`` matching ``name``."""
    for pat, value in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", name):
            return value
    return default


def resolve_all_linear(model: nn.Module) -> list[str]:
    """PEFT's ``"all-linear"``: the leaf names of every ``nn.Linear`` except the output head."""
    from .nf4 import NF4Linear

    head = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        head = get_out()
    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, NF4Linear)) and mod is not head and name.split(".")[-1] != "lm_head":
            names.add(name.split(".")[-1])
    return sorted(names)
