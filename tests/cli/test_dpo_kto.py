"""End to end, ``ftlib dpo --loss kto``: TRL's unpaired records (plain and conversational, one malformed line
skipped and counted with --lenient) through the pair cache and loader; the loss falls, the desirable
completions' implicit reward rises above the undesirable ones', and the flags are checked."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _cli_setup import TEMPLATE, WORDS, _tokenizer, make_model_folder  # noqa: E402

from ftlib.cli import dpo  # noqa: E402


def _records():
    """The answer that opens with "sun" is desirable, the one that opens with "moon" undesirable."""
    recs = []
    for i in range(24):
        a, b = WORDS[i % len(WORDS)], WORDS[(3 * i + 1) % len(WORDS)]
        good, prompt = i % 2 == 0, f"say {a} {b}"
        completion = f"sun {b}" if good else f"moon {b}"
        if i % 3 == 0:  # TRL's conversational form
            recs.append({"prompt": [{"role": "user", "content": prompt}],
                         "completion": [{"role": "assistant", "content": completion}], "label": good})
        else:
            recs.append({"prompt": prompt, "completion": completion, "label": good})
    return recs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from ftlib.data import render_chat

    root = tmp_path_factory.mktemp("kto")
    recs = _records()
    texts = [render_chat([{"role": "user", "content": f"say {a} {b}"}, {"role": "assistant", "content": f"{b} {a}"}],
                         TEMPLATE) for a in WORDS for b in WORDS]
    model = make_model_folder(root / "model", _tokenizer(texts), template=TEMPLATE)
    lines = [json.dumps(r) for r in recs]
    lines.insert(7, json.dumps({"prompt": "say red", "completion": "red", "label": 1}))  # not a bool
    (root / "kto.jsonl").write_text("\n".join(lines) + "\n")
    return root, model


ARGS = ["--loss", "kto", "--batch-size", "4", "--grad-accum", "1", "--lora-r", "4", "--num-proc", "1",
        "--num-workers", "0", "--log-every", "100", "--lr", "5e-2", "--threads", "1", "--max-length", "32",
        "--beta", "2.0", "--epochs", "8", "--warmup-ratio", "0", "--desirable-weight", "1.0",
        "--undesirable-weight", "1.5"]


def test_kto_run_learns_the_labels(setup):
    root, model = setup
    data = str(root / "kto.jsonl")
    with pytest.raises(SystemExit):  # strict: the malformed line stops the run, naming it
        dpo.train(["--model", str(model), "--data", data, "--out", str(root / "strict"), *ARGS])
    model_out, res = dpo.train(["--model", str(model), "--data", data, "--out", str(root / "run"), "--lenient", *ARGS])
    skipped = json.loads((root / "run" / "skipped.json").read_text())
    assert skipped["train"]["counts"] == {"bad_field": 1}, skipped
    log = res["log"]
    assert len(log) == 8 * 24 // 4 and all("kl" in r and "loss" in r for r in log)
    first, last = sum(r["loss"] for r in log[:4]) / 4, sum(r["loss"] for r in log[-4:]) / 4
    assert last < first - 0.05, (first, last)
    end = log[-4:]
    chosen = [r["rewards/chosen"] for r in end if "rewards/chosen" in r]  # a batch may hold one label only
    rejected = [r["rewards/rejected"] for r in end if "rewards/rejected" in r]
    chosen, rejected = sum(chosen) / len(chosen), sum(rejected) / len(rejected)
    assert chosen > 0 > rejected and chosen - rejected > 0.5, (chosen, rejected)
    # measured apart from the run's own bookkeeping: the trained adapter against the adapters-off reference on
    # every training example, the labels read from the records themselves
    from ftlib.data import open_pair_cache
    from ftlib.rl import kto_logps, pack_kto, reference_kto_logps

    cache = open_pair_cache(str(root / "run" / "cache_train"))
    truth = [r["label"] for r in _records()]
    assert len(cache) == len(truth)
    ex = [cache.example(i) for i in range(len(cache))]
    batch = pack_kto([p.tolist() for p, _, _ in ex], [c.tolist() for _, (c, _), _ in ex], truth, kl=False)
    model_out.eval()
    with torch.no_grad():
        gain = kto_logps(model_out, batch)[0] - reference_kto_logps(model_out, batch)[0]
    good, bad = gain[torch.tensor(truth)], gain[~torch.tensor(truth)]
    assert good.mean() > 0.5 and bad.mean() < -0.5, (good, bad)


def test_kto_flags_are_checked(setup, capsys):
    root, model = setup
    base = ["--model", str(model), "--data", str(root / "kto.jsonl"), "--out", str(root / "f")]
    for extra, msg in ((["--loss", "kto", "--margin-filter"], "--margin-filter is not available with --loss kto"),
                       (["--loss", "kto", "--reference", "precompute"], "--reference precompute is not available"),
                       (["--desirable-weight", "2"], "--desirable-weight applies to --loss kto only"),
                       (["--kto-baseline", "zero"], "--kto-baseline applies to --loss kto only")):
        with pytest.raises(SystemExit) as e:
            dpo.parse_args(base + extra)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_kto_zero_baseline_runs_no_mismatched_documents(setup):
    root, model = setup
    args = [a if a != "8" else "1" for a in ARGS]  # one epoch
    _, res = dpo.train(["--model", str(model), "--data", str(root / "kto.jsonl"), "--out", str(root / "zero"),
                        "--lenient", "--kto-baseline", "zero", *args])
    assert len(res["log"]) == 24 // 4 and all(r["kl"] == 0.0 for r in res["log"])
    run = json.loads((root / "zero" / "run.json").read_text())
    assert "zero" in json.dumps(run)
