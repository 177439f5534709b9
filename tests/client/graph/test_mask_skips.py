"""Masks without padding: an exported graph builds or leaves out each attention mask as the model's own forward
does for the call (NOTE [ masks without padding ] in remat.client.graph.mask_skips).

The oracles: the eager model (a chain step ``torch.equal`` to its step) and transformers' own decision, read
off the SDPA calls of the graph (a mask argument, or none) and off the model's eager forward (SDPA called with
a mask, or none).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from remat.client.graph import export_cache, fx_trace, mask_skips
from remat.client.graph.fx_trace import export_any_sizes, export_model, sizes_refused
from remat.client.graph.mask_skips import MASK_SKIPS, mask_decisions
from remat.client.graph.model_call import ModelCall
from remat.client.graph.stage_graph import build_stage_chain
from tests.utils.tiny_transformers import batch, chain_step, same_step, step, tiny


def _unpadded(kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(kwargs, attention_mask=torch.ones_like(kwargs["attention_mask"]))


def _graph_masks(gm: torch.fx.GraphModule) -> list[bool]:
    """Per SDPA call of the graph: whether it is given a mask."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            out.append(mask is not None)
    return out


def _eager_masks(model: torch.nn.Module, kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per SDPA call of the model's own forward: whether it is given a mask."""
    seen: list[bool] = []
    original = F.scaled_dot_product_attention

    def recording(*args: Any, **kw: Any) -> Any:
        seen.append((args[3] if len(args) > 3 else kw.get("attn_mask")) is not None)
        return original(*args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", recording)
        with torch.no_grad():
            model(**kwargs)
    return seen


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_a_batch_without_padding_is_exported_without_its_mask_as_the_model_runs_it(
        arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny(arch)
    padded = batch(seq=16, size=3)
    for kwargs, skipped in ((padded, False), (_unpadded(padded), True)):
        call = ModelCall.bind(model, (), kwargs)
        gm = export_model(model, call, cache_dir=tmp_path)
        assert gm.meta[MASK_SKIPS] == (skipped,)
        masks = _graph_masks(gm)
        assert masks and masks == _eager_masks(model, kwargs, monkeypatch) == [not skipped] * len(masks)
        assert not [n for n in gm.graph.nodes if "assert_async" in str(n.target)]  # the markers are gone
        # The precondition answers for both kinds of batch at these sizes, whichever graph it came from.
        assert mask_decisions(gm, call.flat_inputs()) == (skipped,)
        other = padded if skipped else _unpadded(padded)
        assert mask_decisions(gm, ModelCall.bind(model, (), other).flat_inputs()) == (not skipped,)
        chain = build_stage_chain(model, call, graph=gm)  # the fidelity check: an eager and a chain step agree
        checkpoints = tuple(range(1, chain.num_stages, 2))
        assert same_step(step(model, kwargs), chain_step(model, chain, call, checkpoints))


def test_an_encoder_decoder_decides_each_mask_it_builds(tmp_path: Path) -> None:
    """T5 builds its encoder's and its cross-attention's masks from one ``attention_mask``: two decisions."""
    model = tiny("t5")
    padded = batch(seq=16, size=3)
    for kwargs, skipped in ((padded, False), (_unpadded(padded), True)):
        call = ModelCall.bind(model, (), kwargs)
        gm = export_model(model, call, cache_dir=tmp_path)
        assert gm.meta[MASK_SKIPS] == (skipped, skipped)
        chain = build_stage_chain(model, call, graph=gm)
        assert same_step(step(model, kwargs), chain_step(model, chain, call, tuple(range(1, chain.num_stages, 3))))


def test_the_markers_leave_the_graph_of_a_padded_batch_as_it_was(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A padded call's graph is the export's own, node for node (architecture hashes and stored plans of such
    calls stand), and a cached graph comes back with its decisions and precondition."""
    model = tiny("llama")
    call = ModelCall.bind(model, (), batch(seq=16, size=3))
    marked = export_model(model, call, cache_dir=tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(mask_skips, "export_skips", lambda skips: contextlib.nullcontext())
        plain = export_model(model, call, cache_dir=tmp_path / "plain")
    assert plain.meta[MASK_SKIPS] == () and plain.meta[mask_skips.PRECONDITION] is None
    assert marked.code == plain.code

    def no_export(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("exported although the graph is cached")

    monkeypatch.setattr(fx_trace, "_exported", no_export)
    again = export_model(model, call, cache_dir=tmp_path)
    assert again.code == marked.code and again.meta[MASK_SKIPS] == (False,)
    assert mask_decisions(again, call.flat_inputs()) == (False,)
    unpadded = ModelCall.bind(model, (), _unpadded(batch(seq=16, size=3)))
    assert mask_decisions(again, unpadded.flat_inputs()) == (True,)


def test_a_start_like_the_last_reads_one_graph_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decisions that skip a mask, once a model and call signature took them, are the first guess: a
    training script restarted with its mask without padding reads the graph that skips it, and only that one;
    a padded call, whose decisions contradict the guess, reads both."""
    model = tiny("gpt2")
    unpadded = ModelCall.bind(model, (), _unpadded(batch(seq=16, size=3)))
    padded = ModelCall.bind(model, (), batch(seq=16, size=3))
    assert export_model(model, unpadded, cache_dir=tmp_path).meta[MASK_SKIPS] == (True,)
    assert export_model(model, padded, cache_dir=tmp_path).meta[MASK_SKIPS] == (False,)
    loads: list[str] = []
    load = export_cache.load_graph
    monkeypatch.setattr(export_cache, "load_graph", lambda model, key, **k: loads.append(key) or load(model, key, **k))

    def no_export(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("exported although the graph is cached")

    monkeypatch.setattr(fx_trace, "_exported", no_export)
    for call, skipped, reads in ((padded, False, 2), (unpadded, True, 1), (unpadded, True, 1), (padded, False, 2)):
        loads.clear()
        gm = export_model(model, call, cache_dir=tmp_path)
        assert gm.meta[MASK_SKIPS] == (skipped,) and _graph_masks(gm)[0] is not skipped
        assert len(loads) == reads, (skipped, loads)


def test_the_export_for_any_sizes_takes_the_decisions_it_is_given() -> None:
    model = tiny("gpt2")
    call = ModelCall.bind(model, (), _unpadded(batch(seq=12, size=3)))
    for skips in ((False,), (True,)):
        gm = export_any_sizes(model, call, mask_skips=skips)
        assert gm.meta[MASK_SKIPS] == skips and _graph_masks(gm) == [not skips[0]] * len(_graph_masks(gm))
        for size, seq in ((2, 20), (4, 9)):
            kwargs = batch(seq=seq, size=size, seed=size)
            other = ModelCall.bind(model, (), kwargs if not skips[0] else _unpadded(kwargs))
            # Its precondition holds at any sizes: what the model did to the mask is in symbols.
            assert sizes_refused(gm, other.flat_inputs()) is None and mask_decisions(gm, other.flat_inputs()) == skips
