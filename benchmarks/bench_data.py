"""Data pipeline benchmark: tokenization, cache reads, packing, padding — ftlib vs baselines.

    python benchmarks/bench_data.py --corpus /tmp/ftlib_corpus --results benchmarks/results/data.csv

Generates (once) a JSONL corpus of ``--size-mb`` MB (default 100) in ``--corpus``: documents of
Zipf-distributed pseudo-words with log-normal lengths (median ~250 words, a long tail to tens of
thousands), split into 8 shards. A byte-level BPE tokenizer (vocab 8192) is trained on a sample.
Then, in one run, it measures:

1. tokenization throughput (tokens/s): ``build_cache`` with ``--num-proc`` worker processes vs a
   plain single-process ``json.loads`` + ``Tokenizer.encode`` loop vs Hugging Face ``datasets``
   ``map(num_proc=...)`` (when installed);
2. cache read throughput (GB/s of token data): memory-mapped Arrow arrays vs parsing the same
   token ids from a JSONL file (both warm in the page cache);
3. packing at ``--seq-len``: fill ratio and time of BFD (C++ and NumPy) vs next-fit greedy in
   document order and vs concatenate-and-chunk (full rows, but documents cut across rows), on the
   corpus and on 1M log-normal lengths;
4. padding fraction of batches of 16 (padded to a multiple of 64) with and without length grouping.

Rows (metric, value, unit, hardware, versions, date) are appended to ``--results``.

Chat cache build vs Hugging Face ``datasets`` (``--chat``, only this)::

    python benchmarks/bench_data.py --chat --corpus bench-corpus/chat --records 50000 --rounds 3 \
        --results benchmarks/results/data_chat.csv [--before-src OTHER_CHECKOUT]

Generates ``--records`` ChatML conversations (40 % with a system turn, 1-4 user/assistant pairs
of Zipf pseudo-words, ~500 tokens each) in 4 JSONL shards and trains a byte-level BPE of
``--vocab`` (32000) tokens with ChatML's special tokens on the first shard (nothing downloaded).
Both variants use the same template text (ChatML with HF's ``{% generation %}`` around each
assistant content and its ``<|im_end|>``) and the same tokenizer.json, ``--num-proc`` processes
and ``TOKENIZERS_PARALLELISM=false``; each round runs every variant in a fresh process, the
order rotating per round; medians are reported.

* ``ftlib``: ``build_cache(shards, tokenizer, FormatConfig(kind="chat", chat_template=...),
  num_proc=...)`` (what ``ftlib sft`` calls, through ``prepare_cache``);
* ``datasets``: ``load_dataset("json", num_proc=...)`` then ``map(batched=True, num_proc=...)``
  of ``tokenizer.apply_chat_template(batch, tokenize=True, return_dict=True,
  return_assistant_tokens_mask=True)`` (a ``PreTrainedTokenizerFast`` on the same file), the
  strongest correct use of it: batched, one render per conversation, Arrow output on disk;
* ``encode_batch``: the limit, the tokenizer's own throughput: the same conversations rendered as
  ChatML text beforehand (not timed), then one ``Tokenizer.encode_batch(texts,
  add_special_tokens=False)`` call on ``--num-proc`` threads of its own pool (``RAYON_NUM_THREADS``);
  no masks, no cache written;
* ``ftlib-before`` (with ``--before-src``): ``ftlib`` run on another checkout's code.

Each variant's encoder is printed (``tokenizers``, or the C++ BPE a checkout before it was removed
used by default).

Timed: from the call to the finished cache / dataset (imports and the tokenizer load excluded).
The last line compares every record's token ids and loss / assistant masks of the two variants.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shutil
import sys
import time

import numpy as np

# --chat --before-src DIR runs one variant on the ftlib of another checkout (the code before a change)
sys.path.insert(0, os.environ.get("BENCH_FTLIB_SRC") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftlib.data import (  # noqa: E402
    FormatConfig,
    build_cache,
    cpp_available,
    length_grouped_batches,
    pack,
    padding_fraction,
)


def generate_corpus(out: str, size_mb: int, seed: int = 0) -> list[str]:
    marker = os.path.join(out, f".done-{size_mb}mb")
    paths = [os.path.join(out, f"shard-{k:02d}.jsonl") for k in range(8)]
    if os.path.exists(marker):
        return paths
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(20000)])
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1  # Zipf word frequencies
    p /= p.sum()
    target = size_mb << 20
    written, k = 0, 0
    files = [open(pth, "w") for pth in paths]
    while written < target:
        n_words = max(1, int(rng.lognormal(mean=5.5, sigma=1.1)))  # median ~245 words, long tail
        text = " ".join(vocab[rng.choice(len(vocab), n_words, p=p)].tolist())
        line = json.dumps({"text": text}) + "\n"
        files[k % 8].write(line)
        written += len(line)
        k += 1
    for f in files:
        f.close()
    open(marker, "w").close()
    return paths


def train_tokenizer(paths: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<pad>", "<unk>", "</s>"], show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def sample():
        with open(paths[0]) as f:
            for i, line in enumerate(f):
                if i >= 2000:
                    break
                yield json.loads(line)["text"]

    tok.train_from_iterator(sample(), tr)
    return tok


def next_fit(lengths: np.ndarray, T: int) -> tuple[int, int]:
    """Greedy in document order, no splitting (documents > T truncated): (rows, tokens)."""
    rows, room, tokens = 0, 0, 0
    for L in np.minimum(lengths, T).tolist():
        if L > room:
            rows, room = rows + 1, T
        room -= L
        tokens += L
    return rows, tokens


def concat_chunk(lengths: np.ndarray, T: int) -> tuple[int, int]:
    """Concatenate everything and cut every T tokens: (rows, documents cut across a row boundary)."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    return int(-(-ends[-1] // T)), int((starts // T != (ends - 1) // T).sum())


def timed(fn, *a, **k):
    t = time.perf_counter()
    r = fn(*a, **k)
    return r, time.perf_counter() - t


def cpu_timed(fn, *a, **k):
    """(result, wall s, CPU s of this process and of its finished children, e.g. pool workers)."""
    c0, t = os.times(), time.perf_counter()
    r = fn(*a, **k)
    wall, c1 = time.perf_counter() - t, os.times()
    cpu = sum(c1[i] - c0[i] for i in range(4))  # user, system, children user, children system
    return r, wall, cpu


def best_of(n, fn, *a, **k):
    """Best of n runs (for the sub-second packing timings, which a shared machine makes noisy)."""
    runs = [timed(fn, *a, **k) for _ in range(n)]
    return runs[0][0], min(t for _, t in runs)


# ---- chat cache build: ftlib vs Hugging Face datasets (--chat) ---------------------------------
CHATML_GENERATION = (  # ChatML (as the built-in "chatml"), HF's {% generation %} around content + turn end
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def generate_chat_corpus(out: str, n_records: int, n_shards: int = 4, seed: int = 0) -> list[str]:
    """``n_records`` ChatML conversations (optional system, 1-4 user/assistant pairs) in JSONL shards."""
    marker = os.path.join(out, f".done-{n_records}")
    paths = [os.path.join(out, f"chat-{k:02d}.jsonl") for k in range(n_shards)]
    if os.path.exists(marker):
        return paths
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(30000)]
                     + [",", ".", "?", "!", "1984", "42", "\n", "\n\n- "])
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    p /= p.sum()

    def text(median_words):
        n = max(1, int(rng.lognormal(np.log(median_words), 0.9)))
        return " ".join(vocab[rng.choice(len(vocab), n, p=p)].tolist()).replace(" \n", "\n")

    files = [open(pth, "w") for pth in paths]
    for i in range(n_records):
        msgs = [{"role": "system", "content": text(20)}] if rng.random() < 0.4 else []
        for _ in range(int(rng.integers(1, 5))):
            msgs += [{"role": "user", "content": text(40)}, {"role": "assistant", "content": text(70)}]
        files[i % n_shards].write(json.dumps({"messages": msgs}) + "\n")
    for f in files:
        f.close()
    open(marker, "w").close()
    return paths


def train_chat_tokenizer(paths: list[str], out: str, vocab_size: int = 32000) -> str:
    """A byte-level BPE with ChatML's special tokens, trained on the corpus' first shard; path of tokenizer.json."""
    path = os.path.join(out, f"tokenizer-{vocab_size}.json")
    if os.path.exists(path):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def sample():
        with open(paths[0]) as f:
            for i, line in enumerate(f):
                if i >= 4000:
                    break
                for m in json.loads(line)["messages"]:
                    yield m["content"]

    tok.train_from_iterator(sample(), tr)
    tok.save(path)
    return path


def _encoder_name(tok) -> str:
    """The encoder ``build_cache`` uses for ``tok`` in the ftlib on ``sys.path`` (this checkout or ``--before-src``)."""
    import tokenizers

    try:
        from ftlib.data.fast_bpe import fast_bpe_for  # a checkout from before the C++ BPE was removed
    except ImportError:
        return f"tokenizers {tokenizers.__version__}"
    return "C++ BPE (csrc/bpe.cpp)" if fast_bpe_for(tok) is not None else f"tokenizers {tokenizers.__version__}"


def _encode_batch_variant(args, paths: list[str], tok_path: str) -> None:
    """The tokenizer alone: pre-rendered ChatML texts through one ``encode_batch`` on num_proc threads."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    os.environ["RAYON_NUM_THREADS"] = str(args.num_proc)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    texts = []
    for path in paths:
        with open(path) as f:
            for line in f:
                texts.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                                     for m in json.loads(line)["messages"]))
    encs, wall, cpu = cpu_timed(tok.encode_batch, texts, add_special_tokens=False)
    n_tokens = sum(len(e.ids) for e in encs)
    print("RESULT " + json.dumps({"variant": "encode_batch", "wall": wall, "cpu": cpu, "docs": len(texts),
                                  "tokens": n_tokens, "loss_tokens": 0,
                                  "encoder": f"tokenizers {__import__('tokenizers').__version__} "
                                             "(encode_batch alone)"}), flush=True)


def _chat_variant(args) -> None:
    """One timed build in this (fresh) process; prints a JSON line; dumps ids/masks for the equality check."""
    paths = sorted(os.path.join(args.corpus, "jsonl", f) for f in os.listdir(os.path.join(args.corpus, "jsonl"))
                   if f.endswith(".jsonl"))
    tok_path = os.path.join(args.corpus, f"tokenizer-{args.vocab}.json")
    if args.chat_variant == "encode_batch":
        return _encode_batch_variant(args, paths, tok_path)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # num_proc processes on the cores, no thread pool on top
    from tokenizers import Tokenizer

    work = os.path.join(args.corpus, f"out-{args.chat_variant}")
    shutil.rmtree(work, ignore_errors=True)
    if args.chat_variant == "ftlib":
        tok = Tokenizer.from_file(tok_path)
        encoder = _encoder_name(tok)
        cfg = FormatConfig(kind="chat", chat_template=CHATML_GENERATION)  # the same template text
        cache, wall, cpu = cpu_timed(build_cache, paths, tok, cfg, work, num_proc=args.num_proc, progress=False)
        lens = cache.lengths
        ids = np.concatenate([a for _, a, _ in cache.shard_arrays()])
        mask = np.concatenate([m for _, _, m in cache.shard_arrays()])
    else:
        import datasets
        from transformers import PreTrainedTokenizerFast

        datasets.disable_progress_bars()
        hf_tok = PreTrainedTokenizerFast(tokenizer_file=tok_path, chat_template=CHATML_GENERATION)
        encoder = f"tokenizers {__import__('tokenizers').__version__} (via transformers)"

        def fmt(batch):
            out = hf_tok.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
            return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

        def run():
            ds = datasets.load_dataset("json", data_files=paths, split="train", cache_dir=work,
                                       num_proc=args.num_proc)
            return ds.map(fmt, batched=True, num_proc=args.num_proc, remove_columns=["messages"])

        ds, wall, cpu = cpu_timed(run)
        ids_col = ds.data.column("input_ids").combine_chunks()
        mask_col = ds.data.column("assistant_masks").combine_chunks()
        lens = np.diff(ids_col.offsets.to_numpy())
        ids = ids_col.values.to_numpy().astype(np.uint16)
        mask = mask_col.values.to_numpy().astype(np.uint8)
    np.savez(os.path.join(args.corpus, f"dump-{args.label or args.chat_variant}.npz"), lens=lens, ids=ids, mask=mask)
    shutil.rmtree(work, ignore_errors=True)
    print("RESULT " + json.dumps({"variant": args.label or args.chat_variant, "wall": wall, "cpu": cpu, "docs": int(len(lens)),
                                  "tokens": int(lens.sum()), "loss_tokens": int(mask.sum()),
                                  "encoder": encoder}), flush=True)


def chat_main(args) -> None:
    """Alternating rounds, a fresh process per variant and round; medians; equality of ids and masks."""
    import statistics
    import subprocess

    t0 = time.perf_counter()
    paths = generate_chat_corpus(os.path.join(args.corpus, "jsonl"), args.records)
    train_chat_tokenizer(paths, args.corpus, args.vocab)
    mb = sum(os.path.getsize(p) for p in paths) / 2**20
    print(f"chat corpus: {args.records} records, {len(paths)} shards, {mb:.1f} MB, vocab {args.vocab} "
          f"(ready in {time.perf_counter() - t0:.1f}s); num_proc={args.num_proc}, {os.cpu_count()} CPUs")
    variants = ["ftlib", "datasets", "encode_batch"] + (["ftlib-before"] if args.before_src else [])
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:  # each variant leads a round in turn
            cmd = [sys.executable, os.path.abspath(__file__), "--chat-variant", v.split("-")[0], "--label", v,
                   "--corpus", args.corpus, "--results", args.results, "--num-proc", str(args.num_proc),
                   "--vocab", str(args.vocab)]
            env = dict(os.environ, BENCH_FTLIB_SRC=os.path.abspath(args.before_src)) if v == "ftlib-before" else None
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"{v} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
            res = json.loads(line[0][7:])
            runs[v].append(res)
            print(f"  round {r + 1} {v:<9} {res['wall']:7.1f} s  {res['tokens'] / res['wall']:>9.0f} tok/s  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    a, b = (np.load(os.path.join(args.corpus, f"dump-{v}.npz")) for v in variants[:2])
    same = {k: bool(np.array_equal(a[k], b[k])) for k in ("lens", "ids", "mask")}
    eq = (f"equality: docs {len(a['lens'])} vs {len(b['lens'])}, tokens {int(a['lens'].sum())} vs "
          f"{int(b['lens'].sum())}, loss tokens {int(a['mask'].sum())} vs {int(b['mask'].sum())}; per-record "
          f"lengths {'identical' if same['lens'] else 'DIFFER'}, ids {'identical' if same['ids'] else 'DIFFER'}, "
          f"masks {'identical' if same['mask'] else 'DIFFER'} on all {len(a['lens'])} records")
    rows = []
    print(f"\n{'variant':<13} {'median s':>9} {'tok/s':>10} {'CPU s':>7} {'rounds (s)':<22} encoder")
    med = {v: statistics.median(x["wall"] for x in runs[v]) for v in variants}
    for v in variants:
        n = runs[v][0]["tokens"]
        cpu = statistics.median(x["cpu"] for x in runs[v])
        rounds = " ".join(f"{x['wall']:.1f}" for x in runs[v])
        print(f"{v:<13} {med[v]:>9.1f} {n / med[v]:>10.0f} {cpu:>7.1f} {rounds:<22} {runs[v][0]['encoder']}")
        rows.append((v, round(med[v], 2), round(n / med[v]), round(cpu, 1), rounds, runs[v][0]["encoder"]))
    ratio = med["datasets"] / med["ftlib"]
    print(f"ftlib speedup vs datasets (median wall): {ratio:.2f}x; ftlib at {med['encode_batch'] / med['ftlib']:.2f}x "
          "of encode_batch alone (the tokenizer's own throughput)")
    if args.before_src:
        c = np.load(os.path.join(args.corpus, "dump-ftlib-before.npz"))
        same_c = all(np.array_equal(a[k], c[k]) for k in ("lens", "ids", "mask"))
        print(f"ftlib speedup vs ftlib-before (median wall): {med['ftlib-before'] / med['ftlib']:.2f}x; ftlib-before "
              f"ids and masks {'identical' if same_c else 'DIFFER'}")
    print(eq)
    import datasets
    import tokenizers
    import transformers

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "n_cpus": os.cpu_count(), "python": platform.python_version(), "tokenizers": tokenizers.__version__,
            "datasets": datasets.__version__, "transformers": transformers.__version__,
            "num_proc": args.num_proc, "records": args.records, "vocab": args.vocab,
            "tokens": runs["ftlib"][0]["tokens"], "loss_tokens": runs["ftlib"][0]["loss_tokens"]}
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    new = not os.path.exists(args.results)
    with open(args.results, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(list(meta) + ["variant", "median_s", "tok_per_s", "cpu_s", "rounds_s", "encoder", "speedup",
                                     "equality"])
        for r in rows:
            w.writerow(list(meta.values()) + list(r) + [round(ratio, 3), eq])
    print(f"appended {len(rows)} rows to {args.results} (total {time.perf_counter() - t0:.0f}s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True, help="directory for the generated corpus and caches")
    ap.add_argument("--results", required=True, help="CSV file to append rows to")
    ap.add_argument("--size-mb", type=int, default=100)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--chat", action="store_true", help="only the chat cache build: ftlib vs HF datasets")
    ap.add_argument("--records", type=int, default=50000, help="--chat: conversations in the corpus")
    ap.add_argument("--rounds", type=int, default=3, help="--chat: alternating rounds (fresh process each)")
    ap.add_argument("--vocab", type=int, default=32000, help="--chat: BPE vocabulary size")
    ap.add_argument("--before-src", help="--chat: also time the ftlib of this checkout (e.g. before a change)")
    ap.add_argument("--chat-variant", choices=["ftlib", "datasets", "encode_batch"], help=argparse.SUPPRESS)
    ap.add_argument("--label", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.chat_variant:
        return _chat_variant(args)
    if args.chat:
        return chat_main(args)

    rows = []

    def report(metric, value, unit, note=""):
        rows.append((metric, value, unit, note))
        print(f"  {metric:<46} {value:>14.4g} {unit:<8} {note}")

    t0 = time.perf_counter()
    src = os.path.join(args.corpus, "jsonl")
    paths = generate_corpus(src, args.size_mb)
    mb = sum(os.path.getsize(p) for p in paths) / 2**20
    print(f"corpus: {len(paths)} shards, {mb:.1f} MB in {src} (ready in {time.perf_counter() - t0:.1f}s)")
    tok = train_tokenizer(paths)
    cfg = FormatConfig(kind="text", eos_token="</s>")

    print(f"\n[1] tokenization throughput ({args.num_proc} worker processes, {os.cpu_count()} CPUs)")
    cache_dir = os.path.join(args.corpus, "cache")
    shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"  load average before: {os.getloadavg()[0]:.2f} (other processes share the CPUs)")
    cache, t_build, c_build = cpu_timed(build_cache, src, tok, cfg, cache_dir, num_proc=args.num_proc,
                                        progress=False)
    n_tok = cache.n_tokens
    report("build_cache tokens/s", n_tok / t_build, "tok/s", f"{n_tok} tokens, {len(cache)} docs, {t_build:.1f}s")
    report("build_cache tokens per CPU-second", n_tok / c_build, "tok/cpus", f"{c_build:.1f} CPU-s, all processes")

    def plain_loop():
        n = 0
        for p in paths:
            with open(p) as f:
                for line in f:
                    n += len(tok.encode(json.loads(line)["text"], add_special_tokens=False).ids) + 1
        return n

    n_plain, t_plain, c_plain = cpu_timed(plain_loop)
    assert n_plain == n_tok, (n_plain, n_tok)
    report("single-process loop tokens/s", n_plain / t_plain, "tok/s", f"{t_plain:.1f}s")
    report("single-process loop tokens per CPU-second", n_plain / c_plain, "tok/cpus", f"{c_plain:.1f} CPU-s")
    report("build_cache speedup vs single-process loop", t_plain / t_build, "x", "wall clock")
    print(f"  load average after: {os.getloadavg()[0]:.2f}")
    _, t_hit = timed(build_cache, src, tok, cfg, cache_dir, num_proc=args.num_proc, progress=False)
    report("second build (cache hit) time", t_hit, "s")
    try:
        import datasets  # noqa: F401
    except ImportError:
        print("  HF datasets map(num_proc): skipped (`datasets` is not installed)")
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        ds = datasets.load_dataset("json", data_files=paths, split="train",
                                   cache_dir=os.path.join(args.corpus, "hf"))
        _, t_hf = timed(ds.map, lambda b: {"ids": [e.ids for e in tok.encode_batch(b["text"])]},
                        batched=True, num_proc=args.num_proc, remove_columns=["text"])
        report("HF datasets map tokens/s", n_tok / t_hf, "tok/s", f"{t_hf:.1f}s")

    print("\n[2] read throughput (warm page cache)")
    arrays = cache.shard_arrays()
    nbytes = sum(ids.nbytes for _, ids, _ in arrays)

    def read_cache():
        return sum(int(ids.sum(dtype=np.int64)) for _, ids, _ in arrays)

    read_cache()
    total, t_read = timed(read_cache)
    report("Arrow mmap read GB/s", nbytes / t_read / 1e9, "GB/s", f"{nbytes / 2**20:.0f} MiB of {cache.dtype.name} ids")
    _, t_docs = timed(lambda: [cache[i] for i in range(len(cache))])
    report("Arrow per-document access docs/s", len(cache) / t_docs, "docs/s")
    jpath = os.path.join(args.corpus, "tokens.jsonl")
    with open(jpath, "w") as f:
        for off, ids, _ in arrays:
            for a, b in zip(off[:-1].tolist(), off[1:].tolist()):
                f.write(json.dumps({"input_ids": ids[a:b].tolist()}) + "\n")

    def read_json():
        s = 0
        with open(jpath) as f:
            for line in f:
                s += int(np.asarray(json.loads(line)["input_ids"], dtype=cache.dtype).sum(dtype=np.int64))
        return s

    total_j, t_json = timed(read_json)
    assert total_j == total
    report("JSONL token read GB/s", nbytes / t_json / 1e9, "GB/s", "same ids, json.loads + np.asarray")
    report("Arrow read speedup vs JSONL", t_json / t_read, "x")
    os.remove(jpath)

    T = args.seq_len
    print(f"\n[3] packing, seq_len={T} (best of 3 runs)")
    if cpp_available():
        pack([1, 2, 3], T, backend="cpp")  # load the compiled library outside the timings
    for name, lengths in [("corpus", cache.lengths),
                          ("1M log-normal", np.maximum(1, np.random.default_rng(1).lognormal(5.8, 1.1, 1_000_000)
                                                       .astype(np.int64)))]:
        print(f"  -- {name}: {len(lengths)} documents, {int(lengths.sum())} tokens, "
              f"{int((lengths > T).sum())} longer than seq_len")
        if cpp_available():
            p_cpp, t_cpp = best_of(3, pack, lengths, T, backend="cpp")
            report(f"{name}: BFD C++ time", t_cpp, "s", f"fill {p_cpp.stats.fill_ratio:.4f}, {p_cpp.n_rows} rows, "
                   f"{p_cpp.stats.n_split_docs} docs split")
        else:
            print("  BFD C++: skipped (no C++ compiler)")
        p_np, t_np = best_of(3, pack, lengths, T, backend="numpy")
        report(f"{name}: BFD NumPy time", t_np, "s", f"fill {p_np.stats.fill_ratio:.4f}")
        if cpp_available():
            assert np.array_equal(p_cpp.doc, p_np.doc) and np.array_equal(p_cpp.row_ptr, p_np.row_ptr)
        report(f"{name}: BFD fill ratio", p_np.stats.fill_ratio, "")
        (nf_rows, nf_tok), t_nf = best_of(3, next_fit, lengths, T)
        report(f"{name}: next-fit greedy fill ratio", nf_tok / (nf_rows * T), "",
               f"{nf_rows} rows, {t_nf:.3f}s, {int((lengths > T).sum())} docs truncated")
        (cc_rows, cc_cut), t_cc = best_of(3, concat_chunk, lengths, T)
        report(f"{name}: concat+chunk docs cut across rows", cc_cut, "docs",
               f"fill 1.0, {cc_rows} rows, {t_cc:.3f}s")
        report(f"{name}: BFD rows vs next-fit rows", p_np.n_rows / nf_rows, "x")

    print("\n[4] padding fraction, batch 16, pad to multiple of 64, lengths capped at seq_len")
    lengths = np.minimum(cache.lengths, T)
    rng = np.random.default_rng(2)
    rand = np.array_split(rng.permutation(len(lengths)), max(1, len(lengths) // 16))
    grouped = length_grouped_batches(lengths, 16, np.random.default_rng(2))
    report("padding fraction, random batches", padding_fraction(lengths, rand, 64), "")
    report("padding fraction, length-grouped batches", padding_fraction(lengths, grouped, 64), "")

    import pyarrow
    import tokenizers
    import torch

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": platform.processor() or platform.machine(), "n_cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "tokenizers": tokenizers.__version__,
            "pyarrow": pyarrow.__version__, "num_proc": args.num_proc, "corpus_mb": round(mb, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    new = not os.path.exists(args.results)
    with open(args.results, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(list(meta) + ["metric", "value", "unit", "note"])
        for r in rows:
            w.writerow(list(meta.values()) + list(r))
    print(f"\nappended {len(rows)} rows to {args.results} (total {time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
