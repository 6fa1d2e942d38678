"""ftlib.train.manifest: run.json for a fresh run, and every resume with its overrides."""

import json

import pytest
import torch

from ftlib.train import Resumed, write_run_manifest


def test_fresh_run_then_resumes_with_overrides(tmp_path):
    args = {"lr": 2e-4, "clip": 1.0, "seed": 7}
    run = write_run_manifest(tmp_path, args, device=torch.device("cpu"), world_size=1, data_fingerprint="ab" * 32)
    on_disk = json.loads((tmp_path / "run.json").read_text())
    assert on_disk == run and run["args"] == args and run["seed"] == 7 and run["resumes"] == []
    assert set(run["versions"]) >= {"ftlib", "torch", "transformers", "python"} and "git_commit" in run
    # a fresh start again (no checkpoint): the manifest is written anew
    write_run_manifest(tmp_path, args, device=torch.device("cpu"), world_size=1, data_fingerprint="ab" * 32,
                       resume=Resumed())
    assert json.loads((tmp_path / "run.json").read_text())["resumes"] == []

    r = Resumed(step=40, path=tmp_path / "checkpoints" / "step-00000040", overrides={"lr": (2e-4, 1e-4)},
                saved_world_size=1)
    write_run_manifest(tmp_path, {**args, "lr": 1e-4}, device=torch.device("cpu"), world_size=2,
                       data_fingerprint="ab" * 32, resume=r)
    write_run_manifest(tmp_path, {**args, "lr": 1e-4}, device=torch.device("cpu"), world_size=2,
                       data_fingerprint="ab" * 32, resume=Resumed(step=60, path=r.path.parent / "step-00000060"))
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["args"]["lr"] == 1e-4 and run["started"] and run["world_size"] == 1
    assert [(x["step"], x["world_size"], x["saved_world_size"], x["overrides"]) for x in run["resumes"]] == [
        (40, 2, 1, {"lr": [2e-4, 1e-4]}), (60, 2, None, {})]
    assert not list(tmp_path.glob(".run.json*"))  # no temporary file left


def test_unreadable_manifest_is_named(tmp_path):
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(ValueError, match="run.json: unreadable run manifest"):
        write_run_manifest(tmp_path, {}, device=torch.device("cpu"), world_size=1, data_fingerprint=None,
                           resume=Resumed(step=1, path=tmp_path / "x"))
