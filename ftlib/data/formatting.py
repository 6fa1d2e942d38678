"""Records -> token ids + loss mask: raw text, chat ``messages`` and prompt/response records.

Three kinds (``FormatConfig.kind``):

``text``         continued pre-training: ``[bos] + encode(record[text_field]) + [eos]``; every
                 token carries loss.
``chat``         ``record[messages_field]`` (a list of ``{"role", "content"}``) rendered with a
                 Jinja chat template (the tokenizer's, from tokenizer_config.json, or a built-in
                 one: ``chatml``, ``llama3``) by ftlib's one chat renderer, ``render_chat`` (in
                 ``ftlib._jinja``, re-exported here): sandboxed (templates cannot reach Python
                 internals) and bounded per render in time (``template_max_seconds``, default
                 2 s) and size (``template_max_chars``, default 4,000,000 characters of output
                 and of any value the template builds). Text without any Jinja tag is refused
                 (a misspelled built-in name would otherwise render as constant text).
``instruction``  ``record[prompt_field]`` / ``record[response_field]`` (and an optional
                 ``system_field``) turned into a user/assistant conversation, then as ``chat``.

Record layouts (``ftlib.data.layouts``): besides ``messages``, chat reads ShareGPT (with its
top-level ``system``), TRL's conversational prompt/completion and Alpaca records; a field no
layout reads that looks like content is counted in the report (``report.unread``), never
dropped unseen; ``ignore_fields`` silences named ones.

Roles. A message's role must be one of ``FormatConfig.roles`` (default ``CHAT_ROLES``: system,
user, assistant, tool, function); any other (a misspelled ``"usr"``) is an ``unknown_role``
skip: a ``DataError`` naming the record, the message and the role in strict mode, counted in
the ``SkipReport`` in lenient mode. Tool and function results are context (no loss), and are
kept only where the template shows them: their contents are marked like the assistant's, and a
record whose rendering does not show each of them exactly once (a template with only
user/assistant branches drops them silently) is an ``unsupported_role`` skip.

Template errors. A record whose template raises, or crosses a rendering bound, is a
``template_error`` skip whose detail is the exception's type and message (a bound says which
one and the time spent; a ``MemoryError`` is never an empty reason). A template that crosses a
bound on the 4-message probe conversation below is refused when the ``Formatter`` is built
(``TemplateLimitError``): it would fail on every record.

Loss mask (``loss_on="assistant"``, the default for chat). The template is rendered with
every assistant ``content`` wrapped in private-use sentinel characters; the sentinels give the
exact character spans of assistant content in the rendered text, and are removed (the result
is checked to equal the plain rendering). A template that writes each content only as a whole
``{{ m['content'] }}`` output and never looks at it otherwise (``ftlib._jinja.content_passthrough``,
a conservative check of the parsed template: ``chatml`` and most ChatML-style templates pass,
``llama3``'s ``| trim`` does not) renders the marked conversation as the plain one plus the
sentinels by construction, so it is rendered once, not twice. Each span is extended over the *turn end* that
immediately follows it, so the model learns to stop. A token carries loss iff its character
range (from the tokenizer's offsets) overlaps an assistant span. ``Formatter.format_batch``
encodes many records in one call (``Tokenizer.encode_batch``: the tokenizer of record is the only
encoder) and builds their masks in one vectorised pass (same documents, same reports, in strict mode the first problem in record order
is raised); the token cache formats each chunk of records that way. ``loss_on="all"`` puts every
token in the loss. A record with an empty assistant turn is reported as ``empty_response``:
with loss on assistant turns only, that turn would teach the model to answer with nothing.

Turn header and reasoning. A turn is trained from the first character the model writes: right after
the turn's *header*, what the template writes before the model's part (``<|im_start|>assistant\n``
for ChatML/Qwen), read once per template as the generation prompt of a one-user conversation (or,
where the rendering without it is no prefix of the one with it, its longest tail that also precedes
an assistant content in the probe below). So text a template writes between the header and the
content is trained with the turn: Qwen3's ``<think>\n...\n</think>\n\n`` before the answer of the
turns after the last user query (an empty block for the last turn when it has no reasoning, as
Qwen3's non-thinking mode writes it), from the content's own ``<think>`` text or the message's
``reasoning_content``. A template that splits the content (Qwen3 cuts it at ``</think>``) leaves only
the end sentinel; the header places the turn's start then (a template with no header found there is a
``template_error``). Rule for the turns whose reasoning the template drops (Qwen3: every assistant turn
before the last user query): **train what is rendered**, the answer and the turn end; the dropped
reasoning is not in the sequence and never gets loss. Such turns teach answers without a thinking
block; to train every turn's reasoning, split a conversation into one record per assistant turn
(the earlier turns' text as the template renders it, then the turn).

Tool calls. An assistant turn with ``tool_calls`` (OpenAI's ``[{"id", "type": "function",
"function": {"name", "arguments"}}]``, or flat ``{"name", "arguments"}``; ``content`` may be
empty, ``None`` or missing) is what the model must learn to write, so it is trained whole: the
call, its arguments and the turn end. The record's tool list (``tools_field``, default ``tools``;
a list, or JSON text of one) is passed to the template as ``tools``, as ``transformers`` does;
``tool_call_id`` and ``name`` of tool results pass through. The shipped templates (Qwen2.5/3,
Llama-3.1/3.2, Mistral, Hermes) have no ``{% generation %}`` markers, which TRL's
``assistant_only_loss`` needs, so the call's tokens are found the way content is: each call's
function name is wrapped in sentinels too (they locate the call in the rendered text and show
that the template writes every call, else the record is a ``template_error`` naming the missing
calls). The turn's span runs from the first character the model writes — the end of the turn's
header where it is found (above), else the turn's content when the template shows it, else the call's *lead*, what the template writes between an
assistant turn's header and a call's name (``<tool_call>\n{"name": "`` for Qwen/Hermes, ``{"name":
"`` for Llama-3.1, ``[TOOL_CALLS] [{"name": "`` for Mistral), read once per template from a probe
conversation as the text before the probe call's name less what precedes a plain assistant
content — through the last call and the turn end after it. A template that leaves the content of
a calling turn out (Llama-3.1, Hermes) trains what it renders: the call.

Turn end. ``turn_end=`` names it explicitly. Otherwise it is read from the template itself,
whatever the template: a probe conversation (user, assistant, user, assistant) with sentinel
contents is rendered; the text after the first assistant content up to the next user content,
and the text after the last assistant content up to the end, share a prefix — what the template
writes to close an assistant turn, e.g. ``<|im_end|>\\n`` (ChatML, Qwen2), ``<|eot_id|>``
(Llama-3), `` </s>`` (Llama-2), ``</s>`` (Mistral), ``<end_of_turn>\\n`` (Gemma), ``<|end|>\\n``
(Phi-3). The turn end is that prefix up to and including its last added (special) token of the
tokenizer, so ``<|im_end|>`` gets loss and the newline after it (never generated: decoding stops
at the token) does not. Without an added token in it, the EOS text is used if the prefix holds
it; if nothing is found (or the probe cannot be rendered) the EOS text is the fallback, and a
warning says the model would not learn to stop unless ``turn_end`` or ``add_eos`` is set.

Labels. This module returns a 0/1 ``loss_mask`` aligned with ``input_ids``; the collators
(``ftlib.data.collate``) turn it into ``labels`` aligned with ``input_ids`` (same position, *not*
shifted: the loss compares logits[t] with labels[t + 1]), with -100 where the mask is 0.

Truncation (``max_length``). Three policies; the tokenizer's own truncation and padding (set in
some tokenizer.json files) are turned off while encoding, with a warning, so nothing is cut
except by the policy below.

* ``"prompt_left"`` (default) cuts the leading prompt (the tokens without loss before the first
  response token; a leading BOS is kept) from the left until the record fits, and only if that
  prompt is exhausted cuts what remains from the right (response tokens, later turns); the
  result is always one contiguous window of the record (after the BOS).
* ``"right"`` keeps the first ``max_length`` tokens.
* ``"head_tail"`` keeps the first ``h`` and the last ``t`` tokens of a region and drops its
  middle, with an optional separator token (``truncation_sep``) in the gap. The region is the
  whole document (after the BOS) for ``text``, the leading prompt for ``chat``/``instruction``
  (the response is kept whole; when the prompt cannot absorb the cut, as ``prompt_left``). With
  ``k`` region tokens that fit (``max_length`` minus the rest and the separator), a float
  ``head_tail`` in [0, 1] gives ``h = round(head_tail * k)``, an int gives ``h = min(head_tail,
  k)``; ``t = k - h``. So ``max_length = h + t (+1)`` with ``head_tail=h`` keeps exactly the
  first ``h`` and last ``t`` tokens. The mask follows the kept tokens; the separator and the
  first token after the cut carry no loss (their real context was cut away). A cut that would
  leave the head or the tail empty is a plain cut (no separator).

Truncated records are counted in ``Formatter.stats["n_truncated"]``, the tokens they lost in
``stats["n_truncated_tokens"]`` (summed into the cache's ``stats``).

EOS is explicit: ``add_bos`` / ``add_eos`` (text default: no BOS, EOS appended; chat: the
template decides BOS, ``add_eos`` appends EOS after the rendered conversation).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from .._jinja import (
    BUILTIN_TEMPLATES,
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_SECONDS,
    TemplateLimitError,
    content_passthrough,
    render_chat,
    template_text,
)
from .layouts import record_messages, unread_fields
from .pretruncate import encode_bounded
from .report import SkipReport

__all__ = ["BUILTIN_TEMPLATES", "BadMessages", "CHAT_ROLES", "FormatConfig", "FormattedDoc", "Formatter",
           "TemplateLimitError", "check_messages", "detect_turn_end", "render_chat"]

_S0, _S1 = "\ue000", "\ue001"  # private-use code points: assistant content start / end sentinels
_T0, _T1 = "\ue002", "\ue003"  # the same around tool / function results (to see that the template shows them)
_C0, _C1 = "\ue004", "\ue005"  # the same around a tool call's function name (where the call is written)
_SENTINELS = re.compile(f"[{_S0}{_S1}{_T0}{_T1}{_C0}{_C1}]")
_RESERVED = (_S0, _S1, _T0, _T1, _C0, _C1)
_PROBE = [("user", "\ue010"), ("assistant", "\ue011"), ("user", "\ue012"), ("assistant", "\ue013")]
TRUNCATIONS = ("prompt_left", "right", "head_tail")
CHAT_ROLES = ("system", "user", "assistant", "tool", "function")
_TOOL_ROLES = ("tool", "function")


def _reason(e: BaseException) -> str:
    """An exception as a skip reason: never empty (a bare MemoryError has no message)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _call_name(call: dict):
    """A tool call's function name: OpenAI's ``{"function": {"name"}}`` or a flat ``{"name"}``."""
    fn = call.get("function")
    return fn.get("name") if isinstance(fn, dict) else call.get("name")


class BadMessages(ValueError):
    """A record's message list that cannot be formatted: ``reason`` is the ``SkipReport`` reason
    (``bad_field`` or ``unknown_role``), the message the detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def check_messages(msgs, field: str, roles: tuple[str, ...] | None = CHAT_ROLES, *, name_field: bool = False
                   ) -> list[dict]:
    """The one message validator (SFT records and preference pairs): ``msgs`` of record field ``field``
    as a list of message dicts, or :class:`BadMessages` saying which message and why.

    Each message is a dict with a string ``role`` (one of ``roles``; None: any) and a string
    ``content``, without the reserved code points U+E000..U+E005 (the formatter's span markers); an
    assistant's ``tool_calls`` is a list of calls each with a function name (an empty list is dropped,
    a call without text gets content ""). Returns the messages so normalised. ``name_field``: the
    errors about one message start with ``field 'x': `` too (a pair has several message fields)."""
    at = f"field {field!r}: " if name_field else ""
    if not isinstance(msgs, list) or not msgs:
        raise BadMessages("bad_field", f"field {field!r} must be a non-empty list")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadMessages("bad_field", f"{at}message {j} needs string 'role' and 'content'")
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls is not None:
            if not isinstance(calls, list) or not all(isinstance(k, dict) and isinstance(_call_name(k), str)
                                                      and _call_name(k) for k in calls):
                raise BadMessages("bad_field", f"{at}message {j}: 'tool_calls' must be a list of calls, "
                                  "each with a function name ({'function': {'name', 'arguments'}} or "
                                  "{'name', 'arguments'})")
            if not calls:  # an empty list: no call, an ordinary turn
                m = {k: v for k, v in m.items() if k != "tool_calls"}
            elif m.get("content") is None:  # a call without text: content "" (templates test it)
                m = {**m, "content": ""}
        if not isinstance(m.get("content"), str):
            raise BadMessages("bad_field", f"{at}message {j} needs string 'role' and 'content'")
        if roles is not None and m["role"] not in roles:
            raise BadMessages("unknown_role", f"{at}message {j} has role {m['role']!r}, not one of "
                              f"{', '.join(roles)} (FormatConfig.roles)")
        if any(x in m["content"] for x in _RESERVED) or any(x in _call_name(k) for k in m.get("tool_calls", ())
                                                            for x in _RESERVED):
            raise BadMessages("bad_field", f"{at}message {j} contains reserved code points "
                              "U+E000..U+E005")
        out.append(m)
    return out


def _mark_call(call: dict) -> dict:
    """``call`` with its function name between the call sentinels."""
    fn = call.get("function")
    if isinstance(fn, dict):
        return {**call, "function": {**fn, "name": _C0 + fn["name"] + _C1}}
    return {**call, "name": _C0 + call["name"] + _C1}


def detect_turn_end(template: str, tokenizer, bos_token: str = "", eos_token: str = "", *,
                    max_seconds: float = DEFAULT_MAX_SECONDS,
                    max_chars: int = DEFAULT_MAX_CHARS) -> tuple[str | None, str]:
    """What ``template`` writes after an assistant's content to end its turn (see the module docstring).

    Returns ``(turn_end or None, what the template renders there)``; the second value explains a
    miss (or names the rendering error). A template that crosses a rendering bound on this short
    conversation raises :class:`TemplateLimitError`: it would do so on every record.
    """
    msgs = [{"role": r, "content": c} for r, c in _PROBE]
    try:
        text = render_chat(msgs, template, bos_token=bos_token, eos_token=eos_token, add_generation_prompt=False,
                           max_seconds=max_seconds, max_chars=max_chars)
    except TemplateLimitError as e:
        raise TemplateLimitError(f"the chat template cannot render a 4-message probe conversation: {e}") from None
    except Exception as e:  # a template that refuses this conversation shape
        return None, f"the probe conversation does not render: {_reason(e)}"
    a1, u2, a2 = (text.find(c) for _, c in _PROBE[1:])
    if min(a1, u2, a2) < 0 or not a1 < u2 < a2:
        return None, "the probe conversation's contents do not appear in order"
    common = os.path.commonprefix([text[a1 + 1 : u2], text[a2 + 1 :]])
    enc = tokenizer.encode(common, add_special_tokens=False)
    added = set(tokenizer.get_added_tokens_decoder())
    ends = [e for i, (_, e) in zip(enc.ids, enc.offsets) if i in added]
    if ends:
        return common[: max(ends)], common
    if eos_token and eos_token in common:
        return common[: common.index(eos_token) + len(eos_token)], common
    return None, common


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
    turn_end: str | None = None  # text after assistant content that also gets loss (None: from the template)
    loss_on: str = "assistant"  # "assistant" | "all" (chat); text always trains on all tokens
    bos_token: str | int | None = None
    eos_token: str | int | None = None
    add_bos: bool = False
    add_eos: bool | None = None  # None: True for text, False for chat
    max_length: int | None = None
    truncation: str = "prompt_left"  # "prompt_left" | "right" | "head_tail"
    head_tail: float | int = 0.5  # head_tail: share of kept region tokens from the head, or a head count
    truncation_sep: str | int | None = None  # head_tail: token put where the middle was cut
    roles: tuple[str, ...] = CHAT_ROLES  # chat roles a record may use; any other is skipped as unknown_role
    tools_field: str = "tools"  # chat: the per-record tool (function) list passed to the template as `tools`
    ignore_fields: tuple[str, ...] = ()  # record fields not read that are not to be reported (layouts.py)
    template_max_seconds: float = DEFAULT_MAX_SECONDS  # per render of one record (ftlib._jinja bounds)
    template_max_chars: int = DEFAULT_MAX_CHARS  # output and every value a template builds, per render

    def __post_init__(self):
        if self.kind not in ("text", "chat", "instruction"):
            raise ValueError(f"FormatConfig.kind must be text|chat|instruction, got {self.kind!r}")
        if self.kind != "text" and not self.chat_template:
            raise ValueError(f"FormatConfig.kind={self.kind!r} needs chat_template (a name or Jinja text)")
        if self.chat_template:
            template_text(self.chat_template)
        if isinstance(self.roles, str) or not self.roles or not all(isinstance(r, str) and r for r in self.roles):
            raise ValueError(f"FormatConfig.roles must be a non-empty tuple of role names, got {self.roles!r}")
        if "assistant" not in self.roles:
            raise ValueError("FormatConfig.roles must include 'assistant' (the turns that carry loss)")
        object.__setattr__(self, "roles", tuple(self.roles))
        if isinstance(self.ignore_fields, str):
            object.__setattr__(self, "ignore_fields", tuple(f for f in self.ignore_fields.split(",") if f))
        object.__setattr__(self, "ignore_fields", tuple(self.ignore_fields))
        if not self.template_max_seconds > 0 or self.template_max_chars < 1:
            raise ValueError(f"FormatConfig.template_max_seconds must be > 0 and template_max_chars >= 1, got "
                             f"{self.template_max_seconds!r}, {self.template_max_chars!r}")
        if self.loss_on not in ("assistant", "all"):
            raise ValueError(f"FormatConfig.loss_on must be assistant|all, got {self.loss_on!r}")
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"FormatConfig.truncation must be {'|'.join(TRUNCATIONS)}, got {self.truncation!r}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError("FormatConfig.max_length must be >= 1")
        ht = self.head_tail
        if isinstance(ht, bool) or not isinstance(ht, (int, float)) or ht < 0 or (isinstance(ht, float) and ht > 1):
            raise ValueError(f"FormatConfig.head_tail must be a float in [0, 1] (share of the head) or an int >= 0 "
                             f"(head tokens), got {ht!r}")
        if self.truncation_sep is not None and self.truncation != "head_tail":
            raise ValueError("FormatConfig.truncation_sep applies to truncation='head_tail'")
        if self.turn_end is not None and not self.turn_end:
            raise ValueError("FormatConfig.turn_end must be non-empty text (or None to read it from the template)")

    def fingerprint(self) -> str:
        d = asdict(self)
        d["chat_template"] = BUILTIN_TEMPLATES.get(self.chat_template, self.chat_template)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def formatter(self, tokenizer) -> Formatter:
        """The callable that formats records with these settings (the token cache's hook)."""
        return Formatter(tokenizer, self)


@dataclass
class FormattedDoc:
    input_ids: np.ndarray  # (L,) int64
    loss_mask: np.ndarray  # (L,) uint8, 1 = token carries loss
    truncated: bool = False
    extra: dict[str, int] | None = None  # per-document int columns a config declares (see cache.py)


class Formatter:
    """Callable ``formatter(record, location, report) -> FormattedDoc | None``.

    ``tokenizer`` is a ``tokenizers.Tokenizer``. Special tokens named by string must be in its
    vocabulary. Records that cannot be formatted are reported to ``report`` (see report.py).
    ``turn_end`` is the resolved turn end (chat kinds), ``stats`` the truncation counters.
    """

    def __init__(self, tokenizer, config: FormatConfig):
        self.tok = _without_builtin_truncation(tokenizer)
        self.cfg = config
        self.bos_id = self._token_id(config.bos_token, "bos_token")
        self.eos_id = self._token_id(config.eos_token, "eos_token")
        self.sep_id = self._token_id(config.truncation_sep, "truncation_sep")
        self.add_eos = config.add_eos if config.add_eos is not None else config.kind == "text"
        if config.add_bos and self.bos_id is None:
            raise ValueError("FormatConfig.add_bos=True needs bos_token")
        if self.add_eos and self.eos_id is None:
            raise ValueError("appending EOS needs FormatConfig.eos_token (or set add_eos=False)")
        self.bos_text = config.bos_token if isinstance(config.bos_token, str) else self._id_text(self.bos_id)
        self.eos_text = config.eos_token if isinstance(config.eos_token, str) else self._id_text(self.eos_id)
        self.turn_end = self._resolve_turn_end() if config.kind != "text" else None
        self._passthrough = config.kind != "text" and content_passthrough(config.chat_template)
        self.stats = {"n_truncated": 0, "n_truncated_tokens": 0}
        if "FTLIB_BPE_BACKEND" in os.environ:  # the C++ encoder it chose is gone: say so, never ignore it
            warnings.warn("FTLIB_BPE_BACKEND is no longer read: ftlib encodes data with the tokenizer of record "
                          "(tokenizers) only; unset it", stacklevel=2)
        self._lead = None  # what the template writes before a tool call's name (_call_lead), once read
        self._header = None  # what the template writes right before the model's part of a turn (_answer_header)

    @property
    def n_truncated(self) -> int:
        return self.stats["n_truncated"]

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

    def _resolve_turn_end(self) -> str | None:
        c = self.cfg
        found, rendered = detect_turn_end(c.chat_template, self.tok, self.bos_text or "", self.eos_text or "",
                                          max_seconds=c.template_max_seconds, max_chars=c.template_max_chars)
        if c.turn_end is not None:
            if found is None or not rendered.startswith(c.turn_end):
                warnings.warn(f"FormatConfig.turn_end={c.turn_end!r} does not follow the assistant's content in the "
                              f"chat template (it renders {rendered!r} there); it gets loss only where it does",
                              stacklevel=3)
            return c.turn_end
        if found is None and c.loss_on == "assistant" and not self.add_eos:
            warnings.warn(f"chat template: no turn end found after the assistant's content ({rendered!r}); the end "
                          "of an answer carries no loss, so the model will not learn to stop. Pass "
                          "FormatConfig(turn_end=...) (--turn-end) or add_eos=True", stacklevel=3)
        return found or self.eos_text

    # -- record -> (text, assistant spans) ------------------------------------------------------
    def _messages(self, rec: dict, where: str, report: SkipReport):
        """``(messages, tools or None, leading context messages)`` of a chat / instruction record, or None
        (reported)."""
        c = self.cfg
        try:  # the record's layout (ftlib.data.layouts): messages, ShareGPT, TRL prompt/completion, Alpaca
            field, msgs, read, n_context = record_messages(rec, c)
        except KeyError as e:
            report.add("missing_field", where, f"field {e.args[0]!r} not in record")
            return None
        except ValueError as e:
            report.add("bad_field", where, str(e))
            return None
        tools = rec.get(c.tools_field)
        read = read | {c.tools_field}
        unread = unread_fields(rec, read, c.ignore_fields)
        if unread:
            report.add_unread(where, unread)
        if isinstance(tools, str):  # some datasets keep the tool list as JSON text
            try:
                tools = json.loads(tools) if tools.strip() else None
            except ValueError as e:
                report.add("bad_field", where, f"field {c.tools_field!r} is text but not JSON ({e})")
                return None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            report.add("bad_field", where, f"field {c.tools_field!r} must be a list of tool (function) objects")
            return None
        try:
            msgs = check_messages(msgs, field, c.roles)
        except BadMessages as e:
            report.add(e.reason, where, str(e))
            return None
        if all(not m["content"].strip() and not m.get("tool_calls") for m in msgs):
            report.add("empty_document", where, "all message contents are empty")
            return None
        if c.loss_on == "assistant":
            # only the turn end would carry loss there: the model would learn to answer with nothing
            # (a turn that calls a tool is not empty: the call is what it says)
            empty = [j for j, m in enumerate(msgs) if j >= n_context and m["role"] == "assistant"
                     and not m["content"].strip() and not m.get("tool_calls")]
            n_answers = sum(m["role"] == "assistant" for m in msgs[n_context:])
            if empty and len(empty) == n_answers:
                report.add("empty_response", where, "every assistant turn is empty")
                return None
            if empty:
                report.add("empty_response", where, f"assistant message {empty[0]} is empty (of {n_answers} "
                           "assistant turns); it would train the model to stop at once")
                return None
        return msgs, tools, n_context

    def _call_lead(self) -> str:
        """What the template writes from an assistant turn's start to a tool call's function name, read
        from a probe conversation (see the module docstring); '' when the template shows no call."""
        if self._lead is None:
            name = "\ue014"
            call = {"id": "a1b2c3d4e", "type": "function", "function": {"name": name, "arguments": {}}}
            probe = [{"role": "user", "content": "\ue010"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": "\ue015", "tool_call_id": "a1b2c3d4e", "name": name},
                     {"role": "assistant", "content": "\ue011"}, {"role": "user", "content": "\ue012"},
                     {"role": "assistant", "content": "\ue013"}]
            kw = self._kw()
            self._lead = ""
            try:
                text = render_chat(probe, self.cfg.chat_template, **kw)
                plain = render_chat([{"role": r, "content": x} for r, x in _PROBE], self.cfg.chat_template, **kw)
            except Exception:  # a template without tool calls: the records say so (unsupported_role)
                return self._lead
            u, n = text.find("\ue010"), text.find(name)
            a, h = plain.find("\ue010"), plain.find("\ue011")
            if 0 <= u < n and 0 <= a < h:
                lead = text[u + 1 : n]
                self._lead = lead[len(os.path.commonprefix([lead, plain[a + 1 : h]])) :]
            if not self._lead:
                warnings.warn("chat template: what it writes before a tool call's function name could not be read "
                              "from a probe conversation; a call's loss starts where the record's rendering shares "
                              "no text with it (at the name, at worst)", stacklevel=4)
        return self._lead

    def _answer_header(self) -> str:
        """What the template writes right before the model's part of an assistant turn (``<|im_start|>assistant\\n``
        for ChatML/Qwen), read once: the generation prompt after a one-user conversation, or, where the
        rendering without it is not a prefix of the one with it, the longest tail it shares with what the
        probe conversation writes between a user content and the next assistant content; '' if none."""
        if self._header is None:
            tmpl, kw, self._header = self.cfg.chat_template, self._kw(), ""
            one = [{"role": "user", "content": "\ue010"}]
            try:
                gen = render_chat(one, tmpl, **{**kw, "add_generation_prompt": True})
                bare = render_chat(one, tmpl, **kw)
                probe = render_chat([{"role": r, "content": x} for r, x in _PROBE], tmpl, **kw)
            except Exception:  # the records say why
                return self._header
            u, u1, a1 = gen.find("\ue010"), probe.find("\ue010"), probe.find("\ue011")
            if gen.startswith(bare) and len(gen) > len(bare) and u < len(bare):
                self._header = gen[len(bare):]
            elif 0 <= u and 0 <= u1 < a1:
                g, h = gen[u + 1 :], probe[u1 + 1 : a1]
                n = len(os.path.commonprefix([g[::-1], h[::-1]]))
                self._header = g[len(g) - n :] if n else ""
        return self._header

    def _kw(self) -> dict:
        c = self.cfg
        return {"bos_token": self.bos_text or "", "eos_token": self.eos_text or "", "add_generation_prompt": False,
                "max_seconds": c.template_max_seconds, "max_chars": c.template_max_chars}

    def _render(self, msgs: list[dict], tools=None, n_context: int = 0) -> tuple[str, list[tuple[int, int]], int]:
        """(text, assistant spans, tool / function contents the text shows) of a conversation whose first
        ``n_context`` messages carry no loss whatever their role."""
        c = self.cfg
        kw = self._kw()
        if tools is not None:
            kw["tools"] = tools
        has_calls = any(m.get("tool_calls") for m in msgs)
        # a template that only writes each message's content as is ({{ m['content'] }}, never testing or
        # transforming it: ftlib._jinja.content_passthrough) renders the marked conversation exactly as the plain
        # one plus the sentinels: one render instead of two (not with tool calls: their names are marked too)
        fast = self._passthrough and not has_calls
        plain = None if fast else render_chat(msgs, c.chat_template, **kw)
        # a template that trims content sees the sentinels instead of the whitespace: then the content goes in
        # stripped (assistant turns, tool results, or both, as the template trims them)
        # a template that tests a calling turn's content after transforming it (Qwen3: "<think>..</think>" and
        # nothing after it is no content) sees the sentinels as content: then calling turns' contents go in
        # unmarked (the call's marks and the turn header place such a turn)
        variants = [(a, t, True) for a, t in ((False, False), (True, False), (False, True), (True, True))]
        if has_calls:
            variants += [(a, t, False) for a, t, _ in variants]
        for strip_a, strip_t, mark_calling in variants:
            marked = []
            for j, m in enumerate(msgs):
                if m["role"] == "assistant" and j >= n_context:
                    content = m["content"].strip() if strip_a else m["content"]
                    # an empty content stays empty (a template tests it: "if message.content")
                    mark = content and (mark_calling or not m.get("tool_calls")) or not m.get("tool_calls")
                    m = {**m, "content": _S0 + content + _S1 if mark else content}
                    if m.get("tool_calls"):
                        m["tool_calls"] = [_mark_call(k) for k in m["tool_calls"]]
                elif m["role"] in _TOOL_ROLES:
                    m = {**m, "content": _T0 + (m["content"].strip() if strip_t else m["content"]) + _T1}
                marked.append(m)
            text = render_chat(marked, c.chat_template, **kw)
            # strip the sentinels, recording where each one was in the plain text
            parts = _SENTINELS.split(text)
            seps = _SENTINELS.findall(text)
            out, pos, events = [parts[0]], len(parts[0]), []
            for sep, part in zip(seps, parts[1:]):
                events.append((sep, pos))
                out.append(part)
                pos += len(part)
            stripped = "".join(out)
            if plain is None:
                plain = stripped
                if not fast:
                    plain = render_chat(msgs, c.chat_template, **kw)  # not reached for such a template
            if stripped != plain:
                continue
            spans = self._turn_spans(msgs, events, plain, n_context)
            if spans is not None:
                break
        else:
            raise ValueError(
                "chat template transforms message content in a way that hides assistant spans "
                "(rendering with marked content differs from the plain rendering)"
            )
        return plain, spans, seps.count(_T0)

    def _turn_spans(self, msgs, events, plain, n_context: int = 0) -> list[tuple[int, int]] | None:
        """The loss spans of the assistant turns from the sentinel positions ``events`` (in text order, the
        messages' order); None when they do not pair up as the messages say (another strip setting may).

        An ordinary turn: its content, extended over the turn end that follows it. A turn with tool calls:
        from the first character the model writes (its content if the template shows it, else the call's
        lead: what the template writes between the assistant header and the first call's function name,
        ``_call_lead``) through the last call and the turn end after it: the call, its arguments and the
        turn end. ``ValueError`` when a template does not show a call, or shows no turn end after it."""
        te = self.turn_end
        spans, k, floor = [], 0, 0  # floor: the end of the previous message's marks
        for j, m in enumerate(msgs):
            role = m["role"]
            if role in _TOOL_ROLES:
                if k + 1 < len(events) and events[k][0] == _T0 and events[k + 1][0] == _T1:
                    floor = events[k + 1][1]
                    k += 2
                continue
            if role != "assistant" or j < n_context:
                continue
            content = None
            if k + 1 < len(events) and events[k][0] == _S0 and events[k + 1][0] == _S1:
                content = (events[k][1], events[k + 1][1])
                k += 2
            elif k < len(events) and events[k][0] == _S1:  # the template cut the content's start away (Qwen3's
                content = (None, events[k][1])  # </think> split): the turn starts after its header
                k += 1
            elif not m.get("tool_calls"):
                continue  # a turn the template does not show: nothing to train on there
            calls = m.get("tool_calls") or []
            names = []
            for _ in calls:
                if k + 1 < len(events) and events[k][0] == _C0 and events[k + 1][0] == _C1:
                    names.append((events[k][1], events[k + 1][1]))
                    k += 2
            if len(names) != len(calls):
                raise ValueError(f"the chat template shows {len(names)} of the {len(calls)} tool calls of an "
                                 "assistant turn (it does not render 'tool_calls')")
            # the model's part of the turn starts right after the turn's header: what the template writes there
            # before the content (Qwen3's kept <think> block of the last turns) is the model's to write too
            anchor = (content[0] if content[0] is not None else content[1]) if content else names[0][0]
            hdr = self._answer_header()
            h = plain.rfind(hdr, floor, anchor) if hdr else -1
            head = h + len(hdr) if h >= 0 else None
            if content is not None and content[0] is None and head is None:
                raise ValueError("the chat template cuts the start of an assistant content away (it splits or "
                                 "rewrites it) and writes no turn header ftlib can find before it: where that "
                                 "turn starts is unknown")
            if not calls:
                s, e = head if head is not None else content[0], content[1]
                if te and plain.startswith(te, e):
                    e += len(te)
                spans.append((s, e))
                floor = e
                continue
            first, last = names[0][0], names[-1][1]
            lead = self._call_lead()
            start = first - len(lead)
            if not lead or start < floor or plain[start:first] != lead:  # the lead's longest tail written here
                before = plain[floor:first]
                start = first - len(os.path.commonprefix([before[::-1], lead[::-1]]))
            if content is not None:
                start = min(start, content[1] if content[0] is None else content[0])
            if head is not None:
                start = min(start, head)
            end = plain.find(te, last) if te else -1
            nxt = events[k][1] if k < len(events) else len(plain) + 1
            if end < 0 or end >= nxt:
                raise ValueError(f"no turn end ({te!r}) after the tool call of an assistant turn: the end of the "
                                 "call cannot be found (pass FormatConfig(turn_end=...) / --turn-end)")
            spans.append((start, end + len(te)))
            floor = end + len(te)
        if k != sum(1 for x in events if x[0] in (_S0, _S1, _C0, _C1, _T0, _T1)):
            return None
        return spans

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
            ids = np.asarray(encode_bounded(self.tok, text, c.max_length, "both" if c.truncation == "head_tail"
                                            else "head", self.stats), dtype=np.int64)  # pretruncate.py
            if len(ids) == 0:
                report.add("empty_document", where, "text encodes to no tokens")
                return None
            return self._finish(ids, np.ones(len(ids), dtype=np.uint8))
        prepared = self._prepare(rec, where, report)
        if prepared is None:
            return None
        return self._finish_batch([(where, prepared)], report)[0][1]

    def format_batch(self, records, report: SkipReport) -> list[tuple[str, FormattedDoc | None]]:
        """``[(location, doc or None)]`` of ``(record, location)`` pairs: the same documents and reports as
        calling the formatter on each record, with one ``encode_batch`` call for the chat kinds.

        ``records`` may be a generator that reports (decodes) as it goes: in strict mode, a problem raised
        while reading record j is raised only after the records before j were encoded, so the first
        problem in record order is the one raised, as with per-record calls."""
        if self.cfg.kind == "text":
            return [(where, self(rec, where, report)) for rec, where in records]
        pending = []
        try:
            for rec, where in records:
                pending.append((where, self._prepare(rec, where, report)))
        except Exception:
            self._finish_batch(pending, report)  # a record before the failing one may fail first
            raise
        return self._finish_batch(pending, report)

    def _prepare(self, rec: dict, where: str, report: SkipReport) -> tuple[str, list[tuple[int, int]]] | None:
        """A chat record's (text, assistant spans), or None (reported)."""
        got = self._messages(rec, where, report)
        if got is None:
            return None
        msgs, tool_list, n_context = got
        try:
            text, spans, shown = self._render(msgs, tool_list, n_context)
        except Exception as e:  # template errors name the record, and say why
            report.add("template_error", where, _reason(e))
            return None
        tools = [j for j, m in enumerate(msgs) if m["role"] in _TOOL_ROLES]
        if shown != len(tools):  # the template drops (or repeats) tool results: the text would misstate them
            role = msgs[tools[0]]["role"] if tools else "tool"
            report.add("unsupported_role", where, f"the chat template shows {shown} of the {len(tools)} tool/"
                       f"function results (first: message {tools[0] if tools else '-'}, role {role!r}); it "
                       "does not support that role")
            return None
        return text, spans

    def _finish_batch(self, pending: list, report: SkipReport) -> list[tuple[str, FormattedDoc | None]]:
        """Encode the prepared chat records of ``pending`` ([(location, (text, spans) or None)]) in one batch.

        Loss mask, vectorised over the batch: token [a, b) carries loss iff it overlaps an assistant span
        [s, e), i.e. a < e and b > s. Records are laid end to end in one character axis (one character of
        gap between records), the spans of each record merged where they overlap (same union), so the
        spans are sorted and disjoint: the only span a token can overlap is the last one starting before
        its end."""
        live = [p for _, p in pending if p is not None]
        if not live:
            return [(where, None) for where, _ in pending]
        texts = [t for t, _ in live]
        n, ids, off = self._encode_batch(texts, offsets=self.cfg.loss_on != "all")
        bounds = np.zeros(len(n) + 1, np.int64)
        np.cumsum(n, out=bounds[1:])
        if self.cfg.loss_on == "all":
            mask = np.ones(len(ids), np.uint8)
        else:
            base = np.zeros(len(texts), np.int64)
            np.cumsum([len(t) + 1 for t in texts[:-1]], out=base[1:])
            off += np.repeat(base, n)[:, None]
            starts, ends = [], []
            for b, (_, spans) in zip(base.tolist(), live):
                for s, e in sorted(spans):
                    if starts and s + b < ends[-1]:  # overlaps the previous span (of this record: 1 char gap)
                        ends[-1] = max(ends[-1], e + b)
                    else:
                        starts.append(s + b)
                        ends.append(e + b)
            k = np.searchsorted(np.asarray(starts, np.int64), off[:, 1], side="left") - 1
            ends_a = np.asarray(ends + [0], np.int64)  # k = -1 (no span starts before the token) reads the 0
            mask = ((k >= 0) & (ends_a[k] > off[:, 0])).astype(np.uint8)
        loss = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])[bounds]
        has_loss = (loss[1:] - loss[:-1]) > 0
        out, r = [], 0
        for where, p in pending:
            if p is None:
                out.append((where, None))
                continue
            if not has_loss[r]:
                report.add("no_loss_tokens", where, "no assistant turn to train on")
                out.append((where, None))
            else:
                a, b = int(bounds[r]), int(bounds[r + 1])
                out.append((where, self._finish(ids[a:b], mask[a:b])))
            r += 1
        return out

    def _encode_batch(self, texts: list[str], offsets: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(tokens per text, ids int64 end to end, character offsets (T, 2) or None)`` of
        ``self.tok.encode_batch(texts, add_special_tokens=False)``."""
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        n = np.fromiter((len(e.ids) for e in encs), np.int64, count=len(encs))
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), np.int64, count=int(n.sum()))
        off = None
        if offsets:
            off = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(e.offsets for e in encs)),
                              np.int64, count=2 * len(ids)).reshape(-1, 2)
        return n, ids, off

    def _finish(self, ids: np.ndarray, mask: np.ndarray) -> FormattedDoc:
        """BOS / EOS and truncation of one document's (ids, mask)."""
        c = self.cfg
        if not (c.add_bos or self.add_eos or (c.max_length is not None and len(ids) > c.max_length)):
            return FormattedDoc(ids, mask, False)
        if c.add_bos:
            ids, mask = np.concatenate([[self.bos_id], ids]), np.concatenate([[0], mask]).astype(np.uint8)
        if self.add_eos:
            ids, mask = np.concatenate([ids, [self.eos_id]]), np.concatenate([mask, [1]]).astype(np.uint8)
        truncated = False
        if c.max_length is not None and len(ids) > c.max_length:
            n = len(ids)
            ids, mask, n_sep = self._truncate(ids, mask)
            truncated = True
            self.stats["n_truncated"] += 1
            self.stats["n_truncated_tokens"] += n - (len(ids) - n_sep)
        return FormattedDoc(ids.astype(np.int64), mask.astype(np.uint8), truncated)

    # -- truncation ------------------------------------------------------------------------------
    def _truncate(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(ids, mask, separators inserted) cut to max_length by the configured policy."""
        L = self.cfg.max_length
        if self.cfg.truncation == "right":
            return ids[:L], mask[:L], 0
        first = 1 if (self.cfg.add_bos or (len(ids) and ids[0] == self.bos_id)) else 0
        # the leading prompt: tokens without loss before the first response token (a BOS stays)
        lead = int(np.argmax(mask[first:] != 0)) if mask[first:].any() else len(ids) - first
        if self.cfg.truncation == "head_tail":
            region = len(ids) - first if self.cfg.kind == "text" else lead
            out = self._head_tail(ids, mask, first, region)
            if out is not None:
                return out
            if self.cfg.kind == "text":
                return ids[:L], mask[:L], 0
        # prompt_left. Only the leading prompt is cut: deleting later no-loss tokens (a second user
        # turn, a header) would splice responses into a sequence that never occurred.
        k = min(len(ids) - L, lead)
        ids = np.concatenate([ids[:first], ids[first + k :]])
        mask = np.concatenate([mask[:first], mask[first + k :]])
        return ids[:L], mask[:L], 0  # leading prompt exhausted: cut the rest from the right

    def _head_tail(self, ids, mask, first: int, region: int):
        """Drop the middle of ids[first : first + region] (see the module docstring); None: it cannot absorb the cut."""
        excess = len(ids) - self.cfg.max_length
        sep = [] if self.sep_id is None else [self.sep_id]
        keep = region - excess - len(sep)  # region tokens that fit beside the separator
        if keep < 1:
            return None
        ht = self.cfg.head_tail
        h = int(round(keep * ht)) if isinstance(ht, float) else min(int(ht), keep)
        t = keep - h
        a, b = first, first + region  # the region
        if h == 0 or (t == 0 and b == len(ids)):  # nothing on one side of the cut: a plain cut, no separator
            keep += len(sep)
            if h == 0:
                return (np.concatenate([ids[:a], ids[b - keep :]]), np.concatenate([mask[:a], mask[b - keep :]]), 0)
            return ids[: a + keep], mask[: a + keep], 0
        tail_ids, tail_mask = ids[b - t :], mask[b - t :].copy()
        tail_mask[0] = 0  # the first token after the cut: its real context is gone
        new_ids = np.concatenate([ids[: a + h], np.asarray(sep, np.int64), tail_ids])
        new_mask = np.concatenate([mask[: a + h], np.zeros(len(sep), np.uint8), tail_mask]).astype(np.uint8)
        return new_ids, new_mask, len(sep)


def _without_builtin_truncation(tokenizer):
    """The tokenizer itself, or a copy with its tokenizer.json truncation/padding turned off (warned)."""
    trunc, pad = getattr(tokenizer, "truncation", None), getattr(tokenizer, "padding", None)
    if not trunc and not pad:
        return tokenizer
    from tokenizers import Tokenizer

    what = " and ".join(w for w, on in ((f"truncation (max_length={(trunc or {}).get('max_length')})", trunc),
                                        ("padding", pad)) if on)
    warnings.warn(f"the tokenizer has {what} enabled (tokenizer.json); ftlib turns it off while formatting so no "
                  "document is cut or padded silently: use FormatConfig.max_length and its truncation policy",
                  stacklevel=3)
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.no_truncation()
    tok.no_padding()
    return tok
