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
    list_shards,
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


# ---- fault-injection review: links, empty files, bounds, messages, BOM -------------------------
def _bounded(fn, seconds=60):
    """fn() in a thread; fails (instead of hanging the suite) if it has not returned in time."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"did not finish in {seconds} s (a walk that never ends?)")
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_symlink_loops_in_a_directory_are_read_once(tmp_path, tokenizer, write_jsonl):
    """data/self -> . turned 1 record into 41 documents in a strict build that said "no records
    skipped"; data/up -> .. made the walk exponential. Each real path is visited once; the links
    not followed are named in one warning."""
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"text": "hello world"}])
    os.symlink(".", d / "self")
    os.symlink("..", d / "up")
    os.symlink("a.jsonl", d / "same.jsonl")
    with pytest.warns(UserWarning, match=r"3 link\(s\) not followed") as w:
        cache = _bounded(lambda: build_cache(str(d), tokenizer, TEXT, str(tmp_path / "c"), progress=False))
    assert len(cache) == 1 and not cache.report
    msg = str(w[0].message)
    assert "self -> . (a directory read already)" in msg
    assert f"up -> .. (a directory that contains {d}: a loop)" in msg
    assert "same.jsonl -> a.jsonl (the file" in msg


def test_links_to_one_file_from_outside_the_listing_are_all_read(tmp_path, write_jsonl):
    """The hub cache links each snapshot file to a content-addressed blob: two files with equal
    bytes share one target and are still two files of the dataset."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snap.mkdir()
    write_jsonl(blobs / "0f3a", [{"text": "same bytes"}])
    os.symlink(blobs / "0f3a", snap / "train-0.jsonl")
    os.symlink(blobs / "0f3a", snap / "train-1.jsonl")
    assert [r["text"] for r, _ in iter_records(str(snap))] == ["same bytes", "same bytes"]


def test_recursive_glob_through_a_link_loop_is_read_once(tmp_path, write_jsonl):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "sub" / "b.jsonl", [{"text": "b"}])
    write_jsonl(d / "a.jsonl", [{"text": "a"}])
    os.symlink("..", d / "sub" / "back")
    with pytest.warns(UserWarning, match=r"sub/back -> \.\. \(a directory read already\)"):
        got = _bounded(lambda: [r["text"] for r, _ in iter_records(str(d / "**" / "*.jsonl"))])
    assert got == ["a", "b"]


def test_dangling_link_names_link_and_target(tmp_path, write_jsonl):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"text": "a"}])
    os.symlink("gone.jsonl", d / "b.jsonl")
    with pytest.raises(DataError, match=r"b\.jsonl: symbolic link to gone\.jsonl, which does not exist"):
        list_shards(str(d))


def test_empty_and_whitespace_files_are_reported(tmp_path, tokenizer, write_jsonl):
    """Empty or whitespace-only data files were passed over without a word."""
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"text": "hello world"}])
    (d / "b_empty.jsonl").write_bytes(b"")
    (d / "c_blank.jsonl").write_text("\n   \n\t\n")
    (d / "d_blank.txt").write_text("  \n")
    (d / "e_empty.json").write_text("[]")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), d / "f_empty.parquet")
    with tarfile.open(d / "g.tar", "w") as tf:
        _member(tf, "x/h.jsonl", b"\n\n")
    with pytest.raises(DataError, match=r"b_empty\.jsonl: empty_file: it holds no records"):
        build_cache(str(d), tokenizer, TEXT, str(tmp_path / "strict"), progress=False)
    cache = build_cache(str(d), tokenizer, TEXT, str(tmp_path / "lenient"), strict=False, progress=False)
    assert len(cache) == 1
    assert cache.report.notes == {"empty_file": 6} and cache.report.total == 0
    text = str(cache.report)
    assert "no records skipped" not in text and "empty_file: 6 (no records lost)" in text
    assert "b_empty.jsonl: empty_file" in text  # the first 5 locations are kept as examples
    rep = SkipReport(strict=False)
    assert list(iter_records(str(d / "g.tar"), rep)) == []
    assert rep.notes == {"empty_file": 1} and "g.tar!x/h.jsonl: empty_file" in str(rep)


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


def test_a_line_over_the_record_bound_is_refused_and_counted(tmp_path):
    """A 10 KB gzip expanding to one 10 MB line was read and tokenized whole. A line over
    ReadLimits.max_record_bytes is read past (never held) and reported; the next line is read."""
    from ftlib.data import ReadLimits

    p = tmp_path / "big.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps({"text": "x" * (3 << 20)}) + "\n" + json.dumps({"text": "after"}) + "\n")
    limits = ReadLimits(max_record_bytes=1 << 20)
    with pytest.raises(DataError, match=r"big\.jsonl\.gz:1: record_too_large: a line of 3145741 bytes is over "
                                        r"ReadLimits\.max_record_bytes=1048576 \(1 MiB\)"):
        list(iter_records(str(p), limits=limits))
    rep = SkipReport(strict=False)
    got = list(iter_records(str(p), rep, limits=limits))
    assert [(r["text"], w.rsplit(":", 1)[1]) for r, w in got] == [("after", "2")]
    assert rep.counts == {"record_too_large": 1}
    assert [r["text"][:3] for r, _ in iter_records(str(p))] == ["xxx", "aft"]  # the default bound is 16 MiB


def test_long_text_is_cut_before_tokenizing(tmp_path, tokenizer):
    """A record far longer than max_length was tokenized whole before truncation (2.2 GB, 37 s for
    10 MB). Now the tokenizer sees a bounded prefix, the kept tokens are those of the whole text,
    and the cut is counted."""
    words = "hello world the quick brown fox jumps over the lazy dog".split()
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(words, 200_000))  # ~1 MB
    seen = []

    class Spy:  # the tokenizer, recording the longest text it was asked to encode
        def __init__(self, tok):
            self.tok = tok

        def encode(self, s, **kw):
            seen.append(len(s))
            return self.tok.encode(s, **kw)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    cfg = FormatConfig(kind="text", eos_token="</s>", max_length=64, truncation="right")
    fmt = Formatter(Spy(tokenizer), cfg)
    doc = fmt({"text": text}, "big.jsonl:1", SkipReport())
    assert max(seen) <= (64 + 64) * 32 < len(text)
    assert doc.input_ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids[:64]
    assert doc.truncated and fmt.stats["n_cut_before_tokenizing"] == 1
    assert fmt.stats["n_cut_chars"] == len(text) - (64 + 64) * 32


def test_instruction_field_of_the_wrong_type_is_named(tokenizer):
    """An instruction record with prompt: 5 blamed "message 0"."""
    fmt = Formatter(tokenizer, FormatConfig(kind="instruction", chat_template="chatml"))
    with pytest.raises(DataError, match=r"d\.jsonl:3: bad_field: field 'prompt' is int, not a string"):
        fmt({"prompt": 5, "response": "hi"}, "d.jsonl:3", SkipReport())
    rep = SkipReport(strict=False)
    assert fmt({"prompt": "hi", "response": ["a"]}, "d.jsonl:4", rep) is None
    assert rep.examples["bad_field"] == ["d.jsonl:4: bad_field: field 'response' is list, not a string"]


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


def test_a_leading_bom_is_stripped_by_every_reader(tmp_path):
    """The .json reader accepted a UTF-8 BOM, .jsonl refused it (and .txt kept it as text)."""
    bom = b"\xef\xbb\xbf"
    d = tmp_path / "d"
    d.mkdir()
    line = lambda t: json.dumps({"text": t}).encode() + b"\n"
    (d / "a.jsonl").write_bytes(bom + line("jsonl"))
    (d / "b.jsonl.gz").write_bytes(gzip.compress(bom + line("jsonl.gz")))
    (d / "c.json").write_bytes(bom + json.dumps([{"text": "json"}]).encode())
    (d / "d.txt").write_bytes(bom + b"txt")
    (d / "e.txt.gz").write_bytes(gzip.compress(bom + b"txt.gz"))
    with tarfile.open(d / "f.tar", "w") as tf:
        _member(tf, "m/lines.jsonl", bom + line("tar jsonl"))
        _member(tf, "m/one.json", bom + json.dumps({"text": "tar json"}).encode())
        _member(tf, "m/two.txt", bom + b"tar txt")
        _member(tf, "s/000.json", bom + json.dumps({"source": "wds"}).encode())
        _member(tf, "s/000.txt", bom + b"wds txt")
        _member(tf, "s/001.json", bom + json.dumps({"source": "wds gz"}).encode())
        _member(tf, "s/001.txt.gz", gzip.compress(bom + b"wds txt.gz"))
    got = [r["text"] for r, _ in iter_records(str(d))]  # strict: any refusal raises
    assert sorted(got) == sorted(["jsonl", "jsonl.gz", "json", "txt", "txt.gz", "tar jsonl", "tar json", "tar txt",
                                  "wds txt", "wds txt.gz"])
    # a BOM anywhere but the start is content: in JSON outside a string it is malformed
    (d / "a.jsonl").write_bytes(line("one") + bom + line("two"))
    with pytest.raises(DataError, match=r"a\.jsonl:2: malformed_json"):
        list(iter_records(str(d / "a.jsonl")))
