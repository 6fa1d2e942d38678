"""ftlib.data.shards: listing a source spec (paths, globs, hub repos) and fingerprinting shards."""


import os

import pytest

from ftlib.data import (
    DataError,
    FormatConfig,
    SkipReport,
    build_cache,
    iter_records,
    list_shards,
    shard_fingerprint,
    shards,
)


def _texts(spec, strict=True):
    rep = SkipReport(strict=strict)
    return [r["text"] for r, _ in iter_records(spec, rep)], rep


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
    assert shards.resolve_hub_dataset("org/name") == str(local)


def test_fingerprint_tracks_content_not_mtime(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    big = b"x" * (5 << 20)
    a.write_bytes(big)
    b.write_bytes(big)  # identical copy: same fingerprint although a different file
    assert shard_fingerprint(str(a)) == shard_fingerprint(str(b))
    b.write_bytes(big[:-1] + b"y")  # last byte changed: inside the sampled tail
    assert shard_fingerprint(str(a)) != shard_fingerprint(str(b))
    assert shard_fingerprint(str(a), full_hash=True).startswith("sha256:")


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


@pytest.mark.parametrize("spec,want", [
    ("hf://datasets/org/name", ("org/name", None, None)),
    ("hf://datasets/org/name@v1", ("org/name", "v1", None)),
    ("hf://datasets/org/name@v1/data/train-*.parquet", ("org/name", "v1", "data/train-*.parquet")),
    ("hf://datasets/org/name/data", ("org/name", None, "data")),
    ("hf://datasets/org/name@refs/convert/parquet", ("org/name", "refs/convert/parquet", None)),
    ("hf://datasets/org/name@refs/convert/parquet/default/train", ("org/name", "refs/convert/parquet", "default/train")),
    ("hf://datasets/org/name@refs/pr/3/x.jsonl", ("org/name", "refs/pr/3", "x.jsonl")),
    ("hf://datasets/org/name@feature%2Fx/data", ("org/name", "feature/x", "data")),
])
def test_hub_spec_parsing(spec, want):
    assert shards.parse_hub_spec(spec) == want
    try:  # the same answer as huggingface_hub's own parser, where it has one
        from huggingface_hub.utils import parse_hf_uri
    except ImportError:
        return
    u = parse_hf_uri(spec)
    assert (u.id, u.revision, u.path_in_repo or None) == want


TEXT = FormatConfig(kind="text", eos_token="</s>")


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
