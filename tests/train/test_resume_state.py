"""ftlib.train.resume: one rule for changed settings, and the data position re-planned on another world size."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data import TokenLoader
from ftlib.train import ResumeError, compare_settings, replan_loader_state, resume_train_state, run_settings


def test_unchanged_settings_resume_and_changes_are_named_old_to_new():
    saved = {"lr": 2e-4, "clip": 1.0, "qlora": False, "lora_r": 16}
    assert compare_settings(saved, dict(saved)) == {}
    with pytest.raises(ResumeError) as e:
        compare_settings(saved, {**saved, "lr": 1e-3, "clip": 0.5, "qlora": True})
    msg = str(e.value)
    assert "lr: 0.0002 -> 0.001" in msg and "clip: 1.0 -> 0.5" in msg and "qlora: False -> True" in msg
    assert "--override clip,lr,qlora" in msg and "lora_r" not in msg


def test_overrides_take_the_named_changes_only():
    saved = {"lr": 2e-4, "clip": 1.0, "max_steps": None}
    now = {"lr": 1e-3, "clip": 1.0, "max_steps": 50}
    assert compare_settings(saved, now, overrides=["lr", "max_steps"]) == {"lr": (2e-4, 1e-3), "max_steps": (None, 50)}
    assert compare_settings(saved, saved, overrides=["lr"]) == {}  # an override of an unchanged setting: nothing
    with pytest.raises(ResumeError, match="max_steps: None -> 50"):
        compare_settings(saved, now, overrides=["lr"])


def test_fixed_settings_and_unknown_names_cannot_be_overridden():
    with pytest.raises(ResumeError, match=r"lora_r: 16 -> 8 \(cannot be overridden"):
        compare_settings({"lora_r": 16}, {"lora_r": 8}, overrides=["lora_r"], fixed=["lora_r"])
    with pytest.raises(ResumeError, match="cannot override lrr: not a setting"):
        compare_settings({"lr": 1.0}, {"lr": 1.0}, overrides=["lrr"])
    with pytest.raises(ResumeError, match="neftune_alpha: <unset> -> 5"):  # a setting the old run did not have
        compare_settings({}, {"neftune_alpha": 5})


def test_run_settings_write_paths_inside_the_run_folder_relative(tmp_path):
    (tmp_path / "demo" / "base").mkdir(parents=True)
    got = run_settings({"model": str(tmp_path / "demo" / "base"), "lr": 1e-3, "data": "elsewhere"}, ["model", "lr"],
                       out=tmp_path)
    assert got == {"model": "<out>/demo/base", "lr": 1e-3}


class _Docs:
    def __init__(self, n):
        self.lengths = np.full(n, 5, dtype=np.int64)


def _loaders(n, b, w, seed=3):
    return [TokenLoader(_Docs(n), batch_size=b, pad_id=0, packing=False, rank=r, world_size=w, seed=seed)
            for r in range(w)]


def _step_units(loaders, a, s):
    """The units of optimizer step s (micro-batches [s a, (s + 1) a) of every rank) in epoch 0."""
    return sorted(int(u) for ld in loaders for m in ld.rank_steps(0)[s * a : (s + 1) * a] for u in m)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(8, 300), b=st.integers(1, 4), w=st.integers(1, 4), a=st.integers(1, 4),
       b2=st.integers(1, 4), w2=st.integers(1, 4), data=st.data())
def test_replanned_position_gives_every_later_step_the_same_units(n, b, w, a, b2, w2, data):
    u = b * w * a
    if u % (b2 * w2) or n < u:
        return
    a2 = u // (b2 * w2)
    old, new = _loaders(n, b, w), _loaders(n, b2, w2)
    spe = len(old[0]) // a
    assert spe == len(new[0]) // a2 == n // u
    k = data.draw(st.integers(0, spe))  # optimizer steps done when the checkpoint was written
    saved = old[0].state_dict() | {"step": k * a}
    for ld in new:
        ld.load_state_dict(replan_loader_state(saved, ld))
        assert (ld.epoch, ld.step) == (0, k * a2)
    for s in range(k, spe):
        assert _step_units(old, a, s) == _step_units(new, a2, s)


def test_a_position_that_is_not_whole_steps_on_the_new_ranks_is_refused():
    saved = _loaders(40, 2, 1)[0].state_dict() | {"step": 1}  # 2 units consumed
    ld = _loaders(40, 2, 2)[1]
    with pytest.raises(ResumeError, match=r"2 units of epoch 0 consumed at 2 x 1 ranks.*2 x 2 ranks"):
        replan_loader_state(saved, ld)
    state = replan_loader_state(_loaders(40, 2, 1)[0].state_dict() | {"step": 4}, ld)
    assert (state["step"], state["rank"], state["world_size"]) == (2, 1, 2)


def test_a_used_output_folder_is_not_trained_over(tmp_path):
    import torch

    from ftlib.checkpoint import save_checkpoint

    assert resume_train_state(tmp_path / "ckpt", resume=False, settings={}, model=None).step == 0
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "ckpt", 5, model=model)
    with pytest.raises(ResumeError, match="holds checkpoints of an earlier run .*step-00000005.*pass --resume"):
        resume_train_state(tmp_path / "ckpt", resume=False, settings={}, model=model)
    logs = []
    got = resume_train_state(tmp_path / "empty", resume=True, settings={}, model=model, log=logs.append)
    assert got.step == 0 and got.path is None and "no checkpoint" in logs[0]


def test_a_setting_newer_than_the_saved_run_counts_as_the_value_that_run_had():
    """``added``: a checkpoint saved before a setting existed resumes when the new run keeps the value
    that run had; a different value is still a change, refused unless overridden."""
    saved = {"lr": 2e-4, "seed": 0}
    added = {"mlp_chunks": None, "offload_activations": False}
    now = {**saved, "mlp_chunks": None, "offload_activations": False}
    with pytest.raises(ResumeError, match="mlp_chunks: <unset> -> None"):
        compare_settings(saved, now)  # without ``added`` an older checkpoint reads as changed
    assert compare_settings(saved, now, added=added) == {}
    with pytest.raises(ResumeError, match="mlp_chunks: None -> 4"):
        compare_settings(saved, {**now, "mlp_chunks": 4}, added=added)
    assert compare_settings({**saved, "mlp_chunks": 2}, {**now, "mlp_chunks": 2}, added=added) == {}
