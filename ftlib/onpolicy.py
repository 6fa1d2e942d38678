"""On-policy preference pairs: the model's own answers to training prompts, scored, paired from its mistakes.

The simplest form of iterative / online DPO (Xu et al. 2023, "Some things are more CRINGE than others";
Pang et al. 2024, "Iterative reasoning preference optimization"; Guo et al. 2024, "Direct language
model alignment from online AI feedback"): pairs a model already ranks right teach DPO little and
invite likelihood displacement, pairs made of the model's own mistakes teach it where it errs.
For each training prompt x (a conversation ending with a user turn):

    candidates  y_0 = the greedy answer, y_1..y_k = k answers sampled at ``temperature`` (top-k / top-p
                optional), all from ``ftlib.models.generate``; the text before the first stop token,
                ends stripped. Empty answers and repeats (equal after whitespace runs collapse) are
                dropped and counted.
    reference   optionally the known right answer r of x (the SFT target): a candidate for chosen only
    scores      s(y) = score_fn([x...], [y...])  (a user function: a checker, exact match, or a reward
                model through ``reward_model_scorer``)
    chosen      c = the best-scoring model answer (ties: greedy first, then sampling order); the
                reference instead when s(r) > s(c) (the model never got x right)
    rejected    every model answer with s(y) < s(c) - ``min_gap``: the greedy one first, then the
                best-scoring (hardest) ones, at most ``max_pairs_per_prompt``

So a pair's two sides never hold the same text (after whitespace normalisation) and the chosen side
always scores strictly higher. A prompt whose candidates all score the same gives no pair (counted).
A NaN score ranks nothing: that answer (or reference) is neither chosen nor rejected, counted in
``nan_scores``; a prompt whose every model answer scored NaN is counted in ``nan_prompts``, not as
a prompt without a mistake (``no_pair``).

Held-out prompts. ``exclude`` lists prompts that must never reach training (the held-out set): a
training prompt whose user turns equal those of an excluded prompt (contents whitespace-normalised;
system turns ignored) is an error (``strict=True``) or skipped and counted (``strict=False``).

Records come out as the preference pipeline reads them (``ftlib.data.pairs``): ``{"messages": x,
"chosen": str, "rejected": str, "reward_chosen": s(c), "reward_rejected": s(y), "chosen_from",
"rejected_from"}`` (``greedy`` / ``sample`` / ``reference``). ``write_pairs`` writes them as JSONL
atomically; ``ftlib.data.pairs.build_pair_cache`` tokenizes that file into the pair cache.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .data import render_chat
from .models.generate import generate

__all__ = ["OnPolicyConfig", "OnPolicyPairs", "OnPolicyStats", "build_onpolicy_pairs", "generate_answers",
           "prompt_key", "reward_model_scorer", "split_last_answer", "write_pairs"]

ScoreFn = Callable[[list[list[dict]], list[str]], Sequence[float]]


@dataclass(frozen=True)
class OnPolicyConfig:
    """How many answers per prompt and how they are decoded, and which pairs are kept."""

    samples: int = 4  # sampled answers per prompt, besides the greedy one
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 64
    batch_size: int = 64  # sequences decoded together
    min_gap: float = 0.0  # a rejected answer scores below the chosen one by more than this
    max_pairs_per_prompt: int = 2
    use_reference: bool = True  # the reference answer may be chosen when no model answer is as good
    seed: int = 0

    def __post_init__(self):
        if self.samples < 0:
            raise ValueError(f"samples must be >= 0, got {self.samples}")
        if self.samples and not self.temperature > 0:
            raise ValueError(f"sampled answers need temperature > 0, got {self.temperature}")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.max_pairs_per_prompt < 1:
            raise ValueError("max_new_tokens, batch_size and max_pairs_per_prompt must be >= 1")
        if not self.min_gap >= 0:
            raise ValueError(f"min_gap must be >= 0, got {self.min_gap}")


@dataclass
class OnPolicyStats:
    """Counts of one build: nothing is dropped without being counted here."""

    prompts: int = 0
    candidates: int = 0  # model answers kept (after empty / repeated ones are dropped)
    empty_answers: int = 0
    repeated_answers: int = 0
    excluded_prompts: int = 0  # held-out prompts skipped (strict=False)
    greedy_best: int = 0  # prompts whose greedy answer scores as high as any candidate (and the reference)
    no_pair: int = 0  # prompts whose candidates all score the same (no mistake to learn from)
    nan_scores: int = 0  # answers and references scored NaN by score_fn: never chosen or rejected
    nan_prompts: int = 0  # prompts whose every model answer scored NaN (no pair, and not counted in no_pair)
    reference_chosen: int = 0  # pairs whose chosen side is the reference answer
    pairs: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class OnPolicyPairs:
    records: list[dict]
    stats: OnPolicyStats
    answers: list[list[str]] = field(repr=False, default_factory=list)  # per prompt: greedy, then the samples kept


def _norm(s: str) -> str:
    return " ".join(s.split())


def prompt_key(prompt: str | list[dict]) -> tuple[str, ...]:
    """What makes two prompts the same for ``exclude``: their user turns, whitespace-normalised."""
    if isinstance(prompt, str):
        return (_norm(prompt),)
    return tuple(_norm(m["content"]) for m in prompt if m.get("role") == "user")


def split_last_answer(messages: list[dict]) -> tuple[list[dict], str]:
    """(prompt turns, the final assistant answer) of a chat record's ``messages``."""
    if not messages or messages[-1].get("role") != "assistant" or len(messages) < 2:
        raise ValueError("messages must end with an assistant turn after a prompt turn")
    return [dict(m) for m in messages[:-1]], messages[-1]["content"]


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: Sequence[str], *, temperature: float = 0.0, top_k: int | None = None,
                     top_p: float | None = None, max_new_tokens: int = 64, batch_size: int = 64,
                     stop_tokens: Sequence[int] | None = None, generator: torch.Generator | None = None,
                     device=None) -> list[str]:
    """One decoded answer per prompt (rendered text): left-padded batches through ``ftlib.models.generate``,
    cut at the first stop token (default: the tokenizer's EOS), ends stripped. Eval mode, restored after."""
    if stop_tokens is None:
        stop_tokens = [t for t in (tokenizer.eos_token_id,) if t is not None]
    stops = set(stop_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    device = device if device is not None else next(model.parameters()).device
    enc = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for i, ids in enumerate(enc):
        if not ids:
            raise ValueError(f"generate_answers: prompt {i} encodes to no tokens")
    out = [""] * len(enc)
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(enc), batch_size):
            chunk = enc[s : s + batch_size]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.bool)
            for row, e in enumerate(chunk):  # left padding: each answer starts right after its prompt
                ids[row, width - len(e):] = torch.tensor(e)
                mask[row, width - len(e):] = True
            new = generate(model, ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=list(stops),
                           pad_token_id=pad, generator=generator)
            for row, toks in enumerate(new.tolist()):
                cut = next((j for j, t in enumerate(toks) if t in stops), len(toks))
                out[s + row] = tokenizer.decode(toks[:cut]).strip()
    finally:
        model.train(was_training)
    return out


def build_onpolicy_pairs(model, tokenizer, prompts: Sequence[list[dict]], score_fn: ScoreFn, *, chat_template: str,
                         references: Sequence[str | None] | None = None, exclude: Iterable[str | list[dict]] = (),
                         config: OnPolicyConfig = OnPolicyConfig(), strict: bool = True,
                         stop_tokens: Sequence[int] | None = None, device=None) -> OnPolicyPairs:
    """Pairs from the model's own answers to ``prompts`` (message lists ending with a user turn; module docstring).

    ``score_fn(prompts, answers) -> scores`` scores a batch (higher = better); ``references`` the
    known right answers (or None per prompt); ``exclude`` the held-out prompts that must not appear.
    The prompt is rendered with ``chat_template`` and the generation prompt (the tokenizer's BOS/EOS
    strings passed to the template). Sampling uses its own generator seeded with ``config.seed``.
    """
    cfg = config
    if references is not None and len(references) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(references)} references")
    banned = {prompt_key(p) for p in exclude}
    stats = OnPolicyStats()
    keep: list[int] = []
    for i, p in enumerate(prompts):
        if not p or p[-1].get("role") != "user":
            raise ValueError(f"prompt {i} must be a non-empty message list ending with a user turn")
        if prompt_key(p) in banned:
            if strict:
                raise ValueError(f"prompt {i} is a held-out prompt ({prompt_key(p)!r}); on-policy pairs must come "
                                 "from training prompts only (strict=False skips and counts them)")
            stats.excluded_prompts += 1
            continue
        keep.append(i)
    bos, eos = getattr(tokenizer, "bos_token", None) or "", getattr(tokenizer, "eos_token", None) or ""
    texts = [render_chat(prompts[i], chat_template, add_generation_prompt=True, bos_token=bos, eos_token=eos)
             for i in keep]
    kw = dict(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, stop_tokens=stop_tokens, device=device)
    greedy = generate_answers(model, tokenizer, texts, **kw)
    gen = torch.Generator(device=device if device is not None else next(model.parameters()).device)
    gen.manual_seed(cfg.seed)
    sampled = generate_answers(model, tokenizer, [t for t in texts for _ in range(cfg.samples)],
                               temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, generator=gen,
                               **kw) if cfg.samples else []

    # candidates per prompt: (text, origin); empty and repeated answers dropped and counted
    cands: list[list[tuple[str, str]]] = []
    for j in range(len(keep)):
        seen, mine = set(), []
        for text, origin in [(greedy[j], "greedy")] + [(a, "sample") for a in sampled[j * cfg.samples:(j + 1) * cfg.samples]]:
            if not text:
                stats.empty_answers += 1
            elif _norm(text) in seen:
                stats.repeated_answers += 1
            else:
                seen.add(_norm(text))
                mine.append((text, origin))
        cands.append(mine)
    stats.prompts, stats.candidates = len(keep), sum(map(len, cands))

    # one score_fn call for every model answer and reference
    flat_p, flat_a, owner = [], [], []
    for j, i in enumerate(keep):
        for text, _ in cands[j]:
            flat_p.append(prompts[i])
            flat_a.append(text)
            owner.append(j)
        ref = references[i] if references is not None and cfg.use_reference else None
        if ref is not None and ref.strip():
            flat_p.append(prompts[i])
            flat_a.append(ref.strip())
            owner.append(-1 - j)  # the reference of prompt j
    scores = [float(s) for s in score_fn(flat_p, flat_a)] if flat_a else []
    if len(scores) != len(flat_a):
        raise ValueError(f"score_fn returned {len(scores)} scores for {len(flat_a)} answers")
    per: list[list[float]] = [[] for _ in keep]
    ref_score: dict[int, tuple[str, float]] = {}
    for o, a, s in zip(owner, flat_a, scores):
        if o >= 0:
            per[o].append(s)
        elif math.isnan(s):
            stats.nan_scores += 1
        else:
            ref_score[-1 - o] = (a, s)

    records, answers = [], []
    for j, i in enumerate(keep):
        answers.append([t for t, _ in cands[j]])
        if not cands[j]:
            stats.no_pair += 1
            continue
        scored = [k for k, v in enumerate(per[j]) if not math.isnan(v)]  # NaN ranks nothing: left out, counted
        stats.nan_scores += len(per[j]) - len(scored)
        if not scored:
            stats.nan_prompts += 1
            continue
        mine, sc = [cands[j][k] for k in scored], [per[j][k] for k in scored]
        best = max(range(len(sc)), key=lambda k: (sc[k], -k))  # ties: the earlier (greedy first)
        chosen, chosen_score, chosen_from = mine[best][0], sc[best], mine[best][1]
        if j in ref_score and ref_score[j][1] > chosen_score:
            chosen, chosen_score, chosen_from = ref_score[j][0], ref_score[j][1], "reference"
        if mine[0][1] == "greedy" and sc[0] >= chosen_score:
            stats.greedy_best += 1
        losers = [k for k in range(len(sc)) if sc[k] < chosen_score - cfg.min_gap
                  and _norm(mine[k][0]) != _norm(chosen)]
        losers.sort(key=lambda k: (mine[k][1] != "greedy", -sc[k], k))
        if not losers:
            stats.no_pair += 1
            continue
        for k in losers[: cfg.max_pairs_per_prompt]:
            records.append({"messages": [dict(m) for m in prompts[i]], "chosen": chosen, "rejected": mine[k][0],
                            "reward_chosen": chosen_score, "reward_rejected": sc[k], "chosen_from": chosen_from,
                            "rejected_from": mine[k][1]})
            stats.reference_chosen += chosen_from == "reference"
    stats.pairs = len(records)
    return OnPolicyPairs(records, stats, answers)


def write_pairs(records: Iterable[dict], path: str | Path) -> Path:
    """Write pair records as JSONL, atomically (a crash leaves no half file); returns the path."""
    from ._atomic import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def reward_model_scorer(reward_model, tokenizer, chat_template: str, *, bos_token: str = "", eos_token: str = "",
                        autocast: Callable[[], object] | None = None, max_tokens: int = 16384) -> ScoreFn:
    """A ``score_fn`` from a trained reward model (``ftlib.models.LlamaRewardModel``): each prompt plus
    answer rendered with ``chat_template`` as one conversation, scored by ``ftlib.models.score``."""
    from contextlib import nullcontext

    from .models import score

    def score_fn(prompts: list[list[dict]], answers: list[str]) -> list[float]:
        docs = [tokenizer.encode(render_chat(p + [{"role": "assistant", "content": a}], chat_template,
                                             bos_token=bos_token, eos_token=eos_token), add_special_tokens=False)
                for p, a in zip(prompts, answers)]
        with autocast() if autocast is not None else nullcontext():
            return score(reward_model, docs, max_tokens=max_tokens).tolist()

    return score_fn
