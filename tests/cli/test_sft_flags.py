"""``ftlib sft`` and the data CLI driven as a user drives them (issue 22, items 1-6): a subprocess
each, on a tiny model of the user's own whose tokenizer_config.json holds its template as text, and a
JSONL with malformed lines (tests/cli/_cli_setup.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli_setup import N_BAD, TEMPLATE, make_user_setup, run_cli, train
from safetensors.torch import load_file

from ftlib.cli import sft


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    return make_user_setup(tmp_path_factory.mktemp("user"))


def one_line_error(r, *needles):
    """A user error: exit 2, no traceback, one 'error:' line naming each needle."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# ---- --lenient, and a cache of the data CLI as --data ------------------------------------

def test_strict_stops_lenient_skips_reports_and_data_cli_cache_is_read(user, tmp_path):
    r = train("--model", user["model"], "--data", user["train"], "--out", tmp_path / "strict")
    one_line_error(r, "train.jsonl:6", "--lenient")

    cache = tmp_path / "cache"
    r = run_cli("-m", "ftlib.data", "build", "--source", user["train"], "--tokenizer", user["model"], "--out", cache,
                "--lenient", "--num-proc", "1", "--no-progress", "--max-length", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{N_BAD} records skipped" in r.stdout and "train.jsonl:21" in r.stdout

    out = tmp_path / "from-cache"
    r = train("--model", user["model"], "--data", cache, "--out", out, "--max-steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "48 documents" in r.stdout
    assert f"chat template: the cache {cache}" in r.stdout
    skipped = json.loads((out / "skipped.json").read_text())["train"]["counts"]  # the cache's report, saved
    assert sum(skipped.values()) == N_BAD

    # a cache built with another tokenizer is refused, naming the way out
    other = tmp_path / "other-tok"
    other.mkdir()
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(user["model"] / "tokenizer.json"))
    t.add_tokens(["<extra>"])
    t.save(str(other / "tokenizer.json"))
    (other / "tokenizer_config.json").write_text((user["model"] / "tokenizer_config.json").read_text())
    cache2 = tmp_path / "cache2"
    r = run_cli("-m", "ftlib.data", "build", "--source", user["train"], "--tokenizer", other, "--out", cache2,
                "--lenient", "--num-proc", "1", "--no-progress", "--max-length", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    r = train("--model", user["model"], "--data", cache2, "--out", tmp_path / "x", "--max-steps", "1")
    one_line_error(r, "another tokenizer", "ftlib data build --tokenizer")


# ---- a config file; lenient run; --max-steps over epochs; a rerun from run.json ------

@pytest.fixture(scope="module")
def config_runs(user, tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    cfg = {"model": str(user["model"]), "data": [str(user["train"])], "lenient": True, "max-steps": 5,
           "epochs": 1, "lr": 3e-3, "weight-decay": 0.01, "seed": 7, "save_every": 4}
    (root / "cfg.json").write_text(json.dumps(cfg))
    a = root / "a"
    ra = train("--config", root / "cfg.json", "--max-steps", "12", "--out", a)  # the flag wins over the file
    b = root / "b"
    rb = train("--config", a / "run.json", "--out", b)
    return a, ra, b, rb


def test_lenient_run_prints_and_saves_every_skip(config_runs):
    a, ra, _, _ = config_runs
    assert ra.returncode == 0, ra.stderr[-3000:]
    assert f"--data: {N_BAD} records skipped" in ra.stdout
    for where in ("train.jsonl:6: malformed_json", "train.jsonl:21: missing_field", "train.jsonl:31: bad_field"):
        assert where in ra.stdout
    saved = json.loads((a / "skipped.json").read_text())["train"]
    assert saved["counts"] == {"malformed_json": 1, "missing_field": 1, "bad_field": 1}


def test_log_lines_read_cleanly(config_runs):
    _, ra, _, _ = config_runs
    assert "trainable params: 1,024 / " in ra.stdout and "trainable params: trainable params" not in ra.stdout
    assert "PackStats(" not in ra.stdout and "packing: 18 rows of 64 tokens, " in ra.stdout
    help_text = sft.build_parser().format_help()
    assert "no progress bar" not in help_text and "a terminal gets a progress bar" in help_text


def test_max_steps_overrides_epochs(config_runs):
    a, ra, _, _ = config_runs
    steps = [r["step"] for r in metrics(a) if "kind" not in r]
    assert steps == list(range(1, 13))  # 9 steps per epoch, --epochs 1: --max-steps 12 still runs 12
    assert "--max-steps 12 overrides --epochs 1" in ra.stdout
    assert max(r["epoch"] for r in metrics(a) if "kind" not in r) == 1


def test_config_file_and_rerun_from_run_json_reproduce_the_run(config_runs):
    a, ra, b, rb = config_runs
    assert rb.returncode == 0, rb.stderr[-3000:]
    run_a, run_b = (json.loads((d / "run.json").read_text()) for d in (a, b))
    assert run_a["args"]["weight_decay"] == 0.01 and run_a["args"]["seed"] == 7 and run_a["args"]["lenient"] is True
    assert run_a["args"]["max_steps"] == 12 and run_a["args"]["lr"] == 1e-2  # flags win over the file
    assert {k: v for k, v in run_b["args"].items() if k != "out"} == {k: v for k, v in run_a["args"].items()
                                                                      if k not in ("out", "config")} | {
        "config": str(a / "run.json")}
    wa, wb = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (a, b))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_config_errors_name_the_key(tmp_path, capsys):
    (tmp_path / "bad.json").write_text(json.dumps({"model": "m", "learning_rate": 1.0}))
    with pytest.raises(SystemExit) as e:
        sft.parse_args(["--config", str(tmp_path / "bad.json"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert "learning_rate is not a flag" in capsys.readouterr().err


# ---- chat templates ------------------------------------------------------------------------

def test_no_template_is_refused_and_the_one_used_is_saved_everywhere(user, tmp_path):
    r = train("--model", user["bare"], "--data", user["train"], "--lenient", "--out", tmp_path / "none")
    one_line_error(r, "has no chat template", "--chat-template")

    jinja = tmp_path / "mine.jinja"
    jinja.write_text(TEMPLATE)
    out = tmp_path / "jinja"
    r = train("--model", user["bare"], "--data", user["train"], "--lenient", "--chat-template", jinja, "--out", out,
              "--max-steps", "3", "--save-every", "2", "--save-merged")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"chat template: {jinja}" in r.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["chat_template"] == {"text": TEMPLATE, "source": str(jinja)}
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-00000002", "step-00000003"]
    for folder in [out / "adapter", out / "merged", *ckpts]:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        assert cfg["chat_template"] == TEMPLATE, folder
        assert cfg["eos_token"] == "<|end|>" and (folder / "tokenizer.json").is_file()
    from ftlib.models import load_tokenizer

    assert load_tokenizer(out / "merged").chat_template == TEMPLATE

    # the same spec forms in the data CLI: a tokenizer_config.json path, a built-in name
    for spec in (user["model"] / "tokenizer_config.json", "chatml"):
        r = run_cli("-m", "ftlib.data", "build", "--source", user["train"], "--tokenizer", user["bare"] / "tokenizer.json",
                    "--out", tmp_path / f"c-{Path(str(spec)).name}", "--lenient", "--num-proc", "1", "--no-progress",
                    "--chat-template", spec)
        assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("-m", "ftlib.data", "build", "--source", user["train"], "--tokenizer", user["bare"], "--out",
                tmp_path / "c3", "--lenient", "--num-proc", "1", "--no-progress")
    one_line_error(r, "has no chat template", "--chat-template")


# ---- one vocabulary, one-line errors ----------------------------------------------------

def test_same_flags_same_defaults_and_flag_errors(user, tmp_path):
    r = run_cli("-m", "ftlib.data", "build", "--source", user["train"], "--tokenizer", user["model"] / "tokenizer.json",
                "--out", tmp_path / "c", "--kind", "text", "--eos-token", "<nope>", "--num-proc", "1")
    line = one_line_error(r, "--eos-token", "not in the tokenizer vocabulary")
    assert "FormatConfig" not in line and "add_eos" not in line
    r = train("--model", user["model"], "--data", user["train"], "--chat-template", tmp_path / "missing.jinja",
              "--out", tmp_path / "o")
    one_line_error(r, "--chat-template", "missing.jinja")
    r = run_cli("-m", "ftlib.data", "build", "--source", user["train"], "--tokenizer", user["model"], "--out",
                tmp_path / "c2", "--chat-template", "chatmll", "--num-proc", "1")
    one_line_error(r, "--chat-template", "did you mean 'chatml'")
    r = train("--model", tmp_path / "no-such-model", "--data", user["train"], "--out", tmp_path / "o2")
    one_line_error(r, "--model", "no-such-model")
    r = run_cli("-m", "ftlib.data", "build", "--source", user["train"], "--tokenizer", tmp_path / "nope", "--out",
                tmp_path / "c3", "--num-proc", "1")
    one_line_error(r, "--tokenizer", "nope")

    # the shared flags have the same names, defaults and help in both commands
    import argparse

    from ftlib.data.__main__ import main as data_main  # noqa: F401 -- the CLI module imports
    from ftlib.data.cli import add_format_flags

    ref = argparse.ArgumentParser()
    add_format_flags(ref)
    shared = {a.dest: (a.option_strings, a.default, a.help) for a in ref._actions if a.dest != "help"}
    trainer = {a.dest: (a.option_strings, a.default, a.help) for a in sft.build_parser()._actions}
    for dest, spec in shared.items():
        assert trainer[dest] == spec, dest
    assert shared["kind"][1] == "chat"


# ---- --eval-generate needs records; the overlap check; early stop, samples, loggers --

def test_eval_generate_with_eval_split_is_refused(user, tmp_path):
    r = train("--model", user["model"], "--data", user["train"], "--lenient", "--eval-split", "0.2",
              "--eval-generate", "4", "--out", tmp_path / "o")
    one_line_error(r, "--eval-generate", "--eval-split holds out token documents", "--eval-data")


def test_overlap_early_stop_samples_step0_eval_and_tensorboard(user, tmp_path):
    out = tmp_path / "run"
    r = train("--model", user["model"], "--data", user["train"], "--lenient", "--eval-data", user["eval"],
              "--eval-every", "1", "--early-stop", "1", "--early-stop-delta", "100", "--sample-every", "1",
              "--sample-prompts", "1", "--eval-generate", "2", "--max-steps", "20", "--report-to", "tensorboard",
              "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    # 2 of the 8 held-out records are training records: the table header says so instead of "not in"
    assert "held-out evaluation (2 questions; 2 of 8 held-out documents are also in the training data" in r.stdout
    assert "not in the training data" not in r.stdout
    assert json.loads((out / "run.json").read_text())["heldout_in_train"] == 2
    # early stop: the first eval sets the best, the second does not beat it by 100
    assert "early stop at step 2" in r.stdout
    recs = metrics(out)
    assert [x["step"] for x in recs if "kind" not in x] == [1, 2]
    assert [x["step"] for x in recs if x.get("kind") == "eval"] == [0, 1, 2]  # step 0: the base model
    samples = [x for x in recs if x.get("kind") == "sample"]
    assert [x["step"] for x in samples] == [1, 2] and set(samples[0]["samples"][0]) == {"prompt", "output", "reference"}
    assert "sample @ step 1:" in r.stdout
    assert list((out / "tb").glob("events.out.tfevents.*"))
    state = json.loads((sorted((out / "checkpoints").glob("step-*"))[-1] / "state.json").read_text())
    assert state["extra"]["early_stop"]["stopped"] is True
    r = train("--model", user["model"], "--data", user["train"], "--lenient", "--eval-data", user["eval"],
              "--eval-every", "1", "--early-stop", "1", "--early-stop-delta", "100", "--sample-every", "1",
              "--sample-prompts", "1", "--eval-generate", "2", "--max-steps", "20", "--report-to", "tensorboard",
              "--out", out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stopped early at step 2" in r.stdout


def test_sharegpt_records_are_read_as_chat(user, tmp_path):
    r = run_cli("-m", "ftlib.data", "build", "--source", user["sharegpt"], "--tokenizer", user["model"], "--out",
                tmp_path / "c", "--num-proc", "1", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cache " in r.stdout and ": 24 documents" in r.stdout and "no records skipped" in r.stdout


def test_wandb_offline_or_a_clean_refusal(user, tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        r = train("--model", user["model"], "--data", user["train"], "--report-to", "wandb", "--out", tmp_path / "o")
        one_line_error(r, "--report-to wandb needs the wandb package")
        pytest.skip("wandb is not installed: the refusal is checked, the offline run is not")
    monkeypatch.setenv("WANDB_MODE", "offline")
    r = train("--model", user["model"], "--data", user["train"], "--lenient", "--report-to", "wandb", "--max-steps",
              "2", "--out", tmp_path / "w")
    assert r.returncode == 0, r.stderr[-3000:]
    assert list((tmp_path / "w" / "wandb").glob("offline-run-*"))



@pytest.mark.slow
def test_compile_trains_as_eager(user, tmp_path):
    """--compile (minutes of compilation on a small CPU): the same losses as the eager run, to float tolerance."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        r = train("--model", user["model"], "--data", user["train"], "--lenient", "--max-steps", "2", "--out",
                  tmp_path / name, *extra, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = [x["loss"] for x in metrics(tmp_path / name) if "kind" not in x]
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=1e-4)


# ---- settings that parse but cannot train, refused before training -----------

def _five(user, tmp_path) -> Path:
    good = [ln for ln in user["train"].read_text().splitlines() if '"assistant"' in ln][:5]
    (tmp_path / "five.jsonl").write_text("\n".join(good) + "\n")
    return tmp_path / "five.jsonl"


@pytest.mark.parametrize("flags, needles", [
    (["--lr", "nan"], ["argument --lr", "finite number > 0"]),
    (["--warmup-ratio", "5"], ["argument --warmup-ratio", "[0, 1]"]),
    (["--eval-split", "0.999"], ["--eval-split 0.999 holds out 5 of the 5", "lower it"]),
    (["--batch-size", "64"], ["--batch-size 64", "2 rows", "lower --batch-size (at most 2 here)"]),
    (["--seq-len", "1"], ["--seq-len 1", "carries loss", "raise --seq-len"]),
    (["--precision", "fp16"], ["--precision fp16 needs a CUDA GPU", "--precision fp32"]),
])
def test_bad_numbers_and_impossible_settings_are_one_line_flag_errors_before_training(user, tmp_path, flags,
                                                                                               needles):
    if flags[0] == "--precision":
        import torch

        if torch.cuda.is_available():
            pytest.skip("fp16 runs on the GPU")
    out = tmp_path / "o"
    r = train("--model", user["model"], "--data", _five(user, tmp_path), *flags, "--out", out)
    one_line_error(r, *needles)
    assert not (out / "adapter").exists() and not (out / "checkpoints").exists()


@pytest.mark.parametrize("cfg, needles", [
    ({"batch_size": 2.5}, ["batch_size=2.5", "--batch-size expected a whole number"]),
    ({"grad_accum": [2]}, ["grad_accum=[2]", "--grad-accum takes one value"]),
])
def test_config_values_are_checked_as_the_flags_are(user, tmp_path, cfg, needles):
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    r = train("--model", user["model"], "--data", _five(user, tmp_path), "--config", tmp_path / "c.json",
              "--out", tmp_path / "o")
    one_line_error(r, "--config", *needles)


def test_early_stop_with_save_every_0_evaluates_and_can_stop(user, tmp_path):
    out = tmp_path / "run"
    r = train("--model", user["model"], "--data", user["train"], "--lenient", "--eval-split", "0.2", "--early-stop",
              "1", "--early-stop-delta", "100", "--save-every", "0", "--max-steps", "20", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "early stop at step 4" in r.stdout  # evals every 2 steps (10% of 20): the second one stops the run
    assert [x["step"] for x in metrics(out) if x.get("kind") == "eval"] == [0, 2, 4]
    r = train("--model", user["model"], "--data", user["train"], "--lenient", "--eval-split", "0.2", "--early-stop",
              "1", "--save-every", "0", "--eval-every", "0", "--max-steps", "20", "--out", tmp_path / "never")
    one_line_error(r, "--early-stop 1 needs 2 held-out evals", "--eval-every 0 evaluates only at the end")


def test_the_command_names_itself_in_its_errors(tmp_path):
    r = run_cli("-m", "ftlib", "sft", "--out", tmp_path / "o")
    line = one_line_error(r, "--model and --data are required")
    assert line.startswith("ftlib sft: error:") and "(see ftlib sft --help)" in r.stderr
