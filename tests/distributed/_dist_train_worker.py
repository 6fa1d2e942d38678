"""torchrun worker for tests/test_distributed.py: train every case on 2 CPU ranks (gloo), checkpoint, resume, export.

Per case (``_dist_common.CASES``; FSDP2 through ``shard_model``): ``STEPS`` optimizer steps with a
sharded checkpoint at ``SAVE_AT`` (background for LoRA/QLoRA, synchronous for full fine-tuning),
then a fresh model resumed from it. Rank 0 writes under ``out/<case>/``: the per-step records,
the final weights, the checkpoints, the exported adapter / merged model; the test compares them
with one process. Variants of the LoRA case (HSDP, DDP with and without compression, CPU offload,
bf16 mixed precision; per-block torch.compile in a run of its own: ``worker OUT compile``) write their
records and final weights too.
Checks that need both ranks (the ranks agree, no-sync windows do not communicate, a window
that is non-finite on one rank only is skipped on both) are asserted here.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _dist_common import ACCUM, SAVE_AT, STEPS, build, full_value, has_lora, parts, saved_weights, train
from safetensors.torch import save_file

from ftlib._dist import all_gather_json
from ftlib.checkpoint import load_checkpoint
from ftlib.distributed import (
    ShardedCheckpointer,
    device_mesh,
    export_adapter,
    export_merged,
    init_distributed,
    save_sharded_checkpoint,
    shard_model,
    wrap_ddp,
)


def gathered(obj):
    return all_gather_json(obj)


def write(out: Path, name: str, obj) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        save_file({k: v.contiguous() for k, v in obj.items()}, str(out / name))
    else:
        (out / name).write_text(json.dumps(obj, indent=1))


def trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


def local_bytes(tensors) -> int:
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors if t.ndim)


def build_per_rank(case: str, rank: int):
    """``build(case)``, but rank 1's adapters drawn from another seed, as with a per-rank RNG seed:
    ``shard_model`` must start every rank from rank 0's weights."""
    module = build(case)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad and rank:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))
    return module


def run_case(case: str, out: Path, rank: int) -> None:
    module = shard_model(build_per_rank(case, rank))
    opt, sched, clip, loader = parts(case, module, rank, 2)
    no_sync_clean = []
    sizes = {"params": local_bytes(module.parameters())}  # this rank's memory, for the memory calculator

    def on_micro(m):  # after a no-sync backward FSDP2 has reduce-scattered nothing: no sharded grad yet
        if m < ACCUM - 1:
            no_sync_clean.append(all(p.grad is None for p in trainable(module)))
        else:
            sizes["grads"] = local_bytes(p.grad for p in trainable(module))

    background = case != "full"
    ckpt = ShardedCheckpointer(out / "ckpt", keep=2, background=background) if background else None

    def on_step(step, record):
        if step != SAVE_AT:
            return
        kw = dict(model=module, optimizer=opt, scheduler=sched, clipper=clip, loader=loader,
                  metrics={"loss": record["loss"]}, extra={"tag": case})
        if ckpt is not None:
            ckpt.save(step, **kw)
        else:
            save_sharded_checkpoint(out / "ckpt", step, **kw)
        if case in ("qlora", "full_tied"):  # the state at SAVE_AT: the test merges the checkpoint in one process
            export_merged(module, out / "merged_k", dtype=torch.float32, max_shard_size="24KB")

    records = train(module, opt, sched, clip, loader, on_micro=on_micro, on_step=on_step)
    if ckpt is not None:
        ckpt.close()
    assert no_sync_clean and all(no_sync_clean), f"{case}: a no-sync micro-batch reduced gradients"
    views = gathered([r["loss"] for r in records])
    assert views[0] == views[1], f"{case}: ranks report different losses {views}"
    final = saved_weights(module)
    zscore = gathered(clip.state_dict())
    assert zscore[0] == zscore[1], f"{case}: clipper state differs between ranks: {zscore}"
    sizes["optimizer"] = local_bytes(v for st in opt.optimizer.state.values() for v in st.values()
                                     if isinstance(v, torch.Tensor))
    result = {"records": records, "clip_state": zscore[0], "bytes": gathered(sizes)}
    if has_lora(module):
        export_adapter(module, out / "adapter")

    if case == "lora":  # a window whose loss is non-finite on rank 1 only: both ranks skip it, nothing changes
        before = [full_value(p) for p in trainable(module)]
        it = iter(loader)
        loss_sum, n_tok = module(next(it))
        opt.backward(loss_sum * (float("nan") if rank == 1 else 1.0), n_tok)
        res = opt.step(clip)
        skipped = gathered([res.skipped, opt.skipped_steps])
        assert skipped == [[True, 1], [True, 1]], skipped
        assert all(torch.equal(a, full_value(p)) for a, p in zip(before, trainable(module)))
        result["nan_skipped"] = skipped

    # resume from the checkpoint in a fresh model: the same continuation, bit for bit
    module2 = shard_model(build(case))
    opt2, sched2, clip2, loader2 = parts(case, module2, rank, 2)
    info = load_checkpoint(out / "ckpt", model=module2, optimizer=opt2, scheduler=sched2, clipper=clip2,
                                   loader=loader2)
    assert info.step == SAVE_AT and info.extra == {"tag": case}, info
    resumed = train(module2, opt2, sched2, clip2, loader2, start=SAVE_AT)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records[SAVE_AT:]], (case, resumed, records)
    final2 = saved_weights(module2)
    assert all(torch.equal(final[k], final2[k]) for k in final), f"{case}: resumed weights differ"
    result["resumed"] = resumed
    if rank == 0:
        write(out, "records.json", result)
        write(out, "final.safetensors", final)


def run_variant(name: str, out: Path, rank: int) -> None:
    """The LoRA case on another engine or setting; the records and final weights go to the test."""
    module = build("lora")
    if name == "hsdp":  # 2 replicas of a 1-rank shard group: the replicate dim all-reduces
        module = shard_model(module, mesh=device_mesh(replicate=2))
    elif name == "offload":
        module = shard_model(module, cpu_offload=True)
    elif name == "bf16":
        module = shard_model(module, mixed_precision="bf16")
    elif name == "compile":
        module = shard_model(module, compile={"backend": "aot_eager"})
    elif name.startswith("ddp"):
        module = wrap_ddp(module, compression={"ddp": None, "ddp_fp16": "fp16", "ddp_powersgd": "powersgd"}[name],
                          powersgd_start_iter=2)
    inner = module.module if name.startswith("ddp") else module
    opt, sched, clip, loader = parts("lora", inner, rank, 2)
    checks = []

    def on_micro(m):
        if name.startswith("ddp"):  # local gradients after no_sync, averaged (the same on both ranks) after sync
            sums = gathered(sum(float(p.grad.double().sum()) for p in trainable(inner)))
            checks.append((m, sums[0] == sums[1]))

    def on_step(step, record):  # HSDP (replicated shards) and DDP (plain tensors) checkpoint too
        if name in ("hsdp", "ddp") and step == SAVE_AT:
            save_sharded_checkpoint(out / "ckpt", step, model=module, optimizer=opt, scheduler=sched, clipper=clip,
                                    loader=loader)

    stop = 1 if name == "compile" else STEPS  # compiling dominates; one step shows it runs and agrees
    records = train(module, opt, sched, clip, loader, stop=stop, on_micro=on_micro, on_step=on_step)
    if name.startswith("ddp"):
        assert checks == [(m, m == ACCUM - 1) for _ in range(stop) for m in range(ACCUM)], checks
    final = saved_weights(inner)
    if name in ("hsdp", "ddp"):
        module2 = build("lora")
        module2 = (shard_model(module2, mesh=device_mesh(replicate=2)) if name == "hsdp" else wrap_ddp(module2))
        inner2 = module2.module if name == "ddp" else module2
        opt2, sched2, clip2, loader2 = parts("lora", inner2, rank, 2)
        load_checkpoint(out / "ckpt", model=module2, optimizer=opt2, scheduler=sched2, clipper=clip2,
                                loader=loader2)
        resumed = train(module2, opt2, sched2, clip2, loader2, start=SAVE_AT)
        assert [r["loss"] for r in resumed] == [r["loss"] for r in records[SAVE_AT:]], (name, resumed, records)
        final2 = saved_weights(inner2)
        assert all(torch.equal(final[k], final2[k]) for k in final), f"{name}: resumed weights differ"
    if rank == 0:
        write(out, "records.json", {"records": records})
        write(out, "final.safetensors", final)


def run_gpu(out: Path, env) -> None:
    """The LoRA case on CUDA: NCCL, bf16 mixed precision, a background save through pinned buffers, exports."""
    module = shard_model(build("lora").to(env.device), mixed_precision="bf16")
    opt, sched, clip, loader = parts("lora", module, env.rank, env.world_size)
    ckpt = ShardedCheckpointer(out / "ckpt")

    def on_step(step, record):
        if step == SAVE_AT:
            ckpt.save(step, model=module, optimizer=opt, scheduler=sched, clipper=clip, loader=loader)

    records = train(module, opt, sched, clip, loader, on_step=on_step, device=env.device)
    ckpt.close()
    module2 = shard_model(build("lora").to(env.device), mixed_precision="bf16")
    opt2, sched2, clip2, loader2 = parts("lora", module2, env.rank, env.world_size)
    load_checkpoint(out / "ckpt", model=module2, optimizer=opt2, scheduler=sched2, clipper=clip2,
                            loader=loader2)
    resumed = train(module2, opt2, sched2, clip2, loader2, start=SAVE_AT, device=env.device)
    for a, b in zip(resumed, records[SAVE_AT:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * b["loss"], (resumed, records)
    export_adapter(module, out / "adapter")
    export_merged(module, out / "merged", dtype=torch.bfloat16)
    if env.rank == 0:
        write(out, "records.json", {"records": records, "resumed": resumed})


def main(out_dir: str, only: str | None = None) -> None:
    env = init_distributed()
    out = Path(out_dir)
    if only == "gpu":
        run_gpu(out / "gpu", env)
        dist.barrier()
        if env.rank == 0:
            (out / "ok").write_text("ok")
        dist.destroy_process_group()
        return
    assert env.world_size == 2
    if only == "compile":
        run_variant("compile", out / "compile", env.rank)
    else:
        for case in ("lora", "qlora", "full", "full_tied"):
            run_case(case, out / case, env.rank)
        for name in ("hsdp", "ddp", "ddp_fp16", "ddp_powersgd", "offload", "bf16"):
            run_variant(name, out / name, env.rank)
    dist.barrier()
    if env.rank == 0:
        (out / "ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
