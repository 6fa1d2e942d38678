"""Exact resume: a run SIGKILLed at seeded random points and resumed ends bitwise equal to one never
stopped; two runs with the same seed are bitwise equal. Each run is examples/finetune_lora.py in a
subprocess (tests/_train_kill_worker.py), on the demo's tiny model with a small dataset, with LoRA
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

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "_train_kill_worker.py"
GRAD_ACCUM = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from _demo_assets import make_demo_assets
    finally:
        sys.path.pop(0)
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
