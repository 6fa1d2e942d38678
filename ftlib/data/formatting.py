"""Records -> token ids + loss mask: raw text, chat ``messages`` and prompt/response records.

Three kinds (``FormatConfig.kind``):

``text``         continued pre-training: ``[bos] + encode(record[text_field]) + [eos]``; every
                 token carries loss.
``chat``         ``record[messages_field]`` (a list of ``{"role", "content"}``) rendered with a
                 Jinja chat template (the tokenizer's, from tokenizer_config.json, or a built-in
                 one: ``chatml``, ``llama3``), in a sandbox (``ImmutableSandboxedEnvironment``:
                 templates cannot reach Python internals).
``instruction``  ``record[prompt_field]`` / ``record[response_field]`` (and an optional
                 ``system_field``) turned into a user/assistant conversation, then as ``chat``.

Loss mask (``loss_on="assistant"``, the default for chat). The template is rendered once with
every assistant ``content`` wrapped in private-use sentinel characters; the sentinels give the
exact character spans of assistant content in the rendered text, and are removed (the result
is checked to equal the plain rendering). Each span is extended over the turn-end marker that
immediately follows it (``turn_end``: ``<|im_end|>`` for chatml, ``<|eot_id|>`` for llama3, the
EOS text otherwise) so the model learns to stop. A token carries loss iff its character range
(from the tokenizer's offsets) overlaps an assistant span. ``loss_on="all"`` puts every token in
the loss. A record whose every assistant turn is blank is reported as ``empty_response`` (with
loss on assistant turns only, it would teach the model to answer with nothing).

Labels. This module returns a 0/1 ``loss_mask`` aligned with ``input_ids``; the collator and
packer turn it into ``labels`` aligned with ``input_ids`` (same position, *not* shifted: the
loss compares logits[t] with labels[t + 1]), with -100 where the mask is 0.

Truncation (``max_length``). ``truncation="prompt_left"`` (default) cuts the leading prompt (the
tokens without loss before the first response token; a leading BOS is kept) from the left until
the record fits, and only if that prompt is exhausted cuts what remains from the right (response
tokens, later turns); the result is always one contiguous window of the record (after the BOS).
``"right"`` keeps the first ``max_length`` tokens. Truncated records are counted in
``Formatter.n_truncated``.

EOS is explicit: ``add_bos`` / ``add_eos`` (text default: no BOS, EOS appended; chat: the
template decides BOS, ``add_eos`` appends EOS after the rendered conversation).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

import numpy as np

from .._jinja import compile_template
from .sources import SkipReport

__all__ = ["FormatConfig", "FormattedDoc", "Formatter", "render_chat", "BUILTIN_TEMPLATES"]

BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}
_TURN_END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
_S0, _S1 = "\ue000", "\ue001"  # private-use code points: assistant content start / end sentinels
_SENTINELS = re.compile(f"[{_S0}{_S1}]")


def render_chat(messages: list[dict], template: str, **kwargs) -> str:
    """Render ``messages`` with a Jinja chat template (built-in name or template text)."""
    template = BUILTIN_TEMPLATES.get(template, template)
    return compile_template(template).render(messages=messages, **kwargs)


@dataclass(frozen=True)
class FormatConfig:
    """How records become tokens. Plain values only, so it hashes into the cache fingerprint."""

    kind: str = "text"  # "text" | "chat" | "instruction"
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_field: str | None = None
    chat_template: str | None = None  # built-in name or Jinja text; required for chat/instruction
    turn_end: str | None = None  # text after assistant content that also gets loss
    loss_on: str = "assistant"  # "assistant" | "all" (chat); text always trains on all tokens
    bos_token: str | int | None = None
    eos_token: str | int | None = None
    add_bos: bool = False
    add_eos: bool | None = None  # None: True for text, False for chat
    max_length: int | None = None
    truncation: str = "prompt_left"  # "prompt_left" | "right"

    def __post_init__(self):
        if self.kind not in ("text", "chat", "instruction"):
            raise ValueError(f"FormatConfig.kind must be text|chat|instruction, got {self.kind!r}")
        if self.kind != "text" and not self.chat_template:
            raise ValueError(f"FormatConfig.kind={self.kind!r} needs chat_template (a name or Jinja text)")
        if self.loss_on not in ("assistant", "all"):
            raise ValueError(f"FormatConfig.loss_on must be assistant|all, got {self.loss_on!r}")
        if self.truncation not in ("prompt_left", "right"):
            raise ValueError(f"FormatConfig.truncation must be prompt_left|right, got {self.truncation!r}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError("FormatConfig.max_length must be >= 1")

    def fingerprint(self) -> str:
        d = asdict(self)
        d["chat_template"] = BUILTIN_TEMPLATES.get(self.chat_template, self.chat_template)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


@dataclass
class FormattedDoc:
    input_ids: np.ndarray  # (L,) int64
    loss_mask: np.ndarray  # (L,) uint8, 1 = token carries loss
    truncated: bool = False


class Formatter:
    """Callable ``formatter(record, location, report) -> FormattedDoc | None``.

    ``tokenizer`` is a ``tokenizers.Tokenizer``. Special tokens named by string must be in its
    vocabulary. Records that cannot be formatted are reported to ``report`` (see sources.py).
    """

    def __init__(self, tokenizer, config: FormatConfig):
        self.tok = tokenizer
        self.cfg = config
        self.bos_id = self._token_id(config.bos_token, "bos_token")
        self.eos_id = self._token_id(config.eos_token, "eos_token")
        self.add_eos = config.add_eos if config.add_eos is not None else config.kind == "text"
        if config.add_bos and self.bos_id is None:
            raise ValueError("FormatConfig.add_bos=True needs bos_token")
        if self.add_eos and self.eos_id is None:
            raise ValueError("appending EOS needs FormatConfig.eos_token (or set add_eos=False)")
        self.bos_text = config.bos_token if isinstance(config.bos_token, str) else self._id_text(self.bos_id)
        self.eos_text = config.eos_token if isinstance(config.eos_token, str) else self._id_text(self.eos_id)
        self.turn_end = config.turn_end or _TURN_END.get(config.chat_template or "", None) or self.eos_text
        self.n_truncated = 0

    def _token_id(self, tok, name):
        if isinstance(tok, int):
            n = self.tok.get_vocab_size(with_added_tokens=True)
            if not 0 <= tok < n:
                raise ValueError(f"FormatConfig.{name}={tok} is not a token id (vocabulary of {n})")
            return tok
        if tok is None:
            return tok
        i = self.tok.token_to_id(tok)
        if i is None:
            raise ValueError(f"FormatConfig.{name}={tok!r} is not in the tokenizer vocabulary")
        return i

    def _id_text(self, i):
        return None if i is None else self.tok.id_to_token(i)

    # -- record -> (text, assistant spans) ------------------------------------------------------
    def _messages(self, rec: dict, where: str, report: SkipReport):
        c = self.cfg
        if c.kind == "instruction":
            msgs = []
            for f in ([c.system_field] if c.system_field else []) + [c.prompt_field, c.response_field]:
                if f not in rec:
                    report.add("missing_field", where, f"field {f!r} not in record")
                    return None
            if c.system_field:
                msgs.append({"role": "system", "content": rec[c.system_field]})
            msgs += [{"role": "user", "content": rec[c.prompt_field]},
                     {"role": "assistant", "content": rec[c.response_field]}]
        else:
            if c.messages_field not in rec:
                report.add("missing_field", where, f"field {c.messages_field!r} not in record")
                return None
            msgs = rec[c.messages_field]
            if not isinstance(msgs, list) or not msgs:
                report.add("bad_field", where, f"field {c.messages_field!r} must be a non-empty list")
                return None
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                report.add("bad_field", where, f"message {j} needs string 'role' and 'content'")
                return None
            if _S0 in m["content"] or _S1 in m["content"]:
                report.add("bad_field", where, f"message {j} contains reserved code points U+E000/U+E001")
                return None
        if all(not m["content"].strip() for m in msgs):
            report.add("empty_document", where, "all message contents are empty")
            return None
        answers = [m for m in msgs if m["role"] == "assistant"]
        if c.loss_on == "assistant" and answers and all(not m["content"].strip() for m in answers):
            # only the turn end would carry loss: the model would learn to answer with nothing
            report.add("empty_response", where, "every assistant turn is empty")
            return None
        return msgs

    def _render(self, msgs: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        kw = {"bos_token": self.bos_text or "", "eos_token": self.eos_text or "", "add_generation_prompt": False}
        plain = render_chat(msgs, self.cfg.chat_template, **kw)
        for strip in (False, True):
            marked = [
                {**m, "content": _S0 + (m["content"].strip() if strip else m["content"]) + _S1}
                if m["role"] == "assistant" else m
                for m in msgs
            ]
            text = render_chat(marked, self.cfg.chat_template, **kw)
            # strip the sentinels, recording the [start, end) of each wrapped content
            parts = _SENTINELS.split(text)
            seps = _SENTINELS.findall(text)
            spans, out, pos, start = [], [parts[0]], len(parts[0]), 0
            for sep, part in zip(seps, parts[1:]):
                if sep == _S0:
                    start = pos
                else:
                    spans.append((start, pos))
                out.append(part)
                pos += len(part)
            if "".join(out) == plain and seps == [_S0, _S1] * len(spans):
                break
        else:
            raise ValueError(
                "chat template transforms message content in a way that hides assistant spans "
                "(rendering with marked content differs from the plain rendering)"
            )
        if self.turn_end:
            spans = [(s, e + len(self.turn_end)) if plain.startswith(self.turn_end, e) else (s, e) for s, e in spans]
        return plain, spans

    # -- public --------------------------------------------------------------------------------
    def __call__(self, rec: dict, where: str, report: SkipReport) -> FormattedDoc | None:
        c = self.cfg
        if c.kind == "text":
            if c.text_field not in rec:
                report.add("missing_field", where, f"field {c.text_field!r} not in record")
                return None
            text = rec[c.text_field]
            if not isinstance(text, str):
                report.add("bad_field", where, f"field {c.text_field!r} is {type(text).__name__}, not a string")
                return None
            if not text.strip():
                report.add("empty_document", where, f"field {c.text_field!r} is empty")
                return None
            ids = np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
            if len(ids) == 0:
                report.add("empty_document", where, "text encodes to no tokens")
                return None
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            msgs = self._messages(rec, where, report)
            if msgs is None:
                return None
            try:
                text, spans = self._render(msgs)
            except Exception as e:  # template errors name the record
                report.add("template_error", where, str(e))
                return None
            enc = self.tok.encode(text, add_special_tokens=False)
            ids = np.asarray(enc.ids, dtype=np.int64)
            if c.loss_on == "all":
                mask = np.ones(len(ids), dtype=np.uint8)
            else:
                off = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
                mask = np.zeros(len(ids), dtype=np.uint8)
                for s, e in spans:  # token [a, b) overlaps span [s, e)
                    mask |= ((off[:, 0] < e) & (off[:, 1] > s)).astype(np.uint8)
            if not mask.any():
                report.add("no_loss_tokens", where, "no assistant turn to train on")
                return None
        if c.add_bos:
            ids, mask = np.concatenate([[self.bos_id], ids]), np.concatenate([[0], mask]).astype(np.uint8)
        if self.add_eos:
            ids, mask = np.concatenate([ids, [self.eos_id]]), np.concatenate([mask, [1]]).astype(np.uint8)
        truncated = False
        if c.max_length is not None and len(ids) > c.max_length:
            ids, mask = self._truncate(ids, mask)
            truncated = True
            self.n_truncated += 1
        return FormattedDoc(ids.astype(np.int64), mask.astype(np.uint8), truncated)

    def _truncate(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        L = self.cfg.max_length
        if self.cfg.truncation == "right":
            return ids[:L], mask[:L]
        first = 1 if (self.cfg.add_bos or (len(ids) and ids[0] == self.bos_id)) else 0
        # the leading prompt: tokens without loss before the first response token (a BOS stays).
        # Only this prefix is cut: deleting later no-loss tokens (a second user turn, a header)
        # would splice responses into a sequence that never occurred.
        lead = int(np.argmax(mask[first:] != 0)) if mask[first:].any() else len(ids) - first
        k = min(len(ids) - L, lead)
        ids = np.concatenate([ids[:first], ids[first + k :]])
        mask = np.concatenate([mask[:first], mask[first + k :]])
        return ids[:L], mask[:L]  # leading prompt exhausted: cut the rest from the right
