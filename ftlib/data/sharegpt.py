"""ShareGPT records read as chat: ``{"conversations": [{"from": "human", "value": ...}, ...]}``.

The chat formatter (``ftlib.data.formatting``) reads a record's turns through :func:`chat_turns`:
the configured messages field (``messages``), or, when a record has no such field, ShareGPT's
``conversations``. Turns written ShareGPT's way (``from`` / ``value``) become ``{"role",
"content"}`` with the roles mapped by :data:`SHAREGPT_ROLES` (``human`` -> ``user``, ``gpt`` ->
``assistant``, ``system`` stays); turns already in ``role`` / ``content`` form pass unchanged. A
``from`` outside the table is reported with the turn's index, never guessed.

LLaMA-Factory's ShareGPT layout adds three things, all kept: a top-level ``system`` string (the
system prompt, put first as a ``system`` turn unless the turns start with one), ``function_call``
turns (the assistant's tool call: ``value`` is the JSON ``{"name", "arguments"}``, or a list of
them) read as an assistant turn with ``tool_calls``, and ``observation`` turns (the tool's result)
read as ``tool`` turns. A top-level ``tools`` (the functions offered) is the formatter's
``tools_field``.
"""

from __future__ import annotations

import json

__all__ = ["SHAREGPT_FIELD", "SHAREGPT_READS", "SHAREGPT_ROLES", "chat_turns"]

SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system", "observation": "tool", "function": "tool",
                  "function_call": "assistant"}
SHAREGPT_READS = (SHAREGPT_FIELD, "system")  # the record fields a ShareGPT record is read from


def chat_turns(rec: dict, field: str = "messages") -> tuple[str, object]:
    """(field read, turns) of a chat record: ``rec[field]``, else ShareGPT ``conversations``; turns
    in ``from``/``value`` form converted to ``role``/``content``. ``KeyError`` when neither field is
    there, ``ValueError`` naming the turn whose ``from`` is unknown (or whose call is not JSON)."""
    sharegpt = field not in rec and SHAREGPT_FIELD in rec
    if sharegpt:
        field = SHAREGPT_FIELD
    turns = rec[field]  # KeyError: the caller reports the missing field
    if not isinstance(turns, list):
        return field, turns
    out = []
    system = rec.get("system") if sharegpt else None
    first = turns[0] if turns else None
    first_role = (first.get("role") or SHAREGPT_ROLES.get(first.get("from"))) if isinstance(first, dict) else None
    if isinstance(system, str) and system.strip() and first_role != "system":
        out.append({"role": "system", "content": system})
    for j, t in enumerate(turns):
        if isinstance(t, dict) and "role" not in t and "from" in t:
            role = SHAREGPT_ROLES.get(t["from"]) if isinstance(t["from"], str) else None
            if role is None:
                raise ValueError(f"message {j}: ShareGPT 'from' {t['from']!r} is not one of "
                                 f"{', '.join(SHAREGPT_ROLES)}")
            if t["from"] == "function_call":
                t = {"role": "assistant", "content": "", "tool_calls": _calls(t.get("value"), j)}
            else:
                t = {"role": role, "content": t.get("value")}
        out.append(t)
    return field, out


def _calls(value, j: int) -> list[dict]:
    """A ShareGPT ``function_call`` value (JSON text of one call or a list) as OpenAI-style ``tool_calls``."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except ValueError as e:
        raise ValueError(f"message {j}: ShareGPT 'function_call' value is not JSON ({e})") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise ValueError(f"message {j}: ShareGPT 'function_call' must be {{\"name\", \"arguments\"}} (or a list)")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]
