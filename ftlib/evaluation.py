"""Evaluation: held-out loss and perplexity over a (packed) loader; exact match through generation;
held-out preference pairs (a policy's reward accuracy and margin, a reward model's pairwise accuracy).

Loss. The token-weighted mean over every target token of the held-out set (labels != -100 under
the loss's shift) on every rank, the normalisation training uses (``ftlib.optim``), not a mean
of per-batch means:

    loss = (1 / N) * sum_t -log p(y_t | y_<t),      perplexity = exp(loss)

Packed batches carry ``cu_seqlens``, so no token attends across documents and each document's
loss is what it would be alone (up to float rounding). For a loss over exactly the whole set,
build the loader with ``shuffle=False, drop_last=False``. Runs in eval mode (no dropout) under
``torch.no_grad()`` and puts the model back in the mode it was in.

Exact match. Each prompt is decoded greedily by ``ftlib.models.generate`` (left-padded batches;
positions count real tokens, so padding does not change the result) up to ``max_new_tokens`` or
a stop token; the prediction is the text before the first stop token, and it is correct when
``normalize(prediction) == normalize(reference)`` (default: whitespace runs collapsed, ends
stripped). ``pair_exact_match`` does it for the prompts of a preference-pairs file against their
chosen answers (one-turn answers, each distinct prompt once).

Preference pairs (a ``PairCache``, rank 0 reading every pair in order). For a policy,
``pair_metrics`` runs the loss's own reward definition (``ftlib.preference.PreferenceLoss``;
for DPO the implicit reward ``beta * (log pi(y|x) - log pi_ref(y|x))``) and reports

    reward_accuracy = mean[r(chosen) > r(rejected)],  reward_margin = mean[r(chosen) - r(rejected)],
    logp_accuracy   = mean[log pi(chosen) > log pi(rejected)]    (length-normalised as the loss is)

For a reward model, ``reward_pair_metrics`` reports the Bradley-Terry loss
``mean -log sigmoid(r_c - r_r)`` (Bradley & Terry 1952) and the pairwise accuracy (a tie counts one
half). ``score_pairs`` writes a reward model's scores into the pair records (``reward_chosen``,
``reward_rejected``: the input of the DPO margin filter). ``pair_metrics_table`` lays a policy's numbers before and after training side by side.

Before/after. ``heldout_report`` measures both on one model (loss on every rank, exact match on
rank 0), once before training and once after; ``before_after_table`` prints the two side by side
with the first answers, the report a fine-tuning run ends with (``ftlib sft``, ``examples/sft.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from . import losses
from ._dist import get_rank, get_world_size
from .data import PairLoader, SkipReport, iter_records, render_chat
from .losses import bradley_terry_loss
from .preference import pair_logps, reference_pair_logps

__all__ = [
    "EvalResult",
    "ExactMatch",
    "before_after_table",
    "evaluate",
    "exact_match",
    "heldout_report",
    "pair_exact_match",
    "pair_metrics",
    "pair_metrics_table",
    "reward_pair_metrics",
    "score_pairs",
]


@dataclass
class EvalResult:
    """Held-out loss (mean over target tokens), its perplexity, and what it was measured on."""

    loss: float
    perplexity: float
    tokens: int
    batches: int

    def to_dict(self, prefix: str = "eval_") -> dict[str, float]:
        return {f"{prefix}loss": self.loss, f"{prefix}ppl": self.perplexity, f"{prefix}tokens": self.tokens}


def _param_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, device: torch.device | str | None = None,
             loss_fn: Callable[[nn.Module, dict], tuple[torch.Tensor, torch.Tensor]] | None = None,
             autocast: Callable[[], object] | None = None, max_batches: int | None = None) -> EvalResult:
    """Held-out loss and perplexity of ``model`` over ``loader`` (an iterable of batches).

    ``loss_fn(model, batch) -> (loss_sum, n_tokens)`` defaults to :func:`ftlib.losses.causal_lm_loss`;
    ``autocast`` is a context factory (e.g. ``TrainOptimizer.autocast``); ``max_batches`` stops
    early. Sums are all-reduced over ranks when torch.distributed is initialised (every rank must
    call it). Raises ValueError when the data holds no target token.
    """
    loss_fn = loss_fn or losses.causal_lm_loss
    device = torch.device(device) if device is not None else _param_device(model)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss_sum, tokens]
    batches = 0
    try:
        for batch in loader:
            if max_batches is not None and batches >= max_batches:
                break
            batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
            with autocast() if autocast is not None else nullcontext():
                loss_sum, n = loss_fn(model, batch)
            total += torch.stack([loss_sum.detach().double(), torch.as_tensor(n, device=device).double()])
            batches += 1
    finally:
        model.train(was_training)
    if get_world_size() > 1:
        torch.distributed.all_reduce(total)
    loss_sum, tokens = total.tolist()
    if tokens == 0:
        raise ValueError("evaluate: the evaluation data holds no target token (labels are all -100)")
    loss = loss_sum / tokens
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=int(tokens), batches=batches)


def _normalize(s: str) -> str:
    return " ".join(s.split())


@dataclass
class ExactMatch:
    """Accuracy of greedy answers against references, with every prediction kept."""

    accuracy: float
    correct: int
    total: int
    predictions: list[str] = field(repr=False)
    references: list[str] = field(repr=False)
    hits: list[bool] = field(repr=False)


@torch.no_grad()
def exact_match(model: nn.Module, tokenizer, prompts: Sequence[str], references: Sequence[str], *,
                max_new_tokens: int = 32, batch_size: int = 32, stop_tokens: Sequence[int] | None = None,
                normalize: Callable[[str], str] = _normalize, device: torch.device | str | None = None,
                add_special_tokens: bool = False) -> ExactMatch:
    """Greedy-decode each prompt (text, e.g. a rendered chat prompt) and compare with its reference.

    ``tokenizer`` is an ``ftlib.models.PretrainedTokenizer``; ``stop_tokens`` default to its EOS.
    Prompts are batched by length (``batch_size`` per batch); results keep the input order.
    """
    from .models.generate import generate

    if len(prompts) != len(references):
        raise ValueError(f"exact_match: {len(prompts)} prompts but {len(references)} references")
    if not prompts:
        raise ValueError("exact_match: no prompts")
    if stop_tokens is None:
        stop_tokens = [t for t in (tokenizer.eos_token_id,) if t is not None]
    stops = set(stop_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    device = torch.device(device) if device is not None else _param_device(model)
    encoded = [tokenizer.encode(p, add_special_tokens=add_special_tokens) for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"exact_match: prompt {i} encodes to no tokens")
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    preds: list[str] = [""] * len(encoded)
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            width = max(len(encoded[i]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.bool)
            for row, i in enumerate(idx):  # left padding: the answer starts right after each prompt
                ids[row, width - len(encoded[i]):] = torch.tensor(encoded[i])
                mask[row, width - len(encoded[i]):] = True
            new = generate(model, ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                           stop_tokens=list(stops), pad_token_id=pad)
            for row, i in enumerate(idx):
                toks = new[row].tolist()
                cut = next((j for j, t in enumerate(toks) if t in stops), len(toks))
                preds[i] = tokenizer.decode(toks[:cut])
    finally:
        model.train(was_training)
    hits = [normalize(p) == normalize(r) for p, r in zip(preds, references)]
    correct = sum(hits)
    return ExactMatch(accuracy=correct / len(hits), correct=correct, total=len(hits), predictions=preds,
                      references=list(references), hits=hits)


def heldout_report(model: nn.Module, tokenizer=None, loader=None, prompts: Sequence[str] = (),
                   references: Sequence[str] = (), *, autocast: Callable[[], object] | None = None,
                   loss_fn: Callable[[nn.Module, dict], tuple[torch.Tensor, torch.Tensor]] | None = None,
                   losses: dict | None = None, max_new_tokens: int = 32) -> dict:
    """The held-out numbers of ``model`` as one JSON-able dict: what ``before_after_table`` shows.

    ``eval_loss`` / ``eval_ppl`` / ``eval_tokens`` from ``evaluate(model, loader)`` (collective under
    torch.distributed: every rank calls this), or ``losses`` when they were just measured; with
    ``prompts``, on rank 0 only, ``exact_match`` (the fraction), ``exact_match_correct``,
    ``exact_match_total`` and the ``predictions`` of greedy decoding (``exact_match``)."""
    rep = dict(losses or {})
    if loader is not None and not rep:
        rep.update(evaluate(model, loader, autocast=autocast, loss_fn=loss_fn).to_dict())
    if prompts and get_rank() == 0:
        em = exact_match(model, tokenizer, prompts, references, max_new_tokens=max_new_tokens)
        rep.update(exact_match=em.accuracy, exact_match_correct=em.correct, exact_match_total=em.total,
                   predictions=em.predictions)
    return rep


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def before_after_table(before: dict, after: dict, *, questions: Sequence[str] = (), references: Sequence[str] = (),
                       steps: int, wall_s: float, train_s: float, tokens: int, overlap: int = 0,
                       n_heldout: int | None = None, examples: int = 3) -> list[str]:
    """The lines of the held-out before/after table (``heldout_report`` dicts), empty when there is nothing to show.

    Rows: held-out loss and perplexity (when ``after`` has them), exact match as ``correct/total =
    %`` (``-`` when ``before`` has none); then the run's steps, time and tokens/s, and the first
    ``examples`` questions with the trained model's answer marked right or wrong against
    ``references``. The header says what the overlap check found: ``overlap`` of the ``n_heldout``
    held-out documents have the tokens of a training document (0: none, the held-out set is clean)."""
    rows = []
    if "eval_loss" in after:
        rows += [("held-out loss", f"{before.get('eval_loss', float('nan')):.4f}", f"{after['eval_loss']:.4f}"),
                 ("held-out perplexity", f"{before.get('eval_ppl', float('nan')):.2f}", f"{after['eval_ppl']:.2f}")]
    if "exact_match" in after:
        def em(r):
            return f"{r['exact_match_correct']}/{r['exact_match_total']} = {r['exact_match']:.1%}" if r else "-"
        rows.append(("exact match", em(before if "exact_match" in before else None), em(after)))
    if not rows:
        return []
    n = after.get("exact_match_total")
    lines = [""]
    if overlap:
        what = f"{n} questions; " if n else ""
        lines.append(f"held-out evaluation ({what}{overlap} of {n_heldout} held-out documents are also in the "
                     "training data, exact token match):")
    elif n:
        lines.append(f"held-out evaluation ({n} questions not in the training data):")  # checked: no exact duplicate
    else:
        lines.append("held-out evaluation" + (f" ({n_heldout} documents, none in the training data)" if n_heldout
                                              else "") + ":")
    lines.append(f"  {'':<22}{'before':>16}{'after':>16}")
    lines += [f"  {name:<22}{b:>16}{a:>16}" for name, b, a in rows]
    lines.append(f"  {steps} steps, wall time {wall_s:.0f} s (training {train_s:.0f} s), "
                 f"{tokens / max(train_s, 1e-9):,.0f} tokens/s")
    preds = after.get("predictions") or []
    shown = min(examples, len(questions), len(preds))
    width = max((len(q) for q in questions[:shown]), default=0)
    for i in range(shown):
        verdict = "right" if preds[i].strip() == references[i].strip() else f"wrong, want {references[i]!r}"
        lines.append(f"  {questions[i]:<{width}} -> {_short(preds[i])} ({verdict})")
    if before.get("predictions"):
        lines.append(f"  (before training, the first answer was {_short(before['predictions'][0])})")
    return lines


def _pair_batches(cache, *, pad_id: int, seq_len: int | None, device, packing: bool = True):
    """Every pair of ``cache`` once, in order, one packed row (or one pair) per batch, on ``device``."""
    loader = PairLoader(cache, batch_size=1, seq_len=seq_len, pad_id=pad_id, packing=packing, shuffle=False,
                        drop_last=False, rank=0, world_size=1)  # the caller's rank reads every pair
    for batch in loader:
        yield {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


@torch.no_grad()
def pair_metrics(model: nn.Module, cache, *, loss_fn, pad_id: int, seq_len: int, device=None,
                 autocast: Callable[[], object] | None = None) -> dict:
    """Held-out preference pairs through a policy: ``{"pairs", "reward_accuracy", "reward_margin",
    "logp_accuracy"}`` (module docstring). ``loss_fn`` is a ``PreferenceLoss``; its reference comes from
    the cache when precomputed there, else from ``model`` with its adapters disabled. Eval mode, restored."""
    device = torch.device(device) if device is not None else _param_device(model)
    ctx = autocast if autocast is not None else nullcontext
    was_training = model.training
    model.eval()
    acc = margin = pref = n = 0.0
    try:
        for batch in _pair_batches(cache, pad_id=pad_id, seq_len=seq_len, device=device):
            with ctx():
                policy = pair_logps(model, batch)
            ref = reference_pair_logps(model, batch, autocast=autocast) if loss_fn.needs_reference else None
            res = loss_fn(policy, ref)
            pc, pr = policy.values(loss_fn.normalize)
            acc += float(res.accuracies.sum())
            margin += float(res.margins.sum())
            pref += float((pc > pr).sum())
            n += res.losses.numel()
    finally:
        model.train(was_training)
    if not n:
        raise ValueError(f"pair_metrics: {cache.path} holds no pairs")
    return {"pairs": int(n), "reward_accuracy": acc / n, "reward_margin": margin / n, "logp_accuracy": pref / n}


@torch.no_grad()
def reward_pair_metrics(model: nn.Module, cache, *, pad_id: int, device=None,
                        autocast: Callable[[], object] | None = None) -> dict:
    """Held-out preference pairs through a reward model (``ftlib.models.LlamaRewardModel``):
    ``{"eval_loss": Bradley-Terry loss, "eval_accuracy": pairwise accuracy}``, each side scored as its
    own padded sequence (``ftlib.models.pair_rewards``). Eval mode, restored."""
    from .models import pair_rewards, pairwise_accuracy

    device = torch.device(device) if device is not None else _param_device(model)
    ctx = autocast if autocast is not None else nullcontext
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    try:
        for batch in _pair_batches(cache, pad_id=pad_id, seq_len=None, device=device, packing=False):
            with ctx():
                c, r = pair_rewards(model, batch)
            chosen.append(c.float().cpu())
            rejected.append(r.float().cpu())
    finally:
        model.train(was_training)
    if not chosen:
        raise ValueError(f"reward_pair_metrics: {cache.path} holds no pairs")
    c, r = torch.cat(chosen), torch.cat(rejected)
    loss_sum, n = bradley_terry_loss(c, r, None)
    return {"eval_loss": float(loss_sum) / float(n), "eval_accuracy": pairwise_accuracy(c, r)}


@torch.no_grad()
def score_pairs(model: nn.Module, tokenizer, sources, config, *, report: SkipReport | None = None,
                max_tokens: int = 16384) -> list[dict]:
    """The records of the pairs in ``sources`` that ``config`` (an ``ftlib.data.PairConfig``) formats, each
    with ``reward_chosen`` / ``reward_rejected`` (floats): a reward model's scores (``ftlib.models.score``)
    of exactly the token sequences the pair cache holds for it (its prompt + each side, truncated by
    the same rule). A record the formatter refuses raises (``report`` strict, the default) or is left
    out and counted in ``report`` (lenient)."""
    from .models import score

    fmt = config.formatter(tokenizer.tokenizer)
    report = report if report is not None else SkipReport(strict=True)
    recs, docs = [], []
    for rec, where in iter_records(sources, report):
        doc = fmt(rec, where, report)
        if doc is None:
            continue
        p, c = doc.extra["prompt_len"], doc.extra["chosen_len"]
        ids = doc.input_ids.tolist()
        recs.append(rec)
        docs += [ids[: p + c], ids[:p] + ids[p + c :]]
    if not recs:
        return []
    r = score(model, docs, max_tokens=max_tokens).tolist()
    return [{**rec, "reward_chosen": r[2 * i], "reward_rejected": r[2 * i + 1]} for i, rec in enumerate(recs)]


def pair_exact_match(model: nn.Module, tokenizer, sources, config, *, limit: int, stop_tokens: Sequence[int],
                     device=None) -> dict:
    """Greedy generations for up to ``limit`` distinct prompts of the pairs in ``sources`` (records read
    with ``config``, a chat ``ftlib.data.PairConfig``) against their chosen answers (``exact_match``):
    ``{"exact_match", "generated", "examples"}``; ``{}`` when ``limit`` is 0, the pairs are text, or
    none has a one-turn answer. Records the formatter refuses are left out here (the pair cache
    built from the same sources reports them)."""
    if not limit or config.kind != "chat":
        return {}
    fmt, report = config.formatter(tokenizer.tokenizer), SkipReport(strict=False)
    seen, items = set(), []
    for rec, where in iter_records(sources, SkipReport(strict=False)):
        conv = fmt.conversation(rec, where, report)
        if conv is None or len(conv[1]) != 1:
            continue  # exact match is defined for one-turn answers
        prompt = render_chat(conv[0], config.chat_template, add_generation_prompt=True,
                             bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
        if prompt not in seen:
            seen.add(prompt)
            items.append((prompt, conv[1][0]["content"].strip()))
        if len(items) >= limit:
            break
    if not items:
        return {}
    longest = max(len(tokenizer.encode(a, add_special_tokens=False)) for _, a in items)
    em = exact_match(model, tokenizer, [p for p, _ in items], [a for _, a in items], max_new_tokens=longest + 4,
                     batch_size=16, stop_tokens=stop_tokens, device=device)
    examples = [f"{r!r} -> {p!r}" for p, r in zip(em.predictions[:3], em.references[:3])]
    return {"exact_match": em.accuracy, "generated": em.total, "examples": examples}


def pair_metrics_table(before: dict | None, after: dict) -> str:
    """``pair_metrics`` (+ ``pair_exact_match``) before and after training, one row per number."""
    rows = [("exact match", "exact_match", "{:.3f}"), ("reward accuracy", "reward_accuracy", "{:.3f}"),
            ("mean margin", "reward_margin", "{:.4f}"), ("log-prob accuracy", "logp_accuracy", "{:.3f}")]
    head = f"held-out ({after['pairs']} pairs" + (f", {after['generated']} prompts generated)"
                                                   if "generated" in after else ")")
    lines = [f"{head:<44} {'before':>8} {'after':>8}"]
    for name, key, f in rows:
        if key in after:
            b = f.format(before[key]) if before and key in before else "n/a"
            lines.append(f"{name:<44} {b:>8} {f.format(after[key]):>8}")
    if "examples" in after:
        lines.append("after, e.g.: " + "; ".join(after["examples"][:2]))
    return "\n".join(lines)
