"""linear attains the pytorch-model minimum: against exhaustive search (n ≤ 14) and the O(n²) recurrence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from remat.client.planning.cost_models import PytorchTables, pytorch_peak
from remat.client.planning.planners import PLANNERS, linear
from remat.client.planning.plans import make_plan
from remat.client.trace import TRACE_FORMAT, Trace, make_trace, parse_trace
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


LEAVES = (1, 2, 3, linear._LEAF)


@settings(max_examples=1500, deadline=None)
@given(traces(min_n=2, max_n=7, full=True), st.sampled_from(LEAVES))
def test_suffix_values_on_short_traces_match_the_quadratic_recurrence(trace: Trace, leaf: int) -> None:
    """Dense on short chains, where each optional term decides some segment's value often enough that a
    slip in one term of the leaf, the boundary row or the batch shows in a suffix value (mutation run)."""
    tables = PytorchTables(trace)
    assert linear.optimal_suffix_peaks(tables, leaf) == linear.quadratic_suffix_peaks(tables)[0]


@pytest.mark.parametrize(("before", "after"), [(0, 0), (1, 2), (3, 1)])
def test_the_recompute_of_a_segments_first_stage_decides_the_peak(before: int, after: int) -> None:
    """Stage "heavy"'s forward peak (1000) is paid only when a checkpointed segment starting at it is
    recomputed: its first forward drops the saved tensors (F° = 20), and only the segment (heavy, next]
    recomputes it with the next stage's output gradient (10) alive, so the optimum is 1010. Empty stages
    around it move that segment to an odd start inside a divide-and-conquer batch (leaves 1..3)."""
    empty = {"output_bytes": 0, "saved_bytes": 0}
    stages = [empty] * before + [
        {"output_bytes": 10, "saved_bytes": 0, "forward_peak_bytes": 1000, "forward_peak_dropped_bytes": 20,
         "recompute_peak_bytes": 1000},
        {"output_bytes": 10, "saved_bytes": 600},
        {"output_bytes": 10, "saved_bytes": 600},
    ] + [empty] * after
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0,
                         "stages": [{"name": f"s{i + 1}", **stage} for i, stage in enumerate(stages)]})
    tables = PytorchTables(trace)
    if before == after == 0:
        assert [pytorch_peak(trace, p, tables) for p in ((), (1,), (2,), (1, 2))] == [1220, 1220, 1010, 1010]
        assert linear.plan(trace) == (2,)
    assert _pytorch_minimum(trace)[0] == 1010
    assert pytorch_peak(trace, linear.plan(trace), tables) == 1010
    for leaf in LEAVES:
        assert linear.optimal_suffix_peaks(tables, leaf) == linear.quadratic_suffix_peaks(tables)[0]


@pytest.mark.parametrize("saves_nothing", [False, True])
def test_a_last_stage_past_256_is_priced_as_the_last_segment(saves_nothing: bool) -> None:
    """300 stages, the last one's full forward peak far above its dropped one: only the last segment
    (never checkpointed, never frameless) pays it. Past 256 stages a stage index is no longer a shared small
    int, so an identity comparison of indices would price it as a checkpointed one-stage segment, or, when
    it saves nothing, as a frameless one."""
    stages = [{"name": f"s{i}", "output_bytes": (i * 37) % 101 + 1, "saved_bytes": (i * 53) % 97}
              for i in range(1, 300)]
    last = {"name": "s300", "output_bytes": 7, "saved_bytes": 3, "forward_peak_bytes": 10**6,
            "forward_peak_dropped_bytes": 5}
    stages.append({**last, "saved_bytes": 0, "saves_nothing": True} if saves_nothing else last)
    tables = PytorchTables(parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages}))
    expected = linear.quadratic_suffix_peaks(tables)[0]
    assert expected[0] >= 10**6
    for leaf in LEAVES:
        assert linear.optimal_suffix_peaks(tables, leaf) == expected


@pytest.mark.parametrize(("sizes", "saved", "nearer", "farthest"), [
    ([3, 3, 8, 3, 2, 4], [0, 0, 4, 1, 1, 2], (2, 3), (3,)),
    ([2, 3, 1, 4, 8, 3, 8, 4, 8, 2, 1, 1], [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0], (3, 6), (6,)),
])
def test_the_plan_takes_the_farthest_admissible_checkpoint(sizes: list[int], saved: list[int],
                                                           nearer: tuple[int, ...], farthest: tuple[int, ...]) -> None:
    """Both plans attain the optimum; the rebuild's tie-break takes the farther checkpoint, which here gives
    the fewest checkpoints, as exhaustive search's first optimum does (6 and 12 stages: the rule holds
    beyond the first step and past 8 stages)."""
    trace = make_trace(sizes, saved)
    best, fewest = exhaustive_min(trace, pytorch_peak)
    assert fewest == farthest
    assert pytorch_peak(trace, nearer) == best
    assert linear.plan(trace) == farthest


def _non_decreasing(draw: st.DrawFn, size: int) -> np.ndarray:
    steps = draw(st.lists(st.integers(0, 6), min_size=size, max_size=size))
    return np.array(np.cumsum(steps) - draw(st.integers(0, 20)), dtype=np.int64)


@st.composite
def _separable_inputs(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    times, points = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    columns = [np.array(draw(st.lists(st.integers(-30, 30), min_size=points, max_size=points)), dtype=np.int64)
               for _ in range(3)]
    return (*columns, _non_decreasing(draw, times), _non_decreasing(draw, times))


@settings(max_examples=400, deadline=None)
@given(_separable_inputs())
def test_separable_min_is_the_direct_minimum(inputs: tuple[np.ndarray, ...]) -> None:
    """The batch kernel against its definition: min over j of max(W_j, p_s + X_j, p_s + m_s + D_j)."""
    W, X, D, p, m = inputs
    expected = [min(max(int(W[j]), int(p[s] + X[j]), int(p[s] + m[s] + D[j])) for j in range(len(W)))
                for s in range(len(p))]
    assert linear._separable_min(W, X, D, p, m, 1 << 62).tolist() == expected


@st.composite
def _intervals(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    T = draw(st.integers(1, 40))
    pairs = draw(st.lists(st.tuples(st.integers(0, T - 1), st.integers(1, T)), min_size=1, max_size=12))
    start = [min(a, b - 1) for a, b in pairs]
    stop = [max(a + 1, b) for a, b in pairs]
    value = draw(st.lists(st.integers(-50, 50), min_size=len(pairs), max_size=len(pairs)))
    return (np.array(start, dtype=np.int64), np.array(stop, dtype=np.int64), np.array(value, dtype=np.int64), T)


@settings(max_examples=400, deadline=None)
@given(_intervals())
def test_stabbing_min_is_the_direct_minimum(case: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> None:
    """Every interval length, including 3 (two power-of-two halves that overlap) and lengths up to T."""
    start, stop, value, T = case
    big = 1 << 62
    expected = [min([int(v) for a, b, v in zip(start, stop, value, strict=True) if a <= s < b], default=big)
                for s in range(T)]
    assert linear._stabbing_min(start, stop, value, T, big).tolist() == expected


def test_the_int64_fast_path_covers_every_table_below_2_to_the_59() -> None:
    """The documented switch: int64 batches while every entry is below 2^59 in magnitude (so every sum the
    batches form stays below 2^62), Python integers from 2^59 on."""
    names = linear._TABLE_NAMES
    below = linear._as_arrays([[0, (1 << 59) - 1]] + [[0, 0]] * (len(names) - 1))
    assert {a.dtype.kind for a in below.values()} == {"i"}
    for edge in (1 << 59, -(1 << 59)):
        past = linear._as_arrays([[0, 0]] * (len(names) - 1) + [[edge, 0]])
        assert {a.dtype.kind for a in past.values()} == {"O"}


def test_the_divide_and_conquer_never_runs_a_leaf_longer_than_the_leaf_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The O(n log² n) bound rests on it: a quadratic leaf over the whole chain gives the same values, slowly."""
    sizes = [(i * 7919) % 1013 + 1 for i in range(300)]
    tables = PytorchTables(make_trace(sizes, [(i * 104729) % 2003 for i in range(300)]))
    expected = linear.quadratic_suffix_peaks(tables)[0]
    leaf_lengths: list[int] = []
    run_leaf = linear._Solver._leaf

    def recording_leaf(self: linear._Solver, lo: int, hi: int) -> None:
        leaf_lengths.append(hi - lo)
        run_leaf(self, lo, hi)

    monkeypatch.setattr(linear._Solver, "_leaf", recording_leaf)
    for leaf in LEAVES:
        leaf_lengths.clear()
        assert linear.optimal_suffix_peaks(tables, leaf) == expected
        assert sum(leaf_lengths) == 300 and max(leaf_lengths) <= leaf
    assert linear.optimal_suffix_peaks(tables, 0) == expected  # a leaf size below 1 means 1


@settings(max_examples=300, deadline=None)
@given(traces(min_n=2, max_n=9, full=True))
def test_the_rebuild_steps_find_the_nearest_and_farthest_admissible_boundaries(trace: Trace) -> None:
    """The rebuild's two steps against the model's own local() by brute force, at every boundary and every
    budget that changes the answer. The farthest rule is the default; the nearest one takes over after 8n
    scanned positions, which short chains never reach, so it is checked here directly."""
    t = PytorchTables(trace)
    n, w = t.n, linear.optimal_suffix_peaks(t)
    for i in range(n - 1):
        ends = range(i + 1, n)
        costs = {j: max(t.local(i, j), w[j]) for j in ends}
        frameless = {j: max(t.local_frameless(i, j), w[j]) for j in ends if t.is_frameless(i, j)}
        values = {*costs.values(), *frameless.values()}
        for budget in sorted({-1, *values, *(v - 1 for v in values)}):
            admissible = [j for j in ends if costs[j] <= budget]
            # The scan stops at the first position whose backward or forward candidate alone is over the
            # budget (no later end can fit), or, for the nearest rule, one past the first admissible end.
            over = [j for j in range(i + 2, n) if max(t.back_ck[i + 1:j + 1]) - t.U[i] > budget
                    or max(t.fwd_first[i + 1], *t.fwd_mid[i + 2:j + 1]) > budget]
            last = max(i + 1, n - 1)
            far_stop = min(over, default=last)
            near_stop = min(far_stop, min(admissible, default=last) + 1, last)
            assert linear._next_checkpoint(t, w, i, budget, farthest=False) == (min(admissible, default=0),
                                                                                near_stop - i)
            assert linear._next_checkpoint(t, w, i, budget, farthest=True) == (max(admissible, default=0),
                                                                               far_stop - i)
            fits = [j for j, cost in frameless.items() if cost <= budget]
            if fits:
                assert linear._next_frameless(t, w, i, budget) == (min(fits), min(fits) - i)
            else:
                with pytest.raises(RuntimeError, match="no admissible boundary"):
                    linear._next_frameless(t, w, i, budget)


@pytest.mark.parametrize("scale", [1, 1 << 60])
def test_the_sentinel_exceeds_every_value_the_batches_form(scale: int) -> None:
    """The batches stand in ``big`` for an empty part of a minimum; every value they form is a sum of at
    most three table entries, so ``big`` must exceed three times the largest entry on both paths (int64,
    and Python integers past 2^59), or an empty part would win a minimum."""
    trace = _scaled(make_trace([5, 7, 11, 13, 2, 3], [1, 2, 3, 5, 8, 13], input_bytes=4), scale)
    tables = PytorchTables(trace)
    solver = linear._Solver(tables)
    assert solver.arr["U"].dtype.kind == ("i" if scale == 1 else "O")
    limit = 3 * (linear._INT64_LIMIT if scale == 1 else _table_max(trace))
    assert solver.big > limit


@pytest.mark.parametrize("short", [0, 1])
def test_the_rebuild_switches_to_the_nearest_rule_after_8n_scanned_positions(monkeypatch: pytest.MonkeyPatch,
                                                                             short: int) -> None:
    """The guard that keeps the rebuild O(n): farthest-first while fewer than 8n positions were scanned, the
    nearest rule after. Random chains scan under 2n in all, so each of this plan's 17 steps reports n scanned
    positions here, the eighth n - short: the ninth step starts at exactly 8n (nearest) or 8n - 1 (still
    farthest). The plan must stay optimal after the switch."""
    sizes = [(i * 7919) % 13 + 1 for i in range(150)]
    trace = make_trace(sizes, [(i * 104729) % 7 for i in range(150)])
    n, calls = trace.num_stages, []
    step, frameless_step = linear._next_checkpoint, linear._next_frameless

    def padded_step(*args: object, farthest: bool) -> tuple[int, int]:
        calls.append(farthest)
        j, _ = step(*args, farthest=farthest)
        return j, n - (short if len(calls) == 8 else 0)

    def padded_frameless(*args: object) -> tuple[int, int]:
        j, _ = frameless_step(*args)
        return j, n

    monkeypatch.setattr(linear, "_next_checkpoint", padded_step)
    monkeypatch.setattr(linear, "_next_frameless", padded_frameless)
    checkpoints = linear.plan(trace)
    assert len(calls) > 10  # enough steps to pass 8n
    switch = 8 + short
    assert calls == [True] * switch + [False] * (len(calls) - switch)
    tables = PytorchTables(trace)
    assert pytorch_peak(trace, checkpoints, tables) == linear.quadratic_suffix_peaks(tables)[0][0]


def test_the_rebuild_prices_the_last_segment_by_its_own_stages() -> None:
    """Stage 2's full forward peak (1000) is paid only outside a checkpointed segment, whose first forward
    drops its saved tensors (F° = 1). The optimum (2,) ends with the last segment (2, 4]: the rebuild must
    not charge it stage 2's forward, which ran in the segment before."""
    stages = [{"output_bytes": 0, "saved_bytes": 0},
              {"output_bytes": 0, "saved_bytes": 0, "forward_peak_bytes": 1000, "forward_peak_dropped_bytes": 1},
              {"output_bytes": 0, "saved_bytes": 0, "forward_peak_dropped_bytes": 2},
              {"output_bytes": 0, "saved_bytes": 0}]
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0,
                         "stages": [{"name": f"s{i + 1}", **stage} for i, stage in enumerate(stages)]})
    assert (pytorch_peak(trace, ()), pytorch_peak(trace, (3,)), pytorch_peak(trace, (2,))) == (1000, 1000, 1)
    assert linear.plan(trace) == (2,)
