"""Tokenizers from Hugging Face model folders: tokenizer.json, special tokens and the chat template.

Files read (the layout ``transformers`` writes):

- ``tokenizer.json``           the ``tokenizers`` pipeline (required);
- ``tokenizer_config.json``    ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token``
                               (a string or an ``{"content": ...}`` object) and
                               ``chat_template`` (a string or a list of
                               ``{"name", "template"}``, of which "default" is used);
- ``special_tokens_map.json``  special tokens, when tokenizer_config.json lacks them;
- ``chat_template.jinja``      the template, in newer exports.

Chat templates are untrusted code that came with a checkpoint, so
``apply_chat_template`` renders them with ftlib's one chat renderer
(``ftlib.data.render_chat``, defined in ``ftlib._jinja``): jinja2's
``ImmutableSandboxedEnvironment`` with the helpers Hugging Face provides, bounded
in time and size per render.

``resolve_model_dir`` maps a local directory or a hub repo id to a directory; a
repo id is fetched by ``huggingface_hub.snapshot_download`` (config, weights
and tokenizer files only), from its cache without network when cached.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._fields import json_str
from .._jinja import render_chat
from .vocab import check_vocab

__all__ = ["PretrainedTokenizer", "load_tokenizer", "resolve_model_dir"]

_ALLOW = ["*.json", "*.safetensors", "*.jinja"]  # config, weights + index, tokenizer files, chat template
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def resolve_model_dir(path_or_repo_id: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub repo id downloaded (or found in the cache)."""
    p = Path(path_or_repo_id)
    if p.is_dir():
        return p
    s = str(path_or_repo_id)
    if p.exists() or s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise FileNotFoundError(f"{s}: not a directory, and not a hub repo id of the form 'owner/name'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # the cache first: no network when the files are there
        return Path(snapshot_download(s, allow_patterns=_ALLOW, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(s, allow_patterns=_ALLOW))
    except Exception as e:  # network, auth, missing repo: say which repo and why
        raise FileNotFoundError(
            f"{s}: no local directory of that name, and the hub download failed: {type(e).__name__}: {e}"
        ) from e


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def _token_text(value: Any, path: Path, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {key} must be a string or an object with 'content', got {value!r}")


class PretrainedTokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of its folder."""

    def __init__(self, tokenizer, *, bos_token=None, eos_token=None, pad_token=None, unk_token=None,
                 chat_template: str | None = None, source: str = "<memory>"):
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.chat_template = chat_template
        self.source = source

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    bos_token_id = property(lambda self: self._id(self.bos_token))
    eos_token_id = property(lambda self: self._id(self.eos_token))
    pad_token_id = property(lambda self: self._id(self.pad_token))
    unk_token_id = property(lambda self: self._id(self.unk_token))

    @property
    def pad_id(self) -> int:
        """The id batches are padded with: the pad token's, else the EOS token's, else 0.

        Padding carries no loss (labels -100) and is masked out of attention, so any id works; a
        tokenizer without a pad token (Llama-3, Mistral) pads with EOS, as ``transformers`` does."""
        for i in (self.pad_token_id, self.eos_token_id):
            if i is not None:
                return i
        return 0

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (the tokenizer.json post-processor adds BOS etc. when asked)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, **variables: Any) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the folder's chat template.

        ``ftlib.data.render_chat(messages, self.chat_template, ...)`` with this tokenizer's special
        tokens as variables; ``max_seconds`` / ``max_chars`` set the rendering bounds."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: the tokenizer has no chat_template")
        specials = {k: getattr(self, k) for k in _SPECIAL}
        return render_chat(messages, self.chat_template, add_generation_prompt=add_generation_prompt,
                           **{**specials, **variables})


def load_tokenizer(path_or_repo_id: str | os.PathLike) -> PretrainedTokenizer:
    """Load tokenizer.json, special tokens and chat template from a directory or hub repo id."""
    from tokenizers import Tokenizer

    root = resolve_model_dir(path_or_repo_id)
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file}: not found (ftlib loads fast tokenizers from tokenizer.json only)")
    try:
        tokenizer = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{tok_file}: cannot be read as a tokenizers file: {e}") from None

    cfg_file, map_file = root / "tokenizer_config.json", root / "special_tokens_map.json"
    cfg, smap = _read_json(cfg_file), _read_json(map_file)
    specials = {}
    for key in _SPECIAL:
        if cfg.get(key) is not None:
            specials[key] = _token_text(cfg[key], cfg_file, key)
        else:
            specials[key] = _token_text(smap.get(key), map_file, key)

    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {}
        for i, t in enumerate(template):
            where = f"{cfg_file}: chat_template[{i}]"
            if not isinstance(t, dict):
                raise ValueError(f"{where} must be an object with 'name' and 'template', got {t!r}")
            named[json_str(t, "name", where)] = json_str(t, "template", where)
        if "default" not in named:
            raise ValueError(f"{cfg_file}: chat_template list has no 'default' entry (has {sorted(named)})")
        template = named["default"]
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{cfg_file}: field chat_template must be a string or a list of "
                         f"{{'name', 'template'}} objects, got {type(template).__name__}")
    tok = PretrainedTokenizer(tokenizer, chat_template=template, source=str(root), **specials)
    model_cfg = _read_json(root / "config.json")  # the model of this folder: its embedding must fit the ids
    if "vocab_size" in model_cfg:
        check_vocab(tok, model_cfg, tokenizer_source=tok_file, model_source=root / "config.json")
    return tok
