"""The mixture-of-experts fields of ``LlamaConfig``: read from and written to config.json, checked.

Three families, each a configuration of ftlib's one decoder (``ftlib.models.moe`` holds the block):

- ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms,
  ``attention_bias`` on q/k/v/o) with ``num_experts`` routed experts of width ``moe_intermediate_size``;
  top-``num_experts_per_tok`` of a softmax, renormalised when ``norm_topk_prob``; a sliding window
  on every layer when ``use_sliding_window``;
- ``mixtral`` (Mixtral-8x7B / 8x22B): Mistral's attention, ``num_local_experts`` experts of width
  ``intermediate_size``, top-k always renormalised, ``router_jitter_noise`` (training only);
- ``qwen2_moe`` (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (``qkv_bias``), routed experts plus
  one shared expert of width ``shared_expert_intermediate_size`` gated by ``sigmoid(w . x)``.

Layer ``i`` is sparse when ``num_experts > 0``, ``i`` is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0`` (the Qwen families); otherwise it holds the dense gated MLP of
width ``intermediate_size``. ``router_aux_loss_coef`` is carried for the loop (see
``ftlib.models.moe.RouterStats``).

Reference: transformers' ``Qwen3MoeConfig``, ``MixtralConfig``, ``Qwen2MoeConfig`` (5.25) and the
config.json files published with these models (transformers 5.25 writes Qwen3-MoE's expert count as
``num_local_experts``, the hub files as ``num_experts``: both are read).
"""

from __future__ import annotations

from typing import Any

from .._fields import json_bool, json_float, json_int, json_int_list

__all__ = ["MOE_TYPES", "check_moe", "moe_hf_dict", "read_moe"]

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def read_moe(d: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The MoE keyword arguments of ``LlamaConfig`` from a parsed config.json (empty for a dense family)."""
    if model_type not in MOE_TYPES:
        return {}
    out: dict[str, Any] = {}
    if model_type == "mixtral":
        out["num_experts"] = json_int(d, "num_local_experts", source, default=8, min=1)
        out["moe_intermediate_size"] = json_int(d, "intermediate_size", source, min=1)
        out["norm_topk_prob"] = True  # Mixtral always renormalises its top-k
        out["router_jitter_noise"] = json_float(d, "router_jitter_noise", source, default=0.0, min=0)
    else:
        n = json_int(d, "num_experts", source, default=None, nullable=True, min=0)
        local = json_int(d, "num_local_experts", source, default=None, nullable=True, min=0)
        if n is not None and local is not None and n != local:
            raise ValueError(f"{source}: num_experts={n} and num_local_experts={local} disagree")
        out["num_experts"] = n if n is not None else (local if local is not None else
                                                      (128 if model_type == "qwen3_moe" else 60))
        out["moe_intermediate_size"] = json_int(d, "moe_intermediate_size", source,
                                                default=768 if model_type == "qwen3_moe" else 1408, min=1)
        out["norm_topk_prob"] = json_bool(d, "norm_topk_prob", source, default=False)
        out["decoder_sparse_step"] = json_int(d, "decoder_sparse_step", source, default=1, min=1)
        only = d.get("mlp_only_layers")
        out["mlp_only_layers"] = [] if only == [] else (
            json_int_list(d, "mlp_only_layers", source, default=None, nullable=True, min=0) or [])
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = json_int(d, "shared_expert_intermediate_size", source,
                                                          default=5632, min=1)
    out["num_experts_per_tok"] = json_int(d, "num_experts_per_tok", source,
                                          default={"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8}[model_type], min=1)
    out["router_aux_loss_coef"] = json_float(d, "router_aux_loss_coef", source, default=0.001, min=0)
    return out


def moe_hf_dict(config) -> dict[str, Any]:
    """The MoE keys of ``config``'s config.json under the family's own names (empty for a dense family)."""
    mt = config.model_type
    if mt not in MOE_TYPES:
        return {}
    d: dict[str, Any] = dict(num_experts_per_tok=config.num_experts_per_tok,
                             router_aux_loss_coef=config.router_aux_loss_coef)
    if mt == "mixtral":
        d.update(num_local_experts=config.num_experts, router_jitter_noise=config.router_jitter_noise)
    else:
        d.update(num_experts=config.num_experts, moe_intermediate_size=config.moe_intermediate_size,
                 norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=config.decoder_sparse_step,
                 mlp_only_layers=list(config.mlp_only_layers or []))
    if mt == "qwen2_moe":
        d["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return d


def check_moe(config, source: str) -> None:
    """Raise ``ValueError`` naming ``source`` and the field when the MoE fields are not runnable."""
    mt = config.model_type
    if mt not in MOE_TYPES:
        if config.num_experts:
            raise ValueError(f"{source}: num_experts={config.num_experts} on {mt!r}, which has no experts "
                             f"(MoE families: {', '.join(MOE_TYPES)})")
        return
    if config.num_experts and not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"{source}: num_experts_per_tok={config.num_experts_per_tok} must be in "
                         f"1..num_experts={config.num_experts}")
    if config.num_experts and (not isinstance(config.moe_intermediate_size, int) or config.moe_intermediate_size <= 0):
        raise ValueError(f"{source}: moe_intermediate_size must be a positive integer, got "
                         f"{config.moe_intermediate_size!r}")
    if mt == "qwen2_moe" and (not isinstance(config.shared_expert_intermediate_size, int)
                              or config.shared_expert_intermediate_size <= 0):
        raise ValueError(f"{source}: shared_expert_intermediate_size must be a positive integer, got "
                         f"{config.shared_expert_intermediate_size!r}")
    if mt == "mixtral" and config.norm_topk_prob is not True:
        raise ValueError(f"{source}: mixtral renormalises its top-k (norm_topk_prob must be True)")
    if not isinstance(config.decoder_sparse_step, int) or config.decoder_sparse_step <= 0:
        raise ValueError(f"{source}: decoder_sparse_step must be a positive integer, got {config.decoder_sparse_step!r}")
    for i in config.mlp_only_layers or []:
        if not 0 <= i < config.num_hidden_layers:
            raise ValueError(f"{source}: mlp_only_layers entry {i} is not a layer index "
                             f"(num_hidden_layers={config.num_hidden_layers})")
    if config.router_jitter_noise and mt != "mixtral":
        raise ValueError(f"{source}: router_jitter_noise is Mixtral's; {mt} has none")
    if not 0 <= config.router_jitter_noise < 1:
        raise ValueError(f"{source}: router_jitter_noise must be in [0, 1), got {config.router_jitter_noise!r}")
