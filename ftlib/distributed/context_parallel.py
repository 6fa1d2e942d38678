"""Context parallelism: one long packed sequence sharded along its length over a process group.

Layout ("zigzag", causal load balance). The packed row of T tokens (padded to a multiple of 2P
with a label-free document of its own) is cut into 2P chunks of c = T / 2P tokens; rank r of P
holds chunks r and 2P-1-r, so under the causal mask every rank has the same number of
(query, key) pairs to score: chunk r sees r+1 chunks, chunk 2P-1-r sees 2P-r, together 2P+1.
RoPE positions stay global (each token keeps its position inside its document, as in one
process) and the labels are shifted before sharding (the target of token t is token t+1, which
may live on another rank), so each rank's loss covers exactly its own tokens.

Attention. Every layer all-gathers K and V over the group (``all_gather_into_tensor``), so every
rank holds the whole sequence's keys and no log-sum-exp merge across blocks is needed: for each
local chunk [c0, c1) and each packed document [d0, d1) that meets it, the queries are
doc ∩ chunk = [max(d0, c0), min(d1, c1)) and the keys [d0, min(d1, c1)) (with a sliding window W,
from max(d0, q0 - W + 1): no key before it is in any of those queries' windows). Query and key
segments END at the same global position, so with positions counted from each segment's end

    query i of the segment sees key j   <=>   j <= i + (Tk - Tq)   (and j > i + (Tk - Tq) - W)

is the causal (and window) mask on global indices, which is exactly varlen attention with separate
``cu_seqlens_q`` / ``cu_seqlens_k`` and bottom-right-aligned causal (flash-attn's
``flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)``): one call of
``ftlib.kernels.attention`` per layer (flash-attn, the Triton kernel, SDPA, each by the op's own
backend choice) on the local queries [2c, Hq, D] against the keys of the segments, gathered by one
``index_select`` of the all-gathered rows ([<= (2P + 1) c, Hkv, D]: the chunk of rank r sees
(r + 1) c keys at most, its mirror (2P - r) c). The segment boundaries and that row index are built
on the host once per batch and window (``_segment_plan``, cached on the layout): no device sync per
layer. Documents crossing chunk (and rank) boundaries are exact because the segments are cut on
global positions; the kernels skip the key tiles above each pair's diagonal and outside its window.
Backward is the kernel's (dQ, and dK, dV of the segments' rows, which the ``index_select``'s
backward sums into the gathered rows); the all-gather's backward (``_AllGather``) is their
reduce-scatter (``reduce_scatter_tensor``, summed), so each rank gets the gradient of the keys and
values it owns from every rank's queries.

Why all-gather rather than a ring of P2P sends (``batch_isend_irecv``): with GQA the gathered K/V
are small (Llama-3.1-8B: 2 x 8 x 128 x 2 bytes = 4 KiB a token against 16 KiB for one layer's
bf16 q and output), one collective per layer instead of 2P - 1 dependent steps, and a document
mask over global indices needs no per-step bookkeeping; it is the choice of Llama 3's context
parallelism (Dubey et al. 2024, section 3.3.2, for the same two reasons). The cost is the whole
sequence's K/V of one layer existing at once (4 KiB a token, recomputed under checkpointing);
a ring would keep two blocks. The zigzag is ring-flash-attention's load balance (Zhu 2024), with
the blocks arriving by one all-gather instead of a ring (Liu et al. 2023, "Ring Attention with
Blockwise Transformers").

Memory per layer (the attention alone, bf16, Hkv heads of D, 2c local tokens, T = 2Pc): the
gathered K/V (2 T Hkv D 2 bytes), the segments' K/V (<= 2 (2P + 1) c Hkv D 2 bytes), O and the
fp32 lse (2c Hq); no [2c, T] score tensor exists (the kernels keep their tiles in registers /
shared memory; SDPA, the CPU path, holds one segment pair's scores at a time).

Why not ``torch.distributed.tensor.experimental.context_parallel``: it serves plain causal SDPA
(``F.scaled_dot_product_attention`` with ``is_causal=True``, patched while the context manager is
open, buffers sharded in place with its own load balancer). ftlib's packed batches need the
varlen document mask (its SDPA path would have to carry a dense [T, T] mask), and on a GPU the
model's attention goes through flash-attn / ftlib's Triton varlen kernel, not SDPA; so ftlib
shards and masks itself, on torch.distributed's collectives.

How it reaches the model. ``BatchPlan.attend`` in ``ftlib.models.llama`` is the one place that
calls the attention op (the module's ``attention`` name). The model runs on the local shard as a
packed batch of one segment, ``cu_seqlens = shard_segments(layout)`` ([0, 2c], int32), with the
global positions given, so ``BatchPlan`` and every block stay as they are. That tensor is the
marker: the first ``shard_segments`` call wraps ``llama.attention`` once in a dispatcher that sends
calls whose ``cu_seqlens`` is a live marker to the zigzag attention and every other call to the op
as before. The marker lives in the batch plan, so the recomputation of a checkpointed block in
backward (``set_gradient_checkpointing``, ``ftlib.long_context.offload_checkpoints``), long after the
forward returned, attends over the ring again; a context manager open around the forward only
would leave it attending locally, silently. A marked call that is not the shard's causal
self-attention (another length, a key padding mask) raises.

    group, g = context_groups(4)                      # 4 ranks a sequence; group g takes sequence g
    train = shard_model(ContextParallelLMLoss(model))  # FSDP2 over every rank (optional)
    shard = zigzag_shard(batch_of_group_g, group)      # {input_ids, position_ids, targets, layout} of this rank
    loss_sum, n = train(shard)                         # this rank's tokens' summed loss and count
    opt.backward(loss_sum, n)                          # TrainOptimizer: n all-reduced, FSDP2's average undone
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels import attention
from ..losses import IGNORE_INDEX, chunked_cross_entropy, head_weight

__all__ = [
    "ContextParallelLMLoss",
    "ZigzagLayout",
    "context_groups",
    "context_parallel_attention",
    "context_parallel_loss",
    "shard_segments",
    "sum_gradients",
    "zigzag_indices",
    "zigzag_shard",
]


def zigzag_indices(total: int, world: int, rank: int) -> torch.Tensor:
    """Global token indices (int64 [2c]) rank ``rank`` of ``world`` holds: chunks r and 2P-1-r of c = total / 2P."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"zigzag_indices: rank {rank} is not in a group of {world}")
    if total % (2 * world):
        raise ValueError(f"zigzag_indices: {total} tokens do not split into 2 x {world} equal chunks")
    c = total // (2 * world)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * world - 1 - rank) * c,
                                                                           (2 * world - rank) * c)])


@dataclass
class ZigzagLayout:
    """Where this rank's tokens sit in the packed sequence, the same on every rank but ``rank``.

    ``doc`` int64 [T]: the document id of every global token (padding is a document of its own);
    ``total`` = T (padded), ``pad`` the padding tokens added at the end, ``group`` the process group
    (None: the default group; ``world == 1`` runs without collectives).
    """

    total: int
    world: int
    rank: int
    doc: torch.Tensor
    pad: int = 0
    group: object = None
    _plans: dict = field(default_factory=dict, repr=False, compare=False)  # (window, device) -> _SegmentPlan

    @property
    def chunk(self) -> int:
        return self.total // (2 * self.world)

    def indices(self, rank: int | None = None) -> torch.Tensor:
        """Global indices of ``rank``'s tokens (default this rank's), int64 [2c]."""
        return zigzag_indices(self.total, self.world, self.rank if rank is None else rank)

    def gathered_indices(self) -> torch.Tensor:
        """Global indices of the all-gathered rows: rank-major, each rank's 2c tokens in its own order."""
        return torch.cat([self.indices(r) for r in range(self.world)])


def _group_size_rank(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def zigzag_shard(batch: dict, group=None, *, world: int | None = None, rank: int | None = None) -> dict:
    """This rank's share of a one-row packed batch, with the labels shifted and the positions global.

    ``batch``: ``input_ids`` [1, T], ``labels`` [1, T] (aligned with input_ids, -100 = no loss),
    optional ``cu_seqlens`` (int [n_docs + 1], default one document) and ``position_ids`` [1, T]
    (default: restarting at 0 per document). ``world``/``rank`` default to ``group``'s (pass them to
    shard without a process group, e.g. in tests). Returns ``input_ids``, ``position_ids`` and
    ``targets`` [1, 2c] (``targets[t]`` is the global ``labels[t + 1]``: no shift left to do) and
    ``layout`` (:class:`ZigzagLayout`). T is padded to a multiple of 2P with a document of label -100.
    """
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if ids is None or labels is None:
        raise ValueError("zigzag_shard: the batch needs input_ids and labels")
    if ids.dim() != 2 or ids.shape[0] != 1 or labels.shape != ids.shape:
        raise ValueError(f"zigzag_shard: input_ids and labels must be one packed row [1, T], got "
                         f"{tuple(ids.shape)} and {tuple(labels.shape)}")
    for key in ("attention_mask",):
        if key in batch:
            raise ValueError(f"zigzag_shard: a padded batch ({key}) is not a packed row; pack it (cu_seqlens)")
    if world is None or rank is None:
        world, rank = _group_size_rank(group)
    t = ids.shape[1]
    total = -(-t // (2 * world)) * 2 * world
    pad = total - t
    cu = batch.get("cu_seqlens")
    cu = torch.tensor([0, t]) if cu is None else cu.to(device="cpu", dtype=torch.int64)
    if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != t or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"zigzag_shard: cu_seqlens must rise from 0 to T={t}, got {cu.tolist()[:8]}")
    if pad:
        cu = torch.cat([cu, torch.tensor([total])])
    idx = torch.arange(total)
    doc = torch.searchsorted(cu, idx, right=True) - 1
    pos = batch.get("position_ids")
    if pos is None:
        pos = (idx - cu[doc]).view(1, total)
    elif pad:
        pos = torch.cat([pos.cpu(), torch.arange(pad).view(1, pad)], dim=1)
    targets = torch.cat([labels[:, 1:], labels.new_full((1, 1 + pad), IGNORE_INDEX)], dim=1)
    ids = torch.cat([ids, ids.new_zeros((1, pad))], dim=1) if pad else ids
    layout = ZigzagLayout(total, world, rank, doc, pad, group)
    local = layout.indices().to(ids.device)
    return {"input_ids": ids[:, local], "position_ids": pos.to(ids.device)[:, local],
            "targets": targets[:, local], "layout": layout}


class _AllGather(torch.autograd.Function):
    """Forward: the group's [n, ...] tensors, rank-major [P n, ...]; backward: their gradients' reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // ctx.world, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


def _chunk_id(world: int, rank: int, half: int) -> int:
    """The global chunk id of ``rank``'s first (``half`` 0: chunk r) or second (1: chunk 2P-1-r) chunk."""
    return rank if half == 0 else 2 * world - 1 - rank


def _segment_plan(layout: ZigzagLayout, window: int | None) -> list[tuple[int, int, int, int, int]]:
    """(half, q0, q1, k0, k1) global positions of every query segment of this rank, in local row order.

    Queries [q0, q1) = document ∩ chunk, keys [k0, k1) with k1 = q1 (the segments end together: the
    bottom-right causal alignment is the global causal mask) and k0 the document's start, or with a
    window W the first key any of the queries can see, max(d0, q0 - W + 1).
    """
    doc, c = layout.doc, layout.chunk
    cuts = (torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, layout.total]
    plan = []
    for half in range(2):
        c0 = _chunk_id(layout.world, layout.rank, half) * c
        c1 = c0 + c
        for d0, d1 in zip(bounds, bounds[1:]):
            q0, q1 = max(d0, c0), min(d1, c1)
            if q1 > q0:
                k0 = d0 if window is None else max(d0, q0 - window + 1)
                plan.append((half, q0, q1, k0, q1))
    return plan


@dataclass
class _SegmentPlan:
    """The attention call of one layout and window: query / key segments and the gathered rows of the keys."""

    cu_q: torch.Tensor  # int32 [S + 1] over the 2c local rows
    cu_k: torch.Tensor  # int32 [S + 1] over the rows of ``rows``
    rows: torch.Tensor  # int64 [Nk]: the all-gathered row of every key of every segment
    max_q: int
    max_k: int


def _plan(layout: ZigzagLayout, window: int | None, device) -> _SegmentPlan:
    """``_segment_plan`` as tensors on ``device``, built on the host once per layout and window."""
    key = (window, str(device))
    hit = layout._plans.get(key)
    if hit is not None:
        return hit
    plan = _segment_plan(layout, window)
    where = torch.empty(layout.total, dtype=torch.int64)  # global position -> all-gathered row
    where[layout.gathered_indices()] = torch.arange(layout.total)
    lq = [q1 - q0 for _, q0, q1, _, _ in plan]
    lk = [k1 - k0 for _, _, _, k0, k1 in plan]
    if sum(lq) != 2 * layout.chunk:
        raise AssertionError(f"context parallel: the segments cover {sum(lq)} of the {2 * layout.chunk} local rows")
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    rows = torch.cat([where[k0:k1] for _, _, _, k0, k1 in plan])
    out = _SegmentPlan(cu(lq).to(device), cu(lk).to(device), rows.to(device), max(lq), max(lk))
    layout._plans[key] = out
    return out


def context_parallel_attention(q, k, v, layout: ZigzagLayout, *, softmax_scale=None, sliding_window=None,
                               softcap=None, gather=None):
    """Causal varlen attention of this rank's 2c queries over the whole sharded sequence (module doc).

    q [2c, Hq, D], k/v [2c, Hkv, D] (this rank's tokens, ``zigzag_shard`` order). ``gather``: how
    K/V of all ranks are collected (default: the differentiable all-gather over ``layout.group``;
    tests pass the concatenation of every rank's tensors to run the layout in one process).
    """
    n = 2 * layout.chunk
    if q.dim() != 3 or q.shape[0] != n or k.shape[0] != n or k.shape != v.shape:
        raise ValueError(f"context_parallel_attention: q, k, v must be this rank's {n} tokens [N, H, D], "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"context_parallel_attention: {q.shape[1]} query heads are not a multiple of "
                         f"{k.shape[1]} key/value heads")
    if gather is None:
        if layout.world == 1:
            k_all, v_all = k, v
        else:
            k_all = _AllGather.apply(k, layout.group, layout.world)
            v_all = _AllGather.apply(v, layout.group, layout.world)
    else:
        k_all, v_all = gather(k), gather(v)
    plan = _plan(layout, sliding_window, q.device)
    # (Nk, Hkv, D): each segment's keys, rows of the gathered sequence (the first chunk's repeated in the mirror's)
    ks, vs = k_all.index_select(0, plan.rows), v_all.index_select(0, plan.rows)
    return attention(q, ks, vs, causal=True, cu_seqlens=plan.cu_q, max_seqlen=plan.max_q, cu_seqlens_k=plan.cu_k,
                     max_seqlen_k=plan.max_k, softmax_scale=softmax_scale, sliding_window=sliding_window,
                     softcap=softcap)


_SHARDS = WeakIdKeyDictionary()  # marker cu_seqlens tensor -> layout
_LIVE = [0]  # markers alive: a plain int, readable under torch.compile (the dictionary is not)


def _forget(_cu_id: int) -> None:
    _LIVE[0] -= 1


def _install_dispatch() -> None:
    """Wrap ``ftlib.models.llama.attention`` once: marked calls go to the zigzag attention, the others through."""
    from ..models import llama

    if getattr(llama.attention, "zigzag_dispatch", False):
        return
    inner = llama.attention

    def attention(q, k, v, *, causal=True, cu_seqlens=None, max_seqlen=None, softmax_scale=None,
                  key_padding_mask=None, sliding_window=None, softcap=None):
        if torch.compiler.is_compiling():  # dynamo cannot look markers up: no shard may be alive then
            if _LIVE[0]:
                raise RuntimeError("context parallel does not run under torch.compile (a shard_segments marker "
                                   "is alive): train the sharded model eagerly")
            entry = None
        else:
            entry = _SHARDS.get(cu_seqlens) if cu_seqlens is not None else None
        if entry is None:
            return inner(q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
                         sliding_window=sliding_window, softcap=softcap)
        layout = entry
        n = 2 * layout.chunk
        if not causal or key_padding_mask is not None or q.dim() != 3 or q.shape[0] != n:
            raise RuntimeError(f"context parallel: the model attended over {tuple(q.shape)} (causal={causal}, key "
                               f"mask {key_padding_mask is not None}); the shard is {n} tokens in one packed row")
        return context_parallel_attention(q, k, v, layout, softmax_scale=softmax_scale, sliding_window=sliding_window,
                                          softcap=softcap)

    attention.zigzag_dispatch = True
    attention.__doc__ = f"{inner.__doc__ or ''}\n\n(ftlib.distributed.context_parallel: shard_segments markers " \
                        f"go to the zigzag attention.)"
    llama.attention = attention


def shard_segments(layout: ZigzagLayout, device=None) -> torch.Tensor:
    """The ``cu_seqlens`` ([0, 2c] int32) to run this rank's shard with: ftlib's decoder then attends over the
    whole sharded sequence (module doc), in forward and in any recomputation of it in backward."""
    n = 2 * layout.chunk
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    _install_dispatch()
    _SHARDS[cu] = layout
    _LIVE[0] += 1
    weakref.finalize(cu, _forget, id(cu))
    return cu


def context_parallel_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss, target count) of this rank's tokens of a ``zigzag_shard`` batch, as ``causal_lm_loss``.

    Summed over the group both are the one-process ``causal_lm_loss``'s. So a loop treats the ranks
    of a sequence like data-parallel ranks: ``TrainOptimizer.backward(loss, n)`` (which all-reduces n
    and scales for gradients averaged by FSDP2 / DDP), or without a wrapper
    ``(loss / n_all).backward()`` then :func:`sum_gradients`.
    """
    layout, ids, targets = batch["layout"], batch["input_ids"], batch["targets"]
    n = ids.shape[1]
    cu = shard_segments(layout, ids.device)
    hidden = model.model(ids, position_ids=batch["position_ids"], cu_seqlens=cu, max_seqlen=n)
    # chunked_cross_entropy shifts (hidden[:, :-1] predicts labels[:, 1:]): one label-free row in front of the
    # targets and one hidden row after the shard's make that shift the identity
    hidden = torch.cat([hidden, hidden.new_zeros(1, 1, hidden.shape[-1])], dim=1)
    labels = torch.cat([targets.new_full((1, 1), IGNORE_INDEX), targets], dim=1)
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    loss, _ = chunked_cross_entropy(hidden, head_weight(model.lm_head), labels, softcap=cap)
    return loss, (targets != IGNORE_INDEX).sum().to(torch.int64).cpu()


class ContextParallelLMLoss(torch.nn.Module):
    """``shard -> context_parallel_loss(model, shard)`` as a module: the one FSDP2 wraps (``shard_model``),
    as ``ftlib.losses.CausalLMLoss`` is for whole sequences (the head's weight is read inside its forward)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, shard: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return context_parallel_loss(self.model, shard)


def context_groups(size: int):
    """(this rank's context group, its index among the groups) for consecutive groups of ``size`` ranks:
    ranks [g size, (g + 1) size) share a sequence, the G = world / size groups take different ones
    (data parallel across groups; FSDP2 may shard over all ranks). Every rank must call it (new_group)."""
    world, rank = _group_size_rank(None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"context_groups: size must divide the world size {world}, got {size!r}")
    mine = None
    for g in range(world // size):
        group = dist.new_group(list(range(g * size, (g + 1) * size)))
        if g == rank // size:
            mine = group
    return mine, rank // size


def sum_gradients(params, group=None) -> None:
    """All-reduce (sum) the ``.grad`` of every parameter that has one over ``group``: each rank holds
    the gradient of its own tokens' loss, the one-process gradient is their sum. No-op on one rank."""
    if _group_size_rank(group)[0] == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
