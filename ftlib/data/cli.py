"""The data flags every ftlib command line shares: one name, one meaning, one default each.

``python -m ftlib.data build`` and the training scripts (through ``ftlib.train.cli``) add them
with :func:`add_format_flags` and turn them into a :class:`~ftlib.data.FormatConfig` with
:func:`format_config_from_args`:

    --kind {chat,instruction,text}   how records become tokens (default: chat)
    --chat-template SPEC             built-in name, .jinja file, tokenizer_config.json, model folder
                                     or Jinja text (default: the tokenizer's; none -> refused)
    --messages-field / --text-field / --prompt-field / --response-field / --system-field
    --tools-field NAME               chat: the per-record tool list given to the template (tools)
    --ignore-fields A,B              record fields not read that are not to be reported
    --turn-end TEXT, --loss-on {assistant,all}
    --lenient                        skip bad records, count and report each one
    --num-proc N                     tokenizer processes (default: half the CPUs)

``--tokenizer`` (where one is asked for) takes a model folder, a hub repo id or a
``tokenizer.json`` file: :func:`load_tokenizer_arg`. Errors a user can cause come back as
:class:`FlagError` whose message names the flag and the way out (:func:`flag_message` rewrites the
``FormatConfig.field`` names of the library's own errors into flags); a script passes it to
``parser.error`` (one line, exit 2).

Numbers are checked where they are parsed: ``type=whole(1)`` (an integer >= 1) and
``type=number(0, 1)`` (a finite number in [0, 1]) give argparse's one-line error naming the flag
(``argument --lr: must be a finite number > 0, got nan``), on the command line and, through the
same parser, for the values of a ``--config`` file (``ftlib.train.cli.parse_with_config``).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from .formatting import FormatConfig
from .templates import ChatTemplate, resolve_chat_template

__all__ = ["FIELD_FLAGS", "FlagError", "FlagParser", "RenamedFlag", "add_format_flags", "data_error_message", "data_sources",
           "default_num_proc", "flag_message", "format_config_from_args", "load_tokenizer_arg", "number", "whole"]

# FormatConfig field -> the flag that sets it (the library's messages name fields; users know flags)
FIELD_FLAGS = {"kind": "--kind", "chat_template": "--chat-template", "turn_end": "--turn-end",
               "loss_on": "--loss-on", "bos_token": "--bos-token", "eos_token": "--eos-token",
               "add_bos": "--add-bos", "max_length": "--max-length", "truncation": "--truncation",
               "head_tail": "--head-tail", "truncation_sep": "--truncation-sep",
               "messages_field": "--messages-field", "text_field": "--text-field", "tools_field": "--tools-field",
               "ignore_fields": "--ignore-fields"}


class FlagError(ValueError):
    """A user error on the command line; the message names the flag and what to do instead."""


class FlagParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``prog: error: message``, exit 2) plus a
    pointer to ``--help``, instead of a usage block of every flag."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


def whole(lo: int | None = None):
    """An argparse ``type=``: an integer (written as one: ``2``, not ``2.5`` or ``2.0``), at least ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = "whole number"
    return parse


def number(lo: float | None = None, hi: float | None = None, *, above: bool = False, below: bool = False):
    """An argparse ``type=``: a finite float in ``[lo, hi]`` (``above``: ``> lo``; ``below``: ``< hi``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bad = not math.isfinite(value) or (lo is not None and (value <= lo if above else value < lo)) or (
            hi is not None and (value >= hi if below else value > hi))
        if bad:
            if lo is not None and hi is not None:
                want = f"in {'(' if above else '['}{lo:g}, {hi:g}{')' if below else ']'}"
            elif lo is not None:
                want = f"{'>' if above else '>='} {lo:g}"
            elif hi is not None:
                want = f"{'<' if below else '<='} {hi:g}"
            else:
                want = ""
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + want if want else ''}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def data_error_message(flag: str, err: Exception, lenient: bool) -> str:
    """A ``DataError`` of a strict build as a flag error: where, what, and that ``--lenient`` skips it."""
    msg = str(err).replace(" (use lenient mode to skip and count such records)", "")
    return f"{flag}: {msg}" + ("" if lenient else " (--lenient skips and counts such records)")


def default_num_proc() -> int:
    """Tokenizer processes by default: half the CPUs (at least 1), the same in every command."""
    return max(1, (os.cpu_count() or 2) // 2)


def flag_message(msg: str, renames: dict[str, str] | None = None) -> str:
    """``msg`` with ``FormatConfig.x`` / ``FormatConfig(x=...)`` / ``add_eos=False`` written as flags."""
    flags = {**FIELD_FLAGS, **(renames or {})}
    msg = msg.replace("add_eos=False", "--no-eos").replace("add_eos=True", "--kind text")
    msg = re.sub(r"FormatConfig\((\w+)=[^)]*\)", lambda m: flags.get(m.group(1), m.group(0)), msg)
    return re.sub(r"FormatConfig\.(\w+)", lambda m: flags.get(m.group(1), m.group(0)), msg)


class RenamedFlag(argparse.Action):
    """A flag that was renamed: using it (or its key in a ``--config`` file) is a one-line error naming
    the new flag; nothing is read from it."""

    def __init__(self, option_strings, dest, *, new: str, **kw):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        given = f" {values}" if values is not None else ""
        parser.error(f"{option_string} was renamed {self.new}: pass {self.new}{given}")


def add_format_flags(p: argparse.ArgumentParser, *, kinds: tuple[str, ...] = ("chat", "instruction", "text")) -> None:
    """The record-format flags (see the module docstring), in a group of their own. ``kinds``: the
    ``--kind`` values a command reads (a preference-pair script: chat and text)."""
    g = p.add_argument_group("data format")
    g.add_argument("--kind", choices=list(kinds), default=kinds[0],
                   help="chat: a 'messages' list (or ShareGPT 'conversations'); instruction: prompt/response "
                        "fields; text: raw text, every token trained (default: chat)")
    g.add_argument("--format", action=RenamedFlag, new="--kind", help=argparse.SUPPRESS)
    g.add_argument("--chat-template", default=None,
                   help="built-in name (chatml, llama3), a .jinja file, a tokenizer_config.json, a model folder, "
                        "or Jinja text (default: the tokenizer's own; refused when it has none)")
    g.add_argument("--messages-field", default="messages", help="chat: the field holding the turns")
    g.add_argument("--text-field", default="text", help="text: the field holding the document")
    g.add_argument("--prompt-field", default="prompt", help="instruction: the prompt field")
    g.add_argument("--response-field", default="response", help="instruction: the response field")
    g.add_argument("--system-field", default=None, help="instruction: an optional system-prompt field")
    g.add_argument("--tools-field", default="tools",
                   help="chat: the field holding a record's tool (function) list, passed to the chat template as "
                        "'tools' (default: tools)")
    g.add_argument("--ignore-fields", default="",
                   help="comma-separated record fields the format does not read and that are not to be reported "
                        "(by default every unread field that looks like content is reported once per source)")
    g.add_argument("--turn-end", default=None,
                   help="text after each assistant turn that also gets loss (default: read from the template)")
    g.add_argument("--loss-on", default="assistant", choices=["assistant", "all"],
                   help="chat: which tokens carry loss (default: assistant)")
    g.add_argument("--lenient", action="store_true",
                   help="skip bad records (and unreadable file parts), count and report every skip, instead of "
                        "stopping at the first")
    g.add_argument("--num-proc", type=whole(1), default=default_num_proc(),
                   help="tokenizer processes (default: half the CPUs, %(default)s here)")


def data_sources(specs, flag: str = "--data") -> list[tuple[str, float | None]]:
    """``--data`` values as ``[(source, weight or None)]`` (``PATH:WEIGHT`` makes a weighted mixture,
    ``ftlib.data.mixture``; a config file may give a list or a mapping ``{path: weight}``)."""
    from .mixture import parse_mixture

    try:
        return parse_mixture(specs)
    except ValueError as e:
        raise FlagError(f"{flag}: {e}") from None


def _fields(v) -> tuple[str, ...]:
    """``--ignore-fields``: comma-separated text (a config file may give a list)."""
    if not v:
        return ()
    items = v if isinstance(v, (list, tuple)) else str(v).split(",")
    return tuple(f.strip() for f in items if str(f).strip())


def load_tokenizer_arg(spec: str, flag: str = "--tokenizer"):
    """A model folder, hub repo id or ``tokenizer.json`` file -> ``ftlib.models.PretrainedTokenizer``
    (special tokens and template from the folder's ``tokenizer_config.json`` when there is one)."""
    from ..models import PretrainedTokenizer, load_tokenizer

    p = Path(spec)
    try:
        if p.is_file():
            if p.name == "tokenizer.json":
                return load_tokenizer(p.parent)
            from tokenizers import Tokenizer

            return PretrainedTokenizer(Tokenizer.from_file(str(p)), source=str(p))
        return load_tokenizer(spec)
    except (OSError, ValueError) as e:
        raise FlagError(f"{flag} {spec}: {e} (give a model folder, a hub repo id or a tokenizer.json file)") from None
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise FlagError(f"{flag} {spec}: not a tokenizer file ({e})") from None


def format_config_from_args(args: argparse.Namespace, tok, *, max_length: int | None,
                            renames: dict[str, str] | None = None) -> tuple[FormatConfig, ChatTemplate | None]:
    """The :class:`FormatConfig` the flags describe for tokenizer ``tok``, and the chat template used
    (None for ``--kind text``). Special tokens come from the tokenizer unless ``--bos-token`` /
    ``--eos-token`` are given. ``FlagError`` for what the user must change."""
    template = None
    if args.kind != "text":
        try:
            template = resolve_chat_template(args.chat_template, tokenizer=tok)
        except (OSError, ValueError) as e:
            raise FlagError(f"--chat-template: {e}" if args.chat_template else f"--kind {args.kind}: {e}") from None
    bos = getattr(args, "bos_token", None) or tok.bos_token
    eos = getattr(args, "eos_token", None) or tok.eos_token
    if args.kind == "text" and eos is None and not getattr(args, "no_eos", False):
        raise FlagError(f"--kind text appends EOS after each document, but {tok.source} names no eos_token: pass "
                        "--eos-token TOKEN, or --no-eos where the command has it")
    kw = {}
    for name in ("add_bos", "max_length", "truncation", "truncation_sep", "head_tail"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if getattr(args, "no_eos", False):
        kw["add_eos"] = False
    kw.setdefault("max_length", max_length)
    try:
        cfg = FormatConfig(kind=args.kind, text_field=args.text_field, messages_field=args.messages_field,
                           prompt_field=args.prompt_field, response_field=args.response_field,
                           system_field=args.system_field, chat_template=template.text if template else None,
                           turn_end=args.turn_end, loss_on=args.loss_on, bos_token=bos, eos_token=eos,
                           tools_field=getattr(args, "tools_field", None) or "tools",
                           ignore_fields=_fields(getattr(args, "ignore_fields", None)), **kw)
        if eos is not None or bos is not None:  # the tokens must be in the vocabulary
            cfg.formatter(tok.tokenizer)
    except ValueError as e:
        raise FlagError(flag_message(str(e), renames)) from None
    return cfg, template
