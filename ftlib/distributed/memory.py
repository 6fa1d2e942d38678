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
- ``gathered``: what is whole for a while, the larger of the forward's and the backward's. On
  S > 1 ranks (FSDP2, ``mixed_precision="bf16"``): the root unit (head, final norm, a tied
  embedding) for the whole step and two blocks in the compute dtype (the one computing and the
  one prefetched); in backward also the largest unit's unsharded fp32 gradient before its
  reduce-scatter. On one GPU (no sharding): in the forward, autocast's cached bf16 copies of the
  fp32 weights (full fine-tuning: every weight; freed when the forward ends, as activation
  checkpointing keeps none of them). QLoRA adds one dequantized weight (the largest targeted
  linear) in the compute dtype.
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

``total`` is the peak: params + optimizer + activations + the larger of the forward's gathered
bytes and the backward's gathered bytes plus the gradients (the gradients do not exist yet in
the forward; the activations are counted whole in both phases, an upper bound for the backward).

Not counted: the CUDA context and allocator fragmentation (measured peaks run some 5-15% above
``max_memory_allocated``), communication buffers of NCCL, DoRA's extra activations, the
optimizer step's temporaries (foreach AdamW: about one trainable-sized fp32 buffer). The
activation formula is checked in the tests against the tensors autograd actually saves; the
whole estimate has not been checked against a GPU's ``max_memory_allocated``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..losses import auto_chunk_size

__all__ = ["METHODS", "MemoryEstimate", "activation_bytes_per_token", "estimate_memory", "load_config"]

METHODS = ("full", "lora", "qlora")
GiB = 2**30


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
    gathered: int  # max(gathered_forward, gathered_backward)
    activations: int
    gathered_forward: int
    gathered_backward: int

    @property
    def total(self) -> int:
        """The peak: the forward's gathered copies and the backward's gradients are not alive together."""
        return self.params + self.optimizer + self.activations + max(self.gathered_forward,
                                                                     self.grads + self.gathered_backward)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def load_config(path: str | os.PathLike):
    """A ``LlamaConfig`` from a config.json file or a folder holding one (a Hugging Face checkpoint)."""
    from ..models.config import LlamaConfig

    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{f}: no config.json (pass a Hugging Face config.json or the folder holding it)")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return LlamaConfig.from_hf_dict(d, source=str(f))


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


def activation_bytes_per_token(config, *, lora_targets: dict[str, int] | None = None, lora_r: int = 0,
                               lora_dropout: float = 0.0, train_norms: bool = False, act_bytes: int = 2) -> int:
    """A_block of the module doc: bytes one decoder block saves for backward per token.

    ``lora_targets``: {linear leaf name: in_features} of the adapted linears of one block, with
    rank ``lora_r``; ``train_norms``: the RMSNorm gains are trained (full fine-tuning), which keeps
    nothing more (ftlib's RMSNorm recomputes the normalised input from x and 1/rms in backward).
    """
    h, i = config.hidden_size, config.intermediate_size
    hq, hkv, d, a = config.num_attention_heads, config.num_key_value_heads, config.head_dim, act_bytes
    per = 2 * (a * h + 4 + a * h)  # two RMSNorms: the input, the fp32 1/rms, the output (the next linear's input)
    per += a * (hq * d + 2 * hkv * d) + a * hq * d + 4 * hq  # q, k, v; the attention output; fp32 lse
    per += 4 * a * i  # gate, up, silu(gate), silu(gate) * up
    for n_in in (lora_targets or {}).values():
        per += a * lora_r  # lora_A's output, kept by lora_B
        if lora_dropout > 0:
            per += n_in  # the 1-byte keep mask; the input itself is what the base linear keeps
    return int(per)


def estimate_memory(config, *, method: str = "lora", gpus: int = 1, shard_size: int | None = None,
                    lora_r: int = 16, lora_targets="all-linear", lora_dropout: float = 0.05, use_dora: bool = False,
                    batch_size: int = 1,
                    seq_len: int = 2048, grad_ckpt: bool = True, optimizer: str = "adamw",
                    dtype: torch.dtype = torch.bfloat16, loss_chunk: int | None = None) -> MemoryEstimate:
    """Estimate one rank's memory for fine-tuning ``config`` (a ``LlamaConfig`` or a config.json path).

    ``method``: full | lora | qlora (NF4 with double quantization). ``gpus``: ranks;
    ``shard_size``: ranks per FSDP2 shard group (HSDP; default all of them). ``use_dora`` adds the
    magnitude vectors (their extra activations are not counted). ``dtype``: the frozen base and
    compute dtype. ``batch_size`` x ``seq_len``: tokens per micro-batch per rank.
    """
    from ..lora import LoRAConfig, plan_lora
    from ..models import LlamaForCausalLM

    if not hasattr(config, "hidden_size"):
        config = load_config(config)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if optimizer not in ("adamw", "adamw8bit"):
        raise ValueError(f"optimizer must be adamw or adamw8bit, got {optimizer!r}")
    for name, v in (("gpus", gpus), ("batch_size", batch_size), ("seq_len", seq_len), ("lora_r", lora_r)):
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
    comp_b = 2 if s > 1 or method == "full" else base_b  # bf16 compute (FSDP2 mixed precision / autocast)
    n_layers = config.num_hidden_layers

    def unit_of(name: str) -> str:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            return f"block{parts[2]}"
        if name.startswith("model.embed_tokens") and not config.tie_word_embeddings:
            return "embed"
        return "root"

    persistent = grads = n_params = n_train = 0
    whole: dict[str, int] = {}  # unit -> bytes while gathered (compute form)
    grad_whole: dict[str, int] = {}  # unit -> unsharded fp32 gradient bytes
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue  # a tied head
        seen.add(id(p))
        unit, mod = unit_of(name), name.rpartition(".")[0]
        n_params += p.numel()
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
    if s > 1:
        fwd = whole.get("root", 0) + 2 * max(blocks, default=0)
        bwd = fwd + max(grad_whole.values(), default=0)
    else:
        fwd, bwd = 2 * n_train, 0  # autocast's cached bf16 copies of the fp32 (trainable) weights
    if method == "qlora" and targets:
        dequant = 2 * max(o * i for o, i in targets.values())
        fwd, bwd = fwd + dequant, bwd + dequant

    t = batch_size * seq_len
    h = config.hidden_size
    layer0 = {n.split(".")[-1]: i for n, (o, i) in targets.items() if n.startswith("model.layers.0.")}
    per_block = activation_bytes_per_token(config, lora_targets=layer0, lora_r=lora_r, lora_dropout=lora_dropout,
                                           train_norms=method == "full", act_bytes=2)
    acts = (n_layers * 2 * h * t + per_block * t) if grad_ckpt else n_layers * per_block * t
    rows = loss_chunk or auto_chunk_size(config.vocab_size)
    acts += (2 * h + 4 + 2 * h + 4) * t + min(rows, t) * config.vocab_size * 4
    return MemoryEstimate(method, gpus, s, n_params, n_train, persistent, grads, opt, max(fwd, bwd), acts, fwd, bwd)


def format_table(estimates: list[MemoryEstimate]) -> str:
    """A plain-text table, GiB per rank."""
    cols = ("params", "grads", "optimizer", "gathered", "activations", "total")
    head = f"{'method':<7}{'gpus':>5}{'shard':>6}" + "".join(f"{c:>13}" for c in cols)
    lines = [head, "-" * len(head)]
    for e in estimates:
        d = e.to_dict()
        lines.append(f"{e.method:<7}{e.gpus:>5}{e.shard_size:>6}" + "".join(f"{d[c] / GiB:>13.2f}" for c in cols))
    return "\n".join(lines)
