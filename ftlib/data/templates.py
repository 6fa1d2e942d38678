"""Where a run's chat template comes from: one resolver for the data CLI and every training script.

    resolve_chat_template(None, tokenizer=tok)          # the tokenizer's own (tokenizer_config.json)
    resolve_chat_template("llama3")                     # a built-in name (ftlib.data.BUILTIN_TEMPLATES)
    resolve_chat_template("my_template.jinja")          # a Jinja file
    resolve_chat_template("other/tokenizer_config.json")  # HF's config: a string, or a list with "default"
    resolve_chat_template("other-model-folder/")        # a folder: its tokenizer_config.json / chat_template.jinja
    resolve_chat_template("{% for m in messages %}...")   # inline Jinja text

Each returns a :class:`ChatTemplate`: the template *text* (built-in names are expanded, so the
text can be written into an exported ``tokenizer_config.json``) and where it came from.

An explicit spec wins; without one, the tokenizer's template is used. When there is none the
resolver raises :class:`NoChatTemplate` and says how to pass one: there is no silent fallback to
ChatML. A base model whose tokenizer has no template (a Llama-3 base, say) does not have ChatML's
``<|im_start|>`` / ``<|im_end|>`` as special tokens; training on them teaches text that the model
is never served with. (TRL refuses such a tokenizer too.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .formatting import BUILTIN_TEMPLATES

__all__ = ["ChatTemplate", "NoChatTemplate", "read_template_file", "resolve_chat_template"]

HOW_TO_PASS = ("pass one with --chat-template: a built-in name (" + ", ".join(BUILTIN_TEMPLATES) + "), a .jinja file, "
               "a tokenizer_config.json or a model folder holding one, or Jinja text")


class NoChatTemplate(ValueError):
    """Chat data, but no chat template given and none in the tokenizer."""


@dataclass(frozen=True)
class ChatTemplate:
    """A resolved chat template: its Jinja ``text`` and its ``source`` (for logs and ``run.json``)."""

    text: str
    source: str


def _from_config(cfg, path: Path) -> str | None:
    t = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(t, list):  # [{"name": ..., "template": ...}]: the "default" one is the chat template
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        if "default" not in named:
            raise ValueError(f"{path}: chat_template list has no 'default' entry (has {sorted(map(str, named))})")
        t = named["default"]
    if t is not None and not isinstance(t, str):
        raise ValueError(f"{path}: chat_template must be a string, got {type(t).__name__}")
    return t


def read_template_file(path: str | os.PathLike) -> str | None:
    """Template text from a ``.jinja`` file, a ``tokenizer_config.json`` (string, or HF's list of named
    templates: the ``default`` one) or a folder holding either; None when a config/folder has none."""
    p = Path(path)
    if p.is_dir():
        cfg_file = p / "tokenizer_config.json"
        t = read_template_file(cfg_file) if cfg_file.is_file() else None
        if t is None and (p / "chat_template.jinja").is_file():
            t = (p / "chat_template.jinja").read_text(encoding="utf-8")
        return t
    text = p.read_text(encoding="utf-8")
    if p.suffix != ".json":
        return text
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: invalid JSON: {e}") from None
    return _from_config(cfg, p)


def resolve_chat_template(spec: str | None, *, tokenizer=None, tokenizer_source: str | None = None) -> ChatTemplate:
    """The chat template to use: ``spec`` if given (built-in name, file, folder or Jinja text), else the
    template of ``tokenizer`` (an object with ``chat_template``, e.g. ``ftlib.models.load_tokenizer``'s).

    Raises :class:`NoChatTemplate` when neither gives one, ``FileNotFoundError`` for a spec that looks
    like a path but is not there, ``ValueError`` for a file without a template or a misspelled name.
    """
    if spec is None:
        text = getattr(tokenizer, "chat_template", None)
        where = tokenizer_source or getattr(tokenizer, "source", None) or "the tokenizer"
        if not text:
            raise NoChatTemplate(f"{where} has no chat template (no 'chat_template' in tokenizer_config.json, no "
                                 f"chat_template.jinja); {HOW_TO_PASS}")
        return ChatTemplate(text, f"tokenizer ({where})")
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[spec], f"built-in {spec!r}")
    if "{{" in spec or "{%" in spec:
        return ChatTemplate(spec, "inline text")
    p = Path(spec).expanduser()
    if p.exists():
        text = read_template_file(p)
        if not text:
            raise ValueError(f"{p}: holds no chat template; {HOW_TO_PASS}")
        return ChatTemplate(text, str(p))
    if p.suffix in (".jinja", ".json", ".j2") or os.sep in spec:
        raise FileNotFoundError(f"{spec}: no such file")
    import difflib

    close = difflib.get_close_matches(spec, list(BUILTIN_TEMPLATES), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{spec!r} is not a built-in template name ({', '.join(BUILTIN_TEMPLATES)}){hint}, not a file "
                     "and not Jinja text")
