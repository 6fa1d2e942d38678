"""ftlib.data.readers: every record format, its bounds and its reports."""

import gzip
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ftlib.data import (
    DataError,
    FormatConfig,
    SkipReport,
    build_cache,
    iter_records,
    list_shards,
    readers,
)


def _texts(spec, strict=True):
    rep = SkipReport(strict=strict)
    return [r["text"] for r, _ in iter_records(spec, rep)], rep


def _add_member(tf, name, data: bytes):
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tf.addfile(ti, io.BytesIO(data))


def _bomb_tar(path, name, payload):
    with tarfile.open(path, "w") as tf:
        _add_member(tf, name, payload)
        _add_member(tf, "z/after.jsonl", b'{"text": "after"}\n')


def test_all_formats_in_a_directory(tmp_path, write_jsonl):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", [{"text": "a1"}, {"text": "a2"}])
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "b1"}) + "\n\n")  # blank line skipped
    pq.write_table(pa.table({"text": ["c1", "c2"]}), d / "c.parquet")
    (d / "sub" / "d.txt").write_text("whole\nfile")
    with tarfile.open(d / "e.tar", "w") as tf:
        _add_member(tf, "x/e.jsonl", b'{"text": "e1"}\n')
        _add_member(tf, "x/f.txt", b"f-doc")
    (d / "g.json").write_text(json.dumps([{"text": "g1"}, {"text": "g2"}]))
    with gzip.open(d / "h.txt.gz", "wt") as f:
        f.write("gzipped text")
    (d / "notes.md").write_text("not a data file: named in a warning, not read")
    with pytest.warns(UserWarning, match=r"1 file\(s\) that are not data files were not read: notes\.md"):
        texts, rep = _texts(str(d))
    assert texts == ["a1", "a2", "b1", "c1", "c2", "e1", "f-doc", "g1", "g2", "gzipped text", "whole\nfile"]
    assert not rep
    with pytest.warns(UserWarning):
        kinds = [s.kind for s in list_shards(str(d))]
    assert kinds == ["jsonl", "jsonl", "parquet", "tar", "json", "text", "text"]


def test_tar_is_streamed_never_extracted(tmp_path, monkeypatch):
    p = tmp_path / "s.tar.gz"
    with tarfile.open(p, "w:gz") as tf:
        _add_member(tf, "a.jsonl", b'{"text": "t"}\n')
    monkeypatch.setattr(tarfile.TarFile, "extractall", lambda *a, **k: pytest.fail("extractall called"))
    monkeypatch.setattr(tarfile.TarFile, "extract", lambda *a, **k: pytest.fail("extract called"))
    assert _texts(str(p))[0] == ["t"]


@pytest.mark.parametrize("bad", ["/etc/evil.jsonl", "../evil.jsonl", "a/../../evil.txt"])
def test_unsafe_tar_member(tmp_path, bad):
    p = tmp_path / "s.tar"
    with tarfile.open(p, "w") as tf:
        _add_member(tf, "ok.jsonl", b'{"text": "ok"}\n')
        _add_member(tf, bad, b'{"text": "evil"}\n')
    with pytest.raises(DataError, match=r"s\.tar!.*unsafe_tar_member"):
        _texts(str(p))
    texts, rep = _texts(str(p), strict=False)
    assert texts == ["ok"] and rep.counts == {"unsafe_tar_member": 1}
    assert bad in rep.examples["unsafe_tar_member"][0]


def test_malformed_json_and_invalid_utf8(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "ok1"}\n{"text": broken\n{"text": "\xff\xfe"}\n[1, 2]\n{"text": "ok2"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed_json"):
        _texts(str(p))
    texts, rep = _texts(str(p), strict=False)
    assert texts == ["ok1", "ok2"]
    assert rep.counts == {"malformed_json": 2, "invalid_utf8": 1}
    assert rep.examples["invalid_utf8"][0].startswith(f"{p}:3: invalid_utf8")
    assert f"{p}:4" in rep.examples["malformed_json"][1]
    assert "3 records skipped" in str(rep)


def test_report_keeps_first_locations_and_merges():
    rep = SkipReport(strict=False, keep=2)
    for i in range(5):
        rep.add("empty_document", f"f:{i}")
    other = SkipReport(strict=False)
    other.add("missing_field", "g:1")
    rep.merge(other)
    assert rep.counts == {"empty_document": 5, "missing_field": 1} and rep.total == 6
    assert rep.examples["empty_document"] == ["f:0: empty_document", "f:1: empty_document"]


def test_truncated_gzip_and_tar_links(tmp_path, write_jsonl):
    p = tmp_path / "t.jsonl.gz"
    with gzip.open(p, "wt") as f:
        for i in range(2000):
            f.write(json.dumps({"text": f"doc {i} " + "x" * 50}) + "\n")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"t\.jsonl\.gz:\d+ \(after this point\): unreadable_file"):
        _texts(str(p))
    texts, rep = _texts(str(p), strict=False)
    assert 0 < len(texts) < 2000 and texts[0] == "doc 0 " + "x" * 50
    assert rep.counts == {"unreadable_file": 0} and rep.unknown == {"unreadable_file": 1}  # lost: not countable
    assert f"{len(texts)} records read before it" in rep.examples["unreadable_file"][0]
    t = tmp_path / "l.tar"
    with tarfile.open(t, "w") as tf:
        ti = tarfile.TarInfo("link.jsonl")
        ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(ti)
    texts, rep = _texts(str(t), strict=False)
    assert texts == [] and rep.unknown == {"unsafe_tar_member": 1}


def test_json_files_arrays_objects_and_lines(tmp_path):
    """.json: an array of objects, one object, or JSON Lines named .json; each object has its line."""
    a = tmp_path / "a.json"
    a.write_text('[\n  {"text": "a0"},\n  {"text": "a1"},\n  3\n]\n')
    rep = SkipReport(strict=False)
    got = list(iter_records(str(a), rep))
    assert [(r["text"], loc) for r, loc in got] == [("a0", f"{a}:2"), ("a1", f"{a}:3")]
    assert rep.counts == {"malformed_json": 1} and rep.examples["malformed_json"][0].startswith(f"{a}:4: ")
    (tmp_path / "b.json").write_text('{"text": "one object"}')
    (tmp_path / "c.json").write_text('{"text": "l0"}\n{"text": "l1"}\n')
    with gzip.open(tmp_path / "d.json.gz", "wt") as f:
        f.write('[{"text": "gz"}]')
    assert _texts([str(tmp_path / n) for n in ("b.json", "c.json", "d.json.gz")])[0] == ["one object", "l0", "l1", "gz"]


@pytest.mark.parametrize("text,where,msg", [
    ('[{"text": "ok"}, {"text": "cut', 1, "Unterminated string"),
    ('[{"text": "ok"},\n{"text": "x"}', 2, "not closed"),
    ('[{"text": "ok"}] trailing', 1, "content after the closing"),
    ('[{"text": "ok"} {"text": "no comma"}]', 1, "expected ',' or ']'"),
])
def test_a_broken_json_file_reports_what_was_read(tmp_path, text, where, msg):
    p = tmp_path / "x.json"
    p.write_text(text)
    with pytest.raises(DataError, match=rf"x\.json:{where}: malformed_json: .*{msg}"):
        _texts(str(p))
    texts, rep = _texts(str(p), strict=False)
    assert texts[0] == "ok" and rep.unknown == {"malformed_json": 1}
    assert f"{len(texts)} records read before it" in rep.examples["malformed_json"][0]


def test_webdataset_samples_group_by_key(tmp_path):
    p = tmp_path / "w.tar"
    with tarfile.open(p, "w") as tf:
        _add_member(tf, "a/000.json", b'{"messages": [], "id": 0}')
        _add_member(tf, "a/000.txt", b"zero")
        _add_member(tf, "a/000.en.txt", b"null")
        _add_member(tf, "a/001.txt", b"one")  # a lone member: a file of its own
        _add_member(tf, "a/002.json", b'[{"text": "two-a"}, {"text": "two-b"}]')  # lone: an array is many records
        _add_member(tf, "a/003.json", b'{"text": "dup"}')
        _add_member(tf, "a/003.txt", b"dup again")  # both give "text": refused
        _add_member(tf, "a/004.json", b"[1]")
        _add_member(tf, "a/004.txt", b"x")  # a sample's .json must be one object
    rep = SkipReport(strict=False)
    got = list(iter_records(str(p), rep))
    assert got[0] == ({"messages": [], "id": 0, "text": "zero", "en.txt": "null"}, f"{p}!a/000.{{json,txt,en.txt}}")
    assert [r.get("text") for r, _ in got[1:]] == ["one", "two-a", "two-b"]
    assert rep.counts == {"bad_field": 1, "malformed_json": 1}
    assert "field(s) ['text'] given by more than one member" in rep.examples["bad_field"][0]


def test_refused_and_unsupported_tar_members_are_counted(tmp_path):
    p = tmp_path / "r.tar"
    with tarfile.open(p, "w") as tf:
        _add_member(tf, "../up.jsonl", b'{"text": "1"}\n{"text": "2"}\n\n{"text": "3"}\n')
        _add_member(tf, "notes.md", b"# not data")
        ti = tarfile.TarInfo("fifo")
        ti.type = tarfile.FIFOTYPE
        tf.addfile(ti)
        _add_member(tf, "ok.txt", b"kept")
    rep = SkipReport(strict=False)
    assert [r["text"] for r, _ in iter_records(str(p), rep)] == ["kept"]
    assert rep.counts == {"unsafe_tar_member": 3, "unsupported_tar_member": 0}  # its 3 records, never read as data
    assert rep.unknown == {"unsupported_tar_member": 2}
    assert "3 records skipped, and an unknown number more in 2 place(s) that could not be read" in str(rep)
    assert "unsupported_tar_member: an unknown number (2 places)" in str(rep)


def test_parquet_and_gzip_members_in_a_tar(tmp_path):
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["p0", "p1"]}), buf)
    p = tmp_path / "m.tar.gz"
    with tarfile.open(p, "w:gz") as tf:
        _add_member(tf, "x.parquet", buf.getvalue())
        _add_member(tf, "y.jsonl.gz", gzip.compress(b'{"text": "j0"}\n'))
        _add_member(tf, "z.txt.gz", gzip.compress(b"t0"))
        cut = gzip.compress("".join(json.dumps({"text": f"b{i}"}) + "\n" for i in range(3000)).encode())
        _add_member(tf, "bad.jsonl.gz", cut[: len(cut) // 2])  # a member cut short, in an intact tar
        _add_member(tf, "after.txt", b"after")
    rep = SkipReport(strict=False)
    texts = [r["text"] for r, _ in iter_records(str(p), rep)]
    assert texts[:4] == ["p0", "p1", "j0", "t0"] and texts[-1] == "after"  # the next members are still read
    assert rep.unknown == {"unreadable_file": 1} and "bad.jsonl.gz" in rep.examples["unreadable_file"][0]


def test_report_counts_unknown_losses_apart():
    rep = SkipReport(strict=False)
    assert not rep and str(rep) == "no records skipped"
    rep.add("unreadable_file", "f.gz:10 (after this point)", "EOFError", n=None)
    assert rep and rep.total == 0 and rep.n_unknown == 1 and "unknown" in str(rep)
    other = SkipReport(strict=False)
    other.add("unreadable_file", "p.parquet:rows 1-100", n=100)
    other.merge(rep.to_dict())
    assert other.counts == {"unreadable_file": 100} and other.unknown == {"unreadable_file": 1}
    assert "unreadable_file: 100 + an unknown number (1 place)" in str(other)


@pytest.mark.parametrize("case", ["txt", "txt.gz", "json", "json.gz", "tar txt", "tar json", "tar parquet",
                                  "tar jsonl", "wds txt.gz", "parquet row"])
def test_every_reader_is_bounded(tmp_path, case):
    """No reader holds more than ReadLimits allows: a record over max_record_bytes is refused
    (record_too_large, 1 record), a whole-parsed document over max_file_bytes too (file_too_large,
    records unknown); gzip bombs stop at the bound. Everything after it is still read."""
    lim = readers.ReadLimits(max_record_bytes=4096, max_file_bytes=8192)
    big = b"x" * 20000
    recs = json.dumps([{"text": "x" * 100}] * 100).encode()
    p = tmp_path / "f"
    if case == "parquet row":  # pyarrow reads the row group; the row is kept from the tokenizer
        p = tmp_path / "f.parquet"
        pq.write_table(pa.table({"text": [big.decode(), "after"]}), p)
    elif case in ("txt", "txt.gz", "json", "json.gz"):
        data = big if case.startswith("txt") else recs
        p = tmp_path / f"f.{case}"
        p.write_bytes(gzip.compress(data) if case.endswith(".gz") else data)
    else:
        p = tmp_path / "f.tar"
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": [f"{i:04d}" + "x" * 96 for i in range(200)]}), buf, compression="none",
                       use_dictionary=False)
        member = {"tar txt": ("a/b.txt", big), "tar json": ("a/b.json", recs),
                  "tar parquet": ("a/b.parquet", buf.getvalue()),
                  "tar jsonl": ("a/b.jsonl", json.dumps({"text": big.decode()}).encode() + b"\n"),
                  "wds txt.gz": ("a/b.txt.gz", gzip.compress(big))}[case]
        if case == "wds txt.gz":  # a webdataset sample: the decompressed field is bounded
            with tarfile.open(p, "w") as tf:
                _add_member(tf, "a/b.json", b'{"k": 1}')
                _add_member(tf, *member)
                _add_member(tf, "z/after.jsonl", b'{"text": "after"}\n')
        else:
            _bomb_tar(p, *member)
    record = case in ("txt", "txt.gz", "tar txt", "tar jsonl", "wds txt.gz", "parquet row")
    reason = "record_too_large" if record else "file_too_large"
    bound = "max_record_bytes=4096" if record else "max_file_bytes=8192"
    rep = SkipReport(strict=False)
    got = [r.get("text") for r, _ in iter_records(str(p), rep, limits=lim)]
    assert got == (["after"] if p.suffix in (".tar", ".parquet") else [])
    assert (rep.counts, rep.unknown) == (({reason: 1}, {}) if record else ({reason: 0}, {reason: 1}))
    assert f"ReadLimits.{bound}" in rep.examples[reason][0]
    # without the limit, the same file is read whole
    assert len([r for r, _ in iter_records(str(p), SkipReport(strict=False))]) >= 1


def test_the_old_sources_module_warns_and_holds_the_same_objects():
    import importlib
    import sys

    import ftlib.data

    sys.modules.pop("ftlib.data.sources", None)
    with pytest.warns(DeprecationWarning, match="ftlib.data.sources is deprecated: import from ftlib.data"):
        old = importlib.import_module("ftlib.data.sources")
    assert all(getattr(old, n) is getattr(ftlib.data, n) for n in old.__all__ if n != "item_nbytes")
    assert old.item_nbytes is readers.item_nbytes


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
