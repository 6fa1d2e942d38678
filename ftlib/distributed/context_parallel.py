"""Context parallelism: one long packed sequence sharded along its length over a process group.

Layout ("zigzag", causal load balance). The packed row of T tokens (padded to a multiple of 2P
with a label-free document of its own) is cut into 2P chunks of c = T / 2P tokens; rank r of P
holds chunks r and 2P-1-r, so under the causal mask every rank has the same number of
(query, key) pairs to score: chunk r sees r+1 chunks, chunk 2P-1-r sees 2P-r, together 2P+1.
RoPE positions stay global (each token keeps its position inside its document, as in one
process) and the labels are shifted before sharding (the target of token t is token t+1, which
may live on another rank), so each rank's loss covers exactly its own tokens.

Attention. Every layer all-gathers K and V over the group (``all_gather_into_tensor``) and each
rank attends with its 2c local queries over the whole sequence's keys, block by block: for each
local query chunk a and each of the 2P gathered key chunks b with chunk id(b) <= id(a) (the
blocks the causal mask leaves visible), the partial result over that block is

    s_ij   = scale * <q_i, k_j>        (softcap c: c * tanh(s_ij / c)),   j visible from i:
             j <= i,  doc(j) == doc(i),  (sliding window W: j > i - W)       (global indices)
    lse_b  = log sum_j exp(s_ij),      o_b = sum_j exp(s_ij - lse_b) v_j

and the partials merge exactly by their log-sum-exps (online softmax):

    lse = log(exp(lse_1) + exp(lse_2)),   o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2.

Documents crossing chunk (and rank) boundaries are exact because the mask is written on global
token indices and document ids; tiles no query of which can see a key (other documents, the
window) are skipped. Grouped-query attention views the Hq query heads as [Hkv, Hq / Hkv]; K and V
are never repeated. Backward (``_ZigzagAttention``) recomputes each tile's probabilities from the
saved final lse (no T x T tensor is kept: Dao 2023, FlashAttention-2, Algorithm 2) and returns
dK, dV for the whole gathered sequence; the all-gather's backward (``_AllGather``) is their
reduce-scatter (``reduce_scatter_tensor``, summed), so each rank gets the gradient of the keys and
values it owns from every rank's queries.

Why all-gather rather than a ring of P2P sends (``batch_isend_irecv``): with GQA the gathered K/V
are small (Llama-3.1-8B: 2 x 8 x 128 x 2 bytes = 4 KiB a token against 16 KiB for one layer's
bf16 q and output), one collective per layer instead of 2P - 1 dependent steps, and a document
mask over global indices needs no per-step bookkeeping; it is the choice of Llama 3's context
parallelism (Dubey et al. 2024, section 3.3.2, for the same two reasons). The cost is the whole
sequence's K/V of one layer existing at once (4 KiB a token, recomputed under checkpointing);
a ring would keep two blocks. The block loop and its lse merge are the same as ring attention
(Liu et al. 2023, "Ring Attention with Blockwise Transformers"; zigzag: Zhu 2024,
ring-flash-attention), with the blocks arriving by one all-gather instead of a ring.

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

The block math here is PyTorch (float32 scores, float64 stays float64), tiled by ``tile`` rows
each way: exact and O(tile^2) memory, the test oracle of the layout; not a fused kernel.

    group, g = context_groups(4)                      # 4 ranks a sequence; group g takes sequence g
    train = shard_model(ContextParallelLMLoss(model))  # FSDP2 over every rank (optional)
    shard = zigzag_shard(batch_of_group_g, group)      # {input_ids, position_ids, targets, layout} of this rank
    loss_sum, n = train(shard)                         # this rank's tokens' summed loss and count
    opt.backward(loss_sum, n)                          # TrainOptimizer: n all-reduced, FSDP2's average undone
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

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


def _visible_blocks(world: int, rank: int) -> list[tuple[int, int]]:
    """(local query chunk 0|1, gathered key chunk 0..2P-1) pairs the causal mask leaves something of.

    Gathered chunk 2r' + s holds chunk id ``_chunk_id(P, r', s)``; a key chunk is visible from a
    query chunk when its id is not larger (equal: the diagonal block, causal inside). Rank r scores
    (r + 1) + (2P - r) = 2P + 1 blocks, the same on every rank: the zigzag's load balance.
    """
    return [(a, 2 * src + s) for a in range(2) for src in range(world) for s in range(2)
            if _chunk_id(world, src, s) <= _chunk_id(world, rank, a)]


def _tile_mask(qi, kj, qdoc, kdoc, window):
    """(tq, tk) bool: key j visible from query i (global indices): causal, same document, in the window."""
    m = (kj[None, :] <= qi[:, None]) & (kdoc[None, :] == qdoc[:, None])
    if window is not None:
        m &= kj[None, :] > qi[:, None] - window
    return m


def _tiles(layout: ZigzagLayout, tile: int, window, device):
    """(q rows, k rows, mask) of every tile that has a visible pair: local query rows, gathered key rows."""
    c = layout.chunk
    q_idx, k_idx = layout.indices(), layout.gathered_indices()
    for a, b in _visible_blocks(layout.world, layout.rank):
        q0, k0 = a * c, b * c
        for qs in range(q0, q0 + c, tile):
            qr = slice(qs, min(qs + tile, q0 + c))
            qi = q_idx[qr]
            qd = layout.doc[qi]
            for ks in range(k0, k0 + c, tile):
                kr = slice(ks, min(ks + tile, k0 + c))
                kj = k_idx[kr]
                kd = layout.doc[kj]
                if int(kj[0]) > int(qi[-1]) or int(kd[0]) > int(qd[-1]) or int(kd[-1]) < int(qd[0]):
                    continue  # after every query, or no document in common
                if window is not None and int(kj[-1]) <= int(qi[0]) - window:
                    continue
                yield qr, kr, _tile_mask(qi, kj, qd, kd, window).to(device)


def _scores(q, k, scale, softcap, mask):
    """(Hkv, G, tq, tk) masked scores and, with a softcap, the capped ones' tanh for the backward."""
    s = torch.einsum("qhgd,khd->hgqk", q, k) * scale
    th = None
    if softcap is not None:
        th = torch.tanh(s / softcap)
        s = softcap * th
    return s.masked_fill(~mask, float("-inf")), th


class _ZigzagAttention(torch.autograd.Function):
    """o [2c, Hq, D] of the local queries over the gathered keys; backward recomputes tile by tile."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, layout, scale, window, softcap, tile):
        n, hq, d = q.shape
        hkv = k_all.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        qg = q.view(n, hkv, hq // hkv, d).to(acc)
        kf, vf = k_all.to(acc), v_all.to(acc)
        o = torch.zeros(n, hkv, hq // hkv, d, dtype=acc, device=q.device)
        lse = torch.full((hkv, hq // hkv, n), float("-inf"), dtype=acc, device=q.device)
        for qr, kr, mask in _tiles(layout, tile, window, q.device):
            s, _ = _scores(qg[qr], kf[kr], scale, softcap, mask)
            blk = torch.logsumexp(s, dim=-1)  # (Hkv, G, tq); -inf where the tile shows a row nothing
            p = torch.exp(s - torch.where(torch.isinf(blk), 0.0, blk)[..., None])
            ob = torch.einsum("hgqk,khd->qhgd", p, vf[kr])
            new = torch.logaddexp(lse[..., qr], blk)
            safe = torch.where(torch.isinf(new), 0.0, new)
            wa = torch.exp(lse[..., qr] - safe).permute(2, 0, 1)[..., None]  # (tq, Hkv, G, 1)
            wb = torch.exp(blk - safe).permute(2, 0, 1)[..., None]
            o[qr] = o[qr] * wa + ob * wb
            lse[..., qr] = new
        ctx.save_for_backward(q, k_all, v_all, o, lse)
        ctx.layout, ctx.scale, ctx.window, ctx.softcap, ctx.tile = layout, scale, window, softcap, tile
        return o.to(q.dtype).view(n, hq, d)

    @staticmethod
    def backward(ctx, grad):
        q, k_all, v_all, o, lse = ctx.saved_tensors
        n, hq, d = q.shape
        hkv = k_all.shape[1]
        acc = o.dtype
        qg = q.view(n, hkv, hq // hkv, d).to(acc)
        kf, vf = k_all.to(acc), v_all.to(acc)
        do = grad.reshape(n, hkv, hq // hkv, d).to(acc)
        delta = (do * o).sum(-1).permute(1, 2, 0)  # (Hkv, G, n): rowsum(dO * O)
        lse_safe = torch.where(torch.isinf(lse), 0.0, lse)
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kf), torch.zeros_like(vf)
        for qr, kr, mask in _tiles(ctx.layout, ctx.tile, ctx.window, q.device):
            s, th = _scores(qg[qr], kf[kr], ctx.scale, ctx.softcap, mask)
            p = torch.exp(s - lse_safe[..., qr, None])  # (Hkv, G, tq, tk), 0 where masked
            dv[kr] += torch.einsum("hgqk,qhgd->khd", p, do[qr])
            dp = torch.einsum("qhgd,khd->hgqk", do[qr], vf[kr])
            ds = p * (dp - delta[..., qr, None])
            if th is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2
                ds = ds * (1 - th * th)
            dq[qr] += torch.einsum("hgqk,khd->qhgd", ds, kf[kr]) * ctx.scale
            dk[kr] += torch.einsum("hgqk,qhgd->khd", ds, qg[qr]) * ctx.scale
        return (dq.view(n, hq, d).to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype),
                None, None, None, None, None)


def context_parallel_attention(q, k, v, layout: ZigzagLayout, *, softmax_scale=None, sliding_window=None,
                               softcap=None, tile: int = 512, gather=None):
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
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if gather is None:
        if layout.world == 1:
            k_all, v_all = k, v
        else:
            k_all = _AllGather.apply(k, layout.group, layout.world)
            v_all = _AllGather.apply(v, layout.group, layout.world)
    else:
        k_all, v_all = gather(k), gather(v)
    return _ZigzagAttention.apply(q, k_all, v_all, layout, float(scale), sliding_window, softcap, int(tile))


_SHARDS = WeakIdKeyDictionary()  # marker cu_seqlens tensor -> (layout, tile)


def _install_dispatch() -> None:
    """Wrap ``ftlib.models.llama.attention`` once: marked calls go to the zigzag attention, the others through."""
    from ..models import llama

    if getattr(llama.attention, "zigzag_dispatch", False):
        return
    inner = llama.attention

    def attention(q, k, v, *, causal=True, cu_seqlens=None, max_seqlen=None, softmax_scale=None,
                  key_padding_mask=None, sliding_window=None, softcap=None):
        entry = _SHARDS.get(cu_seqlens) if cu_seqlens is not None else None
        if entry is None:
            return inner(q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
                         sliding_window=sliding_window, softcap=softcap)
        layout, tile = entry
        n = 2 * layout.chunk
        if not causal or key_padding_mask is not None or q.dim() != 3 or q.shape[0] != n:
            raise RuntimeError(f"context parallel: the model attended over {tuple(q.shape)} (causal={causal}, key "
                               f"mask {key_padding_mask is not None}); the shard is {n} tokens in one packed row")
        return context_parallel_attention(q, k, v, layout, softmax_scale=softmax_scale, sliding_window=sliding_window,
                                          softcap=softcap, tile=tile)

    attention.zigzag_dispatch = True
    attention.__doc__ = f"{inner.__doc__ or ''}\n\n(ftlib.distributed.context_parallel: shard_segments markers " \
                        f"go to the zigzag attention.)"
    llama.attention = attention


def shard_segments(layout: ZigzagLayout, device=None, *, tile: int = 512) -> torch.Tensor:
    """The ``cu_seqlens`` ([0, 2c] int32) to run this rank's shard with: ftlib's decoder then attends over the
    whole sharded sequence (module doc), in forward and in any recomputation of it in backward."""
    n = 2 * layout.chunk
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    _install_dispatch()
    _SHARDS[cu] = (layout, int(tile))
    return cu


def context_parallel_loss(model, batch: dict, *, tile: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss, target count) of this rank's tokens of a ``zigzag_shard`` batch, as ``causal_lm_loss``.

    Summed over the group both are the one-process ``causal_lm_loss``'s. So a loop treats the ranks
    of a sequence like data-parallel ranks: ``TrainOptimizer.backward(loss, n)`` (which all-reduces n
    and scales for gradients averaged by FSDP2 / DDP), or without a wrapper
    ``(loss / n_all).backward()`` then :func:`sum_gradients`.
    """
    layout, ids, targets = batch["layout"], batch["input_ids"], batch["targets"]
    n = ids.shape[1]
    cu = shard_segments(layout, ids.device, tile=tile)
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

    def __init__(self, model: torch.nn.Module, *, tile: int = 512):
        super().__init__()
        self.model, self.tile = model, tile

    def forward(self, shard: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return context_parallel_loss(self.model, shard, tile=self.tile)


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
