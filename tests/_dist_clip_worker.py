"""torchrun worker for tests/test_clip.py: FSDP2 (gloo, CPU) clipping vs a single-process run.

Each rank holds half of the data; FSDP2 averages gradients over ranks, so the reference is the
full-data gradient halved. Every clipper's gathered result must equal the reference's.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ftlib.clip import AGCClipper, GlobalNormClipper, PerLayerClipper, ZScoreClipper


def build():
    torch.manual_seed(0)
    # odd sizes: uneven shards over 2 ranks
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def grads_of(model, x, y, halve):
    model.zero_grad(set_to_none=True)
    (model(x) - y).pow(2).sum().backward()
    if halve:
        for p in model.parameters():
            p.grad.div_(2)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main(out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    makers = {
        "global2": lambda: GlobalNormClipper(0.05),
        "global_inf": lambda: GlobalNormClipper(0.01, norm_type=float("inf")),
        "zscore": lambda: ZScoreClipper(z=0.5, beta=0.5, warmup=2),
        "agc": lambda: AGCClipper(0.005),
        "per_layer": lambda: PerLayerClipper([(r"^0\.", 0.01), (r"^2\.", 0.02)], default=0.03),
    }
    for name, make in makers.items():
        ref, ref_clip = build(), make()
        model, clip = build(), make()
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for it, k in enumerate((0.1, 0.12, 1.0)):  # the z-score clipper acts on the third (two give a variance)
            grads_of(ref, x * k, y, halve=True)
            grads_of(model, x[rank::2] * k, y[rank::2], halve=False)
            s_ref, s = ref_clip(ref), clip(model)
            for key in ("norm_before", "norm_after", "scale"):
                a, b = float(getattr(s_ref, key)), float(full(getattr(s, key)))
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (name, it, key, a, b)
            assert bool(s_ref.clipped) == bool(s.clipped), (name, it)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(full(p.grad), q.grad, rtol=1e-5, atol=1e-7, msg=f"{name} {it} {n}")
        assert bool(s.clipped), f"{name} never clipped: the test would prove nothing"
    dist.barrier()
    if rank == 0:
        Path(out_dir, "ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
