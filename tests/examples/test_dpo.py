"""examples/dpo.py end to end: --demo (SFT first, then DPO with RPO on the SFT model's own mistakes) raises
held-out exact match and reward accuracy over the starting model, a run cut after a checkpoint and
resumed ends with the same adapter bit for bit, and the file stays a short loop (<= 200 lines, <= 15 flags)."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("dpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_the_example_is_a_short_loop():
    text = EXAMPLE.read_text()
    assert len(text.splitlines()) <= 200
    assert len(re.findall(r"add_argument\(\"--", text)) <= 15


@pytest.mark.slow
def test_demo_raises_held_out_exact_match_and_reward_accuracy(tmp_path):
    res = _example().main(["--demo", "--out", str(tmp_path / "dpo")])
    before, after = res["before"], res["after"]
    print(f"held-out exact match {before['exact_match']:.3f} -> {after['exact_match']:.3f}, reward accuracy "
          f"{before['reward_accuracy']:.3f} -> {after['reward_accuracy']:.3f}")
    assert 0.2 < before["exact_match"] < 0.9, before  # the SFT start is partly right
    assert after["exact_match"] >= before["exact_match"] + 0.1, (before, after)
    assert abs(before["reward_margin"]) < 1e-4 and before["reward_accuracy"] < 0.1, before  # policy == reference
    assert after["reward_accuracy"] > 0.7 and after["reward_margin"] > 0.1, after


def test_resume_after_a_cut_ends_with_the_same_adapter(tmp_path):
    from ftlib.lora import load_adapter, merge_and_unload
    from ftlib.models import load_pretrained, load_tokenizer
    from ftlib.train.demo import dpo_demo_pairs, dpo_demo_setup

    full = tmp_path / "full"
    torch.set_num_threads(1)
    d = dpo_demo_setup(full, sft_steps=3)  # a smaller demo than --demo makes: the example reuses these files
    tok = load_tokenizer(d["model"])
    sft = merge_and_unload(load_adapter(load_pretrained(d["model"]), d["sft_adapter"], check_base=False))
    dpo_demo_pairs(sft, tok, tok.chat_template, full, d["train"], prompts=48, stop_tokens=[tok.eos_token_id])
    (full / "demo" / "pairs" / "eval.jsonl").write_text(  # a few held-out pairs keep the evals short
        "".join((full / "demo" / "pairs" / "eval.jsonl").read_text().splitlines(keepends=True)[:8]))
    args = ["--demo", "--max-steps", "6", "--save-every", "3", "--batch-size", "2"]
    res = _example().main(args + ["--out", str(full)])
    assert sorted(p.name for p in (full / "checkpoints").glob("step-*")) == ["step-00000003", "step-00000006"]
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000006")  # as if killed after step 3's checkpoint
    shutil.rmtree(cut / "adapter")
    res2 = _example().main(args + ["--out", str(cut), "--resume"])
    assert [r["step"] for r in res2["log"]] == list(range(1, 7))
    untimed = lambda log: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in log]
    assert untimed(res2["log"]) == untimed(res["log"]) and res2["before"] == res["before"]
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
