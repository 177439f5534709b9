"""remat.client.wire_json: the one JSON reading, against an oracle that says what JSON remat keeps.

The oracle is written from the rules, not from the module: a value is keepable when every float is finite,
every integer fits 64 bits, every string encodes as UTF-8 and containers nest at most MAX_DEPTH deep.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.client.wire_json import MAX_DEPTH, MAX_INT, WireJSONError, check, loads

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4),
                                                                                          inner, max_size=4),
                      max_leaves=30)


def keepable(value: Any, depth: int = 0) -> bool:
    if isinstance(value, dict):
        return depth < MAX_DEPTH and all(keepable(k) and keepable(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return depth < MAX_DEPTH and all(keepable(v, depth + 1) for v in value)
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return abs(value) <= MAX_INT
    if isinstance(value, float):
        return math.isfinite(value)
    assert isinstance(value, str)
    return all(not 0xD800 <= ord(c) <= 0xDFFF for c in value)


@settings(max_examples=400, deadline=None)
@given(values)
def test_loads_accepts_exactly_what_remat_keeps(value: Any) -> None:
    text = json.dumps(value)  # writes NaN/Infinity for non-finite floats, as a careless client would
    if keepable(value):
        assert loads(text) == json.loads(text)
    else:
        with pytest.raises(WireJSONError):
            loads(text)


@settings(max_examples=200, deadline=None)
@given(values)
def test_check_agrees_with_loads(value: Any) -> None:
    if keepable(value):
        check(value)
    else:
        with pytest.raises(WireJSONError):
            check(value)


@pytest.mark.parametrize("text, where", [
    ('{"extra": {"x": NaN}}', "extra.x: NaN is not a number"),
    ('{"a": [1, Infinity]}', "a[1]: Infinity is not a number"),
    ('{"a": -Infinity}', "a: -Infinity"),
    ('{"a": 1e400}', "a: 1e400 is not a number"),
    ('{"a": -1e400}', "a: -1e400"),
    ('{"a": ' + "9" * 5000 + "}", "a: 999999999999...(5000 digits) is not a number"),
    ('{"a": 9223372036854775808}', "a: 9223372036854775808 is not a number"),
    ('{"a": "\\ud800"}', "a: not valid Unicode"),
    ('{"\\udfff": 1}', "body: a key is not valid Unicode"),
    ("[" * 1000 + "]" * 1000, "body: nested more than 32 levels deep"),
    ("[" * 100000 + "]" * 100000, "body: nested more than 32 levels deep"),
    ('{"a": ' + "[" * 32 + "]" * 32 + "}", "a" + "[0]" * 31 + ": nested more than 32"),
    ('{"a": 1', "body: not valid JSON (Expecting"),
    (b'{"a": "\xff"}', "body: not valid JSON (not UTF-8 text)"),
])
def test_refusals_name_the_place(text: str | bytes, where: str) -> None:
    with pytest.raises(WireJSONError) as info:
        loads(text)
    assert str(info.value).startswith(where), str(info.value)
    assert "\n" not in str(info.value)


def test_the_limits_themselves_are_kept() -> None:
    assert loads(f"[{MAX_INT}, {-MAX_INT}, 1.7976931348623157e308]") == [MAX_INT, -MAX_INT, 1.7976931348623157e308]
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(deepest) == json.loads(deepest)


def test_where_names_the_source() -> None:
    with pytest.raises(WireJSONError, match=r"^stages\[0\]\.forward_ms: NaN"):
        loads('{"stages": [{"forward_ms": NaN}]}', where="trace")
    with pytest.raises(WireJSONError, match=r"^trace: not valid JSON"):
        loads('{"stages": ', where="trace")
