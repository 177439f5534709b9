"""Export's size guards held as data (remat.client.graph.size_guards).

The oracle is export's own guards module, built by torch from the same expressions: a graph read back from
disk must refuse exactly the calls a fresh export refuses. And a cache file is data: an expression that is not
size arithmetic is refused when the file is read, never run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from remat.client.graph import export_cache
from remat.client.graph.fx_trace import ANY_SIZES_GUARDS, export_any_sizes, sizes_refused
from remat.client.graph.model_call import ModelCall
from remat.client.graph.size_guards import SIZE_CHECKS, SizeChecks, agrees_with_module


class _Pair(nn.Module):
    """Two inputs whose code decides on sizes in ways a range cannot say: a length that is a multiple of 4, and
    one input twice as long as the other (export writes the second length as an expression of the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[1] % 4 == 0:
            h = h * 2
        if y.shape[1] == 2 * x.shape[1]:
            return h.sum() + y.sum()
        return h.sum() - y.sum()


def _inputs(batch: int, x_len: int, y_len: int, y_batch: int | None = None) -> list[torch.Tensor]:
    return [torch.ones(batch, x_len, 4), torch.ones(y_batch or batch, y_len, 4)]


def _call(model: nn.Module, *inputs: torch.Tensor) -> ModelCall:
    return ModelCall.bind(model, inputs, {})


def _no_export(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("exported although a graph for any sizes is stored")

    monkeypatch.setattr(torch.export, "export", refuse)


def test_a_graph_read_back_refuses_exactly_what_export_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Pair()
    fresh = export_any_sizes(model, _call(model, *_inputs(3, 8, 16)), cache_dir=tmp_path)
    assert ANY_SIZES_GUARDS in fresh.meta  # export's module answers in the exporting process
    _no_export(monkeypatch)
    loaded = export_any_sizes(model, _call(model, *_inputs(2, 12, 24)), cache_dir=tmp_path)
    assert ANY_SIZES_GUARDS not in loaded.meta and loaded.code == fresh.code
    grid = [_inputs(b, x, y, yb) for b in (1, 2, 5) for x in (2, 3, 4, 8, 10, 12) for y in (2 * x, 2 * x + 1, 7)
            for yb in (None, 4)]
    refused = {sizes_refused(loaded, inputs) for inputs in grid}
    for inputs in grid:
        assert sizes_refused(loaded, inputs) == sizes_refused(fresh, inputs), [tuple(t.shape) for t in inputs]
    # The grid reaches every kind of refusal, guards that no range can say included.
    assert "Guard failed: x.size()[1] % 4 == 0" in refused
    assert "Guard failed: y.size()[1] == 2 * x.size()[1]" in refused
    assert any(r is not None and "outside the sizes export assumed" in r for r in refused)
    assert None in refused


def test_a_stored_graph_that_does_not_hold_for_the_call_is_exported_again(tmp_path: Path) -> None:
    model = _Pair()
    export_any_sizes(model, _call(model, *_inputs(3, 8, 16)), cache_dir=tmp_path)
    # A call of odd length: the stored graph holds the other branch, so this call gets (and stores) its own.
    other = export_any_sizes(model, _call(model, *_inputs(3, 5, 9)), cache_dir=tmp_path)
    assert ANY_SIZES_GUARDS in other.meta and sizes_refused(other, _inputs(2, 7, 3)) is None
    assert len(list((tmp_path / "graphs").glob("*.json"))) == 1  # one key: the file now holds the newer graph


@pytest.mark.parametrize("hostile", [
    "__import__('os').system('touch PWNED')",
    "args[0].size.__self__",
    "args[0].__class__",
    "(lambda: 1)()",
    "print(1)",
    "args[0].size()[1] ** 99999999",
    "'a' == 'a'",
    "[x for x in ()]",
])
def test_a_cache_file_whose_guards_are_not_size_arithmetic_is_ignored(tmp_path: Path, hostile: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Pair()
    call = _call(model, *_inputs(3, 8, 16))
    export_any_sizes(model, call, cache_dir=tmp_path)
    (path,) = (tmp_path / "graphs").glob("*.json")
    data = json.loads(path.read_text())
    data["size_checks"]["guards"].append(hostile)
    path.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    key = export_cache.pre_keys(model, call, train=True, any_sizes=True)(())
    assert export_cache.load_graph(model, key, train=True, directory=tmp_path / "graphs") is None
    again = export_any_sizes(model, call, cache_dir=tmp_path)  # exported again, the file rewritten
    assert ANY_SIZES_GUARDS in again.meta and not (tmp_path / "PWNED").exists()
    assert hostile not in path.read_text()


def test_stored_checks_are_validated_field_by_field() -> None:
    good = {"names": ["x"], "labels": ["x"], "dims": [[["s0", 2, None], ["s1", 2, None], 4]],
            "guards": ["(args[0].size()[1] % 4) == 0", "max(args[0].size()[0], 3) <= 512 and not 1 > 2"]}
    checks = SizeChecks.from_json(good)
    assert checks.refusal([torch.ones(3, 7, 4)]) == "Guard failed: x.size()[1] % 4 == 0"
    assert checks.refusal([torch.ones(3, 4, 4)]) is None
    assert checks.refusal([torch.ones(3, 4, 5)]) == "x.shape[2] is 5, the graph's 4"
    assert SizeChecks.from_json(checks.to_json()) == checks
    for bad in [{**good, "guards": ["args[1].size()[0] == 1"]},      # an input the graph does not have
                {**good, "guards": ["1 << 70"]},                     # a shift: not size arithmetic
                {**good, "guards": [str(1 << 70) + " == 1"]},        # an integer no size comes near
                {**good, "dims": [[["s0", 5, 2]]]},                  # an empty range
                {**good, "dims": [[-3]]},
                {**good, "names": ["x", "y"]},
                {**good, "extra": 1},
                {**good, "guards": ["x" * 5000]}]:
        with pytest.raises(ValueError):
            SizeChecks.from_json(bad)


def test_a_reading_of_the_guards_that_misses_one_disagrees_with_the_module() -> None:
    model = _Pair()
    call = _call(model, *_inputs(3, 8, 16))
    gm = export_any_sizes(model, call)
    checks: SizeChecks = gm.meta[SIZE_CHECKS]
    module, indices = gm.meta[ANY_SIZES_GUARDS]
    assert agrees_with_module(checks, module, indices, call.flat_inputs())
    assert checks.guards is not None
    # The guards the code's decisions wrote (export adds others that follow from these and the ranges).
    decisive = [g for g in checks.guards if "% 4" in g or "2*" in g]
    assert len(decisive) == 2
    for dropped in decisive:
        fewer = dataclasses.replace(checks, guards=tuple(g for g in checks.guards if g != dropped))
        assert not agrees_with_module(fewer, module, indices, call.flat_inputs()), dropped
    mangled = dataclasses.replace(checks, guards=tuple(g.replace("% 4", "% 2") for g in checks.guards))
    assert not agrees_with_module(mangled, module, indices, call.flat_inputs())


def test_stored_probe_facts_cut_a_graph_read_back_only_when_they_fit_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.client.graph.fx_trace import any_sizes_probe_facts, keep_any_sizes_probe_facts
    from remat.client.graph.stage_graph import build_stage_chain

    model = _Pair()
    call = _call(model, *_inputs(3, 8, 16))
    fresh = export_any_sizes(model, call, cache_dir=tmp_path)
    assert any_sizes_probe_facts(fresh, tmp_path) is None  # a fresh export is probed
    chain = build_stage_chain(model, call, graph=fresh, check=False)
    keep_any_sizes_probe_facts(fresh, chain.probe_facts, tmp_path)
    (facts_file,) = (tmp_path / "graphs").glob("*.probe.json")

    def read_back_chain() -> object:
        later = _call(model, *_inputs(2, 12, 24))
        graph = export_any_sizes(model, later, cache_dir=tmp_path)
        return build_stage_chain(model, later, graph=graph, check=False, facts=any_sizes_probe_facts(graph, tmp_path))

    assert not read_back_chain().probed  # type: ignore[attr-defined]
    good = json.loads(facts_file.read_text())
    renamed = json.loads(json.dumps(good).replace('"lin', '"other'))  # facts of nodes this graph does not have
    for text in ["{not json", json.dumps({**good, "facts": {"format": "remat-probe-facts/1"}}), json.dumps(renamed)]:
        facts_file.write_text(text)
        assert read_back_chain().probed  # type: ignore[attr-defined]
