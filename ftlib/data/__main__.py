"""Command line: pre-tokenize a corpus into an Arrow token cache, or describe a cache.

    python -m ftlib.data build --source data/ --tokenizer tokenizer.json --out cache/ \\
        --kind chat --chat-template tokenizer_config.json --num-proc 8 --lenient
    python -m ftlib.data info cache/

``--lenient`` skips bad records and prints every skip (the reader's too: a cut file, a refused
tar member) with its location; the turn end that gets loss is read from the template
(``--turn-end`` overrides it); ``--truncation head_tail --head-tail 0.5 --truncation-sep <sep>``
keeps the head and tail of over-long documents or prompts.

Sources are recognised by content: by default by size plus a SHA-256 of files up to 3 MiB and of
~3 MiB of sampled blocks of larger ones, so a same-size in-place edit of a large file outside
the samples is not noticed; ``--full-hash`` hashes every byte (one full read of the corpus per
build). ``--max-record-bytes`` (16 MiB) and ``--max-file-bytes`` (1 GiB) bound what one record or
one whole-parsed document may take when read; larger ones are refused and reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .cache import build_cache, open_cache
from .formatting import TRUNCATIONS, FormatConfig
from .sources import ReadLimits


def _token(s):
    return int(s) if s is not None and s.isdigit() else s


def _head_tail(s: str):
    try:
        return int(s) if s.isdigit() else float(s)
    except ValueError:
        raise SystemExit(f"--head-tail: expected a share in [0, 1] or a token count, got {s!r}") from None


def _read_template(path: str) -> str:
    """Template text from a .jinja file or a tokenizer_config.json (string, or HF's list of named ones)."""
    with open(path, encoding="utf-8") as f:
        if not path.endswith(".json"):
            return f.read()
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON: {e}") from None
    t = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(t, list):  # [{"name": ..., "template": ...}]: the "default" one is the chat template
        t = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}.get("default")
    if not isinstance(t, str):
        raise ValueError(f"{path}: no 'chat_template' string (nor a list with a 'default' entry)")
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftlib.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="tokenize sources into a cache directory")
    b.add_argument("--source", action="append", required=True,
                   help="file, directory, glob or hf://datasets/owner/name[@rev][/path or glob]; repeatable")
    b.add_argument("--tokenizer", required=True, help="path to tokenizer.json")
    b.add_argument("--out", required=True, help="cache directory")
    b.add_argument("--kind", default="text", choices=["text", "chat", "instruction"])
    b.add_argument("--text-field", default="text")
    b.add_argument("--messages-field", default="messages")
    b.add_argument("--prompt-field", default="prompt")
    b.add_argument("--response-field", default="response")
    b.add_argument("--system-field", default=None)
    b.add_argument("--chat-template", default=None,
                   help="built-in name (chatml, llama3), a .jinja file, or a tokenizer_config.json")
    b.add_argument("--turn-end", default=None,
                   help="text after each assistant turn that also gets loss (default: read from the template)")
    b.add_argument("--loss-on", default="assistant", choices=["assistant", "all"])
    b.add_argument("--bos-token", default=None)
    b.add_argument("--eos-token", default=None)
    b.add_argument("--add-bos", action="store_true")
    b.add_argument("--no-eos", action="store_true", help="do not append EOS (text kind)")
    b.add_argument("--max-length", type=int, default=None)
    b.add_argument("--truncation", default="prompt_left", choices=list(TRUNCATIONS))
    b.add_argument("--head-tail", default="0.5",
                   help="head_tail truncation: share of kept tokens from the head (0.5) or head tokens (an int)")
    b.add_argument("--truncation-sep", default=None, help="head_tail truncation: separator token (text or id)")
    b.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    b.add_argument("--lenient", action="store_true", help="skip and report bad records instead of failing")
    b.add_argument("--full-hash", action="store_true",
                   help="recognise sources by a SHA-256 of every byte (default: size + SHA-256 of files up to "
                        "3 MiB and of ~3 MiB of sampled blocks of larger ones, which misses a same-size edit "
                        "outside the samples)")
    b.add_argument("--max-record-bytes", type=int, default=ReadLimits.max_record_bytes,
                   help="most bytes one record (a JSONL line, a .txt document) may take when read; larger "
                        "ones are refused and reported (default: %(default)s)")
    b.add_argument("--max-file-bytes", type=int, default=ReadLimits.max_file_bytes,
                   help="most bytes of a document parsed whole (.json, a Parquet tar member) "
                        "(default: %(default)s)")
    b.add_argument("--no-progress", action="store_true")
    i = sub.add_parser("info", help="verify a cache and print its summary")
    i.add_argument("cache")
    i.add_argument("--verify", default="full", choices=["size", "sample", "full"])
    a = ap.parse_args(argv)

    if a.cmd == "info":
        c = open_cache(a.cache, verify=a.verify)
        print(json.dumps({"n_docs": len(c), "n_tokens": c.n_tokens, "dtype": c.dtype.name,
                          "source_fingerprint": c.manifest.get("fingerprint_mode"),
                          "shards": len(c.manifest["shards"]), "n_truncated": c.n_truncated,
                          "stats": dict(c.stats), "skipped": c.report.to_dict()}, indent=1))
        return 0

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    template = a.chat_template
    if template and os.path.isfile(template):
        template = _read_template(template)
    cfg = FormatConfig(
        kind=a.kind, text_field=a.text_field, messages_field=a.messages_field, prompt_field=a.prompt_field,
        response_field=a.response_field, system_field=a.system_field, chat_template=template,
        loss_on=a.loss_on, bos_token=_token(a.bos_token), eos_token=_token(a.eos_token), add_bos=a.add_bos,
        add_eos=False if a.no_eos else None, max_length=a.max_length, truncation=a.truncation,
        turn_end=a.turn_end, head_tail=_head_tail(a.head_tail), truncation_sep=_token(a.truncation_sep),
    )
    c = build_cache(a.source, tok, cfg, a.out, num_proc=a.num_proc, strict=not a.lenient,
                    progress=not a.no_progress, full_hash=a.full_hash,
                    limits=ReadLimits(a.max_record_bytes, a.max_file_bytes))
    print(f"cache {a.out}: {len(c)} documents, {c.n_tokens} tokens ({c.dtype.name}), "
          f"{c.n_built} of {len(c.manifest['shards'])} shards tokenized, {c.n_truncated} truncated "
          f"({c.stats.get('n_truncated_tokens', 0)} tokens cut, truncation={a.truncation}; "
          f"{c.stats.get('n_cut_before_tokenizing', 0)} over-long texts cut before tokenizing)")
    print(c.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
