"""Load and save Hugging Face checkpoints: config.json + (sharded) safetensors + index.

Format (the layout ``transformers`` reads and writes):

    config.json                          model_type, sizes, architectures, dtype
    model.safetensors                    all tensors, or, above the shard size,
    model-00001-of-0000N.safetensors     shards, and
    model.safetensors.index.json         {"metadata": {"total_size": bytes},
                                          "weight_map": {tensor name: shard file}}

Safetensors spec: https://huggingface.co/docs/safetensors (8-byte header
length, JSON header of dtype/shape/offsets, raw little-endian data).

Memory when loading: the model is built on the ``meta`` device (no storage),
then each tensor is allocated once with its final shape and read from the file
into that storage (``_safetensors_io``: no memory map, no intermediate buffer),
converted to the target dtype and moved to the target device, and installed as
the parameter. There is never a float32 model beside a state dict: host memory
peaks at one copy of the weights in the target dtype plus the tensor in flight
(and its converted copy when the dtype changes). An 8B bf16 checkpoint loaded
to CPU in bf16 peaks near its 16 GB of weights; loaded to a GPU, host memory
holds one tensor at a time (the largest, the embedding, is ~1 GB).
``benchmarks/bench_load.py`` measures it against the naive recipe.

Every file ``save_pretrained`` writes goes to a temporary name in the target
directory and is renamed into place; the index (when sharded) is written after
the shards it names, and stale weight files from an earlier save are removed.
Any save (sharded or one file) over an earlier sharded one removes the old index
before writing a weight file, so a crash in the middle leaves a directory that
fails to load or holds the new weights, never the old shards under the old index
or a mix of two saves.

MoE checkpoints: the hub's per-expert tensors (``...mlp.experts.{e}.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.{e}.w1``) are read into the stacked in-memory weights and written back
per expert (``ftlib.models.moe_hub``), as transformers 5.25 writes them.

``save_pretrained`` writes only the tensor names of a plain ``LlamaForCausalLM``:
a model with unmerged adapters (``base_layer`` / ``lora_A`` names) or NF4 weights
is refused, because ``transformers`` would load those layers randomly initialised.
``load_pretrained`` records its source as ``model.name_or_path`` (an adapter saved
from the model names its base, as PEFT's ``base_model_name_or_path``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from .._atomic import atomic_write
from .._fields import json_dict
from ._safetensors_io import SafetensorsReader
from .config import ARCHITECTURES, LlamaConfig
from .llama import LlamaForCausalLM
from .moe_hub import is_hub_expert_tensor, read_expert_weights, to_hub_layout
from .tokenizer import load_tokenizer, resolve_model_dir

__all__ = ["load_config", "load_pretrained", "load_tokenizer", "parse_size", "save_pretrained"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # old checkpoints saved the RoPE buffer
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_config(path_or_repo_id: str | os.PathLike) -> LlamaConfig:
    """``LlamaConfig`` from a config.json file, the local directory holding one, or a hub repo id.

    The one config reader: ``ftlib.distributed.estimate_memory`` and ``load_pretrained`` use it too."""
    p = Path(path_or_repo_id)
    if p.is_file():
        return read_config(p)
    return read_config(resolve_model_dir(path_or_repo_id) / "config.json")


def read_config(path: Path) -> LlamaConfig:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: config.json not found")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return LlamaConfig.from_hf_dict(d, source=str(path))


def weight_files(root: Path) -> dict[str, list[str]]:
    """{file path: [tensor names the index assigns to it]}; one file without an index maps to []."""
    index = root / _INDEX
    if index.is_file():
        try:
            d = json.loads(index.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{index}: not a safetensors index (need a 'weight_map' object): {e}") from None
        if not isinstance(d, dict) or "weight_map" not in d:
            raise ValueError(f"{index}: not a safetensors index (need a 'weight_map' object)")
        weight_map = json_dict(d, "weight_map", str(index))
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or not fname or os.path.basename(fname) != fname:
                raise ValueError(f"{index}: field weight_map[{name!r}] must be a shard file name in this folder, "
                                 f"got {fname!r}")
            files.setdefault(str(root / fname), []).append(name)
        for f in files:
            if not os.path.isfile(f):
                raise FileNotFoundError(f"{index}: names shard {os.path.basename(f)}, which is missing")
        return files
    single = root / _SINGLE
    if single.is_file():
        return {str(single): []}
    raise FileNotFoundError(f"{root}: no {_SINGLE} or {_INDEX} (only safetensors checkpoints are loaded)")


def is_ignored(name: str) -> bool:
    """True for a tensor name loaders pass over (the RoPE ``inv_freq`` buffer old checkpoints saved)."""
    return bool(_IGNORED.search(name))


def checkpoint_tensors(root: Path) -> Iterator[tuple[str, SafetensorsReader, str]]:
    """(file, open reader, tensor name) for every tensor stored under ``root``, file by file.

    Checks what every loader needs: each file holds the names the index assigns to it, and no name is
    stored twice. Names ``is_ignored`` passes over are not yielded. The reader is open while its
    names are yielded.
    """
    seen: dict[str, str] = {}
    for fname, listed in weight_files(root).items():
        with SafetensorsReader(fname) as f:
            names = f.keys()
            missing_listed = sorted(set(listed) - set(names))
            if missing_listed:
                raise ValueError(f"{fname}: the index lists tensors this file lacks: {missing_listed[:5]}")
            for name in names:
                if is_ignored(name):
                    continue
                if name in seen:
                    raise ValueError(f"{fname}: tensor {name!r} also stored in {seen[name]}")
                seen[name] = fname
                yield fname, f, name


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Install ``value`` as the parameter/buffer ``name`` (replacing a meta tensor)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        old = mod._parameters[attr]
        mod._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        mod._buffers[attr] = value


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype or its name ("bfloat16", "float16", "float32"); None stays None."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def read_weights(model: nn.Module, root: Path, expected: dict[str, torch.Tensor], *, dtype: torch.dtype | None,
                  device: torch.device, what: str, skip: Callable[[str], bool]) -> dict[str, str]:
    """Read every checkpoint tensor under ``root`` into the meta-built ``model``, one tensor in flight.

    Tensors matched by ``_IGNORED`` or ``skip(name)`` are passed over; any other name must be in
    ``expected`` (its shape too), stored once, and listed files must hold what the index lists.
    Returns {tensor name: file it came from}; the caller checks what is missing.
    """
    loaded: dict[str, str] = {}
    for fname, f, name in checkpoint_tensors(root):
        if skip(name):
            continue
        if name not in expected:
            raise ValueError(f"{fname}: unexpected tensor {name!r} (not part of {what})")
        want, got = tuple(expected[name].shape), f.shape(name)
        if got != want:
            raise ValueError(f"{fname}: tensor {name!r} has shape {got}, the config expects {want}")
        t = f.read(name).to(device)  # one tensor in flight; on a GPU the cast below runs there
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        set_tensor(model, name, t)
        loaded[name] = fname
    return loaded


def load_pretrained(path_or_repo_id: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None) -> LlamaForCausalLM:
    """Build a ``LlamaForCausalLM`` from a checkpoint directory or hub repo id.

    ``dtype`` (torch dtype or "bfloat16"/"float16"/"float32"): target dtype of every
    floating tensor; None keeps each tensor's stored dtype. ``device``: target
    device (default CPU). A repo id is fetched through ``huggingface_hub`` (its
    cache; no network when already cached). Raises with the file and tensor name
    on a missing or unexpected tensor, a shape mismatch or a corrupt file.
    """
    dtype, device = resolve_dtype(dtype), torch.device(device if device is not None else "cpu")
    root = resolve_model_dir(path_or_repo_id)
    config = read_config(root / "config.json")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = dict(model.state_dict(keep_vars=True))
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    moe = config.num_experts > 0  # the hub's per-expert tensors are stacked by read_expert_weights
    loaded = read_weights(model, root, expected, dtype=dtype, device=device, what=f"a {config.model_type} model",
                           skip=lambda name: (name == "lm_head.weight" and config.tie_word_embeddings)
                           or (moe and is_hub_expert_tensor(name)))
    if moe:
        loaded.update(read_expert_weights(checkpoint_tensors(root), lambda name, t: set_tensor(model, name, t),
                                          root, expected, dtype=dtype, device=device))

    missing = sorted(set(expected) - set(loaded))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{root}: checkpoint is missing tensors {missing[:5]}{more}")
    model.tie_weights()
    model.name_or_path = str(path_or_repo_id)  # as transformers' name_or_path: save_adapter records it
    return model


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "10KB", "2GiB" (GB = 10**9, GiB = 2**30)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a string like '5GB'")
    unit = (m.group(2) or "B").upper()
    power = " KMGT".index(unit[0]) if unit != "B" else 0
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base**power)


def _check_plain_names(state: dict, model: nn.Module, root: Path) -> None:
    """Refuse tensor names a fresh model of ``model``'s class lacks (adapters, NF4 weights, extra modules).

    The class is the model's own (``LlamaForCausalLM``, or a head such as the reward model's), built
    on the meta device from the config; adapters and NF4 layers replace modules, not the class.
    """
    config: LlamaConfig = model.config
    with torch.device("meta"):
        expected = set(type(model)(config).state_dict())
    extra = [k for k in state if k not in expected]
    if not extra:
        return
    shown = ", ".join(extra[:3]) + (f" (+{len(extra) - 3} more)" if len(extra) > 3 else "")
    adapted = [k for k in extra if re.search(r"(^|\.)(base_layer|lora_[AB]|lora_magnitude_vector)(\.|$)", k)
               or k.rsplit(".", 1)[-1] in ("codes", "absmax", "absmax2", "absmax_code", "offset")]
    if adapted:
        raise ValueError(
            f"{root}: the model has unmerged adapters or NF4 weights ({shown}); transformers would load those "
            "layers randomly initialised. Merge first (ftlib.lora.merge_and_unload(model)) or save the adapter "
            "alone (ftlib.lora.save_adapter)"
        )
    raise ValueError(f"{root}: tensors that are not part of a {config.model_type} model: {shown}")


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and alone in its storage (a view of a stacked expert tensor is copied)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def save_pretrained(model: LlamaForCausalLM, path: str | os.PathLike, max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``model`` in the Hugging Face layout ``transformers`` loads; return the files written.

    Refuses (ValueError) a model whose tensor names are not a plain ``LlamaForCausalLM``'s, e.g.
    one with unmerged adapters: "merge first (merge_and_unload) or save_adapter". Tensors are
    copied to CPU one shard at a time. A tied ``lm_head.weight`` is
    not stored (the config says tie_word_embeddings). Shards are written in
    state_dict order, a new shard starting when the next tensor would pass
    ``max_shard_size``.
    """
    from safetensors.torch import save_file

    config: LlamaConfig = model.config
    root = Path(path)
    limit = parse_size(max_shard_size)
    state = model.state_dict()
    _check_plain_names(state, model, root)
    root.mkdir(parents=True, exist_ok=True)
    if config.tie_word_embeddings:
        head, emb = state.pop("lm_head.weight", None), state.get("model.embed_tokens.weight")
        if head is not None and emb is not None and head.data_ptr() != emb.data_ptr() and not torch.equal(head, emb):
            # a loader rebuilds lm_head from the embedding: the trained head would be lost silently
            raise ValueError(f"{root}: config says tie_word_embeddings=True, but lm_head.weight differs from "
                             "model.embed_tokens.weight; re-tie them or set tie_word_embeddings=False")
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if config.num_experts:  # stacked experts -> the hub's per-expert tensors (views)
        state = to_hub_layout(state, config.model_type)

    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    names = [_SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    if (root / _INDEX).exists():
        # The old index would bind new shards to old ones of the same names, or (for a one-file
        # save) win over the new model.safetensors, if a crash cut this save short; without it, a
        # half-written save fails to load instead of loading the old model or a mix.
        (root / _INDEX).unlink()
    written = []
    for fname, keys in zip(names, shards):
        tensors = {k: _own(state[k].detach().to("cpu")) for k in keys}
        atomic_write(root / fname, lambda tmp, tensors=tensors: save_file(tensors, str(tmp), metadata={"format": "pt"}))
        written.append(fname)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {k: fname for fname, keys in zip(names, shards) for k in keys},
        }
        atomic_write(root / _INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n"))
        written.append(_INDEX)

    cfg = {"architectures": [ARCHITECTURES[config.model_type]], **config.to_hf_dict()}
    if len(dtypes) == 1:
        dtype_name = str(dtypes.pop()).removeprefix("torch.")
        cfg["torch_dtype"] = cfg["dtype"] = dtype_name
    atomic_write(root / "config.json", lambda tmp: tmp.write_text(json.dumps(cfg, indent=2) + "\n"))
    written.append("config.json")

    # weight files of an earlier save into this directory would be read in place of ours
    for old in root.glob("model*.safetensors*"):
        if old.name not in written and (old.name == _INDEX or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", old.name)):
            old.unlink()
    return written
