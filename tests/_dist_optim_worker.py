"""torchrun worker for tests/test_optim.py: token-weighted accumulation across DDP ranks (gloo, CPU).

DDP (with no_sync) and FSDP2 (with set_requires_gradient_sync). Rank 0 holds 4 sequences in 2 micro-batches, rank 1 holds 3 in 1: different token counts and
micro-batch counts. Gradients after ``prepare_grads`` must equal one process's full-batch ones.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from test_optim import TinyLM, collate, make_sequences, reference_grads, split
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ftlib.losses import count_target_tokens, cross_entropy_sum
from ftlib.optim import TrainOptimizer


def main(out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seqs = make_sequences(11, 7)
    ref_loss, ref = reference_grads(seqs)
    # DDP: rank 0 runs 2 micro-batches, rank 1 one; FSDP2 all-gathers in every forward, so
    # there both ranks run 2 (of different sizes and token counts)
    uneven = split(seqs[:4], [1, 3]) if rank == 0 else [seqs[4:]]
    even = split(seqs[:4], [1, 3]) if rank == 0 else split(seqs[4:], [2, 1])
    mesh = init_device_mesh("cpu", (2,))

    def fsdp2(model):
        fully_shard(model.proj, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    for wrap, up_front, mine in ((DDP, False, uneven), (DDP, True, uneven), (fsdp2, False, even)):
        model = wrap(TinyLM())
        opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
        if up_front:
            opt.set_window_tokens(sum(int(count_target_tokens(collate(mb)[1])) for mb in mine))
        for i, mb in enumerate(mine):
            input_ids, labels = collate(mb)
            with opt.grad_sync(model, enabled=i == len(mine) - 1):
                opt.backward(*cross_entropy_sum(model(input_ids), labels))
        opt.prepare_grads()
        inner = model.module if isinstance(model, DDP) else model
        for k, p in inner.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, ref[k], rtol=1e-5, atol=1e-7, msg=f"{k} {wrap} up_front={up_front}")
        result = opt.step()
        assert abs(result.loss - ref_loss) <= 1e-6 * abs(ref_loss), (result.loss, ref_loss)
    dist.barrier()
    if rank == 0:
        Path(out_dir, "ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
