"""The sharded layout: which tensors go into the shards, under which names, and the per-rank files.

A sharded checkpoint (written by ``ftlib.distributed.ShardedCheckpointer``, read by
``ftlib.checkpoint.load_checkpoint``) is a step directory of the common format with
``state.json`` saying ``"model_kind": "sharded"``:

    shards/shard-00001-model-00001-of-00001.safetensors   rank 0's chunks (torch DCP, safetensors: each
    shards/shard-00002-model-00001-of-00001.safetensors   tensor's local chunk, its offsets in the header)
    adapter_config.json        LoRA runs: the whole adapter in PEFT's format (gathered by rank 0)
    adapter_model.safetensors
    state.json                 rank 0: step, world size, every saved tensor's global shape, optimizer
    state.safetensors          structure and wrapper state, schedule, clipper, loss scaler, metrics, extra
    rank-00000.json            per rank: the loader's position and the Python/NumPy RNG states,
    rank-00000.safetensors     and the torch CPU/CUDA RNG states
    COMPLETE                   the marker

The shards hold ``model.<name>`` for every trainable tensor (LoRA runs: adapters and
``modules_to_save``; full fine-tuning: every weight) under its name inside the causal LM
(Hugging Face names, the same whatever wraps the model: FSDP root, DDP, a loss module), and
``optim.<name>.<key>`` for every tensor of the optimizer's state
(``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``: keyed by parameter name,
not position, so any sharding reads any other). DCP's default ``.metadata`` file is a pickle;
the safetensors storage (``HuggingFaceStorageWriter`` / ``Reader``) keeps the chunk offsets in
each file's JSON header instead.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from .local import unwrap

__all__ = [
    "KIND",
    "causal_lm",
    "listed_shards_reader",
    "model_tensors",
    "optimizer_parts",
    "quiet_single_process",
    "rank_file",
    "tensor_meta",
    "train_optimizer_parts",
]

KIND = "sharded"


def rank_file(rank: int, ext: str) -> str:
    """``rank-00003.json``: the per-rank file of ``rank``."""
    return f"rank-{rank:05d}.{ext}"


def causal_lm(model: nn.Module) -> tuple[nn.Module, str]:
    """(the causal LM inside ``model``, its name prefix): the first module with a Hugging Face config."""
    for name, mod in unwrap(model).named_modules():
        if hasattr(getattr(mod, "config", None), "to_hf_dict"):
            return mod, (name + "." if name else "")
    return unwrap(model), ""


def _strip(key: str, prefix: str) -> str:
    return key[len(prefix):] if prefix and key.startswith(prefix) else key


def _has_lora(model: nn.Module) -> bool:
    from ..lora import get_lora_config

    try:
        get_lora_config(model)
    except ValueError:
        return False
    return True


def tensor_meta(t: torch.Tensor) -> dict:
    """``{"shape", "dtype"}`` of a (possibly sharded) tensor's global value."""
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def model_tensors(model: nn.Module) -> tuple[str, dict[str, torch.Tensor], str]:
    """(weights kind "adapter" | "full", {name in the causal LM: tensor (DTensor when sharded)}, LM prefix)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lm, prefix = causal_lm(model)
    lora = _has_lora(lm)
    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=lora))
    return ("adapter" if lora else "full"), {_strip(k, prefix): v for k, v in sd.items()}, prefix


def train_optimizer_parts(optimizer) -> tuple[object, dict | None]:
    """(the torch optimizer, the ``TrainOptimizer``'s own state without the inner optimizer's, or None).

    A ``TrainOptimizer`` (anything with ``.optimizer`` and ``state_dict()["optimizer"]``) saves and
    restores its precision, fallback, counters and loss scaler through its own ``state_dict`` /
    ``load_state_dict``; only the inner optimizer's tensors go through DCP.
    """
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return optimizer, None
    wrapper = dict(optimizer.state_dict())
    del wrapper["optimizer"]
    return inner, wrapper


def optimizer_parts(model: nn.Module, inner, prefix: str) -> tuple[dict[str, dict], list[dict]]:
    """({name in the causal LM: {key: value}}, param groups with those names) of torch optimizer ``inner``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, inner)
    state = {_strip(k, prefix): v for k, v in osd["state"].items()}
    groups = [dict(g, params=[_strip(k, prefix) for k in g["params"]]) for g in osd["param_groups"]]
    return state, groups


@contextlib.contextmanager
def quiet_single_process(distributed: bool):
    """DCP warns on every call without torch.distributed that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def listed_shards_reader(shards_dir: str, listed: set[str]):
    """DCP's safetensors reader over ``shards_dir`` that sees only the files in ``listed`` (their names).

    A shard file copied in after the save is not in the marker and must not be read: DCP's
    reader would take every ``*.safetensors`` of the directory.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.futures import Future

    from ..models import SafetensorsReader

    class _RowReader(HuggingFaceStorageReader):
        """Reads each request's rows with ``SafetensorsReader.read_rows`` (one byte range, into memory the
        reader frees) instead of ``safe_open``, whose memory map keeps every page read resident in this
        process's RSS until the file closes: a resume would hold a second copy of the rank's shards."""

        def read_data(self, plan, planner):
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for file_name, reqs in per_file.items():
                with SafetensorsReader(file_name) as f:
                    for req in reqs:
                        name, offs, lens = req.storage_index.fqn, list(req.storage_offsets), list(req.lengths)
                        if offs:
                            t = f.read_rows(name, offs[0], offs[0] + lens[0])
                            for d in range(1, len(offs)):
                                t = t.narrow(d, offs[d], lens[d])
                        else:
                            t = f.read(name)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != t.size():
                            raise AssertionError(f"{file_name}: {name}: stored {tuple(t.shape)}, "
                                                 f"expected {tuple(target.shape)}")
                        target.copy_(t)
                        planner.commit_tensor(req, target)
                        del t
            fut: Future = Future()
            fut.set_result(None)
            return fut

    reader = _RowReader(shards_dir)
    fs = reader.fs

    class _Listed:
        def __getattr__(self, name):
            return getattr(fs, name)

        def ls(self, path):
            return [f for f in fs.ls(path) if str(f).replace("\\", "/").rsplit("/", 1)[-1] in listed]

    reader.fs = _Listed()
    return reader
