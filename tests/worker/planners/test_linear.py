"""linear attains the pytorch-model minimum: against exhaustive search (n ≤ 14) and the O(n²) recurrence."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from remat.client.trace import TRACE_FORMAT, Trace, make_trace, parse_trace
from remat.worker.cost_models import PytorchTables, pytorch_peak
from remat.worker.planners import PLANNERS, linear
from remat.worker.planning import make_plan
from tests.oracles import exhaustive_min
from tests.strategies import traces


def _pytorch_minimum(trace: Trace) -> tuple[int, PytorchTables]:
    tables = PytorchTables(trace)
    best, _ = exhaustive_min(trace, lambda tr, checkpoints: pytorch_peak(tr, checkpoints, tables))
    return best, tables


def _assert_valid(checkpoints: tuple[int, ...], n: int) -> None:
    assert isinstance(checkpoints, tuple)
    assert all(type(c) is int and 1 <= c <= n - 1 for c in checkpoints)
    assert list(checkpoints) == sorted(set(checkpoints))


@settings(max_examples=500, deadline=None)
@given(traces(min_n=1, max_n=14, full=True))
def test_linear_attains_the_exhaustive_minimum(trace: Trace) -> None:
    best, tables = _pytorch_minimum(trace)
    checkpoints = linear.plan(trace)
    _assert_valid(checkpoints, trace.num_stages)
    assert pytorch_peak(trace, checkpoints, tables) == best


@settings(max_examples=100, deadline=None)
@given(traces(min_n=11, max_n=14, full=True))
def test_linear_attains_the_exhaustive_minimum_on_the_longest_chains(trace: Trace) -> None:
    best, tables = _pytorch_minimum(trace)
    assert pytorch_peak(trace, linear.plan(trace, cost_model="pytorch"), tables) == best


@settings(max_examples=80, deadline=None)
@given(traces(min_n=1, max_n=13, full=False))
def test_linear_attains_the_exhaustive_minimum_on_plain_traces(trace: Trace) -> None:
    best, tables = _pytorch_minimum(trace)
    assert pytorch_peak(trace, linear.plan(trace), tables) == best


@settings(max_examples=120, deadline=None)
@given(traces(min_n=1, max_n=13, full=True))
def test_quadratic_reference_attains_the_exhaustive_minimum(trace: Trace) -> None:
    best, tables = _pytorch_minimum(trace)
    checkpoints = linear._plan_quadratic(trace)
    _assert_valid(checkpoints, trace.num_stages)
    assert pytorch_peak(trace, checkpoints, tables) == best
    assert linear.quadratic_suffix_peaks(tables)[0][0] == best


@settings(max_examples=250, deadline=None)
@given(traces(min_n=1, max_n=200, full=True), st.sampled_from([1, 2, 3, 32]))
def test_every_suffix_value_matches_the_quadratic_recurrence(trace: Trace, leaf: int) -> None:
    # Small leaves send nearly every pair through the vectorised batches; 32 is the production size.
    tables = PytorchTables(trace)
    reference, _ = linear.quadratic_suffix_peaks(tables)
    assert linear.optimal_suffix_peaks(tables, leaf) == reference
    checkpoints = linear.plan(trace)
    _assert_valid(checkpoints, trace.num_stages)
    assert pytorch_peak(trace, checkpoints, tables) == reference[0]


@st.composite
def _huge_traces(draw: st.DrawFn) -> Trace:
    """Byte counts up to 2^70: past int64, so the batches run on Python integers."""
    n = draw(st.integers(2, 60))
    column = st.lists(st.integers(0, 2**70), min_size=n, max_size=n)
    d, e, g, b = (draw(column) for _ in range(4))
    flags = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    stages = [{"name": f"s{i}", "output_bytes": d[i], "saved_bytes": e[i], "param_grad_bytes": g[i],
               "backward_peak_bytes": b[i], "saves_input": flags[i]} for i in range(n)]
    return parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})


@settings(max_examples=40, deadline=None)
@given(_huge_traces(), st.sampled_from([1, 2, 32]))
def test_values_beyond_int64_stay_exact(trace: Trace, leaf: int) -> None:
    tables = PytorchTables(trace)
    reference, _ = linear.quadratic_suffix_peaks(tables)
    assert linear.optimal_suffix_peaks(tables, leaf) == reference
    assert pytorch_peak(trace, linear.plan(trace), tables) == reference[0]


@settings(max_examples=150, deadline=None)
@given(traces(min_n=2, max_n=12, full=True), st.data())
def test_local_never_grows_when_a_segment_shrinks_from_the_left(trace: Trace, data: st.DataObject) -> None:
    # The module docstring's claim, for every segment that is not the last one.
    tables = PytorchTables(trace)
    b = data.draw(st.integers(2, trace.num_stages - 1)) if trace.num_stages > 2 else 1
    values = [tables.local(a, b) for a in range(b)]
    assert values == sorted(values, reverse=True)


def test_the_last_segment_is_not_monotone_in_its_start() -> None:
    # Stage 2 outputs nothing and saves 1 byte; stage 3 keeps 100. Starting at 1, x_1 is dropped after stage 2.
    tables = PytorchTables(make_trace([100, 0, 100], [5, 1, 0]))
    assert (tables.local(1, 3), tables.local(2, 3)) == (1, 100)


@pytest.mark.parametrize(("sizes", "saved"), [
    ([7], [7]),
    ([4, 4, 4, 4], None),
    ([0, 0, 0, 0, 0], None),
    ([1, 1000, 1, 1, 1], None),
    ([2**40] * 9, [1] * 9),
    ([5, 7, 11, 13, 2, 3], [1, 2, 3, 5, 8, 13]),
])
def test_small_traces_by_exhaustive_search(sizes: list[int], saved: list[int] | None) -> None:
    trace = make_trace(sizes, saved)
    best, tables = _pytorch_minimum(trace)
    assert pytorch_peak(trace, linear.plan(trace), tables) == best


def test_single_stage_has_no_boundary() -> None:
    assert linear.plan(make_trace([123])) == ()
    assert linear._plan_quadratic(make_trace([123])) == ()


def test_cost_model_argument_is_ignored() -> None:
    trace = make_trace([5, 7, 11, 13, 2, 3, 9, 4], [1, 2, 3, 5, 8, 13, 1, 1])
    assert linear.plan(trace, cost_model="classic") == linear.plan(trace)


def test_registry_and_reported_plan() -> None:
    assert PLANNERS["linear"].fn is linear.plan
    trace = make_trace([3, 9, 2, 8, 1, 7, 4, 4, 6, 5])
    plan = make_plan(trace, "linear")
    assert plan.cost_model == "pytorch"
    assert plan.predicted_peak_bytes == pytorch_peak(trace, plan.checkpoints)
    assert plan.predicted_peak_bytes == linear.optimal_suffix_peaks(PytorchTables(trace))[0]


def test_a_long_chain_matches_the_reference() -> None:
    # 600 stages: five levels of batches at the production leaf size.
    sizes = [(i * 7919) % 1013 + 1 for i in range(600)]
    saved = [(i * 104729) % 2003 for i in range(600)]
    tables = PytorchTables(make_trace(sizes, saved))
    assert linear.optimal_suffix_peaks(tables) == linear.quadratic_suffix_peaks(tables)[0]


def _scaled(trace: Trace, k: int) -> Trace:
    """The trace with every byte count multiplied by ``k`` (flags and names unchanged)."""
    def scale(value: object) -> object:
        return value * k if isinstance(value, int) and not isinstance(value, bool) else value

    data = trace.to_dict()
    data["input_bytes"] = scale(data.get("input_bytes", 0))
    data["stages"] = [{key: scale(v) for key, v in stage.items()} for stage in data["stages"]]
    return parse_trace(data)


def _table_max(trace: Trace) -> int:
    tables = PytorchTables(trace)
    return max(abs(v) for name in linear._TABLE_NAMES for v in getattr(tables, name))


@settings(max_examples=60, deadline=None)
@given(traces(min_n=2, max_n=40, full=True), st.sampled_from([1, 2, 32]))
def test_the_int64_path_is_exact_at_its_limit_and_the_integer_path_just_past_it(trace: Trace, leaf: int) -> None:
    """Scaled so that the largest table entry is the last value the int64 batches accept, then one step past
    it (the tables are homogeneous in the byte counts, so scaling moves every entry together)."""
    m = _table_max(trace)
    assume(m > 0)
    k = (linear._INT64_LIMIT - 1) // m
    for scale, kind in ((k, "i"), (k + 1, "O")):
        big = _scaled(trace, scale)
        assert _table_max(big) == scale * m
        tables = PytorchTables(big)
        assert linear._as_arrays([getattr(tables, n) for n in linear._TABLE_NAMES])["U"].dtype.kind == kind
        reference, _ = linear.quadratic_suffix_peaks(tables)
        assert linear.optimal_suffix_peaks(tables, leaf) == reference
        assert pytorch_peak(big, linear.plan(big), tables) == reference[0]
