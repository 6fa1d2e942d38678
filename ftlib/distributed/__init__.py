"""Multi-GPU training on PyTorch's own engine: FSDP2 / HSDP / DDP, sharded checkpoints, exports, memory.

    env = init_distributed()                                   # torchrun sets RANK, WORLD_SIZE, ...
    model, train_model = load_sharded(path, dtype=torch.bfloat16, wrap=CausalLMLoss,   # FSDP2, each rank
        lora_config=LoRAConfig(r=16, target_modules="all-linear", quantize="nf4"),      # reads its rows only
        mixed_precision="bf16")                                                         # (QLoRA: NF4 shards)
    # (one process's recipe, whole model per rank first: load_pretrained + apply_lora + shard_model)
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=2e-4)))
    ckpt = ShardedCheckpointer("runs/x/checkpoints", keep=3)
    ...                                                         # the usual loop
    ckpt.save(step, model=train_model, optimizer=opt, scheduler=sched, clipper=clip, loader=loader)
    export_adapter(train_model, "runs/x/adapter")               # PEFT format, from rank 0
    export_merged(train_model, "runs/x/merged")                 # HF format, one layer at a time

Modules: ``sharding`` (``wrap(model, engine="none" | "ddp" | "fsdp")`` over ``shard_model`` and ``wrap_ddp``, ``device_mesh``, ``init_distributed``),
``sharded_load`` (``load_sharded`` / ``init_sharded``: build on the meta device, adapt, shard, then each
rank fills only its shards from the safetensors rows it owns or the replayed constructor init;
``meta_model``, ``materialize_sharded``, ``shard_rows`` are its steps),
``checkpoint`` (``ShardedCheckpointer``, built on ``ftlib.checkpoint``'s format; they are read back by
``ftlib.checkpoint.load_checkpoint``, which reads either kind on any number of ranks),
``context_parallel`` (``zigzag_shard``, ``context_parallel_loss``: one long packed sequence over a process
group, zigzag chunks, all-gathered K/V), ``export``
(``export_adapter``, ``export_merged``), ``memory`` (``estimate_memory``; the CLI
``python -m ftlib.distributed memory --model config.json --gpus 8 --lora-r 16 --qlora``).
"""

from .checkpoint import ShardedCheckpointer, save_sharded_checkpoint
from .context_parallel import (
    ContextParallelLMLoss,
    ZigzagLayout,
    context_groups,
    context_parallel_attention,
    context_parallel_loss,
    shard_segments,
    sum_gradients,
    zigzag_indices,
    zigzag_shard,
)
from .export import export_adapter, export_merged
from .memory import MemoryEstimate, estimate_memory
from .sharded_load import init_sharded, load_sharded, materialize_sharded, meta_model, shard_rows
from .sharding import (
    DistEnv,
    decoder_blocks,
    device_mesh,
    init_distributed,
    is_rank0,
    mixed_precision_policy,
    shard_model,
    wrap,
    wrap_ddp,
)

__all__ = [
    "ContextParallelLMLoss",
    "DistEnv",
    "MemoryEstimate",
    "ShardedCheckpointer",
    "ZigzagLayout",
    "context_groups",
    "context_parallel_attention",
    "context_parallel_loss",
    "decoder_blocks",
    "device_mesh",
    "estimate_memory",
    "export_adapter",
    "export_merged",
    "init_distributed",
    "init_sharded",
    "is_rank0",
    "load_sharded",
    "materialize_sharded",
    "meta_model",
    "mixed_precision_policy",
    "save_sharded_checkpoint",
    "shard_model",
    "shard_rows",
    "shard_segments",
    "sum_gradients",
    "wrap",
    "wrap_ddp",
    "zigzag_indices",
    "zigzag_shard",
]
