"""remat-trace/1 loading: valid files round-trip, every bad field is named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.client.errors import TraceFormatError
from remat.client.trace import TRACE_FORMAT, load_trace, loads_trace, parse_trace


def _trace(**overrides):
    obj = {"format": TRACE_FORMAT, "input_bytes": 8, "model": "toy",
           "stages": [{"name": "a", "output_bytes": 4, "saved_bytes": 2, "forward_ms": 0.5, "custom": [1]},
                      {"name": "b", "output_bytes": 6, "saved_bytes": 0}]}
    obj.update(overrides)
    return obj


class TestValidTraces:
    def test_round_trip_keeps_unknown_fields(self) -> None:
        trace = parse_trace(_trace())
        assert trace.num_stages == 2
        assert trace.column("output_bytes") == [4, 6]
        assert trace.stages[0].extra == {"custom": [1]}
        assert parse_trace(json.loads(trace.to_json())) == trace

    def test_optional_fields_default_to_zero(self) -> None:
        stage = parse_trace(_trace()).stages[1]
        assert (stage.forward_peak_bytes, stage.backward_peak_bytes, stage.param_grad_bytes) == (0, 0, 0)
        assert stage.saves_input is False and stage.forward_ms is None

    def test_load_from_file(self, tmp_path: Path) -> None:
        path = tmp_path / "t.json"
        path.write_text(json.dumps(_trace()))
        assert load_trace(path).metadata["model"] == "toy"


_DIAMOND = {"vertices": [{"name": "<input>", "bytes": 8}, {"name": "left", "bytes": 4, "kind": "conv"},
                        {"name": "right", "bytes": 6}, {"name": "join", "bytes": 4}],
            "edges": [[0, 1], [0, 2], [2, 3], [1, 3]]}


class TestGraph:
    def test_graph_round_trips_with_unknown_vertex_fields(self) -> None:
        trace = parse_trace(_trace(graph=_DIAMOND))
        assert trace.graph is not None
        assert trace.graph.weights == [8, 4, 6, 4]
        assert trace.graph.edges == ((0, 1), (0, 2), (1, 3), (2, 3))
        assert trace.graph.vertices[1].extra == {"kind": "conv"}
        assert "graph" not in trace.metadata
        assert parse_trace(json.loads(trace.to_json())) == trace

    def test_a_trace_without_graph_has_none_and_writes_none(self) -> None:
        trace = parse_trace(_trace())
        assert trace.graph is None
        assert "graph" not in trace.to_dict()


def _graph(**overrides):
    return json.dumps(_trace(graph={**_DIAMOND, **overrides}))


BAD = [
    ("not json", "{", "not valid JSON"),
    ("not an object", "[1, 2]", "must be a JSON object"),
    ("wrong format", json.dumps(_trace(format="remat-trace/2")), "format: must be 'remat-trace/1'"),
    ("missing format", json.dumps({k: v for k, v in _trace().items() if k != "format"}), "format:"),
    ("zero stages", json.dumps(_trace(stages=[])), "stages: must hold at least one stage"),
    ("stages not a list", json.dumps(_trace(stages={"a": 1})), "stages: missing or not a list"),
    ("negative size", json.dumps(_trace(stages=[{"name": "a", "output_bytes": -1, "saved_bytes": 0}])),
     "stages[0].output_bytes: must be ≥ 0"),
    ("float size", json.dumps(_trace(stages=[{"name": "a", "output_bytes": 1.5, "saved_bytes": 0}])),
     "stages[0].output_bytes: must be an integer"),
    ("bool size", json.dumps(_trace(stages=[{"name": "a", "output_bytes": True, "saved_bytes": 0}])),
     "stages[0].output_bytes: must be an integer"),
    ("missing saved", json.dumps(_trace(stages=[{"name": "a", "output_bytes": 1}])),
     "stages[0].saved_bytes: missing"),
    ("missing name", json.dumps(_trace(stages=[{"output_bytes": 1, "saved_bytes": 1}])), "stages[0].name"),
    ("bad input bytes", json.dumps(_trace(input_bytes="8")), "input_bytes: must be an integer"),
    ("missing input bytes", json.dumps({k: v for k, v in _trace().items() if k != "input_bytes"}),
     "input_bytes: missing"),
    ("negative time", json.dumps(_trace(stages=[{"name": "a", "output_bytes": 1, "saved_bytes": 1,
                                                 "forward_ms": -2}])), "stages[0].forward_ms"),
    ("bad flag", json.dumps(_trace(stages=[{"name": "a", "output_bytes": 1, "saved_bytes": 1,
                                            "saves_input": "yes"}])), "stages[0].saves_input"),
    ("bad grads", json.dumps(_trace(grads="sometimes")), "grads: must be one of"),
    ("bad metadata type", json.dumps(_trace(input_shape="3x224")), "input_shape: must be of type list"),
    ("graph not an object", json.dumps(_trace(graph=[1])), "graph: must be an object"),
    ("graph unknown field", _graph(weights=[1]), "graph.weights: unknown field"),
    ("graph one vertex", _graph(vertices=[{"name": "x", "bytes": 1}], edges=[]), "graph.vertices: needs at least 2"),
    ("graph vertex bytes", _graph(vertices=[{"name": "x", "bytes": 1}, {"name": "y", "bytes": -3}]),
     "graph.vertices[1].bytes: must be ≥ 0"),
    ("graph vertex name", _graph(vertices=[{"name": "x", "bytes": 1}, {"bytes": 3}]), "graph.vertices[1].name"),
    ("graph edges missing", json.dumps(_trace(graph={"vertices": _DIAMOND["vertices"]})),
     "graph.edges: missing or not a list"),
    ("graph edge shape", _graph(edges=[[0, 1], [0, 2, 3]]), "graph.edges[1]: must be a pair"),
    ("graph edge backward", _graph(edges=[[0, 1], [2, 1]]),
     "graph.edges[1]: [2, 1] must satisfy 0 ≤ u < v < 4"),
    ("graph edge out of range", _graph(edges=[[0, 4]]), "graph.edges[0]: [0, 4] must satisfy"),
    ("graph edge twice", _graph(edges=[[0, 1], [0, 2], [1, 3], [0, 1], [2, 3]]),
     "graph.edges[3]: [0, 1] is listed twice"),
    ("graph second source", _graph(edges=[[0, 1], [1, 3], [2, 3]]), "graph.vertices[2]: no edge enters it"),
    ("graph second sink", _graph(edges=[[0, 1], [0, 2], [1, 3]]), "graph.vertices[2]: no edge leaves it"),
]


@pytest.mark.parametrize(("case", "text", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_trace_is_named_in_one_line(case: str, text: str, message: str) -> None:
    with pytest.raises(TraceFormatError) as info:
        loads_trace(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot be read"):
        load_trace(tmp_path / "missing.json")


def _two_stages(**metadata: object) -> dict:
    stage = {"name": "s", "output_bytes": 8, "saved_bytes": 0, "saves_input": False, "saves_output": False}
    return {"format": TRACE_FORMAT, "input_bytes": 8, "stages": [dict(stage), dict(stage)], **metadata}


def test_side_value_lifetimes_are_read_and_every_bad_entry_is_named() -> None:
    good = {"side_bytes": 12, "side_by_stage": [4, 8], "side_values": [
        {"stage": 1, "bytes": 4, "saved_by": [2, 1], "grad_bytes": 4, "grad_from": [2]},
        {"stage": 2, "bytes": 8}]}
    trace = parse_trace(_two_stages(**good))
    assert [(v.stage, v.bytes, v.saved_by, v.grad_bytes, v.grad_from) for v in trace.side_values] == [
        (1, 4, (1, 2), 4, (2,)), (2, 8, (), 0, ())]
    assert parse_trace(json.loads(trace.to_json())) == trace
    for entry, message in [({"stage": 3, "bytes": 4}, r"side_values\[0\].stage: must be a stage number in 1..2"),
                           ({"stage": 1, "bytes": -4}, r"side_values\[0\].bytes: must be a non-negative integer"),
                           ({"stage": 2, "bytes": 4, "saved_by": [1]}, r"side_values\[0\].saved_by: .* in 2..2"),
                           ({"stage": 1, "bytes": 4, "grad_from": [1]}, r"side_values\[0\].grad_from: .* in 2..2"),
                           ({"stage": 1, "bytes": 4, "grad_bytes": 4}, r"side_values\[0\].grad_bytes: a gradient"),
                           ({"stage": 1, "bytes": 4, "owner": 1}, r"side_values\[0\].owner: unknown field"),
                           ("x", r"side_values\[0\]: must be an object")]:
        with pytest.raises(TraceFormatError, match=message):
            parse_trace(_two_stages(side_bytes=4, side_values=[entry]))
    with pytest.raises(TraceFormatError, match="side_values: their bytes must add up to side_by_stage"):
        parse_trace(_two_stages(side_bytes=12, side_by_stage=[4, 8], side_values=[{"stage": 1, "bytes": 12}]))


def test_side_values_are_read_per_stage_and_checked_against_their_totals() -> None:
    trace = parse_trace(_two_stages(side_bytes=12, side_by_stage=[4, 8], side_unsaved_bytes=8,
                                    side_unsaved_by_stage=[0, 8]))
    assert trace.side_by_stage == (4, 8) and trace.side_unsaved_by_stage == (0, 8)
    only_totals = parse_trace(_two_stages(side_bytes=12, side_unsaved_bytes=4))
    assert only_totals.side_by_stage == (12, 0) and only_totals.side_unsaved_by_stage == (4, 0)
    for bad, message in [({"side_bytes": 12, "side_by_stage": [4, 4]}, "side_by_stage: must add up to side_bytes"),
                         ({"side_bytes": 4, "side_by_stage": [4]}, "side_by_stage: must be 2 non-negative"),
                         ({"side_bytes": 4, "side_unsaved_bytes": 8}, "side_unsaved_bytes: must not exceed"),
                         ({"side_bytes": -1}, "side_bytes")]:
        with pytest.raises(TraceFormatError, match=message):
            parse_trace(_two_stages(**bad))
