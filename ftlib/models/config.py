"""``LlamaConfig``: one dataclass for every dense decoder family ftlib runs.

One architecture (RMSNorm, RoPE, grouped-query attention, gated MLP) with switches, read from the
Hugging Face ``config.json`` of these ``model_type`` values:

- ``llama``   (Llama 2 / 3 / 3.1 / 3.2): optional ``attention_bias`` on q/k/v/o, ``mlp_bias``;
- ``mistral``: ``sliding_window`` on every layer;
- ``qwen2``   (Qwen2 / 2.5): bias on q/k/v only; ``use_sliding_window`` + ``layer_types``;
- ``qwen3``:   per-head RMSNorm on q and k before RoPE (``qk_norm="head"``), explicit ``head_dim``;
- ``gemma2``:  embeddings x sqrt(hidden), norms ``(1 + w)`` in fp32, four norms per layer
  (``norm_layout="sandwich"``), GeGLU (tanh GELU), ``query_pre_attn_scalar``, attention and final
  logit soft-capping, sliding window on alternating layers (``layer_types``);
- ``gemma3_text``: Gemma-2's layout plus per-head q/k norms, 5 local : 1 global layers, a local
  RoPE base (``rope_local_theta``) beside the global base and its scaling;
- ``phi3``    (Phi-3 / Phi-3.5 / Phi-4-mini): fused ``qkv_proj`` and ``gate_up_proj``
  (``fused_proj``), ``partial_rotary_factor``, ``longrope``;
- ``olmo2``:   norms after attention and after the MLP, none before (``norm_layout="post"``), q/k
  norms over the whole projection (``qk_norm="proj"``);
- ``smollm3``: RoPE off on the layers where ``no_rope_layers[i] == 0``;
- ``qwen3_moe``, ``mixtral``, ``qwen2_moe``: the attention of Qwen3 / Mistral / Qwen2 with
  mixture-of-experts feed-forward layers (the fields ``num_experts`` ... ``router_jitter_noise``, read
  and checked by ``ftlib.models.moe_config``; the block is ``ftlib.models.moe``).

RoPE scalings: ``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3`` (``ftlib.models.rope``).
``from_hf_dict`` accepts both the classic layout (``rope_theta`` + ``rope_scaling``) and the newer
``rope_parameters`` dict (flat, or per layer type for Gemma-3); ``to_hf_dict`` writes the family's
own keys so transformers reads them back. Keys ftlib does not use are kept in ``extra`` and written
back unchanged. Every key it reads is checked for its JSON type and range first
(``"tie_word_embeddings": "false"`` is refused, not read as True); what ftlib cannot run
(another ``model_type``, ``rope_type`` or ``layer_types`` entry) is refused naming the field and
the value.

Reference: the configuration classes of Hugging Face transformers (``LlamaConfig``,
``Qwen3Config``, ``Gemma2Config``, ``Gemma3TextConfig``, ``Phi3Config``, ``Olmo2Config``,
``SmolLM3Config`` ...) and their published ``config.json`` files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .._fields import json_bool, json_dict, json_float, json_int, json_int_list, json_str, json_str_list
from .moe_config import check_moe, moe_hf_dict, read_moe
from .rope import ROPE_TYPES

__all__ = ["ARCHITECTURES", "FAMILIES", "LAYER_TYPES", "LlamaConfig"]

#: model_type -> the class name written to ``architectures`` in config.json
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
}

_GEMMA = dict(norm_layout="sandwich", norm_offset=True, embed_scale=True, hidden_act="gelu_pytorch_tanh")
#: model_type -> the architecture switches it fixes (the rest come from config.json)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "smollm3": {},
    "qwen3": dict(qk_norm="head"),
    "gemma2": dict(_GEMMA),
    "gemma3_text": dict(_GEMMA, qk_norm="head"),
    "phi3": dict(fused_proj=True),
    "olmo2": dict(norm_layout="post", qk_norm="proj"),
    "qwen3_moe": dict(qk_norm="head"), "mixtral": {}, "qwen2_moe": {},
}
LAYER_TYPES = ("full_attention", "sliding_attention")
_ACTS = ("silu", "gelu_pytorch_tanh")

# config.json keys that describe how a file was written, not the model; rewritten on save.
_VOLATILE = {"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "rope_parameters"}


@dataclass
class LlamaConfig:
    """Hyper-parameters of a decoder of one of the ``FAMILIES`` (names follow config.json)."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None -> num_attention_heads (no GQA)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "yarn" | ..., "factor": ..., ...}
    qkv_bias: bool = False  # bias on q_proj/k_proj/v_proj (Qwen2: True)
    o_bias: bool = False  # bias on o_proj (Llama attention_bias=True sets both)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # window of the "sliding_attention" layers
    layer_types: list[str] | None = None  # per layer, LAYER_TYPES; None -> all sliding when a window is set
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    # family switches (FAMILIES sets them from model_type when they are left at None)
    qk_norm: str | None = None  # None | "head" (RMSNorm over each head, Qwen3/Gemma-3) | "proj" (OLMo-2)
    norm_layout: str | None = None  # "pre" (Llama) | "sandwich" (Gemma: pre+post both) | "post" (OLMo-2)
    norm_offset: bool | None = None  # RMSNorm scales by (1 + w), in fp32 (Gemma)
    embed_scale: bool | None = None  # embeddings x sqrt(hidden_size) (Gemma)
    fused_proj: bool | None = None  # qkv_proj and gate_up_proj (Phi-3)
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma), else head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(scores / c)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c)
    partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim * this) dims (Phi-3)
    no_rope_layers: list[int] | None = None  # per layer 1 = RoPE, 0 = none (SmolLM3)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma-3), default scaling
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # mixture of experts (ftlib.models.moe_config): 0 experts = every layer dense
    num_experts: int = 0  # routed experts per sparse layer
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int | None = None  # width of one routed expert
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1 (Mixtral: always)
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's sigmoid-gated shared expert, else None
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] | None = None  # ... and i is not listed here
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in the training loss
    router_jitter_noise: float = 0.0  # Mixtral: x * U(1 - j, 1 + j) before routing, in training
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"LlamaConfig: hidden_size={self.hidden_size} is not a multiple of "
                    f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        family = FAMILIES.get(self.model_type, {})
        defaults = dict(qk_norm=None, norm_layout="pre", norm_offset=False, embed_scale=False, fused_proj=False)
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, family.get(name, default))
        if self.model_type == "gemma3_text" and self.rope_local_theta is None:
            self.rope_local_theta = 10000.0
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        self.validate()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None: full attention)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def layer_is_moe(self, i: int) -> bool:
        """Whether layer ``i`` holds a mixture-of-experts block (else the dense gated MLP)."""
        return (self.num_experts > 0 and i not in (self.mlp_only_layers or [])
                and (i + 1) % self.decoder_sparse_step == 0)

    def layer_rope(self, i: int) -> str | None:
        """Which RoPE tables layer ``i`` uses: ``"global"``, ``"local"`` (Gemma-3's sliding layers) or None."""
        if self.no_rope_layers is not None and not self.no_rope_layers[i]:
            return None
        if self.rope_local_theta is not None and self.layer_types[i] == "sliding_attention":
            return "local"
        return "global"

    def validate(self, source: str = "LlamaConfig") -> None:
        """Raise ``ValueError`` naming ``source`` and the field when the config is not runnable."""
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"{source}: model_type {self.model_type!r} is not supported "
                f"(expected one of {', '.join(sorted(ARCHITECTURES))})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{source}: num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"{source}: partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"{source}: the rotary dim {self.rotary_dim} (head_dim x partial_rotary_factor) must "
                             "be even and positive")
        if self.hidden_act not in _ACTS:
            raise ValueError(f"{source}: hidden_act {self.hidden_act!r} is not supported (expected one of {_ACTS})")
        if self.qk_norm not in (None, "head", "proj"):
            raise ValueError(f"{source}: qk_norm {self.qk_norm!r} is not supported (None, 'head' or 'proj')")
        if self.norm_layout not in ("pre", "sandwich", "post"):
            raise ValueError(f"{source}: norm_layout {self.norm_layout!r} is not supported (pre, sandwich or post)")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{source}: layer_types has {len(self.layer_types)} entries for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"{source}: layer_types[{i}] {kind!r} is not supported (expected one of "
                                 f"{', '.join(LAYER_TYPES)})")
        if self.no_rope_layers is not None and len(self.no_rope_layers) != self.num_hidden_layers:
            raise ValueError(f"{source}: no_rope_layers has {len(self.no_rope_layers)} entries for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        for name in ("sliding_window",):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{source}: {name} must be a positive integer or null, got {value!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{source}: {name} must be > 0 or null, got {value!r}")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ValueError(f"{source}: qwen2 has bias on q/k/v only (qkv_bias=True, o_bias=False, mlp_bias=False)")
        if self.model_type == "qwen2_moe" and (self.o_bias or self.mlp_bias):
            raise ValueError(f"{source}: qwen2_moe has bias on q/k/v only (qkv_bias; o_bias=False, mlp_bias=False)")
        if self.model_type in ("mistral", "phi3", "mixtral") and (self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ValueError(f"{source}: {self.model_type} has no biases")
        if self.model_type not in ("qwen2", "mistral", "phi3", "mixtral", "qwen2_moe") and self.qkv_bias != self.o_bias:
            raise ValueError(f"{source}: {self.model_type}'s attention_bias covers q/k/v/o together "
                             "(qkv_bias must equal o_bias)")
        check_moe(self, source)
        if self.rope_scaling is not None:
            self.rope_scaling = _check_rope_scaling(self.rope_scaling, self.max_position_embeddings, source,
                                                    self.rotary_dim)

    # ------------------------------------------------------------------ config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> LlamaConfig:
        """Build a config from a parsed Hugging Face ``config.json``; ``source`` names it in errors."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        model_type = json_str(d, "model_type", source)
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(expected one of {', '.join(sorted(ARCHITECTURES))})"
            )
        sizes = {key: json_int(d, key, source, min=1) for key in
                 ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
        n_layers = sizes["num_hidden_layers"]
        max_pos = json_int(d, "max_position_embeddings", source, default=2048, min=1)

        theta, scaling, local_theta, partial = _read_rope(d, model_type, source)
        if model_type == "phi3" and scaling is not None and "original_max_position_embeddings" in d:
            # transformers gives Phi-3's top-level original_max_position_embeddings priority
            scaling["original_max_position_embeddings"] = json_int(d, "original_max_position_embeddings", source,
                                                                   min=1)

        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        elif model_type == "qwen2_moe":
            qkv_bias, o_bias = json_bool(d, "qkv_bias", source, default=True), False
        elif model_type in ("mistral", "phi3", "mixtral"):
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = json_bool(d, "attention_bias", source, default=False)
        if model_type in ("qwen2", "qwen3", "smollm3", "qwen3_moe", "qwen2_moe"):
            use_window = json_bool(d, "use_sliding_window", source, default=False)
        else:
            use_window = model_type in ("mistral", "phi3", "gemma2", "gemma3_text", "mixtral")
        window = json_int(d, "sliding_window", source, default=None, nullable=True, min=1) if use_window else None
        if model_type == "gemma3_text" and json_bool(d, "use_bidirectional_attention", source, default=False,
                                                     nullable=True):
            raise ValueError(f"{source}: use_bidirectional_attention=true is not supported (ftlib's decoder is causal)")
        layer_types = json_str_list(d, "layer_types", source, default=None, nullable=True)
        if layer_types is None:
            layer_types = _default_layer_types(d, model_type, n_layers, window, source)
        no_rope = None
        if model_type == "smollm3":
            no_rope = json_int_list(d, "no_rope_layers", source, default=None, nullable=True)
            if no_rope is None:
                every = json_int(d, "no_rope_layer_interval", source, default=4, min=1)
                no_rope = [int((i + 1) % every != 0) for i in range(n_layers)]
        gemma = model_type in ("gemma2", "gemma3_text")
        act_key = "hidden_activation" if gemma and "hidden_activation" in d else "hidden_act"
        eos = json_int_list(d, "eos_token_id", source, default=None, nullable=True, or_int=True)

        known = set(f.name for f in dataclasses.fields(cls)) | {
            "rope_scaling", "attention_bias", "use_sliding_window", "hidden_activation", "rope_local_base_freq",
            "use_bidirectional_attention", "num_local_experts"}
        if model_type == "qwen2_moe":
            known.add("qkv_bias")
        extra = {k: v for k, v in d.items() if k not in known and k not in _VOLATILE}
        kwargs = dict(
            model_type=model_type,
            **sizes,
            num_key_value_heads=json_int(d, "num_key_value_heads", source, default=None, nullable=True, min=1),
            head_dim=json_int(d, "head_dim", source, default=None, nullable=True, min=1),
            max_position_embeddings=max_pos,
            rms_norm_eps=json_float(d, "rms_norm_eps", source, default=1e-6, min=0, min_open=True),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=json_bool(d, "mlp_bias", source, default=False),
            tie_word_embeddings=json_bool(d, "tie_word_embeddings", source, default=gemma),
            sliding_window=window,
            layer_types=layer_types,
            hidden_act=json_str(d, act_key, source, default="gelu_pytorch_tanh" if gemma else "silu"),
            query_pre_attn_scalar=(json_float(d, "query_pre_attn_scalar", source, default=256, min=0, min_open=True)
                                   if gemma else None),
            attn_logit_softcapping=json_float(d, "attn_logit_softcapping", source, default=None, nullable=True,
                                              min=0, min_open=True) if gemma else None,
            final_logit_softcapping=json_float(d, "final_logit_softcapping", source, default=None, nullable=True,
                                               min=0, min_open=True) if gemma else None,
            partial_rotary_factor=partial,
            no_rope_layers=no_rope,
            rope_local_theta=local_theta,
            initializer_range=json_float(d, "initializer_range", source, default=0.02, min=0),
            bos_token_id=json_int(d, "bos_token_id", source, default=None, nullable=True),
            eos_token_id=eos,
            pad_token_id=json_int(d, "pad_token_id", source, default=None, nullable=True),
            **read_moe(d, model_type, source),
            extra=extra,
        )
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as e:
            msg = str(e)
            msg = msg.replace("LlamaConfig:", f"{source}:", 1) if msg.startswith("LlamaConfig:") else f"{source}: {msg}"
            raise ValueError(msg) from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict (without ``architectures``/dtype, which ``save_pretrained`` adds)."""
        mt = self.model_type
        d: dict[str, Any] = dict(self.extra)
        d.update(
            model_type=mt,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        flat = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        if mt == "phi3":  # in rope_parameters (transformers 5) and at the top (older readers, and 5 given rope_scaling)
            flat["partial_rotary_factor"] = d["partial_rotary_factor"] = self.partial_rotary_factor
        if mt == "gemma3_text":
            d["rope_parameters"] = {"full_attention": flat,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_theta}}
        else:
            d.update(rope_theta=self.rope_theta, rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
                     rope_parameters=flat)
        if mt not in ("qwen2", "phi3") or self.head_dim != self.hidden_size // self.num_attention_heads:
            d["head_dim"] = self.head_dim
        d["hidden_activation" if mt in ("gemma2", "gemma3_text") else "hidden_act"] = self.hidden_act
        if mt in ("llama", "smollm3"):
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif mt in ("qwen3", "gemma2", "gemma3_text", "olmo2", "qwen3_moe"):
            d["attention_bias"] = self.qkv_bias
        elif mt == "qwen2_moe":
            d["qkv_bias"] = self.qkv_bias
        d.update(moe_hf_dict(self))
        if mt in ("mistral", "phi3", "mixtral"):
            d["sliding_window"] = self.sliding_window
        elif mt == "qwen3_moe":  # one window on every layer, no layer_types
            d.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window)
        elif mt in ("qwen2", "qwen3", "smollm3", "qwen2_moe"):
            d.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window,
                     layer_types=list(self.layer_types))
        elif mt in ("gemma2", "gemma3_text"):
            d.update(sliding_window=self.sliding_window, layer_types=list(self.layer_types),
                     query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar),
                     attn_logit_softcapping=self.attn_logit_softcapping,
                     final_logit_softcapping=self.final_logit_softcapping)
        if mt == "smollm3":
            d["no_rope_layers"] = list(self.no_rope_layers)
        if mt == "phi3" and self.rope_scaling and "original_max_position_embeddings" in self.rope_scaling:
            d["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        return d


def _int_if_whole(x: float | None) -> float | int | None:
    """transformers types some float-valued fields as int (Gemma's query_pre_attn_scalar)."""
    return int(x) if x is not None and float(x).is_integer() else x


def _read_rope(d: dict, model_type: str, source: str) -> tuple[float, dict | None, float | None, float]:
    """(theta, scaling or None, local theta or None, partial_rotary_factor) from either rope layout."""
    rope_params = json_dict(d, "rope_parameters", source, default=None, nullable=True) or {}
    nested = {k for k, v in rope_params.items() if isinstance(v, dict) or k in LAYER_TYPES}
    local_theta = None
    if nested:
        if model_type != "gemma3_text":
            raise ValueError(f"{source}: per-layer rope_parameters are not supported for {model_type}")
        unknown = nested - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"{source}: rope_parameters entry {sorted(unknown)[0]!r} is not a layer type")
        local = json_dict(rope_params, "sliding_attention", f"{source}: rope_parameters", default=None,
                          nullable=True) or {}
        if _kind(local, f"{source}: rope_parameters.sliding_attention") != "default":
            raise ValueError(f"{source}: rope_parameters.sliding_attention: only the default rope_type is supported "
                             f"for the local layers, got {local.get('rope_type')!r}")
        local_theta = json_float(local, "rope_theta", f"{source}: rope_parameters.sliding_attention",
                                 default=10000.0, min=0, min_open=True)
        rope_params = json_dict(rope_params, "full_attention", f"{source}: rope_parameters", default=None,
                                nullable=True) or {}
        where = f"{source}: rope_parameters.full_attention"
        theta = json_float(rope_params, "rope_theta", where, default=1000000.0, min=0, min_open=True)
    else:
        default_theta = 1000000.0 if model_type in ("gemma3_text", "mixtral") else 10000.0
        if "rope_theta" in d:
            theta = json_float(d, "rope_theta", source, min=0, min_open=True)
        else:
            theta = json_float(rope_params, "rope_theta", f"{source}: rope_parameters", default=default_theta,
                               min=0, min_open=True)
        if model_type == "gemma3_text":
            local_theta = json_float(d, "rope_local_base_freq", source, default=10000.0, min=0, min_open=True)
    scaling = json_dict(d, "rope_scaling", source, default=None, nullable=True)
    if not scaling:
        scaling = {k: v for k, v in rope_params.items() if k not in ("rope_theta", "partial_rotary_factor")} or None
    if scaling is not None and _kind(scaling, f"{source}: rope_scaling") == "default":
        scaling = None
    if "partial_rotary_factor" in d:
        partial = json_float(d, "partial_rotary_factor", source, min=0, min_open=True)
    else:
        partial = json_float(rope_params, "partial_rotary_factor", f"{source}: rope_parameters", default=1.0,
                             min=0, min_open=True)
    return theta, dict(scaling) if scaling else None, local_theta, partial


def _kind(scaling: dict, where: str) -> str:
    kind = json_str(scaling, "rope_type", where, default=None, nullable=True)
    if kind is None:
        kind = json_str(scaling, "type", where, default="default", nullable=True) or "default"
    return kind


def _default_layer_types(d: dict, model_type: str, n: int, window: int | None, source: str) -> list[str]:
    """transformers' ``layer_types`` when config.json has none (older files)."""
    full, sliding = LAYER_TYPES
    if model_type == "gemma2":
        return [sliding if (i + 1) % 2 else full for i in range(n)]
    if model_type == "gemma3_text":
        every = json_int(d, "sliding_window_pattern", source, default=6, min=1)
        return [sliding if (i + 1) % every else full for i in range(n)]
    if model_type == "qwen2_moe":  # transformers' Qwen2MoeConfig: every other layer below max_window_layers
        first = json_int(d, "max_window_layers", source, default=28, min=0)
        return [sliding if window is not None and (i + 1) % 2 and i < first else full for i in range(n)]
    if model_type in ("qwen2", "qwen3"):
        first = json_int(d, "max_window_layers", source, default=28, min=0)
        return [sliding if window is not None and i >= first else full for i in range(n)]
    return [sliding if window is not None else full] * n


def _check_rope_scaling(scaling: dict, max_pos: int, source: str, rotary_dim: int) -> dict:
    """Normalise a ``rope_scaling`` dict to ``{"rope_type": ..., ...}`` and check its fields."""
    if not isinstance(scaling, dict):
        raise ValueError(f"{source}: rope_scaling must be an object, got {type(scaling).__name__}")
    where = f"{source}: rope_scaling"
    s = dict(scaling)
    kind = json_str(s, "type", where, default=None, nullable=True)
    s.pop("type", None)
    s["rope_type"] = json_str(s, "rope_type", where, default=None, nullable=True) or kind or "default"
    if s["rope_type"] not in ROPE_TYPES:
        raise ValueError(
            f"{source}: rope_scaling: rope_type {s['rope_type']!r} is not supported (expected one of "
            f"{', '.join(ROPE_TYPES)})"
        )
    if s["rope_type"] in ("linear", "llama3", "dynamic", "yarn"):
        json_float(s, "factor", where, min=0, min_open=True)
    if s["rope_type"] in ("llama3", "yarn", "longrope"):
        s.setdefault("original_max_position_embeddings", max_pos)
        json_int(s, "original_max_position_embeddings", where, min=1)
    if s["rope_type"] == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            json_float(s, key, where, min=0, min_open=True)
        if s["high_freq_factor"] <= s["low_freq_factor"]:
            raise ValueError(f"{source}: rope_scaling needs high_freq_factor > low_freq_factor")
    if s["rope_type"] == "yarn":
        for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            json_float(s, key, where, default=None, nullable=True)
        json_bool(s, "truncate", where, default=True)
    if s["rope_type"] == "longrope":
        json_float(s, "factor", where, default=None, nullable=True, min=0, min_open=True)
        json_float(s, "attention_factor", where, default=None, nullable=True, min=0)
        for key in ("short_factor", "long_factor"):
            value = s.get(key)
            if (not isinstance(value, list) or len(value) != rotary_dim // 2
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)):
                raise ValueError(f"{source}: rope_scaling: field {key} must be a list of {rotary_dim // 2} numbers "
                                 f"(rotary dim / 2), got {value!r}"[:300])
    return s
