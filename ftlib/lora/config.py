"""``LoRAConfig``: what to adapt and how, plus the mapping to PEFT's ``adapter_config.json``.

LoRA (Hu et al., arXiv:2106.09685) adds a low-rank update to a frozen weight,
``W' = W + s * B A`` with ``A`` [r, in], ``B`` [out, r] and ``s = alpha / r``
(rsLoRA, Kalajdzievski arXiv:2312.03732: ``s = alpha / sqrt(r)``). DoRA (Liu et al.,
arXiv:2402.09353) further rescales each output row to a learned magnitude.

Targets follow PEFT's rules so an ``adapter_config.json`` means the same thing here:
``target_modules`` as a list matches a module whose full name equals an entry or ends
with ``"." + entry``; as a string it is a regex that must match the full name
(``re.fullmatch``); the string ``"all-linear"`` means every ``nn.Linear`` except the
output head. ``target_parameters`` (PEFT's field of that name) selects stacked MoE expert weights
(``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``) for a per-expert LoRA
(``ftlib.lora.experts``); the router is never a target. ``rank_pattern`` / ``alpha_pattern`` map a pattern ``p`` to a value for
modules whose name matches ``(.*\\.)?(p)$``, first matching pattern wins. ``from_peft_dict`` checks
the JSON type and range of every field it reads (``"use_rslora": "false"`` or ``"modules_to_save":
"lm_head"`` are refused, naming the file and the field).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .._fields import json_bool, json_dict, json_float, json_int, json_str, json_str_list
from ._match import pattern_value

__all__ = ["LoRAConfig"]

# What ftlib reads from a PEFT adapter_config.json is an allow-list, so an adapter using a feature
# ftlib does not implement is refused instead of being loaded with a different meaning:
# - fields ftlib implements (mapped in from_peft_dict);
_PEFT_FIELDS = (
    "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "rank_pattern", "alpha_pattern",
    "use_rslora", "use_dora", "init_lora_weights", "modules_to_save", "ensure_weight_tying", "bias",
    "target_parameters",
)
# - bookkeeping that does not change what the adapter computes;
_PEFT_METADATA = ("peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
                  "peft_version")
# - features ftlib does not implement, accepted only at their "off" value (PEFT 0.21 defaults), and
#   settings that only matter when such a feature is on (any value).
_PEFT_OFF = {
    "fan_in_fan_out": (False, None), "lora_bias": (False, None), "layers_to_transform": (None, []),
    "layers_pattern": (None, [], ""), "layer_replication": (None, []), "use_qalora": (False, None),
    "trainable_token_indices": (None, [], {}), "alora_invocation_tokens": (None, []),
    "use_bdlora": (None, False), "megatron_config": (None,), "arrow_config": (None,), "loftq_config": (None, {}),
    "eva_config": (None,), "corda_config": (None,), "lora_ga_config": (None,), "kasa_config": (None,),
    "velora_config": (None,), "monteclora_config": (None,), "runtime_config": (None, {}, {"ephemeral_gpu_offload": False}),
}
_PEFT_ANY = ("qalora_group_size", "megatron_core")  # read by use_qalora / megatron_config only


@dataclass
class LoRAConfig:
    """Adapter hyper-parameters.

    Attributes:
        r: rank (> 0).
        alpha: scale numerator; the update is multiplied by ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).
        dropout: dropout probability on the adapter input, in [0, 1).
        target_modules: list of module-name suffixes, a full-name regex, or ``"all-linear"`` (may be empty
            when ``target_parameters`` names what to adapt).
        target_parameters: stacked MoE expert weights to adapt per expert (names or dotted suffixes of
            ``...mlp.experts.gate_up_proj`` / ``...mlp.experts.down_proj``); None: no expert adapters.
        exclude_modules: list of suffixes or a regex of modules never adapted.
        rank_pattern / alpha_pattern: per-module overrides ``{pattern: value}``.
        use_rslora: rank-stabilised scaling ``alpha / sqrt(r)``.
        use_dora: weight-decomposed adaptation (a magnitude vector per output unit).
        init: ``"kaiming"`` (A Kaiming-uniform, PEFT's default) or ``"gaussian"`` (A ~ N(0, 1/r^2)); B = 0.
        modules_to_save: module-name suffixes trained in full (e.g. ``["lm_head"]``). A weight such a
            module shares with another (a tied ``lm_head`` and embedding) is untied: the module trains
            its own copy and the other keeps the frozen original, as PEFT does.
        ensure_weight_tying: PEFT's option of that name: keep tied weights tied instead. A tied weight of
            a ``modules_to_save`` module is then trained in place, for both modules (and saved under both
            names, as PEFT does); a LoRA target with a tied weight is refused (PEFT would put a tied LoRA
            on the embedding, which ftlib does not implement).
        quantize: ``None`` or ``"nf4"``: store base weights in NF4 (QLoRA).
        quantize_modules: ``"targets"`` (the adapted layers) or ``"all"`` (every ``nn.Linear`` except
            ``modules_to_save`` and ``quantize_skip``).
        quantize_skip: module-name suffixes left unquantized with ``quantize_modules="all"``.
        double_quant: also quantize the NF4 absmax to 8 bits.
        quant_blocksize: NF4 block size (64 as in QLoRA).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    exclude_modules: list[str] | str | None = None
    target_parameters: list[str] | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False
    init: str = "kaiming"
    modules_to_save: list[str] = field(default_factory=list)
    ensure_weight_tying: bool = False
    quantize: str | None = None
    quantize_modules: str = "targets"
    quantize_skip: list[str] = field(default_factory=lambda: ["lm_head"])
    double_quant: bool = False
    quant_blocksize: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, (tuple, set)):
            self.target_modules = sorted(self.target_modules)
        self.modules_to_save = list(self.modules_to_save or [])
        self.rank_pattern = dict(self.rank_pattern or {})
        self.alpha_pattern = dict(self.alpha_pattern or {})
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"LoRAConfig.r must be a positive integer, got {self.r!r}")
        for pat, rv in self.rank_pattern.items():
            if not isinstance(rv, int) or isinstance(rv, bool) or rv <= 0:
                raise ValueError(f"LoRAConfig.rank_pattern[{pat!r}] must be a positive integer, got {rv!r}")
        for name in ("alpha", "dropout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"LoRAConfig.{name} must be a number, got {v!r} ({type(v).__name__})")
        if not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in ("kaiming", "gaussian"):
            raise ValueError(f"LoRAConfig.init must be 'kaiming' or 'gaussian', got {self.init!r}")
        if self.quantize not in (None, "nf4"):
            raise ValueError(f"LoRAConfig.quantize must be None or 'nf4', got {self.quantize!r}")
        if self.quantize_modules not in ("targets", "all"):
            raise ValueError(f"LoRAConfig.quantize_modules must be 'targets' or 'all', got {self.quantize_modules!r}")
        self.target_parameters = list(self.target_parameters) if self.target_parameters else None
        if not self.target_modules and not self.target_parameters:
            raise ValueError("LoRAConfig.target_modules is empty: name the modules to adapt")

    def rank_for(self, name: str) -> int:
        """Rank of module ``name`` (``rank_pattern`` override or ``r``)."""
        return pattern_value(self.rank_pattern, name, self.r)

    def alpha_for(self, name: str) -> float:
        """Alpha of module ``name`` (``alpha_pattern`` override or ``alpha``)."""
        return pattern_value(self.alpha_pattern, name, self.alpha)

    # ---- PEFT adapter_config.json ------------------------------------------------------------
    def to_peft_dict(self, target_modules: list[str] | str, base_model_name_or_path: str | None = None,
                     task_type: str | None = None) -> dict[str, Any]:
        """PEFT ``LoraConfig`` fields (``target_modules`` given resolved, as PEFT stores it)."""
        return {
            "peft_type": "LORA",
            "task_type": task_type,
            "base_model_name_or_path": base_model_name_or_path,
            "revision": None,
            "inference_mode": True,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": target_modules or None,  # None: experts only (PEFT's target_parameters alone)
            "target_parameters": list(self.target_parameters) if self.target_parameters else None,
            "exclude_modules": self.exclude_modules,
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "use_rslora": self.use_rslora,
            "use_dora": self.use_dora,
            "init_lora_weights": True if self.init == "kaiming" else "gaussian",
            "modules_to_save": list(self.modules_to_save) or None,
            "ensure_weight_tying": self.ensure_weight_tying,
            "bias": "none",
            "fan_in_fan_out": False,
            "lora_bias": False,
            "layers_to_transform": None,
            "layers_pattern": None,
        }

    @classmethod
    def from_peft_dict(cls, d: dict[str, Any], source: str = "adapter_config.json", **overrides: Any) -> LoRAConfig:
        """Build a config from PEFT's ``adapter_config.json`` content; unsupported features raise."""
        peft_type = json_str(d, "peft_type", source, default="LORA")
        if peft_type != "LORA":
            raise ValueError(f"{source}: peft_type is {peft_type!r}; ftlib loads LORA adapters only")
        bias = json_str(d, "bias", source, default="none")
        if bias != "none":
            raise ValueError(f"{source}: bias={bias!r} is not supported (only 'none')")
        for key, value in d.items():
            if key in _PEFT_FIELDS or key in _PEFT_METADATA or key in _PEFT_ANY:
                continue
            if key in _PEFT_OFF:
                if any(value == off and type(value) is type(off) for off in _PEFT_OFF[key]):
                    continue
                raise ValueError(f"{source}: field {key!r}={value!r} is not supported by ftlib (PEFT feature "
                                 f"not implemented; only {_PEFT_OFF[key][0]!r} is accepted)")
            if value in (None, False, [], {}, ""):
                continue  # a field of a newer PEFT, switched off
            raise ValueError(f"{source}: field {key!r}={value!r} is not one ftlib implements; it reads "
                             f"{', '.join(_PEFT_FIELDS)} (and metadata {', '.join(_PEFT_METADATA)})")
        init = d.get("init_lora_weights", True)
        if not isinstance(init, (bool, str)):
            raise ValueError(f"{source}: field 'init_lora_weights' must be a boolean or a string, "
                             f"got {init!r} ({type(init).__name__})")
        if init not in (True, False, "gaussian"):
            # PiSSA / OLoRA / LoftQ / CorDA ... rewrite the base weights at init: the adapter only fits that
            # modified base unless PEFT converted it (which saves init_lora_weights=True)
            raise ValueError(
                f"{source}: init_lora_weights={init!r} changes the base weights; convert the adapter with PEFT's "
                "save_pretrained(path_initial_model_for_weight_conversion=...) before loading it on the original base"
            )
        kw = dict(
            r=json_int(d, "r", source, min=1),
            alpha=json_float(d, "lora_alpha", source, min=0, min_open=True),
            dropout=json_float(d, "lora_dropout", source, default=0.0, nullable=True, min=0, max=1,
                               max_open=True) or 0.0,
            target_modules=json_str_list(d, "target_modules", source, or_str=True,
                                         **({} if not d.get("target_parameters") else dict(default=None, nullable=True)))
            or [],
            target_parameters=json_str_list(d, "target_parameters", source, default=None, nullable=True) or None,
            exclude_modules=json_str_list(d, "exclude_modules", source, default=None, nullable=True, or_str=True),
            rank_pattern=json_dict(d, "rank_pattern", source, default=None, nullable=True, values="int",
                                   above=0) or {},
            alpha_pattern=json_dict(d, "alpha_pattern", source, default=None, nullable=True, values="number",
                                    above=0) or {},
            use_rslora=json_bool(d, "use_rslora", source, default=False),
            use_dora=json_bool(d, "use_dora", source, default=False),
            init="gaussian" if init == "gaussian" else "kaiming",
            modules_to_save=json_str_list(d, "modules_to_save", source, default=None, nullable=True) or [],
            ensure_weight_tying=json_bool(d, "ensure_weight_tying", source, default=False),
        )
        kw.update(overrides)
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def replace(self, **changes: Any) -> LoRAConfig:
        return dataclasses.replace(self, **changes)
