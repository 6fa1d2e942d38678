"""examples/sft.py end to end on the demo (ftlib.train.demo): the loss falls, the held-out loss after
training beats the one before, the table is printed, and a run cut after a checkpoint and resumed
ends with the adapter of the run never stopped."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft.py"
STEPS = 20


@pytest.fixture(scope="module")
def sft():
    spec = importlib.util.spec_from_file_location("example_sft", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    n = torch.get_num_threads()
    yield module
    torch.set_num_threads(n)  # the demo sets one thread


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def demo_run(sft, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "run"
    after = sft.main(["--demo", "--out", str(out), "--max-steps", str(STEPS)])
    return out, after


def test_demo_learns_and_reports_before_and_after(demo_run, capsys):
    out, after = demo_run
    recs = _records(out)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)) and not any(r["skipped"] for r in recs)
    first, last = (sum(r["loss"] for r in part) / 5 for part in (recs[:5], recs[-5:]))
    assert last < 0.7 * first, (first, last)
    summary = json.loads((out / "summary.json").read_text())
    before = summary["before"]
    assert summary["steps"] == STEPS and summary["after"] == after
    assert after["eval_loss"] < 0.7 * before["eval_loss"], (before["eval_loss"], after["eval_loss"])
    assert before["exact_match_total"] == after["exact_match_total"] == 64  # the demo's held-out questions
    assert [r["step"] for r in recs if "eval_loss" in r] == list(range(2, STEPS + 1, 2))  # every checkpoint
    assert recs[-1]["eval_loss"] == after["eval_loss"]
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 64 and (out / "adapter" / "tokenizer.json").is_file()


def test_demo_prints_the_before_after_table(sft, tmp_path, capsys):
    sft.main(["--demo", "--out", str(tmp_path), "--max-steps", "2"])
    printed = capsys.readouterr().out
    assert "held-out evaluation (64 questions not in the training data):" in printed
    row = next(line for line in printed.splitlines() if line.strip().startswith("held-out loss"))
    before, after = map(float, row.split()[-2:])
    assert after < before
    assert "exact match" in printed and "2 steps, wall time" in printed


def test_resume_continues_to_the_same_adapter(sft, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = ["--demo", "--max-steps", "10"]  # a checkpoint every step, the newest 2 kept
    sft.main([*args, "--out", str(full)])
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000010")
    shutil.rmtree(cut / "adapter")
    with pytest.raises(SystemExit, match="holds checkpoints of an earlier run .*pass --resume"):
        sft.main([*args, "--out", str(cut)])
    sft.main([*args, "--out", str(cut), "--resume"])
    assert [r["step"] for r in _records(cut)] == list(range(1, 11))  # steps 1-9 kept, step 10 run again
    assert _records(cut)[-1]["loss"] == _records(full)[-1]["loss"]
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_under_torchrun_with_the_library_wrap(engine, tmp_path):
    """2 CPU ranks (gloo): the same loop trains through ``ftlib.distributed.wrap``; a run cut after a checkpoint
    resumes; FSDP writes sharded checkpoints (every rank's RNG too) and resumes to the adapter of the run never
    stopped."""
    import sys

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the torchrun launcher
    from _torchrun import torchrun

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    full = tmp_path / "full"
    args = ("--demo", "--engine", engine, "--max-steps", "10", "--batch-size", "2")
    torchrun(EXAMPLE, *args, "--out", str(full), timeout=300)
    summary = json.loads((full / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["engine"] == engine and summary["steps"] == 10
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]
    assert ("exact_match" in summary["after"]) == (engine == "ddp")  # generation needs the whole model on one rank
    ranks = sorted(p.name for p in (full / "checkpoints" / "step-00000010").glob("rank-*.json"))
    assert ranks == (["rank-00000.json", "rank-00001.json"] if engine == "fsdp" else [])
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000010")
    shutil.rmtree(cut / "adapter")
    text = torchrun(EXAMPLE, *args, "--out", str(cut), "--resume", timeout=300)
    assert "(step 9)" in text and [r["step"] for r in _records(cut)] == list(range(1, 11))
    if engine == "ddp":  # rank 0 saved the state: rank 1's dropout stream restarts from a seed, as it says
        assert "the run is not bitwise the same as an uninterrupted one" in text
        return
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
