"""Rollouts: G completions per prompt from the current policy, and their padding-free packed layout.

``rollout(generator, tokenizer, prompt_ids, group_size=G, sampling=...)`` repeats each prompt G
times (the G samples of prompt j are rows j·G .. j·G + G - 1: a group) and asks a ``Generator``
for one completion each. ``ModelGenerator`` decodes with ``ftlib.models.generate`` (batched, KV
cache; temperature, top-k, top-p, min-p; stop tokens; stop strings, with its ``tokenizer``) with the
model in eval mode (dropout off:
a rollout sampled with dropout on has other log-probs than the ones the loss recomputes) and its
mode restored after. Any other engine (a server, vLLM) plugs in as a callable
``(prompt_ids, sampling, rng) -> list[completion ids]``.

A completion keeps its first stop token (the policy chose to stop: the loss trains that choice,
as TRL's completion mask does) and nothing after it; ``stop_strings`` cut the completion after
the first token at which the decoded text contains one (``ftlib.models.generate.StopStrings``,
checked token by token; whichever stop comes first). ``ModelGenerator`` halts each row at that
token while decoding, so a batch whose rows have all stopped ends early; completions from any
other engine are cut the same way afterwards. A completion that reached
``max_new_tokens`` without stopping is *truncated* (counted; ``mask_truncated`` in
``pack_rollouts`` leaves it out of the loss, DAPO's overlong filtering).

The sampler's RNG is a ``torch.Generator`` the loop owns: ``rng.get_state()`` goes into the
checkpoint and ``rng.set_state`` restores it, so a resumed run samples the same rollouts.

``pack_rollouts`` lays out prompt + completion documents in packed rows (``ftlib.data.pack``
best-fit-decreasing, ``collate_packed``: ``position_ids`` / ``cu_seqlens``, no token attends
across documents, no padding inside a row), labels on the completion tokens only, plus
``token_seq`` [N] (the local sequence of each completion token, in label order) and
``sample_index`` (which rollout sample each local sequence is).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data import collate_packed, pack
from ..models.generate import StopStrings, generate

__all__ = ["Generator", "ModelGenerator", "RolloutBatch", "SamplingConfig", "pack_rollouts", "rollout"]


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled (TRL's names where they exist)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    max_new_tokens: int = 64  # TRL's max_completion_length
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    batch_size: int = 256  # sequences decoded together

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"rollouts sample: temperature must be > 0, got {self.temperature}")


Generator = Callable[[Sequence[Sequence[int]], SamplingConfig, torch.Generator], list[list[int]]]


class ModelGenerator:
    """A ``Generator`` over a ``LlamaForCausalLM`` through ``ftlib.models.generate`` (eval mode while decoding).

    ``tokenizer`` (its ``decode``) is needed for ``sampling.stop_strings``: decoding halts at them.
    """

    def __init__(self, model, pad_token_id: int, device=None, tokenizer=None):
        self.model, self.pad_token_id, self.tokenizer = model, int(pad_token_id), tokenizer
        self.device = device if device is not None else next(model.parameters()).device

    @torch.no_grad()
    def __call__(self, prompt_ids, sampling: SamplingConfig, rng: torch.Generator) -> list[list[int]]:
        out: list[list[int]] = []
        stops = set(sampling.stop_tokens)
        strings = None
        if sampling.stop_strings:
            if self.tokenizer is None:
                raise ValueError("ModelGenerator: sampling.stop_strings needs ModelGenerator(..., tokenizer=...) "
                                 "to halt decoding at them")
            strings = StopStrings(self.tokenizer, sampling.stop_strings)
        was_training = self.model.training
        self.model.eval()
        try:
            for s in range(0, len(prompt_ids), sampling.batch_size):
                chunk = prompt_ids[s : s + sampling.batch_size]
                width = max(map(len, chunk))
                ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.bool)
                for row, e in enumerate(chunk):  # left padding
                    ids[row, width - len(e):] = torch.tensor(list(e), dtype=torch.long)
                    mask[row, width - len(e):] = True
                new = generate(self.model, ids.to(self.device), attention_mask=mask.to(self.device),
                               max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                               top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                               stop_tokens=list(stops), stop_strings=sampling.stop_strings or None,
                               tokenizer=self.tokenizer, pad_token_id=self.pad_token_id, generator=rng)
                out.extend(_cut_at_stop(toks, stops, strings)[0] for toks in new.tolist())
        finally:
            self.model.train(was_training)
        return out


@dataclass
class RolloutBatch:
    """S = n_prompts · group_size samples, groups consecutive."""

    prompts: list  # the prompt objects (str or messages), one per sample
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # the first stop token kept, nothing after
    completions: list[str]  # decoded, the stop token dropped (a stop string's text stays)
    truncated: list[bool]  # reached max_new_tokens without a stop
    group_size: int
    fields: dict = field(default_factory=dict)  # the other dataset columns, one value per sample
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.completion_ids)

    def stats(self) -> dict:
        """TRL's names: ``completions/mean_length``, ``/max_length``, ``/clipped_ratio``; generation tokens/s."""
        lens = np.array([len(c) for c in self.completion_ids], dtype=np.float64)
        n = float(lens.sum())
        return {"completions/mean_length": float(lens.mean()), "completions/max_length": float(lens.max()),
                "completions/min_length": float(lens.min()), "completions/clipped_ratio": float(np.mean(self.truncated)),
                "generation/tokens": n, "generation/seconds": self.seconds,
                "generation/tokens_per_s": n / self.seconds if self.seconds > 0 else 0.0}

    def select(self, keep) -> RolloutBatch:
        """The samples where ``keep`` (a bool sequence or tensor [S]) is true (whole groups, to stay grouped)."""
        idx = [i for i, k in enumerate(torch.as_tensor(keep).tolist()) if k]
        return RolloutBatch([self.prompts[i] for i in idx], [self.prompt_ids[i] for i in idx],
                            [self.completion_ids[i] for i in idx], [self.completions[i] for i in idx],
                            [self.truncated[i] for i in idx], self.group_size,
                            {k: [v[i] for i in idx] for k, v in self.fields.items()}, self.seconds)


def _cut_at_stop(toks: list[int], stops: set[int], strings: StopStrings | None) -> tuple[list[int], bool]:
    """``toks`` up to and including its first stop (a stop token, or the token completing a stop
    string), and whether it stopped; nothing after a stop is kept (``generate`` pads there)."""
    cut = next((j for j, t in enumerate(toks) if t in stops), None)
    if strings is not None:
        at = strings.first_stop(toks if cut is None else toks[:cut])  # a string completed before the token
        cut = at if at is not None else cut
    return (toks, False) if cut is None else (toks[:cut + 1], True)


def rollout(generator: Generator, tokenizer, prompt_ids: Sequence[Sequence[int]], *, group_size: int,
            sampling: SamplingConfig, rng: torch.Generator, prompts: Sequence | None = None,
            fields: dict | None = None) -> RolloutBatch:
    """``group_size`` completions for each prompt (see the module docstring). ``prompts`` (the
    prompt objects the reward functions see; default: the decoded prompt ids) and ``fields``
    (dataset columns, one value per prompt) are repeated per sample."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"rollout: prompt {i} has no tokens")
    rep = [list(p) for p in prompt_ids for _ in range(group_size)]
    t0 = time.perf_counter()
    comp = generator(rep, sampling, rng)
    seconds = time.perf_counter() - t0
    if len(comp) != len(rep):
        raise ValueError(f"the generator returned {len(comp)} completions for {len(rep)} prompts")
    stops = set(sampling.stop_tokens)
    strings = StopStrings(tokenizer, sampling.stop_strings) if sampling.stop_strings else None
    comp_ids, texts, truncated = [], [], []
    for toks in comp:
        toks, stopped = _cut_at_stop(list(toks), stops, strings)
        if not toks:
            raise ValueError("the generator returned an empty completion")
        comp_ids.append(toks)
        truncated.append(not stopped and len(toks) >= sampling.max_new_tokens)
        body = toks[:-1] if toks[-1] in stops else toks
        texts.append(tokenizer.decode(body))
    if prompts is None:
        prompts = [tokenizer.decode(list(p)) for p in prompt_ids]
    if len(prompts) != len(prompt_ids):
        raise ValueError(f"{len(prompts)} prompts for {len(prompt_ids)} prompt_ids")
    f = {k: [v[j] for j in range(len(prompt_ids)) for _ in range(group_size)] for k, v in (fields or {}).items()}
    return RolloutBatch([p for p in prompts for _ in range(group_size)], rep, comp_ids, texts, truncated,
                        group_size, f, seconds)


def pack_rollouts(batch: RolloutBatch, *, max_tokens: int | None = None, pad_id: int = 0,
                  mask_truncated: bool = False, indices: Sequence[int] | None = None) -> list[dict]:
    """Packed micro-batches (one row of at most ``max_tokens`` tokens each; default: all in one row).

    Each dict holds the packed-batch contract (``input_ids``, ``labels``, ``position_ids``,
    ``cu_seqlens``, ``max_seqlen``) for prompt + completion documents with labels on the completion
    tokens, ``token_seq`` [N] and ``sample_index`` [S_row] (see the module docstring). ``indices``:
    which samples (default all); ``mask_truncated``: truncated samples get no labels (no loss).
    """
    idx = list(range(len(batch))) if indices is None else [int(i) for i in indices]
    if not idx:
        raise ValueError("pack_rollouts: no samples")
    docs = [(np.asarray(batch.prompt_ids[i] + batch.completion_ids[i], dtype=np.int64),
             np.r_[np.zeros(len(batch.prompt_ids[i]), np.int64), np.ones(len(batch.completion_ids[i]), np.int64)]
             * (0 if mask_truncated and batch.truncated[i] else 1)) for i in idx]
    lengths = np.array([len(d[0]) for d in docs])
    seq_len = max(int(lengths.max()), int(max_tokens or lengths.sum()))
    plan = pack(lengths, seq_len, overflow="truncate")
    out = []
    for r in range(plan.n_rows):
        b = collate_packed(plan, [r], lambda d: docs[d], pad_id)
        row_docs = [d for d, _, _ in plan.row(r)]
        if b["input_ids"].shape[1] > sum(lengths[d] for d in row_docs):  # trim the padding tail: no pad at all
            n = int(sum(lengths[d] for d in row_docs))
            b = {"input_ids": b["input_ids"][:, :n], "labels": b["labels"][:, :n],
                 "position_ids": b["position_ids"][:, :n], "cu_seqlens": b["cu_seqlens"][:-1].clone(),
                 "max_seqlen": int(lengths[row_docs].max())}
        y = b["labels"][0, 1:]
        doc_of_pos = torch.repeat_interleave(torch.arange(len(row_docs)),
                                             torch.as_tensor(lengths[row_docs]))[1:]  # document of each target
        b["token_seq"] = doc_of_pos[y != -100]
        b["sample_index"] = torch.tensor([idx[d] for d in row_docs], dtype=torch.int64)
        b["n_tokens"] = int(sum(lengths[d] for d in row_docs))
        out.append(b)
    return out
