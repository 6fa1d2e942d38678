"""``ftlib grpo``: a tiny demo run through the command (files, TRL's metric names, the adapter trained),
a run resumed with more steps ends where the uninterrupted run ends, and bad flag values are refused
in one line naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ftlib.cli import grpo
from ftlib.cli import main as ftlib_main

# the format reward varies over the barely-trained demo model's answers, so groups carry signal
TINY = ["--demo", "--sft-steps", "6", "--prompts", "2", "--group", "4", "--max-new-tokens", "8", "--mu", "2",
        "--beta", "0.04", "--save-every", "2", "--reward", "format:.*[aeo].*"]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_through_the_command_trains_and_resumes_exactly(tmp_path):
    full = tmp_path / "full"
    assert ftlib_main(["grpo", *TINY, "--steps", "4", "--out", str(full)]) == 0
    recs = _metrics(full)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "step_seconds"):
        assert all(key in r for r in recs), key
    assert any(r["frac_reward_zero_std"] < 1 for r in recs), "no group carried signal: nothing trained"
    summary = json.loads((full / "summary.json").read_text())
    assert 0 <= summary["heldout_reward_before"] <= 1 and 0 <= summary["heldout_reward_after"] <= 1
    adapter = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items()), "adapter untrained"
    assert json.loads((full / "adapter" / "adapter_config.json").read_text())["r"] == 8

    # 2 steps, then --resume to 4 (the step count overridden): the same rollouts and the same adapter
    cut = tmp_path / "cut"
    assert grpo.main([*TINY, "--steps", "2", "--out", str(cut)]) == 0
    with pytest.raises(SystemExit, match="steps: 2 -> 4"):  # a changed setting is refused, named
        grpo.main([*TINY, "--steps", "4", "--out", str(cut), "--resume"])
    assert grpo.main([*TINY, "--steps", "4", "--out", str(cut), "--resume", "--override", "steps"]) == 0
    assert [r["reward"] for r in _metrics(cut)] == [r["reward"] for r in recs]
    resumed = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert adapter.keys() == resumed.keys() and all(torch.equal(adapter[k], resumed[k]) for k in adapter)


@pytest.mark.parametrize("flags, flag", [
    (["--group", "1"], "--group"),
    (["--epsilon-low", "1.5"], "--epsilon-low"),
    (["--beta", "-0.1"], "--beta"),
    (["--top-p", "0"], "--top-p"),
    (["--max-new-tokens", "2.5"], "--max-new-tokens"),
    (["--loss-type", "ppo"], "--loss-type"),
    (["--reward", "bogus"], "--reward"),
    (["--reward", "format:"], "--reward"),
    (["--reward-weights", "1,2"], "--reward-weights"),
    (["--reward-weights", "x"], "--reward-weights"),
    (["--override", "lr"], "--override"),
])
def test_bad_flag_values_are_one_line_naming_the_flag(tmp_path, capsys, flags, flag):
    with pytest.raises(SystemExit) as e:
        grpo.main(["--demo", "--sft-steps", "0", "--steps", "1", "--out", str(tmp_path / "o"), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("ftlib grpo: error:") and flag in first and "Traceback" not in err, err


def test_data_without_the_answer_field_is_refused_naming_it(tmp_path, capsys):
    from ftlib.train.demo import make_demo_assets

    base = make_demo_assets(tmp_path / "demo") / "base"
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Reverse the words: a b"}\n')
    with pytest.raises(SystemExit) as e:
        grpo.main(["--model", str(base), "--data", str(data), "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "'answer'" in capsys.readouterr().err
    data.write_text('{"prompt": "Reverse the words: a b", "answer": "b a"}\n{"prompt": 3, "answer": "x"}\n')
    with pytest.raises(SystemExit) as e:
        grpo.main(["--model", str(base), "--data", str(data), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "prompts.jsonl:2" in err and "'prompt'" in err and "--lenient" in err, err
