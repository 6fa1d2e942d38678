"""``ftlib sft --engine fsdp`` under torchrun (``torchrun -m ftlib sft``) (2 CPU ranks, gloo), as a user runs it: the demo
trains, writes sharded checkpoints and a PEFT adapter; a run cut after its first checkpoint and resumed
ends with the same adapter, bit for bit; the DDP engine runs the same loop."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the torchrun launcher
from _torchrun import torchrun  # noqa: E402

pytestmark = pytest.mark.distributed
ARGS = ("--engine", "fsdp", "--demo", "--max-steps", "6", "--save-every", "3", "--log-every", "2", "--num-proc", "1", "--num-workers", "0")


def launch(out: Path, *extra: str, timeout: float = 300.0) -> str:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    return torchrun("-m", "ftlib", "sft", "--out", str(out), *ARGS, *extra, timeout=timeout)


def test_fsdp_demo_trains_checkpoints_and_resumes_bitwise(tmp_path):
    full = tmp_path / "full"
    text = launch(full)
    assert "fsdp on 2 rank(s)" in text and "base loaded sharded" in text
    summary = json.loads((full / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]
    steps = sorted(p.name for p in (full / "checkpoints").glob("step-*"))
    assert steps == ["step-00000003", "step-00000006"]
    assert sorted(p.name for p in (full / "checkpoints" / "step-00000003").glob("rank-*.json")) == \
        ["rank-00000.json", "rank-00001.json"]  # every rank wrote its part
    cfg = json.loads((full / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"

    # cut after step 3: keep only that checkpoint, then --resume
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000006")
    shutil.rmtree(cut / "adapter")
    text = launch(cut, "--resume")
    assert "(step 3)" in text
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert a[k].equal(b[k]), k


def test_ddp_engine_runs_the_same_loop(tmp_path):
    out = tmp_path / "ddp"
    text = launch(out, "--engine", "ddp", "--max-steps", "2", "--save-every", "0")
    assert "ddp on 2 rank(s)" in text
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    with pytest.raises(AssertionError, match="--compression is a DDP option"):
        launch(tmp_path / "bad", "--compression", "fp16")


def test_fsdp_qlora_demo_loads_sharded(tmp_path):
    out = tmp_path / "qlora"
    text = launch(out, "--qlora", "--max-steps", "2", "--save-every", "0")
    assert "base loaded sharded" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["after"]["eval_loss"] < summary["before"]["eval_loss"]
