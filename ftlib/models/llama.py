"""One decoder for every family (Llama, Mistral, Qwen2/3, Gemma-2/3, Phi-3/4, OLMo-2, SmolLM3; MoE: Qwen3-MoE,
Mixtral, Qwen2-MoE).

Per block, with x [B, T, H] the residual stream, the norms placed by ``config.norm_layout``:

    pre      (Llama, Qwen, Mistral, Phi, SmolLM3):  h = x + A(n1(x));        out = h + M(n2(h))
    sandwich (Gemma-2/3):                           h = x + n2(A(n1(x)));    out = h + n4(M(n3(h)))
    post     (OLMo-2):                              h = x + n2(A(x));        out = h + n4(M(h))

    A(x) = o_proj(attention(rope(qn(q_proj(x))), rope(kn(k_proj(x))), v_proj(x)))
    M(x) = down_proj(act(gate_proj(x)) * up_proj(x))        act = silu (SwiGLU) | tanh-GELU (GeGLU)
    n(x) = w * x / sqrt(mean(x^2) + eps)                   RMSNorm in float32; Gemma: (1 + w), in fp32

then ``logits = lm_head(norm(x_L))`` (Gemma-2: ``c * tanh(logits / c)``). The family's extras are
switches of ``LlamaConfig``: q/k norms per head before RoPE (Qwen3, Gemma-3) or over the whole
projection (OLMo-2); fused ``qkv_proj`` / ``gate_up_proj`` (Phi-3, split after the product);
partial rotary (Phi-3); RoPE off per layer (SmolLM3); embeddings x sqrt(hidden) in the
activations' dtype (Gemma); softmax scale ``query_pre_attn_scalar ** -0.5`` and attention logit
soft-capping ``c * tanh(s / c)`` (Gemma-2); a sliding window per layer (``layer_types``: Mistral,
Qwen, Gemma, Phi-3) and, for Gemma-3, a local RoPE base on the sliding layers. In the MoE families
M is, on the layers ``config.layer_is_moe`` selects, the sparse block of ``ftlib.models.moe`` (router,
stacked experts, Qwen2-MoE's shared expert); ``forward(..., router_stats=RouterStats())`` collects
its router logits for the auxiliary losses. Attention is
grouped-query (Hq query heads share Hkv key/value heads) and goes through
``ftlib.kernels.attention``.

References: Touvron et al. 2023 (Llama 2), Dubey et al. 2024 (Llama 3), Zhang &
Sennrich 2019 (RMSNorm), Shazeer 2020 (GLU variants), Ainslie et al. 2023 (GQA), Gemma Team
2024/2025 (Gemma 2, Gemma 3), Abdin et al. 2024 (Phi-3), OLMo Team 2024 (OLMo 2), Yang et al. 2025
(Qwen3); the ``modeling_*.py`` files of Hugging Face transformers are the specification.

Module names mirror Hugging Face's ``*ForCausalLM`` classes so ``state_dict()`` keys equal the
checkpoint keys (``model.layers.0.self_attn.q_proj.weight``, Phi-3's ``qkv_proj`` ...).
Projections are plain ``nn.Linear`` so adapters can wrap them.

Three batch layouts (the batch contract of ``ftlib.data.collate``), decided once per forward by ``BatchPlan.build``
(the one place that reads the layout arguments) and applied by ``BatchPlan.attend`` (the one
place that calls the attention op); the blocks never look at the layout:

- plain: ``input_ids`` [B, T], causal attention, positions 0..T-1;
- padded: plus ``attention_mask`` [B, T] (1 = token, 0 = pad; left or right
  padding); positions count real tokens only. When each row's real tokens are
  one run (left or right padding), the batch runs as varlen segments (the run,
  and each pad run on its own), which the fused kernels take; a dense key mask
  would send every layer to a masked dense attention instead. Other masks (holes
  inside a row) use the dense key mask;
- packed: plus ``cu_seqlens`` int32 [n_docs + 1] over the flattened B*T tokens
  (and ``position_ids`` restarting at 0 per document, derived from cu_seqlens
  when absent); the varlen attention keeps every document separate.

Decoding passes a ``KVCache`` (``ftlib.models.generate``): the new K/V are
written at the cache position and the queries attend over the whole cache with
bottom-right causal alignment and a key mask hiding padded prompt slots (a
sliding-window layer's cache is a ring of its window, whose ``update`` returns the keys
the same windowed attention reads). The
prompt pass over an empty cache attends over its own tokens only, so it runs as
varlen segments like a padded batch (fused kernels, no T x T score matrix). The
model itself holds no inference state.

Activation checkpointing (non-reentrant) is a switch:
``model.set_gradient_checkpointing(every=k, part="block"|"attn"|"mlp")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels import attention, rms_norm, swiglu
from .config import LlamaConfig
from .moe import MoEExperts, RouterStats, SparseMoeBlock, TopKRouter
from .rope import apply_rope, rope_attention_scaling, rope_cos_sin, rope_inv_freq

__all__ = [
    "BatchPlan",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "RMSNorm",
]

_PARTS = ("block", "attn", "mlp")


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in float32 and cast back before the scale.

    ``ftlib.kernels.rms_norm``: forward and backward written out (backward keeps x and the per-row
    1 / rms only), one pass each way over a row on CPU for fp32. ``offset=True`` (Gemma) is
    ``((1 + w) * n).to(x.dtype)`` with the scale in float32 too; ``scale_fp32=True`` (OLMo-2) is
    ``(w * n).to(x.dtype)``: in float32 all three are the same numbers.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, offset: bool = False, scale_fp32: bool = False):
        super().__init__()
        self.eps, self.offset, self.scale_fp32 = eps, offset, scale_fp32
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.offset or self.scale_fp32):
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (n * (1.0 + w) if self.offset else w * n).to(x.dtype)


@dataclass
class BatchPlan:
    """How the tokens of one forward attend, decided once (``build``) and shared by every layer.

    ``mode``: ``"varlen"`` (q/k/v flattened to [B*T, H, D], documents from ``cu_seqlens``:
    packed rows, padded rows whose real tokens are one run, the prefill of an empty KV cache),
    ``"cache"`` (decoding: the queries read every cache slot so far under the cache's key mask)
    or ``"dense"`` ([B, T, H, D], causal, optional ``key_padding_mask`` for rows with holes).
    A KV cache, when given, is written by every layer whatever the mode.
    """

    mode: str
    position_ids: torch.Tensor  # (B, T)
    cu_seqlens: torch.Tensor | None = None  # (segments + 1,) int32 over the flattened B*T tokens
    max_seqlen: int | None = None
    key_padding_mask: torch.Tensor | None = None  # (B, T) bool, dense mode only
    kv_cache: Any = None  # ftlib.models.generate.KVCache
    keys: int = 0  # the longest run of keys a query sees
    rope_len: int | None = None  # the longest position + 1 when the host knows it (plain: T, packed: max_seqlen)
    cos: torch.Tensor | None = None  # (B, T, R) RoPE tables in the activations' dtype, set by the model
    sin: torch.Tensor | None = None
    local_cos: torch.Tensor | None = None  # (B, T, R) the sliding layers' tables (Gemma-3), else None
    local_sin: torch.Tensor | None = None
    router_stats: RouterStats | None = None  # filled by the sparse (MoE) layers when given

    @classmethod
    def build(cls, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None,
              kv_cache=None) -> BatchPlan:
        """Validate the layout arguments of ``LlamaModel.forward`` and decide the mode."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if attention_mask is not None and attention_mask.shape != (b, t):
            raise ValueError(f"attention_mask must be [B, T]={(b, t)}, got {tuple(attention_mask.shape)}")
        if position_ids is not None and position_ids.shape != (b, t):
            raise ValueError(f"position_ids must be [B, T]={(b, t)}, got {tuple(position_ids.shape)}")
        if cu_seqlens is not None:  # packed
            if attention_mask is not None or kv_cache is not None:
                raise ValueError("cu_seqlens (packed batch) cannot be combined with attention_mask or kv_cache")
            if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
            if max_seqlen is None:
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            if position_ids is None:
                position_ids = _positions_from_cu_seqlens(cu_seqlens, b, t)
            return cls("varlen", position_ids, cu_seqlens, max_seqlen, keys=max_seqlen, rope_len=max_seqlen)
        if kv_cache is not None:
            first, keys = kv_cache.length == 0, kv_cache.length + t
            default_pos = kv_cache.prepare(attention_mask, t)
            position_ids = default_pos if position_ids is None else position_ids
            if first and t > 1:  # prefill: only the new tokens are keys, so left padding is segments too
                mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
                segments = _padding_to_cu_seqlens(mask)
                if segments is not None:
                    return cls("varlen", position_ids, *segments, kv_cache=kv_cache, keys=keys)
            return cls("cache", position_ids, kv_cache=kv_cache, keys=keys)
        key_mask = None
        if attention_mask is not None:
            if position_ids is None:  # count real tokens only: left padding starts at 0 too
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            segments = _padding_to_cu_seqlens(attention_mask.bool())
            if segments is not None:  # same result for real tokens, and the fused varlen kernels apply
                return cls("varlen", position_ids, *segments, keys=t)
            key_mask = attention_mask.bool()  # real tokens not one run per row: a dense key mask
        rope_len = None
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
            rope_len = t
        return cls("dense", position_ids, key_padding_mask=key_mask, keys=t, rope_len=rope_len)

    def rope_seq_len(self) -> int:
        """The longest position + 1, S of ``dynamic`` and ``longrope`` RoPE (``ftlib.models.rope``).

        Known on the host, so a compiled forward reads nothing from the device and has no graph
        break: T for a plain batch, ``max_seqlen`` for a packed one (positions restart at 0 per
        document, the batch contract; in eager the positions are checked against it, one read per
        forward). Padded and decoding batches read it from ``position_ids`` once (their layout is
        read on the host already).
        """
        if self.rope_len is None:
            return int(self.position_ids.max()) + 1 if self.position_ids.numel() else 0
        if self.mode == "varlen" and not torch.compiler.is_compiling():
            got = int(self.position_ids.max()) + 1 if self.position_ids.numel() else 0
            if got != self.rope_len:
                raise ValueError(f"packed batch: the longest position + 1 is {got} but max_seqlen is {self.rope_len}; "
                                 "dynamic / longrope RoPE take it from max_seqlen, which must be the longest document "
                                 "(position_ids restarting at 0 per document)")
        return self.rope_len

    def rope_tables(self, kind: str | None):
        """(cos, sin) for a layer whose ``config.layer_rope`` is ``kind`` (None: no RoPE)."""
        if kind is None:
            return None
        if kind == "local" and self.local_cos is not None:
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
               sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """o (B, T, Hq, D) from q (B, T, Hq, D) and k, v (B, T, Hkv, D) of layer ``layer_idx``.

        ``sliding_window``: a query sees the keys of the last ``sliding_window`` positions only (its
        own included); ``softcap``: scores become ``softcap * tanh(s / softcap)`` before the softmax.
        """
        extras = dict(sliding_window=sliding_window, softcap=softcap)
        if self.kv_cache is not None:  # write these T keys/values; (B, L, Hkv, D) over the slots so far
            k_all, v_all, key_mask = self.kv_cache.update(layer_idx, k, v, window=sliding_window)
        if self.mode == "varlen":  # (B*T, H, D): documents never see each other
            b, t, hq, d = q.shape
            o = attention(q.reshape(b * t, hq, d), k.reshape(b * t, -1, d), v.reshape(b * t, -1, d), causal=True,
                          cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen, softmax_scale=scale, **extras)
            return o.view(b, t, hq, d)
        if self.mode == "cache":  # keys are the cache up to and including these T tokens
            return attention(q, k_all, v_all, causal=True, softmax_scale=scale, key_padding_mask=key_mask, **extras)
        return attention(q, k, v, causal=True, softmax_scale=scale, key_padding_mask=self.key_padding_mask, **extras)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE; q/k/v/o (or Phi-3's fused qkv_proj) are plain ``nn.Linear``."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        scalar = config.query_pre_attn_scalar
        self.scale = (scalar if scalar is not None else self.head_dim) ** -0.5
        self.sliding_window = config.layer_window(layer_idx)
        self.softcap = config.attn_logit_softcapping
        self.rope = config.layer_rope(layer_idx)
        self.fused = config.fused_proj
        h, d = config.hidden_size, config.head_dim
        nq, nkv = self.num_heads * d, self.num_kv_heads * d
        if self.fused:
            self.qkv_proj = nn.Linear(h, nq + 2 * nkv, bias=config.qkv_bias)
        else:
            self.q_proj = nn.Linear(h, nq, bias=config.qkv_bias)
            self.k_proj = nn.Linear(h, nkv, bias=config.qkv_bias)
            self.v_proj = nn.Linear(h, nkv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(nq, h, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm is not None:  # "head": over each head's D (Qwen3, Gemma-3); "proj": over Hq*D (OLMo-2)
            dq, dk = (d, d) if self.qk_norm == "head" else (nq, nkv)
            norm = dict(offset=config.norm_offset, scale_fp32=config.norm_layout == "post")
            self.q_norm = RMSNorm(dq, config.rms_norm_eps, **norm)
            self.k_norm = RMSNorm(dk, config.rms_norm_eps, **norm)

    def forward(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        b, t, _ = x.shape
        if self.fused:
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, t, self.num_heads, self.head_dim)  # (B, T, Hq, D)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        tables = plan.rope_tables(self.rope)
        if tables is not None:
            q, k = apply_rope(q, *tables), apply_rope(k, *tables)
        o = plan.attend(self.layer_idx, q, k, v, self.scale, sliding_window=self.sliding_window, softcap=self.softcap)
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """Gated MLP: down_proj(act(gate_proj(x)) * up_proj(x)), act = silu (SwiGLU) or tanh-GELU (GeGLU).

    Phi-3 stores gate and up as one ``gate_up_proj`` ([gate; up] rows), split after the product.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.fused = config.fused_proj
        self.act = config.hidden_act
        if self.fused:
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias)
        else:
            self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
            self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        h = swiglu(g, u) if self.act == "silu" else F.gelu(g, approximate="tanh") * u
        return self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    """One block, norms placed by ``config.norm_layout`` (see the module docstring).

    ``checkpoint_part`` in (None, "block", "attn", "mlp") selects what is recomputed.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.moe = config.layer_is_moe(layer_idx)  # MoE families: a sparse block in place of the MLP
        self.mlp = SparseMoeBlock(config, layer_idx) if self.moe else LlamaMLP(config)
        self.layout = config.norm_layout
        norm = dict(offset=config.norm_offset, scale_fp32=self.layout == "post")
        h, eps = config.hidden_size, config.rms_norm_eps
        if self.layout != "post":
            self.input_layernorm = RMSNorm(h, eps, **norm)
        self.post_attention_layernorm = RMSNorm(h, eps, **norm)
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(h, eps, **norm)
        if self.layout != "pre":
            self.post_feedforward_layernorm = RMSNorm(h, eps, **norm)
        self.checkpoint_part: str | None = None

    def _attn(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        if self.layout == "pre":
            return self.self_attn(self.input_layernorm(x), plan)
        if self.layout == "sandwich":
            return self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), plan))
        return self.post_attention_layernorm(self.self_attn(x, plan))

    def _mlp(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        if self.moe:  # pre layout (the MoE families); the router statistics go to the plan's collector
            return self.mlp(self.post_attention_layernorm(x), plan.router_stats)
        if self.layout == "pre":
            return self.mlp(self.post_attention_layernorm(x))
        if self.layout == "sandwich":
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.post_feedforward_layernorm(self.mlp(x))

    def _block(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        h = x + self._attn(x, plan)
        return h + self._mlp(h, plan)

    def forward(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        # Recomputation only pays when a backward will follow; decoding writes the cache and must run once.
        part = self.checkpoint_part if torch.is_grad_enabled() and plan.kv_cache is None else None
        if part == "block":
            return checkpoint(self._block, x, plan, use_reentrant=False)
        if part == "attn":
            h = x + checkpoint(self._attn, x, plan, use_reentrant=False)
        else:
            h = x + self._attn(x, plan)
        if part == "mlp":
            return h + checkpoint(self._mlp, h, plan, use_reentrant=False)
        return h + self._mlp(h, plan)


class LlamaModel(nn.Module):
    """Embeddings, decoder blocks and final norm; ``forward`` returns the normed hidden states [B, T, H]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=config.norm_offset,
                            scale_fp32=config.norm_layout == "post")
        # an int fixed here: under torch.compile(dynamic=True) a float config field (partial_rotary_factor) is
        # symbolic, and int(head_dim * it) would make the RoPE tables' width a symbol with no source
        self.rotary_dim = config.rotary_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        kv_cache: Any = None,
        router_stats: RouterStats | None = None,
    ) -> torch.Tensor:
        plan = BatchPlan.build(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen, kv_cache)
        cfg = self.config
        if router_stats is not None:  # MoE: the sparse layers record their router logits there
            router_stats.begin(attention_mask, cfg.num_experts, cfg.num_experts_per_tok)
            plan.router_stats = router_stats
        x = self.embed_tokens(input_ids)  # (B, T, H)
        if cfg.embed_scale:  # Gemma: sqrt(hidden) rounded to the activations' dtype first, as the reference
            x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype)
        kinds = {cfg.layer_rope(i) for i in range(cfg.num_hidden_layers)}
        scaling = cfg.rope_scaling
        seq_len = None
        if scaling is not None and scaling["rope_type"] in ("dynamic", "longrope"):  # depend on the longest position
            seq_len = plan.rope_seq_len()
        if "global" in kinds:
            inv_freq = rope_inv_freq(self.rotary_dim, cfg.rope_theta, scaling, x.device, seq_len=seq_len,
                                     max_position_embeddings=cfg.max_position_embeddings)
            scale = rope_attention_scaling(scaling, cfg.max_position_embeddings)
            plan.cos, plan.sin = rope_cos_sin(inv_freq, plan.position_ids, x.dtype, scale)  # (B, T, R)
        if "local" in kinds:  # Gemma-3's sliding layers: their own base, no scaling
            inv_freq = rope_inv_freq(self.rotary_dim, cfg.rope_local_theta, None, x.device)
            plan.local_cos, plan.local_sin = rope_cos_sin(inv_freq, plan.position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, plan)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        return self.norm(x)


def _padding_to_cu_seqlens(mask: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Varlen segments for a padded batch whose real tokens form one run per row, else None.

    mask (B, T) bool. Row r's run [s, e) and its pads [0, s), [e, T) each become a segment of
    the flattened B*T tokens, so real tokens attend exactly to the real tokens before them (as
    with a key mask) and pads only to pads. Empty segments are dropped; returns
    (cu_seqlens int32 [n_segments + 1], max_seqlen).
    """
    b, t = mask.shape
    edges = torch.diff(F.pad(mask.to(torch.int8), (1, 1)), dim=-1)  # (B, T+1): +1 run start, -1 run end
    starts, ends = edges == 1, edges == -1
    if bool((starts.sum(-1) > 1).any()):
        return None
    s = starts.to(torch.int8).argmax(-1)  # 0 for a row without real tokens (then e = 0 too)
    e = ends.to(torch.int8).argmax(-1)
    zero = torch.zeros_like(s)
    bounds = torch.stack([zero, s, e], dim=-1) + torch.arange(b, device=mask.device)[:, None] * t  # (B, 3)
    bounds = torch.cat([bounds.reshape(-1), bounds.new_tensor([b * t])])
    cu = torch.unique_consecutive(bounds).to(torch.int32)  # non-decreasing already: drop empty segments
    return cu, int((cu[1:] - cu[:-1]).max())


def _positions_from_cu_seqlens(cu_seqlens: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """Position of each flattened token inside its document, reshaped to [B, T]."""
    idx = torch.arange(b * t, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens.to(torch.int64), idx, right=True) - 1
    return (idx - cu_seqlens.to(torch.int64)[doc.clamp(max=cu_seqlens.numel() - 1)]).view(b, t)


class LlamaForCausalLM(nn.Module):
    """``model`` (LlamaModel) + ``lm_head``; ``forward`` returns logits [B, T, V].

    ``model.model(...)`` gives the final normed hidden states [B, T, H] for losses
    that apply ``lm_head`` chunk by chunk instead of materialising all logits.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        self.tie_weights()

    def reset_parameters(self) -> None:
        """Initialise as the reference does: N(0, initializer_range) weights, zero biases, unit norms."""
        for m in self.modules():
            LlamaForCausalLM.init_module(self, m)  # unbound: reward models reuse this on their own modules

    def init_module(self, m: nn.Module) -> None:
        """``reset_parameters`` for one module (its own parameters), in the same RNG order."""
        std = self.config.initializer_range
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            (nn.init.zeros_ if m.offset else nn.init.ones_)(m.weight)
        elif isinstance(m, (TopKRouter, MoEExperts)):  # stacked MoE weights: N(0, initializer_range) too
            m.init_weights(std)

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``model.embed_tokens.weight`` when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_gradient_checkpointing(self, every: int | None = 1, part: str = "block") -> None:
        """Recompute activations in backward (non-reentrant ``torch.utils.checkpoint``).

        ``every=k`` checkpoints blocks 0, k, 2k, ...; ``every=None`` or 0 turns it off.
        ``part``: ``"block"`` (whole block: least memory), ``"attn"`` (norm + attention
        only) or ``"mlp"`` (norm + MLP only: the MLP holds most activation memory).
        """
        if part not in _PARTS:
            raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
        if every is not None and (not isinstance(every, int) or every < 0):
            raise ValueError(f"every must be a non-negative int or None, got {every!r}")
        for i, layer in enumerate(self.model.layers):
            layer.checkpoint_part = part if every and i % every == 0 else None

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        kv_cache: Any = None,
        router_stats: RouterStats | None = None,
    ) -> torch.Tensor:
        hidden = self.model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, kv_cache=kv_cache, router_stats=router_stats,
        )
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)``, soft-capped ``c * tanh(z / c)`` when ``final_logit_softcapping`` is set (Gemma-2)."""
        z = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return z if cap is None else torch.tanh(z / cap) * cap
