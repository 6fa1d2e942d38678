import gzip
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ftlib.data import DataError, SkipReport, iter_records, list_shards, shard_fingerprint
from ftlib.data import sources as src


def _texts(spec, strict=True):
    rep = SkipReport(strict=strict)
    return [r["text"] for r, _ in iter_records(spec, rep)], rep


def _add_member(tf, name, data: bytes):
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tf.addfile(ti, io.BytesIO(data))


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
        _add_member(tf, "x/readme.md", b"ignored")
    (d / "notes.md").write_text("unsupported files in a directory are ignored")
    texts, rep = _texts(str(d))
    assert texts == ["a1", "a2", "b1", "c1", "c2", "e1", "f-doc", "whole\nfile"]
    assert rep.total == 0
    kinds = [s.kind for s in list_shards(str(d))]
    assert kinds == ["jsonl", "jsonl", "parquet", "tar", "text"]


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


def test_missing_path_and_unsupported_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list_shards(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DataError, match="unsupported"):
        list_shards(str(tmp_path / "x.csv"))


def test_hub_dataset_resolves_through_snapshot_download(tmp_path, monkeypatch, write_jsonl):
    local = tmp_path / "snap"
    local.mkdir()
    write_jsonl(local / "train.jsonl", [{"text": "from hub"}])
    calls = []

    def fake_snapshot_download(**kw):
        calls.append(kw)
        return str(local)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert _texts("hf://datasets/org/name@v1")[0] == ["from hub"]
    assert calls[0]["repo_id"] == "org/name" and calls[0]["repo_type"] == "dataset"
    assert calls[0]["revision"] == "v1" and "*.jsonl" in calls[0]["allow_patterns"]
    assert src.resolve_hub_dataset("org/name") == str(local)


def test_fingerprint_tracks_content_not_mtime(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    big = b"x" * (5 << 20)
    a.write_bytes(big)
    b.write_bytes(big)  # identical copy: same fingerprint although a different file
    assert shard_fingerprint(str(a)) == shard_fingerprint(str(b))
    b.write_bytes(big[:-1] + b"y")  # last byte changed: inside the sampled tail
    assert shard_fingerprint(str(a)) != shard_fingerprint(str(b))
    assert shard_fingerprint(str(a), full_hash=True).startswith("sha256:")


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
    assert 0 < len(texts) < 2000 and texts[0] == "doc 0 " + "x" * 50 and rep.counts == {"unreadable_file": 1}
    t = tmp_path / "l.tar"
    with tarfile.open(t, "w") as tf:
        ti = tarfile.TarInfo("link.jsonl")
        ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(ti)
    texts, rep = _texts(str(t), strict=False)
    assert texts == [] and rep.counts == {"unsafe_tar_member": 1}


def test_hub_dataset_path_inside_the_repo_selects_a_split(tmp_path, monkeypatch, write_jsonl):
    """hf://datasets/org/name@rev/<path or glob> reads (and fetches) only those files, e.g. the train split."""
    local = tmp_path / "snap"
    (local / "data").mkdir(parents=True)
    write_jsonl(local / "data" / "train-0.jsonl", [{"text": "train"}])
    write_jsonl(local / "data" / "test-0.jsonl", [{"text": "test"}])
    calls = []

    def fake_snapshot_download(**kw):
        calls.append(kw)
        return str(local)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert _texts("hf://datasets/org/name@v1/data/train-*.jsonl")[0] == ["train"]
    assert calls[-1]["repo_id"] == "org/name" and calls[-1]["revision"] == "v1"
    assert calls[-1]["allow_patterns"] == ["data/train-*.jsonl"]  # the test split is not even downloaded
    assert sorted(_texts("hf://datasets/org/name/data")[0]) == ["test", "train"]
    assert calls[-1]["revision"] is None and "data/*.jsonl" in calls[-1]["allow_patterns"]
    with pytest.raises(DataError, match="no such file"):
        list_shards("hf://datasets/org/name/valid-*.jsonl")
