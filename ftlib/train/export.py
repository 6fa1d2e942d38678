"""Saving the model a run produced in Hugging Face's layout, with the base model's tokenizer files.

    save_merged(model, "runs/x/merged", tokenizer_from="meta-llama/Meta-Llama-3-8B-Instruct")

``save_merged`` folds every adapter into its base weight (``ftlib.lora.merge_and_unload``:
``W' = W + (alpha / r) B A``, computed in fp32 from the dequantized base, then cast to ``dtype``),
writes the model with ``ftlib.models.save_pretrained`` (config.json + safetensors shards + index)
and copies the tokenizer files beside it, so the folder loads in ``transformers`` and vLLM as it
is. ``copy_tokenizer_files`` is the last part alone, for models saved another way (a reward
model's ``save_reward_model``, the sharded ``ftlib.distributed.export_merged``).

Tokenizer files: ``tokenizer.json``, ``tokenizer_config.json`` (chat template, special tokens)
and ``special_tokens_map.json``, each copied when the source has it (a hub repo id is resolved
through the local cache, downloading if needed). ``chat_template=`` writes the template the run
trained with into the copied ``tokenizer_config.json`` (created when the source has none), so the
adapter, every checkpoint and the merged model are served with the text they learned. Each copy is atomic (temporary name, fsync,
rename): a crash leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .._atomic import atomic_write
from ..checkpoint.format import SERVING_FILES

__all__ = ["TOKENIZER_FILES", "copy_tokenizer_files", "save_merged"]

TOKENIZER_FILES = SERVING_FILES  # also put beside every checkpoint's adapter: a load ignores them without a warning


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike, *,
                         chat_template: str | None = None) -> list[Path]:
    """Copy the tokenizer files of model folder or hub repo id ``src`` into folder ``dst``; return the copies.

    ``chat_template``: set as ``chat_template`` in the copied ``tokenizer_config.json``.
    ``FileNotFoundError`` when ``src`` has no ``tokenizer.json``: a model folder without its
    tokenizer is not usable by the tools that read it."""
    from ..models.tokenizer import resolve_model_dir

    root, dst = resolve_model_dir(src), Path(dst)
    if not (root / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{root}: no tokenizer.json to copy into {dst}")
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (root / name).is_file():
            atomic_write(dst / name, lambda tmp, s=root / name: shutil.copyfile(s, tmp))
            copied.append(dst / name)
    if chat_template is not None:
        cfg_file = dst / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        cfg["chat_template"] = chat_template
        text = json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"
        atomic_write(cfg_file, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        if cfg_file not in copied:
            copied.append(cfg_file)
    return copied


def save_merged(model: torch.nn.Module, path: str | os.PathLike, *, tokenizer_from: str | os.PathLike | None = None,
                dtype: torch.dtype | None = torch.bfloat16, chat_template: str | None = None) -> Path:
    """Merge the adapters of ``model`` into its weights (in place: the model has no adapters after),
    save it under ``path`` in HF's layout in ``dtype`` (None: each weight's own), and copy the
    tokenizer files of ``tokenizer_from`` beside it (with ``chat_template`` set). Returns ``path``."""
    from ..lora import merge_and_unload
    from ..models import save_pretrained

    path = Path(path)
    merged = merge_and_unload(model, dtype=dtype)
    save_pretrained(merged, path)
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, path, chat_template=chat_template)
    return path
