"""Hub layout of the MoE experts, both ways: per-expert tensors on disk, stacked ``[E, out, in]`` in memory.

On the hub (and as transformers 5.25's ``save_pretrained`` writes them), each expert is stored alone:

    Qwen3-MoE / Qwen2-MoE   model.layers.{i}.mlp.experts.{e}.gate_proj.weight     [I, H]
                            model.layers.{i}.mlp.experts.{e}.up_proj.weight       [I, H]
                            model.layers.{i}.mlp.experts.{e}.down_proj.weight     [H, I]
                            model.layers.{i}.mlp.gate.weight                      [E, H]  (the router)
    Mixtral                 model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2.weight
                            (gate / up / down) and model.layers.{i}.block_sparse_moe.gate.weight

In memory (``ftlib.models.moe``, the names of transformers 5's modules) they are stacked:
``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] = [gate_0; up_0], ... per expert, and
``...experts.down_proj`` [E, H, I]. ``read_expert_weights`` fills each stacked tensor expert by
expert (one stacked tensor allocated per projection and layer, one hub tensor in flight);
checkpoints that already store the stacked names load through the plain path. ``to_hub_layout``
gives the per-expert views ``save_pretrained`` writes (slices of the stacked tensors, no copy).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

__all__ = ["is_hub_expert_tensor", "read_expert_weights", "to_hub_layout"]

_QWEN = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(?:experts\.(\d+)\.(w1|w2|w3)\.weight|(gate\.weight))$")
_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HUB_NAME = {v: k for k, v in _PART.items()}


def _parse(name: str) -> tuple[str, int | None, str] | None:
    """(layer prefix, expert or None, part: gate_proj | up_proj | down_proj | router) of a hub name."""
    m = _QWEN.match(name)
    if m:
        return m.group(1), int(m.group(2)), m.group(3)
    m = _MIXTRAL.match(name)
    if m:
        if m.group(4):
            return m.group(1), None, "router"
        return m.group(1), int(m.group(2)), _PART[m.group(3)]
    return None


def is_hub_expert_tensor(name: str) -> bool:
    """True for a per-expert tensor name of the hub layout (or Mixtral's ``block_sparse_moe`` router)."""
    return _parse(name) is not None


def read_expert_weights(tensors: Iterable, install: Callable[[str, torch.Tensor], None], root: Path,
                        expected: dict[str, torch.Tensor], *, dtype: torch.dtype | None,
                        device: torch.device) -> dict[str, str]:
    """Read the hub's per-expert tensors into stacked parameters: ``install(name, tensor)`` sets each one.

    ``tensors``: (file, open reader, name) for every tensor under ``root`` (``hub.checkpoint_tensors``);
    names that are not per-expert hub names are passed over. ``expected``: the meta-built model's
    state dict (names and shapes).

    Refuses (naming the file and tensor) an expert index past ``num_experts``, a tensor of a layer
    that is dense, a wrong shape, a tensor stored twice, and (naming the hub name) an expert the
    checkpoint lacks. Returns {stacked parameter name: a file it came from}.
    """
    stacks: dict[str, torch.Tensor] = {}
    seen: dict[str, set[tuple[int, str]]] = {}
    loaded: dict[str, str] = {}
    for fname, f, name in tensors:
        parsed = _parse(name)
        if parsed is None:
            continue
        prefix, e, part = parsed
        if part == "router":
            target = f"{prefix}.mlp.gate.weight"
            if target not in expected:
                raise ValueError(f"{fname}: unexpected tensor {name!r} (layer {prefix} has no router in the config)")
            want, got = tuple(expected[target].shape), f.shape(name)
            if got != want:
                raise ValueError(f"{fname}: tensor {name!r} has shape {got}, the config expects {want}")
            t = f.read(name).to(device)
            install(target, t.to(dtype) if dtype is not None else t)
            loaded[target] = fname
            continue
        target = f"{prefix}.mlp.experts.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
        if target not in expected:
            raise ValueError(f"{fname}: unexpected tensor {name!r} (layer {prefix} is not a sparse layer in the config)")
        full = expected[target].shape  # (E, 2I, H) or (E, H, I)
        if e >= full[0]:
            raise ValueError(f"{fname}: tensor {name!r} names expert {e}, the config has num_experts={full[0]}")
        rows = full[1] // 2 if part != "down_proj" else full[1]
        want, got = (rows, full[2]), f.shape(name)
        if got != want:
            raise ValueError(f"{fname}: tensor {name!r} has shape {got}, the config expects {want}")
        if (e, part) in seen.setdefault(target, set()):
            raise ValueError(f"{fname}: tensor {name!r} stored twice")
        t = f.read(name)
        if target not in stacks:
            stacks[target] = torch.empty(full, dtype=dtype if dtype is not None else t.dtype, device=device)
        lo = rows if part == "up_proj" else 0
        stacks[target][e, lo : lo + rows].copy_(t)
        seen[target].add((e, part))
        loaded[target] = fname
    for target, stack in stacks.items():
        parts = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
        missing = [(e, p) for e in range(stack.shape[0]) for p in parts if (e, p) not in seen[target]]
        if missing:
            e, p = missing[0]
            prefix = target.rsplit(".mlp.", 1)[0]
            raise ValueError(f"{root}: checkpoint is missing {prefix}.mlp.experts.{e}.{p}.weight "
                             f"(or Mixtral's block_sparse_moe.experts.{e}.{_HUB_NAME[p]}.weight)"
                             + (f" and {len(missing) - 1} more expert tensors" if len(missing) > 1 else ""))
        install(target, stack)
    return loaded


def to_hub_layout(state: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """``state`` with each stacked expert tensor replaced, in place in the order, by its per-expert hub tensors."""
    out: dict[str, torch.Tensor] = {}
    mixtral = model_type == "mixtral"
    for name, t in state.items():
        m = re.match(r"^(model\.layers\.\d+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)$", name)
        if m is None:
            out[name] = t
            continue
        prefix = m.group(1) + (".block_sparse_moe" if mixtral else ".mlp")
        if m.group(3) is None:  # the router
            out[f"{prefix}.gate.weight"] = t
            continue
        for e in range(t.shape[0]):
            if m.group(3) == "down_proj":
                pieces = {"down_proj": t[e]}
            else:
                half = t.shape[1] // 2
                pieces = {"gate_proj": t[e, :half], "up_proj": t[e, half:]}
            for part, piece in pieces.items():
                out[f"{prefix}.experts.{e}.{_HUB_NAME[part] if mixtral else part}.weight"] = piece
    return out
