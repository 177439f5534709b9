"""Cost models on hand-worked traces, so each term of docs/cost-model.md is pinned by an exact number."""

from __future__ import annotations

import pytest

from remat.client.errors import PlanError
from remat.client.planning.cost_models import PytorchTables, classic_peak, peak, pytorch_peak
from remat.client.trace import TRACE_FORMAT, Trace, make_trace, parse_trace


class TestClassic:
    def test_no_checkpoints_is_sum_of_inner_activations(self) -> None:
        assert classic_peak(make_trace([5, 7, 11, 13]), ()) == 5 + 7 + 11

    def test_checkpoints_plus_largest_interior(self) -> None:
        # C = {2}: d_2 + max(d_1, d_3) = 7 + 11
        assert classic_peak(make_trace([5, 7, 11, 13]), (2,)) == 18

    def test_every_boundary(self) -> None:
        assert classic_peak(make_trace([5, 7, 11, 13]), (1, 2, 3)) == 5 + 7 + 11

    def test_single_stage(self) -> None:
        assert classic_peak(make_trace([9]), ()) == 0


class TestPytorch:
    def test_plain_trace_no_checkpoints(self) -> None:
        # No flags, no profiled peaks. Backward of stage 4: all saved tensors plus its output gradient,
        # 1 + 2 + 3 + 5 + 4 = 15. The end of stage 4's forward is higher: stages 1-3's saved (6), its input
        # x_3 (4, alive while it runs though nobody saves it), its saved (5) and its output (4) = 19.
        trace = make_trace([4, 4, 4, 4], [1, 2, 3, 5])
        assert pytorch_peak(trace, ()) == 19
        flagged = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": [
            {"name": f"s{i}", "output_bytes": 4, "saved_bytes": e, "saves_input": True}
            for i, e in enumerate([1, 2, 3, 5])]})
        # With every input saved (x_0 is the baseline), stages 1-3 keep 1+4, 2+4, 3+4 = 18 and stage 4 adds its
        # saved and its output (forward's end) or its saved and its output gradient (backward): 27 both.
        assert pytorch_peak(flagged, ()) == 27

    def test_plain_trace_one_checkpoint(self) -> None:
        trace = make_trace([4, 4, 4, 4])
        # Segment 1 re-run, at its last stage: stage 1's saved (4) + x_1 (4, unsaved input of stage 2)
        # + stage 2's saved (4) + gradient of x_2 (4) = 16. Last segment: x_2 dropped (not saved by
        # stage 3), stages 3-4 saved + grad of x_4 = 12, plus checkpoint x_2 kept only if saved: 12.
        assert pytorch_peak(trace, (2,)) == 16

    def test_docstring_example_matches(self) -> None:
        assert pytorch_peak(make_trace([4, 4, 4, 4]), [2]) == 16

    def test_boundary_storage_counted_once(self) -> None:
        stages = [
            {"name": "a", "output_bytes": 10, "saved_bytes": 0, "saves_output": True},
            {"name": "b", "output_bytes": 30, "saved_bytes": 0, "saves_input": True},
        ]
        trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
        # Stage b's backward: x_1, saved by both stages, counted once (10) + b's output gradient (30).
        assert pytorch_peak(trace, ()) == 10 + 30

    def test_parameter_gradients_of_later_stages_stay_alive(self) -> None:
        stages = [
            {"name": "a", "output_bytes": 1, "saved_bytes": 1, "param_grad_bytes": 100},
            {"name": "b", "output_bytes": 1, "saved_bytes": 1, "param_grad_bytes": 50},
        ]
        trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
        # Stage a's backward: its own saved (1) + grad out (1) + its grads (100) + stage b's grads (50).
        assert pytorch_peak(trace, ()) == 152

    def test_profiled_peaks_raise_the_floor(self) -> None:
        stages = [
            {"name": "a", "output_bytes": 2, "saved_bytes": 2, "backward_peak_bytes": 40},
            {"name": "b", "output_bytes": 2, "saved_bytes": 2},
        ]
        trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
        assert pytorch_peak(trace, ()) == 40

    @pytest.mark.parametrize(("saves_input", "expected"), [(False, 102), (True, 105)])
    def test_last_segment_keeps_its_input_only_if_saved(self, saves_input: bool, expected: int) -> None:
        stages = [{"name": f"s{i}", "output_bytes": d, "saved_bytes": 1} for i, d in enumerate([100, 1, 1, 1])]
        stages[1]["saves_input"] = saves_input
        trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
        tables = PytorchTables(trace)
        # Segment 1 re-run: stage 1's saved (1) + gradient of x_1 (100) = 101. In backward the last segment
        # holds stages 2-4's saved (3) + the output gradient (1), plus x_1 (100) only when stage 2 saves it.
        # Forward, which decides here: without the flag x_1 (100) is alive only while stage 2 runs, beside its
        # saved tensor and output (1 + 1) = 102; with it x_1 stays, and the end of stage 4's forward holds
        # x_1 + stages 2-3's saved (2) + x_3 (1, unsaved) + stage 4's saved and output (2) = 105 (backward: 104).
        assert tables.local(1, 4) == (5 if saves_input else 2)
        assert pytorch_peak(trace, (1,)) == expected


def test_peak_dispatch_and_errors() -> None:
    trace = make_trace([1, 2, 3])
    assert peak(trace, (1,), "classic") == classic_peak(trace, (1,))
    with pytest.raises(ValueError, match="unknown"):
        peak(trace, (), "magic")
    with pytest.raises(PlanError, match="not in 1..2"):
        peak(trace, (3,), "pytorch")
    with pytest.raises(PlanError, match="twice"):
        peak(trace, (1, 1), "pytorch")


def _long_chain(n: int, **fields: object) -> Trace:
    stages = [{"name": f"s{i + 1}", "output_bytes": 1000 + i % 7, "saved_bytes": 3, **fields} for i in range(n)]
    return parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})


def test_diagnostics_of_a_chain_longer_than_cpythons_shared_small_ints() -> None:
    """Past 256 stages two equal ints are different objects: cosmic-ray survivors that compared the last bound
    with the stage count by identity (``is``/``is not``) listed recomputes in the last segment and priced its
    backward as a recomputed one. Here every stage's backward peak (5000) is far above its recomputed one (10),
    so the last segment's backward decides the peak."""
    from remat.client.planning.cost_models import peak_candidates

    n = 300
    trace = _long_chain(n, backward_peak_bytes=5000, recomputed_backward_peak_bytes=10)
    plan = (100, 200)
    candidates = peak_candidates(trace, plan)
    last = f"segment (200, {n}]"
    assert not [label for _, label in candidates if "recompute" in label and last in label]
    assert [label for _, label in candidates if "recompute" in label and "segment (100, 200]" in label]
    assert candidates[0][0] == pytorch_peak(trace, plan)
    assert last in candidates[0][1] and "backward" in candidates[0][1]


def test_a_last_segment_is_never_frameless_past_256_stages() -> None:
    """The last segment runs without a checkpoint, so it cannot be frameless, however long the chain (a cosmic-ray
    survivor tested ``b is not n``: true for equal ints above 256). Its stages save nothing, so were it taken
    for frameless, x_295 would leave the kept checkpoints."""
    from tests.step_simulator import simulate_peak

    n = 300
    stages = [{"name": f"s{i + 1}", "output_bytes": 1000 + i % 7, "saved_bytes": 3} for i in range(n - 5)]
    stages += [{"name": f"t{i}", "output_bytes": 50 * (i + 1), "saved_bytes": 0, "saves_nothing": True}
               for i in range(5)]
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
    tables = PytorchTables(trace)
    assert not tables.is_frameless(n - 5, n) and tables.is_frameless(n - 5, n - 1)
    for plan in [(n - 5,), (150, n - 5), (n - 4,)]:
        assert pytorch_peak(trace, plan) == simulate_peak(trace, plan), plan


def test_a_recompute_stops_at_the_last_saved_tensor_past_256_stages() -> None:
    """Stage 295's forward peak F (10⁶ bytes, saved tensors kept) is far above its peak up to the last saved
    tensor F' and its peak with saved tensors dropped F° (10 each): a segment ending at stage 295 recomputes it
    only up to F'. Two cosmic-ray survivors compared stage indices by identity (``b is a + 1``, ``s is b``),
    which fails above 256 and priced that recompute at F; the independent simulator says what the step does."""
    from remat.client.planning.cost_models import peak_candidates
    from tests.step_simulator import simulate_peak

    n = 300
    stages = [{"name": f"s{i + 1}", "output_bytes": 1000 + i % 7, "saved_bytes": 3} for i in range(n)]
    stages[294].update(forward_peak_bytes=10**6, recompute_peak_bytes=10, forward_peak_dropped_bytes=10)
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
    for plan in [(294, 295), (290, 295), (100, 290, 295)]:  # a one-stage segment, then longer ones
        peak = pytorch_peak(trace, plan)
        assert peak == simulate_peak(trace, plan) < 10**6, plan
        candidates = peak_candidates(trace, plan)
        assert candidates[0][0] == peak and all(value <= peak for value, _ in candidates), plan


@pytest.mark.parametrize(("stage", "fields", "plan", "decides"), [
    # The first stage of the last segment keeps its saved tensors: its forward peak is F, not F°.
    (201, {"forward_peak_bytes": 10**7, "forward_peak_dropped_bytes": 10}, (100, 200), "forward of stage 201, first"),
    # The first stage of a checkpointed segment runs beside its input, the kept checkpoint, counted once.
    (291, {"forward_peak_bytes": 10**8, "forward_peak_dropped_bytes": 10**8, "recompute_peak_bytes": 10},
     (100, 290, 291), "forward of stage 291, first"),
    # Recomputing a segment's first stage: its input is the kept checkpoint, not an unsaved input on top.
    (291, {"forward_peak_bytes": 10**8, "forward_peak_dropped_bytes": 10}, (100, 290, 293),
     "recompute of stage 291"),
    # A last segment of one stage (no later stages' forwards to take the maximum of).
    (300, {"backward_peak_bytes": 10**8}, (299,), "backward of stage 300"),
])
def test_a_segments_first_stage_past_256_stages(stage: int, fields: dict[str, int], plan: tuple[int, ...],
                                                decides: str) -> None:
    """The first stage of a segment decides the peak; cosmic-ray survivors that compared indices by identity
    (``s is a + 1``, ``b is t.n``, ``b is not a + 1``: wrong above 256) priced it as a middle stage, or as in a
    checkpointed segment, or failed on a one-stage last segment."""
    from remat.client.planning.cost_models import peak_candidates
    from tests.step_simulator import simulate_peak

    n = 300
    stages = [{"name": f"s{i + 1}", "output_bytes": 1000 + i % 7, "saved_bytes": 3} for i in range(n)]
    stages[stage - 1].update(fields)
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
    peak = pytorch_peak(trace, plan)
    assert peak == simulate_peak(trace, plan)
    candidates = peak_candidates(trace, plan)
    assert candidates[0][0] == peak and candidates[0][1].startswith(decides), candidates[:2]
    assert all(value <= peak for value, _ in candidates)
