"""The disk cache of exported graphs (remat.client.graph.export_cache): a second trace of the same model and call
rebuilds the graph from JSON without ``torch.export``, and that graph is the exported one: the same
architecture hash, and a chain whose training step is bit-equal to the eager model's. Another model or call
misses; a tampered file is ignored (and nothing it names runs)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remat.client.graph import export_cache
from remat.client.graph.fidelity import graph_routing, routing_ops
from remat.client.graph.fx_trace import trace_model
from remat.client.graph.hashing import architecture_hash
from remat.client.graph.model_call import ModelCall
from remat.client.graph.stage_graph import build_stage_chain
from tests.utils.tiny_transformers import batch, chain_step, classifier_batch, same_step, step, tiny

ARCHITECTURES = ["gpt2", "llama", "bert", "t5"]


class _ExportCounter:
    """Counts ``torch.export.export`` calls; ``refuse()`` makes any further call fail the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.refused = False
        real = torch.export.export

        def export(*args: Any, **kwargs: Any) -> Any:
            if self.refused:
                raise AssertionError("torch.export.export ran on a cache hit")
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch.export, "export", export)

    def refuse(self) -> None:
        self.refused = True


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> _ExportCounter:
    return _ExportCounter(monkeypatch)


def _graph_files() -> list[Path]:
    return sorted(export_cache.graph_cache_dir().glob("*.json"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_cached_graph_is_the_exported_graph(arch: str, exports: _ExportCounter) -> None:
    model = tiny(arch)
    kwargs = batch()
    call = ModelCall.bind(model, (), kwargs)
    exported = trace_model(model, train=True, call=call)
    assert exports.calls == 1 and len(_graph_files()) == 1
    exports.refuse()  # from here on, an export fails the test

    cached = trace_model(model, train=True, call=call)
    assert cached is not exported
    assert cached.code == exported.code
    assert [n.name for n in cached.graph.nodes] == [n.name for n in exported.graph.nodes]
    assert [n.meta.get("nn_module_stack") for n in cached.graph.nodes] == \
        [n.meta.get("nn_module_stack") for n in exported.graph.nodes]
    assert {k: cached.meta[k] for k in ("remat_train", "remat_tracer")} == {"remat_train": True,
                                                                           "remat_tracer": "export"}
    assert cached.meta["remat_pytree"] == exported.meta["remat_pytree"]
    assert architecture_hash(model, graph=cached) == architecture_hash(model, graph=exported)

    chain = build_stage_chain(model, call, graph=cached)  # probes and checks fidelity on the cached graph
    reference = step(model, kwargs)
    n = chain.num_stages
    assert n >= 8, chain.names
    for checkpoints in [(), tuple(range(1, n)), tuple(range(2, n, 3))]:
        assert same_step(reference, chain_step(model, chain, call, checkpoints)), (arch, checkpoints)
    assert chain.names == build_stage_chain(model, call, graph=exported).names


def test_a_classifier_pooling_by_token_ids_is_admitted_from_its_cached_graph(exports: _ExportCounter) -> None:
    """A decoder classifier takes ``argmax`` over token ids to find each row's last token: admitted (NOTE
    [ routing by activations ]). Read back from the cache, its graph has no recorded values, from which alone
    every node would count as floating: a later start refused it as a mixture of experts."""
    model = tiny("gpt2-classifier")
    kwargs = classifier_batch()
    call = ModelCall.bind(model, (), kwargs)
    reference = step(model, kwargs)  # its first call sets config.problem_type, which is part of the key
    exported = trace_model(model, train=True, call=call)
    calls = exports.calls
    cached = trace_model(model, train=True, call=call)
    assert exports.calls == calls, "exported again"
    assert routing_ops(exported.graph) == [] and "argmax" in routing_ops(cached.graph)  # values are not stored
    assert graph_routing(cached) == []  # the verdict is
    chain = build_stage_chain(model, call, graph=cached)  # probes and checks fidelity: not refused
    assert chain.names == build_stage_chain(model, call, graph=exported).names
    assert same_step(reference, chain_step(model, chain, call, tuple(range(2, chain.num_stages, 2))))


def test_a_graph_file_without_its_routing_verdict_is_exported_again(exports: _ExportCounter) -> None:
    model = tiny("gpt2-classifier")
    call = ModelCall.bind(model, (), classifier_batch())
    step(model, call.kwargs)
    trace_model(model, train=True, call=call)
    (path,) = _graph_files()
    data = json.loads(path.read_text())
    del data["routing"]
    path.write_text(json.dumps(data))
    trace_model(model, train=True, call=call)
    assert exports.calls == 2 and "routing" in json.loads(path.read_text())


def test_another_model_or_call_misses(exports: _ExportCounter) -> None:
    model = tiny("gpt2")
    call = ModelCall.bind(model, (), batch())
    key = export_cache.pre_key(model, call, train=True)
    assert key is not None and key == export_cache.pre_key(tiny("gpt2"), call, train=True)  # weights aside

    deeper = tiny("gpt2", layers=3)
    import transformers

    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=512,
                                            n_positions=128, use_cache=False, resid_pdrop=0.2)
    torch.manual_seed(0)
    other_dropout = transformers.AutoModelForCausalLM.from_config(cfg).train()
    sdpa_off = tiny("gpt2")
    sdpa_off.config._attn_implementation = "eager"
    frozen = tiny("gpt2")
    frozen.transformer.wte.weight.requires_grad_(False)
    keys = {
        "layers": export_cache.pre_key(deeper, call, train=True),
        "dropout": export_cache.pre_key(other_dropout, call, train=True),
        "attention": export_cache.pre_key(sdpa_off, call, train=True),
        "frozen": export_cache.pre_key(frozen, call, train=True),
        "eval": export_cache.pre_key(model, call, train=False),
        "longer": export_cache.pre_key(model, ModelCall.bind(model, (), batch(seq=48)), train=True),
        "no mask": export_cache.pre_key(model, ModelCall.bind(model, (), batch(mask=False)), train=True),
        "float64": export_cache.pre_key(tiny("gpt2").double(), call, train=True),
    }
    assert None not in keys.values()
    assert len({key, *keys.values()}) == len(keys) + 1, keys

    trace_model(model, train=True, call=call)
    trace_model(deeper, train=True, call=call)
    assert exports.calls == 2 and len(_graph_files()) == 2


def test_the_folder_keeps_the_most_recently_used_graphs(exports: _ExportCounter,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each signature's sizes store a graph of their own; the folder keeps the MAX_CACHED_GRAPHS used last (a
    hit counts as a use), not every size a script ever met."""
    monkeypatch.setattr(export_cache, "MAX_CACHED_GRAPHS", 2)
    model = tiny("gpt2")
    calls = [ModelCall.bind(model, (), batch(seq=seq)) for seq in (16, 24, 40)]
    keys = [export_cache.pre_key(model, call, train=True) for call in calls]
    paths = [export_cache.graph_cache_dir() / f"{key}.json" for key in keys]
    trace_model(model, train=True, call=calls[0])
    trace_model(model, train=True, call=calls[1])
    past = paths[0].stat().st_mtime - 60
    os.utime(paths[0], (past - 60, past - 60))  # stored two minutes ago, the second one a minute ago;
    os.utime(paths[1], (past, past))  # then the first is used again
    trace_model(model, train=True, call=calls[0])
    assert exports.calls == 2  # a hit
    trace_model(model, train=True, call=calls[2])
    assert exports.calls == 3 and not paths[1].exists() and paths[0].exists() and paths[2].exists()
    assert len([p for p in _graph_files() if not p.name.endswith(".hash.json")]) == 2


MODULE_SOURCE = '''
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, scale):
        return self.b(torch.relu(self.a(x)) * scale){change}
'''


def _import_fresh(directory: Path, source: str) -> Any:
    (directory / "remat_cache_probe_model.py").write_text(source)
    sys.modules.pop("remat_cache_probe_model", None)
    importlib.invalidate_caches()
    return importlib.import_module("remat_cache_probe_model")


def test_a_changed_forward_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exports: _ExportCounter) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    first = _import_fresh(tmp_path, MODULE_SOURCE.format(change=""))
    torch.manual_seed(0)
    model = first.Scaled()
    call = ModelCall.bind(model, (torch.randn(4, 8), torch.full((4, 1), 2.0)), {})
    key = export_cache.pre_key(model, call, train=True)
    gm = trace_model(model, train=True, call=call)
    assert exports.calls == 1 and len(_graph_files()) == 1
    assert trace_model(model, train=True, call=call).code == gm.code and exports.calls == 1

    second = _import_fresh(tmp_path, MODULE_SOURCE.format(change=" - 1.0"))
    torch.manual_seed(0)
    changed = second.Scaled()
    new_key = export_cache.pre_key(changed, call, train=True)
    assert new_key is not None and new_key != key
    # The first class, still in memory, runs its old code: its file changed under it, but its key is not the
    # new class's (the bytecode is part of it), so it never gets the new code's graph.
    assert export_cache.pre_key(model, call, train=True) not in (new_key, None)
    new_gm = trace_model(changed, train=True, call=call)
    assert exports.calls == 2 and "sub" in new_gm.code and "sub" not in gm.code
    sys.modules.pop("remat_cache_probe_model", None)


class _Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.a(x) * scale


def test_a_model_with_hooks_is_exported_every_time(exports: _ExportCounter) -> None:
    model = _Hooked()
    model.a.register_forward_hook(lambda module, args, out: out + 1)
    call = ModelCall.bind(model, (torch.randn(4, 8), torch.ones(4, 1)), {})
    assert export_cache.pre_key(model, call, train=True) is None
    trace_model(model, train=True, call=call)
    trace_model(model, train=True, call=call)
    assert exports.calls == 2 and _graph_files() == []


class _WithTable(nn.Module):
    """A plain tensor attribute read in forward: export lifts it into the graph as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.table = torch.arange(4.0)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.a(x) * scale + self.table


def test_a_lifted_constant_is_keyed_by_its_values_and_not_stored(exports: _ExportCounter) -> None:
    model = _WithTable()
    call = ModelCall.bind(model, (torch.randn(2, 4), torch.ones(2, 1)), {})
    key = export_cache.pre_key(model, call, train=True)
    model.table = torch.arange(4.0) * 2
    assert export_cache.pre_key(model, call, train=True) not in (key, None)
    trace_model(model, train=True, call=call)
    trace_model(model, train=True, call=call)
    assert exports.calls == 2 and _graph_files() == []  # its graph reads a constant the model does not hold


def _filled(exports: _ExportCounter) -> tuple[nn.Module, ModelCall, Path, dict[str, Any]]:
    model = tiny("gpt2")
    call = ModelCall.bind(model, (), batch())
    trace_model(model, train=True, call=call)
    (path,) = _graph_files()
    assert exports.calls == 1
    return model, call, path, json.loads(path.read_text())


def _first_call(data: dict[str, Any]) -> list[Any]:
    return next(node for node in data["nodes"] if node[1] == "call_function")


def _tamper_unknown_op(data: dict[str, Any]) -> None:
    _first_call(data)[2] = ["op", "os", "system", "default"]


def _tamper_operator(data: dict[str, Any]) -> None:
    _first_call(data)[2] = ["operator", "__import__"]


def _tamper_dotted_name(data: dict[str, Any]) -> None:
    _first_call(data)[2] = "os.system"


def _tamper_op_attribute(data: dict[str, Any]) -> None:
    _first_call(data)[2] = ["op", "aten", "add", "__call__"]


def _tamper_argument(data: dict[str, Any]) -> None:
    _first_call(data)[3] = ["t", [["pickle", "cos\nsystem\n(S'echo tampered'\ntR."]]]


def _tamper_attribute(data: dict[str, Any]) -> None:
    node = next(node for node in data["nodes"] if node[1] == "get_attr")
    node[2] = "transformer.device"


def _tamper_forward_reference(data: dict[str, Any]) -> None:
    _first_call(data)[3] = ["t", [["n", data["nodes"][-2][0]]]]


def _tamper_key(data: dict[str, Any]) -> None:
    data["key"] = "0" * 64


def _tamper_spec(data: dict[str, Any]) -> None:
    data["codegen"]["out_spec"] = data["codegen"]["out_spec"].replace("transformers.", "os.")


TAMPERINGS = [_tamper_unknown_op, _tamper_operator, _tamper_dotted_name, _tamper_op_attribute, _tamper_argument,
              _tamper_attribute, _tamper_forward_reference, _tamper_key, _tamper_spec]


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=[t.__name__.removeprefix("_tamper_") for t in TAMPERINGS])
def test_a_tampered_file_is_ignored_and_nothing_it_names_runs(tamper: Any, exports: _ExportCounter,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model, call, path, data = _filled(exports)
    tamper(data)
    path.write_text(json.dumps(data))
    ran: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: ran.append(a))
    key = export_cache.pre_key(model, call, train=True)
    assert key is not None and export_cache.load_graph(model, key, train=True) is None
    gm = trace_model(model, train=True, call=call)  # exported again, and the file rewritten
    assert exports.calls == 2 and ran == [] and gm.meta["remat_tracer"] == "export"
    assert json.loads(path.read_text())["key"] == key
    exports.refuse()
    assert trace_model(model, train=True, call=call).code == gm.code


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[]", b'{"format": "remat-graph/1"}', b""])
def test_a_malformed_file_is_ignored(content: bytes, exports: _ExportCounter) -> None:
    model, call, path, _ = _filled(exports)
    path.write_bytes(content)
    trace_model(model, train=True, call=call)
    assert exports.calls == 2


def test_an_oversized_file_is_not_read(exports: _ExportCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    model, call, path, _ = _filled(exports)
    monkeypatch.setattr(export_cache, "MAX_GRAPH_BYTES", 1024)
    trace_model(model, train=True, call=call)
    assert exports.calls == 2


def test_a_graph_of_another_model_with_the_same_key_is_refused(exports: _ExportCounter) -> None:
    """A file copied under another key's name (or a key collision) is refused: the key is inside the file."""
    model, call, path, data = _filled(exports)
    other = tiny("gpt2", layers=3)
    key = export_cache.pre_key(other, call, train=True)
    assert key is not None
    (path.parent / f"{key}.json").write_text(json.dumps(data))
    assert export_cache.load_graph(other, key, train=True) is None


def test_an_unwritable_cache_costs_an_export_not_an_error(exports: _ExportCounter, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("REMAT_PLAN_CACHE_DIR", str(blocked))
    model = tiny("gpt2")
    call = ModelCall.bind(model, (), batch())
    trace_model(model, train=True, call=call)
    trace_model(model, train=True, call=call)
    assert exports.calls == 2
