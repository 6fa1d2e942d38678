"""Preference pairs: records -> (prompt, chosen, rejected) token ids with response-only loss masks,
stored in the Arrow token cache, one document per pair.

Records (JSONL / Parquet / any source of ``ftlib.data.readers``), field names configurable:

``prompt``     a string (one user turn) or a list of ``{"role", "content"}`` messages;
``messages``   the prompt conversation as a message list (used when present, before ``prompt``);
``chosen``, ``rejected``  each a string (one assistant turn) or a message list. A list may repeat
               the prompt messages first (the "full conversation" convention of UltraFeedback-style
               datasets): that prefix is removed. Without a prompt field both lists are full
               conversations and the prompt is their longest common prefix of whole messages that
               is followed by an assistant turn on both sides (the "implicit prompt" convention);
``system``     optional system message (only when ``PairConfig.system_field`` names it);
``reward_chosen``, ``reward_rejected``  optional numbers (scores of a reward model; written e.g.
               by a reward-model scoring pass), and/or ``margin``: optional number. Missing or
               null means "no score" (NaN in the cache). The margin used for filtering is
               ``margin`` when present, else ``reward_chosen - reward_rejected``.

Formatting (``kind="chat"``): the prompt messages plus each side's messages are rendered with the
chat template and tokenized jointly, exactly as SFT data (``ftlib.data.formatting.Formatter``, so
the template, BOS/EOS and turn-end rules are the same). Only the response carries loss: the
assistant turns that belong to the prompt (earlier turns of a multi-turn prompt) are masked out.
The prompt is the longest common token prefix of the two rendered sides that ends before the
first response token, so both sides share it token for token. ``kind="text"`` (no template):
``[bos] + encode(prompt)`` then ``encode(response) + [eos]`` per side (``add_eos`` defaults to
True here), the response tokens carrying loss.

Truncation (``max_length`` = the longest sequence, prompt + one response). With ``p`` the prompt
length, ``R`` the longer response and ``F = max_prompt_length`` (default ``max_length // 2``):

1. a prompt longer than ``max_prompt_length`` (when set) keeps its last ``max_prompt_length`` tokens;
2. if ``p + R > max_length`` the prompt is cut from the left (a leading BOS stays) to
   ``max(max_length - R, min(p, F))`` tokens: the prompt gives way first, down to ``F``;
3. if it still does not fit, both responses are cut from the right to the same budget
   ``max_length - p'`` (a shorter response stays whole), so neither side is favoured.

Truncated pairs are counted (``n_truncated``). Pairs whose two responses are the same token
sequence (before, or only after, truncation) carry no preference and are reported
(``identical_responses``, ``identical_after_truncation``); like every bad record they raise in
strict mode and are counted in lenient mode.

Cache layout. One cache document per pair: ``input_ids = prompt | chosen | rejected`` and a
``loss_mask`` of bit flags: bit 0 = the token carries loss, bit 1 = chosen response, bit 2 =
rejected response (0 = prompt, 3 = chosen token with loss, 5 = rejected token with loss, ...).
Per-document columns (the cache's int64 columns): ``prompt_len``, ``chosen_len``,
``rejected_len``, and ``reward_chosen``, ``reward_rejected``, ``margin`` as the int64 bit patterns
of float64 values (exact; NaN = absent; ``PairCache`` views them back as floats). The **pair id** is
the document index in the cache (stable for a given cache: sources in order, records in order).
A pair cache is an ordinary ``TokenCache`` (fingerprinted, incremental, memory-mapped); do not
train SFT on it (its mask is not a 0/1 loss mask). Reference log-probabilities can be
precomputed into it (``ftlib.preference.precompute_reference``): ``reference/<name>.safetensors``.

Unpaired examples (KTO; ``PairConfig(unpaired=True)``): TRL's unpaired format, one record per
example, ``prompt`` (or ``messages``), ``completion`` (a string or a message list, as a side above)
and ``label`` (true = desirable, false = undesirable; anything else is a ``bad_field`` error). The
same formatter, truncation (with the completion as both "responses") and cache: the completion is
stored as the chosen side when the label is true and as the rejected side when it is false, the
other side empty (length 0; a preference pair never has an empty side), so
``PairCache.unpaired`` is read from the lengths and ``PairCache.label`` = ``chosen_len > 0``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from .cache import CacheError, TokenCache, build_cache
from .formatting import BUILTIN_TEMPLATES, BadMessages, FormatConfig, Formatter, check_messages
from .pretruncate import encode_bounded

__all__ = [
    "CHOSEN_BIT",
    "LOSS_BIT",
    "PairCache",
    "PairConfig",
    "PairDoc",
    "PairFormatter",
    "REJECTED_BIT",
    "build_pair_cache",
    "open_pair_cache",
]

LOSS_BIT, CHOSEN_BIT, REJECTED_BIT = 1, 2, 4
_LENGTHS = ("prompt_len", "chosen_len", "rejected_len")
_SCORES = ("reward_chosen", "reward_rejected", "margin")  # float64, stored as their int64 bit patterns


def _float_bits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


@dataclass(frozen=True)
class PairConfig:
    """How preference records become pair documents (plain values: hashed into the cache key).

    ``formatter(tokenizer)`` and ``columns`` are the token cache's formatter hook.
    """

    columns: ClassVar[tuple[str, ...]] = _LENGTHS + _SCORES

    kind: str = "chat"  # "chat" | "text"
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_field: str | None = None
    reward_chosen_field: str = "reward_chosen"
    reward_rejected_field: str = "reward_rejected"
    margin_field: str = "margin"
    unpaired: bool = False  # KTO's records: prompt, completion, label (module docstring)
    completion_field: str = "completion"
    label_field: str = "label"
    chat_template: str | None = None  # built-in name or Jinja text; required for chat
    turn_end: str | None = None
    bos_token: str | int | None = None
    eos_token: str | int | None = None
    add_bos: bool = False
    add_eos: bool | None = None  # None: True for text, False for chat (the template ends turns)
    max_length: int | None = None  # prompt + one response
    max_prompt_length: int | None = None

    def __post_init__(self):
        if self.kind not in ("chat", "text"):
            raise ValueError(f"PairConfig.kind must be chat|text, got {self.kind!r}")
        if self.kind == "chat" and not self.chat_template:
            raise ValueError("PairConfig.kind='chat' needs chat_template (a name or Jinja text)")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError("PairConfig.max_length must be >= 2 (a prompt token and a response token)")
        if self.max_prompt_length is not None:
            if self.max_prompt_length < 1:
                raise ValueError("PairConfig.max_prompt_length must be >= 1")
            if self.max_length is not None and self.max_prompt_length >= self.max_length:
                raise ValueError(f"PairConfig.max_prompt_length={self.max_prompt_length} leaves no room for a "
                                 f"response within max_length={self.max_length}")

    def fingerprint(self) -> str:
        d = asdict(self)
        d["chat_template"] = BUILTIN_TEMPLATES.get(self.chat_template, self.chat_template)
        d["layout"] = "unpaired-v1" if self.unpaired else "pairs-v1"
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def formatter(self, tokenizer) -> PairFormatter:
        """The callable that formats records with these settings (the token cache's hook)."""
        return PairFormatter(tokenizer, self)


@dataclass
class PairDoc:
    input_ids: np.ndarray  # (p + c + r,) int64: prompt | chosen | rejected
    loss_mask: np.ndarray  # (p + c + r,) uint8 bit flags (module docstring)
    truncated: bool
    extra: dict  # PairConfig.columns -> int (the scores as float64 bit patterns)


def _runs(mask: np.ndarray) -> np.ndarray:
    """Start positions of the runs of nonzero values in ``mask``."""
    m = (mask != 0).astype(np.int8)
    return np.flatnonzero(np.diff(np.concatenate([[0], m])) == 1)


class PairFormatter:
    """Callable ``formatter(record, location, report) -> PairDoc | None`` (see the module docstring).

    ``report`` is a ``ftlib.data.SkipReport``; ``stats`` counts truncated pairs.
    """

    def __init__(self, tokenizer, config: PairConfig):
        self.tok, self.cfg = tokenizer, config
        c = config
        add_eos = c.add_eos if c.add_eos is not None else c.kind == "text"
        # the SFT formatter does the chat rendering and checks the special tokens; no truncation there
        self.fmt = Formatter(tokenizer, FormatConfig(
            kind="chat" if c.kind == "chat" else "text", chat_template=c.chat_template, turn_end=c.turn_end,
            bos_token=c.bos_token, eos_token=c.eos_token, add_bos=c.add_bos, add_eos=add_eos))
        self.add_eos = add_eos
        self.stats = {"n_truncated": 0}
        # the two "responses": an unpaired record's completion plays both, so one set of rules formats it
        self.sides = ((c.completion_field,) * 2 if c.unpaired else (c.chosen_field, c.rejected_field))

    @property
    def n_truncated(self) -> int:
        return self.stats["n_truncated"]

    # -- record -> messages ----------------------------------------------------------------------
    def _messages(self, value, field: str, where: str, report, role: str | None):
        if isinstance(value, str):
            if role is None:
                report.add("bad_field", where, f"field {field!r}: a string needs a prompt field beside it")
                return None
            return [{"role": role, "content": value}]
        if not isinstance(value, list) or not value:
            report.add("bad_field", where, f"field {field!r} must be a string or a non-empty list of messages")
            return None
        try:  # the formatter's validator: one set of rules for SFT records and pairs
            return check_messages(value, field, roles=None, name_field=True)
        except BadMessages as e:
            report.add(e.reason, where, str(e))
            return None

    def conversation(self, rec: dict, where: str, report):
        """(prompt, chosen, rejected) message lists of a chat record, or None (reported)."""
        c = self.cfg
        for f in self.sides:
            if f not in rec:
                report.add("missing_field", where, f"field {f!r} not in record")
                return None
        pfield = c.messages_field if c.messages_field in rec else c.prompt_field if c.prompt_field in rec else None
        prompt = None
        if pfield is not None:
            prompt = self._messages(rec[pfield], pfield, where, report, role="user")
            if prompt is None:
                return None
        sides = []
        for f in self.sides:
            s = self._messages(rec[f], f, where, report, role="assistant" if prompt is not None else None)
            if s is None:
                return None
            if prompt is not None and len(s) > len(prompt) and s[: len(prompt)] == prompt:
                s = s[len(prompt):]  # full-conversation convention: the side repeats the prompt
            sides.append(s)
        chosen, rejected = sides
        if prompt is None:  # implicit prompt: the longest shared message prefix followed by assistant turns
            k = 0
            while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
                k += 1
            while k > 0 and not (k < len(chosen) and k < len(rejected)
                                 and chosen[k]["role"] == rejected[k]["role"] == "assistant"):
                k -= 1
            if k == 0:
                report.add("missing_field", where, f"no prompt: neither {c.messages_field!r} nor {c.prompt_field!r} "
                           "is present and the two sides share no leading messages")
                return None
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        if c.system_field and isinstance(rec.get(c.system_field), str) and rec[c.system_field].strip():
            if prompt[0]["role"] != "system":
                prompt = [{"role": "system", "content": rec[c.system_field]}] + prompt
        if prompt[-1]["role"] == "assistant":
            report.add("bad_field", where, "the prompt ends with an assistant turn; the responses must be the "
                       "next assistant turn")
            return None
        for name, s in zip(self.sides, (chosen, rejected)):
            if s[0]["role"] != "assistant":
                report.add("bad_field", where, f"{name} must start with an assistant turn, got role {s[0]['role']!r}")
                return None
            if all(not m["content"].strip() for m in s if m["role"] == "assistant"):
                report.add("empty_response", where, f"every assistant turn of {name} is empty")
                return None
        return prompt, chosen, rejected

    def _number(self, rec: dict, field: str, where: str, report):
        v = rec.get(field)
        if v is None:
            return math.nan
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            report.add("bad_field", where, f"field {field!r} must be a finite number or null, got {v!r}")
            return None
        return float(v)

    # -- tokens ------------------------------------------------------------------------------------
    def _chat_sides(self, rec, where, report):
        conv = self.conversation(rec, where, report)
        if conv is None:
            return None
        prompt, chosen, rejected = conv
        n_prompt_turns = sum(m["role"] == "assistant" for m in prompt)
        out = []
        for side in (chosen, rejected):
            doc = self.fmt({"messages": prompt + side}, where, report)
            if doc is None:
                return None
            ids, mask = doc.input_ids, doc.loss_mask.copy()
            runs = _runs(mask)
            if len(runs) <= n_prompt_turns:
                report.add("no_loss_tokens", where, "the chat template gives the response no loss tokens")
                return None
            start = int(runs[n_prompt_turns])  # first token of the response (earlier runs: prompt turns)
            mask[:start] = 0
            out.append((ids, mask, start))
        (ic, mc, sc), (ir, mr, sr) = out
        n = min(sc, sr)
        p = int(np.argmax(ic[:n] != ir[:n])) if (ic[:n] != ir[:n]).any() else n  # common token prefix
        return ic[:p], (ic[p:], mc[p:]), (ir[p:], mr[p:])

    def _text_sides(self, rec, where, report):
        c = self.cfg
        for f in (c.prompt_field, *self.sides):
            if f not in rec:
                report.add("missing_field", where, f"field {f!r} not in record")
                return None
            if not isinstance(rec[f], str):
                report.add("bad_field", where, f"field {f!r} is {type(rec[f]).__name__}, not a string (kind='text')")
                return None
        if not rec[c.prompt_field].strip():
            report.add("empty_document", where, f"field {c.prompt_field!r} is empty")
            return None
        # only the ends the truncation keeps are tokenized (pretruncate.py): the prompt's tail, each response's head
        enc = lambda s, n, keep: np.asarray(encode_bounded(self.tok, s, n, keep, self.stats), dtype=np.int64)
        prompt = enc(rec[c.prompt_field], c.max_length if c.max_length is not None else c.max_prompt_length, "tail")
        if c.add_bos:
            prompt = np.concatenate([[self.fmt.bos_id], prompt])
        sides = []
        for f in self.sides:
            ids = enc(rec[f], c.max_length, "head")
            if not rec[f].strip() or len(ids) == 0:
                report.add("empty_response", where, f"field {f!r} is empty")
                return None
            if self.add_eos:
                ids = np.concatenate([ids, [self.fmt.eos_id]])
            sides.append((ids, np.ones(len(ids), np.uint8)))
        return prompt, sides[0], sides[1]

    def _truncate(self, prompt, chosen, rejected):
        c = self.cfg
        L, Fp = c.max_length, c.max_prompt_length
        first = 1 if len(prompt) and self.fmt.bos_id is not None and prompt[0] == self.fmt.bos_id else 0
        cut = False

        def left_cut(p, keep):
            return np.concatenate([p[:first], p[len(p) - (keep - first):]]) if keep >= first else p[:keep]

        if Fp is not None and len(prompt) > Fp:
            prompt, cut = left_cut(prompt, Fp), True
        if L is not None:
            R = max(len(chosen[0]), len(rejected[0]))
            if len(prompt) + R > L:
                floor = Fp if Fp is not None else L // 2
                keep = max(L - R, min(len(prompt), floor))
                if keep < len(prompt):
                    prompt, cut = left_cut(prompt, keep), True
                budget = L - len(prompt)
                if R > budget:
                    chosen = (chosen[0][:budget], chosen[1][:budget])
                    rejected = (rejected[0][:budget], rejected[1][:budget])
                    cut = True
        return prompt, chosen, rejected, cut

    def __call__(self, rec: dict, where: str, report) -> PairDoc | None:
        c = self.cfg
        label = None
        if c.unpaired:
            if c.label_field not in rec:
                report.add("missing_field", where, f"field {c.label_field!r} not in record")
                return None
            label = rec[c.label_field]
            if not isinstance(label, bool):
                report.add("bad_field", where, f"field {c.label_field!r} must be true or false, got {label!r}")
                return None
        rewards = [self._number(rec, f, where, report)
                   for f in (c.reward_chosen_field, c.reward_rejected_field, c.margin_field)]
        if any(r is None for r in rewards):
            return None
        if math.isnan(rewards[0]) != math.isnan(rewards[1]):
            report.add("bad_field", where, f"{c.reward_chosen_field!r} and {c.reward_rejected_field!r} must be "
                       "given together (one is missing or null)")
            return None
        sides = self._chat_sides(rec, where, report) if c.kind == "chat" else self._text_sides(rec, where, report)
        if sides is None:
            return None
        prompt, chosen, rejected = sides
        same = lambda a, b: len(a[0]) == len(b[0]) and bool((a[0] == b[0]).all())
        if label is None and same(chosen, rejected):
            report.add("identical_responses", where, "chosen and rejected are the same token sequence")
            return None
        if len(prompt) == 0:
            report.add("bad_field", where, "the prompt renders to no tokens")
            return None
        prompt, chosen, rejected, cut = self._truncate(prompt, chosen, rejected)
        if cut:
            self.stats["n_truncated"] += 1
            if label is None and same(chosen, rejected):
                report.add("identical_after_truncation", where,
                           f"the responses differ only after max_length={c.max_length}; raise it")
                return None
            if not (chosen[1].any() and rejected[1].any()):
                report.add("no_loss_tokens", where, f"a response has no loss token left within max_length={c.max_length}")
                return None
        if label is not None:  # the completion on its label's side, the other side empty
            empty = (chosen[0][:0], chosen[1][:0])
            chosen, rejected = (chosen, empty) if label else (empty, chosen)
        ids = np.concatenate([prompt, chosen[0], rejected[0]]).astype(np.int64)
        flags = np.concatenate([np.zeros(len(prompt), np.uint8),
                                CHOSEN_BIT | (chosen[1] != 0).astype(np.uint8),
                                REJECTED_BIT | (rejected[1] != 0).astype(np.uint8)]).astype(np.uint8)
        extra = {"prompt_len": len(prompt), "chosen_len": len(chosen[0]), "rejected_len": len(rejected[0]),
                 **{k: _float_bits(v) for k, v in zip(_SCORES, rewards)}}
        return PairDoc(ids, flags, cut, extra)


class PairCache:
    """A built pair cache: ``len(cache)`` pairs; ``cache.pair(i)`` and ``cache.sequence(i, side)``.

    Arrays (n_pairs,): ``prompt_len``, ``chosen_len``, ``rejected_len`` int64; ``reward_chosen``,
    ``reward_rejected``, ``margin`` float64 (NaN = absent); ``unpaired`` (a KTO cache: ``label`` bool
    (n,), ``example(i)``); ``effective_margin`` (``margin``, else
    the reward difference). ``reference`` is ``None`` or the attached reference log-probs
    (``{"chosen": (n,), "rejected": (n,)}`` float64 sums over response tokens) with its metadata.
    Pickles as its path (and attached reference name), so DataLoader workers reopen it.
    """

    def __init__(self, cache: TokenCache | str, reference: str | None = None, verify: str = "sample"):
        self.tokens = cache if isinstance(cache, TokenCache) else TokenCache(cache, verify=verify)
        self.path = self.tokens.path
        ex = getattr(self.tokens, "columns", {})
        missing = [n for n in PairConfig.columns if n not in ex]
        if missing:
            raise CacheError(f"{self.path}: not a pair cache (no {missing} columns); build it with "
                             "ftlib.data.pairs.build_pair_cache")
        self.prompt_len, self.chosen_len, self.rejected_len = (ex[k].astype(np.int64) for k in _LENGTHS)
        if not np.array_equal(self.prompt_len + self.chosen_len + self.rejected_len, self.tokens.lengths):
            raise CacheError(f"{self.path}: pair lengths disagree with the stored documents (corrupt); rebuild")
        self.reward_chosen, self.reward_rejected, self.margin = (ex[k].astype(np.int64).view(np.float64) for k in _SCORES)
        self.effective_margin = np.where(np.isfinite(self.margin), self.margin, self.reward_chosen - self.reward_rejected)
        empty_c, empty_r = self.chosen_len == 0, self.rejected_len == 0
        self.unpaired = bool(len(self) and (empty_c | empty_r).any())
        if self.unpaired and not (empty_c ^ empty_r).all():
            raise CacheError(f"{self.path}: mixes pairs and unpaired examples (corrupt); rebuild")
        self.label = ~empty_c if self.unpaired else None  # unpaired: True = desirable
        self.report, self.n_truncated = self.tokens.report, self.tokens.n_truncated
        self.reference: dict | None = None
        self.reference_name: str | None = None
        if reference is not None:
            self.load_reference(reference)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def side_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(prompt + chosen, prompt + rejected) sequence lengths per pair."""
        return self.prompt_len + self.chosen_len, self.prompt_len + self.rejected_len

    def pair(self, i: int):
        """(prompt ids, (chosen ids, chosen 0/1 loss mask), (rejected ids, rejected loss mask)) NumPy views."""
        ids, flags = self.tokens[i]
        p, c = int(self.prompt_len[i]), int(self.chosen_len[i])
        loss = flags & LOSS_BIT
        return ids[:p], (ids[p : p + c], loss[p : p + c]), (ids[p + c :], loss[p + c :])

    def example(self, i: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], bool]:
        """Unpaired caches: (prompt ids, (completion ids, 0/1 loss mask), label) of example ``i``."""
        if not self.unpaired:
            raise ValueError(f"{self.path}: a pair cache; example() reads unpaired (KTO) caches")
        prompt, chosen, rejected = self.pair(i)
        return (prompt, chosen, True) if self.label[i] else (prompt, rejected, False)

    def sequence(self, i: int, side: str) -> tuple[np.ndarray, np.ndarray]:
        """The prompt + ``side`` ("chosen" | "rejected") sequence of pair ``i``: (int64 ids, 0/1 loss mask)."""
        prompt, chosen, rejected = self.pair(i)
        ids, loss = {"chosen": chosen, "rejected": rejected}[side]
        return (np.concatenate([prompt, ids]).astype(np.int64),
                np.concatenate([np.zeros(len(prompt), np.uint8), loss]))

    # -- precomputed reference log-probs ---------------------------------------------------------
    def reference_path(self, name: str) -> str:
        if not name or os.sep in name or name.startswith("."):
            raise ValueError(f"reference name must be a plain file name, got {name!r}")
        return os.path.join(self.path, "reference", name + ".safetensors")

    def fingerprint(self) -> str:
        """Identity of the cached pairs (shard keys in order): a reference belongs to exactly this cache."""
        keys = [s["key"] for s in self.tokens.manifest["shards"]]
        return hashlib.sha256(json.dumps([keys, len(self)]).encode()).hexdigest()

    def load_reference(self, name: str) -> None:
        """Attach ``reference/<name>.safetensors`` (written by ``ftlib.preference.precompute_reference``)."""
        from safetensors import safe_open

        path = self.reference_path(name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no precomputed reference of that name; run precompute_reference")
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("cache_fingerprint") != self.fingerprint():
                raise CacheError(f"{path}: computed for another cache (fingerprint mismatch); recompute it")
            ref = {k: f.get_tensor(k) for k in ("chosen", "rejected")}
        for k, v in ref.items():
            if v.shape != (len(self),) or not np.isfinite(v).all():
                raise CacheError(f"{path}: {k} must be {len(self)} finite values, got shape {v.shape}")
        self.reference = {**ref, "metadata": meta}
        self.reference_name = name

    def __getstate__(self):
        return {"path": self.path, "reference": self.reference_name}

    def __setstate__(self, state):
        self.__init__(state["path"], reference=state["reference"], verify="none")


def build_pair_cache(sources, tokenizer, config: PairConfig, cache_dir: str, **kwargs) -> PairCache:
    """Tokenize preference records into a pair cache (``build_cache`` with the pair formatter).

    ``kwargs`` go to :func:`ftlib.data.build_cache` (``num_proc``, ``strict``, ``progress``, ...).
    """
    if not isinstance(config, PairConfig):
        raise TypeError(f"build_pair_cache needs a PairConfig, got {type(config).__name__}")
    return PairCache(build_cache(sources, tokenizer, config, cache_dir, **kwargs))


def open_pair_cache(cache_dir: str, reference: str | None = None, verify: str = "sample") -> PairCache:
    """Open a built pair cache (optionally with a precomputed reference attached)."""
    return PairCache(cache_dir, reference=reference, verify=verify)
