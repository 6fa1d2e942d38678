"""torchrun worker for tests/distributed/test_context_parallel.py: ``_cp_worker.py OUT``.

Every rank runs the tiny LoRA model on its zigzag shard of one packed row and sums the gradients
over the group (as it is, with every block checkpointed, and with offloaded checkpoints and a chunked MLP;
and under FSDP2 over every rank with context groups of 2 ranks, each group on its own sequence); rank 0 writes ``OUT/result.json`` with the largest differences from the one-process
loss and gradients (and of the adapter after one step, saved in PEFT's format), for the code as it is and with two
bugs put in on purpose (a skipped key block, the mirrored chunk's causal diagonal one key too far), which must be far
off.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cp_common import build, mirrored_off_by_one, one_process, packed_batch, skip_first_block  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import ftlib.distributed.context_parallel as cp  # noqa: E402
from ftlib.distributed import shard_model  # noqa: E402
from ftlib.long_context import chunk_mlp, offload_checkpoints  # noqa: E402
from ftlib.lora import save_adapter  # noqa: E402


def _all_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    x = x.detach().clone().reshape(1).double()
    dist.all_reduce(x, group=group)
    return x


def run(model, batch):
    model.zero_grad(set_to_none=True)
    shard = cp.zigzag_shard(batch)
    loss, n = cp.context_parallel_loss(model, shard)
    n_all = _all_sum(n).float()
    (loss / n_all).backward()
    cp.sum_gradients(model.parameters())
    return float(_all_sum(loss / n_all)), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def run_fsdp(size, batches):
    """FSDP2 over every rank, context groups of ``size`` ranks, group g on ``batches[g]``: FSDP2 averages the
    gradients over the world, so the loss is scaled by it (what TrainOptimizer.backward does)."""
    group, g = cp.context_groups(size)
    train = shard_model(cp.ContextParallelLMLoss(build()))
    loss, n = train(cp.zigzag_shard(batches[g], group))
    n_all = _all_sum(n).float()
    (loss * dist.get_world_size() / n_all).backward()
    grads = {k.removeprefix("model."): p.grad.full_tensor() for k, p in train.named_parameters() if p.grad is not None}
    return float(_all_sum(loss / n_all)), grads


def diffs(model, batch, ref, runner=None):
    loss, grads = runner() if runner else run(model, batch)
    ref_loss, ref_grads = ref
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    worst = max(((g - ref_grads[k]).abs().max().item(), k) for k, g in grads.items())
    return {"loss": abs(loss - ref_loss), "grad": worst[0], "worst": worst[1],
            "lora_grad": max((g - ref_grads[k]).abs().max().item() for k, g in grads.items() if "lora_" in k),
            "n_grads": len(grads)}


def adapter_after_step(model, reference, batch, out: Path) -> float:
    """One SGD step (lr 1) from the context-parallel gradients still on ``model`` and one from the one-process
    gradients of ``reference``; both adapters saved in PEFT's format: the largest difference of their tensors."""
    one_process(reference, batch)
    for m in (model, reference):
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p -= p.grad
    if dist.get_rank() != 0:
        return 0.0
    a, b = (load_file(save_adapter(m, out / name) / "adapter_model.safetensors")
            for m, name in ((model, "cp-adapter"), (reference, "one-adapter")))
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 2
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main():
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model, batch = build(), packed_batch()
    ref = one_process(model, batch)
    result = {"exact": diffs(model, batch, ref), "world": dist.get_world_size()}
    result["adapter"] = adapter_after_step(model, build(), batch, out)
    checkpointed = build()
    checkpointed.set_gradient_checkpointing(1)  # the blocks' recomputation in backward attends over the ring too
    result["checkpointed"] = diffs(checkpointed, batch, ref)
    result["offload_chunks"] = diffs(offload_checkpoints(chunk_mlp(build(), 3), copy_cpu=True), batch, ref)
    world = dist.get_world_size()
    # FSDP2 and context parallel on one set of ranks: 2 ranks a sequence, world / 2 sequences (a 2-D layout)
    batches = [packed_batch(1 + g) for g in range(world // 2)]
    result["fsdp2"] = diffs(None, None, one_process(build(), *batches), runner=lambda: run_fsdp(2, batches))

    plan = cp._segment_plan
    cp._segment_plan = lambda layout, w: skip_first_block(plan(layout, w), layout.chunk)  # bug 1
    result["skip_block"] = diffs(build(), batch, ref)
    cp._segment_plan = lambda layout, w: mirrored_off_by_one(plan(layout, w), layout.total)  # bug 2
    result["mirrored_off_by_one"] = diffs(build(), batch, ref)
    cp._segment_plan = plan
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result))
        (out / "ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
