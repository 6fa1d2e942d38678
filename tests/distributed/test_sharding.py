"""FSDP2 / HSDP / DDP on 2 CPU ranks against one process on the same global batches.

The 2-rank run is ``_dist_train_worker.py`` (once per session, see conftest.py). fp32 throughout,
so two ranks must give one process's losses, token counts, gradient norms, clipping statistics
and final weights up to the rounding of a different summation order.
"""

import json

import pytest
import torch
from _dist_common import CASES, STEPS, build, saved_weights
from conftest import reference, run_once
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed


def _records(out, name):
    return json.loads((out / name / "records.json").read_text())


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(b))


def _assert_records_match(got: list, want: list, rel: float, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], (what, i)  # the ranks' tokens add up to the one-process count
        assert g["skipped"] == w["skipped"] is False, (what, i)
        for key in ("loss", "grad_norm"):
            assert _close(g[key], w[key], rel), (what, i, key, g[key], w[key])
        for key, v in w["clip"].items():
            assert _close(g["clip"][key], v, rel), (what, i, key, g["clip"][key], v)


def _assert_weights_match(got: dict, want: dict, tol: float, what: str) -> None:
    assert set(got) == set(want), what
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=tol, rtol=tol, msg=lambda m, k=k: f"{what} {k}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_train_like_one_process(two_ranks, case):
    module, want, clip = reference(case)
    got = _records(two_ranks, case)
    _assert_records_match(got["records"], want, 2e-6, case)
    # the clipping did something in this run, or equal statistics would prove little
    assert any(r["clip"]["clipped"] for r in want), f"{case}: the clipper never clipped"
    if CASES[case]["clip"] == "zscore":  # the EMA: identical on both ranks (checked there) and equal to one process'
        for k, v in clip.state_dict().items():
            assert _close(got["clip_state"][k], v, 1e-5), (k, got["clip_state"][k], v)
    final = load_file(two_ranks / case / "final.safetensors")
    _assert_weights_match(final, saved_weights(module), 1e-6, case)
    initial = saved_weights(build(case))
    assert any(not torch.equal(final[k], initial[k]) for k in final), f"{case}: training changed nothing"


@pytest.mark.parametrize("name", ["hsdp", "ddp", "offload"])
def test_other_engines_train_like_one_process(two_ranks, name):
    module, want, _ = reference("lora")
    _assert_records_match(_records(two_ranks, name)["records"], want, 2e-6, name)
    _assert_weights_match(load_file(two_ranks / name / "final.safetensors"), saved_weights(module), 1e-6, name)


def _flat(d: dict) -> torch.Tensor:
    return torch.cat([d[k].flatten() for k in sorted(d)])


# bound on |w - w_ref| / |w_ref - w_init| after STEPS steps (measured: bf16 0.04, fp16 2.5e-4, PowerSGD 0.19)
@pytest.mark.parametrize("name,bound", [("bf16", 0.1), ("ddp_fp16", 1e-3), ("ddp_powersgd", 0.4)])
def test_approximate_settings_stay_close(two_ranks, name, bound):
    """bf16 compute and compressed gradients approximate the fp32 run: close to it, not equal."""
    module, want, _ = reference("lora")
    got = _records(two_ranks, name)["records"]
    assert len(got) == STEPS
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"] and not g["skipped"]
        assert _close(g["loss"], w["loss"], 1e-3), (name, i, g["loss"], w["loss"])
    final, ref, init = (_flat(d) for d in (load_file(two_ranks / name / "final.safetensors"), saved_weights(module),
                                            saved_weights(build("lora"))))
    ratio = float((final - ref).norm() / (ref - init).norm())
    assert 1e-5 < ratio < bound, (name, ratio)
    if name == "ddp_powersgd":  # exact all-reduce for the first powersgd_start_iter=2 iterations
        assert all(_close(g["grad_norm"], w["grad_norm"], 1e-6) for g, w in zip(got[:2], want[:2]))


@pytest.mark.slow
def test_per_block_torch_compile_trains_like_one_process(tmp_path_factory):
    out = run_once(tmp_path_factory, "ftlib-two-ranks-compile", args=("compile",))
    _, want, _ = reference("lora")
    _assert_records_match(_records(out, "compile")["records"], want[:1], 2e-6, "compile")


# ---- arguments, in this process (a one-rank gloo group) ------------------------------------------


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharding_needs_torch_distributed(monkeypatch):
    from ftlib.distributed import init_distributed, shard_model, wrap_ddp

    monkeypatch.delenv("RANK", raising=False)
    env = init_distributed()  # a plain python launch: one process, nothing initialised
    assert (env.rank, env.world_size) == (0, 1)
    for fn in (shard_model, wrap_ddp):
        with pytest.raises(RuntimeError, match="launch with torchrun and call ftlib.distributed.init_distributed"):
            fn(build("lora"))


def test_shard_model_units_and_refusals(one_rank):
    from torch.distributed.fsdp import FSDPModule

    from ftlib.distributed import device_mesh, shard_model, wrap_ddp

    untied, tied = shard_model(build("full")), shard_model(build("full_tied"))
    for module, embed_unit in ((untied, True), (tied, False)):
        lm = module.model
        assert isinstance(module, FSDPModule) and all(isinstance(b, FSDPModule) for b in lm.model.layers)
        assert isinstance(lm.model.embed_tokens, FSDPModule) is embed_unit  # a tied one stays with the head
        assert not isinstance(lm.lm_head, FSDPModule)  # the chunked loss reads its weight: root unit
    with pytest.raises(RuntimeError, match="already sharded"):
        shard_model(untied)
    other = build("lora")
    with pytest.raises(ValueError, match="is not a submodule of the model"):
        shard_model(build("lora"), blocks=[other.model.model.layers[0]])
    with pytest.raises(ValueError, match="mixed_precision must be None, 'fp32', 'bf16', 'fp16'"):
        shard_model(build("lora"), mixed_precision="bf8")
    with pytest.raises(ValueError, match="replicate 0 x shard 2 != world size 1"):
        device_mesh(shard=2)
    with pytest.raises(ValueError, match="compression='bf16' needs the NCCL backend.*use compression='fp16'"):
        wrap_ddp(build("lora"), compression="bf16")
    with pytest.raises(ValueError, match="compression must be one of"):
        wrap_ddp(build("lora"), compression="int8")


def test_wrap_one_process_and_options_of_the_other_engine_are_errors():
    from ftlib.distributed import wrap

    m = torch.nn.Linear(2, 2)
    assert wrap(m) is m and wrap(m, engine="none") is m
    with pytest.raises(ValueError, match="engine must be one of"):
        wrap(m, engine="deepspeed")
    with pytest.raises(ValueError, match="compression is a DDP option"):
        wrap(m, engine="fsdp", compression="fp16")
    with pytest.raises(ValueError, match="shard_size, cpu_offload are FSDP2 options"):
        wrap(m, engine="ddp", shard_size=2, cpu_offload=True)
    with pytest.raises(ValueError, match="mixed_precision are FSDP2 options"):
        wrap(m, mixed_precision="bf16")
