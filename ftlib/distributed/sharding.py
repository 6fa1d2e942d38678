"""Spreading a model over GPUs: FSDP2 per decoder block plus the root, HSDP, or DDP with compression.

Built on PyTorch's own engine: ``torch.distributed.fsdp.fully_shard`` (FSDP2, per-parameter
DTensor sharding; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel"), ``DistributedDataParallel`` and its communication hooks, ``init_device_mesh``.

FSDP2 (``shard_model``). With S ranks in a shard group, rank r keeps row-chunk r of every
parameter (dim 0, ``torch.chunk`` sizes), so persistent memory per rank is

    params / S  +  grads / S  +  optimizer state / S

Each decoder block (and, when untied, the input embedding) is one unit: its shards are
all-gathered just before the unit's forward (and again in backward when
``reshard_after_forward``), its gradients reduce-scattered right after its backward,

    g_r = chunk_r( (1/W) sum_w g^(w) )            (W = ranks holding a replica of the data)

so at most about two units are whole at a time (the one computing and the one prefetched). The
root (the module whose ``forward`` the loop calls) holds what is left: final norm, LM head (the
chunked loss reads ``lm_head.weight`` directly, so it must stay in the root unit) and a tied
embedding. Trainable parameters of one unit must share one dtype (adapters fp32 beside a bf16
or NF4 frozen base is fine: only trainable dtypes must agree).

Mixed precision: ``mixed_precision="bf16"`` all-gathers parameters in bf16 for compute while the
sharded masters and the optimizer stay fp32, and reduces gradients in ``reduce_dtype`` (fp32 by
default, bf16 to halve reduce traffic). NF4 storage (uint8 codes, int32 bit patterns of the fp32
scales) is not floating point, so no policy can round it.

HSDP: a 2-D mesh (replicate R, shard S) with R * S = world shards each parameter within a group
of S ranks (a node) and replicates across the R groups; gradients are reduce-scattered inside a
group, then all-reduced across groups. ``device_mesh(shard=8)`` builds it.

DDP (``wrap_ddp``): every rank holds the whole model; gradients are averaged by bucketed
all-reduce overlapped with backward. ``compression="fp16" | "bf16"`` casts each bucket before
the all-reduce and back after (torch's ``fp16_compress_hook`` / ``bf16_compress_hook``; bf16 needs
NCCL); ``"powersgd"`` replaces each gradient matrix M [n, m] by a rank-k approximation P Q^T with
error feedback (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression"), after
``powersgd_start_iter`` exact iterations. Compressed gradients are approximations: the run no
longer matches one process bit for bit.

``wrap(model, engine=...)`` is the one call a training script makes: ``"none"`` (one process, the
model itself), ``"ddp"`` (``wrap_ddp``) or ``"fsdp"`` (``shard_model``, HSDP with ``shard_size``).

What stays correct when sharded (the rest of ftlib is written for it): clippers reduce norms over
every shard and every mesh dim (``ftlib.clip``); ``TrainOptimizer`` all-reduces the window's
target-token count, so the loss is the mean over every token of every rank; ``grad_sync`` turns
FSDP2's ``set_requires_gradient_sync`` / DDP's ``no_sync`` off for all but the last micro-batch;
the non-finite check uses the global norm, so every rank skips the same windows and the z-score
EMA (fed the global norm) is the same on every rank.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .._dist import get_local_rank, get_rank, get_world_size, is_distributed

__all__ = [
    "DistEnv",
    "ENGINES",
    "decoder_blocks",
    "device_mesh",
    "init_distributed",
    "is_rank0",
    "mixed_precision_policy",
    "shard_model",
    "wrap",
    "wrap_ddp",
]

_COMPRESSIONS = (None, "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class DistEnv:
    """Where this process runs: global rank, world size, rank on its node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> DistEnv:
    """Initialise ``torch.distributed`` from the torchrun environment; one process without it.

    Backend: ``"cpu:gloo,cuda:nccl"`` on CUDA (NCCL for GPU tensors, gloo for CPU ones, which
    CPU offload and asynchronous checkpoints need), ``"gloo"`` on CPU. Sets the CUDA device
    from ``LOCAL_RANK``. Without ``RANK`` in the environment (a plain ``python`` launch) nothing
    is initialised and the result says rank 0 of 1.
    """
    cuda = torch.cuda.is_available()
    local = get_local_rank()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistEnv(0, 1, 0, torch.device("cuda") if cuda else device)
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend or ("cpu:gloo,cuda:nccl" if cuda else "gloo"), **kw)
    return DistEnv(get_rank(), get_world_size(), local, device)


def is_rank0() -> bool:
    """True on global rank 0 (and in a process without torch.distributed)."""
    return get_rank() == 0


def _need_dist(what: str) -> int:
    if not is_distributed():
        raise RuntimeError(f"{what} needs torch.distributed: launch with torchrun and call "
                           "ftlib.distributed.init_distributed() first")
    return get_world_size()


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_mesh(*, shard: int | None = None, replicate: int | None = None, device_type: str | None = None):
    """The device mesh for ``shard_model``: 1-D over all ranks, or 2-D (replicate, shard) for HSDP.

    ``shard``: ranks per shard group (e.g. the GPUs of one node); ``replicate``: number of
    groups. Give either (the other follows from the world size) or neither (plain FSDP).
    """
    world = _need_dist("device_mesh")
    from torch.distributed.device_mesh import init_device_mesh

    device_type = device_type or _device_type()
    if shard is None and replicate is None:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    for name, v in (("shard", shard), ("replicate", replicate)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"device_mesh: {name} must be an int >= 1, got {v!r}")
    if shard is None:
        shard = world // replicate
    if replicate is None:
        replicate = world // shard
    if shard * replicate != world:
        raise ValueError(f"device_mesh: replicate {replicate} x shard {shard} != world size {world}")
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: the children of its first ``nn.ModuleList`` named
    ``layers``, ``h`` or ``blocks`` (Llama/Qwen2/Mistral: ``model.layers``)."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rpartition(".")[2] in ("layers", "h", "blocks") and len(mod):
            return list(mod)
    raise ValueError(f"{type(model).__name__} has no ModuleList named layers/h/blocks: pass blocks=[...] to "
                     "shard_model")


def mixed_precision_policy(mixed_precision=None, reduce_dtype: torch.dtype | None = None):
    """A ``MixedPrecisionPolicy`` from a name: None/"fp32" (no casting), "bf16" or "fp16"
    (parameters all-gathered in that dtype for compute, gradients reduced in ``reduce_dtype``,
    fp32 unless given); a ``MixedPrecisionPolicy`` is returned as is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(mixed_precision, MixedPrecisionPolicy):
        if reduce_dtype is not None:
            raise ValueError("pass reduce_dtype inside the MixedPrecisionPolicy, not beside it")
        return mixed_precision
    dtypes = {None: None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if mixed_precision not in dtypes:
        raise ValueError(f"mixed_precision must be None, 'fp32', 'bf16', 'fp16' or a MixedPrecisionPolicy, "
                         f"got {mixed_precision!r}")
    param_dtype = dtypes[mixed_precision]
    if reduce_dtype is None and param_dtype is not None:
        reduce_dtype = torch.float32
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _is_tied_embedding(model: nn.Module, emb: nn.Module) -> bool:
    ids = {id(p) for p in emb.parameters()}
    return any(id(p) in ids for m in model.modules() if m is not emb for p in m.parameters(recurse=False))


def _default_units(model: nn.Module) -> list[nn.Module]:
    units = decoder_blocks(model)
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if len(embeds) == 1 and not _is_tied_embedding(model, embeds[0]):
        units.insert(0, embeds[0])  # ~1 GB at 8B: gathered only around its own forward/backward
    return units


def _sync_from_rank0(model: nn.Module) -> None:
    """Broadcast rank 0's parameters and buffers to every rank (what DDP does when it wraps a model)."""
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        dist.broadcast(t.data, src=0)


def shard_model(model: nn.Module, *, mesh=None, mixed_precision=None, reduce_dtype: torch.dtype | None = None,
                reshard_after_forward: bool = True, cpu_offload: bool = False, blocks=None,
                compile: bool | dict = False, sync_module_states: bool = True) -> nn.Module:
    """Shard ``model`` in place with FSDP2: one unit per decoder block (and untied embedding), plus the root.

    ``model`` is the module whose ``forward`` the loop calls (a loss wrapper around the causal LM
    when the loss reads ``lm_head.weight`` directly, as ``chunked_cross_entropy`` does). Works for
    full fine-tuning, LoRA (frozen base sharded, adapters trained) and QLoRA (NF4 storage
    sharded); apply adapters and activation checkpointing before, build the optimizer after
    (on the sharded parameters).

    ``mesh``: a 1-D mesh (FSDP) or 2-D (replicate, shard) mesh (HSDP, see ``device_mesh``);
    default all ranks. ``mixed_precision`` / ``reduce_dtype``: see ``mixed_precision_policy``.
    ``reshard_after_forward``: free each block's gathered weights after its forward (gathered
    again in backward; False trades memory for one all-gather less per block). ``cpu_offload``:
    sharded parameters, gradients and so the optimizer state live in (pinned) CPU memory and the
    optimizer steps on the CPU. ``blocks``: the units to shard (default ``decoder_blocks``).
    ``compile``: ``torch.compile`` each block after sharding (True, or a dict of compile options),
    the per-block recipe FSDP2 supports. ``sync_module_states``: broadcast rank 0's weights first,
    as DDP does: each rank keeps its own rows of its own tensors, so a randomly initialised tensor
    (LoRA's A, drawn from each rank's RNG) would otherwise be a patchwork of different draws
    (False skips the one broadcast of the model when every rank's copy is known to be the same).
    """
    _need_dist("shard_model")
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError("shard_model: the model is already sharded")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("shard_model: the model is wrapped in DDP; shard the plain module instead")
    units = list(blocks) if blocks is not None else _default_units(model)
    inside = {id(m) for m in model.modules()}
    for u in units:
        if id(u) not in inside or u is model:
            raise ValueError(f"shard_model: block {type(u).__name__} is not a submodule of the model")
    if sync_module_states:
        _sync_from_rank0(model)
    kw = dict(mesh=mesh, mp_policy=mixed_precision_policy(mixed_precision, reduce_dtype),
              offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy())
    for u in units:
        fully_shard(u, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, **kw)  # the root: whatever the units left (norm, head, a tied embedding)
    if compile:
        opts = {} if compile is True else dict(compile)
        for u in units:
            u.compile(**opts)
    return model


def wrap_ddp(model: nn.Module, *, compression: str | None = None, powersgd_rank: int = 1,
             powersgd_start_iter: int = 10, **ddp_kwargs) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(model)`` on this rank's device, with an optional compression hook.

    ``compression``: None (exact fp32 all-reduce), ``"fp16"``, ``"bf16"`` (NCCL only) or
    ``"powersgd"`` (rank ``powersgd_rank``, exact for the first ``powersgd_start_iter``
    iterations, error feedback and warm start on). Other keyword arguments go to DDP.
    """
    _need_dist("wrap_ddp")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if compression not in _COMPRESSIONS:
        raise ValueError(f"compression must be one of {_COMPRESSIONS}, got {compression!r}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda" and "device_ids" not in ddp_kwargs:
        ddp_kwargs["device_ids"] = [device.index if device.index is not None else torch.cuda.current_device()]
    if compression == "bf16" and "nccl" not in dist.get_backend():
        raise ValueError(f"compression='bf16' needs the NCCL backend (torch's bf16_compress_hook); this process "
                         f"group is {dist.get_backend()!r}: use compression='fp16' there")
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    if compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif compression == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif compression == "powersgd":
        if powersgd_rank < 1 or powersgd_start_iter < 2:
            raise ValueError(f"powersgd needs powersgd_rank >= 1 and powersgd_start_iter >= 2 (error feedback "
                             f"starts from exact iterations), got {powersgd_rank}, {powersgd_start_iter}")
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=powersgd_start_iter, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


ENGINES = ("none", "ddp", "fsdp")


def wrap(model: nn.Module, *, engine: str = "none", compression: str | None = None, shard_size: int | None = None,
         mixed_precision: str | None = None, reshard_after_forward: bool = True, cpu_offload: bool = False,
         sync_module_states: bool = True) -> nn.Module:
    """``model`` ready for ``engine``: ``"none"`` returns it, ``"ddp"`` wraps it (``wrap_ddp``), ``"fsdp"``
    shards it in place (``shard_model``; ``shard_size``: HSDP, shard within groups of that many ranks).

    ``model`` is the module the loop calls (a loss wrapper such as ``ftlib.losses.CausalLMLoss``);
    apply adapters and activation checkpointing before, build the optimizer after. An option of the
    other engine is an error naming it, never ignored: ``compression`` is DDP's; ``shard_size``,
    ``mixed_precision``, ``cpu_offload``, ``reshard_after_forward=False`` and
    ``sync_module_states=False`` are FSDP's. ``"ddp"`` / ``"fsdp"`` need torch.distributed
    initialised (``init_distributed`` under torchrun)."""
    if engine not in ENGINES:
        raise ValueError(f"wrap: engine must be one of {ENGINES}, got {engine!r}")
    fsdp_opts = {"shard_size": shard_size is not None, "mixed_precision": mixed_precision is not None,
                 "cpu_offload": cpu_offload, "reshard_after_forward": not reshard_after_forward,
                 "sync_module_states": not sync_module_states}
    if engine != "ddp" and compression is not None:
        raise ValueError(f"wrap: compression is a DDP option (engine='ddp'), not one of engine={engine!r}")
    if engine != "fsdp" and any(fsdp_opts.values()):
        named = ", ".join(k for k, v in fsdp_opts.items() if v)
        raise ValueError(f"wrap: {named} are FSDP2 options (engine='fsdp'), not ones of engine={engine!r}")
    if engine == "none":
        return model
    if engine == "ddp":
        return wrap_ddp(model, compression=compression)
    mesh = device_mesh(shard=shard_size) if shard_size else None
    return shard_model(model, mesh=mesh, mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
                       cpu_offload=cpu_offload, sync_module_states=sync_module_states)
