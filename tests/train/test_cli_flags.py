"""ftlib.train.cli / ftlib.data.cli: shared flag groups, --config under the flags, thread default, flag errors."""

import json
import os

import pytest

from ftlib.data.cli import FlagError, FlagParser, flag_message
from ftlib.train import (
    add_data_flags,
    add_eval_flags,
    add_loop_flags,
    add_model_flags,
    add_output_flags,
    check_output_flags,
    cpu_threads,
    load_config_file,
    parse_with_config,
)


def parser():
    p = FlagParser(prog="train")
    for add in (add_model_flags, add_data_flags, add_loop_flags, add_eval_flags, add_output_flags):
        add(p)
    return p


def test_config_values_sit_under_the_flags(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"lr": 1e-3, "grad-accum": 8, "kind": "text", "data": ["a.jsonl"]}))
    a = parse_with_config(parser(), ["--config", str(tmp_path / "c.json"), "--lr", "5e-4"])
    assert (a.lr, a.grad_accum, a.kind, a.data) == (5e-4, 8, "text", ["a.jsonl"])
    # a run.json: its args; what describes one invocation (resume, override, config) is not taken
    run = {"command": ["python", "x.py"], "args": {"lr": 2e-4, "resume": True, "override": ["lr"], "config": "c"}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    a = parse_with_config(parser(), ["--config", str(tmp_path / "run.json")])
    assert a.lr == 2e-4 and a.resume is False and a.override == ""


def test_yaml_config_when_pyyaml_is_there(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "c.yaml").write_text("lr: 3.0e-4\nmax_steps: 7\nlenient: true\n")
    a = parse_with_config(parser(), ["--config", str(tmp_path / "c.yaml")])
    assert (a.lr, a.max_steps, a.lenient) == (3e-4, 7, True)


@pytest.mark.parametrize("cfg, needle", [
    ({"learning_rate": 1}, "learning_rate is not a flag of train"),
    ({"kind": "sharegpt"}, "kind='sharegpt' is not one of chat, instruction, text"),
    ([1, 2], "expected a mapping"),
])
def test_config_errors_are_one_line(tmp_path, capsys, cfg, needle):
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        parse_with_config(parser(), ["--config", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count("\n") == 2  # the error and the --help pointer


def test_missing_config_file_names_it(tmp_path):
    with pytest.raises(FlagError, match="--config .*nope.json"):
        load_config_file(tmp_path / "nope.json")


def test_cpu_threads_default():
    usable = len(os.sched_getaffinity(0))
    assert cpu_threads(3) == 3
    assert cpu_threads(None, num_workers=0) == max(1, min(8, usable))
    assert cpu_threads(None, num_workers=64) == 1  # never below one
    with pytest.raises(FlagError, match="--threads must be >= 1"):
        cpu_threads(0)


def test_library_messages_are_rewritten_as_flags():
    assert flag_message("FormatConfig.eos_token='<x>' is not in the vocabulary") == \
        "--eos-token='<x>' is not in the vocabulary"
    assert flag_message("appending EOS needs FormatConfig.eos_token (or set add_eos=False)") == \
        "appending EOS needs --eos-token (or set --no-eos)"
    assert flag_message("FormatConfig.max_length must be >= 1", {"max_length": "--seq-len"}) == "--seq-len must be >= 1"


def test_output_flags_are_normalised_once_and_bad_values_are_one_line_errors(capsys):
    p = parser()
    a = p.parse_args(["--out", "o", "--report-to", " tensorboard ,", "--tensorboard", "--resume",
                      "--override", "lr, warmup-ratio"])
    check_output_flags(p, a)
    assert a.report_to == ["tensorboard"] and a.tensorboard is False
    assert a.override == ["lr", "warmup_ratio"]
    a = p.parse_args(["--out", "o", "--tensorboard"])
    check_output_flags(p, a)
    assert a.report_to == ["tensorboard"] and a.override == []
    for argv, msg in ((["--report-to", "mlflow"], "--report-to mlflow: not one of tensorboard, wandb"),
                      (["--override", "lr"], "--override applies to --resume")):
        with pytest.raises(SystemExit) as e:
            check_output_flags(p, p.parse_args(["--out", "o", *argv]))
        assert e.value.code == 2 and msg in capsys.readouterr().err


# ---- config values go through the flags' own parsing -------------------------------

@pytest.mark.parametrize("cfg, needle", [
    ({"batch_size": 2.5}, "batch_size=2.5: --batch-size expected a whole number, got '2.5'"),
    ({"grad_accum": [2]}, "grad_accum=[2]: --grad-accum takes one value, not a list"),
    ({"batch_size": True}, "batch_size=True: not a value --batch-size takes"),
    ({"lr": "nan"}, "lr='nan': --lr must be a finite number > 0, got nan"),
    ({"warmup_ratio": 5}, "warmup_ratio=5: --warmup-ratio must be a finite number in [0, 1], got 5"),
    ({"lenient": "yes"}, "lenient='yes': --lenient is a switch; give true or false"),
])
def test_config_values_are_checked_by_the_flags_own_parser(tmp_path, capsys, cfg, needle):
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        parse_with_config(parser(), ["--config", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count("\n") == 2, err


def test_config_values_come_back_typed_as_the_flags_give_them(tmp_path):
    cfg = {"batch_size": "4", "lr": 1e-3, "data": "a.jsonl", "report_to": [], "num_workers": 0, "precision": None}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    a = parse_with_config(parser(), ["--config", str(tmp_path / "c.json")])
    assert (a.batch_size, a.lr, a.data, a.report_to, a.num_workers, a.precision) == (4, 1e-3, ["a.jsonl"], "", 0, None)


@pytest.mark.parametrize("argv, needle", [
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0, got -1"),
    (["--warmup-ratio", "5"], "argument --warmup-ratio: must be a finite number in [0, 1], got 5"),
    (["--eval-split", "1"], "argument --eval-split: must be a finite number in [0, 1), got 1"),
    (["--clip", "inf"], "argument --clip: must be a finite number > 0, got inf"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
])
def test_numbers_out_of_range_are_one_line_errors_naming_the_flag(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        parse_with_config(parser(), argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count("\n") == 2, err


# ---- issue 34, items 6 and 9: settings that parse but cannot train ----------------------------------

def test_impossible_early_stop_is_refused_and_save_every_0_still_evaluates():
    from ftlib.train import eval_intervals

    assert eval_intervals(40, save_every=0, eval_every=None, early_stop=1) == (0, 4)  # 10% of the run
    assert eval_intervals(40, save_every=None, eval_every=None) == (4, 4)
    with pytest.raises(FlagError, match=r"--early-stop 1 needs 2 held-out evals .* --eval-every 0 evaluates only "
                                        r"at the end: give --eval-every 39 or less"):
        eval_intervals(40, save_every=0, eval_every=0, early_stop=1)
    with pytest.raises(FlagError, match=r"--eval-every 20 evaluates 2 time\(s\) in 40 steps: give --eval-every 19 or less"):
        eval_intervals(40, save_every=None, eval_every=20, early_stop=2)
    assert eval_intervals(40, save_every=0, eval_every=0, early_stop=1, evaluates=False) == (0, 0)


def test_fp16_on_a_cpu_is_refused_and_the_defaults_are_per_device():
    import torch

    from ftlib.train import pick_precision

    with pytest.raises(FlagError, match="--precision fp16 needs a CUDA GPU"):
        pick_precision("fp16", torch.device("cpu"))
    assert pick_precision(None, torch.device("cpu")) == "fp32"
    assert pick_precision(None, torch.device("cuda")) == "bf16"
    assert pick_precision("fp16", torch.device("cuda")) == "fp16"


@pytest.mark.parametrize("argv", [["--format", "text"], ["--format"]])
def test_the_old_format_flag_is_an_error_naming_kind(capsys, argv):
    """``--format`` was renamed ``--kind``: one line saying so, never read as the record kind."""
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    err = capsys.readouterr().err
    want = "--format was renamed --kind: pass --kind" + (" text" if len(argv) == 2 else "")
    assert e.value.code == 2 and want in err and err.count("\n") == 2
    assert "--format" not in parser().format_help()  # not offered in --help


def test_the_old_format_key_of_a_config_file_is_refused(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps({"format": "text"}))
    with pytest.raises(SystemExit) as e:
        parse_with_config(parser(), ["--config", str(tmp_path / "c.json")])
    assert e.value.code == 2 and "format='text': --format was renamed --kind: write kind instead" in capsys.readouterr().err
