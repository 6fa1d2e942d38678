"""ftlib.checkpoint: round trips, verification and fallback, rotation, background writes, no pickle."""

import json
import math
import os
import random
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from ftlib import checkpoint as ckmod
from ftlib.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    best_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from ftlib.checkpoint import format as ckfmt
from ftlib.clip import ZScoreClipper
from ftlib.lora import LoRAConfig, apply_lora, load_adapter, save_adapter
from ftlib.models import LlamaConfig, LlamaForCausalLM, load_pretrained
from ftlib.models._safetensors_io import SafetensorsReader
from ftlib.optim import TrainOptimizer, make_adamw, param_groups
from ftlib.sched import LRScheduler, PlateauCosine

CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


class _Loader:
    """A stand-in loader: state_dict / load_state_dict of plain numbers."""

    def __init__(self):
        self.epoch, self.step = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, s):
        self.epoch, self.step = s["epoch"], s["step"]


def _parts(seed=0, lora=True, tie=False):
    """Model (the same base for every seed), optimizer, schedule, clipper, loader; ``seed`` sets
    the adapter's init (or, without LoRA, perturbs every weight)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=tie))
    torch.manual_seed(seed)
    if lora:
        apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.1, target_modules="all-linear"), verbose=False)
    elif seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=1e-2)))
    sched = LRScheduler(opt.optimizer, PlateauCosine(total=20, warmup=2, window=2, threshold=10.0, patience=1))
    return model, opt, sched, ZScoreClipper(warmup=1), _Loader()


def _train(model, opt, sched, clip, loader, steps=3):
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, CFG["vocab_size"], (2, 9))
        loss = model(ids).float().logsumexp(-1).sum()  # any differentiable loss
        opt.backward(loss, 18)
        res = opt.step(clip)
        sched.step(1, loss=res.loss)
        loader.step += 1


def _kw(model, opt, sched, clip, loader):
    return dict(model=model, optimizer=opt, scheduler=sched, clipper=clip, loader=loader)


def test_round_trip_restores_every_part_bitwise_and_continues_identically(tmp_path):
    a = _parts()
    _train(*a)
    save_checkpoint(tmp_path, 3, **_kw(*a), metrics={"eval_loss": 1.5}, extra={"tokens_seen": 123})
    b = _parts(seed=1)  # another adapter init, fresh optimizer state: all must come from the checkpoint
    assert not torch.equal(a[0].model.layers[0].self_attn.q_proj.lora_A.weight,
                           b[0].model.layers[0].self_attn.q_proj.lora_A.weight)
    random.seed(11)
    torch.manual_seed(11)
    state = load_checkpoint(tmp_path, **_kw(*b))
    assert (state.step, state.metrics, state.extra) == (3, {"eval_loss": 1.5}, {"tokens_seen": 123})
    for (n, p), (_, q) in zip(a[0].named_parameters(), b[0].named_parameters()):
        assert torch.equal(p, q), n
    assert a[2].state_dict() == b[2].state_dict() and a[3].state_dict() == b[3].state_dict()
    assert a[4].state_dict() == b[4].state_dict()
    assert (a[1].steps, a[1].skipped_steps) == (b[1].steps, b[1].skipped_steps)
    # the same next steps, bit for bit, from the same RNG state (dropout masks, data)
    rng = torch.get_rng_state()
    _train(*a, steps=2)
    torch.set_rng_state(rng)
    _train(*b, steps=2)
    for (n, p), (_, q) in zip(a[0].named_parameters(), b[0].named_parameters()):
        assert torch.equal(p, q), n
    sa, sb = a[1].state_dict()["optimizer"]["state"], b[1].state_dict()["optimizer"]["state"]
    for k in sa:
        for name in sa[k]:
            assert torch.equal(sa[k][name], sb[k][name]), (k, name)


def test_rng_states_are_restored(tmp_path):
    model = _parts()[0]
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    save_checkpoint(tmp_path, 1, model=model)
    want = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    load_checkpoint(tmp_path, model=model)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert want[:2] == got[:2] and torch.equal(want[2], got[2])


def test_checkpoint_is_a_peft_format_adapter(tmp_path):
    model = _parts()[0]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    path = save_checkpoint(tmp_path, 7, model=model)
    assert path.name == "step-00000007"
    fresh = LlamaForCausalLM(LlamaConfig(**CFG))
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k}, strict=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**CFG))
    reloaded = load_adapter(base, path, check_base=False).eval()
    ids = torch.randint(0, CFG["vocab_size"], (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids), model.eval()(ids), rtol=0, atol=0)
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4


def test_full_finetune_checkpoint_loads_with_load_pretrained_and_resumes(tmp_path):
    a = _parts(lora=False, tie=True)
    _train(*a)
    path = save_checkpoint(tmp_path, 3, **_kw(*a))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once, as save_pretrained does
    hf = load_pretrained(path)
    for (n, p), (_, q) in zip(a[0].state_dict().items(), hf.state_dict().items()):
        assert torch.equal(p, q), n
    b = _parts(seed=3, lora=False, tie=True)
    load_checkpoint(path, **_kw(*b))
    assert b[0].lm_head.weight is b[0].model.embed_tokens.weight
    for (n, p), (_, q) in zip(a[0].state_dict().items(), b[0].state_dict().items()):
        assert torch.equal(p, q), n


def test_extra_trainable_parameters_outside_the_adapter_are_saved(tmp_path):
    a = _parts()
    a[0].model.norm.weight.requires_grad_(True)  # trained, but not part of the adapter
    a = (a[0], TrainOptimizer(make_adamw(param_groups(a[0], lr=1e-2))), *a[2:])
    _train(*a)
    path = save_checkpoint(tmp_path, 3, model=a[0])
    assert "model.norm.weight" in load_file(str(path / "trainable.safetensors"))
    b = _parts(seed=0)
    b[0].model.norm.weight.requires_grad_(True)
    load_checkpoint(path, model=b[0])
    assert torch.equal(b[0].model.norm.weight, a[0].model.norm.weight)


def _three_checkpoints(tmp_path):
    a = _parts()
    paths = []
    for step in (2, 4, 6):
        _train(*a, steps=1)
        paths.append(save_checkpoint(tmp_path, step, **_kw(*a)))
    return a, paths


@pytest.mark.parametrize("damage", ["no_marker", "truncated_tensors", "corrupt_json", "flipped_byte"])
def test_damaged_checkpoint_is_skipped_with_a_warning_and_the_previous_one_used(tmp_path, damage):
    a, paths = _three_checkpoints(tmp_path)
    bad = paths[-1]
    if damage == "no_marker":
        (bad / MARKER).unlink()
        why = "no COMPLETE marker"
    elif damage == "truncated_tensors":
        f = bad / "adapter_model.safetensors"
        f.write_bytes(f.read_bytes()[:-100])
        why = "truncated"
    elif damage == "corrupt_json":
        f = bad / "state.json"
        text = f.read_text()
        i = text.index('"step"')
        f.write_text(text[:i] + "#" + text[i + 1:])  # one byte changed, same size: no longer JSON
        why = "SHA-256"
    else:
        f = bad / "optimizer.safetensors"
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        why = "SHA-256"
    with pytest.warns(CheckpointWarning, match=f"skipping checkpoint .*{bad.name}.*{why}"):
        assert latest_checkpoint(tmp_path) == paths[1]
    b = _parts(seed=2)
    with pytest.warns(CheckpointWarning, match=bad.name):
        state = load_checkpoint(tmp_path, **_kw(*b))
    assert state.path == paths[1] and state.step == 4
    with pytest.raises(CheckpointError, match=why):
        verify_checkpoint(bad)
    with pytest.raises(CheckpointError):  # asked for by name: refused, not replaced by another
        load_checkpoint(bad, **_kw(*b))


def test_corrupt_json_with_a_forged_marker_still_fails_to_parse(tmp_path):
    _, paths = _three_checkpoints(tmp_path)
    bad = paths[-1]
    (bad / "state.json").write_text('{"step": 6, "mode')
    marker = json.loads((bad / MARKER).read_text())
    marker["files"]["state.json"] = {"bytes": (bad / "state.json").stat().st_size,
                                     "sha256": ckfmt.sha256_file(bad / "state.json")}
    (bad / MARKER).write_text(json.dumps(marker))
    with pytest.warns(CheckpointWarning, match="unreadable train state"):
        assert latest_checkpoint(tmp_path) == paths[1]


def test_no_usable_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, model=_parts()[0])


def test_mismatches_are_refused_with_clear_errors(tmp_path):
    a = _parts()
    path = save_checkpoint(tmp_path, 1, model=a[0], optimizer=a[1])
    with pytest.raises(CheckpointError, match="no scheduler state was saved"):
        load_checkpoint(path, model=a[0], scheduler=a[2])
    with pytest.raises(CheckpointError, match="holds a LoRA adapter but the model has none"):
        load_checkpoint(path, model=LlamaForCausalLM(LlamaConfig(**CFG)))
    other = LlamaForCausalLM(LlamaConfig(**CFG))
    apply_lora(other, LoRAConfig(r=8, alpha=8, target_modules="all-linear"), verbose=False)
    with pytest.raises(CheckpointError, match="adapter does not fit"):
        load_checkpoint(path, model=other)


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    a = _parts()
    ck = Checkpointer(tmp_path, keep=2, metric="eval_loss", mode="min", background=False)
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 1.0, 5: 4.0, 6: 5.0}
    for step, loss in losses.items():
        ck.save(step, model=a[0], metrics={"eval_loss": loss})
    ck.close()
    assert [s for s, _, _ in list_checkpoints(tmp_path)] == [2, 5, 6]  # 2: first to reach the best
    assert ck.best().name == "step-00000002"
    assert best_checkpoint(tmp_path, "eval_loss", "max").name == "step-00000006"
    ck2 = Checkpointer(tmp_path, keep=1, background=False)
    ck2.save(7, model=a[0], metrics={"eval_loss": math.nan})
    assert [s for s, _, _ in list_checkpoints(tmp_path)] == [7]


def test_background_save_snapshots_at_call_time_and_reraises_errors(tmp_path, monkeypatch):
    a = _parts()
    ck = Checkpointer(tmp_path, keep=None)
    name, lora_b = next((n, p) for n, p in a[0].named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.fill_(1.0)
    path = ck.save(1, model=a[0], optimizer=a[1])
    with torch.no_grad():
        lora_b.fill_(2.0)  # training goes on while the thread writes
    assert ck.wait() == path
    saved = load_file(str(path / "adapter_model.safetensors"))
    assert torch.equal(saved["base_model.model." + name], torch.ones_like(lora_b))

    def broken(*args, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(ckfmt, "write_safetensors", broken)
    ck.save(2, model=a[0])
    with pytest.raises(CheckpointError, match="disk full"):
        ck.wait()
    assert not (tmp_path / "step-00000002").exists() and not list(tmp_path.glob(".tmp-*"))
    monkeypatch.undo()
    ck.save(3, model=a[0])  # the error was reported once; saving works again
    ck.close()
    assert [s for s, _, _ in list_checkpoints(tmp_path)] == [1, 3]


def test_stale_temporary_directories_are_ignored_then_removed(tmp_path):
    a = _parts()
    save_checkpoint(tmp_path, 1, model=a[0])
    stale = tmp_path / ".tmp-step-00000002-999999999-1"  # no such process
    stale.mkdir()
    (stale / "adapter_model.safetensors").write_bytes(b"partial")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_checkpoint(tmp_path).name == "step-00000001"
    Checkpointer(tmp_path).close()
    assert not stale.exists()


def test_resaving_a_step_replaces_an_incomplete_directory(tmp_path):
    a = _parts()
    (tmp_path / "step-00000004").mkdir()  # a save that never finished, without its marker
    save_checkpoint(tmp_path, 4, model=a[0])
    verify_checkpoint(tmp_path / "step-00000004")


def _file_format(path):
    data = path.read_bytes()
    assert not data.startswith(b"\x80"), f"{path} looks like a pickle"  # every pickle protocol >= 2
    assert b"torch._utils" not in data and b"_rebuild_tensor" not in data, f"{path} holds pickled tensors"
    if path.suffix == ".safetensors":
        with SafetensorsReader(path) as r:
            for k in r.keys():
                r.read(k)
        load_file(str(path))  # and the reference reader agrees
        return "safetensors"
    json.loads(data)  # every other file is JSON (config, state, marker)
    return "json"


def test_every_file_a_checkpoint_or_adapter_writes_is_safetensors_or_json(tmp_path):
    a = _parts()
    _train(*a)
    save_checkpoint(tmp_path / "ck", 3, **_kw(*a), metrics={"eval_loss": 1.0}, extra={"t": torch.ones(2)})
    b = _parts(lora=False, tie=True)
    _train(*b)
    save_checkpoint(tmp_path / "full", 3, **_kw(*b))
    save_adapter(a[0], tmp_path / "adapter")
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    formats = {p.relative_to(tmp_path).as_posix(): _file_format(p) for p in files}
    common = {"optimizer.safetensors": "safetensors", "state.safetensors": "safetensors", "state.json": "json",
              "COMPLETE": "json"}
    want = {**{f"ck/step-00000003/{k}": v for k, v in {**common, "adapter_model.safetensors": "safetensors",
                                                       "adapter_config.json": "json"}.items()},
            **{f"full/step-00000003/{k}": v for k, v in {**common, "model.safetensors": "safetensors",
                                                         "config.json": "json"}.items()},
            "adapter/adapter_model.safetensors": "safetensors", "adapter/adapter_config.json": "json"}
    assert formats == want  # every file, and no stray one of another kind


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="mode"):
        Checkpointer(tmp_path, mode="best")
    with pytest.raises(ValueError, match="step"):
        ckmod.step_dir_name(-1)
    with pytest.raises(TypeError, match="cannot store a object"):
        save_checkpoint(tmp_path, 1, model=_parts()[0], extra={"x": object()})


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.text(max_size=5),
                  st.floats(allow_nan=True, allow_infinity=True),
                  st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 4)),
                  st.builds(lambda n: np.arange(n, dtype=np.uint32), st.integers(0, 4)))
_tree = st.recursive(_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.tuples(kids, kids),
    st.dictionaries(st.text(max_size=3), kids, max_size=3),
    st.dictionaries(st.integers(0, 9), kids, max_size=3)), max_leaves=12)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@given(_tree)
def test_state_encoding_round_trips_through_strict_json(tree):
    """Invariant: decode(json(encode(x))) == x for tensors, arrays, tuples, int keys, inf and nan."""
    tensors = {}
    text = json.dumps(ckfmt.encode(tree, "x", tensors), allow_nan=False)
    assert _same(tree, ckfmt.decode(json.loads(text), tensors, "test"))


def test_written_safetensors_match_the_reference_writer(tmp_path):
    from safetensors.torch import save_file

    ts = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2).bfloat16(),
          "d": torch.tensor(3.0), "e": torch.zeros(0, 4), "f": torch.tensor([True, False])}
    size, sha = ckfmt.write_safetensors(tmp_path / "ours.safetensors", ts, {"format": "pt"})
    assert size == os.path.getsize(tmp_path / "ours.safetensors")
    assert sha == ckfmt.sha256_file(tmp_path / "ours.safetensors")
    save_file(ts, str(tmp_path / "ref.safetensors"))
    ours, ref = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    assert ours.keys() == ref.keys()
    for k in ts:
        assert ours[k].dtype == ts[k].dtype and torch.equal(ours[k], ts[k]), k


def test_a_lora_checkpoint_loads_in_peft(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from ftlib.models import save_pretrained

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**CFG))
    save_pretrained(base, tmp_path / "base")
    model = load_pretrained(tmp_path / "base")
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear"), verbose=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    path = save_checkpoint(tmp_path / "ck", 5, model=model, base_model_name_or_path=str(tmp_path / "base"))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, path).eval()
    ids = torch.randint(0, CFG["vocab_size"], (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, model.eval()(ids), atol=1e-5, rtol=1e-5)


# ---- issue 21: what a checkpoint holds, who writes it, and what is refused ----------------------


def test_files_the_marker_does_not_list_are_ignored_with_a_warning(tmp_path):
    """A file copied into a verified checkpoint after the save is not loaded (the marker is the manifest)."""
    from safetensors.torch import save_file

    a = _parts()
    path = save_checkpoint(tmp_path, 1, model=a[0])
    b = _parts()
    b[0].model.norm.weight.requires_grad_(True)
    before = b[0].model.norm.weight.detach().clone()
    save_file({"model.norm.weight": torch.full_like(before, 7.0)}, str(path / "trainable.safetensors"))
    verify_checkpoint(path)  # the listed files are intact
    with pytest.warns(CheckpointWarning, match=r"\['trainable.safetensors'\] are not listed in the checkpoint"):
        load_checkpoint(path, model=b[0])
    assert torch.equal(b[0].model.norm.weight, before)


def test_a_second_writer_on_a_root_is_refused_naming_the_holder(tmp_path):
    import socket
    import subprocess
    import sys

    code = ("import sys; from ftlib.checkpoint import Checkpointer; ck = Checkpointer(sys.argv[1]); "
            "print('ready', flush=True); sys.stdin.readline(); ck.close()")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(CheckpointError, match=rf"another writer holds this checkpoint root \(pid {holder.pid} "
                                                  rf"on host '{socket.gethostname()}'"):
            Checkpointer(tmp_path)
        with pytest.raises(CheckpointError, match="another writer"):
            save_checkpoint(tmp_path, 1, model=_parts()[0])
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    assert not (tmp_path / ".lock").exists()  # released by close()
    with Checkpointer(tmp_path):  # free again
        with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
            Checkpointer(tmp_path)  # a second live writer in this process too
    ck = Checkpointer(tmp_path, background=False)
    ck.close()
    ck.save(1, model=_parts()[0])  # saving after close() takes the lock again ...
    with pytest.raises(CheckpointError, match="another writer"):
        Checkpointer(tmp_path)
    ck.close()  # ... and close() gives it back
    assert not (tmp_path / ".lock").exists()


def test_a_stale_lock_is_taken_over_and_another_hosts_lock_is_not(tmp_path):
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "earlier"}))
    with pytest.warns(CheckpointWarning, match=f"took over a stale lock .*pid {dead.pid}.*has exited"):
        ck = Checkpointer(tmp_path)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    ck.close()
    assert not lock.exists()
    lock.write_text(json.dumps({"pid": 1, "host": "some-other-node", "started": "earlier"}))
    with pytest.raises(CheckpointError, match=f"pid 1 on host 'some-other-node'.*delete {lock}"):
        Checkpointer(tmp_path)
    assert json.loads(lock.read_text())["host"] == "some-other-node"  # never removed by the refused writer


def test_a_step_directory_copied_to_another_name_is_refused(tmp_path):
    import shutil

    a = _parts()
    save_checkpoint(tmp_path, 2, model=a[0])
    shutil.copytree(tmp_path / "step-00000002", tmp_path / "step-00000005")
    with pytest.warns(CheckpointWarning, match=r"step-00000005.*marker records step 2 \(copied or renamed"):
        assert latest_checkpoint(tmp_path).name == "step-00000002"
    with pytest.raises(CheckpointError, match="named for step 5 but its marker records step 2"):
        load_checkpoint(tmp_path / "step-00000005", model=a[0])
    assert [s for s, _, _ in list_checkpoints(tmp_path)] == [2]
    shutil.copytree(tmp_path / "step-00000002", tmp_path / "backup")  # a copy under another kind of name loads
    assert load_checkpoint(tmp_path / "backup", model=a[0]).step == 2


def test_rotation_unlinks_symlinked_step_directories_and_leaves_no_dangling_link(tmp_path):
    a = _parts()
    elsewhere = save_checkpoint(tmp_path / "elsewhere", 3, model=a[0])
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000003").symlink_to(elsewhere, target_is_directory=True)
    ck = Checkpointer(root, keep=1, background=False)
    ck.save(4, model=a[0])
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000004"]
    verify_checkpoint(elsewhere)  # the link went, what it pointed to is untouched
    (root / "step-00000002").symlink_to(elsewhere, target_is_directory=True)  # copied/renamed: never resumed
    (root / "step-00000001").symlink_to(tmp_path / "gone", target_is_directory=True)  # already dangling
    ck.save(5, model=a[0])
    ck.close()
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert names == ["step-00000002", "step-00000005"]  # a failing one is left for inspection, as a link
    import shutil

    shutil.rmtree(elsewhere)  # its target rotated away elsewhere: the next rotation removes the dangling link
    save_checkpoint(root, 6, model=a[0], keep=1)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000006"]


def test_a_refused_adapter_names_each_differing_field(tmp_path):
    a = _parts()
    path = save_checkpoint(tmp_path, 1, model=a[0])
    other = LlamaForCausalLM(LlamaConfig(**CFG))
    apply_lora(other, LoRAConfig(r=8, alpha=16, use_rslora=True, target_modules="all-linear"), verbose=False)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, model=other)
    msg = str(e.value)
    assert "adapter does not fit" in msg and "r 4 -> 8" in msg and "lora_alpha 8 -> 16" in msg, msg
    assert "use_rslora False -> True" in msg and "{" not in msg, msg  # fields, not two dumped dicts


def _fallen_back(to, tmp_path):
    """A TrainOptimizer (fp16, fallback ``to``) that fell back on its first overflow, saved at step 2."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = TrainOptimizer(make_adamw([{"params": list(model.parameters())}], lr=1e-2), precision="fp16",
                         fallback=to, fallback_after=1, fallback_window=4)
    for overflow in (True, False):
        opt.backward((model(torch.ones(2, 4)) ** 2).sum(), 6)
        if overflow:
            model.weight.grad[0, 0] = float("inf")
        opt.step()
    assert opt.precision == to and opt.fell_back_at == 1
    return model, save_checkpoint(tmp_path, 2, model=model, optimizer=opt)


def test_a_fallen_back_run_resumes_and_without_fallback_the_refusal_says_what_to_pass(tmp_path):
    model, path = _fallen_back("bf16", tmp_path)
    plain = TrainOptimizer(make_adamw([{"params": list(model.parameters())}], lr=1e-2), precision="fp16")
    with pytest.raises(CheckpointError, match=r"saved with precision='bf16': the run started in fp16 and fell back "
                                              r"to bf16 at step 1.*precision='fp16', fallback='bf16'"):
        load_checkpoint(path, model=model, optimizer=plain, rng=False)
    ok = TrainOptimizer(make_adamw([{"params": list(model.parameters())}], lr=1e-2), precision="fp16",
                        fallback="bf16", fallback_after=1, fallback_window=4)
    load_checkpoint(path, model=model, optimizer=ok, rng=False)
    assert (ok.precision, ok.fell_back_at, ok.scaler, ok.steps, ok.skipped_steps) == ("bf16", 1, None, 1, 1)
