"""ftlib.data.shards: listing a source spec (paths, globs, hub repos) and fingerprinting shards."""


import pytest

from ftlib.data import DataError, SkipReport, iter_records, list_shards, shard_fingerprint, shards


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
