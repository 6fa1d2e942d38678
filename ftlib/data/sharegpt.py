"""ShareGPT records read as chat: ``{"conversations": [{"from": "human", "value": ...}, ...]}``.

The chat formatter (``ftlib.data.formatting``) reads a record's turns through :func:`chat_turns`:
the configured messages field (``messages``), or, when a record has no such field, ShareGPT's
``conversations``. Turns written ShareGPT's way (``from`` / ``value``) become ``{"role",
"content"}`` with the roles mapped by :data:`SHAREGPT_ROLES` (``human`` -> ``user``, ``gpt`` ->
``assistant``, ``system`` stays); turns already in ``role`` / ``content`` form pass unchanged. A
``from`` outside the table is reported with the turn's index, never guessed.
"""

from __future__ import annotations

__all__ = ["SHAREGPT_FIELD", "SHAREGPT_ROLES", "chat_turns"]

SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system"}


def chat_turns(rec: dict, field: str = "messages") -> tuple[str, object]:
    """(field read, turns) of a chat record: ``rec[field]``, else ShareGPT ``conversations``; turns
    in ``from``/``value`` form converted to ``role``/``content``. ``KeyError`` when neither field is
    there, ``ValueError`` naming the turn whose ``from`` is unknown."""
    if field not in rec and SHAREGPT_FIELD in rec:
        field = SHAREGPT_FIELD
    turns = rec[field]  # KeyError: the caller reports the missing field
    if not isinstance(turns, list):
        return field, turns
    out = []
    for j, t in enumerate(turns):
        if isinstance(t, dict) and "role" not in t and "from" in t:
            role = SHAREGPT_ROLES.get(t["from"]) if isinstance(t["from"], str) else None
            if role is None:
                raise ValueError(f"message {j}: ShareGPT 'from' {t['from']!r} is not one of "
                                 f"{', '.join(SHAREGPT_ROLES)}")
            t = {"role": role, "content": t.get("value")}
        out.append(t)
    return field, out
