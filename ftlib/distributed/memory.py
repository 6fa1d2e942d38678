"""Per-GPU memory of a fine-tuning run, before you rent the GPUs: parameters, gradients, optimizer, activations.

    python -m ftlib.distributed memory --model config.json --gpus 1 2 4 8 --lora-r 16 --qlora

What is counted (bytes on the busiest rank, rank 0, which holds the largest chunks: FSDP2 gives
rank r rows ``[r c, (r + 1) c)`` of every tensor, c = ceil(rows / S) for a shard group of S):

- ``params``: the persistent weights. Full fine-tuning keeps fp32 masters; LoRA keeps the frozen
  base in ``dtype`` (bf16) plus fp32 adapters; QLoRA stores the targeted linears in NF4 (half a
  byte per weight, plus per 64 weights one 8-bit absmax, plus per 16384 one fp32 second-level
  scale: about 0.516 bytes a weight), every other tensor (embeddings, norms, head) in ``dtype``.
- ``grads``: fp32 gradients of the trainable tensors (sharded like them).
- ``optimizer``: AdamW's two fp32 moments (8 bytes a trainable weight; ``adamw8bit``: 2).
- ``gathered``: what is whole for a while, the largest of three phases. On S > 1 ranks (FSDP2,
  ``mixed_precision="bf16"``): the root unit (head, final norm, a tied embedding) for the whole
  step and two blocks in the compute dtype (the one computing and the one prefetched); in
  backward also the largest unit's unsharded fp32 gradient before its reduce-scatter. An untied
  input embedding is a unit of its own, gathered with the root and block 0 before any
  activation exists (and, when trained, again with its fp32 gradient after they are freed):
  ``gathered_embed`` (70B: a 2 GiB embedding, larger than a 0.4 GiB NF4 block). On one GPU
  (no sharding): in the forward, autocast's cached bf16 copies of the fp32 weights (full
  fine-tuning: every weight; freed when the forward ends, as activation checkpointing keeps
  none of them). QLoRA adds one dequantized weight (the largest targeted linear) in the
  compute dtype.
- ``activations``: tensors saved for backward, for ``batch_size * seq_len`` tokens per rank, in
  the compute dtype (2 bytes) unless noted. Per token and decoder block, with an attention
  kernel that keeps q, k, v, its output and the fp32 log-sum-exp (flash-attn, ftlib's Triton
  kernel):

      RMSNorm x 2     2 x (2H input + 4 fp32 1/rms + 2H output)               = 8H + 8
                      (the gain's gradient is recomputed from them: full fine-tuning adds nothing)
      attention       2 (Hq D + 2 Hkv D) q, k, v + 2 Hq D output + 4 Hq lse    = 4 Hq D + 4 Hkv D + 4 Hq
      SwiGLU          2I each: gate, up, silu(gate), silu(gate) * up            = 8I
      LoRA            per adapted linear: 2r (A's output); with dropout p > 0
                      also its 1-byte keep mask (the input is the base's)      = 2r + in

  (A_block bytes). With activation checkpointing a block keeps only its input (2H) and one
  block at a time is recomputed: ``L * 2H * T + A_block * T``; without it ``L * A_block * T``.
  Plus the head: final norm (2H input + 4) and the chunked loss (its 2H gradient of the hidden
  state, computed in forward, and a 4-byte log-sum-exp), and the one [rows, V] fp32 logit block
  of the chunk in flight (``ftlib.losses.auto_chunk_size``: ~64 MiB).

``total`` is the peak of the three phases:

    params + optimizer + max(gathered_forward + activations,
                             grads + gathered_backward + activations,
                             grads + gathered_embed)

(the activations are counted whole in both block phases, an upper bound for the backward; the
gradients of earlier micro-batches of a window exist in every phase but the first forward).

CPU offload (``cpu_offload=True``, FSDP2's ``CPUOffloadPolicy``, ``--cpu-offload``): the sharded
parameters, the sharded gradients and so the optimizer state live in pinned host memory and the
optimizer steps there. Each unit's shards are copied to the GPU just before its all-gather, so
on the GPU ``params``, ``grads`` and ``optimizer`` are 0 and ``total`` is the gathered units plus
the activations; ``host`` (bytes of host memory per rank while training) is what they were:

    host = params + grads + optimizer          (the rank's shards; 0 without offload)

Host memory while loading (``load_host``, per rank; a node needs it times its ranks): the
weights are built on the meta device and each rank reads from the safetensors files only the
rows of every tensor it keeps, one decoder block at a time. A tensor that stays in the load
dtype (``dtype``) is read as the rank's rows only; a targeted linear that becomes NF4 is read
whole in the load dtype and quantized, then its flat NF4 tensors are sharded. With
the rank's shards on the GPU only the block in flight is on the host; with CPU offload the
shards stay there:

    load_host = (params with CPU offload, else 0) + max over units of in_flight(unit)
    in_flight = sum over the unit's NF4 linears of  out * in * bytes(dtype) + NF4 bytes of out x in
              + sum over its other tensors of       rank-0 rows * bytes(dtype)

The quantizer's own temporaries are not counted (on the GPU when the device quantizes; on the
CPU, ``ftlib.kernels.nf4_ref.quantize_nf4`` makes fp32 and int32 copies of the tensor it
quantizes: its peak resident memory rose 12.1-12.4 bytes per weight above the bf16 weight,
measured by ``benchmarks/bench_nf4_host_memory.py``), nor the page cache of the files.

Not counted: the CUDA context and allocator fragmentation (measured peaks run some 5-15% above
``max_memory_allocated``), communication buffers of NCCL, DoRA's extra activations, the
optimizer step's temporaries (foreach AdamW: about one trainable-sized fp32 buffer), FSDP2's
all-gather input buffers (one unit's shards). Checked in the tests: the per-rank params, grads
and optimizer bytes equal a 2-rank FSDP2 run's, the NF4 bytes a real ``NF4Linear``'s, the
activation formula the tensors autograd saves; the gathered bytes, the totals and the host
memory are computed, not measured (``benchmarks/bench_memory.py`` checks one GPU's totals).

Long context (``mlp_chunks``, ``activation_offload``, ``context_parallel``; ``max_context``; the CLI's
``--max-context``). At 100k+ tokens everything but the weights scales with T, so the activations are
written as bytes per token, tensor by tensor (``activation_terms``; a = 2 bytes, bf16, the GPU code
path: flash-attn or ftlib's Triton kernel, which keep q, k, v, o and the fp32 lse), with activation
checkpointing on every block:

    checkpointed block inputs      L a H            (activation offload, ``ftlib.long_context.offload_checkpoints``:
                                                    on the host; 2 a H on the GPU,
                                                    the block recomputed and the next one brought back)
    block recompute: norms         a H + 8 + 2 a H  (the first norm's input is the checkpointed one)
    block recompute: attention     a (Hq D + 2 Hkv D) + a Hq D + 4 Hq
    block recompute: MLP           4 a I / K        (``ftlib.long_context.chunk_mlp``: K sequence chunks)
    block recompute: LoRA          a r per adapted linear (+ in, its 1-byte dropout mask); the MLP's / K
    block backward: gradients      2 a H + max(a Hq D + a (Hq D + 2 Hkv D) + 4 Hq,  3 a I / K,  12 H / K)
                                   (dy and dx of the residual; then either dO, dq, dk, dv and the fp32
                                   rowsum(dO O) of the attention backward, or d gate, d up, d h of an MLP
                                   chunk, or an RMSNorm backward's fp32 n, g and dx: with K > 1 the norms
                                   are taken as chunked too, ``ftlib.long_context.chunk_norms``)
    head: final norm + loss        2 H + 4 + 2 H + 4  (the loss's dL/dh, computed in forward)
    batch + RoPE tables            3 x 8 (ids, labels, positions) + 2 a R (cos, sin)

plus one [rows, V] fp32 logit block. Without checkpointing a block keeps its whole A_block (above,
input included) and every block is counted. Context parallelism over N ranks
(``ftlib.distributed.context_parallel``): every term above at T / N tokens per rank, plus the
all-gathered K and V of the layer in flight and their gradients, 2 x 2 a Hkv D per token of the
whole sequence, and as much again for the key segments the local queries attend over (the
gathered rows of their documents: at most (2N + 1) / 2 rows per local token). The per-block terms with chunking are what autograd saves (tests/distributed/
test_memory.py measures them with saved-tensor hooks at tiny sizes; the gradient working set and
the attention kernel's are stated, not measured on CPU).

``max_context(config, gpu_gib, ...)``: the largest T with ``total`` <= the usable memory, taken as
``(1 - 0.05) * gpu_gib GiB - 1 GiB`` (5 % for the allocator's fragmentation, 1 GiB for the CUDA
context and the cuBLAS / NCCL workspaces); ``total`` is affine in T past the loss block, so it is
solved, then checked with one more estimate.

``PRESETS`` holds the sizes from the published config.json of a few models (``--model llama-3-70b``), so the
calculator runs without a download.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..losses import auto_chunk_size

__all__ = ["METHODS", "MemoryEstimate", "PRESETS", "activation_bytes_per_token", "activation_terms",
           "block_lora_targets", "estimate_memory", "max_context", "usable_bytes"]

METHODS = ("full", "lora", "qlora")
GiB = 2**30
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192,
           "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "vocab_size": 128256}
#: the sizes of Meta-Llama-3-8B's, Llama-3.1-8B's and Meta-Llama-3-70B's config.json (Hugging Face meta-llama/*)
PRESETS = {
    "llama-3-8b": _LLAMA3 | {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                             "num_hidden_layers": 32},
    "llama-3.1-8b": _LLAMA3 | {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                               "num_hidden_layers": 32, "max_position_embeddings": 131072,
                               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "llama-3-70b": _LLAMA3 | {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                              "num_hidden_layers": 80},
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the busiest rank (see the module doc); ``total`` is their sum."""

    method: str
    gpus: int
    shard_size: int
    n_params: int  # the model's weights (NF4 weights counted as out * in)
    n_trainable: int
    params: int
    grads: int
    optimizer: int
    gathered: int  # max(gathered_forward, gathered_backward, gathered_embed)
    activations: int
    gathered_forward: int
    gathered_backward: int
    cpu_offload: bool = False
    host: int = 0  # host bytes per rank while training: the offloaded shards (params + grads + optimizer)
    load_host: int = 0  # host bytes per rank at the peak of sharded loading

    gathered_embed: int = 0
    mlp_chunks: int = 1
    activation_offload: bool = False
    context_parallel: int = 1
    activation_host: int = 0  # host bytes of the offloaded checkpointed block inputs (part of ``host``)

    @property
    def total(self) -> int:
        """The peak of the three phases (see the module doc)."""
        return self.params + self.optimizer + max(self.activations + self.gathered_forward,
                                                  self.activations + self.grads + self.gathered_backward,
                                                  self.grads + self.gathered_embed)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _config(spec):
    """``spec`` as a ``LlamaConfig``: one as is, the name of a ``PRESETS`` entry (when no such file or
    folder exists), else what ``ftlib.models.load_config`` reads (a config.json, its folder, a repo id)."""
    from ..models import LlamaConfig, load_config

    if isinstance(spec, LlamaConfig) or hasattr(spec, "hidden_size"):
        return spec
    if str(spec) in PRESETS and not Path(spec).exists():
        return LlamaConfig.from_hf_dict(PRESETS[str(spec)], source=f"preset {spec}")
    try:
        return load_config(spec)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e} (pass a Hugging Face config.json, the folder holding it, a hub repo id, or "
                                f"one of the presets {', '.join(sorted(PRESETS))})") from None


def _rows0(shape, shards: int) -> int:
    """Elements of rank 0's chunk of a tensor sharded on dim 0 over ``shards`` ranks (torch.chunk sizes)."""
    if not shape:
        return 1
    rest = math.prod(shape[1:])
    return min(shape[0], math.ceil(shape[0] / shards)) * rest


def _nf4_parts(out_f: int, in_f: int, blocksize: int = 64) -> list[tuple[int, int]]:
    """(elements, bytes each) of the 1-D tensors of a double-quantized ``NF4Linear`` (see ftlib.lora.nf4)."""
    n = out_f * in_f
    nb = -(-n // blocksize)
    return [((n + 1) // 2, 1), (nb, 1), (-(-nb // 256), 4), (1, 4), (256, 4)]


_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def activation_bytes_per_token(config, *, lora_targets: dict[str, int] | None = None, lora_r: int = 0,
                               lora_dropout: float = 0.0, train_norms: bool = False, act_bytes: int = 2,
                               mlp_chunks: int = 1) -> int | float:
    """A_block of the module doc: bytes one decoder block saves for backward per token.

    ``mlp_chunks`` K: the MLP runs over K sequence chunks (``ftlib.long_context.chunk_mlp``), so its
    intermediates and its adapters' tensors are held for T / K tokens at once (a float when K > 1).

    ``lora_targets``: {linear leaf name: in_features} of the adapted linears of one block, with
    rank ``lora_r``; ``train_norms``: the RMSNorm gains are trained (full fine-tuning), which keeps
    nothing more (ftlib's RMSNorm recomputes the normalised input from x and 1/rms in backward).
    """
    h, i = config.hidden_size, config.intermediate_size
    hq, hkv, d, a = config.num_attention_heads, config.num_key_value_heads, config.head_dim, act_bytes
    per = 2 * (a * h + 4 + a * h)  # two RMSNorms: the input, the fp32 1/rms, the output (the next linear's input)
    per += a * (hq * d + 2 * hkv * d) + a * hq * d + 4 * hq  # q, k, v; the attention output; fp32 lse
    mlp = 4 * a * i  # gate, up, silu(gate), silu(gate) * up
    for name, n_in in (lora_targets or {}).items():
        one = a * lora_r + (n_in if lora_dropout > 0 else 0)  # lora_A's output (kept by lora_B); the 1-byte
        if name in _MLP_LINEARS:                               # keep mask (the input is the base linear's)
            mlp += one
        else:
            per += one
    return int(per + mlp) if mlp_chunks == 1 else per + mlp / mlp_chunks


def block_lora_targets(config, lora_r: int = 16, lora_targets="all-linear") -> dict[str, int]:
    """{leaf name: in_features} of the linears of block 0 that LoRA adapts (``ftlib.lora.plan_lora`` on a meta model)."""
    from ..lora import LoRAConfig, plan_lora
    from ..models import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(config))
    _, planned, _ = plan_lora(model, LoRAConfig(r=lora_r, alpha=2 * lora_r, target_modules=lora_targets))
    return {n.split(".")[-1]: mod.in_features for n, mod in planned if n.startswith("model.layers.0.")}


def activation_terms(config, *, lora_targets: dict[str, int] | None = None, lora_r: int = 0,
                     lora_dropout: float = 0.0, mlp_chunks: int = 1, grad_ckpt: bool = True,
                     activation_offload: bool = False, act_bytes: int = 2) -> list[tuple[str, float, float]]:
    """(tensor, GPU bytes per token, host bytes per token) of the long-context table in the module doc.

    ``config``: what :func:`estimate_memory` takes; ``lora_targets``: as ``block_lora_targets`` gives."""
    config = _config(config)
    h, i, n_layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hq, hkv, d, a = config.num_attention_heads, config.num_key_value_heads, config.head_dim, act_bytes
    k = mlp_chunks
    targets = lora_targets or {}
    lora = sum((a * lora_r + (n if lora_dropout > 0 else 0)) / (k if name in _MLP_LINEARS else 1)
               for name, n in targets.items())
    norms, attn = 2 * (a * h + 4 + a * h), a * (hq * d + 2 * hkv * d) + a * hq * d + 4 * hq
    grads = 2 * a * h + max(a * hq * d + a * (hq * d + 2 * hkv * d) + 4 * hq, 3 * a * i / k, 12 * h / k)
    head = [("head: final norm + loss", 2 * h + 4 + 2 * h + 4, 0),
            ("batch + RoPE tables", 3 * 8 + 2 * a * config.rotary_dim, 0)]
    if not grad_ckpt:
        block = norms + attn + 4 * a * i / k + lora
        return [(f"{n_layers} blocks' saved tensors", n_layers * block, 0), ("block backward: gradients", grads, 0)] + head
    offload = [("checkpointed block inputs", 2 * a * h, n_layers * a * h)] if activation_offload else [
        ("checkpointed block inputs", n_layers * a * h, 0)]
    return offload + [("block recompute: norms", norms - a * h, 0), ("block recompute: attention", attn, 0),
                      ("block recompute: MLP", 4 * a * i / k, 0), ("block recompute: LoRA", lora, 0),
                      ("block backward: gradients", grads, 0)] + head


def estimate_memory(config, *, method: str = "lora", gpus: int = 1, shard_size: int | None = None,
                    lora_r: int = 16, lora_targets="all-linear", lora_dropout: float = 0.05, use_dora: bool = False,
                    batch_size: int = 1,
                    seq_len: int = 2048, grad_ckpt: bool = True, optimizer: str = "adamw",
                    dtype: torch.dtype = torch.bfloat16, loss_chunk: int | None = None,
                    cpu_offload: bool = False, mlp_chunks: int = 1, activation_offload: bool = False,
                    context_parallel: int = 1) -> MemoryEstimate:
    """Estimate one rank's memory for fine-tuning ``config``: a ``LlamaConfig``, a config.json, the folder
    holding one, a hub repo id (``ftlib.models.load_config``) or the name of a ``PRESETS`` entry.

    ``method``: full | lora | qlora (NF4 with double quantization). ``gpus``: ranks;
    ``shard_size``: ranks per FSDP2 shard group (HSDP; default all of them). ``use_dora`` adds the
    magnitude vectors (their extra activations are not counted). ``dtype``: the frozen base and
    compute dtype (and the dtype weights are loaded in). ``batch_size`` x ``seq_len``: tokens per
    micro-batch per rank. ``cpu_offload``: FSDP2's CPU offload (also on one GPU: FSDP2 on one rank).
    ``mlp_chunks``, ``activation_offload`` (the checkpointed block inputs in host memory) and
    ``context_parallel`` (ranks one sequence is sharded over; ``seq_len`` is the whole sequence): see
    "Long context" in the module doc.
    """
    from ..lora import LoRAConfig, plan_lora
    from ..models import LlamaForCausalLM

    config = _config(config)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if optimizer not in ("adamw", "adamw8bit"):
        raise ValueError(f"optimizer must be adamw or adamw8bit, got {optimizer!r}")
    for name, v in (("gpus", gpus), ("batch_size", batch_size), ("seq_len", seq_len), ("lora_r", lora_r),
                    ("mlp_chunks", mlp_chunks), ("context_parallel", context_parallel)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    s = gpus if shard_size is None else shard_size
    if isinstance(s, bool) or not isinstance(s, int) or s < 1 or gpus % s:
        raise ValueError(f"shard_size must divide gpus={gpus}, got {shard_size!r}")

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    targets: dict[str, tuple[int, int]] = {}
    if method != "full":
        _, planned, _ = plan_lora(model, LoRAConfig(r=lora_r, alpha=2 * lora_r, target_modules=lora_targets))
        targets = {name: (mod.out_features, mod.in_features) for name, mod in planned}
    base_b = torch.empty((), dtype=dtype).element_size()
    fsdp = s > 1 or cpu_offload  # FSDP2 units (gathered one or two at a time) rather than one whole model
    comp_b = 2 if fsdp or method == "full" else base_b  # bf16 compute (FSDP2 mixed precision / autocast)

    def unit_of(name: str) -> str:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            return f"block{parts[2]}"
        if name.startswith("model.embed_tokens") and not config.tie_word_embeddings:
            return "embed"
        return "root"

    persistent = grads = n_params = n_train = 0
    whole: dict[str, int] = {}  # unit -> bytes while gathered (compute form)
    loading: dict[str, int] = {}  # unit -> host bytes while it is read (see load_host in the module doc)
    grad_whole: dict[str, int] = {}  # unit -> unsharded fp32 gradient bytes
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue  # a tied head
        seen.add(id(p))
        unit, mod = unit_of(name), name.rpartition(".")[0]
        n_params += p.numel()
        if method == "qlora" and mod in targets:  # read whole in the load dtype, quantized whole
            loading[unit] = loading.get(unit, 0) + base_b * p.numel() + sum(b * n for n, b in _nf4_parts(*targets[mod]))
        else:  # the rank's rows only
            loading[unit] = loading.get(unit, 0) + base_b * _rows0(p.shape, s)
        if method == "full":
            persistent += 4 * _rows0(p.shape, s)
            grads += 4 * _rows0(p.shape, s)
            n_train += p.numel()
            whole[unit] = whole.get(unit, 0) + 2 * p.numel()
            grad_whole[unit] = grad_whole.get(unit, 0) + 4 * p.numel()
            continue
        if method == "qlora" and mod in targets:
            for n, b in _nf4_parts(*targets[mod]):
                persistent += b * _rows0((n,), s)
                whole[unit] = whole.get(unit, 0) + b * n
        else:
            persistent += base_b * _rows0(p.shape, s)
            whole[unit] = whole.get(unit, 0) + comp_b * p.numel()
        if mod in targets:
            out_f, in_f = targets[mod]
            for shape in ((lora_r, in_f), (out_f, lora_r)) + (((out_f,),) if use_dora else ()):
                n = math.prod(shape)
                n_train += n
                persistent += 4 * _rows0(shape, s)
                grads += 4 * _rows0(shape, s)
                whole[unit] = whole.get(unit, 0) + 2 * n
                grad_whole[unit] = grad_whole.get(unit, 0) + 4 * n
    trainable_rank0 = grads // 4
    opt = (8 if optimizer == "adamw" else 2) * trainable_rank0

    blocks = [v for k, v in whole.items() if k.startswith("block")]
    embed_phase = 0
    if fsdp:  # the root for the whole step, two blocks; the embedding unit before and after them
        block = max(blocks, default=0)
        fwd = whole.get("root", 0) + 2 * block
        bwd = fwd + max(grad_whole.values(), default=0)
        if "embed" in whole:
            embed_phase = whole["root"] + whole["embed"] + max(block, grad_whole.get("embed", 0))
    else:
        fwd, bwd = 2 * n_train, 0  # autocast's cached bf16 copies of the fp32 (trainable) weights
    if method == "qlora" and targets:
        dequant = 2 * max(o * i for o, i in targets.values())
        fwd, bwd = fwd + dequant, bwd + dequant

    cp = context_parallel
    t = batch_size * (-(-seq_len // (2 * cp)) * 2 if cp > 1 else seq_len)  # tokens per rank (zigzag: 2 cp chunks)
    layer0 = {n.split(".")[-1]: i for n, (o, i) in targets.items() if n.startswith("model.layers.0.")}
    terms = activation_terms(config, lora_targets=layer0, lora_r=lora_r, lora_dropout=lora_dropout,
                             mlp_chunks=mlp_chunks, grad_ckpt=grad_ckpt, activation_offload=activation_offload)
    acts = math.ceil(sum(g for _, g, _ in terms) * t)
    act_host = math.ceil(sum(hb for _, _, hb in terms) * t)
    if cp > 1:  # the all-gathered K and V of one layer and their gradients, for the whole sequence, and the key
        # segments' K and V (the rows of the local queries' documents, (2 cp + 1) / 2 per local token) and theirs
        acts += 2 * 2 * 2 * config.num_key_value_heads * config.head_dim * (t * cp + t * (2 * cp + 1) // 2)
    rows = loss_chunk or auto_chunk_size(config.vocab_size)
    acts += min(rows, t) * config.vocab_size * 4
    host = (persistent + grads + opt if cpu_offload else 0) + act_host
    load_host = (persistent if cpu_offload else 0) + max(loading.values(), default=0)
    if cpu_offload:  # the shards live on the host; only the gathered units and the activations on the GPU
        persistent = grads = opt = 0
    return MemoryEstimate(method, gpus, s, n_params, n_train, persistent, grads, opt, max(fwd, bwd, embed_phase), acts,
                          fwd, bwd, cpu_offload, host, load_host, embed_phase, mlp_chunks, activation_offload,
                          context_parallel, act_host)


def usable_bytes(gpu_gib: float) -> int:
    """The bytes a run may allocate on a GPU of ``gpu_gib`` GiB: 95 % of it, less 1 GiB (module doc)."""
    return int(0.95 * gpu_gib * GiB) - GiB


def max_context(config, gpu_gib: float, **kwargs) -> tuple[int, MemoryEstimate | None]:
    """(the largest ``seq_len`` whose ``total`` fits ``usable_bytes(gpu_gib)``, its estimate); (0, None) when
    not even one loss block's worth of tokens fits. ``kwargs``: those of :func:`estimate_memory` but seq_len."""
    if "seq_len" in kwargs:
        raise ValueError("max_context: seq_len is what it solves for; do not pass it")
    config = _config(config)
    budget = usable_bytes(gpu_gib)
    step = 2 * kwargs.get("context_parallel", 1) * 1024  # a multiple of the zigzag's 2N chunks
    t1, t2 = 16 * step, 32 * step  # both past the loss block, where total is affine in T
    e1, e2 = (estimate_memory(config, seq_len=t, **kwargs) for t in (t1, t2))
    slope = (e2.total - e1.total) / (t2 - t1)
    if e1.total > budget:
        lo, hi = 0, t1  # short contexts: search (the loss block is not affine in T below its rows)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if estimate_memory(config, seq_len=mid, **kwargs).total <= budget else (lo, mid)
        return (lo, estimate_memory(config, seq_len=lo, **kwargs)) if lo else (0, None)
    t = t1 + int((budget - e1.total) / slope)
    t -= t % (2 * kwargs.get("context_parallel", 1))
    while estimate_memory(config, seq_len=t, **kwargs).total > budget:  # rounding: at most a step or two
        t -= 2 * kwargs.get("context_parallel", 1)
    return t, estimate_memory(config, seq_len=t, **kwargs)


def format_terms(terms: list[tuple[str, float, float]]) -> str:
    """The per-token table: bytes (and KiB) per token of each tensor on the GPU and on the host."""
    lines = [f"{'tensor':<34}{'GPU B/token':>14}{'host B/token':>14}", "-" * 62]
    for name, g, hb in terms:
        lines.append(f"{name:<34}{g:>14,.0f}{hb:>14,.0f}")
    lines.append(f"{'total':<34}{sum(g for _, g, _ in terms):>14,.0f}{sum(hb for _, _, hb in terms):>14,.0f}")
    return "\n".join(lines)


def format_table(estimates: list[MemoryEstimate], gpu_gib: float | None = None) -> str:
    """A plain-text table, GiB per rank: the GPU columns and their ``total``, then the host memory while
    training (``host``: the offloaded shards) and while loading (``load host``); with ``gpu_gib``, whether
    ``total`` fits a GPU of that many GiB (nothing left for the CUDA context and fragmentation)."""
    cols = ("params", "grads", "optimizer", "gathered", "activations", "total", "host", "load host")
    head = f"{'method':<7}{'gpus':>5}{'shard':>6}{'offload':>8}" + "".join(f"{c:>12}" for c in cols)
    if gpu_gib is not None:
        head += f"{f'fits {gpu_gib:g} GiB':>14}"
    lines = [head, "-" * len(head)]
    for e in estimates:
        d = e.to_dict() | {"load host": e.load_host}
        line = f"{e.method:<7}{e.gpus:>5}{e.shard_size:>6}{'cpu' if e.cpu_offload else '-':>8}" + "".join(
            f"{d[c] / GiB:>12.2f}" for c in cols)
        if gpu_gib is not None:
            line += f"{'yes' if e.total <= gpu_gib * GiB else 'no':>14}"
        lines.append(line)
    return "\n".join(lines)
