"""Record layouts: the shapes chat and instruction data come in, read as one list of messages.

``record_messages(rec, cfg) -> (field, messages, fields read)``; the formatter renders the
messages with the chat template. By ``FormatConfig.kind``:

``chat``         the first layout the record has, in this order:
                 ``messages`` (``messages_field``: ``[{"role", "content", ...}]``, OpenAI style,
                 ``tool_calls`` / ``tool_call_id`` / ``name`` included);
                 ShareGPT ``conversations`` (``from`` / ``value``, a top-level ``system``,
                 ``function_call`` / ``observation`` turns: ``ftlib.data.sharegpt``);
                 TRL's conversational prompt/completion (``prompt`` and ``completion`` both
                 message lists: the conversation is ``prompt + completion``, and only the
                 completion's assistant turns carry loss, as in TRL);
                 Alpaca (``instruction``, optional ``input``, ``output``, optional ``system`` and
                 LLaMA-Factory's ``history``: earlier ``[instruction, response]`` pairs, first).
``instruction``  ``prompt_field`` / ``response_field`` strings (optional ``system_field``): one
                 user turn and one assistant turn; TRL's ``completion`` stands for the response
                 when ``response_field`` is the default and the record has none; prompt and
                 completion given as message lists are read as in ``chat``; Alpaca fields as in
                 ``chat``.

Alpaca. The user turn is the instruction, then, when ``input`` is non-empty, a blank line and
the input: ``instruction + "\\n\\n" + input``, the separation Alpaca's own prompt puts between its
``### Instruction:`` and ``### Input:`` sections (the section headers belong to Alpaca's prompt
template; with a chat template the model's own turn markup takes their place). An empty
``input`` adds nothing.

Unread fields. Whatever the layout, a field of the record that it does not read and that looks
like content — a string with a space or line break in it, or a list / mapping holding one (a
``context`` beside Dolly's ``instruction``, an ``input`` beside ``prompt``, a ``notes`` beside
``messages``) — is reported, never dropped unseen: :func:`unread_fields` names them, the formatter
passes them to the ``SkipReport`` (``report.unread``), which counts them per field with the first
location and prints them once per source. ``FormatConfig.ignore_fields`` (``--ignore-fields``)
silences the fields named there. Identifiers, labels and numbers (``id``, ``category``, ``lang``,
``score``) do not look like content.
"""

from __future__ import annotations

from .sharegpt import SHAREGPT_FIELD, SHAREGPT_READS, chat_turns

__all__ = ["ALPACA_FIELDS", "looks_like_content", "record_messages", "unread_fields"]

ALPACA_FIELDS = ("instruction", "input", "output", "system", "history")


def _alpaca(rec: dict) -> list[dict]:
    for f in ("instruction", "output"):
        if not isinstance(rec[f], str):
            raise ValueError(f"field {f!r} is {type(rec[f]).__name__}, not a string")
    inp = rec.get("input")
    if inp is not None and not isinstance(inp, str):
        raise ValueError(f"field 'input' is {type(inp).__name__}, not a string")
    user = rec["instruction"] + ("\n\n" + inp if inp and inp.strip() else "")
    system = rec.get("system")
    msgs = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    history = rec.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) for x in h)
                                                for h in history):
        raise ValueError("field 'history' must be a list of [instruction, response] pairs of strings")
    for q, a in history:  # earlier turns (LLaMA-Factory's Alpaca layout), before the instruction
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]


def _is_alpaca(rec: dict) -> bool:
    return "instruction" in rec and "output" in rec


def _is_conversational(rec: dict, prompt: str = "prompt", completion: str = "completion") -> bool:
    return isinstance(rec.get(prompt), list) and isinstance(rec.get(completion), list)


def record_messages(rec: dict, cfg) -> tuple[str, object, set[str], int]:
    """(field named in errors, messages, record fields read, leading messages that are context) of a
    chat / instruction record. Context: TRL's ``prompt`` messages, which TRL never trains (its
    ``completion_only_loss``); an assistant turn there is shown to the model without loss.

    ``KeyError(field)``: the record has no layout of its kind (the field the default one needs);
    ``ValueError``: a layout's field is malformed (the message names it)."""
    if cfg.kind == "instruction":
        p, r = cfg.prompt_field, cfg.response_field
        if r not in rec and r == "response" and "completion" in rec:
            r = "completion"
        if _is_conversational(rec, p, r):
            return p, rec[p] + rec[r], {p, r}, len(rec[p])
        if p not in rec and _is_alpaca(rec):
            return "instruction", _alpaca(rec), set(ALPACA_FIELDS), 0
        fields = ([cfg.system_field] if cfg.system_field else []) + [p, r]
        for f in fields:
            if f not in rec:
                raise KeyError(f)
            if not isinstance(rec[f], str):
                raise ValueError(f"field {f!r} is {type(rec[f]).__name__}, not a string")
        msgs = [{"role": "system", "content": rec[cfg.system_field]}] if cfg.system_field else []
        msgs += [{"role": "user", "content": rec[p]}, {"role": "assistant", "content": rec[r]}]
        return p, msgs, set(fields), 0
    f = cfg.messages_field
    if f in rec or SHAREGPT_FIELD in rec:
        field, msgs = chat_turns(rec, f)
        return field, msgs, ({field} | set(SHAREGPT_READS) if field == SHAREGPT_FIELD else {field}), 0
    if _is_conversational(rec):
        return "prompt", rec["prompt"] + rec["completion"], {"prompt", "completion"}, len(rec["prompt"])
    if _is_alpaca(rec):
        return "instruction", _alpaca(rec), set(ALPACA_FIELDS), 0
    raise KeyError(f)


def looks_like_content(v, depth: int = 0) -> bool:
    """A string with whitespace inside, or a list / mapping (a few levels deep) holding one."""
    if isinstance(v, str):
        return any(ch.isspace() for ch in v.strip())
    if depth > 3:
        return False
    if isinstance(v, dict):
        return any(looks_like_content(x, depth + 1) for x in list(v.values())[:64])
    if isinstance(v, list):
        return any(looks_like_content(x, depth + 1) for x in v[:64])
    return False


def unread_fields(rec: dict, read: set[str], ignore=()) -> list[str]:
    """The fields of ``rec`` outside ``read`` and ``ignore`` whose value looks like content, sorted."""
    return sorted(k for k, v in rec.items() if k not in read and k not in ignore and looks_like_content(v))
