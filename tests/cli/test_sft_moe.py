"""``ftlib sft`` on a tiny Qwen3-MoE folder (issue 38, the command): the training loss carries
``router_aux_loss_coef x load-balancing loss`` (the config's, or ``--router-aux-coef``), in the gradient, and
metrics.jsonl logs the aux loss and the expert load of every step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _cli_setup import SMALL, make_user_setup

from ftlib.cli import sft

transformers = pytest.importorskip("transformers")

COEF = 0.02  # the folder's router_aux_loss_coef


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user setup of _cli_setup, and a 2-layer Qwen3-MoE (4 experts, top-2) with its tokenizer."""
    root = tmp_path_factory.mktemp("moe")
    setup = make_user_setup(root)
    cfg = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, router_aux_loss_coef=COEF, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # wide random weights, as tests/models/test_moe.py: the routing is far from even
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    folder = root / "qwen3moe"
    hf.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(setup["model"] / f, folder / f)
    return {**setup, "moe": folder}


def run(user, out: Path, *extra: str):
    n = torch.get_num_threads()
    try:
        return sft.run([*SMALL, "--model", str(user["moe"]), "--data", str(user["train"]), "--lenient",
                        "--out", str(out), "--precision", "fp32", "--lora-dropout", "0", "--save-every", "0", *extra])
    finally:
        torch.set_num_threads(n)


def steps(out: Path) -> list[dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r and r.get("kind", "step") == "step"]


def test_moe_trains_with_router_aux_loss_and_expert_load_logged(user, tmp_path, capsys):
    run(user, tmp_path / "cfg", "--max-steps", "3")
    assert f"training loss += {COEF:g} x load-balancing loss" in capsys.readouterr().out
    recs = steps(tmp_path / "cfg")
    assert len(recs) == 3
    for r in recs:
        # E * sum_e f_e P_e is 1 when balanced and at most E = 4 (top-2: at most E / k ... E); here uneven
        assert 1.0 <= r["router_aux_loss"] <= 4.0, r
        assert r["expert_load_max"] >= 1.0 >= r["expert_load_min"] >= 0.0, r
        assert r["experts_idle"] >= 0
    assert recs[-1]["loss"] < recs[0]["loss"]


def test_aux_loss_is_in_the_loss_and_the_gradient(user, tmp_path):
    """One step with --router-aux-coef 0 and with 1: the same batch and initialisation, so the logged loss
    differs by exactly 1 x the aux loss, and the gradient (its norm, the adapter after the step) differs."""
    run(user, tmp_path / "off", "--max-steps", "2", "--router-aux-coef", "0")
    run(user, tmp_path / "on", "--max-steps", "2", "--router-aux-coef", "1")
    off, on = steps(tmp_path / "off"), steps(tmp_path / "on")
    assert abs(on[0]["router_aux_loss"] - off[0]["router_aux_loss"]) < 1e-6  # the same forward
    assert abs(on[0]["loss"] - (off[0]["loss"] + 1.0 * on[0]["router_aux_loss"])) < 1e-5, (on[0], off[0])
    assert abs(on[0]["grad_norm"] - off[0]["grad_norm"]) > 1e-4 * off[0]["grad_norm"], (on[0], off[0])
    manifest = json.dumps(json.loads((tmp_path / "on" / "run.json").read_text()))
    assert '"router_aux_coef": 1.0' in manifest
