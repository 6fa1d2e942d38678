"""Noise on the input embeddings during training: NEFTune and plain Gaussian, packed-batch aware.

NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning",
arXiv:2310.05914) adds uniform noise to the token embeddings X (L tokens x d dims) of each
training sequence:

    X' = X + (alpha / sqrt(L d)) * U,     U_ij ~ Uniform(-1, 1) independently,

so the noise norm ~ alpha sqrt(1/3) does not grow with the sequence. L is the sequence length:
here it is **each document's** length. In a packed row (``cu_seqlens``) every document gets the
scale of its own length, as if it had been trained alone; in a padded batch
(``attention_mask``) L is the row's number of real tokens and padding gets no noise; a plain
batch uses the row length T. (Implementations that use the padded or packed row length give
short documents in a long row too little noise.) The Gaussian variant adds N(0, std^2) to
every element of real tokens.

It is a forward hook on the embedding module, so the model's code and ``state_dict`` keys are
unchanged (tied ``lm_head`` weights, checkpoints and PEFT files are untouched), and it acts only
while the embedding is in training mode (``model.train()``)::

    noise = EmbeddingNoise.attach(model, neftune_alpha=5.0, seed=seed + rank)
    for step, batch in enumerate(loader):
        noise.set_batch(batch, step=step)   # document lengths + the RNG key of this forward
        loss = ...model(batch["input_ids"], cu_seqlens=..., ...)
    noise.remove()

The forward checks that ``set_batch`` received this very ``input_ids`` tensor, so a stale or
missing batch (wrong document lengths) is an error, not silently wrong noise. The noise of a
forward is a function of (seed, step) alone: runs reproduce and resume exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["EmbeddingNoise", "document_lengths"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64 finaliser (Steele, Lea, Flood 2014): one well-mixed 64-bit word per input."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def document_lengths(input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] int64: the length of the document each token belongs to (0 on padding).

    Packed: from ``cu_seqlens`` over the flattened B*T tokens; padded: the row's real-token
    count where ``attention_mask`` is 1, else 0; plain: T everywhere. No host synchronisation.
    """
    b, t = input_ids.shape
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("document_lengths: a batch has cu_seqlens (packed) or attention_mask (padded), not both")
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int64)
        idx = torch.arange(b * t, device=input_ids.device)
        doc = (torch.searchsorted(cu, idx, right=True) - 1).clamp(0, cu.numel() - 2)
        return (cu[doc + 1] - cu[doc]).view(b, t)
    if attention_mask is not None:
        if attention_mask.shape != (b, t):
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {(b, t)}")
        real = attention_mask.to(device=input_ids.device) != 0
        return torch.where(real, real.sum(-1, keepdim=True), 0)
    return torch.full((b, t), t, dtype=torch.int64, device=input_ids.device)


class EmbeddingNoise:
    """A forward hook adding NEFTune (``neftune_alpha``) or Gaussian (``gaussian_std``) noise.

    Exactly one of ``neftune_alpha`` / ``gaussian_std`` is given (>= 0). ``seed`` keys the noise
    (use seed + rank under data parallelism). ``state_dict`` / ``load_state_dict`` carry the seed
    and the forward counter used when ``set_batch`` gets no step.
    """

    def __init__(self, embedding: nn.Module, *, neftune_alpha: float | None = None,
                 gaussian_std: float | None = None, seed: int = 0):
        if not isinstance(embedding, nn.Embedding) and not hasattr(embedding, "embedding_dim"):
            raise TypeError(f"EmbeddingNoise needs an nn.Embedding (or a module with embedding_dim), "
                            f"got {type(embedding).__name__}")
        if (neftune_alpha is None) == (gaussian_std is None):
            raise ValueError("EmbeddingNoise: give exactly one of neftune_alpha (NEFTune) or gaussian_std")
        scale = neftune_alpha if gaussian_std is None else gaussian_std
        name = "neftune_alpha" if gaussian_std is None else "gaussian_std"
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
            raise ValueError(f"EmbeddingNoise: {name} must be a finite number >= 0, got {scale!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"EmbeddingNoise: seed must be a non-negative int, got {seed!r}")
        self.kind = "neftune" if gaussian_std is None else "gaussian"
        self.scale = float(scale)
        self.seed = seed
        self.calls = 0  # training forwards so far (the RNG step when set_batch gets none)
        self.embedding = embedding
        self._batch: dict | None = None
        self._generators: dict[torch.device, torch.Generator] = {}
        self._handle = embedding.register_forward_hook(self._hook)

    @classmethod
    def attach(cls, model: nn.Module, **kwargs) -> EmbeddingNoise:
        """Hook the input embedding of an ftlib / HF-style causal LM (``model.model.embed_tokens``)."""
        emb = None
        if hasattr(model, "get_input_embeddings"):
            emb = model.get_input_embeddings()
        for path in (("model", "embed_tokens"), ("embed_tokens",)):
            if emb is not None:
                break
            m = model
            for p in path:
                m = getattr(m, p, None)
            emb = m if isinstance(m, nn.Module) else None
        if emb is None:
            if isinstance(model, nn.Embedding):
                emb = model
            else:
                raise ValueError(f"EmbeddingNoise.attach: no input embedding found on {type(model).__name__} "
                                 "(looked for get_input_embeddings(), .model.embed_tokens, .embed_tokens); "
                                 "pass the embedding module to EmbeddingNoise(...) directly")
        return cls(emb, **kwargs)

    def set_batch(self, batch: Mapping, step: int | None = None) -> None:
        """The batch of the next forward: its ``input_ids`` and ``cu_seqlens`` / ``attention_mask``.

        ``step`` keys the noise (default: a counter of training forwards).
        """
        if "input_ids" not in batch:
            raise ValueError(f"EmbeddingNoise.set_batch: the batch has no 'input_ids' (keys: {sorted(batch)})")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"EmbeddingNoise.set_batch: step must be a non-negative int, got {step!r}")
        self._batch = {"input_ids": batch["input_ids"], "cu_seqlens": batch.get("cu_seqlens"),
                       "attention_mask": batch.get("attention_mask"), "step": step}

    def remove(self) -> None:
        """Unhook: the embedding behaves as before."""
        self._handle.remove()

    def state_dict(self) -> dict:
        return {"kind": self.kind, "scale": self.scale, "seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("kind") != self.kind or state.get("scale") != self.scale:
            raise ValueError(f"EmbeddingNoise.load_state_dict: state is {state.get('kind')}={state.get('scale')}, "
                             f"this hook is {self.kind}={self.scale}")
        self.seed, self.calls = int(state["seed"]), int(state["calls"])

    def _generator(self, device: torch.device, step: int) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device)
        g.manual_seed(_splitmix64(_splitmix64(self.seed) ^ step) & ((1 << 63) - 1))
        return g

    def noise(self, out: torch.Tensor, input_ids: torch.Tensor, cu_seqlens=None, attention_mask=None,
              step: int = 0) -> torch.Tensor:
        """The noise tensor added to the embedding output ``out`` [B, T, d] (for tests and tools)."""
        if out.dim() != 3 or out.shape[:2] != input_ids.shape:
            raise ValueError(f"EmbeddingNoise: embedding output {tuple(out.shape)} is not [B, T, d] for input_ids "
                             f"{tuple(input_ids.shape)}")
        d = out.shape[-1]
        lengths = document_lengths(input_ids, cu_seqlens=cu_seqlens, attention_mask=attention_mask)
        g = self._generator(out.device, step)
        if self.kind == "neftune":
            # alpha / sqrt(L d) per token; 0 on padding (L = 0)
            scale = torch.where(lengths > 0, self.scale / torch.sqrt(lengths.clamp(min=1).double() * d), 0.0)
            u = torch.rand(out.shape, generator=g, device=out.device, dtype=out.dtype).mul_(2).sub_(1)
            return u.mul_(scale.to(out.dtype).unsqueeze(-1))
        z = torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype)
        return z.mul_(((lengths > 0).to(out.dtype) * self.scale).unsqueeze(-1))

    def _hook(self, module, args, out):
        if not module.training or self.scale == 0.0:
            return None
        input_ids = args[0] if args else None
        b = self._batch
        if b is None or b["input_ids"] is not input_ids:
            raise RuntimeError("EmbeddingNoise: call noise.set_batch(batch) with this forward's batch before the "
                               "forward (the noise scale needs each document's length; the hook saw "
                               + ("no batch)" if b is None else "a different input_ids tensor)"))
        step = self.calls if b["step"] is None else b["step"]
        self.calls += 1
        return out + self.noise(out, input_ids, b["cu_seqlens"], b["attention_mask"], step)
