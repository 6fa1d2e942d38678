"""LoRA on the stacked MoE experts: a per-expert low-rank update of ``gate_up_proj`` / ``down_proj``.

For a stacked weight W [E, out, in] (``ftlib.models.moe.MoEExperts``), expert e computes

    y = x W_e^T + s * (x A_e^T) B_e^T,     A [E, r, in], B [E, out, r],  s = alpha / r (rsLoRA: alpha / sqrt(r))

over its slice of the expert-sorted rows: three grouped products (``grouped_linear``), never a
per-expert copy of the weight or of the activations. B starts at 0 and A as PEFT initialises its
``lora_A`` (Kaiming-uniform on the [E*r, in] matrix), so the adapted model starts equal to the base.

Targets are chosen with PEFT's ``target_parameters`` (a name matches a stacked parameter whose full
name equals it or ends with ``"." + name``: ``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``
or ``["gate_up_proj", "down_proj"]``); ``target_modules`` (attention only by default) adapts the
``nn.Linear`` layers as before. The router (``mlp.gate``) is never adapted. PEFT's ``ParamWrapper``
is the reference for the file layout (``ftlib.lora.peft_io``): ``lora_A.weight`` [E*r, in] is A
flattened expert-major, ``lora_B.weight`` [out, r*E] is B with rank-major, expert-minor columns
(``B.permute(1, 2, 0)``); with both parameters of one module adapted, PEFT nests its wrappers in
the module's parameter order, so ``gate_up_proj``'s tensors are keyed ``experts.base_layer.lora_*``
and ``down_proj``'s ``experts.lora_*`` (one adapted: ``experts.lora_*``). As in PEFT, no dropout or
DoRA on experts (refused by ``apply_lora``); an NF4 base (QLoRA, ``ftlib.lora.nf4_experts``) works as
a full-precision one, except that ``merge`` refuses it (``merge_and_unload`` dequantizes, then merges).

Reference: Hu et al. 2021 (LoRA); PEFT 0.21 ``tuners/lora/layer.py`` ``ParamWrapper``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.moe import MoEExperts, grouped_linear

__all__ = ["ExpertLoRA", "LoRAExperts", "expert_peft_keys", "expert_targets", "from_peft_layout", "to_peft_layout"]

_STACKED = ("gate_up_proj", "down_proj")  # MoEExperts' parameter order (PEFT's nesting follows it)


class ExpertLoRA(nn.Module):
    """The low-rank factors of one stacked weight: ``lora_A`` [E, r, in], ``lora_B`` [E, out, r]."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, r: int, alpha: float, *,
                 use_rslora: bool = False, init: str = "kaiming", device=None, dtype=None):
        super().__init__()
        self.r, self.alpha = r, float(alpha)
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora_A = nn.Parameter(torch.empty(num_experts, r, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(num_experts, out_features, r, device=device, dtype=dtype))
        flat = self.lora_A.data.view(num_experts * r, in_features)  # PEFT's lora_A: Linear(in, r * E)
        if init == "kaiming":
            nn.init.kaiming_uniform_(flat, a=math.sqrt(5))
        else:
            nn.init.normal_(flat, std=1.0 / r)

    def delta(self) -> torch.Tensor:
        """s * B_e A_e for every expert, [E, out, in] (for merging)."""
        return self.scaling * torch.bmm(self.lora_B.float(), self.lora_A.float())


class LoRAExperts(nn.Module):
    """``MoEExperts`` (``base_layer``) plus an ``ExpertLoRA`` per adapted stacked weight (``adapters``)."""

    def __init__(self, base: MoEExperts, adapters: dict[str, ExpertLoRA]):
        super().__init__()
        self.base_layer = base
        self.adapters = nn.ModuleDict(adapters)
        self.merged = False
        self.disabled = False

    def project(self, name: str, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        y = self.base_layer.project(name, x, sizes)
        if self.merged or self.disabled or name not in self.adapters:
            return y
        a = self.adapters[name]
        low = grouped_linear(grouped_linear(x.to(a.lora_A.dtype), a.lora_A, sizes), a.lora_B, sizes)  # (M, out)
        return y + (a.scaling * low).to(y.dtype)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x, experts, weights, project=self.project)

    @torch.no_grad()
    def merge(self) -> None:
        """W += s B A for each adapted weight (fp32 math); ``unmerge`` subtracts it again."""
        if self.merged:
            return
        quantized = [n for n in self.adapters if not isinstance(getattr(self.base_layer, n), torch.Tensor)]
        if quantized:
            raise RuntimeError(f"LoRAExperts.merge: the stacked base weight {quantized[0]} is NF4; merging in place "
                               "would re-quantize and lose the update. Use ftlib.lora.merge_and_unload(model) to "
                               "export a dequantized, merged model")
        for name, a in self.adapters.items():
            w = getattr(self.base_layer, name)
            w.copy_((w.float() + a.delta()).to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        for name, a in self.adapters.items():
            w = getattr(self.base_layer, name)
            w.copy_((w.float() - a.delta()).to(w.dtype))
        self.merged = False


def expert_targets(model: nn.Module, target_parameters: list[str] | None) -> list[tuple[str, str]]:
    """``[(experts module name, stacked parameter name)]`` that ``target_parameters`` selects, in model order.

    Raises ValueError for an entry that matches nothing or names the router.
    """
    if not target_parameters:
        return []
    found, used = [], set()
    for mod_name, mod in model.named_modules():
        plain = isinstance(mod, MoEExperts) and not mod_name.endswith(".base_layer")  # not one already wrapped
        if not (plain or isinstance(mod, LoRAExperts)):
            continue
        for pname in _STACKED:
            full = f"{mod_name}.{pname}"
            hits = [t for t in target_parameters if full == t or full.endswith("." + t)]
            if hits:
                found.append((mod_name, pname))
                used.update(hits)
    for t in target_parameters:
        if t.rsplit(".", 1)[-1] == "weight" and t.split(".")[-2:-1] == ["gate"]:
            raise ValueError(f"apply_lora: target_parameters entry {t!r} names the router; ftlib leaves it frozen")
        if t not in used:
            raise ValueError(f"apply_lora: target_parameters entry {t!r} matched no stacked expert weight "
                             f"(expected one of {', '.join('mlp.experts.' + p for p in _STACKED)})")
    return found


def expert_peft_keys(targets: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """``{(module, parameter): PEFT key stem}``: ``<module>.base_layer`` for ``gate_up_proj`` when
    ``down_proj`` of the same module is adapted too (PEFT nests in parameter order), else ``<module>``."""
    by_module: dict[str, list[str]] = {}
    for mod, p in targets:
        by_module.setdefault(mod, []).append(p)
    out = {}
    for mod, params in by_module.items():
        ordered = [p for p in _STACKED if p in params]
        for depth, p in enumerate(ordered):
            out[(mod, p)] = mod + ".base_layer" * (len(ordered) - 1 - depth)
    return out


def to_peft_layout(a: ExpertLoRA) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A.weight [E*r, in], lora_B.weight [out, r*E]) as PEFT's ParamWrapper holds them."""
    e, r, i = a.lora_A.shape
    return a.lora_A.detach().reshape(e * r, i), a.lora_B.detach().permute(1, 2, 0).reshape(a.lora_B.shape[1], r * e)


def from_peft_layout(lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``to_peft_layout``: (A [E, r, in], B [E, out, r])."""
    r = lora_a.shape[0] // num_experts
    return lora_a.reshape(num_experts, r, lora_a.shape[1]), lora_b.reshape(lora_b.shape[0], r, num_experts).permute(2, 0, 1)
