"""Regression tests for defects a review of the data pipeline found: each failed before its fix.

They go through public entry points only (build_cache, Formatter, TokenLoader, list_shards), as a
user would; the finer-grained tests live beside each module's own tests.
"""

import gzip
import io
import json
import os
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _chat_templates import TEMPLATES

from ftlib.data import (
    CacheError,
    DataError,
    FormatConfig,
    Formatter,
    SkipReport,
    TokenLoader,
    build_cache,
    iter_records,
    open_cache,
)

TEXT = FormatConfig(kind="text", eos_token="</s>")


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


# 1. reader-side skips --------------------------------------------------------------------------
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


# 2. turn end from template text ----------------------------------------------------------------
CONV = [
    {"role": "user", "content": "why is the sky blue"},
    {"role": "assistant", "content": "because of Rayleigh scattering"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the quick brown fox"},
]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_turn_end_carries_loss_with_template_text(tokenizer, name):
    """The template as text (tokenizer_config.json), not a built-in name: the end-of-turn token after
    each answer must be in the loss, else the model never learns to stop."""
    template, bos, eos, prefix, turn_end, strip = TEMPLATES[name]
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template=template, bos_token=bos, eos_token=eos))
    doc = fmt({"messages": CONV}, "x:1", SkipReport())
    got = tokenizer.decode([i for i, m in zip(doc.input_ids.tolist(), doc.loss_mask) if m], skip_special_tokens=False)
    print(name, repr(got))
    # expected: the tokens that overlap "content + turn end" of each answer in the rendered text
    from ftlib.data import render_chat

    text = render_chat(CONV, template, bos_token=bos or "", eos_token=eos or "", add_generation_prompt=False)
    enc = tokenizer.encode(text, add_special_tokens=False)
    assert enc.ids == doc.input_ids.tolist()
    want, pos = np.zeros(len(enc.ids), np.uint8), 0
    for m in CONV:
        if m["role"] == "assistant":
            body = (m["content"].strip() if strip else m["content"]) + turn_end
            a = text.index(prefix + body, pos) + len(prefix)
            pos = a + len(body)
            want |= np.array([s < pos and e > a for s, e in enc.offsets], np.uint8)
    assert doc.loss_mask.tolist() == want.tolist()
    assert got.count(turn_end) == 2 and got.endswith(turn_end)


# 3. data members inside tar shards and directories ----------------------------------------------
def test_tar_and_directory_data_files_are_read_or_reported(tmp_path):
    """webdataset samples (key.json + key.txt), .json / .parquet / .txt.gz members and .json files in
    a folder are data; anything else in a tar is reported, never skipped without a word."""
    d = tmp_path / "d"
    d.mkdir()
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["from parquet"]}), buf)
    with tarfile.open(d / "wds.tar", "w") as tf:
        _member(tf, "s/000.json", json.dumps({"source": "web"}).encode())
        _member(tf, "s/000.txt", b"sample zero")
        _member(tf, "s/001.json", json.dumps({"text": "sample one"}).encode())
        _member(tf, "s/002.parquet", buf.getvalue())
        _member(tf, "s/003.txt.gz", gzip.compress(b"gzipped member"))
    (d / "arr.json").write_text(json.dumps([{"text": "json array 0"}, {"text": "json array 1"}]))
    got = sorted(r["text"] for r, _ in iter_records(str(d)))
    assert got == sorted(["sample zero", "sample one", "from parquet", "gzipped member", "json array 0",
                          "json array 1"])
    recs = [r for r, _ in iter_records(str(d / "wds.tar"))]
    assert {"source": "web", "text": "sample zero"} in recs
    with tarfile.open(d / "img.tar", "w") as tf:
        _member(tf, "s/000.json", json.dumps({"text": "caption"}).encode())
        _member(tf, "s/000.jpg", b"\xff\xd8 not text")
    with pytest.raises(DataError, match=r"img\.tar!s/000\.jpg: unsupported_tar_member"):
        list(iter_records(str(d / "img.tar")))
    rep = SkipReport(strict=False)
    list(iter_records(str(d / "img.tar"), rep))
    assert rep and "unsupported_tar_member" in rep.examples


# 4. length grouping on several ranks ------------------------------------------------------------
class _Docs:
    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        return np.full(n, i + 1), np.ones(n, np.uint8)


@pytest.mark.parametrize("n", [21, 23, 25])
def test_group_by_length_without_drop_last_keeps_ranks_in_step(n):
    """Every rank must yield the same number of batches, none empty, the short step last."""
    lengths = np.random.default_rng(0).integers(1, 50, size=n)
    loaders = [TokenLoader(_Docs(lengths), batch_size=3, pad_id=0, packing=False, group_by_length=True,
                           mega_batch_mult=2, drop_last=False, rank=r, world_size=4, seed=1) for r in range(4)]
    counts = [len(list(L)) for L in loaders]
    print("batches per rank:", counts)
    assert len(set(counts)) == 1
    for L in loaders:
        steps = L.rank_steps(0)
        assert all(len(s) >= 1 for s in steps) and all(len(s) == 3 for s in steps[:-1])


# 5. the smaller defects -------------------------------------------------------------------------
def test_resume_refuses_reordered_documents():
    a = _Docs([5, 9, 3, 7, 2, 8, 4, 6])
    b = _Docs([9, 5, 3, 7, 2, 8, 4, 6])  # same count, same total tokens, two documents swapped
    state = TokenLoader(a, batch_size=2, pad_id=0, packing=False).state_dict()
    with pytest.raises(ValueError, match="loader state mismatch"):
        TokenLoader(b, batch_size=2, pad_id=0, packing=False).load_state_dict(state)


def test_tokenizer_builtin_truncation_does_not_cut_documents(tokenizer):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.enable_truncation(max_length=4)
    text = {"text": "the quick brown fox jumps over the lazy dog"}
    full = Formatter(tokenizer, TEXT)(text, "x:1", SkipReport())
    with pytest.warns(UserWarning, match="truncation"):
        fmt = Formatter(tok, TEXT)
    assert fmt(text, "x:1", SkipReport()).input_ids.tolist() == full.input_ids.tolist()


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


def test_misspelled_builtin_template_name_is_refused():
    with pytest.raises(ValueError, match=r"'chatlm' is neither a built-in name.*did you mean 'chatml'"):
        FormatConfig(kind="chat", chat_template="chatlm")


def test_hub_revision_with_slashes(tmp_path, monkeypatch, write_jsonl):
    local = tmp_path / "snap"
    (local / "default" / "train").mkdir(parents=True)
    write_jsonl(local / "default" / "train" / "0.jsonl", [{"text": "converted"}])
    calls = []

    def fake_snapshot_download(**kw):
        calls.append(kw)
        return str(local)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    got = [r["text"] for r, _ in iter_records("hf://datasets/org/name@refs/convert/parquet/default/train")]
    assert got == ["converted"]
    assert calls[-1]["repo_id"] == "org/name" and calls[-1]["revision"] == "refs/convert/parquet"
    assert calls[-1]["allow_patterns"][0].startswith("default/train/")


def test_one_empty_assistant_turn_among_others_is_reported(tokenizer):
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello world"},
                        {"role": "user", "content": "why"}, {"role": "assistant", "content": ""}]}
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template="chatml"))
    with pytest.raises(DataError, match="x:3: empty_response"):
        fmt(rec, "x:3", SkipReport())


def test_unreadable_file_counts_the_records_it_lost(tmp_path):
    """A corrupt Parquet row group of 100 rows loses 100 records, not 1; a cut gzip loses an
    unknown number, which must not be reported as 1."""
    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " + "x" * 200 for i in range(300)]}), p, row_group_size=100)
    col = pq.ParquetFile(p).metadata.row_group(1).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    data = bytearray(p.read_bytes())
    data[start : start + 40] = b"\xff" * 40  # row group 1's first page header: garbage
    p.write_bytes(bytes(data))
    rep = SkipReport(strict=False)
    texts = [r["text"] for r, _ in iter_records(str(p), rep)]
    print("parquet:", rep)
    assert len(texts) == 200 and rep.counts == {"unreadable_file": 100}
    _cut_gzip(tmp_path / "g.jsonl.gz")
    rep = SkipReport(strict=False)
    list(iter_records(str(tmp_path / "g.jsonl.gz"), rep))
    print("gzip:", rep)
    assert rep.counts.get("unreadable_file") != 1 and "unknown" in str(rep)


def test_docstrings_point_to_files_that_ship():
    """DESIGN.md is not part of the package or the repository's examples: no module may send a reader there."""
    import ftlib

    pkg = os.path.dirname(ftlib.__file__)
    roots = [pkg, os.path.join(os.path.dirname(pkg), "examples"), os.path.join(os.path.dirname(pkg), "benchmarks")]
    seen = 0
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in sorted(files):
                if name.endswith(".py"):
                    seen += 1
                    path = os.path.join(dirpath, name)
                    assert "DESIGN.md" not in open(path).read(), path
    assert seen > 20
