"""``LlamaConfig``: one dataclass for the Llama-family decoders ftlib runs.

It covers the Hugging Face ``config.json`` of three ``model_type`` values that
share one architecture (pre-norm decoder, RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP) and differ only in a few switches:

- ``llama``   (Llama 2, Llama 3 / 3.1 / 3.2): optional ``attention_bias`` on
  q/k/v/o, optional ``mlp_bias``, ``rope_scaling`` of type ``llama3`` (3.1+) or
  ``linear``, tied embeddings on the 1B/3B 3.2 models;
- ``qwen2``   (Qwen2 / Qwen2.5): bias on q/k/v only, often tied embeddings;
- ``mistral``: no biases, a ``sliding_window`` (ftlib's attention has no
  window, so a sequence longer than the window is refused instead of being
  computed differently from the reference).

``from_hf_dict`` accepts both the classic layout (``rope_theta`` +
``rope_scaling``) and the newer ``rope_parameters`` dict; ``to_hf_dict`` writes
the classic layout plus ``rope_parameters`` so both old and new readers load it.
Keys ftlib does not use are kept in ``extra`` and written back unchanged. Every key it reads is
checked for its JSON type and range first (``"tie_word_embeddings": "false"`` is refused, not read
as True), with an error naming the file, the field, what was expected and what was found.

Reference: the ``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig`` classes of
Hugging Face transformers and their published ``config.json`` files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .._fields import json_bool, json_dict, json_float, json_int, json_int_list, json_str

__all__ = ["ARCHITECTURES", "LlamaConfig"]

#: model_type -> the class name written to ``architectures`` in config.json
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}

# config.json keys that describe how a file was written, not the model; rewritten on save.
_VOLATILE = {"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "rope_parameters"}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (names follow config.json)."""

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
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", "factor": ..., ...}
    qkv_bias: bool = False  # bias on q_proj/k_proj/v_proj (Qwen2: True)
    o_bias: bool = False  # bias on o_proj (Llama attention_bias=True sets both)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
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
        self.validate()

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
        if self.head_dim % 2:
            raise ValueError(f"{source}: head_dim={self.head_dim} must be even for rotary embeddings")
        if self.hidden_act != "silu":
            raise ValueError(f"{source}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ValueError(f"{source}: qwen2 has bias on q/k/v only (qkv_bias=True, o_bias=False, mlp_bias=False)")
        if self.model_type == "mistral" and (self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ValueError(f"{source}: mistral has no biases")
        if self.model_type == "llama" and self.qkv_bias != self.o_bias:
            raise ValueError(f"{source}: llama's attention_bias covers q/k/v/o together (qkv_bias must equal o_bias)")
        if self.rope_scaling is not None:
            self.rope_scaling = _check_rope_scaling(self.rope_scaling, self.max_position_embeddings, source)

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

        rope_params = json_dict(d, "rope_parameters", source, default=None, nullable=True) or {}
        if rope_params and any(isinstance(v, dict) for v in rope_params.values()):
            raise ValueError(f"{source}: per-layer rope_parameters are not supported")
        if "rope_theta" in d:
            theta = json_float(d, "rope_theta", source, min=0, min_open=True)
        else:
            theta = json_float(rope_params, "rope_theta", f"{source}: rope_parameters", default=10000.0,
                               min=0, min_open=True)
        scaling = json_dict(d, "rope_scaling", source, default=None, nullable=True)
        if not scaling:
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"} or None
        if scaling is not None:
            where = f"{source}: rope_scaling"
            kind = json_str(scaling, "rope_type", where, default=None, nullable=True)
            if kind is None:
                kind = json_str(scaling, "type", where, default="default", nullable=True) or "default"
            if kind == "default":
                scaling = None

        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
            use_window = json_bool(d, "use_sliding_window", source, default=False)
        else:
            qkv_bias = o_bias = json_bool(d, "attention_bias", source, default=False)
            use_window = model_type == "mistral"
        window = json_int(d, "sliding_window", source, default=None, nullable=True, min=1) if use_window else None
        eos = json_int_list(d, "eos_token_id", source, default=None, nullable=True, or_int=True)

        known = set(f.name for f in dataclasses.fields(cls)) | {"rope_scaling", "attention_bias", "use_sliding_window"}
        extra = {k: v for k, v in d.items() if k not in known and k not in _VOLATILE}
        kwargs = dict(
            model_type=model_type,
            **sizes,
            num_key_value_heads=json_int(d, "num_key_value_heads", source, default=None, nullable=True, min=1),
            head_dim=json_int(d, "head_dim", source, default=None, nullable=True, min=1),
            max_position_embeddings=json_int(d, "max_position_embeddings", source, default=2048, min=1),
            rms_norm_eps=json_float(d, "rms_norm_eps", source, default=1e-6, min=0, min_open=True),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=json_bool(d, "mlp_bias", source, default=False),
            tie_word_embeddings=json_bool(d, "tie_word_embeddings", source, default=False),
            sliding_window=window,
            hidden_act=json_str(d, "hidden_act", source, default="silu"),
            initializer_range=json_float(d, "initializer_range", source, default=0.02, min=0),
            bos_token_id=json_int(d, "bos_token_id", source, default=None, nullable=True),
            eos_token_id=eos,
            pad_token_id=json_int(d, "pad_token_id", source, default=None, nullable=True),
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
        d: dict[str, Any] = dict(self.extra)
        d.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            rope_parameters={"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
            initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.model_type != "qwen2" or self.head_dim != self.hidden_size // self.num_attention_heads:
            d["head_dim"] = self.head_dim
        if self.model_type == "llama":
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        else:  # qwen2
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
        return d


def _check_rope_scaling(scaling: dict, max_pos: int, source: str) -> dict:
    """Normalise a ``rope_scaling`` dict to ``{"rope_type": ..., ...}`` and check its fields."""
    if not isinstance(scaling, dict):
        raise ValueError(f"{source}: rope_scaling must be an object, got {type(scaling).__name__}")
    where = f"{source}: rope_scaling"
    s = dict(scaling)
    kind = json_str(s, "type", where, default=None, nullable=True)
    s.pop("type", None)
    s["rope_type"] = json_str(s, "rope_type", where, default=None, nullable=True) or kind or "default"
    if s["rope_type"] not in _ROPE_TYPES:
        raise ValueError(
            f"{source}: rope_scaling type {s['rope_type']!r} is not supported (expected one of {_ROPE_TYPES})"
        )
    if s["rope_type"] in ("linear", "llama3"):
        json_float(s, "factor", where, min=0, min_open=True)
    if s["rope_type"] == "llama3":
        s.setdefault("original_max_position_embeddings", max_pos)
        json_int(s, "original_max_position_embeddings", where, min=1)
        for key in ("low_freq_factor", "high_freq_factor"):
            json_float(s, key, where, min=0, min_open=True)
        if s["high_freq_factor"] <= s["low_freq_factor"]:
            raise ValueError(f"{source}: rope_scaling needs high_freq_factor > low_freq_factor")
    return s
