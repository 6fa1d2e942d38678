"""Token-weighted causal-LM cross-entropy, plain and chunked (no full logits).

Label convention: ``labels`` [B, T] are aligned with ``input_ids`` (``labels[b, t]`` is the
token at position t, or -100 for no loss), and the shift happens inside: the logits at
position t predict ``labels[:, t + 1]``. So the loss covers ``labels[:, 1:]`` predicted from
``logits[:, :-1]``, the Hugging Face convention.

Both functions return ``(loss_sum, num_tokens)``: the *sum* of -log p(label) over target
tokens and the number of target tokens (labels != -100). Summing, not averaging, is what makes
gradient accumulation exact: divide by the token count of the whole accumulation window
(``ftlib.optim`` does this), never per micro-batch.

Chunked variant: with vocabulary V = 128k and 8k tokens, fp32 logits alone take 4 GiB. The
chunked loss computes logits for ``chunk_size`` target tokens at a time and, when a backward
will follow, turns each chunk's logits into its gradient on the spot (the loss is the last
op of the graph, so its upstream gradient is a scalar g known to scale linearly)::

    loss_i   = lse_i - z_i[y_i],          z_i = W h_i,  lse_i = log sum_v exp(z_iv)
    dL/dz_i  = g * (softmax(z_i) - onehot(y_i))
    dL/dh_i  = dL/dz_i @ W,               dL/dW = sum_i dL/dz_i^T h_i

Forward keeps dL/dh (N x H) and, for a trainable head, dL/dW (V x H, fp32) at g = 1;
backward only multiplies them by g. So the head's matmul runs once (no recompute in backward:
the same matmul count as plain cross-entropy on full logits) and nothing [N, V] is ever kept.
Within a chunk every step is in place (shift, exp, normalise, subtract the one-hot) on one
[chunk_size, V] fp32 block, freed before the next chunk: peak extra memory is one such block
(1.5 under bf16 autocast, where the matmul output and its fp32 copy briefly coexist), measured
in ``tests/test_losses.py``. ``chunk_size=None`` (default) picks the rows from the vocabulary so
that the block is about 64 MiB on an accelerator (2048 rows at V = 8192, i.e. one chunk per
2k-token micro-batch: plain cross-entropy with a fused gradient; 128 rows at V = 128k) and about
512 MiB on CPU (1024 rows at V = 128k): every chunk reads the whole [V, H] head twice and the CPU
BLAS packs it again for each of its two GEMMs, so 128-row chunks ran the 128k head 1.42x slower
than one chunk of 768 rows (3.28 vs 2.31 s for 768 tokens, 2 threads, ``benchmarks/NOTES.md``). On CPU
the fp32 block is laid out (V, chunk), computed as ``W @ h^T`` (faster in MKL than ``h @ W^T``: 755 vs
940+ ms at V = 128k; see ``_vocab_major``), with the softmax along its first dimension, in two passes over the block for fp32 on an AVX2
CPU (``ftlib.kernels.xent_block_``: 197 -> 58 ms for a 131072 x 767 block, 2 threads, against the
five passes of the PyTorch ops). Without a backward (eval,
``torch.no_grad()``) no gradient is computed. Tokens without a label are dropped before any
matmul. The same idea as Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, "Liger
Kernel: Efficient Triton Kernels for LLM Training"), which also computes the gradient in forward.

The model's loss. ``causal_lm_loss(model, batch)`` runs an ftlib causal LM's decoder on a batch
(the batch contract of ``ftlib.data``: ``input_ids``, ``labels`` and the packing / padding keys)
and applies the chunked loss to its hidden states and LM head, so the [B, T, V] logits never
exist. ``CausalLMLoss(model)`` is the same as a module, ``batch -> (loss_sum, num_tokens)``: the
module a training loop wraps with DDP or FSDP2, since gradients are only synchronised for a
forward that runs through the wrapper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftlib.kernels.linear import linear_nograd
from ftlib.kernels.xent_block import xent_block_, xent_block_backend

__all__ = ["BATCH_KEYS", "CausalLMLoss", "IGNORE_INDEX", "auto_chunk_size", "bradley_terry_loss",
           "causal_lm_loss", "chunked_cross_entropy", "count_target_tokens", "cross_entropy_sum", "head_weight"]

IGNORE_INDEX = -100
BATCH_KEYS = ("position_ids", "cu_seqlens", "max_seqlen", "attention_mask")  # the batch contract of ftlib.data.collate


def _check_labels(labels: torch.Tensor, lead_shape: torch.Size, what: str) -> None:
    if labels.ndim != 2 or labels.shape != lead_shape:
        raise ValueError(f"labels must be [B, T] matching {what} {tuple(lead_shape)}, got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}")


def count_target_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of tokens that carry a loss under the shift convention: (labels[:, 1:] != -100).sum()."""
    return (labels[:, 1:] != ignore_index).sum()


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``labels[:, 1:]`` under ``logits[:, :-1]`` and the target count.

    logits [B, T, V] (any float dtype; half types computed in fp32), labels [B, T] aligned with
    input_ids. Returns (loss_sum fp32 (fp64 for fp64 logits) 0-d, num_tokens int64 0-d).
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    _check_labels(labels, logits.shape[:2], "logits")
    vocab = logits.shape[-1]
    z = logits[:, :-1].reshape(-1, vocab)  # (B*(T-1), V)
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # fp32 softmax for half inputs
    y = labels[:, 1:].reshape(-1).long()
    loss = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")
    return loss, (y != ignore_index).sum()


_BLOCK_BYTES = 64 << 20  # the [chunk, V] fp32 block chunk_size=None aims at on an accelerator
_CPU_BLOCK_BYTES = 512 << 20  # on CPU: fewer re-reads (and BLAS re-packs) of the head, in host memory


def auto_chunk_size(vocab: int, device_type: str = "cuda") -> int:
    """Rows per chunk for a [rows, V] fp32 block of ~64 MiB (~512 MiB when ``device_type`` is "cpu"):
    a power of two in [128, 8192]."""
    budget = _CPU_BLOCK_BYTES if device_type == "cpu" else _BLOCK_BYTES
    rows = max(1, budget // (4 * max(1, vocab)))
    return int(min(8192, max(128, 1 << (rows.bit_length() - 1))))


def _vocab_major(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the loss's [chunk, V] block is laid out as (V, chunk): for fp32/fp64 matmuls on CPU,
    where ``W @ h^T`` runs faster than ``h @ W^T`` (MKL, 2 cores, C = 768, V = 131072, H = 512: 755
    vs 940-1190 ms; the gradient's ``z^T W`` 630 vs 645-750 ms) and the softmax passes along V cost
    about the same either way. Elsewhere (accelerators, bf16/fp16 matmuls) the block stays (chunk, V).
    The block's rows are padded to a multiple of 16 columns (zero rows of h, sliced off before the
    softmax): with 767 or 771 columns the same product took 2,270 ms against 1,540 for 768 or 784
    (one core), the unaligned output rows costing a third."""
    return device_type == "cpu" and dtype in (torch.float32, torch.float64)


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, y, chunk_size, dtype, need_h, need_w, softcap=None):
        # h (N, H) target tokens only, weight (V, H), y (N,); matmuls in `dtype`, softmax in fp32 (fp64 stays)
        acc = torch.promote_types(dtype, torch.float32)
        n = h.shape[0]
        total = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        # (V, H) accumulator in fp32: summing many chunks in bf16 would lose the small updates
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        # autocast off: the matmuls run in `dtype` explicitly (autocast's dtype when it was on)
        tr = _vocab_major(h.device.type, dtype)
        with torch.autocast(device_type=h.device.type, enabled=False):
            w = weight.to(dtype)  # (V, H): converted once, not per chunk (a [V, H] copy each)
            for s in range(0, n, chunk_size):
                hc = h[s : s + chunk_size].to(dtype)  # (C, H)
                yc = y[s : s + chunk_size]
                if tr:  # the block as (V, C): W (V, H) @ hc^T, C padded to a multiple of 16 (see _vocab_major)
                    pad = -hc.shape[0] % 16
                    hp = torch.cat([hc, hc.new_zeros(pad, hc.shape[1])]) if pad else hc
                    # on oneDNN where torch has it (ftlib.kernels.linear: 1.8x MKL here); the gradient's
                    # z^T W stays on MKL, which beat oneDNN's layouts of it short of a [H, V] copy of W
                    z, d, yc = linear_nograd(w, hp)[:, : hc.shape[0]], 0, yc[None, :]
                else:  # as (C, V): hc @ W^T
                    z, d, yc = hc @ w.t(), 1, yc[:, None]
                if z.dtype != acc:
                    z = z.to(acc)  # the `dtype` block is freed here: 1.5 blocks at most
                if softcap is not None:  # z <- c tanh(z / c) (Gemma-2); its derivative 1 - tanh^2 kept for the gradient
                    z.div_(softcap).tanh_()
                    dcap = 1.0 - z * z if need_h or need_w else None
                    z.mul_(softcap)
                z_y = z.gather(d, yc)  # label logits, before z is overwritten
                if softcap is None and tr and xent_block_backend(z) == "cpu":  # two passes over the block, not five
                    total += (xent_block_(z, yc[0], need_h or need_w) - z_y[0]).sum()
                else:
                    m = z.amax(dim=d, keepdim=True)
                    z.sub_(m).exp_()  # exp(z - max), in place
                    total_c = z.sum(dim=d, keepdim=True)
                    total += (m + total_c.log() - z_y).sum()  # sum of lse - z_y
                    if need_h or need_w:
                        z.div_(total_c)  # softmax
                        z.scatter_add_(d, yc, torch.full_like(z_y, -1.0))  # dL/dz = softmax - onehot(y), at g = 1
                        if softcap is not None:
                            z.mul_(dcap)  # through the cap
                            del dcap
                zc = z.t() if tr else z  # (C, V)
                if need_h or need_w:
                    if need_h:
                        grad_h[s : s + chunk_size] = (zc.to(dtype) @ w).to(h.dtype)
                    if need_w:
                        grad_w.addmm_(zc.t(), hc.to(acc))  # (V, C) @ (C, H)
                del z, zc  # before the next chunk's block is allocated
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None and ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_out.to(grad_w.dtype)).to(ctx.weight_dtype) if grad_w is not None and ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy_sum(hidden @ lm_head_weight.T, labels)`` without [B, T, V] logits.

    ``softcap`` c: the logits are ``c * tanh(z / c)`` first (Gemma-2's ``final_logit_softcapping``).

    hidden [B, T, H] (the final-norm output), lm_head_weight [V, H], labels [B, T] aligned with
    input_ids (same shift as :func:`cross_entropy_sum`). Matmuls run in the autocast dtype
    when autocast is on (else the inputs' common dtype), softmax in fp32. ``chunk_size``: target
    tokens per [chunk, V] block (None: :func:`auto_chunk_size` of V and the device). When grad mode is on and an
    input requires grad, the gradient is computed here and ``backward`` only scales it (see the
    module docstring). Returns (loss_sum fp32 0-d, num_tokens int64 0-d). The count was read to the
    host anyway, so it comes back as a CPU tensor (usable with device tensors like a number): the
    optimizer then knows a window's token count without another device sync.
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"lm_head_weight must be [V, {hidden.shape[2]}] for hidden size {hidden.shape[2]}, "
            f"got {tuple(lm_head_weight.shape)}"
        )
    if chunk_size is None:
        chunk_size = auto_chunk_size(lm_head_weight.shape[0], hidden.device.type)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_labels(labels, hidden.shape[:2], "hidden")
    y = labels[:, 1:].reshape(-1).long()
    target = y != ignore_index
    # One host read per call (a device sync on CUDA): the target count, which sizes everything below,
    # and the number of out-of-range labels, read together
    bad = target & ((y < 0) | (y >= lm_head_weight.shape[0]))
    n_target = target.sum()
    n, n_bad = torch.stack([n_target, bad.sum()]).tolist()
    if n_bad:
        raise ValueError(f"labels must be in [0, {lm_head_weight.shape[0]}) or {ignore_index}")
    # (N,) positions with a target, in order, without nonzero's second sync: a stable sort puts them first
    keep = torch.argsort((~target).to(torch.uint8), stable=True)[:n]
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, keep)  # (N, H)
    # the matmul dtype: autocast's when active (as nn.Linear would run), else the wider input's
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
    else:
        dtype = torch.promote_types(h.dtype, lm_head_weight.dtype)
    y = y.index_select(0, keep)
    grads = torch.is_grad_enabled()
    need_h, need_w = grads and hidden.requires_grad, grads and lm_head_weight.requires_grad
    loss = _ChunkedCE.apply(h, lm_head_weight, y, int(chunk_size), dtype, need_h, need_w,
                            None if softcap is None else float(softcap))
    return loss, torch.tensor(n, dtype=torch.int64)


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise reward-model loss, summed: ``sum_i -log sigmoid(r_c,i - r_r,i - m_i)`` and the pair count.

    Bradley-Terry (Bradley & Terry 1952): P(chosen preferred) = sigmoid(r_c - r_r), the reward-model
    objective of InstructGPT (Ouyang et al. 2022); the optional margin m (a float or a [N] tensor)
    is Llama 2's (Touvron et al. 2023, eq. 2): a clearer preference must win by more. Computed as
    -logsigmoid(d - m) in fp32 (fp64 stays fp64), stable for any |d|. ``chosen``, ``rejected``: scores
    [N]. Returns (loss_sum 0-d, num_pairs int64 0-d), ready for ``TrainOptimizer.backward``.
    """
    if chosen.shape != rejected.shape or chosen.ndim != 1:
        raise ValueError(f"chosen and rejected must be [N] score vectors of one shape, got "
                         f"{tuple(chosen.shape)} and {tuple(rejected.shape)}")
    acc = torch.promote_types(torch.promote_types(chosen.dtype, rejected.dtype), torch.float32)
    d = chosen.to(acc) - rejected.to(acc)
    if margin is not None:
        m = torch.as_tensor(margin, dtype=acc, device=d.device)
        if m.ndim not in (0, 1) or (m.ndim == 1 and m.shape != d.shape):
            raise ValueError(f"margin must be a float or a [{d.shape[0]}] tensor, got shape {tuple(m.shape)}")
        d = d - m
    return -F.logsigmoid(d).sum(), torch.tensor(d.shape[0], dtype=torch.int64, device=d.device)


def head_weight(lm_head: torch.nn.Module) -> torch.Tensor:
    """The [V, H] weight the chunked losses multiply the hidden states by: ``lm_head.weight`` of a plain
    linear head, the adapted ``W + s B A`` of a LoRA-wrapped one (``LoRALinear.effective_weight``:
    gradients reach the adapter). A head with a bias is refused: the chunked losses take no bias."""
    fn = getattr(lm_head, "effective_weight", None)
    if callable(fn):
        return fn()
    w = getattr(lm_head, "weight", None)
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        raise TypeError(f"head_weight: {type(lm_head).__name__} has no [V, H] weight; pass a linear head")
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("head_weight: the LM head has a bias, which the chunked losses do not add")
    return w


def causal_lm_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss, target tokens) of an ftlib causal LM on a batch, without [B, T, V] logits."""
    hidden = model.model(batch["input_ids"], **{k: batch[k] for k in BATCH_KEYS if k in batch})
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return chunked_cross_entropy(hidden, head_weight(model.lm_head), batch["labels"], softcap=cap)


class CausalLMLoss(torch.nn.Module):
    """``batch -> (summed token loss, target-token count)`` of ``model``, without [B, T, V] logits.

    The module a loop wraps for several ranks (``DistributedDataParallel``, ``wrap_ddp``,
    ``shard_model``): gradients are averaged or reduced only for a forward that runs through the
    wrapper. Divide the sum by the target tokens of the whole accumulation window (on all ranks),
    as ``ftlib.optim.TrainOptimizer.backward`` does.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_lm_loss(self.model, batch)
