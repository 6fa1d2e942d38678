"""ftlib.train.cli / ftlib.data.cli: shared flag groups, --config under the flags, thread default, flag errors."""

import json
import os

import pytest

from ftlib.data.cli import flag_message
from ftlib.train import (
    FlagError,
    FlagParser,
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
