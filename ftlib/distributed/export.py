"""Full-state export from a sharded run: the adapter (PEFT format) or the merged model (Hugging Face format).

Both are collective (call them on every rank at the same point), write from rank 0 only, and
write through the one-process functions, so the files are exactly theirs:

- ``export_adapter``: the adapter's shards are swapped for their gathered values
  (``DTensor.full_tensor``; an adapter is small: r * (in + out) per layer) and rank 0 calls
  ``ftlib.lora.save_adapter``; then the shards are put back.
- ``export_merged``: one layer at a time. For each adapted (or NF4) linear, every rank swaps the
  layer's shards for their gathered values, the layer's own code computes the merged weight
  (``LoRALinear.to_linear``: ``W + s B A`` in fp32, DoRA's ``m / ||W + s B A||`` per row, an NF4
  base dequantized), the shards go back, and rank 0 moves the result to host memory; other
  tensors (embeddings, norms, head) are gathered one by one. No GPU holds more than one whole
  layer beyond its shards. Rank 0 assembles the merged ``LlamaForCausalLM`` on the CPU (host
  memory: one copy of the merged weights, 16 GB for an 8B model in bf16) and calls
  ``ftlib.models.save_pretrained``: the files ``save_pretrained(merge_and_unload(model, dtype))``
  writes in one process, the same names, shards, index and config, and the same bits.

Under DDP (nothing sharded) only rank 0 computes; the others wait for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from .._dist import from_rank0, get_rank
from ..checkpoint.local import unwrap
from ..checkpoint.sharded import causal_lm

__all__ = ["export_adapter", "export_merged"]


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly sharded) tensor, on the device it computes on (collective for DTensors)."""
    if not _is_dtensor(t):
        return t.detach()
    from torch.distributed.tensor import DTensor

    mesh = t.device_mesh
    local = t.to_local()
    if local.device.type != mesh.device_type:  # CPU-offloaded shards: gather on the mesh's device
        t = DTensor.from_local(local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor().detach()


def _resharded(model: nn.Module) -> None:
    """Put every FSDP2 unit back in its sharded state (a forward without backward may leave one gathered)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _lora_model(model: nn.Module) -> nn.Module:
    from ..lora import get_lora_config

    inner = unwrap(model)
    for mod in inner.modules():
        try:
            get_lora_config(mod)
        except ValueError:
            continue
        return mod
    raise ValueError("the model has no LoRA adapters (ftlib.lora.apply_lora was not applied)")


@contextlib.contextmanager
def _gathered(module: nn.Module, names: set[str] | None = None):
    """Inside the block, ``module``'s sharded parameters (those named in ``names``, default all) are
    plain tensors holding their whole value; collective: every rank enters with the same arguments."""
    swapped = []
    try:
        for mod_name, mod in module.named_modules():
            for name, p in list(mod._parameters.items()):
                full_name = f"{mod_name}.{name}" if mod_name else name
                if p is not None and _is_dtensor(p) and (names is None or full_name in names):
                    swapped.append((mod, name, p))
                    mod._parameters[name] = nn.Parameter(_full(p), requires_grad=False)
        yield module
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p
        for mod in module.modules():
            if hasattr(mod, "_w_sq_cache"):
                mod._w_sq_cache = None  # DoRA's ||W||^2 cache saw the gathered tensor


def save_adapter_gathered(lm: nn.Module, path: str | os.PathLike, **save_kw) -> None:
    """``save_adapter(lm, path)`` on rank 0 with the adapter gathered; collective."""
    from ..lora import save_adapter
    from ..lora.peft_io import adapter_params

    with _gathered(lm, set(adapter_params(lm))):
        if get_rank() == 0:
            save_adapter(lm, path, **save_kw)


def export_adapter(model: nn.Module, path: str | os.PathLike, **save_kw) -> Path:
    """Write the adapter of a sharded (or DDP, or plain) model to ``path`` in PEFT's format, from rank 0.

    Collective: call on every rank. Keyword arguments go to ``ftlib.lora.save_adapter``
    (``base_model_name_or_path``, ``task_type``). Returns ``path`` on every rank once the files exist.
    """
    _resharded(model)
    save_adapter_gathered(_lora_model(model), path, **save_kw)
    from_rank0(None)  # every rank returns once rank 0 has written
    return Path(path)


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor, param: bool) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    if param:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


def export_merged(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                  max_shard_size: int | str = "5GB") -> list[str]:
    """Write the merged model (LoRA/QLoRA folded in; a full fine-tune as it is) in Hugging Face's layout.

    Collective: call on every rank. ``dtype`` as ``ftlib.lora.merge_and_unload``: None keeps each
    merged layer in its base's dtype and every other tensor in its own; a dtype converts every
    floating tensor. ``model`` may be the FSDP2 root, a DDP wrapper or a plain module containing
    the causal LM. Returns the files written (on every rank).
    """
    from ..lora.layers import LoRALinear
    from ..lora.nf4 import NF4Linear
    from ..models import LlamaForCausalLM, save_pretrained
    _resharded(model)
    lm, _ = causal_lm(model)
    config = getattr(lm, "config", None)
    if not hasattr(config, "to_hf_dict"):
        raise ValueError("export_merged: no causal LM with a Hugging Face config inside the model")
    rank = get_rank()
    sharded = any(_is_dtensor(p) for p in lm.parameters())
    names: list[str] = []
    if rank == 0 or sharded:
        head = getattr(lm, "lm_head", None)
        if config.tie_word_embeddings and isinstance(head, LoRALinear):
            config = dataclasses.replace(config, tie_word_embeddings=False)  # the merged head is its own
        out = None
        if rank == 0:
            with torch.device("meta"):
                out = LlamaForCausalLM(config)
        done: set[int] = set()
        for prefix, mod in _walk(lm, "", (LoRALinear, NF4Linear)):
            if isinstance(mod, (LoRALinear, NF4Linear)):
                with _gathered(mod):
                    lin = mod.to_linear(dtype)  # fp32 merge from the whole base and adapter
                if rank == 0:
                    _set_tensor(out, prefix + "weight", lin.weight.detach().cpu(), True)
                    if lin.bias is not None:
                        _set_tensor(out, prefix + "bias", lin.bias.detach().cpu(), True)
                del lin
                continue
            for name, p in mod._parameters.items():
                if p is None or id(p) in done:
                    continue  # a tied weight: tie_weights() shares it again below
                done.add(id(p))
                t = _full(p)
                if rank == 0:
                    t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
                    _set_tensor(out, prefix + name, t.cpu(), True)
            for name, b in mod._buffers.items():
                if b is not None and name not in mod._non_persistent_buffers_set:
                    t = _full(b)
                    if rank == 0:
                        _set_tensor(out, prefix + name, (t.to(dtype) if dtype is not None and t.is_floating_point()
                                                         else t).cpu(), False)
        if rank == 0:
            out.tie_weights()
            left = [n for n, p in out.named_parameters() if p.is_meta]
            if left:
                raise RuntimeError(f"export_merged: no value for {left[:5]} (a module ftlib cannot merge?)")
            names = save_pretrained(out, path, max_shard_size=max_shard_size)
            del out
    return from_rank0(names)  # also the barrier: the files exist when it returns


def _walk(module: nn.Module, prefix: str, leaves: tuple):
    """(name prefix, module) in ``named_modules`` order, not descending into ``leaves`` (merged whole)."""
    yield prefix, module
    if isinstance(module, leaves):
        return
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{name}.", leaves)
