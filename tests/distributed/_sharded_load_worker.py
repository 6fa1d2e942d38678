"""torchrun worker for tests/distributed/test_sharded_load.py and benchmarks/bench_load.py --sharded.

``worker.py OUT MODE DIR``:

- ``equal``: tiny checkpoints under DIR (written by the test with their one-process references);
  sharded loads / meta inits on every mesh of this world (1-D, and HSDP 2 x 2 on 4 ranks) must
  equal them: every full tensor and the logits. Also counts the bytes each rank reads.
- ``memory``: DIR holds ``model/`` (a few hundred MB fp32) and ``ref.pt`` (one-process logits);
  loads it sharded (plain fp32, then QLoRA), then resumes a sharded checkpoint, measuring each
  rank's peak RSS above the baseline taken right before each phase (``/proc/self/clear_refs``
  resets ``VmHWM``). Rank r writes ``OUT/mem-r.json``.
"""

import ctypes
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ftlib.checkpoint import load_checkpoint
from ftlib.distributed import (
    device_mesh,
    init_distributed,
    init_sharded,
    load_sharded,
    save_sharded_checkpoint,
    shard_model,
)
from ftlib.lora import LoRAConfig
from ftlib.models import LlamaConfig, SafetensorsReader

IDS = torch.tensor([[3, 17, 5, 40, 2, 9, 33, 11]])
QLORA = dict(r=3, alpha=8, target_modules="all-linear", quantize="nf4", double_quant=True)


def prepare_memory_dir(root: Path, config: dict) -> Path:
    """Write ``root/model`` (random fp32 weights of ``config``), ``ref.pt`` (one-process logits, plain and
    QLoRA with seed 0) and ``info.json`` (model, layer and NF4-model sizes in MB) for ``memory``."""
    from ftlib.lora import apply_lora
    from ftlib.models import LlamaForCausalLM, save_pretrained

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same GEMM blocking, so logits compare bit for bit
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    save_pretrained(model, root / "model", max_shard_size="60MB")
    n = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    with torch.no_grad():
        plain = model(IDS)
        torch.manual_seed(0)
        apply_lora(model, LoRAConfig(**QLORA), verbose=False)
        qlora = model(IDS)
    nf4 = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.save({"ids": IDS, "plain": plain, "qlora": qlora}, root / "ref.pt")
    (root / "info.json").write_text(json.dumps({"model_mb": n * 4 / 2**20, "layer_mb": layer * 4 / 2**20,
                                                "nf4_mb": nf4 / 2**20}))
    torch.set_num_threads(threads)
    return root


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB -> MB
    raise KeyError(key)


def _baseline() -> float:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in
            model.named_parameters()}


def _lora(kind: str):
    if kind == "lora":
        return LoRAConfig(r=3, alpha=8, target_modules="all-linear")
    if kind == "qlora":
        return LoRAConfig(**QLORA)
    if kind == "qlora_single":
        return LoRAConfig(r=3, alpha=8, target_modules=["q_proj", "down_proj"], quantize="nf4", init="gaussian")
    return None


class _Counter:
    """Bytes each rank reads from safetensors files (through ``SafetensorsReader``)."""

    def __init__(self):
        self.n = 0
        orig = SafetensorsReader._read_into
        counter = self

        def counted(reader, name, t, offset):
            counter.n += t.numel() * t.element_size()
            return orig(reader, name, t, offset)

        SafetensorsReader._read_into = counted


def equal(out: Path, root: Path, env) -> None:
    world = env.world_size
    meshes = {"fsdp": None}
    if world == 4:
        meshes["hsdp"] = "hsdp"
    ids = torch.tensor([[3, 17, 5, 40, 2, 9, 33, 11]])
    counter = _Counter()
    for case in json.loads((root / "cases.json").read_text()):
        ref = torch.load(root / f"{case['name']}.pt")
        for mesh_name, m in meshes.items():
            mesh = device_mesh(shard=2) if m == "hsdp" else None
            kw = dict(dtype=case["dtype"], lora_config=_lora(case["lora"]), mesh=mesh, seed=case["seed"])
            before = counter.n
            if case["source"] == "config":
                model, root_mod = init_sharded(LlamaConfig(**case["config"]), **kw)
            else:
                model, root_mod = load_sharded(str(root / case["name"]), **kw)
            got = _full(model)
            assert set(got) == set(ref["params"]), (case["name"], sorted(set(got) ^ set(ref["params"])))
            for n, t in ref["params"].items():
                assert got[n].dtype == t.dtype and torch.equal(got[n], t), (case["name"], mesh_name, n)
            with torch.no_grad():
                logits = root_mod(ids)
            assert torch.equal(logits, ref["logits"]), (case["name"], mesh_name,
                                                        float((logits - ref["logits"]).abs().max()))
            if case["source"] == "checkpoint" and case["lora"] in (None, "lora"):
                # plain rows: each rank reads its chunk of each tensor (torch.chunk rows), not the file
                read, own = counter.n - before, case["bytes"] / (2 if m == "hsdp" else world)
                assert read <= own * 1.5 + 4096, (case["name"], mesh_name, read, case["bytes"])
            del model, root_mod
    (out / "ok").write_text("ok")


def _warm_up(out: Path, ids: torch.Tensor) -> None:
    """Run every code path once on a tiny model: the first meta build, FSDP2 forward and DCP save/load
    each cost ~100+ MB of one-time process state (libraries, thread pools), not loading memory."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2)
    _, r = init_sharded(cfg, lora_config=_lora("qlora"), seed=0)
    with torch.no_grad():
        r(ids % 64)
    r.reshard()
    del r
    _, r = init_sharded(cfg, seed=0)
    ck = save_sharded_checkpoint(out / "warm", 1, model=r, rng=False)
    load_checkpoint(ck, model=r, rng=False)
    del r


def memory(out: Path, root: Path, env) -> None:
    rank, world = env.rank, env.world_size
    info = json.loads((root / "info.json").read_text())
    ref = torch.load(root / "ref.pt")
    ids = ref["ids"]
    _warm_up(out, ids)
    rec: dict = {"rank": rank, "world": world, "model_mb": info["model_mb"], "layer_mb": info["layer_mb"],
                 "nf4_mb": info["nf4_mb"]}
    if "--baseline" in sys.argv:  # 0. what FSDP loading did before: the whole model per rank, then shard
        from ftlib.models import load_pretrained

        base = _baseline()
        root_mod = shard_model(load_pretrained(root / "model", dtype=torch.float32))
        rec["whole_peak_mb"] = _status("VmHWM") - base
        del root_mod
    # 1. plain fp32 load
    base = _baseline()
    model, root_mod = load_sharded(str(root / "model"), dtype=torch.float32)
    rec["plain_peak_mb"] = _status("VmHWM") - base
    with torch.no_grad():
        logits = root_mod(ids)
    rec["plain_maxdiff"] = float((logits - ref["plain"]).abs().max())
    # perturb and save a sharded checkpoint (for the resume phase)
    root_mod.reshard()  # the root unit stays gathered after a forward
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(1.01)
        rec_logits = root_mod(ids)
    root_mod.reshard()
    ck = save_sharded_checkpoint(out / "ckpt", 1, model=root_mod, rng=False)
    del model, root_mod, logits
    # 2. QLoRA load (rank 0 quantizes each layer and scatters NF4 chunks)
    base = _baseline()
    model, root_mod = load_sharded(str(root / "model"), dtype=torch.float32, lora_config=_lora("qlora"), seed=0)
    rec["qlora_peak_mb"] = _status("VmHWM") - base
    with torch.no_grad():
        logits = root_mod(ids)
    rec["qlora_maxdiff"] = float((logits - ref["qlora"]).abs().max())
    del model, root_mod, logits
    # 3. resume: the sharded model is built again and the checkpoint read into its shards
    base = _baseline()
    model, root_mod = load_sharded(str(root / "model"), dtype=torch.float32)
    load_peak, mid = _status("VmHWM") - base, _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    load_checkpoint(ck, model=root_mod, rng=False)
    rec["resume_ckpt_peak_mb"] = _status("VmHWM") - mid  # the checkpoint read alone, above the loaded model
    rec["resume_peak_mb"] = max(load_peak, mid - base + rec["resume_ckpt_peak_mb"])
    with torch.no_grad():
        logits = root_mod(ids)
    rec["resume_maxdiff"] = float((logits - rec_logits).abs().max())
    (out / f"mem-{rank}.json").write_text(json.dumps(rec))
    dist.barrier()
    if rank == 0:
        (out / "ok").write_text("ok")


def main() -> None:
    out, mode, root = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    env = init_distributed()
    try:
        (equal if mode == "equal" else memory)(out, root, env)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
