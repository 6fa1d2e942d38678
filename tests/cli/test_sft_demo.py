"""``ftlib sft --demo`` end to end: the demo fine-tune trains, lowers the loss, writes its checkpoints, metrics, plot, run
manifest and held-out report, and its PEFT-format adapter reloads exactly; reruns are refused or resumed.
"""

import json
from pathlib import Path

import pytest
import torch

from ftlib.cli import sft

STEPS = 20


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    model, records = sft.run(["--demo", "--out", str(out), "--max-steps", str(STEPS), "--num-proc", "1",
                               "--num-workers", "0", "--eval-generate", "8", "--log-every", "10"])
    return out, model, records


def test_demo_finetune_learns_and_adapter_round_trips(demo_run):
    out, model, logs = demo_run
    assert [r["step"] for r in logs] == list(range(1, STEPS + 1)) and not any(r["skipped"] for r in logs)
    first = sum(r["loss"] for r in logs[:5]) / 5
    last = sum(r["loss"] for r in logs[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 64

    # The saved adapter, loaded onto a fresh copy of the base, reproduces the trained model.
    from ftlib.lora import load_adapter
    from ftlib.models import load_pretrained

    base = out / "demo" / "base"
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    reloaded = load_adapter(load_pretrained(base), out / "adapter", check_base=False).eval()
    final_ckpt = load_adapter(load_pretrained(base), out / "checkpoints" / f"step-{STEPS:08d}", check_base=False)
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(reloaded(ids), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final_ckpt.eval()(ids), want, atol=1e-5, rtol=1e-5)
        assert (load_pretrained(base)(ids) - want).abs().max() > 1e-2, "the adapter changed nothing"


def test_demo_writes_checkpoints_metrics_plot_manifest_and_report(demo_run):
    out, _, logs = demo_run
    from ftlib.checkpoint import list_checkpoints
    from ftlib.metrics import read_metrics

    # a checkpoint every 10 % of the steps; the newest 3 kept, plus the best by held-out loss
    every = STEPS // 10
    steps = [s for s, _, _ in list_checkpoints(out / "checkpoints")]
    assert steps[-3:] == [STEPS - 2 * every, STEPS - every, STEPS] and all(s % every == 0 for s in steps)
    assert len(steps) <= 4
    recs = read_metrics(out / "metrics.jsonl")
    train = [r for r in recs if r.get("kind") != "eval"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in evals] == [0, *range(every, STEPS + 1, every)]  # step 0: the base model
    for key in ("loss", "lr", "grad_norm", "grad_norm_clipped", "clip_ratio", "target_tokens", "tokens",
                "tokens_per_s", "padding_fraction", "skipped_steps", "peak_mem_gib", "tflops"):
        assert all(key in r for r in train), key
    assert train == logs
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    run = json.loads((out / "run.json").read_text())
    assert run["args"]["seed"] == 0 and run["args"]["demo"] is True and run["seed"] == 0
    assert set(run["versions"]) >= {"ftlib", "torch", "transformers", "python"} and "git_commit" in run
    assert len(run["data_fingerprint"]) == 64 and run["device"] and run["resumes"] == []
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    # no pickle: every file of every checkpoint and of the adapter is safetensors or JSON
    from safetensors.torch import load_file

    files = [p for d in ("checkpoints", "adapter") for p in (out / d).rglob("*") if p.is_file()]
    assert len(files) >= 2 + 6 * len(steps)
    for f in files:
        assert not f.read_bytes().startswith(b"\x80"), f
        if f.suffix == ".safetensors":
            load_file(str(f))
        else:
            json.loads(f.read_text())  # configs, train state, the COMPLETE marker
    assert after["eval_loss"] < before["eval_loss"] and before["exact_match_total"] == 8
    assert Path(summary["best_checkpoint"]).name.startswith("step-")


def test_rerun_into_a_used_out_is_refused_and_resume_of_a_finished_run_is_a_no_op(demo_run, capsys):
    out, _, _ = demo_run
    args = ["--demo", "--out", str(out), "--max-steps", str(STEPS), "--num-proc", "1", "--num-workers", "0",
            "--eval-generate", "0"]
    with pytest.raises(SystemExit, match="holds checkpoints of an earlier run .*pass --resume"):
        sft.main(args)
    _, records = sft.run([*args, "--resume"])
    assert records == []  # nothing left to train
    assert f"resumed from {out / 'checkpoints' / f'step-{STEPS:08d}'}" in capsys.readouterr().out
    assert len(json.loads((out / "run.json").read_text())["resumes"]) == 1


def test_eval_split_holds_out_training_documents(tmp_path):
    _, records = sft.run(["--demo", "--out", str(tmp_path), "--max-steps", "2", "--num-proc", "1",
                           "--num-workers", "0", "--eval-split", "0.1", "--eval-generate", "0", "--save-every", "0"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(records) == 2 and summary["after"]["eval_tokens"] > 1000  # 200 of the 2000 documents
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000002"]  # the final one only


@pytest.mark.slow
def test_full_demo_answers_held_out_questions(tmp_path):
    assert sft.main(["--demo", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["before"]["exact_match"] <= 0.05 and summary["after"]["exact_match"] >= 0.8, summary
