"""Sharded loading and meta-device initialisation: each rank materialises only its own FSDP2 shards.

The model is built on the ``meta`` device (shapes, no storage), adapted (LoRA, NF4 shells for
QLoRA) and sharded there with ``shard_model``; ``materialize_sharded`` then allocates each rank's
shards (``to_empty``) and fills them, one tensor in flight, from a *full-tensor source*:

    rows(name, i, j)   rows i..j-1 (dim 0) of the full tensor ``name``
    full(name)         the whole tensor, on the ranks that have it

FSDP2 keeps row chunk r of every parameter on shard rank r (``torch.chunk`` sizes along dim 0):

    c = ceil(n / S),   rows of rank r = [min(r c, n), min((r + 1) c, n))

(HSDP: r is the rank's coordinate on the mesh's shard dim, the same rows on every replica.)

Sources. *A safetensors checkpoint*: a row-major tensor's row chunk is one contiguous byte range,
``[i, j) * row_bytes``, so each rank reads exactly its chunk (``SafetensorsReader.read_rows``: no
memory map, no whole tensor), converts it to the model's dtype (elementwise, so rows commute with
the cast) and copies it into its shard. *The constructor's random initialisation* (full fine-tuning
from a config): every rank replays the one-process constructor's RNG draws in the same order on the
CPU generator, one module at a time (first the draws ``nn.Linear`` / ``nn.Embedding`` make when
constructed, then the model's ``reset_parameters``), and keeps its rows, so the sharded model equals
``torch.manual_seed(s); LlamaForCausalLM(config)`` bit for bit. *LoRA adapters*: every rank replays
``LoRALinear``'s own constructor (on a storage-free stand-in base) in ``apply_lora``'s order, so A
equals the one-process draw for the same seed (B is zero). One machinery fills all three.

NF4 (QLoRA). An ``NF4Linear``'s parameters are flat: codes (2 per byte) and per-block absmax over
the row-major flattened weight, chunked by FSDP2 independently of each other and of the weight's
rows, and double quantization subtracts the mean of *all* the layer's absmax. A rank's codes chunk
therefore cannot be computed from its weight rows alone. So for a checkpoint, global rank 0 reads
the layer's full weight, converts and quantizes it exactly as ``apply_lora`` does in one process,
and scatters each NF4 tensor's padded row chunks (one layer at a time); every rank's share stays
NF4. From a config every rank has the full weight anyway (it generated it), so each quantizes
locally and keeps its rows (no communication).

Memory per rank: its share of the model (allocated once by ``to_empty``), plus one tensor's rows in
flight (none when stored and model dtype agree on the CPU: read straight into the shard), plus on
rank 0 one full layer weight and its NF4 copy while quantizing; from a config, one full module.
``tests/distributed/test_sharded_load.py`` measures peak RSS per rank against that bound.

Resuming from a sharded checkpoint (``ftlib.checkpoint.load_checkpoint``) already keeps to the
shards: DCP reads each rank's chunks into the DTensors ``get_model_state_dict`` returns (the shards
themselves); the test measures it too.

References: torchtitan (meta-device model, ``fully_shard``, ``to_empty``, then init/load into the
local shards); torchtune's ``load_from_full_model_state_dict`` (keep each rank's chunk of a full
tensor); Answer.AI, "You can now train a 70b language model at home" (2024), FSDP + QLoRA with
quantized shards loaded layer by layer.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .._dist import get_rank, get_world_size, is_distributed
from ..checkpoint.sharded import causal_lm
from ..lora import LoRAConfig, LoRALinear, NF4Linear, apply_lora, get_lora_config, lora_layers
from ..models import LlamaConfig, LlamaForCausalLM
from ..models.hub import checkpoint_tensors, read_config, resolve_dtype
from ..models.tokenizer import resolve_model_dir
from .sharding import shard_model

__all__ = ["init_sharded", "load_sharded", "materialize_sharded", "meta_model", "shard_rows"]

_SOURCE = "_ftlib_source"  # on a meta-built model: (config as built, checkpoint dir or None)


def meta_model(source: str | os.PathLike | LlamaConfig, *, dtype: torch.dtype | str | None = None) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` on the ``meta`` device from a checkpoint directory / repo id or a config.

    ``dtype``: the dtype its floating parameters will have (from a checkpoint, None keeps fp32 here;
    the stored dtype is cast on reading). Adapt it (``apply_lora``) and shard it (``shard_model(...,
    sync_module_states=False)``), then ``materialize_sharded``.
    """
    dtype = resolve_dtype(dtype)
    if isinstance(source, LlamaConfig):
        config, root = source, None
    else:
        root = resolve_model_dir(source)
        config = read_config(root / "config.json")
    with torch.device("meta"):
        model = LlamaForCausalLM(copy.deepcopy(config))
    if dtype is not None:
        model.to(dtype)
    object.__setattr__(model, _SOURCE, (copy.deepcopy(config), root))
    if root is not None:
        model.name_or_path = str(source)
    return model


def _chunk(n: int, s: int, r: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``torch.chunk``'s chunk ``r`` of ``n`` rows in ``s`` chunks (empty past the end)."""
    c = -(-n // s)
    return min(r * c, n), min(r * c + c, n)


def shard_rows(t: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(start, stop, local): the rows of dim 0 this rank holds of parameter ``t`` and its local tensor.

    A DTensor sharded on dim 0 (FSDP2, HSDP) holds ``torch.chunk``'s chunk at the rank's coordinate on
    the sharding mesh dim; a replicated DTensor or a plain tensor holds every row.
    """
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        local = t.to_local()
        n = t.shape[0] if t.dim() else 1
        start, stop = 0, n
        for i, pl in enumerate(t.placements):
            if pl.is_shard():
                if pl.dim != 0:
                    raise ValueError(f"shard_rows: tensor sharded on dim {pl.dim}; FSDP2 shards dim 0")
                start, stop = _chunk(n, t.device_mesh.size(i), t.device_mesh.get_local_rank(i))
        if (local.shape[0] if local.dim() else 1) != stop - start:
            raise RuntimeError(f"shard_rows: local shard has {local.shape[0]} rows, torch.chunk gives {stop - start}")
        return start, stop, local
    return 0, (t.shape[0] if t.dim() else 1), t.data


def _shard_coords(t: torch.Tensor) -> tuple[int, dict[int, int]]:
    """(S, {global rank: its coordinate on the shard dim}) of a DTensor sharded on dim 0."""
    dims = [i for i, pl in enumerate(t.placements) if pl.is_shard()]
    if not dims:
        return 1, {g: 0 for g in range(get_world_size())}
    grid, d = t.device_mesh.mesh, dims[0]
    inner = 1
    for s in grid.shape[d + 1:]:
        inner *= s
    return grid.shape[d], {int(g): (k // inner) % grid.shape[d] for k, g in enumerate(grid.flatten().tolist())}


class _Filler:
    """Fills a model's (sharded, just allocated) parameters from full-tensor sources; tracks what it filled."""

    def __init__(self, lm: nn.Module, where: str):
        self.lm, self.where = lm, where
        self.filled: set[int] = set()

    def route(self, name: str) -> tuple[str, object] | None:
        """Where checkpoint/constructor tensor ``name`` goes: ("param", p), ("nf4", NF4Linear) or None."""
        mod_name, _, attr = name.rpartition(".")
        try:
            mod = self.lm.get_submodule(mod_name)
        except AttributeError:
            return None
        if isinstance(mod, LoRALinear):
            mod = mod.base_layer
        if isinstance(mod, NF4Linear):
            if attr == "weight":
                return "nf4", mod
            return ("param", mod._parameters[attr]) if mod._parameters.get(attr) is not None else None
        p = mod._parameters.get(attr)
        return ("param", p) if p is not None else None

    def param_rows(self, p: torch.Tensor, rows: Callable[[int, int, torch.Tensor | None], torch.Tensor]) -> None:
        """Copy rows ``start:stop`` (``rows(start, stop, out)``; ``out`` a CPU shard to read into, or None)."""
        start, stop, local = shard_rows(p)
        with torch.no_grad():
            direct = local.device.type == "cpu" and local.is_contiguous() and local.dim() > 0
            got = rows(start, stop, local if direct else None)
            if got is not local:
                local.copy_(got.reshape(local.shape))
        self.filled.add(id(p))

    def scatter_rows(self, p: torch.Tensor, full: torch.Tensor | None) -> None:
        """Rank 0 holds ``full``; every rank receives its row chunk of it (padded ``dist.scatter``)."""
        start, stop, local = shard_rows(p)
        s, coords = _shard_coords(p) if hasattr(p, "placements") else (1, {0: 0})
        n = p.shape[0]
        c = -(-n // s)
        buf = torch.empty((c, *p.shape[1:]), dtype=local.dtype, device=local.device)
        pieces = None
        if get_rank() == 0:
            full = full.to(local.device)
            pieces = []
            for g in range(get_world_size()):
                piece = torch.zeros_like(buf)
                a, b = _chunk(n, s, coords[g])
                piece[: b - a] = full[a:b]
                pieces.append(piece)
        if is_distributed() and get_world_size() > 1:
            dist.scatter(buf, pieces, src=0)
        else:
            buf = pieces[0]
        with torch.no_grad():
            local.copy_(buf[: stop - start])
        self.filled.add(id(p))

    def nf4(self, layer: NF4Linear, full: torch.Tensor | None, *, everywhere: bool, name: str) -> None:
        """Quantize the full weight as ``apply_lora`` does in one process; fill each NF4 tensor's rows.

        ``everywhere``: every rank holds ``full`` (quantize locally, keep rows); else rank 0 does and
        scatters.
        """
        quantized = None
        if everywhere or get_rank() == 0:
            w = full.to(layer.compute_dtype)
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"{self.where}: tensor {name!r} has non-finite values; cannot quantize it to NF4")
            lin = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            quantized = NF4Linear.from_linear(lin, blocksize=layer.blocksize, double_quant=layer.double_quant)
            del w, lin
        for pname, p in list(layer._parameters.items()):
            if p is None or pname == "bias":
                continue
            if everywhere:
                src = quantized._parameters[pname].detach()
                self.param_rows(p, lambda a, b, out, src=src: src[a:b])
            else:
                self.scatter_rows(p, None if quantized is None else quantized._parameters[pname].detach())
        del quantized


def _tied(model: nn.Module) -> bool:
    src = getattr(model, _SOURCE, None)
    cfg = src[0] if src else getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False))


def _head_also(f: _Filler, name: str, tied: bool) -> list[tuple[str, object]]:
    """Targets of ``name``; a tied source's embedding also fills an untied head (``modules_to_save``)."""
    targets = [t for t in [f.route(name)] if t is not None]
    if tied and name == "model.embed_tokens.weight":
        head = f.route("lm_head.weight")
        if head is not None and (head[0] != "param" or all(head[1] is not t[1] for t in targets)):
            targets.append(head)
    return targets


def _fill_from_checkpoint(f: _Filler, root: Path, tied: bool) -> None:
    for fname, r, name in checkpoint_tensors(root):
        if tied and name == "lm_head.weight":
            continue
        targets = _head_also(f, name, tied)
        if not targets:
            raise ValueError(f"{fname}: unexpected tensor {name!r} (not part of the model)")
        got = r.shape(name)
        for kind, t in targets:
            want = (t.out_features, t.in_features) if kind == "nf4" else tuple(t.shape)
            if got != want:
                raise ValueError(f"{fname}: tensor {name!r} has shape {got}, the config expects {want}")
            if kind == "nf4":
                f.nf4(t, r.read(name) if get_rank() == 0 else None, everywhere=False, name=f"{fname}:{name}")
                continue
            stored = r.dtype(name)

            def rows(a, b, out, r=r, name=name, stored=stored, t=t):
                if out is not None and out.dtype == stored:
                    return r.read_rows(name, a, b, out=out)
                return r.read_rows(name, a, b).to(t.dtype)

            f.param_rows(t, rows)


def _twin(m: nn.Module) -> nn.Module:
    """A full-size CPU copy of leaf module ``m`` (uninitialised storage), for one module's draws."""
    return copy.deepcopy(m).to_empty(device="cpu")


def _constructor_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the one-process ``LlamaForCausalLM(config)``, in its RNG order, one module at
    a time: first the draws each ``nn.Linear`` / ``nn.Embedding`` makes in its constructor (discarded: the
    model's ``reset_parameters`` overwrites them, but they advance the generator), then that
    ``reset_parameters`` module by module. Construction order is ``named_modules`` order."""
    config = getattr(model, _SOURCE, (model.config, None))[0]
    with torch.device("meta"):
        plain = type(model)(copy.deepcopy(config)) if hasattr(type(model), "init_module") else None
    if plain is None:
        raise TypeError(f"init from a config needs a model class with init_module(); got {type(model).__name__}")
    mods = [(n, m) for n, m in plain.named_modules() if any(True for _ in m.parameters(recurse=False))]
    for _, m in mods:
        if hasattr(m, "reset_parameters"):
            _twin(m).reset_parameters()  # the constructor's own draws, advancing the generator
    for name, m in mods:
        twin = _twin(m)
        plain.init_module(twin)
        for pname, t in twin.named_parameters(recurse=False):
            yield f"{name}.{pname}", t.detach()
        del twin


def _fill_from_constructor(f: _Filler, model: nn.Module, tied: bool) -> None:
    for name, full in _constructor_tensors(model):
        if tied and name == "lm_head.weight":
            continue  # drawn (as in one process) then replaced by the tied embedding
        targets = _head_also(f, name, tied)
        if not targets:
            raise ValueError(f"{name}: constructor tensor with no place in the model")
        for kind, t in targets:
            if kind == "nf4":
                f.nf4(t, full, everywhere=True, name=name)
            else:
                f.param_rows(t, lambda a, b, out, full=full, t=t: full[a:b].to(t.dtype))


def _fill_adapters(f: _Filler, lm: nn.Module) -> None:
    """LoRA A/B as ``apply_lora`` draws them in one process: ``LoRALinear``'s constructor per layer, in order."""
    layers = list(lora_layers(lm))
    init = get_lora_config(lm).init if layers else "kaiming"
    for _, layer in layers:
        a = layer.lora_A.weight
        stand_in = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        # a CPU base with no storage: the adapters are created on the CPU, drawing from its generator
        stand_in.weight = nn.Parameter(torch.zeros((), dtype=a.dtype).expand(layer.out_features, layer.in_features),
                                       requires_grad=False)
        twin = LoRALinear(stand_in, layer.r, layer.alpha, use_rslora=layer.use_rslora, init=init, adapter_dtype=a.dtype)
        for sub in ("lora_A", "lora_B"):
            src = getattr(twin, sub).weight.detach()
            f.param_rows(getattr(layer, sub).weight, lambda i, j, out, src=src: src[i:j])
        del twin


def materialize_sharded(root: nn.Module, *, checkpoint: str | os.PathLike | None = None,
                        device: torch.device | str | None = None, seed: int | None = None) -> nn.Module:
    """Allocate this rank's shards of the meta-built, sharded ``root`` and fill them; return ``root``.

    ``checkpoint``: a Hugging Face safetensors directory / repo id (default: the one ``meta_model`` was
    built from; none: the constructor's random initialisation, replayed). LoRA adapters (``apply_lora``
    on the meta model) get the one-process draws. ``seed``: ``torch.manual_seed(seed)`` first (else the
    current CPU generator, which must agree on every rank). ``device``: where the shards live (default
    the current CUDA device, else CPU). Every rank must see the same files.
    """
    lm, _ = causal_lm(root)
    if any(not p.is_meta for p in root.parameters()):
        raise ValueError("materialize_sharded: the model has parameters off the meta device; build it with "
                         "ftlib.distributed.meta_model")
    if any(layer.use_dora for _, layer in lora_layers(lm)):
        raise NotImplementedError("materialize_sharded: DoRA's magnitude vector needs the full base weight; load "
                                  "DoRA models with load_pretrained + apply_lora + shard_model")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    src = getattr(lm, _SOURCE, None)
    path = checkpoint if checkpoint is not None else (src[1] if src else None)
    tied = _tied(lm)
    if seed is not None:
        torch.manual_seed(seed)
    root.to_empty(device=device)
    f = _Filler(lm, str(path) if path is not None else "config")
    adapters = {id(p) for _, layer in lora_layers(lm) for p in (layer.lora_A.weight, layer.lora_B.weight)}
    if path is not None:
        dir_ = resolve_model_dir(path)
        if src is not None and src[1] is None:
            tied = bool(read_config(dir_ / "config.json").tie_word_embeddings)
        _fill_from_checkpoint(f, dir_, tied)
    else:
        _fill_from_constructor(f, lm, tied)
    _fill_adapters(f, lm)
    missing = [n for n, p in lm.named_parameters() if id(p) not in f.filled and id(p) not in adapters]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{f.where}: checkpoint is missing tensors {missing[:5]}{more}")
    return root


def _build(source, *, dtype, lora_config: LoRAConfig | None, wrap, mesh, grad_ckpt: bool, **shard_kwargs):
    model = meta_model(source, dtype=dtype)
    if grad_ckpt:
        model.set_gradient_checkpointing(every=1, part="block")
    if lora_config is not None:
        apply_lora(model, lora_config, verbose=False)
    root = wrap(model) if wrap is not None else model
    root = shard_model(root, mesh=mesh, sync_module_states=False, **shard_kwargs)
    return model, root


def load_sharded(path: str | os.PathLike, *, dtype: torch.dtype | str | None = None, device=None,
                 lora_config: LoRAConfig | None = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
                 mesh=None, seed: int | None = None, grad_ckpt: bool = False,
                 **shard_kwargs) -> tuple[LlamaForCausalLM, nn.Module]:
    """(model, sharded root): a checkpoint loaded straight into FSDP2 shards, no whole model on any rank.

    ``lora_config``: adapters (``quantize="nf4"``: QLoRA, NF4 shards) as ``apply_lora`` would add them.
    ``wrap``: the module whose forward the loop calls, built around the model before sharding (e.g.
    ``CausalLMLoss``). ``mesh`` and the other keywords go to ``shard_model``. ``seed``: see
    ``materialize_sharded``. The result equals ``load_pretrained(path, dtype)`` + ``apply_lora`` +
    ``shard_model`` in one process with the same seed.
    """
    model, root = _build(path, dtype=dtype, lora_config=lora_config, wrap=wrap, mesh=mesh, grad_ckpt=grad_ckpt,
                         **shard_kwargs)
    materialize_sharded(root, checkpoint=path, device=device, seed=seed)
    return model, root


def init_sharded(config: LlamaConfig, *, dtype: torch.dtype | str | None = None, device=None,
                 lora_config: LoRAConfig | None = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
                 mesh=None, seed: int | None = None, grad_ckpt: bool = False,
                 **shard_kwargs) -> tuple[LlamaForCausalLM, nn.Module]:
    """(model, sharded root) from a config alone: equal to ``torch.manual_seed(seed); LlamaForCausalLM(config)``
    (then ``.to(dtype)``, ``apply_lora``) in one process, each rank holding only its shards."""
    model, root = _build(config, dtype=dtype, lora_config=lora_config, wrap=wrap, mesh=mesh, grad_ckpt=grad_ckpt,
                         **shard_kwargs)
    materialize_sharded(root, checkpoint=None, device=device, seed=seed)
    return model, root

