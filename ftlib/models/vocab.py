"""Tokenizer against model: every token id the tokenizer can produce must have an embedding row.

A token id ``i`` indexes row ``i`` of the model's ``[vocab_size, H]`` embedding (and of the LM
head's output), so a tokenizer whose largest id is ``>= vocab_size`` fails only when such a token
occurs, deep inside torch (``IndexError: index out of range in self``, or a device-side assert on
CUDA). ``check_vocab`` compares the two when both are known and names both files. A tokenizer with
*fewer* ids than the model is normal (embeddings padded to a multiple of 64 or 128, as Qwen2 does).

``load_tokenizer`` runs it against the ``config.json`` in the tokenizer's own folder; a script
that takes the tokenizer and the model from different places calls it after loading both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._fields import json_int

__all__ = ["check_vocab", "max_token_id"]


def max_token_id(tokenizer: Any) -> int:
    """The largest id ``tokenizer`` (a ``PretrainedTokenizer`` or a ``tokenizers.Tokenizer``) can produce."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(vocab.values()) if vocab else -1


def check_vocab(tokenizer: Any, model: Any, *, tokenizer_source: str | os.PathLike | None = None,
                model_source: str | os.PathLike | None = None) -> None:
    """Raise ``ValueError`` naming both files when ``tokenizer`` has ids past ``model``'s embedding.

    ``model``: a model (its input embedding's rows count; else ``model.config.vocab_size``), a
    config with ``vocab_size``, a parsed ``config.json`` dict, or the vocabulary size as an int.
    The sources default to the tokenizer's folder (``tokenizer.source``) and the model's
    ``name_or_path`` (``load_pretrained`` sets it).
    """
    source = model_source
    if isinstance(model, int) and not isinstance(model, bool):
        size = model
    elif isinstance(model, dict):
        source = source or "config.json"
        size = json_int(model, "vocab_size", str(source), min=1)
    elif hasattr(model, "get_input_embeddings") or hasattr(model, "config"):
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        size = int(emb.num_embeddings) if emb is not None else int(model.config.vocab_size)
        source = source or getattr(model, "name_or_path", None)
    elif hasattr(model, "vocab_size"):
        size = int(model.vocab_size)
    else:
        raise TypeError(f"check_vocab: model must be a model, a config or an int, got {type(model).__name__}")
    top = max_token_id(tokenizer)
    if top < size:
        return
    tok_source = tokenizer_source or getattr(tokenizer, "source", None)
    tok_file = Path(tok_source) / "tokenizer.json" if tok_source and Path(tok_source).is_dir() else tok_source
    if source and Path(source).is_dir():
        source = Path(source) / "config.json"
    raise ValueError(
        f"{tok_file or 'the tokenizer'} has token ids up to {top} ({top + 1} ids), but "
        f"{source or 'the model'} has vocab_size {size}: ids >= {size} have no embedding row and would fail "
        "inside the model (IndexError); use the model's own tokenizer, or resize the model's embeddings to at "
        f"least {top + 1} rows"
    )
