"""End to end, ``ftlib dpo``: the DPO demo (SFT first, then DPO with RPO on on-policy pairs of the training prompts)
raises held-out exact match, its pairs hold no held-out prompt and no pair with equal sides, every step
is logged under TRL's names, and its PEFT-format adapter reloads onto the SFT-merged base exactly."""

import json
import sys

import pytest
import torch

from ftlib.cli import dpo


@pytest.mark.slow
def test_demo_dpo_raises_held_out_exact_match(tmp_path):
    from ftlib.train.demo import heldout_records

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads only contend on a shared runner
    try:
        out = tmp_path / "run"
        model, res = dpo.train(["--demo", "--out", str(out), "--log-every", "50", "--num-proc", "1",
                               "--num-workers", "0"])
    finally:
        torch.set_num_threads(n)
    before, after = res["before"], res["after"]
    # the SFT start is partly right; DPO on its own mistakes makes it clearly better (seed 0: 0.547 -> 0.781)
    assert 0.2 < before["exact_match"] < 0.9, before
    assert after["exact_match"] >= before["exact_match"] + 0.1, (before, after)
    # policy == reference at the start (up to float rounding: the reference pass packs the pairs differently)
    assert abs(before["reward_margin"]) < 1e-4 and before["reward_accuracy"] < 0.1, before
    assert after["reward_accuracy"] > 0.7 and after["reward_margin"] > 0.1, after
    # the on-policy pairs: training prompts only, two different sides, the chosen one scored higher
    pairs = [json.loads(line) for line in (out / "demo" / "pairs" / "train.jsonl").read_text().splitlines()]
    held = {r["messages"][0]["content"] for r in heldout_records()}
    assert len(pairs) > 300 and not any(p["messages"][-1]["content"] in held for p in pairs)
    assert all(" ".join(p["chosen"].split()) != " ".join(p["rejected"].split()) for p in pairs)
    assert all(p["reward_chosen"] > p["reward_rejected"] for p in pairs)
    assert {p["rejected_from"] for p in pairs} == {"greedy", "sample"}
    # every step logged, TRL's names, RPO on
    steps = res["log"]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)) and all(r["skipped"] == 0 for r in steps)
    for key in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected", "rewards/margins",
                "rewards/accuracies", "nll_loss"):
        assert all(key in r for r in steps), key
    logged = json.loads((out / "train_log.json").read_text())
    assert logged["eval_after"]["exact_match"] == after["exact_match"]

    # the adapter, loaded onto the SFT-merged base, reproduces the trained policy
    from ftlib.lora import load_adapter, merge_and_unload
    from ftlib.models import load_pretrained

    base = out / "demo" / "base"
    sft = lambda: merge_and_unload(load_adapter(load_pretrained(base), out / "sft" / "adapter", check_base=False),
                                   dtype=torch.float32)
    reloaded = load_adapter(sft(), out / "adapter", check_base=False).eval()
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 13))
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(reloaded(ids), want, atol=1e-5, rtol=1e-5)
        assert (sft()(ids) - want).abs().max() > 1e-3, "DPO changed nothing"


def test_dpo_resume_after_a_cut_ends_with_the_same_adapter(tmp_path):
    """The main job's checkpoints in the DPO loop: a run cut after its first checkpoint and resumed with
    --resume ends bit for bit where the uninterrupted run ends (CPU, fp32), without a CheckpointWarning
    about the tokenizer files written beside each checkpoint."""
    import shutil
    import warnings

    from safetensors.torch import load_file

    from ftlib.checkpoint import CheckpointWarning

    args = ["--demo", "--demo-prompts", "48", "--demo-sft-steps", "3", "--max-steps", "6", "--save-every", "3",
            "--log-every", "1", "--eval-generate", "0", "--num-proc", "1", "--num-workers", "0"]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = tmp_path / "full"
        _, res = dpo.train(args + ["--out", str(full)])
        assert sorted(p.name for p in (full / "checkpoints").glob("step-*")) == ["step-00000003", "step-00000006"]
        cut = tmp_path / "cut"
        shutil.copytree(full, cut)
        shutil.rmtree(cut / "checkpoints" / "step-00000006")
        shutil.rmtree(cut / "adapter")
        with pytest.raises(SystemExit, match="--resume"):  # a used --out is not overwritten silently
            dpo.train(args + ["--out", str(cut)])
        with warnings.catch_warnings(record=True) as caught:  # issue 34, item 10: not about ftlib's tokenizer files
            warnings.simplefilter("always")
            _, res2 = dpo.train(args + ["--out", str(cut), "--resume"])
        assert not [w for w in caught if issubclass(w.category, CheckpointWarning)], [str(w.message) for w in caught]
    finally:
        torch.set_num_threads(n)
    assert res2["log"] == res["log"][:3] + res2["log"][3:] and [r["step"] for r in res2["log"]] == list(range(1, 7))
    assert [r["loss"] for r in res2["log"]] == [r["loss"] for r in res["log"]]
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_dpo_cli_refuses_in_one_line_and_lenient_skips(tmp_path):
    """The shared CLI (ftlib.train.cli) in ftlib dpo: a tokenizer without a chat template is refused (one line,
    exit 2, how to pass one); a malformed pair names file:line and --lenient; a flag ftlib dpo does not
    implement is refused; --lenient trains on the rest, saves the skip report, and the template used goes
    into the adapter's tokenizer_config.json and run.json."""
    import subprocess

    from ftlib.data import BUILTIN_TEMPLATES
    from ftlib.train.demo import make_demo_assets

    make_demo_assets(tmp_path / "demo")
    base = tmp_path / "demo" / "base"
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in base.glob("chat_template.jinja"):
        f.unlink()
    good = '{"messages": [{"role": "user", "content": "a b"}], "chosen": "b a", "rejected": "a b"}\n'
    data = tmp_path / "pairs.jsonl"
    data.write_text(good * 5 + '{"messages": [{"role": "user", "content": "q"}], "chosen": "x"}\n' + good * 2)
    argv = ["--model", str(base), "--data", str(data), "--out", str(tmp_path / "o"), "--max-steps", "2",
            "--batch-size", "2", "--grad-accum", "1", "--max-length", "32", "--num-proc", "1", "--num-workers", "0", "--threads", "1"]

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "ftlib", "dpo", *argv, *extra], capture_output=True,
                              text=True, timeout=300)

    r = cli()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no chat template" in r.stderr and "--chat-template" in r.stderr
    r = cli("--chat-template", "chatml")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "pairs.jsonl:6" in r.stderr and "--lenient" in r.stderr
    r = cli("--chat-template", "chatml", "--early-stop", "2")
    assert r.returncode == 2 and "--early-stop is not available in ftlib dpo" in r.stderr

    n = torch.get_num_threads()
    try:  # the held-out pairs (the same file) every step, mirrored to TensorBoard
        _, res = dpo.train(argv + ["--chat-template", "chatml", "--lenient", "--eval-data", str(data), "--eval-every",
                                  "1", "--eval-generate", "0", "--report-to", "tensorboard"])
    finally:
        torch.set_num_threads(n)
    assert [r["step"] for r in res["log"]] == [1, 2]
    skipped = json.loads((tmp_path / "o" / "skipped.json").read_text())
    assert sum(skipped["train"]["counts"].values()) == 1
    saved = json.loads((tmp_path / "o" / "adapter" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == BUILTIN_TEMPLATES["chatml"]
    run = json.loads((tmp_path / "o" / "run.json").read_text())
    assert run["chat_template"]["source"] == "built-in 'chatml'" and run["args"]["kind"] == "chat"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "o" / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/loss")] == [1, 2]
    evals = [k for k in tb.Tags()["scalars"] if k.startswith("eval/")]
    assert evals and all([e.step for e in tb.Scalars(k)] == [1, 2] for k in evals), tb.Tags()["scalars"]
