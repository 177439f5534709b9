"""remat.client.derived_trace: traces at any batch size from profiles at two, against ground truths written
independently: synthetic profiles whose every field is a known affine function of the batch, and peaks that
are the maximum of known affine levels (the dominant term changing past the profiled batches)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.client.derived_trace import DERIVED_FROM, LEVELS, SizeFitError, fit_batches, is_derived
from remat.client.plan_key import content_sha256
from remat.client.planning.plans import plan_all
from remat.client.trace import TRACE_FORMAT, Trace, parse_trace

SAMPLE = [3, 8, 8]

Line = tuple[int, int]  # (intercept, bytes per sample)


def _at(line: Line, batch: int) -> int:
    return line[0] + line[1] * batch


def profile(batch: int, stages: list[dict[str, Any]], **meta: Any) -> Trace:
    """A trace at ``batch`` whose stage fields are lines (a, s) -> a + s*batch, and whose ``levels`` entries
    are lists of lines: the peak field is their maximum, as a profiler records it."""
    out = []
    for i, spec in enumerate(stages):
        stage: dict[str, Any] = {"name": f"s{i}", "forward_ms": 0.1 * batch + 0.05, "backward_ms": 0.2 * batch}
        levels = {}
        for name, value in spec.items():
            if name == "levels":
                for field, lines in value.items():
                    levels[field] = [_at(line, batch) for line in lines]
                    stage[field] = max(0, max(levels[field]))
            else:
                stage[name] = _at(value, batch)
        if levels:
            stage[LEVELS] = levels
        out.append(stage)
    return parse_trace({"format": TRACE_FORMAT, "model": "m", "model_hash": "h", "input_shape": [batch, *SAMPLE],
                        "batch_size": batch, "dtype": "float32", "device": "cpu", "grads": "kept", "mode": "train",
                        "input_bytes": 4 * 3 * 8 * 8 * batch, "profiler": "test", "stages": out, **meta})


lines = st.tuples(st.integers(0, 2**30), st.integers(0, 2**20))
stage_specs = st.lists(st.fixed_dictionaries({
    "output_bytes": lines, "saved_bytes": lines, "forward_peak_bytes": lines, "param_grad_bytes": lines,
    "levels": st.fixed_dictionaries({"backward_peak_bytes": st.lists(lines, min_size=1, max_size=6),
                                     "recomputed_backward_peak_bytes": st.lists(lines, min_size=1, max_size=6)}),
}), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(stage_specs, st.sampled_from([(1, 2), (2, 4), (4, 8), (3, 5)]), st.integers(1, 4096))
def test_two_profiles_give_the_trace_at_any_batch(specs: list[dict[str, Any]], profiled: tuple[int, int],
                                                  batch: int) -> None:
    fit = fit_batches([profile(b, specs) for b in profiled])
    derived = fit.trace_at(batch)
    truth = profile(batch, specs)
    assert derived.input_bytes == truth.input_bytes
    assert derived.metadata["input_shape"] == [batch, *SAMPLE] and derived.metadata["batch_size"] == batch
    for got, want in zip(derived.stages, truth.stages, strict=True):
        for name in ("output_bytes", "saved_bytes", "forward_peak_bytes", "param_grad_bytes", "backward_peak_bytes",
                     "recomputed_backward_peak_bytes"):
            assert getattr(got, name) == getattr(want, name), (name, batch)
        assert got.forward_ms == pytest.approx(want.forward_ms) and got.backward_ms == pytest.approx(want.backward_ms)


def test_times_that_happened_to_fall_with_the_batch_do_not_extrapolate_to_zero() -> None:
    """Noise made the larger profile faster: its times are held at their mean, never driven to zero, and the
    profiler's timing summary (the same keys and types in every profile) is fitted like any time."""
    spec = [{"output_bytes": (0, 64), "saved_bytes": (0, 64)}] * 3
    small, large = profile(3, spec), profile(4, spec)
    slower = {"rounds": 3, "step_ms": 12.0, "recompute_to_forward": 1.7}
    faster = {"rounds": 7, "step_ms": 9.0, "recompute_to_forward": 1.0}
    stages_small = [{**s.to_dict(), "forward_ms": 2.0, "recompute_ms": 3.4} for s in small.stages]
    stages_large = [{**s.to_dict(), "forward_ms": 1.0, "recompute_ms": 1.0} for s in large.stages]
    fit = fit_batches([parse_trace({**small.to_dict(), "stages": stages_small, "timing": slower}),
                       parse_trace({**large.to_dict(), "stages": stages_large, "timing": faster})])
    derived = fit.trace_at(8)
    assert [s.forward_ms for s in derived.stages] == pytest.approx([1.5] * 3)
    assert [s.recompute_ms for s in derived.stages] == pytest.approx([2.2] * 3)
    assert derived.metadata["timing"]["step_ms"] == pytest.approx(10.5)


def test_a_peak_whose_dominant_term_changes_past_the_profiles_is_derived_from_its_levels() -> None:
    # A weight gradient (1 MiB, constant) dominates at batch 2 and 4; an activation term overtakes it at 65.
    specs = [{"output_bytes": (0, 4096), "saved_bytes": (0, 4096),
              "levels": {"backward_peak_bytes": [(2**20, 0), (0, 16384), (4096, 8192)]}}]
    fit = fit_batches([profile(2, specs), profile(4, specs)])
    for batch in (8, 64, 65, 1000):
        want = max(2**20, 16384 * batch, 4096 + 8192 * batch)
        assert fit.trace_at(batch).stages[0].backward_peak_bytes == want
    # Without the levels, the line through the two peaks (both 1 MiB) would say 1 MiB at any batch.
    bare = fit_batches([parse_trace({**profile(b, specs).to_dict(), "stages": [
        {k: v for k, v in s.to_dict().items() if k != LEVELS} for s in profile(b, specs).stages]}) for b in (2, 4)])
    assert bare.trace_at(1000).stages[0].backward_peak_bytes == 2**20


def test_a_field_off_the_line_is_reported_with_three_profiles() -> None:
    def stage(batch: int) -> list[dict[str, Any]]:
        return [{"output_bytes": (0, 100), "saved_bytes": (0, 0),
                 "forward_peak_bytes": (max(1000, 100 * batch), 0)}]  # a maximum, recorded without levels

    fit = fit_batches([profile(b, stage(b)) for b in (2, 4, 16)])
    assert [f.field for f in fit.off_fit] == ["stages[0].forward_peak_bytes"]
    assert "forward_peak_bytes (2: 1000, 4: 1000, 16: 1600; " in fit.describe()
    # Exact on the profiled points, the end segments beyond them: 2,200 at batch 28 where the truth is 2,800,
    # which is why a profiler records levels and a derived plan is measured before it is trusted.
    assert [fit.trace_at(b).stages[0].forward_peak_bytes for b in (2, 4, 16, 10, 28)] == [1000, 1000, 1600, 1300,
                                                                                          2200]
    assert fit_batches([profile(b, stage(b)) for b in (2, 4)]).off_fit == ()


def test_a_derived_trace_says_where_it_came_from_and_plans_like_any_trace() -> None:
    specs = [{"output_bytes": (0, 4096 * (i + 1)), "saved_bytes": (64, 1024), "forward_peak_bytes": (0, 8192)}
             for i in range(6)]
    profiles = [profile(b, specs) for b in (2, 4)]
    derived = fit_batches(profiles).trace_at(16)
    assert is_derived(derived) and not is_derived(profiles[0])
    assert derived.metadata[DERIVED_FROM] == [{"batch_size": 2, "content_sha256": content_sha256(profiles[0])},
                                              {"batch_size": 4, "content_sha256": content_sha256(profiles[1])}]
    assert "profiler" not in derived.metadata  # no profiler ran at batch 16
    truth = profile(16, specs)
    assert [p.predicted_peak_bytes for p in plan_all(derived)] == [p.predicted_peak_bytes for p in plan_all(truth)]
    assert fit_batches(profiles).trace_at(4) is profiles[1]


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "model_hash": "other"}, "model_hash: differs between the profiles (2: 'h', 4: 'other')"),
    (lambda t: {**t, "dtype": "bfloat16"}, "dtype: differs between the profiles"),
    (lambda t: {**t, "input_shape": [4, 3, 9, 9]}, "input_shape: the profiles' shapes differ"),
    (lambda t: {**t, "stages": t["stages"][:1]}, "stages: [1, 2] entries in different profiles"),
    (lambda t: {**t, "stages": [{**t["stages"][0], "name": "x"}, t["stages"][1]]},
     "stages[0].name: differs between the profiles (2: 's0', 4: 'x')"),
    (lambda t: {**t, "stages": [{**t["stages"][0], "saves_input": True}, t["stages"][1]]},
     "stages[0].saves_input: present in some profiles only"),
    (lambda t: {**t, "inputs": "input_ids: int64[4, 16]"}, "inputs: present in some profiles only"),
    (lambda t: {**t, "input_shape": [2, *SAMPLE], "batch_size": 2}, "batch_size: fitting needs profiles at two"),
])
def test_profiles_that_differ_in_more_than_the_batch_are_refused(change: Any, message: str) -> None:
    specs = [{"output_bytes": (0, 10), "saved_bytes": (0, 10)}, {"output_bytes": (5, 10), "saved_bytes": (0, 1)}]
    with pytest.raises(SizeFitError) as info:
        fit_batches([profile(2, specs), parse_trace(change(profile(4, specs).to_dict()))])
    assert str(info.value).startswith(message), str(info.value)


def test_a_derived_trace_is_not_a_profile() -> None:
    specs = [{"output_bytes": (0, 10), "saved_bytes": (0, 10)}]
    derived = fit_batches([profile(2, specs), profile(4, specs)]).trace_at(8)
    with pytest.raises(SizeFitError, match="derived_from: a trace derived at batch 8 is not a profile"):
        fit_batches([derived, profile(2, specs)])


def test_unaligned_levels_fall_back_to_the_values_and_are_reported() -> None:
    specs2 = [{"output_bytes": (0, 10), "saved_bytes": (0, 10), "levels": {"backward_peak_bytes": [(0, 10)]}}]
    specs4 = [{"output_bytes": (0, 10), "saved_bytes": (0, 10),
               "levels": {"backward_peak_bytes": [(0, 10), (1, 1)]}}]
    fit = fit_batches([profile(2, specs2), profile(4, specs4)])
    assert [f.field for f in fit.off_fit] == ["stages[0].backward_peak_bytes"]
    assert "its levels differ between profiles" in fit.describe()
    assert fit.trace_at(8).stages[0].backward_peak_bytes == 80  # the line through 20 and 40
    assert LEVELS not in fit.trace_at(8).stages[0].extra


def test_byte_counts_round_up() -> None:
    fit = fit_batches([profile(2, [{"output_bytes": (0, 3), "saved_bytes": (1, 0)}]),
                       profile(5, [{"output_bytes": (0, 3), "saved_bytes": (2, 0)}])])
    assert fit.trace_at(3).stages[0].saved_bytes == math.ceil(1 + 1 / 3)
    assert fit.trace_at(1).stages[0].saved_bytes == 1  # 2/3, rounded up


def test_a_call_of_several_inputs_has_its_batch_dimensions_carried_in_its_signature() -> None:
    specs = [{"output_bytes": (0, 10), "saved_bytes": (0, 10)}]

    def call(batch: int) -> str:
        return f"input_ids: int64[{batch}, 256]; labels: int64[{batch}, 256]; max_new=12; use_cache=False"

    fit = fit_batches([profile(b, specs, inputs=call(b)) for b in (2, 4)])
    assert fit.trace_at(32).metadata["inputs"] == call(32)
    with pytest.raises(SizeFitError, match=r"^inputs\.numbers\[1\]: differs between the profiles"):
        fit_batches([profile(2, specs, inputs=call(2)),
                     profile(4, specs, inputs=call(4).replace("256]; labels", "128]; labels"))])



def test_a_call_signature_reads_at_another_batch_by_its_batch_numbers_only() -> None:
    from remat.client.derived_trace import inputs_at_batch

    text = "input_ids: int64[2, 256]; labels: int64[2, 256]; use_cache=False; scale=0.2; name='x2'"
    assert inputs_at_batch(text, 2, 8) == \
        "input_ids: int64[8, 256]; labels: int64[8, 256]; use_cache=False; scale=0.2; name='x2'"
    assert inputs_at_batch(text, 2, 2) == text
    assert inputs_at_batch("", 4, 8) == ""
    # a sequence length that equals the batch follows it too: such a profile is found at no other batch
    assert inputs_at_batch("input_ids: int64[4, 4]", 4, 8) == "input_ids: int64[8, 8]"


# --- the sequence length of a token model ------------------------------------------------------------------

Quadratic = tuple[int, int, int]  # (constant, bytes per token, bytes per pair of tokens)


def _in_length(q: Quadratic, seq_len: int) -> int:
    return q[0] + q[1] * seq_len + q[2] * seq_len * seq_len


def token_profile(seq_len: int, stages: list[dict[str, Any]], *, batch: int = 2, attention: str | None = "sdpa",
                  **meta: Any) -> Trace:
    """A token model's trace at ``seq_len`` whose stage fields are quadratics in the length (the (L, L) scores
    of attention that materialises them), with ``levels`` as in :func:`profile`."""
    out = []
    for i, spec in enumerate(stages):
        stage: dict[str, Any] = {"name": f"block{i}", "forward_ms": 0.01 * seq_len, "backward_ms": 0.02 * seq_len}
        levels = {}
        for name, value in spec.items():
            if name == "levels":
                for field, quadratics in value.items():
                    levels[field] = [_in_length(q, seq_len) for q in quadratics]
                    stage[field] = max(0, max(levels[field]))
            else:
                stage[name] = _in_length(value, seq_len)
        if levels:
            stage[LEVELS] = levels
        out.append(stage)
    extra = {"attention": attention} if attention else {}
    return parse_trace({"format": TRACE_FORMAT, "model": "hf:gpt2", "model_hash": "t", "input_shape": [batch, seq_len],
                        "batch_size": batch, "dtype": "float32", "device": "cpu", "grads": "none", "mode": "train",
                        "input_bytes": 16 * batch * seq_len, "profiler": "test", "stages": out,
                        "inputs": f"input_ids: int64[{batch}, {seq_len}]; labels: int64[{batch}, {seq_len}]",
                        **extra, **meta})


quadratics = st.tuples(st.integers(0, 2**30), st.integers(0, 2**16), st.integers(0, 2**10))
token_stage_specs = st.lists(st.fixed_dictionaries({
    "output_bytes": quadratics, "saved_bytes": quadratics, "forward_peak_bytes": quadratics,
    "levels": st.fixed_dictionaries({"backward_peak_bytes": st.lists(quadratics, min_size=1, max_size=5)}),
}), min_size=1, max_size=4)


def _bytes(trace: Trace) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.to_dict().items() if not k.endswith("_ms")} for s in trace.stages]


@settings(max_examples=150, deadline=None)
@given(token_stage_specs, st.sampled_from([(8, 16, 24), (16, 32, 64), (3, 5, 9)]), st.integers(3, 8192))
def test_three_lengths_give_the_trace_at_any_length_for_attention_that_holds_its_scores(
        specs: list[dict[str, Any]], profiled: tuple[int, int, int], seq_len: int) -> None:
    from remat.client.derived_trace import fit_lengths

    fit = fit_lengths([token_profile(L, specs) for L in profiled])
    assert fit.along == "seq_len" and fit.degree == 2 and fit.off_fit == ()
    if seq_len == 2:
        return
    derived, truth = fit.trace_at(seq_len), token_profile(seq_len, specs)
    assert _bytes(derived) == _bytes(truth)
    assert derived.input_bytes == truth.input_bytes
    assert derived.metadata["input_shape"] == [2, seq_len] and derived.metadata["inputs"] == truth.metadata["inputs"]
    if seq_len not in profiled:
        assert derived.metadata[DERIVED_FROM] == [
            {"batch_size": 2, "seq_len": L, "content_sha256": content_sha256(token_profile(L, specs))}
            for L in profiled]


def test_the_degree_is_what_the_attention_implementation_needs() -> None:
    from remat.client.derived_trace import derived_along, derived_sizes, fit_lengths, sequence_degree

    linear = [{"output_bytes": (64, 512, 0), "saved_bytes": (0, 1024, 0)}]
    assert sequence_degree(token_profile(8, linear, attention="flash_attention_2"))[0] == 1
    assert sequence_degree(token_profile(8, linear, attention="eager"))[0] == 2
    assert sequence_degree(token_profile(8, linear, attention=None)) == (
        2, "the trace names no attention implementation: degree 2 covers one that materialises its scores")
    fused = fit_lengths([token_profile(L, linear, attention="flash_attention_2") for L in (8, 16)])
    assert fused.degree == 1
    assert fused.trace_at(1000).stages[0].saved_bytes == 1024 * 1000
    # Two lengths cannot fit attention that holds its scores: refused, saying what the degree needs.
    with pytest.raises(SizeFitError, match=r"^seq_len: fitting with degree 2 \(attention 'sdpa' holds the \(L, L\) "
                                           r"attention scores\) needs profiles at three sequence lengths or more, "
                                           r"got \[8, 16\]$"):
        fit_lengths([token_profile(L, linear) for L in (8, 16)])
    derived = fit_lengths([token_profile(L, linear) for L in (8, 16, 24)]).trace_at(40)
    assert derived_along(derived) == "seq_len" and derived_sizes(derived) == (8, 16, 24)
    assert derived_along(token_profile(8, linear)) is None and derived_sizes(token_profile(8, linear)) == ()


def test_a_fourth_length_off_the_quadratic_is_reported() -> None:
    from remat.client.derived_trace import fit_lengths

    def stage(seq_len: int) -> list[dict[str, Any]]:  # a maximum recorded without levels: off any polynomial
        return [{"output_bytes": (0, 100, 1), "saved_bytes": (0, 0, 0),
                 "forward_peak_bytes": (max(5000, 300 * seq_len), 0, 0)}]

    fit = fit_lengths([token_profile(L, stage(L)) for L in (8, 16, 24, 64)])
    assert [f.field for f in fit.off_fit] == ["stages[0].forward_peak_bytes"]
    assert "16 tokens" not in fit.describe() and "profiles at 8, 16, 24, 64 tokens, degree 2" in fit.describe()
    assert [fit.trace_at(L).stages[0].forward_peak_bytes for L in (8, 16, 24, 64)] == [5000, 5000, 7200, 19200]


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "input_shape": [4, t["input_shape"][1]], "batch_size": 4},
     "input_shape: the profiles' shapes differ ([2, 8], [4, 16], [2, 24]): only the seq_len may"),
    (lambda t: {**t, "attention": "eager"}, "attention: differs between the profiles"),
    (lambda t: {**t, "inputs": t["inputs"].replace("labels: int64[2, 16]", "labels: int64[2, 8]")},
     "inputs.numbers[3]: differs between the profiles"),
])
def test_lengths_that_differ_in_more_than_the_length_are_refused(change: Any, message: str) -> None:
    from remat.client.derived_trace import fit_lengths

    specs = [{"output_bytes": (0, 10, 1), "saved_bytes": (0, 10, 0)}]
    with pytest.raises(SizeFitError) as info:
        fit_lengths([token_profile(8, specs), parse_trace(change(token_profile(16, specs).to_dict())),
                     token_profile(24, specs)])
    assert str(info.value).startswith(message), str(info.value)


def test_as_many_tokens_as_samples_cannot_be_told_apart() -> None:
    from remat.client.derived_trace import fit_lengths

    specs = [{"output_bytes": (0, 10, 1), "saved_bytes": (0, 0, 0)}]
    with pytest.raises(SizeFitError, match=r"^input_shape: \[2, 2\] has as many tokens as samples"):
        fit_lengths([token_profile(L, specs) for L in (2, 8, 16)])


def test_derive_at_fits_the_size_the_stored_profiles_differ_in() -> None:
    from remat.client.derived_trace import derive_at, derived_along, inputs_at_length, token_length

    specs = [{"output_bytes": (0, 10, 1), "saved_bytes": (5, 3, 2)}]
    at_lengths = [token_profile(L, specs) for L in (8, 16, 24)]
    signature = "input_ids: int64[2, 40]; labels: int64[2, 40]"
    derived = derive_at(at_lengths, (2, 40), signature)
    assert derived is not None and derived_along(derived) == "seq_len"
    assert _bytes(derived) == _bytes(token_profile(40, specs))
    assert derive_at(at_lengths[:2], (2, 40), signature) is None  # two lengths: too few for degree 2
    assert derive_at(at_lengths, (4, 40), signature.replace("[2,", "[4,")) is None  # another batch: no family
    at_batches = [token_profile(40, specs, batch=b) for b in (2, 4)]
    by_batch = derive_at(at_batches + at_lengths, (8, 40), signature.replace("[2,", "[8,"))
    assert by_batch is not None and derived_along(by_batch) == "batch" and by_batch.metadata["input_shape"] == [8, 40]
    # only a call that starts with token ids has a sequence length
    assert token_length((2, 40), signature) == 40 and token_length((2, 40), "x: float32[2, 40]") is None
    assert token_length((2, 3, 8), signature) is None
    assert inputs_at_length("input_ids: int64[2, 256]; labels: int64[2, 256]; n=2", 256, 64) == \
        "input_ids: int64[2, 64]; labels: int64[2, 64]; n=2"
