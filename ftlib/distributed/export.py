"""Full-state export from a sharded run: the adapter (PEFT format) or the merged model (Hugging Face format).

Both are collective (call them on every rank at the same point) and write from rank 0 only:

- ``export_adapter``: each adapter tensor is gathered whole (``DTensor.full_tensor``; an adapter
  is small: r * (in + out) per layer) and rank 0 writes ``adapter_config.json`` +
  ``adapter_model.safetensors`` exactly as ``ftlib.lora.save_adapter`` does in one process.
- ``export_merged``: one layer at a time. For each adapted (or NF4) linear, every rank swaps the
  layer's shards for their gathered values, computes the merged weight with the layer's own code
  (``LoRALinear.to_linear``: ``W + s B A`` in fp32, DoRA's ``m / ||W + s B A||`` per row, the NF4
  base dequantized), puts the shards back and keeps nothing; other tensors (embeddings, norms,
  the head) are gathered one by one. So no GPU ever holds more than one whole weight matrix
  beyond its shards, and rank 0's host memory holds at most one output file (``max_shard_size``)
  before it is written. The files are those ``save_pretrained(merge_and_unload(model, dtype))``
  writes in one process: the same names, shards, index and config, and the same bits.

Under DDP (nothing sharded) only rank 0 computes; the others wait at the final barrier.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .._atomic import atomic_write

__all__ = ["export_adapter", "export_merged"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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
        local = local.to(mesh.device_type)
        t = DTensor.from_local(local, mesh, t.placements, shape=t.shape, stride=t.stride())
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
    from ..lora.apply import _CONFIG_ATTR

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    for mod in inner.modules():
        if getattr(mod, _CONFIG_ATTR, None) is not None:
            return mod
    raise ValueError("export_adapter: the model has no LoRA adapters (ftlib.lora.apply_lora was not applied)")


def _adapter_files(lm: nn.Module, base_model_name_or_path: str | None, task_type: str | None):
    """(PEFT-keyed CPU tensors, adapter_config.json text) of ``lm``'s adapter; collective, every rank gets them."""
    from ..lora.apply import get_lora_config
    from ..lora.peft_io import _PREFIX, _adapter_params, _model_name_or_path

    cfg = get_lora_config(lm)
    tensors = {_PREFIX + k: _full(p).to("cpu").contiguous().clone() for k, p in _adapter_params(lm).items()}
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else sorted(set(cfg.target_modules))
    d = cfg.to_peft_dict(targets, base_model_name_or_path or _model_name_or_path(lm), task_type)
    return tensors, json.dumps(d, indent=2, sort_keys=True) + "\n"


def export_adapter(model: nn.Module, path: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                   task_type: str | None = None) -> Path:
    """Write the adapter of a sharded (or DDP, or plain) model to ``path`` in PEFT's format, from rank 0.

    Collective: call on every rank. Returns ``path`` on every rank once the files exist.
    """
    from safetensors.torch import save_file

    from ..lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    path = Path(path)
    _resharded(model)
    tensors, text = _adapter_files(_lora_model(model), base_model_name_or_path, task_type)
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / ADAPTER_WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
        atomic_write(path / ADAPTER_CONFIG, lambda p: p.write_text(text))
    _barrier()
    return path


@contextlib.contextmanager
def _gathered(module: nn.Module):
    """Inside the block ``module``'s sharded parameters are plain tensors holding their whole value."""
    swapped = []
    try:
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and _is_dtensor(p):
                    swapped.append((mod, name, p))
                    mod._parameters[name] = nn.Parameter(_full(p), requires_grad=False)
        yield module
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p
        if hasattr(module, "_w_sq_cache"):
            module._w_sq_cache = None  # DoRA's ||W||^2 cache saw the gathered tensor


def _leaves(module: nn.Module, prefix: str, dtype):
    """(name, shape, dtype, make) of every tensor of the merged model, in ``state_dict`` order.

    ``make()`` returns the tensor's whole value (collective when sharded).
    """
    from ..lora.layers import LoRALinear
    from ..lora.nf4 import NF4Linear

    if isinstance(module, (LoRALinear, NF4Linear)):
        base = module.base_layer if isinstance(module, LoRALinear) else module
        out_dtype = dtype or (base.compute_dtype if isinstance(base, NF4Linear) else base.weight.dtype)
        shape = (module.out_features, module.in_features)

        made: dict[str, torch.Tensor] = {}  # weight and bias of one gather and merge

        def take(key, module=module, made=made):
            if not made:
                with _gathered(module):
                    lin = module.to_linear(dtype)
                made.update(weight=lin.weight.detach(), bias=None if lin.bias is None else lin.bias.detach())
            return made.pop(key)

        yield prefix + "weight", shape, out_dtype, lambda: take("weight")
        if base.bias is not None:
            yield prefix + "bias", (module.out_features,), out_dtype, lambda: take("bias")
        return
    for name, p in module._parameters.items():
        if p is not None:
            yield prefix + name, tuple(p.shape), p.dtype, lambda p=p: _full(p)
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, tuple(b.shape), b.dtype, lambda b=b: _full(b)
    for name, child in module._modules.items():
        if child is not None:
            yield from _leaves(child, f"{prefix}{name}.", dtype)


def export_merged(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = torch.bfloat16,
                  max_shard_size: int | str = "5GB") -> list[str]:
    """Write the merged model (LoRA/QLoRA folded in; a full fine-tune as it is) in Hugging Face's layout.

    Collective: call on every rank. ``dtype`` is that of the merged linear weights (None: the
    base's), other tensors keep theirs, as ``ftlib.lora.merge_and_unload``. Returns the files
    written (on every rank). ``model`` may be the FSDP2 root, a DDP wrapper or a plain module
    containing the causal LM.
    """
    from safetensors.torch import save_file

    from ..models.config import ARCHITECTURES
    from ..models.hub import _INDEX, _SINGLE, parse_size
    from .checkpoint import _causal_lm, _Comm

    _resharded(model)
    lm, _ = _causal_lm(model)
    config = getattr(lm, "config", None)
    if not hasattr(config, "to_hf_dict"):
        raise ValueError("export_merged: no causal LM with a Hugging Face config inside the model")
    sharded = any(_is_dtensor(p) for p in lm.parameters())
    rank = _rank()
    root = Path(path)
    names: list[str] = []
    if rank == 0 or sharded:
        leaves, seen = [], set()
        tied = getattr(config, "tie_word_embeddings", False)
        for name, shape, dt, make in _leaves(lm, "", dtype):
            if tied and name == "lm_head.weight":
                continue  # the config ties it back (as save_pretrained)
            if name not in seen:
                seen.add(name)
                leaves.append((name, shape, dt, make))
        limit = parse_size(max_shard_size)
        shards: list[list[int]] = [[]]
        size = 0
        for i, (_, shape, dt, _) in enumerate(leaves):
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            if shards[-1] and size + nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append(i)
            size += nbytes
        n = len(shards)
        names = [_SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if n > 1 and (root / _INDEX).exists():
                (root / _INDEX).unlink()  # as save_pretrained: a cut save must not load as a mix
        total = 0
        for fname, idxs in zip(names, shards):
            tensors = {}
            for i in idxs:
                name, shape, dt, make = leaves[i]
                t = make()  # every rank takes part in the gather
                if rank == 0:
                    if tuple(t.shape) != tuple(shape) or t.dtype != dt:
                        raise RuntimeError(f"export_merged: {name} came out {tuple(t.shape)} {t.dtype}, "
                                           f"planned {shape} {dt}")
                    tensors[name] = t.detach().to("cpu").contiguous()
                    total += t.numel() * t.element_size()
                del t
            if rank == 0:
                atomic_write(root / fname, lambda p, ts=tensors: save_file(ts, str(p), metadata={"format": "pt"}))
        if rank == 0:
            if n > 1:
                index = {"metadata": {"total_size": total},
                         "weight_map": {leaves[i][0]: fname for fname, idxs in zip(names, shards) for i in idxs}}
                atomic_write(root / _INDEX, lambda p: p.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n"))
                names.append(_INDEX)
            cfg = {"architectures": [ARCHITECTURES[config.model_type]], **config.to_hf_dict()}
            dtypes = {dt for _, _, dt, _ in leaves if dt.is_floating_point}
            if len(dtypes) == 1:
                cfg["torch_dtype"] = cfg["dtype"] = str(dtypes.pop()).removeprefix("torch.")
            atomic_write(root / "config.json", lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"))
            names.append("config.json")
            for old in root.glob("model*.safetensors*"):
                if old.name not in names and (old.name == _INDEX or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors",
                                                                               old.name)):
                    old.unlink()
    return _Comm(None).from_rank0(names)  # also the barrier: the files exist when it returns
