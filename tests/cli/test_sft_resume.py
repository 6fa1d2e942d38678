"""Exact resume: a run SIGKILLed at seeded random points and resumed ends bitwise equal to one never
stopped; two runs with the same seed are bitwise equal. Each run is ``ftlib sft`` in a
subprocess (tests/cli/_sft_kill_worker.py), on the demo's tiny model with a small dataset, with LoRA
dropout on, a DataLoader worker, two epochs and several accumulation windows per epoch.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ftlib.cli import sft

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_sft_kill_worker.py")
SFT = ("-m", "ftlib", "sft")  # torchrun -m ftlib sft ...
GRAD_ACCUM = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from ftlib.train.demo import make_demo_assets

    return make_demo_assets(tmp_path_factory.mktemp("assets"), n_records=160)


def _args(assets: Path, out: Path) -> list[str]:
    return ["--model", str(assets / "base"), "--data", str(assets / "data"), "--eval-data", str(assets / "eval"),
            "--out", str(out), "--seq-len", "96", "--batch-size", "2", "--grad-accum", str(GRAD_ACCUM),
            "--epochs", "2", "--lr", "3e-3", "--lora-r", "4", "--lora-dropout", "0.2", "--save-every", "2",
            "--keep", "2", "--num-proc", "1", "--num-workers", "1", "--log-every", "100", "--seed", "3"]


def _run(assets, out, *kill, resume=False, expect_kill=False):
    cmd = [sys.executable, str(WORKER), *kill, "--", *_args(assets, out), *(["--resume"] if resume else [])]
    # one thread: runs are bitwise comparable only under the same settings, and two-thread processes
    # on a shared 2-core machine lose most of their time to oversubscription
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    if expect_kill:
        assert r.returncode == -9, f"expected a SIGKILL, got rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    else:
        assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def _final(out: Path):
    steps = sorted((out / "checkpoints").glob("step-*"))
    last = steps[-1]
    state = json.loads((last / "state.json").read_text())
    losses = [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") != "eval"]
    adapter, optim = load_file(str(last / "adapter_model.safetensors")), load_file(str(last / "optimizer.safetensors"))
    # the rest of the train state's tensors (torch RNG) join the optimizer's for the bitwise check
    optim.update({"state." + k: v for k, v in load_file(str(last / "state.safetensors")).items()})
    return adapter, optim, state, losses, last.name


def _assert_bitwise(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k)
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    _run(assets, out)
    return _final(out)


def test_two_runs_with_the_same_seed_are_bitwise_equal(assets, reference, tmp_path):
    _run(assets, tmp_path)
    adapter, optim, state, losses, name = _final(tmp_path)
    _assert_bitwise(adapter, reference[0], "adapter")
    _assert_bitwise(optim, reference[1], "optimizer")
    assert losses == reference[3] and name == reference[4]
    assert state["loader"] == reference[2]["loader"] and state["scheduler"] == reference[2]["scheduler"]


def test_sigkill_at_random_points_then_resume_is_bitwise_exact(assets, reference, tmp_path):
    ref_adapter, ref_optim, ref_state, ref_losses, ref_name = reference
    total_steps = ref_losses[-1][0]
    n_backward = total_steps * GRAD_ACCUM
    rng = random.Random(20240611)
    # mid-window kills (never on a window's first backward); the first one after the first checkpoint
    early = rng.choice([b for b in range(2 * GRAD_ACCUM + 2, n_backward // 3) if b % GRAD_ACCUM != 1])
    later = rng.choice([b for b in range(2, n_backward // 3) if b % GRAD_ACCUM != 1])
    out = tmp_path / "run"
    _run(assets, out, "--kill-backward", str(early), expect_kill=True)
    _run(assets, out, "--kill-backward", str(later), resume=True, expect_kill=True)
    # inside a save: the 2nd checkpoint this process writes, after its first tensor file
    _run(assets, out, "--kill-save", f"2:{rng.randint(1, 2)}", resume=True, expect_kill=True)
    tmp_dirs = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert tmp_dirs, "the kill inside a save should have left its temporary directory"
    r = _run(assets, out, resume=True)
    assert "resumed from" in r.stdout
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())
    adapter, optim, state, losses, name = _final(out)
    assert name == ref_name
    _assert_bitwise(adapter, ref_adapter, "adapter")
    _assert_bitwise(optim, ref_optim, "optimizer")
    for part in ("optimizer", "loader", "scheduler", "clipper", "rng"):  # optimizer: counters, groups
        assert state[part] == ref_state[part], part
    assert losses == ref_losses  # every step's loss, as logged across the four processes
    run = json.loads((out / "run.json").read_text())
    assert run["resumes"] and run["args"]["seed"] == 3


# ---- resume with other settings or on another number of ranks (one rule, nothing mixed silently) ----------------


def _finetune(argv):
    return sft.run(argv)


def _small(assets: Path, out: Path, *extra: str) -> list[str]:
    return [*_args(assets, out), "--num-workers", "0", "--lora-dropout", "0", "--epochs", "1", *extra]


def test_resume_with_changed_settings_is_refused_naming_each_unless_overridden(assets, tmp_path):
    from ftlib.sched import WarmupDecay

    out = tmp_path / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _finetune(_small(assets, out, "--max-steps", "2"))
        changed = ["--lr", "1e-3", "--clip", "0.5", "--warmup-ratio", "0.2", "--max-steps", "4", "--qlora"]
        with pytest.raises(SystemExit) as e:
            _finetune(_small(assets, out, *changed, "--resume"))
        msg = str(e.value)
        for line in ("lr: 0.003 -> 0.001", "clip: 1.0 -> 0.5", "warmup_ratio: 0.03 -> 0.2", "max_steps: 2 -> 4",
                     "qlora: False -> True", "--override clip,lr,max_steps,qlora,warmup_ratio"):
            assert line in msg, msg
        assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000002"]  # nothing trained
        with pytest.raises(SystemExit, match="lora_r: 4 -> 8 \\(cannot be overridden"):
            _finetune(_small(assets, out, "--lora-r", "8", "--override", "lora_r", "--resume"))
        with pytest.raises(SystemExit, match="cannot override nonsense: not a setting"):
            _finetune(_small(assets, out, "--override", "nonsense", "--resume"))

        # overridden: the new values are taken entirely (base LR and schedule), and run.json says so
        _, records = _finetune(_small(assets, out, "--lr", "1e-3", "--max-steps", "4", "--override", "lr,max_steps",
                                      "--resume"))
    finally:
        torch.set_num_threads(n)
    assert [r["step"] for r in records] == [3, 4]
    want = WarmupDecay(total=4, warmup_ratio=0.03, decay="cosine", min_lr_ratio=0.1)
    for r in records:
        assert r["lr"] == pytest.approx(1e-3 * want(r["step"]), rel=1e-9), r
    run = json.loads((out / "run.json").read_text())
    assert run["args"]["lr"] == 1e-3 and run["args"]["max_steps"] == 4
    assert [r["overrides"] for r in run["resumes"]] == [{"lr": [0.003, 0.001], "max_steps": [2, 4]}]
    assert run["resumes"][0]["step"] == 2 and run["resumes"][0]["world_size"] == 1


@pytest.mark.distributed
def test_one_process_checkpoint_on_two_ranks_replans_exactly_or_is_refused(assets, tmp_path):
    import shutil

    import torch.distributed as dist
    from _torchrun import torchrun

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    full = tmp_path / "full"  # one process, 2 rows x 2 micro-batches a step, uninterrupted
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _finetune(_small(assets, full, "--grad-accum", "2", "--max-steps", "6", "--keep", "10"))
    finally:
        torch.set_num_threads(n)
    cut = tmp_path / "cut"  # the same run cut after step 2
    shutil.copytree(full, cut)
    assert (cut / "checkpoints" / "step-00000002").is_dir()
    for p in (cut / "checkpoints").glob("step-*"):
        if p.name != "step-00000002":
            shutil.rmtree(p)
    shutil.rmtree(cut / "adapter")
    # the same flags on 2 ranks double the global batch: refused, naming both world sizes (not "resumed", 0 steps)
    with pytest.raises(AssertionError) as e:
        torchrun(*SFT, *_small(assets, cut, "--grad-accum", "2", "--max-steps", "6", "--resume"), timeout=300)
    assert "saved on 1 rank(s)" in str(e.value) and "this run has 2 rank(s)" in str(e.value), str(e.value)[-3000:]
    assert "--grad-accum 1" in str(e.value)
    # the global batch kept (2 rows x 1 micro-batch x 2 ranks): the data position is re-planned exactly
    text = torchrun(*SFT, *_small(assets, cut, "--grad-accum", "1", "--max-steps", "6", "--resume"), timeout=300)
    assert "resumed from" in text and "re-planned the data position from 1 rank(s) to 2" in text
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") != "eval"]
    assert steps[-4:] == [3, 4, 5, 6]
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:  # the same units in every step; only the summation order differs
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4)


@pytest.mark.distributed
def test_fsdp_checkpoint_resumes_on_one_process_with_the_grad_accum_the_refusal_advises(assets, tmp_path):
    """Issue 34, item 10: a checkpoint of --engine fsdp on 2 ranks, resumed on one process, is refused
    with the --grad-accum that keeps the global batch; that advice used to be refused again (the
    checkpoint's layout was a setting that could not change). Now the advised command resumes: the
    sharded checkpoint is loaded whole and the data position re-planned, ending where the 2-rank run
    ends (the same units in every step; only the summation order differs)."""
    import shutil

    import torch.distributed as dist
    from _torchrun import torchrun

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    full = tmp_path / "full"  # 2 ranks x 2 rows x 1 micro-batch a step, uninterrupted
    torchrun(*SFT, *_small(assets, full, "--engine", "fsdp", "--grad-accum", "1", "--max-steps", "6", "--keep", "10"),
             timeout=300)
    cut = tmp_path / "cut"  # the same run cut after step 2
    shutil.copytree(full, cut)
    for p in (cut / "checkpoints").glob("step-*"):
        if p.name != "step-00000002":
            shutil.rmtree(p)
    shutil.rmtree(cut / "adapter")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(SystemExit) as e:  # one process, the same flags: half the global batch
            _finetune(_small(assets, cut, "--grad-accum", "1", "--max-steps", "6", "--resume"))
        assert "saved on 2 rank(s)" in str(e.value) and "(--grad-accum 2)" in str(e.value), str(e.value)
        _, records = _finetune(_small(assets, cut, "--grad-accum", "2", "--max-steps", "6", "--resume"))
    finally:
        torch.set_num_threads(n)
    assert [r["step"] for r in records] == [3, 4, 5, 6]
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4)
