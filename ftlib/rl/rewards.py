"""Rewards for RL with verifiable rewards: user callables, weights, checkers, a reward model.

A reward function is any callable ``f(prompts, completions, **fields) -> list[float]`` (TRL's
convention): ``prompts`` and ``completions`` are lists of S items (a prompt repeated once per
completion of its group), ``fields`` the dataset's other columns, each a list of S values (e.g.
``answer``). ``compute_rewards`` calls each function once per rollout batch and sums them with
weights::

    r_i = sum_k w_k f_k(...)_i          (TRL's ``reward_weights``; w_k = 1 by default)

Nothing is lost silently. A function that raises, returns the wrong number of values, or returns a
value that is not a finite real number (``None``, NaN, a string) is an error naming the function
and the sample (prompt, completion) at fault; with ``lenient=True`` that value becomes NaN, is
counted in ``RewardResult.skipped[name]``, and is left out of the sum (a sample whose every value
is NaN gets r_i = NaN, which ``group_advantages`` treats as unscorable: advantage 0, as TRL does
with ``None``). A function that raises in lenient mode skips its whole batch (all S counted).

Built-ins (each returns a reward function):

- ``exact_answer_reward(extract=...)``: 1.0 when the completion's final answer equals the
  sample's ``answer`` field, else 0.0. ``extract`` is ``"last_number"`` (the last integer or
  decimal in the text, thousands commas dropped), ``"boxed"`` (the content of the last
  ``\\boxed{...}``, braces balanced) or a regular expression (its first group, or the whole match,
  of the last match). Numbers compare as numbers (``"4.0" == "4"``), other answers as stripped text.
- ``format_reward(pattern)``: 1.0 when the completion matches ``pattern`` (``re.fullmatch`` after
  stripping, DOTALL), else 0.0.
- ``reward_model_reward(model, tokenizer)``: the scalar score of a trained
  ``ftlib.models.reward`` model on prompt + completion (packed, no padding).

``greedy_reward`` is the held-out number of a run: the mean reward of the greedy (temperature 0)
completion of each prompt, e.g. the exact-match accuracy with ``exact_answer_reward``.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["RewardError", "RewardResult", "boxed_answer", "compute_rewards", "exact_answer_reward",
           "format_reward", "greedy_reward", "last_number", "reward_model_reward"]

RewardFn = Callable[..., Sequence[float]]


class RewardError(ValueError):
    """A reward function failed or returned something that is not a number."""


@dataclass
class RewardResult:
    """Rewards of one rollout batch: ``per_func`` [S, F] (NaN where skipped), ``total`` [S] (weighted sum)."""

    per_func: torch.Tensor
    total: torch.Tensor
    names: list[str]
    skipped: dict[str, int] = field(default_factory=dict)

    def stats(self) -> dict[str, float]:
        """TRL's metric names: ``rewards/<name>/mean`` and ``/std`` per function, ``reward``, ``reward_std``."""
        out = {}
        for k, name in enumerate(self.names):
            col = self.per_func[:, k]
            out[f"rewards/{name}/mean"] = _nanmean(col)
            out[f"rewards/{name}/std"] = _nanstd(col)
            if self.skipped.get(name):
                out[f"rewards/{name}/skipped"] = float(self.skipped[name])
        out["reward"] = _nanmean(self.total)
        out["reward_std"] = _nanstd(self.total)
        return out


def _nanmean(x: torch.Tensor) -> float:
    return float(torch.nanmean(x)) if bool((~torch.isnan(x)).any()) else float("nan")


def _nanstd(x: torch.Tensor) -> float:  # unbiased, as TRL's nanstd
    v = x[~torch.isnan(x)]
    return float(v.std()) if v.numel() > 1 else float("nan")


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _short(x, n: int = 80) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def compute_rewards(funcs: RewardFn | Sequence[RewardFn], prompts: Sequence, completions: Sequence[str], *,
                    weights: Sequence[float] | None = None, lenient: bool = False, **fields) -> RewardResult:
    """Call every reward function on the batch and sum them with ``weights`` (see the module docstring)."""
    if callable(funcs):
        funcs = [funcs]
    funcs = list(funcs)
    if not funcs:
        raise ValueError("compute_rewards: no reward function")
    s = len(completions)
    if len(prompts) != s:
        raise ValueError(f"compute_rewards: {len(prompts)} prompts for {s} completions")
    for k, v in fields.items():
        if len(v) != s:
            raise ValueError(f"compute_rewards: field {k!r} has {len(v)} values for {s} completions")
    w = [1.0] * len(funcs) if weights is None else [float(x) for x in weights]
    if len(w) != len(funcs):
        raise ValueError(f"compute_rewards: {len(w)} weights for {len(funcs)} reward functions")
    names, per, skipped = [], torch.full((s, len(funcs)), float("nan"), dtype=torch.float64), {}
    for k, fn in enumerate(funcs):
        name = _name(fn)
        names.append(name)
        try:
            values = list(fn(list(prompts), list(completions), **fields))
        except Exception as e:
            if not lenient:
                raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
            skipped[name] = s
            continue
        if len(values) != s:
            raise RewardError(f"reward function {name!r} returned {len(values)} values for {s} completions")
        for i, v in enumerate(values):
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))
            if ok:
                per[i, k] = float(v)
                continue
            if not lenient:
                raise RewardError(f"reward function {name!r} returned {_short(v)} (not a finite number) for sample "
                                  f"{i}: prompt {_short(prompts[i])}, completion {_short(completions[i])}")
            skipped[name] = skipped.get(name, 0) + 1
    wt = torch.tensor(w, dtype=torch.float64)
    total = (per * wt).nansum(1)
    total[torch.isnan(per).all(1)] = float("nan")  # unscorable: every function skipped it
    return RewardResult(per, total, names, skipped)


def greedy_reward(model, tokenizer, prompts: Sequence[str], funcs: RewardFn | Sequence[RewardFn], *,
                  max_new_tokens: int, stop_tokens: Sequence[int] | None = None,
                  weights: Sequence[float] | None = None, **fields) -> float:
    """Mean total reward (``compute_rewards``) of one greedy completion per prompt (rendered text; decoded by
    ``ftlib.onpolicy.generate_answers``, eval mode, stop tokens default to the tokenizer's EOS); ``fields``
    one value per prompt."""
    from ..onpolicy import generate_answers

    got = generate_answers(model, tokenizer, list(prompts), temperature=0.0, max_new_tokens=max_new_tokens,
                           stop_tokens=stop_tokens)
    return _nanmean(compute_rewards(funcs, list(prompts), got, weights=weights, **fields).total)


# ---- built-ins ---------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in ``text`` (commas between digits dropped), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _same(got: str | None, want) -> bool:
    if got is None:
        return False
    want = str(want).strip()
    got = got.strip()
    try:
        return float(got.replace(",", "")) == float(want.replace(",", ""))
    except ValueError:
        return got == want


def exact_answer_reward(extract: str = "last_number", *, answer_field: str = "answer") -> RewardFn:
    """A reward function: 1.0 when the extracted final answer equals the ``answer_field`` value, else 0.0."""
    if extract == "last_number":
        get = last_number
    elif extract == "boxed":
        get = boxed_answer
    else:
        rx = re.compile(extract, re.DOTALL)

        def get(text: str) -> str | None:
            ms = list(rx.finditer(text))
            return (ms[-1].group(1) if rx.groups else ms[-1].group(0)) if ms else None

    def exact_answer(prompts, completions, **fields):
        if answer_field not in fields:
            raise KeyError(f"needs the {answer_field!r} field of the dataset")
        return [1.0 if _same(get(c), a) else 0.0 for c, a in zip(completions, fields[answer_field])]

    return exact_answer


def format_reward(pattern: str) -> RewardFn:
    """A reward function: 1.0 when the whole completion (stripped) matches ``pattern``, else 0.0."""
    rx = re.compile(pattern, re.DOTALL)

    def format_match(prompts, completions, **fields):
        return [1.0 if rx.fullmatch(c.strip()) else 0.0 for c in completions]

    return format_match


def reward_model_reward(model, tokenizer, *, render: Callable[[object, str], str] | None = None,
                        max_tokens: int = 16384, device=None) -> RewardFn:
    """A reward function scoring prompt + completion with a trained ``ftlib.models.reward`` model.

    ``render(prompt, completion) -> text`` builds what the model scores (default: the two strings
    joined, the prompt being a string), tokenized without special tokens."""
    from ..models.reward import score

    def reward_model(prompts, completions, **fields):
        texts = [render(p, c) if render is not None else f"{p}{c}" for p, c in zip(prompts, completions)]
        docs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return [float(x) for x in score(model, docs, max_tokens=max_tokens, device=device)]

    return reward_model
