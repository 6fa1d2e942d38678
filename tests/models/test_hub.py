"""Checkpoint I/O: bit-identical round trips (single file and sharded), tied weights, bad files."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftlib.models import load_config, load_pretrained, parse_size, save_pretrained


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_round_trip_single_file(make_model, tmp_path, model_type):
    model = make_model(model_type)
    written = save_pretrained(model, tmp_path)
    assert written == ["model.safetensors", "config.json"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["dtype"] == "float32"
    loaded = load_pretrained(tmp_path)
    _assert_same_weights(model, loaded)
    assert loaded.config == model.config
    ids = torch.randint(0, 128, (2, 5))
    assert torch.equal(loaded(ids), model(ids))
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_round_trip_sharded_and_dtype(make_model, tmp_path):
    model = make_model("llama").to(torch.bfloat16)
    written = save_pretrained(model, tmp_path, max_shard_size="20KB")
    shards = [w for w in written if w.startswith("model-")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    for s in shards:  # no shard above the limit unless it holds a single bigger tensor
        tensors = load_file(tmp_path / s)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 20_000 or len(tensors) == 1
    loaded = load_pretrained(tmp_path)
    _assert_same_weights(model, loaded)
    # converting on load: every floating tensor ends in the requested dtype
    f32 = load_pretrained(tmp_path, dtype="float32")
    assert all(p.dtype == torch.float32 for p in f32.parameters())
    assert torch.equal(f32.model.embed_tokens.weight, model.model.embed_tokens.weight.float())
    # saving again as one file removes the stale shards and index
    save_pretrained(loaded, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    _assert_same_weights(model, load_pretrained(tmp_path))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("10kb") == 10_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def test_old_rotary_buffers_are_ignored(make_model, tmp_path):
    model = make_model()
    save_pretrained(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _assert_same_weights(model, load_pretrained(tmp_path))


def test_missing_tensor_names_file_and_tensor(make_model, tmp_path):
    save_pretrained(make_model(), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]") as e:
        load_pretrained(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_wrong_shape_names_file_and_tensor(make_model, tmp_path):
    save_pretrained(make_model(), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.norm.weight"] = torch.ones(31)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.norm.weight' has shape \(31,\), "
                                         r"the config expects \(32,\)"):
        load_pretrained(tmp_path)


def test_unexpected_tensor_is_an_error(make_model, tmp_path):
    save_pretrained(make_model(), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.9.mlp.up_proj.weight"] = torch.ones(2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.9.mlp.up_proj.weight'"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 4])
def test_truncated_safetensors_file(make_model, tmp_path, keep):
    save_pretrained(make_model(), tmp_path, max_shard_size="30KB")
    shard = sorted(p for p in os.listdir(tmp_path) if p.startswith("model-"))[-1]
    path = tmp_path / shard
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match=f"{shard}: corrupt or truncated safetensors file"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("change,match", [
    (lambda d: {"weight_map": list(d["weight_map"])}, "field weight_map must be an object"),
    (lambda d: [d], "need a 'weight_map' object"),
    (lambda d: {"weight_map": {**d["weight_map"], "lm_head.weight": 3}}, r"weight_map\['lm_head.weight'\] must be"),
    (lambda d: {"weight_map": {**d["weight_map"], "lm_head.weight": "../elsewhere.safetensors"}}, "shard file name"),
])
def test_index_field_types(make_model, tmp_path, change, match):
    save_pretrained(make_model(), tmp_path, max_shard_size="30KB")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps(change(json.loads(index.read_text()))))
    with pytest.raises(ValueError, match=match) as e:
        load_pretrained(tmp_path)
    assert str(index) in str(e.value)


def test_missing_shard_and_missing_files(make_model, tmp_path):
    shards = [w for w in save_pretrained(make_model(), tmp_path, max_shard_size="30KB") if w.startswith("model-")]
    os.remove(tmp_path / shards[1])
    with pytest.raises(FileNotFoundError, match=f"names shard {shards[1]}, which is missing"):
        load_pretrained(tmp_path)
    os.remove(tmp_path / "model.safetensors.index.json")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_pretrained(tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_pretrained(tmp_path)


def test_unknown_model_type_names_config_file(make_model, tmp_path):
    save_pretrained(make_model(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: model_type 'gpt_neox' is not supported"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: invalid JSON at line 1 column 2"):
        load_config(tmp_path)


def test_load_config_reads_the_file_or_its_folder(make_model, tmp_path):
    """One config reader: a config.json given itself or by its folder is the same config."""
    save_pretrained(make_model(), tmp_path)
    (tmp_path / "config.json").rename(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_config(tmp_path)
    (tmp_path / "other.json").rename(tmp_path / "config.json")
    assert load_config(tmp_path / "config.json") == load_config(tmp_path) == make_model().config


def test_hub_repo_id_from_cache(make_model, tmp_path, monkeypatch):
    # A repo id resolves through huggingface_hub's cache without network: seed the cache layout.
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny" / "snapshots" / ("0" * 40)
    save_pretrained(make_model(), snap)
    (cache / "models--acme--tiny" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    _assert_same_weights(make_model(), load_pretrained("acme/tiny"))
    with pytest.raises(FileNotFoundError, match="acme/absent"):
        load_pretrained("acme/absent")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_pretrained(str(tmp_path / "nope"))


def test_failed_save_leaves_no_half_file(make_model, tmp_path, monkeypatch):
    import safetensors.torch

    def broken(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(make_model(), tmp_path)
    assert os.listdir(tmp_path) == []


def test_crash_while_overwriting_a_sharded_save_never_loads_a_mix(make_model, tmp_path, monkeypatch):
    """Re-saving into a directory: a crash after some shards must not leave old + new shards that load."""
    import safetensors.torch

    old, new = make_model(seed=0), make_model(seed=1)
    save_pretrained(old, tmp_path, max_shard_size="20KB")
    real, n = safetensors.torch.save_file, []

    def dies_on_second_shard(tensors, path, metadata=None):
        n.append(path)
        if len(n) == 2:
            raise KeyboardInterrupt
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", dies_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(new, tmp_path, max_shard_size="20KB")
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_pretrained(tmp_path)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    save_pretrained(new, tmp_path, max_shard_size="20KB")
    got = load_pretrained(tmp_path)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in new.state_dict().items())


def test_save_refuses_to_drop_an_untied_lm_head(make_model, tmp_path):
    """tie_word_embeddings=True stores no lm_head; one that no longer equals the embedding would be lost."""
    model = make_model("qwen2")  # tied
    save_pretrained(model, tmp_path / "ok")  # tied: fine, and lm_head is not stored
    assert "lm_head.weight" not in load_file(str(tmp_path / "ok" / "model.safetensors"))
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 0.5)  # untied and changed
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        save_pretrained(model, tmp_path / "bad")
    assert not (tmp_path / "bad" / "model.safetensors").exists()


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_save_refuses_unmerged_adapters(make_model, tmp_path, quantize):
    """Unmerged adapters (base_layer / lora_A names) or NF4 weights would load in transformers as
    randomly initialised layers: refused with the way out; after merge_and_unload the save works."""
    from ftlib.lora import LoRAConfig, apply_lora, merge_and_unload

    model = apply_lora(make_model(), LoRAConfig(r=2, target_modules=["q_proj"], quantize=quantize,
                                                quantize_modules="all"))
    with pytest.raises(ValueError, match=r"unmerged adapters .*base_layer.*Merge first \(ftlib.lora.merge_and_unload"
                                         r"\(model\)\) or save the adapter alone \(ftlib.lora.save_adapter\)"):
        save_pretrained(model, tmp_path / "adapted")
    assert not (tmp_path / "adapted").exists()
    merged = merge_and_unload(model)
    save_pretrained(merged, tmp_path / "merged")
    _assert_same_weights(merged, load_pretrained(tmp_path / "merged"))


def test_crash_while_saving_one_file_over_a_sharded_save_never_loads_the_old_shards(make_model, tmp_path, monkeypatch):
    """A one-file save over a sharded one: a crash before the cleanup must not leave the old index
    naming the old shards (that would load the old model as if it were the new one)."""
    import safetensors.torch

    old, new = make_model(seed=0), make_model(seed=1)
    save_pretrained(old, tmp_path, max_shard_size="20KB")
    real = safetensors.torch.save_file

    def dies(tensors, path, metadata=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(new, tmp_path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_pretrained(tmp_path)

    def no_more_writes(*args):
        raise KeyboardInterrupt

    def dies_after_weights(tensors, path, metadata=None):  # the weights land, config.json and cleanup do not
        real(tensors, path, metadata=metadata)
        monkeypatch.setattr("ftlib.models.hub.atomic_write", no_more_writes)

    monkeypatch.setattr(safetensors.torch, "save_file", dies_after_weights)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(new, tmp_path)
    _assert_same_weights(new, load_pretrained(tmp_path))


def test_load_pretrained_records_its_source(make_model, tmp_path):
    save_pretrained(make_model(), tmp_path)
    assert load_pretrained(tmp_path).name_or_path == str(tmp_path)
    assert load_pretrained(str(tmp_path)).name_or_path == str(tmp_path)
