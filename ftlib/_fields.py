"""Typed reads of fields from parsed JSON files (config.json, adapter_config.json, tokenizer_config.json).

JSON carries its own types, and Python's conversions do not check them: ``bool("false")`` is
True, ``list("lm_head")`` is a list of characters, ``float(None)`` raises a bare TypeError. Every
field ftlib reads from such a file goes through one of these functions, which return the value
when its type (and range) is the expected one and otherwise raise ``ValueError`` naming the file,
the field, what was expected and what was found::

    config.json: field tie_word_embeddings must be a boolean (true/false), got 'false' (a string)

Conventions: a missing key gives ``default`` (or an error without one); JSON ``null`` is an error
unless ``nullable=True``, where it gives ``None``. Booleans are never numbers (``true`` is not
the integer 1), integers are accepted where a number is expected, and numbers must be finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["REQUIRED", "json_bool", "json_dict", "json_float", "json_int", "json_int_list", "json_str", "json_str_list"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: ``default=REQUIRED``: the field must be present.
REQUIRED: Any = _Required()

_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object", type(None): "null"}


def _got(value: Any) -> str:
    kind = _JSON_TYPES.get(type(value), type(value).__name__)
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{shown} ({kind})"


def _fail(source: str, key: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{source}: field {key} must be {expected}, got {_got(value)}")


def _lookup(d: Mapping, key: str, source: str, default: Any, nullable: bool, expected: str) -> tuple[bool, Any]:
    """(done, value): done when the key is missing or null and that is allowed."""
    if key not in d or (d[key] is None and nullable):
        if key not in d and default is REQUIRED:
            raise ValueError(f"{source}: missing field {key!r} ({expected})")
        return True, None if key in d else default
    return False, d[key]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _int_words(min: int | None) -> str:
    return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(min, f"an integer >= {min}")


def json_int(d: Mapping, key: str, source: str, *, default: Any = REQUIRED, nullable: bool = False,
             min: int | None = None) -> int | None:
    """An integer field, ``>= min`` when given."""
    expected = _int_words(min)
    done, v = _lookup(d, key, source, default, nullable, expected)
    if done:
        return v
    if not _is_int(v) or (min is not None and v < min):
        raise _fail(source, key, expected, v)
    return v


def json_int_list(d: Mapping, key: str, source: str, *, default: Any = REQUIRED, nullable: bool = False,
                  or_int: bool = False, min: int | None = None) -> list[int] | int | None:
    """A non-empty list of integers (each ``>= min``); with ``or_int`` a single integer is also accepted."""
    each = _int_words(min).removeprefix("an ").removeprefix("a ")
    expected = (_int_words(min) + " or " if or_int else "") + f"a non-empty list of {each}s"
    done, v = _lookup(d, key, source, default, nullable, expected)
    if done:
        return v
    if or_int and _is_int(v):
        if min is not None and v < min:
            raise _fail(source, key, expected, v)
        return v
    if not isinstance(v, list) or not v:
        raise _fail(source, key, expected, v)
    for i, item in enumerate(v):
        if not _is_int(item) or (min is not None and item < min):
            raise ValueError(f"{source}: field {key} must be {expected}; item {i} is {_got(item)}")
    return list(v)


def json_float(d: Mapping, key: str, source: str, *, default: Any = REQUIRED, nullable: bool = False,
               min: float | None = None, max: float | None = None, min_open: bool = False,
               max_open: bool = False) -> float | None:
    """A finite number (an integer is accepted), returned as float, in ``[min, max]`` (or open ends)."""
    bounds = []
    if min is not None:
        bounds.append(f"{'>' if min_open else '>='} {min}")
    if max is not None:
        bounds.append(f"{'<' if max_open else '<='} {max}")
    expected = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")
    done, v = _lookup(d, key, source, default, nullable, expected)
    if done:
        return v
    if not _is_number(v):
        raise _fail(source, key, expected, v)
    low_bad = min is not None and (v <= min if min_open else v < min)
    high_bad = max is not None and (v >= max if max_open else v > max)
    if low_bad or high_bad:
        raise _fail(source, key, expected, v)
    return float(v)


def json_bool(d: Mapping, key: str, source: str, *, default: Any = REQUIRED, nullable: bool = False) -> bool | None:
    """A JSON boolean (``true``/``false``; not a string or a number)."""
    expected = "a boolean (true/false)"
    done, v = _lookup(d, key, source, default, nullable, expected)
    if done:
        return v
    if not isinstance(v, bool):
        raise _fail(source, key, expected, v)
    return v


def json_str(d: Mapping, key: str, source: str, *, default: Any = REQUIRED, nullable: bool = False,
             choices: tuple[str, ...] | None = None) -> str | None:
    """A string, one of ``choices`` when given."""
    expected = "a string" + (f" (one of {', '.join(map(repr, choices))})" if choices else "")
    done, v = _lookup(d, key, source, default, nullable, expected)
    if done:
        return v
    if not isinstance(v, str) or (choices is not None and v not in choices):
        raise _fail(source, key, expected, v)
    return v


def json_str_list(d: Mapping, key: str, source: str, *, default: Any = REQUIRED, nullable: bool = False,
                  or_str: bool = False) -> list[str] | str | None:
    """A list of strings (a copy); with ``or_str`` a single string is also accepted and returned as is."""
    expected = ("a string or " if or_str else "") + "a list of strings"
    done, v = _lookup(d, key, source, default, nullable, expected)
    if done:
        return v
    if or_str and isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise _fail(source, key, expected, v)
    for i, item in enumerate(v):
        if not isinstance(item, str):
            raise ValueError(f"{source}: field {key} must be {expected}; item {i} is {_got(item)}")
    return list(v)


def json_dict(d: Mapping, key: str, source: str, *, default: Any = REQUIRED, nullable: bool = False,
              values: str | None = None, above: float | None = None) -> dict | None:
    """A JSON object (a copy). ``values="int"`` / ``"number"`` checks every value (``> above`` when given)."""
    kind = {"int": "integer", "number": "number", None: None}[values]
    expected = "an object" + (f" of {kind}s" if kind else "") + (f" > {above}" if kind and above is not None else "")
    done, v = _lookup(d, key, source, default, nullable, expected)
    if done:
        return v
    if not isinstance(v, dict):
        raise _fail(source, key, expected, v)
    if kind is not None:
        for k, item in v.items():
            ok = _is_int(item) if values == "int" else _is_number(item)
            if not ok or (above is not None and not item > above):
                raise ValueError(f"{source}: field {key} must be {expected}; {key}[{k!r}] is {_got(item)}")
    return dict(v)
