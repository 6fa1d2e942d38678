"""Sharded checkpoints: exact resume on 2 ranks, resharding 2 -> 1, the shared layout and its checks.

The 2-rank checkpoints come from ``_dist_train_worker.py`` (saved at step SAVE_AT of every case,
resumed there bit for bit); the rest runs in this process, where a ``ShardedCheckpointer``
works without torch.distributed (one shard).
"""

import json
import warnings

import pytest
import torch
from _dist_common import CASES, SAVE_AT, STEPS, build, parts, saved_weights, train
from conftest import reference
from safetensors.torch import load_file

from ftlib.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    step_dir_name,
    verify_checkpoint,
)
from ftlib.distributed import ShardedCheckpointer, save_sharded_checkpoint
from ftlib.distributed.checkpoint import SHARDS
from ftlib.lora import save_adapter

STEP = step_dir_name(SAVE_AT)


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_rank_checkpoint_layout_and_exact_resume(two_ranks, case):
    root = two_ranks / case / "ckpt"
    path = latest_checkpoint(root)  # the one-process API reads sharded checkpoints' markers too
    assert path is not None and path.name == STEP
    files = verify_checkpoint(path)["files"]
    shards = sorted(f for f in files if f.startswith(f"{SHARDS}/"))
    assert [f.split("/")[1][:11] for f in shards] == ["shard-00001", "shard-00002"], shards  # one per rank
    assert {"rank-00000.json", "rank-00001.json", "state.json"} <= set(files)
    assert ("adapter_model.safetensors" in files) == (CASES[case]["lora"] is not None)
    for f in path.rglob("*"):  # no pickle: DCP's .metadata would be one
        assert f.is_dir() or f.name == MARKER or f.suffix in (".json", ".safetensors"), f
    [(step, _, metrics)] = list_checkpoints(root)
    records = json.loads((two_ranks / case / "records.json").read_text())
    assert step == SAVE_AT and metrics["loss"] == records["records"][SAVE_AT - 1]["loss"]
    # the worker resumed a fresh model from it and asserted the same losses and weights bit for bit
    assert records["resumed"] == records["records"][SAVE_AT:]


def _resume_here(root, case, **kw):
    module = build(case)
    opt, sched, clip, loader = parts(case, module, rank=0, world=1)
    info = load_checkpoint(root, model=module, optimizer=opt, scheduler=sched, clipper=clip, loader=loader,
                                   **kw)
    return module, info, train(module, opt, sched, clip, loader, start=info.step)


@pytest.mark.distributed
@pytest.mark.parametrize("run,case", [(c, c) for c in sorted(CASES)] + [("hsdp", "lora"), ("ddp", "lora")])
def test_two_rank_checkpoint_resumes_in_one_process(two_ranks, run, case):
    """Resharding 2 -> 1 (FSDP2, HSDP and DDP checkpoints): weights, optimizer state, schedule, clipper
    and the loader position all carry over."""
    with pytest.warns(CheckpointWarning, match="saved by 2 ranks, restored on 1"):
        module, info, records = _resume_here(two_ranks / run / "ckpt", case)
    ref_module, want, _ = reference(case)
    assert info.step == SAVE_AT and info.extra == ({"tag": case} if run == case else {})
    assert len(records) == STEPS - SAVE_AT
    for got, exp in zip(records, want[SAVE_AT:]):
        assert got["tokens"] == exp["tokens"]  # the loader went on with the same global batches
        assert abs(got["loss"] - exp["loss"]) <= 2e-6 * exp["loss"], (got["loss"], exp["loss"])
        assert abs(got["grad_norm"] - exp["grad_norm"]) <= 2e-6 * exp["grad_norm"]
    final, ref = saved_weights(module), saved_weights(ref_module)
    for k in ref:
        torch.testing.assert_close(final[k], ref[k], atol=1e-6, rtol=1e-6, msg=lambda m, k=k: f"{case} {k}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["lora", "qlora"])
def test_adapter_in_a_sharded_checkpoint_is_the_one_process_adapter(two_ranks, case, tmp_path):
    path = two_ranks / case / "ckpt" / STEP
    module = build(case)
    with pytest.warns(CheckpointWarning):
        load_checkpoint(path, model=module)
    save_adapter(module.model, tmp_path)
    got, want = load_file(path / "adapter_model.safetensors"), load_file(tmp_path / "adapter_model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((path / "adapter_config.json").read_text()) == json.loads(
        (tmp_path / "adapter_config.json").read_text())


# ---- one process --------------------------------------------------------------------------------


def _run(case, steps, ckpt=None, save_at=(), **save_kw):
    module = build(case)
    opt, sched, clip, loader = parts(case, module, rank=0, world=1)

    def on_step(step, record):
        if step in save_at:
            ckpt.save(step, model=module, optimizer=opt, scheduler=sched, clipper=clip, loader=loader,
                      metrics={"loss": record["loss"]}, **save_kw)

    return module, train(module, opt, sched, clip, loader, stop=steps, on_step=on_step)


@pytest.mark.parametrize("background", [True, False])
def test_one_process_save_resume_and_rotation(tmp_path, background):
    with ShardedCheckpointer(tmp_path, keep=2, metric="loss", background=background) as ck:
        module, want = _run("lora", STEPS, ck, save_at=range(1, STEPS + 1))
    kept = [s for s, _, _ in list_checkpoints(tmp_path)]
    best = min(range(1, STEPS + 1), key=lambda s: want[s - 1]["loss"])
    assert kept == sorted({STEPS - 1, STEPS, best})  # the newest two and the best by loss
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    _, _, resumed = _resume_here(tmp_path / step_dir_name(STEPS - 1), "lora")
    assert resumed == want[STEPS - 1:]


def test_background_save_snapshots_before_returning(tmp_path):
    """The training step after ``save`` changes the weights in place while the write is in flight."""
    module = build("full")
    with ShardedCheckpointer(tmp_path) as ck:
        ck.save(1, model=module, rng=False)
        want = {k: v.clone() for k, v in saved_weights(module).items()}
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1000.0)
    fresh = build("full")
    load_checkpoint(tmp_path, model=fresh, rng=False)
    got = saved_weights(fresh)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_corrupt_or_incomplete_newest_falls_back(tmp_path):
    with ShardedCheckpointer(tmp_path, keep=None, background=False) as ck:
        _run("lora", 2, ck, save_at=(1, 2))
    shard = next((tmp_path / step_dir_name(2) / SHARDS).iterdir())
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match="SHA-256 differs"):
        _, info, _ = _resume_here(tmp_path, "lora")
    assert info.step == 1
    with pytest.raises(CheckpointError, match="SHA-256 differs"):  # a step directory given by name: no fallback
        _resume_here(tmp_path / step_dir_name(2), "lora")
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match="truncated"):
        _resume_here(tmp_path / step_dir_name(2), "lora")
    (tmp_path / step_dir_name(1) / MARKER).unlink()  # an unfinished save is never resumed from
    with pytest.warns(CheckpointWarning), pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        _resume_here(tmp_path, "lora")


def test_what_does_not_fit_is_named(tmp_path):
    saved = build("lora")
    save_sharded_checkpoint(tmp_path / "lora", 1, model=saved, optimizer=parts("lora", saved, 0, 1)[0])
    with pytest.raises(CheckpointError, match="holds adapter weights, the model is a full fine-tuning model"):
        load_checkpoint(tmp_path / "lora", model=build("full"), rng=False)
    other = build("full")
    from ftlib.lora import LoRAConfig, apply_lora

    apply_lora(other.model, LoRAConfig(r=5, alpha=8, target_modules="all-linear"), verbose=False)
    with pytest.raises(CheckpointError, match=r"lora_A.weight has shape \[3, 32\] in the checkpoint, \[5, 32\] here"):
        load_checkpoint(tmp_path / "lora", model=other, rng=False)
    # one load_checkpoint reads either kind: the sharded checkpoint in one process (it used to refuse it)
    assert load_checkpoint(tmp_path / "lora", model=build("lora"), rng=False).step == 1
    module = build("lora")
    opt, sched, clip, loader = parts("lora", module, 0, 1)
    with pytest.raises(CheckpointError, match="no clipper state was saved"):
        load_checkpoint(tmp_path / "lora", model=module, clipper=clip, rng=False)
    # and a one-process checkpoint through the distributed name (the same function; it used to refuse it)
    with Checkpointer(tmp_path / "single", background=False) as ck:
        ck.save(1, model=module.model)
    assert load_checkpoint(tmp_path / "single", model=module.model).step == 1


def test_loader_position_needs_the_same_global_batch(tmp_path):
    module = build("lora")
    opt, sched, clip, loader = parts("lora", module, 0, 1)
    next(iter(loader))
    save_sharded_checkpoint(tmp_path, 1, model=module, loader=loader)
    from _dist_common import Docs

    from ftlib.data import TokenLoader

    same = TokenLoader(Docs(), batch_size=2, pad_id=0, seq_len=16, seed=3, rank=1, world_size=2)
    load_checkpoint(tmp_path, loader=same, rng=False)  # 4 x 1 == 2 x 2: the same global steps
    assert same.step == 1 and same.rank == 1
    other = TokenLoader(Docs(), batch_size=3, pad_id=0, seq_len=16, seed=3)
    with pytest.raises(CheckpointError, match="exact resume on another world size needs the same global batch"):
        load_checkpoint(tmp_path, loader=other, rng=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same world size: RNG restored without a warning
        load_checkpoint(tmp_path, loader=parts("lora", module, 0, 1)[3])


def _fp16_fell_back(module):
    """A TrainOptimizer (fp16, fallback fp32) over ``module``'s trainable weights, fallen back on its first overflow."""
    from ftlib.optim import TrainOptimizer, make_adamw, param_groups

    opt = TrainOptimizer(make_adamw(param_groups(module.model, lr=1e-2), lr=1e-2), precision="fp16", fallback="fp32",
                         fallback_after=1, fallback_window=4)
    trainable = [p for p in module.parameters() if p.requires_grad]
    for overflow in (True, False):
        opt.backward(sum((p.float() ** 2).sum() for p in trainable), 10)
        if overflow:
            trainable[0].grad.view(-1)[0] = float("inf")
        opt.step()
    return opt


def test_a_run_whose_fp16_fell_back_resumes_from_a_sharded_checkpoint(tmp_path):
    """Issue 20, bug 2: the sharded path restores the TrainOptimizer through its own load_state_dict."""
    module = build("lora")
    opt = _fp16_fell_back(module)
    assert (opt.precision, opt.fell_back_at, opt.steps, opt.skipped_steps) == ("fp32", 1, 1, 1)
    save_sharded_checkpoint(tmp_path, 2, model=module, optimizer=opt)
    fresh = build("lora")
    from ftlib.optim import TrainOptimizer, make_adamw, param_groups

    opt2 = TrainOptimizer(make_adamw(param_groups(fresh.model, lr=1e-2), lr=1e-2), precision="fp16", fallback="fp32",
                          fallback_after=1, fallback_window=4)
    load_checkpoint(tmp_path, model=fresh, optimizer=opt2, rng=False)
    assert (opt2.precision, opt2.fell_back_at, opt2.scaler, opt2.steps, opt2.skipped_steps) == ("fp32", 1, None, 1, 1)
    assert opt2.state_dict()["fallback"] == opt.state_dict()["fallback"]
    want, got = opt.optimizer.state_dict()["state"], opt2.optimizer.state_dict()["state"]
    assert want.keys() == got.keys() and all(torch.equal(want[i][k], got[i][k]) for i in want for k in want[i])


def test_a_shard_file_copied_in_after_the_save_is_not_read(tmp_path):
    module = build("full")
    save_sharded_checkpoint(tmp_path, 1, model=module, rng=False)
    shards = tmp_path / step_dir_name(1) / SHARDS
    [real] = list(shards.iterdir())
    stray = load_file(real)
    from safetensors.torch import save_file

    save_file({k: torch.full_like(v, 5.0) for k, v in stray.items()}, str(shards / "shard-00002-model-00001-of-00001.safetensors"))
    fresh = build("full")
    with pytest.warns(CheckpointWarning, match="shard-00002-model-00001-of-00001.safetensors'] are not listed"):
        load_checkpoint(tmp_path, model=fresh, rng=False)
    want, got = saved_weights(module), saved_weights(fresh)
    assert all(torch.equal(want[k], got[k]) for k in want)
