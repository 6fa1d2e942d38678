"""ftlib.data.readers: every record format, its bounds and its reports."""

import gzip
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ftlib.data import DataError, SkipReport, iter_records, list_shards, readers


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
