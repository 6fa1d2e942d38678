"""Typed JSON field reads: each wrong type or range is refused naming the file, the field, expected and got."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftlib._fields import json_bool, json_dict, json_float, json_int, json_int_list, json_str, json_str_list

SRC = "some/dir/x.json"


def _refused(fn, value, *args, **kw):
    with pytest.raises(ValueError) as e:
        fn({"f": value}, "f", SRC, *args, **kw)
    msg = str(e.value)
    assert msg.startswith(SRC + ": field f must be"), msg
    return msg


def test_strings_and_numbers_are_not_booleans():
    assert json_bool({"f": False}, "f", SRC) is False
    msg = _refused(json_bool, "false")
    assert "a boolean" in msg and "got 'false' (a string)" in msg
    _refused(json_bool, 0)
    _refused(json_bool, None)


def test_integers():
    assert json_int({"f": 7}, "f", SRC, min=1) == 7
    assert "got 'abc' (a string)" in _refused(json_int, "abc", min=1)
    assert "a positive integer, got -5" in _refused(json_int, -5, min=1)
    _refused(json_int, True)  # JSON true is not the integer 1
    _refused(json_int, 2048.0)
    assert json_int_list({"f": [1, 2]}, "f", SRC, or_int=True) == [1, 2]
    assert json_int_list({"f": 3}, "f", SRC, or_int=True) == 3
    assert "item 1" in str(pytest.raises(ValueError, json_int_list, {"f": [1, "2"]}, "f", SRC).value)


def test_numbers_are_finite_and_in_range():
    assert json_float({"f": 16}, "f", SRC, min=0, min_open=True) == 16.0
    assert "got '16' (a string)" in _refused(json_float, "16", min=0, min_open=True)
    _refused(json_float, math.nan)
    _refused(json_float, math.inf)
    _refused(json_float, 0, min=0, min_open=True)
    assert "< 1" in _refused(json_float, 1.0, min=0, max=1, max_open=True)


def test_missing_and_null():
    assert json_int({}, "f", SRC, default=3) == 3
    with pytest.raises(ValueError, match=f"{SRC}: missing field 'f'"):
        json_int({}, "f", SRC)
    assert json_int({"f": None}, "f", SRC, default=3, nullable=True) is None
    assert "got None (null)" in _refused(json_float, None, default=1.0)


def test_lists_strings_and_objects():
    assert "got 'lm_head' (a string)" in _refused(json_str_list, "lm_head")
    assert json_str_list({"f": "q_proj|v_proj"}, "f", SRC, or_str=True) == "q_proj|v_proj"
    assert "item 1 is 3" in str(pytest.raises(ValueError, json_str_list, {"f": ["a", 3]}, "f", SRC).value)
    assert json_str({"f": "a"}, "f", SRC, choices=("a", "b")) == "a"
    _refused(json_str, "c", choices=("a", "b"))
    assert json_dict({"f": {"q": 4}}, "f", SRC, values="int", above=0) == {"q": 4}
    msg = str(pytest.raises(ValueError, json_dict, {"f": {"q": "4"}}, "f", SRC, values="int", above=0).value)
    assert "f['q'] is '4' (a string)" in msg
    _refused(json_dict, ["q"])


@given(st.one_of(st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=5), st.none(),
                 st.lists(st.integers(), max_size=2)))
def test_a_value_is_returned_only_when_its_type_is_the_expected_one(v):
    d = {"f": v}
    checks = [
        (json_bool, isinstance(v, bool)),
        (json_int, isinstance(v, int) and not isinstance(v, bool)),
        (json_float, isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
        (json_str, isinstance(v, str)),
    ]
    for fn, ok in checks:
        if ok:
            assert fn(d, "f", SRC) == v
        else:
            with pytest.raises(ValueError, match="field f must be"):
                fn(d, "f", SRC)
