"""``ftlib sft --mlp-chunks K --offload-activations --context-parallel N`` (issue 39's command flags) on the tiny
user setup of tests/cli/_cli_setup.py: the same per-step losses as the plain run (fp32), context parallelism
under torchrun (2 CPU ranks, gloo) equal to one process on packed rows, the flags in run.json and checked on
--resume, and a one-line error for each bad value or combination."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _cli_setup import SFT, SMALL, make_user_setup, train

from ftlib.cli import sft

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the torchrun launcher
from _torchrun import torchrun  # noqa: E402

# fp32, no dropout, 4 steps of one packed row of 64 tokens (every row holds several documents)
EXACT = ["--precision", "fp32", "--lora-dropout", "0", "--max-steps", "4", "--save-every", "0"]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    return make_user_setup(tmp_path_factory.mktemp("user"))


def steps(out: Path) -> list[dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r and r.get("kind", "step") == "step"]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in steps(out)]


def args(user, out: Path, *extra: str) -> list[str]:
    return [*SMALL, "--model", str(user["model"]), "--data", str(user["train"]), "--lenient", "--out", str(out),
            *EXACT, *extra]


def run_in_process(argv: list[str]):
    n = torch.get_num_threads()
    try:
        return sft.run(argv)
    finally:
        torch.set_num_threads(n)


def test_chunked_mlp_and_offloaded_checkpoints_give_the_plain_losses_and_resume_checks_them(user, tmp_path):
    plain = tmp_path / "plain"
    run_in_process(args(user, plain))
    long = tmp_path / "long"
    model, _ = run_in_process(args(user, long, "--mlp-chunks", "2", "--offload-activations"))
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    assert mlps and all(type(m).__name__.startswith("Chunked") for m in mlps)  # the flags reached the model
    assert all(type(b).__name__.startswith("Offloaded") for b in model.model.layers)
    a, b = losses(plain), losses(long)
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    assert a[-1] < a[0]  # it trains
    manifest = json.loads((long / "run.json").read_text())
    flat = json.dumps(manifest)
    assert '"mlp_chunks": 2' in flat and '"offload_activations": true' in flat, flat[:2000]

    # a resume with another --mlp-chunks is refused, naming the change (the checkpoint of step 4 exists)
    with pytest.raises(SystemExit, match=r"mlp_chunks: 2 -> 4"):
        run_in_process(args(user, long, "--mlp-chunks", "4", "--offload-activations", "--resume"))
    with pytest.raises(SystemExit, match=r"offload_activations: True -> False"):
        run_in_process(args(user, long, "--mlp-chunks", "2", "--resume"))
    # named in --override: taken, and the run continues from step 4 with the new K
    run_in_process(args(user, long, "--mlp-chunks", "4", "--offload-activations", "--max-steps", "6",
                        "--override", "mlp_chunks,max_steps", "--resume"))
    assert [r["step"] for r in steps(long)] == [1, 2, 3, 4, 5, 6]


def test_seq_len_past_the_native_context_warns_once(user, tmp_path):
    # the tiny model's max_position_embeddings is 256 and its config has no rope_scaling
    r = train("--model", user["model"], "--data", user["train"], "--lenient", "--out", tmp_path / "w",
              "--seq-len", "320", "--max-steps", "1", "--save-every", "0", "--batch-size", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [ln for ln in r.stdout.splitlines() if "max_position_embeddings 256" in ln]
    assert len(warned) == 1 and "--seq-len 320" in warned[0], r.stdout[-3000:]


@pytest.mark.parametrize("extra, needles", [
    (["--mlp-chunks", "0"], ["--mlp-chunks", "must be >= 1"]),
    (["--context-parallel", "two"], ["--context-parallel", "whole number"]),
    (["--router-aux-coef", "-1"], ["--router-aux-coef"]),
    (["--offload-activations", "--grad-ckpt"], ["--offload-activations", "--grad-ckpt"]),
    (["--context-parallel", "2", "--batch-size", "2"], ["--context-parallel 2", "--batch-size 1"]),
    (["--context-parallel", "3", "--batch-size", "1"], ["--context-parallel 3", "--seq-len 64", "divisible by 6"]),
    (["--context-parallel", "2", "--batch-size", "1"], ["--context-parallel 2", "world size divisible by 2"]),
    (["--router-aux-coef", "0.01"], ["--router-aux-coef", "not a mixture-of-experts model"]),
])
def test_bad_values_and_combinations_get_one_line_errors(user, tmp_path, extra, needles):
    from _cli_setup import run_cli

    r = run_cli(*SFT, *args(user, tmp_path / "bad", *extra))
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.distributed
def test_context_parallel_on_two_ranks_equals_one_process(user, tmp_path):
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    one = tmp_path / "one"
    run_in_process(args(user, one, "--batch-size", "1"))
    two = tmp_path / "cp"
    text = torchrun("-m", "ftlib", "sft", *args(user, two, "--batch-size", "1", "--context-parallel", "2"),
                    timeout=300.0)
    assert "ddp on 2 rank(s)" in text
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    # the same rows, each scored once over the group: a rank that scored the whole row would double these
    assert [(r["target_tokens"], r["tokens"]) for r in steps(one)] == [(r["target_tokens"], r["tokens"])
                                                                       for r in steps(two)]
    assert "context parallel: 2 ranks a row" in text, text[-3000:]
    manifest = json.loads((two / "run.json").read_text())
    assert '"context_parallel": 2' in json.dumps(manifest)

    # composed with the chunked MLP and the offloaded checkpoints under FSDP2 (their recomputation attends over
    # the ring again)
    both = tmp_path / "cp-long"
    torchrun("-m", "ftlib", "sft", *args(user, both, "--batch-size", "1", "--context-parallel", "2", "--engine", "fsdp", "--mlp-chunks", "2",
                                        "--offload-activations"), timeout=300.0)
    c = losses(both)
    assert len(c) == 4 and max(abs(x - y) for x, y in zip(a, c)) <= 1e-5, (a, c)
    with pytest.raises(AssertionError, match="DDP's gradient hooks refuse"):  # recompute in backward: not under DDP
        torchrun("-m", "ftlib", "sft", *args(user, tmp_path / "ddp", "--batch-size", "1", "--mlp-chunks", "2"),
                 timeout=300.0)
