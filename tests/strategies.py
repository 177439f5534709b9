"""Hypothesis strategies for traces, biased towards the inputs that break planners.

Every byte column is drawn from one of several *size shapes*: all zeros, tiny values (many ties), all equal,
one huge stage among small ones, powers of two (sums collide with single values) and uniform up to 2^40.
With ``full=True`` the optional fields of ``remat-trace/1`` are drawn too: the saves_input/saves_output/
saves_nothing flags (random, all set or none set; a stage that saves nothing gets no saved bytes or flags)
and the profiled peaks and parameter gradients (absent or any shape).
"""

from __future__ import annotations

from hypothesis import strategies as st

from remat.client.trace import OPTIONAL_STAGE_BOOLS, OPTIONAL_STAGE_BYTES, TRACE_FORMAT, Trace, parse_trace

HUGE = 2**40
SHAPES = ("zeros", "tiny", "equal", "one_huge", "pow2", "random")


@st.composite
def byte_columns(draw: st.DrawFn, n: int, shape: str | None = None) -> list[int]:
    """n non-negative byte counts of one size shape (drawn when not given)."""
    shape = shape or draw(st.sampled_from(SHAPES))
    if shape == "zeros":
        return [0] * n
    if shape == "tiny":
        return draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    if shape == "equal":
        return [draw(st.sampled_from([1, 3, 1024, HUGE]) | st.integers(0, HUGE))] * n
    if shape == "one_huge":
        values = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
        values[draw(st.integers(0, n - 1))] = draw(st.sampled_from([HUGE, 1000, 2**20]))
        return values
    if shape == "pow2":
        return [2**k for k in draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))]
    return draw(st.lists(st.integers(0, HUGE), min_size=n, max_size=n))


@st.composite
def flag_columns(draw: st.DrawFn, n: int) -> list[bool]:
    """n booleans: all false, all true, or random."""
    mode = draw(st.sampled_from(("none", "all", "random")))
    if mode == "none":
        return [False] * n
    if mode == "all":
        return [True] * n
    return draw(st.lists(st.booleans(), min_size=n, max_size=n))


@st.composite
def traces(draw: st.DrawFn, min_n: int = 1, max_n: int = 14, full: bool = True) -> Trace:
    """A valid trace of min_n..max_n stages; ``full`` adds the optional flags and byte fields."""
    n = draw(st.integers(min_n, max_n))
    columns: dict[str, list] = {
        "output_bytes": draw(byte_columns(n)),
        "saved_bytes": draw(byte_columns(n)),
    }
    if full:
        for key in OPTIONAL_STAGE_BOOLS:
            columns[key] = draw(flag_columns(n))
        for key in OPTIONAL_STAGE_BYTES:
            if draw(st.booleans()):
                columns[key] = draw(byte_columns(n))
        if "cast_bytes" in columns or "cast_unsaved_bytes" in columns:
            cast = columns.setdefault("cast_bytes", [0] * n)
            unsaved = columns.setdefault("cast_unsaved_bytes", [0] * n)
            columns["cast_unsaved_bytes"] = [min(c, x) for c, x in zip(cast, unsaved, strict=True)]
        for i, nothing in enumerate(columns["saves_nothing"]):
            if nothing:  # a stage that saves nothing has no saved bytes and saves neither end
                columns["saved_bytes"][i] = 0
                columns["saves_input"][i] = columns["saves_output"][i] = False
    stages = [{"name": f"s{i + 1}", **{key: values[i] for key, values in columns.items()}} for i in range(n)]
    input_bytes = draw(st.sampled_from([0, 1, HUGE]) | st.integers(0, HUGE))
    return parse_trace({"format": TRACE_FORMAT, "input_bytes": input_bytes, "stages": stages})
