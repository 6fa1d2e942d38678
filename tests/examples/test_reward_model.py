"""examples/reward_model.py end to end: --demo raises held-out pairwise accuracy over the untrained head,
its merged model loads in transformers with ftlib's scores, a run cut after a checkpoint and resumed
ends with the same adapter bit for bit, and the file stays a short loop (<= 200 lines, <= 15 flags)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reward_model.py"


def _example():
    spec = importlib.util.spec_from_file_location("reward_model_example", EXAMPLE)
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


def test_demo_raises_held_out_accuracy_and_loads_in_transformers(tmp_path):
    out = tmp_path / "rm"
    res = _example().main(["--demo", "--out", str(out)])
    evals = res["evals"]
    assert [e["step"] for e in evals] == [0, 50, 100, 150, 200]
    before, after = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    print(f"held-out pairwise accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.15 and after >= 0.65, (before, after)  # seed 0: 0.529 -> 0.750
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"

    transformers = pytest.importorskip("transformers")
    from ftlib.data import render_chat
    from ftlib.models import load_reward_model, load_tokenizer, score

    tok = load_tokenizer(out / "reward_model")
    recs = [json.loads(line) for line in (out / "demo" / "pairs" / "eval.jsonl").read_text().splitlines()][:4]
    docs = [tok.encode(render_chat(r["messages"] + [{"role": "assistant", "content": r["chosen"]}],
                                   tok.chat_template), add_special_tokens=False) for r in recs]
    want = score(load_reward_model(out / "reward_model"), docs)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out / "reward_model").eval()
    with torch.no_grad():
        got = torch.stack([hf(input_ids=torch.tensor([d])).logits[0, 0] for d in docs])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_resume_after_a_cut_ends_with_the_same_adapter(tmp_path):
    args = ["--demo", "--max-steps", "12", "--save-every", "4", "--batch-size", "4"]
    full = tmp_path / "full"
    res = _example().main(args + ["--out", str(full)])
    assert sorted(p.name for p in (full / "checkpoints").glob("step-*")) == ["step-00000008", "step-00000012"]
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000012")  # as if killed after step 8's checkpoint
    for folder in ("adapter", "reward_model"):
        shutil.rmtree(cut / folder)
    res2 = _example().main(args + ["--out", str(cut), "--resume"])
    assert [r["step"] for r in res2["log"]] == list(range(1, 13))
    untimed = lambda log: [{k: v for k, v in r.items() if k != "pairs_per_s"} for r in log]
    assert untimed(res2["log"]) == untimed(res["log"]) and res2["evals"] == res["evals"]
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
