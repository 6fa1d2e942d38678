import gzip
import io
import json
import os
import pickle
import tarfile
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ftlib.data import (
    CacheError,
    DataError,
    FormatConfig,
    Formatter,
    SkipReport,
    build_cache,
    open_cache,
)
from ftlib.data.__main__ import main as cli

TEXT = FormatConfig(kind="text", eos_token="</s>")


def _docs(n, seed=0):
    words = "hello world the quick brown fox jumps over lazy dog".split()
    rng = np.random.default_rng(seed)
    return [{"text": " ".join(rng.choice(words, rng.integers(1, 30)))} for _ in range(n)]


def _expected(tok, records, cfg=TEXT):
    fmt = Formatter(tok, cfg)
    return [fmt(r, "x", SkipReport()).input_ids.tolist() for r in records]


def test_build_matches_formatter_and_is_zero_copy(tmp_path, tokenizer, write_jsonl):
    recs = _docs(40)
    (tmp_path / "src").mkdir()
    write_jsonl(tmp_path / "src" / "a.jsonl", recs)
    c = build_cache(str(tmp_path / "src"), tokenizer, TEXT, str(tmp_path / "c"), progress=False)
    assert [c[i][0].tolist() for i in range(len(c))] == _expected(tokenizer, recs)
    assert c.dtype == np.uint16 and c.n_tokens == int(c.lengths.sum())
    ids, mask = c[5]
    assert not ids.flags.writeable and not ids.flags.owndata  # a view into the read-only memory map
    assert mask.dtype == np.uint8 and mask.all()
    c2 = pickle.loads(pickle.dumps(c))  # what DataLoader workers receive under spawn: the path, reopened
    assert len(pickle.dumps(c)) < 200 and np.array_equal(c2[5][0], ids) and np.array_equal(c2.lengths, c.lengths)


def test_multiprocess_build_equals_single_process(tmp_path, tokenizer, write_jsonl):
    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        write_jsonl(src / f"{k}.jsonl", _docs(30, seed=k))
    c1 = build_cache(str(src), tokenizer, TEXT, str(tmp_path / "c1"), progress=False)
    c2 = build_cache(str(src), tokenizer, TEXT, str(tmp_path / "c2"), num_proc=2, progress=False)
    assert len(c1) == len(c2) == 90
    for i in range(90):
        assert np.array_equal(c1[i][0], c2[i][0]) and np.array_equal(c1[i][1], c2[i][1])


def test_cache_hit_and_incremental_shards(tmp_path, tokenizer, write_jsonl):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "0.jsonl", _docs(10, 0))
    out = str(tmp_path / "c")
    assert build_cache(str(src), tokenizer, TEXT, out, progress=False).n_built == 1
    assert build_cache(str(src), tokenizer, TEXT, out, progress=False).n_built == 0  # hit
    write_jsonl(src / "1.jsonl", _docs(7, 1))
    c = build_cache(str(src), tokenizer, TEXT, out, progress=False)
    assert c.n_built == 1 and len(c) == 17  # only the new shard was tokenized
    # other settings are another cache (no stale hit)
    cfg2 = FormatConfig(kind="text", eos_token="</s>", bos_token="<s>", add_bos=True)
    c2 = build_cache(str(src), tokenizer, cfg2, out, progress=False)
    assert c2.n_built == 2 and c2[0][0][0] == tokenizer.token_to_id("<s>")


def test_uint32_ids_for_big_vocabularies(tmp_path, write_jsonl):
    vocab = {f"w{i}": i for i in range(70000)}
    vocab["[UNK]"] = 70000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    write_jsonl(tmp_path / "a.jsonl", [{"text": "w1 w69999 w65536"}])
    c = build_cache(str(tmp_path / "a.jsonl"), tok, FormatConfig(kind="text", add_eos=False),
                    str(tmp_path / "c"), progress=False)
    assert c.dtype == np.uint32 and c[0][0].tolist() == [1, 69999, 65536]


def test_truncated_or_altered_cache_file_is_detected(tmp_path, tokenizer, write_jsonl):
    write_jsonl(tmp_path / "a.jsonl", _docs(50))
    out = str(tmp_path / "c")
    build_cache(str(tmp_path / "a.jsonl"), tokenizer, TEXT, out, progress=False)
    (arrow,) = [os.path.join(out, "shards", f) for f in os.listdir(os.path.join(out, "shards")) if f.endswith(".arrow")]
    data = open(arrow, "rb").read()
    open(arrow, "wb").write(data[:-100])
    with pytest.raises(CacheError, match=r"\.arrow: cache file is \d+ bytes, expected"):
        open_cache(out)
    altered = bytearray(data)
    altered[len(data) // 2] ^= 0xFF
    open(arrow, "wb").write(bytes(altered))
    with pytest.raises(CacheError, match="SHA-256 mismatch"):
        open_cache(out, verify="full")
    with pytest.raises(CacheError, match="hash mismatch"):
        open_cache(out, verify="sample")  # small file: the sampled hash covers every byte
    # a rebuild notices the broken shard and redoes it
    c = build_cache(str(tmp_path / "a.jsonl"), tokenizer, TEXT, out, progress=False)
    assert c.n_built == 1 and len(open_cache(out, verify="full")) == 50


@pytest.mark.parametrize("crash_on", [".arrow", "manifest.json"])
def test_interrupted_build_never_opens(tmp_path, tokenizer, write_jsonl, monkeypatch, crash_on):
    write_jsonl(tmp_path / "a.jsonl", _docs(5))
    real_replace = os.replace

    def crashing_replace(src, dst):  # the process dies between writing a file and renaming it
        if str(dst).endswith(crash_on):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        build_cache(str(tmp_path / "a.jsonl"), tokenizer, TEXT, str(tmp_path / "c"), progress=False)
    with pytest.raises(CacheError, match="no manifest.json"):
        open_cache(str(tmp_path / "c"))
    assert not [f for f in os.listdir(tmp_path / "c" / "shards") if ".tmp-" in f]
    monkeypatch.setattr(os, "replace", real_replace)
    c = build_cache(str(tmp_path / "a.jsonl"), tokenizer, TEXT, str(tmp_path / "c"), progress=False)
    assert c.n_built == (1 if crash_on == ".arrow" else 0) and len(c) == 5


@pytest.mark.parametrize("num_proc", [1, 2])
def test_strict_and_lenient_builds(tmp_path, tokenizer, num_proc):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "hello"}\n{oops\n{"text": ""}\n{"other": 1}\n{"text": "\xc3("}\n{"text": "world"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed_json"):
        build_cache(str(p), tokenizer, TEXT, str(tmp_path / "s"), num_proc=num_proc, progress=False)
    c = build_cache(str(p), tokenizer, TEXT, str(tmp_path / "l"), num_proc=num_proc, strict=False, progress=False)
    assert len(c) == 2
    assert c.report.counts == {"malformed_json": 1, "empty_document": 1, "missing_field": 1, "invalid_utf8": 1}
    assert c.report.examples["missing_field"] == [f"{p}:4: missing_field: field 'text' not in record"]
    assert open_cache(str(tmp_path / "l")).report.total == 4  # the report is stored with the cache


def test_cli_build_and_info(tmp_path, tokenizer, write_jsonl, capsys):
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}]}, {"bad": 1}])
    rc = cli(["build", "--source", str(tmp_path / "a.jsonl"), "--tokenizer", str(tmp_path / "tokenizer.json"),
              "--out", str(tmp_path / "c"), "--kind", "chat", "--chat-template", "chatml", "--num-proc", "1",
              "--lenient", "--no-progress", "--max-length", "64"])
    out = capsys.readouterr().out
    assert rc == 0 and "1 documents" in out and "missing_field: 1" in out
    assert cli(["info", str(tmp_path / "c")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["n_docs"] == 1 and info["skipped"]["counts"] == {"missing_field": 1}


def test_strict_build_does_not_reuse_a_shard_that_skipped_records(tmp_path, tokenizer, write_jsonl):
    """A lenient build's shard lost records; a later strict build must raise, not reuse it silently."""
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello world"}, "{not json", {"text": "the fox"}])
    out = str(tmp_path / "c")
    lenient = build_cache(src, tokenizer, TEXT, out, strict=False, progress=False)
    assert len(lenient) == 2 and lenient.report.counts == {"malformed_json": 1}
    with pytest.raises(DataError, match=r"a\.jsonl:2: malformed_json"):
        build_cache(src, tokenizer, TEXT, out, strict=True, progress=False)
    assert build_cache(src, tokenizer, TEXT, out, strict=False, progress=False).n_built == 0  # lenient: a hit


def test_build_memory_stays_near_the_cache_size(tmp_path, tokenizer, monkeypatch):
    """Host memory of a shard build is a few bytes per token (uint16 ids + mask), not int64 copies.

    tracemalloc sees NumPy's buffers; a shard waits in the parent until its last chunk, so this is
    what bounds the size of a source shard one can tokenize.
    """
    import tracemalloc

    import ftlib.data.cache as cache_mod

    words = "hello world the quick brown fox jumps over lazy dog".split()
    rng = np.random.default_rng(0)
    with open(tmp_path / "a.jsonl", "w") as f:
        for _ in range(1000):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 400))}) + "\n")
    monkeypatch.setattr(cache_mod, "_CHUNK_BYTES", 16 << 10)  # many small chunks, as on a big corpus
    tracemalloc.start()
    try:
        c = build_cache(str(tmp_path / "a.jsonl"), tokenizer, TEXT, str(tmp_path / "c"), progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.n_tokens > 300_000 and c.dtype == np.uint16
    # 10.4 measured (3 B/token held twice while a shard is joined, plus fixed read buffers); 27.5 with int64 chunks
    assert peak / c.n_tokens < 14, f"{peak / c.n_tokens:.1f} bytes per token"


def test_cli_chat_template_from_tokenizer_config(tmp_path, tokenizer, write_jsonl, capsys):
    """A tokenizer_config.json template may be a list of named templates (HF format), or missing."""
    from ftlib.data.formatting import BUILTIN_TEMPLATES

    tokenizer.save(str(tmp_path / "tokenizer.json"))
    write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}]}])
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                 {"name": "default", "template": BUILTIN_TEMPLATES["chatml"]}]}))
    args = ["build", "--source", str(tmp_path / "a.jsonl"), "--tokenizer", str(tmp_path / "tokenizer.json"),
            "--out", str(tmp_path / "c"), "--kind", "chat", "--chat-template", str(cfg), "--num-proc", "1",
            "--no-progress"]
    assert cli(args) == 0 and "1 documents" in capsys.readouterr().out
    cfg.write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(SystemExit) as e:  # a one-line CLI error (exit 2), not a traceback
        cli(args)
    assert e.value.code == 2
    assert "tokenizer_config.json: holds no chat template; pass one with --chat-template" in capsys.readouterr().err


def test_parquet_chunks_are_bounded_by_bytes_not_only_rows(tmp_path, tokenizer, monkeypatch):
    """Rows of long documents must not pile up 4096 to a chunk (x the in-flight window) in memory."""
    import pyarrow as pa

    import ftlib.data.cache as cache_mod

    pq.write_table(pa.table({"text": ["hello world " * 2000] * 40}), tmp_path / "long.parquet")  # 24 KB rows
    sizes, real = [], cache_mod._work
    monkeypatch.setattr(cache_mod, "_work", lambda task: sizes.append(len(task[1])) or real(task))
    monkeypatch.setattr(cache_mod, "_CHUNK_BYTES", 64 << 10)
    c = build_cache(str(tmp_path / "long.parquet"), tokenizer, TEXT, str(tmp_path / "c"), progress=False)
    assert len(c) == 40 and sum(sizes) == 40
    assert max(sizes) <= 3, sizes  # 64 KiB / 24 KB rows


@dataclass(frozen=True)
class _PairConfig:
    """A config following the formatter hook: one record -> two documents with two int columns."""

    columns = ("pair_id", "chosen")  # a class attribute, not a field
    eos_token: str = "</s>"
    bad_columns: bool = False

    def fingerprint(self):
        return f"test-pairs|{self.eos_token}|{self.bad_columns}"

    def formatter(self, tokenizer):
        text = Formatter(tokenizer, FormatConfig(kind="text", eos_token=self.eos_token))

        def fmt(rec, where, report):
            docs = []
            for side, chosen in (("chosen", 1), ("rejected", 0)):
                doc = text({"text": rec["prompt"] + " " + rec[side]}, where, report)
                if doc is None:
                    return None
                doc.extra = {"pair_id": rec["id"], "chosen": chosen} if not self.bad_columns else {"id": 1}
                docs.append(doc)
            return docs

        return fmt


@pytest.mark.parametrize("num_proc", [1, 2])
def test_formatter_hook_gives_several_documents_with_columns(tmp_path, tokenizer, write_jsonl, num_proc):
    recs = [{"id": 10 + i, "prompt": "why is the sky blue", "chosen": "because of Rayleigh scattering",
             "rejected": "hello " * (i + 1)} for i in range(7)]
    src = write_jsonl(tmp_path / "p.jsonl", recs)
    c = build_cache(src, tokenizer, _PairConfig(), str(tmp_path / "c"), num_proc=num_proc, progress=False)
    assert len(c) == 14 and c.columns["pair_id"].tolist() == [10 + i // 2 for i in range(14)]
    assert c.columns["chosen"].tolist() == [1, 0] * 7 and c.columns["chosen"].dtype == np.int64
    text = Formatter(tokenizer, TEXT)
    assert c[1][0].tolist() == text({"text": recs[0]["prompt"] + " " + recs[0]["rejected"]}, "x", SkipReport()
                                    ).input_ids.tolist()
    assert open_cache(str(tmp_path / "c")).manifest["columns"] == ["pair_id", "chosen"]
    with pytest.raises(ValueError, match=r"p\.jsonl:1: the formatter gave columns \['id'\], the config declares"):
        build_cache(src, tokenizer, _PairConfig(bad_columns=True), str(tmp_path / "c2"), progress=False)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_reader_and_worker_skips_share_one_report_per_shard(tmp_path, tokenizer, num_proc):
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(src / "a.jsonl.gz", "wt") as f:  # a bad record (worker) then a cut (reader)
        f.write('{"text": "hello"}\n{bad\n')
        for i in range(3000):
            f.write(json.dumps({"text": f"doc {i}"}) + "\n")
    data = (src / "a.jsonl.gz").read_bytes()
    (src / "a.jsonl.gz").write_bytes(data[: len(data) // 2])
    (src / "b.jsonl").write_text('{"text": "world"}\n{"txt": 1}\n')
    c = build_cache(str(src), tokenizer, TEXT, str(tmp_path / "c"), num_proc=num_proc, strict=False, progress=False)
    assert c.report.counts == {"malformed_json": 1, "unreadable_file": 0, "missing_field": 1}
    assert c.report.unknown == {"unreadable_file": 1}
    metas = [json.loads(p.read_text()) for p in sorted((tmp_path / "c" / "shards").glob("*.json"))]
    by_src = {os.path.basename(m["source"]): m["skipped"] for m in metas}
    assert by_src["a.jsonl.gz"]["counts"] == {"malformed_json": 1, "unreadable_file": 0}
    assert by_src["a.jsonl.gz"]["unknown"] == {"unreadable_file": 1}
    assert by_src["b.jsonl"]["counts"] == {"missing_field": 1}


def test_truncation_stats_are_kept_with_the_cache(tmp_path, tokenizer, write_jsonl, capsys):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "the quick brown fox jumps over the lazy dog " * 3}, {"text": "hi"}])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rc = cli(["build", "--source", str(tmp_path / "a.jsonl"), "--tokenizer", str(tmp_path / "tokenizer.json"),
              "--out", str(tmp_path / "c"), "--kind", "text", "--eos-token", "</s>", "--max-length", "12",
              "--truncation", "head_tail",
              "--head-tail", "4", "--truncation-sep", "<sep>", "--num-proc", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "1 truncated" in out and "truncation=head_tail" in out
    c = open_cache(str(tmp_path / "c"))
    n_full = len(Formatter(tokenizer, TEXT)({"text": "the quick brown fox jumps over the lazy dog " * 3}, "x",
                                             SkipReport()).input_ids)
    assert c.stats == {"n_truncated": 1, "n_truncated_tokens": n_full - 11} and c.lengths.max() == 12
    assert c[0][0][4] == tokenizer.token_to_id("<sep>")


def _unsampled_offset(size: int) -> int:
    """An offset past the first MiB that the sampled fingerprint does not read (shards.shard_fingerprint)."""
    blocks = [((size - (64 << 10)) * (i + 1) // 17, (size - (64 << 10)) * (i + 1) // 17 + (64 << 10))
              for i in range(16)] + [(0, 1 << 20), (size - (1 << 20), size)]
    return next(p for p in range(1 << 20, size, 4096) if all(not (a <= p < b + 100) for a, b in blocks))


def test_same_size_edit_is_seen_with_full_hash_only(tmp_path, tokenizer, capsys):
    """The default fingerprint samples files over 3 MiB: an in-place edit that keeps the size and
    misses the samples reuses the old tokens (documented). ``full_hash`` / ``--full-hash`` sees it,
    and ``info`` says which check a cache was built with."""
    size = 4 << 20
    p = tmp_path / "src" / "big.jsonl"
    p.parent.mkdir()
    at = _unsampled_offset(size)
    first = json.dumps({"text": "hello world"}).encode() + b"\n"
    line = json.dumps({"text": "alpha"}).encode() + b"\n"
    data = bytearray(b"\n" * size)  # blank lines are skipped: two records in 4 MiB
    data[: len(first)] = first
    data[at : at + len(line)] = line
    p.write_bytes(bytes(data))
    texts = lambda c: sorted(tokenizer.decode(c[i][0].tolist()) for i in range(len(c)))
    sampled = build_cache(str(p), tokenizer, TEXT, str(tmp_path / "s"), progress=False)
    full = build_cache(str(p), tokenizer, TEXT, str(tmp_path / "f"), progress=False, full_hash=True)
    assert texts(sampled) == texts(full) == ["alpha", "hello world"]
    data[at : at + len(line)] = json.dumps({"text": "omega"}).encode() + b"\n"  # same size, same mtime order
    p.write_bytes(bytes(data))
    again = build_cache(str(p), tokenizer, TEXT, str(tmp_path / "s"), progress=False)
    assert again.n_built == 0 and texts(again) == ["alpha", "hello world"]  # the default misses it
    again = build_cache(str(p), tokenizer, TEXT, str(tmp_path / "f"), progress=False, full_hash=True)
    assert again.n_built == 1 and texts(again) == ["hello world", "omega"]
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    args = ["build", "--source", str(p), "--tokenizer", str(tmp_path / "tokenizer.json"), "--kind", "text",
            "--eos-token", "</s>",
            "--num-proc", "1", "--no-progress"]
    assert cli(args + ["--out", str(tmp_path / "s")]) == 0 and "0 of 1 shards tokenized" in capsys.readouterr().out
    assert cli(args + ["--out", str(tmp_path / "cli"), "--full-hash"]) == 0
    capsys.readouterr()
    for out, mode in (("s", "sampled-sha256"), ("cli", "sha256")):
        assert cli(["info", str(tmp_path / out)]) == 0
        assert json.loads(capsys.readouterr().out)["source_fingerprint"] == mode


def test_read_limits_are_part_of_the_key_and_reach_the_readers(tmp_path, tokenizer, write_jsonl, capsys):
    from ftlib.data import ReadLimits

    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello world " * 20}, {"text": "the fox"}])
    small = ReadLimits(max_record_bytes=100)
    c = build_cache(src, tokenizer, TEXT, str(tmp_path / "c"), strict=False, progress=False, limits=small)
    assert len(c) == 1 and c.report.counts == {"record_too_large": 1}
    c = build_cache(src, tokenizer, TEXT, str(tmp_path / "c"), progress=False)  # the default bound: read again
    assert len(c) == 2 and c.n_built == 1 and not c.report
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rc = cli(["build", "--source", src, "--tokenizer", str(tmp_path / "tokenizer.json"), "--kind", "text",
              "--eos-token", "</s>",
              "--out", str(tmp_path / "cli"), "--num-proc", "1", "--no-progress", "--lenient",
              "--max-record-bytes", "100"])
    assert rc == 0 and "record_too_large: 1" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"ReadLimits\.max_record_bytes must be a positive int"):
        ReadLimits(max_record_bytes=0)


def _member(tf, name, data: bytes):
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tf.addfile(ti, io.BytesIO(data))


def _cut_gzip(path, n=2000):
    with gzip.open(path, "wt") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i} " + "hello world " * 5}) + "\n")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def test_reader_skips_reach_the_cache_report_and_shard_metadata(tmp_path, tokenizer):
    """A cut .jsonl.gz and a cut tar lose records in the reader: the lenient cache must say so,
    keep it in the shard metadata, and a strict build must not reuse those shards."""
    src = tmp_path / "src"
    src.mkdir()
    _cut_gzip(src / "a.jsonl.gz")
    with tarfile.open(src / "b.tar", "w") as tf:
        for k in range(40):
            _member(tf, f"part{k}.jsonl", b"".join(json.dumps({"text": f"t{k} {j}"}).encode() + b"\n"
                                                   for j in range(50)))
    data = (src / "b.tar").read_bytes()
    (src / "b.tar").write_bytes(data[: len(data) // 2])
    out = str(tmp_path / "c")
    cache = build_cache(str(src), tokenizer, TEXT, out, strict=False, progress=False)
    print("lenient report:", cache.report)
    assert str(cache.report) != "no records skipped"
    assert "unreadable_file" in cache.report.examples and len(cache.report.examples["unreadable_file"]) == 2
    assert "records read before it" in cache.report.examples["unreadable_file"][0]
    assert "a.jsonl.gz" in str(cache.report) and "b.tar" in str(cache.report)
    assert "unreadable_file" in open_cache(out).report.examples  # stored with the shards
    with pytest.raises(DataError, match="unreadable_file"):
        build_cache(str(src), tokenizer, TEXT, out, strict=True, progress=False)


def test_cut_or_keyless_manifest_and_metadata_name_the_file(tmp_path, tokenizer, write_jsonl):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "hello world"}])
    out = tmp_path / "c"
    build_cache(str(tmp_path / "a.jsonl"), tokenizer, TEXT, str(out), progress=False)
    manifest = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(manifest[: len(manifest) // 2])
    with pytest.raises(CacheError, match=r"manifest\.json"):
        open_cache(str(out))
    m = json.loads(manifest)
    del m["dtype"]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CacheError, match=r"manifest\.json: field 'dtype' missing"):
        open_cache(str(out))
    (out / "manifest.json").write_text(manifest)
    (meta_path,) = [p for p in (out / "shards").iterdir() if p.suffix == ".json"]
    meta = json.loads(meta_path.read_text())
    del meta["n_docs"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CacheError, match=rf"{meta_path.name}: field 'n_docs' missing"):
        open_cache(str(out))


def test_a_build_that_gives_no_document_is_an_error(tmp_path, tokenizer):
    """A build of only empty files gave a cache of 0 documents without an error."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text("\n")
    (d / "b.txt").write_text(" ")
    with pytest.raises(DataError, match=r"a\.jsonl: empty_file"):
        build_cache(str(d), tokenizer, TEXT, str(tmp_path / "c"), progress=False)
    with pytest.raises(DataError, match=r"the build gave 0 documents from 2 file\(s\) \(.*a\.jsonl, .*b\.txt\)"):
        build_cache(str(d), tokenizer, TEXT, str(tmp_path / "c"), strict=False, progress=False)
    assert not os.path.exists(tmp_path / "c" / "manifest.json")


def test_a_failed_cache_write_names_the_file(tmp_path, tokenizer, write_jsonl, monkeypatch):
    """A cache build on a full disk said "OSError: Error writing bytes" without a path."""
    (tmp_path / "src").mkdir()
    src = write_jsonl(tmp_path / "src" / "a.jsonl", [{"text": "hello world"}])

    class FullDisk:  # what pyarrow raises when the device is full
        def __init__(self, *a, **k):
            raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    with monkeypatch.context() as m:
        m.setattr(pa, "OSFile", FullDisk)
        with pytest.raises(CacheError, match=r"c/shards/[0-9a-f]{32}\.arrow: could not write the cache shard of "
                                             r".*a\.jsonl: OSError: Error writing bytes.*No space left on device"):
            build_cache(src, tokenizer, TEXT, str(tmp_path / "c"), progress=False)
    assert not os.listdir(tmp_path / "c" / "shards")  # no half file left behind
    from ftlib.data import cache as cache_mod

    real = cache_mod.atomic_write

    def full_for_manifest(path, write):
        if str(path).endswith("manifest.json"):
            raise OSError(28, "No space left on device")
        real(path, write)

    monkeypatch.setattr(cache_mod, "atomic_write", full_for_manifest)
    with pytest.raises(CacheError, match=r"c/manifest\.json: could not write the cache manifest: .*No space left"):
        build_cache(src, tokenizer, TEXT, str(tmp_path / "c"), progress=False)


def test_prepare_cache_one_process_is_build_cache(tmp_path, tokenizer, write_jsonl):
    from ftlib.data import prepare_cache

    src = write_jsonl(tmp_path / "a.jsonl", _docs(7))
    got = prepare_cache(str(src), tokenizer, TEXT, str(tmp_path / "p"), progress=False)
    want = build_cache(str(src), tokenizer, TEXT, str(tmp_path / "b"), progress=False)
    assert len(got) == len(want) == 7
    assert all((got[i][0] == want[i][0]).all() for i in range(7))


@pytest.mark.parametrize("rank", [0, 1])
def test_prepare_cache_rank0_builds_and_shares_its_failure(tmp_path, tokenizer, write_jsonl, monkeypatch, rank):
    """Under torch.distributed (simulated: world 2) rank 0 tokenizes and a rank-0 failure reaches every
    rank with rank 0's message, so no rank waits for a cache that never comes."""
    from ftlib.data import cache as cache_mod

    sent = []
    monkeypatch.setattr(cache_mod, "get_world_size", lambda: 2)
    monkeypatch.setattr(cache_mod, "get_rank", lambda: rank)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n{oops\n')
    rank0_error = ["DataError", f"{bad}:2: malformed_json"]
    monkeypatch.setattr(cache_mod, "from_rank0", lambda obj: sent.append(obj) or (obj if rank == 0 else rank0_error))
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed_json"):
        cache_mod.prepare_cache(str(bad), tokenizer, TEXT, str(tmp_path / f"c{rank}"), progress=False)
    assert len(sent) == 1 and (sent[0] is None if rank else sent[0][0] == "DataError")  # rank 1 did not tokenize
    assert rank or sent[0][1].startswith(rank0_error[1])
    assert not (tmp_path / "c1").exists()
    good = write_jsonl(tmp_path / "good.jsonl", _docs(3))
    monkeypatch.setattr(cache_mod, "from_rank0", lambda obj: None)
    if rank == 1:  # rank 0's finished cache is opened, not built again
        build_cache(str(good), tokenizer, TEXT, str(tmp_path / "g"), progress=False)
    assert len(cache_mod.prepare_cache(str(good), tokenizer, TEXT, str(tmp_path / "g"), progress=False)) == 3
