"""Command line: pre-tokenize a corpus into an Arrow token cache, or describe a cache.

    ftlib data build --source data/ --tokenizer models/llama3/ --out cache/ --num-proc 8 --lenient
    ftlib sft --model models/llama3/ --data cache/ --out runs/x

(``python -m ftlib.data build ...`` is the same command.)

The record-format flags (``--kind``, default chat; ``--chat-template``, default the tokenizer's;
the field names; ``--lenient``; ``--num-proc``) are the training scripts' (``ftlib.data.cli``), so
a cache built here is what ``--data cache/`` of a training script reads (the same tokenizer is
checked). ``--tokenizer`` takes the model folder (or hub repo id) or a ``tokenizer.json``.
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

import json
import sys
import warnings

from .cache import CacheError, build_cache, open_cache
from .cli import (
    FlagError,
    FlagParser,
    add_format_flags,
    data_error_message,
    format_config_from_args,
    load_tokenizer_arg,
)
from .formatting import TRUNCATIONS
from .readers import ReadLimits
from .report import DataError


def _token(s):
    return int(s) if s is not None and s.isdigit() else s


def _head_tail(s: str):
    try:
        return int(s) if s.isdigit() else float(s)
    except ValueError:
        raise FlagError(f"--head-tail: expected a share in [0, 1] or a token count, got {s!r}") from None


def main(argv=None) -> int:
    ap = FlagParser(prog="python -m ftlib.data")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=FlagParser)
    b = sub.add_parser("build", help="tokenize sources into a cache directory")
    b.add_argument("--source", action="append", required=True,
                   help="file, directory, glob or hf://datasets/owner/name[@rev][/path or glob]; repeatable")
    b.add_argument("--tokenizer", required=True,
                   help="the model folder (or hub repo id) whose tokenizer.json and tokenizer_config.json to use, "
                        "or a tokenizer.json file")
    b.add_argument("--out", required=True, help="cache directory")
    add_format_flags(b)
    b.add_argument("--bos-token", default=None, help="default: the tokenizer's")
    b.add_argument("--eos-token", default=None, help="default: the tokenizer's")
    b.add_argument("--add-bos", action="store_true", default=None)
    b.add_argument("--no-eos", action="store_true", help="do not append EOS (text kind)")
    b.add_argument("--max-length", type=int, default=None,
                   help="longest document in tokens, cut by --truncation (a cache for ftlib sft --data "
                        "needs at most its --seq-len)")
    b.add_argument("--truncation", default="prompt_left", choices=list(TRUNCATIONS))
    b.add_argument("--head-tail", default="0.5",
                   help="head_tail truncation: share of kept tokens from the head (0.5) or head tokens (an int)")
    b.add_argument("--truncation-sep", default=None, help="head_tail truncation: separator token (text or id)")
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
        try:
            c = open_cache(a.cache, verify=a.verify)
        except CacheError as e:
            i.error(str(e))
        print(json.dumps({"n_docs": len(c), "n_tokens": c.n_tokens, "dtype": c.dtype.name,
                          "source_fingerprint": c.manifest.get("fingerprint_mode"),
                          "shards": len(c.manifest["shards"]), "n_truncated": c.n_truncated,
                          "stats": dict(c.stats), "skipped": c.report.to_dict()}, indent=1))
        return 0

    try:
        tok = load_tokenizer_arg(a.tokenizer)
        a.bos_token, a.eos_token, a.truncation_sep = _token(a.bos_token), _token(a.eos_token), _token(a.truncation_sep)
        a.head_tail = _head_tail(a.head_tail)
        cfg, template = format_config_from_args(a, tok, max_length=a.max_length)
    except FlagError as e:
        b.error(str(e))
    if template is not None:
        print(f"chat template: {template.source}")
    # unread record fields are named once, in the report printed below, not also as a warning per source
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fields the format does not read")
            c = build_cache(a.source, tok.tokenizer, cfg, a.out, num_proc=a.num_proc, strict=not a.lenient,
                            progress=not a.no_progress, full_hash=a.full_hash,
                            limits=ReadLimits(a.max_record_bytes, a.max_file_bytes))
    except DataError as e:
        b.error(data_error_message("--source", e, a.lenient))
    except FileNotFoundError as e:
        b.error(f"--source: {e}")
    print(f"cache {a.out}: {len(c)} documents, {c.n_tokens} tokens ({c.dtype.name}), "
          f"{c.n_built} of {len(c.manifest['shards'])} shards tokenized, {c.n_truncated} truncated "
          f"({c.stats.get('n_truncated_tokens', 0)} tokens cut, truncation={a.truncation}; "
          f"{c.stats.get('n_cut_before_tokenizing', 0)} over-long texts cut before tokenizing)")
    print(c.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
