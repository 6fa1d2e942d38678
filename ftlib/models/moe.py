"""The mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral, Qwen2-MoE) and its router statistics.

For the tokens x [N, H] of one layer, E experts, top-k routing:

    z = x W_r^T                                  router logits [N, E]  (``gate.weight`` [E, H])
    p = softmax(z) (fp32);  (w, e) = topk(p, k)   w [N, k], e [N, k]
    w <- w / sum(w)                               when ``norm_topk_prob`` (Mixtral: always)
    y_n = sum_j w_nj * down_e(act(gate_e(x_n)) * up_e(x_n)),  e = e_nj
    Qwen2-MoE adds  sigmoid(x . w_s) * shared(x)  (one dense gated MLP on every token)

The routed experts are held stacked, ``experts.gate_up_proj`` [E, 2I, H] (gate rows first, then up)
and ``experts.down_proj`` [E, H, I] (``[E, out, in]``, the layout of transformers 5's
``*Experts`` modules, so PEFT's ``target_parameters`` names apply unchanged); ``ftlib.models.moe_hub``
converts from and to the per-expert tensors of the hub. Grouped computation: the N*k (token,
expert) pairs are sorted by expert once per layer (a stable argsort; one host sync for the group
sizes), the token rows gathered once, and each projection is one grouped product over the
contiguous per-expert slices of the sorted rows (``grouped_linear``: one GEMM per expert on its
slice, never a loop over tokens); the weighted results are scattered back with one ``index_add_``
in expert order, the same summation order as transformers, so fp32 results agree to rounding.
``torch._grouped_mm`` is not used: on this torch (2.13, CPU) its backward fails.

``RouterStats`` collects each sparse layer's logits during a forward (``model(ids,
router_stats=stats)``) and gives the auxiliary losses a loop adds to its loss:

    load balancing (Switch, eq. 4-6; transformers' ``load_balancing_loss_func``):
        f_e = (top-k assignments to e) / T,  P_e = (sum of p_e) / T   over all sparse layers' tokens T
        L_aux = E * sum_e f_e P_e      (training loss += router_aux_loss_coef * L_aux)
    router z-loss (ST-MoE, Zoph et al. 2022, eq. 5):  L_z = mean over tokens and layers of logsumexp(z)^2

over the tokens of ``token_mask`` (the forward's ``attention_mask`` by default: padding never
counts; a packed row's documents all count). ``tokens_per_expert()`` gives the per-layer counts
and ``utilisation()`` their summary for a log line (busiest / idlest expert's load against an even
split, idle experts).

References: Shazeer et al. 2017 (sparsely-gated MoE), Fedus et al. 2021 (Switch Transformer),
Jiang et al. 2024 (Mixtral), Qwen Team 2024/2025 (Qwen2-MoE, Qwen3); transformers 5.25's
``modeling_qwen3_moe.py``, ``modeling_mixtral.py``, ``modeling_qwen2_moe.py`` are the specification.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import swiglu

__all__ = ["MoEExperts", "RouterStats", "SharedExpert", "SparseMoeBlock", "TopKRouter", "grouped_linear"]


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """y [M, out] = the rows of x [M, in], sorted by group, each times its group's weight [G, out, in]^T.

    ``sizes[g]`` rows of group g, in order (``sum(sizes) == M``). One GEMM per group on a contiguous
    slice; an empty group costs nothing.
    """
    ws = weight.unbind(0)  # one view per group; its backward stacks the gradients once (no E zero-filled copies)
    parts = [F.linear(rows, ws[g]) for g, rows in enumerate(x.split(sizes)) if sizes[g]]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


class TopKRouter(nn.Module):
    """Softmax top-k router: ``weight`` [E, H]; returns logits [N, E], weights [N, k], experts [N, k]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 fp32_weights: bool = False):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.fp32_weights = fp32_weights  # Mixtral weighs the experts' outputs in fp32; Qwen in x's dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)
        top, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, (top if self.fp32_weights else top.to(logits.dtype)), experts

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)


class MoEExperts(nn.Module):
    """E gated MLPs held stacked: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, act: str):
        super().__init__()
        self.num_experts, self.act = num_experts, act
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def project(self, name: str, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """One grouped product with the stacked weight ``name`` over expert-sorted rows (adapters override it)."""
        return grouped_linear(x, getattr(self, name), sizes)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, project=None) -> torch.Tensor:
        """x [N, H], experts / weights [N, k] -> sum_j weights_j * expert_j(x) [N, H].

        ``project(name, rows, sizes)``: the grouped product to use (default ``self.project``; an
        adapter wrapping this module passes its own, base plus low-rank term).
        """
        project = self.project if project is None else project
        k = experts.shape[-1]
        flat = experts.reshape(-1)  # (N*k,) one (token, expert) pair per entry
        order = torch.argsort(flat, stable=True)  # pairs sorted by expert, tokens in order within one
        sizes = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync
        token = order // k  # (N*k,) the token of each sorted pair
        h = project("gate_up_proj", x[token], sizes)  # (N*k, 2I)
        g, u = h.chunk(2, dim=-1)
        h = swiglu(g, u) if self.act == "silu" else F.gelu(g, approximate="tanh") * u
        o = project("down_proj", h, sizes)  # (N*k, H)
        o = (o * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, o)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: down_proj(silu(gate_proj(x)) * up_proj(x)) on every token."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(swiglu(g, u) if self.act == "silu" else F.gelu(g, approximate="tanh") * u)


class SparseMoeBlock(nn.Module):
    """Router ``gate``, routed ``experts`` and (Qwen2-MoE) ``shared_expert`` + ``shared_expert_gate``."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        h, act = config.hidden_size, config.hidden_act
        self.layer_idx = layer_idx
        self.jitter = config.router_jitter_noise
        self.gate = TopKRouter(h, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob,
                               fp32_weights=config.model_type == "mixtral")
        self.experts = MoEExperts(h, config.moe_intermediate_size, config.num_experts, act)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size is not None:
            self.shared_expert = SharedExpert(h, config.shared_expert_intermediate_size, act)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor, stats: RouterStats | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, H)
        if self.training and self.jitter > 0:  # Mixtral: multiplicative noise on router and experts' input
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits, weights, experts = self.gate(x)
        if stats is not None:
            stats.record(self.layer_idx, logits, experts)
        y = self.experts(x, experts, weights)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.view(shape)


class RouterStats:
    """The router logits of one forward's sparse layers, and the losses and counts computed from them.

    Pass one to ``model(input_ids, ..., router_stats=stats)``; the forward clears it and fills it.
    ``token_mask`` [B, T] (1 = counts) defaults to the forward's ``attention_mask``; set it to leave
    out a packed row's padding tail.
    """

    def __init__(self, token_mask: torch.Tensor | None = None):
        self.token_mask = token_mask
        self.num_experts = 0
        self.top_k = 0
        self.logits: dict[int, torch.Tensor] = {}  # layer -> (N, E)
        self.experts: dict[int, torch.Tensor] = {}  # layer -> (N, k) chosen experts
        self._mask: torch.Tensor | None = None  # (N,) float, set by ``begin``

    def begin(self, attention_mask: torch.Tensor | None, num_experts: int, top_k: int) -> None:
        """Called by the model at the start of a forward: forget the last one, fix the token mask."""
        self.logits, self.experts = {}, {}
        self.num_experts, self.top_k = num_experts, top_k
        mask = self.token_mask if self.token_mask is not None else attention_mask
        self._mask = None if mask is None else mask.reshape(-1).float()

    def record(self, layer: int, logits: torch.Tensor, experts: torch.Tensor) -> None:
        """Keep a layer's logits (N, E) and top-k choices (N, k); a recomputation overwrites the same entry."""
        if self._mask is not None and self._mask.numel() != logits.shape[0]:
            raise ValueError(f"RouterStats: token_mask has {self._mask.numel()} entries for {logits.shape[0]} tokens")
        self.logits[layer], self.experts[layer] = logits, experts

    def _weights(self, n: int, device) -> torch.Tensor:
        return torch.ones(n, device=device) if self._mask is None else self._mask.to(device)

    def load_balancing_loss(self) -> torch.Tensor:
        """E * sum_e f_e P_e over every recorded layer's counted tokens (unscaled; 0 without sparse layers)."""
        if not self.logits:
            return torch.zeros(())
        e = self.num_experts
        first = next(iter(self.logits.values()))
        counts = torch.zeros(e, device=first.device)
        prob_sum = torch.zeros(e, device=first.device)
        rows = torch.zeros((), device=first.device)
        for z in self.logits.values():
            m = self._weights(z.shape[0], z.device)
            p = torch.softmax(z.float(), dim=-1)  # (N, E)
            chosen = torch.topk(p, self.top_k, dim=-1).indices
            counts = counts.scatter_add(0, chosen.reshape(-1), m.repeat_interleave(self.top_k))
            prob_sum = prob_sum + (p * m[:, None]).sum(0)
            rows = rows + m.sum()
        return e * torch.sum((counts / rows) * (prob_sum / rows))

    def z_loss(self) -> torch.Tensor:
        """Mean of logsumexp(z)^2 over every recorded layer's counted tokens (0 without sparse layers)."""
        if not self.logits:
            return torch.zeros(())
        total, rows = 0.0, 0.0
        for z in self.logits.values():
            m = self._weights(z.shape[0], z.device)
            total = total + (torch.logsumexp(z.float(), dim=-1).square() * m).sum()
            rows = rows + m.sum()
        return total / rows

    def utilisation(self) -> dict[str, float]:
        """Expert utilisation for a log line: over the sparse layers, the busiest and idlest expert's load
        relative to an even split (1.0 = balanced), and how many (layer, expert) pairs got no token."""
        counts = self.tokens_per_expert()
        if counts.numel() == 0:
            return {}
        even = counts.sum(-1, keepdim=True) / self.num_experts  # (L, 1) tokens an expert gets when balanced
        load = counts / even.clamp(min=1e-12)
        return {"expert_load_max": float(load.max()), "expert_load_min": float(load.min()),
                "experts_idle": float((counts == 0).sum())}

    def tokens_per_expert(self) -> torch.Tensor:
        """(sparse layers, E) float counts of counted tokens routed to each expert (no gradient)."""
        out = []
        for chosen in self.experts.values():
            m = self._weights(chosen.shape[0], chosen.device)
            c = torch.zeros(self.num_experts, device=chosen.device)
            out.append(c.scatter_add(0, chosen.reshape(-1), m.repeat_interleave(chosen.shape[-1])))
        return torch.stack(out) if out else torch.zeros(0, self.num_experts)
