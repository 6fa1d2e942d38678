"""Adapters: LoRA, rsLoRA, DoRA and QLoRA (NF4 base) layers, apply/merge, PEFT-format files.

Typical use::

    from ftlib.lora import LoRAConfig, apply_lora, trainable_params, save_adapter
    apply_lora(model, LoRAConfig(r=16, alpha=32, target_modules="all-linear", quantize="nf4"))
    opt = torch.optim.AdamW(trainable_params(model).values(), lr=2e-4)
    # LoRA+ (lora_B at 16x the learning rate): ftlib.optim.param_groups(model, lr=2e-4, lora_plus_ratio=16)
    ...
    save_adapter(model, "out/adapter")   # loads with peft.PeftModel.from_pretrained
"""

from ..kernels.dora_ref import dora_row_norm, dora_row_norm_direct
from .apply import (
    ParamCount,
    apply_lora,
    count_params,
    disable_adapters,
    get_lora_config,
    lora_layers,
    merge_and_unload,
    merge_lora,
    plan_lora,
    trainable_params,
    unmerge_lora,
)
from .config import LoRAConfig
from .layers import LoRALinear
from .nf4 import NF4Linear, dequantize_nf4, quantize_nf4
from .peft_io import adapter_state_dict, load_adapter, save_adapter
from .rank_decay import ExponentialRank, RankDecay, ShrinkReport, StepRanks, lora_spectrum, shrink_lora

__all__ = [
    "ExponentialRank",
    "LoRAConfig",
    "LoRALinear",
    "NF4Linear",
    "ParamCount",
    "RankDecay",
    "ShrinkReport",
    "StepRanks",
    "adapter_state_dict",
    "apply_lora",
    "count_params",
    "dequantize_nf4",
    "disable_adapters",
    "dora_row_norm",
    "dora_row_norm_direct",
    "get_lora_config",
    "load_adapter",
    "lora_layers",
    "lora_spectrum",
    "merge_and_unload",
    "merge_lora",
    "plan_lora",
    "quantize_nf4",
    "save_adapter",
    "shrink_lora",
    "trainable_params",
    "unmerge_lora",
]
