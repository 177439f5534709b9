"""Op graphs of calls with several inputs (NOTE [ an op graph of a call ]): transformers planned by ``acg`` on
their exported graphs.

Oracles: the unmodified model's loss and gradients (a dropped set runs like the model), the CPU meter's
measured peak (the graph predictor's replay of a plan), and the model's own graph (which vertex holds what).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path

import pytest
import torch

import remat.client
from remat.client import apply_plan
from remat.client.apply_plan import applied_chain, applied_plan
from remat.client.errors import PlanError, PlanMismatchError
from remat.client.graph.fx_trace import trace_model
from remat.client.graph.model_call import ModelCall
from remat.client.graph.op_graph import OpGraph, build_op_graph
from remat.client.planning.graph_predict import predict_graph_peak
from remat.client.planning.planners.acg import plan_graph
from remat.worker.graph_profile import executor_units, profile_graph
from remat.worker.measure import measure_step
from remat.worker.pipeline import explains_its_step
from tests.utils.tiny_transformers import batch, same_step, step, tiny


def _graph(arch: str, **batch_kwargs: object) -> tuple[torch.nn.Module, ModelCall, OpGraph]:
    model = tiny(arch)
    call = ModelCall.bind(model, (), batch(seed=1, **batch_kwargs))
    return model, call, build_op_graph(model, call, graph=trace_model(model, train=True, call=call))


def _valid_dropped_sets(graph: OpGraph, count: int, seed: int = 0) -> list[list[int]]:
    """Random dropped sets the executor accepts (it refuses groups it cannot run as one call)."""
    rng = random.Random(seed)
    found: list[list[int]] = []
    while len(found) < count:
        dropped = sorted(rng.sample(range(1, graph.sink), rng.randint(1, graph.sink // 2)))
        try:
            graph.execution_order(dropped)
        except PlanError:
            continue
        found.append(dropped)
    return found


@pytest.mark.parametrize("arch", ["gpt2", "bert", "t5"])
def test_a_calls_op_graph_has_every_input_at_its_source_and_trains_like_the_model(arch: str) -> None:
    model, call, graph = _graph(arch)
    placeholders = [n.name for n in graph.graph_module.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == graph.num_inputs == len(call.flat_inputs()) >= 3
    assert set(placeholders) <= set(graph.vertex_nodes[0])
    assert graph.names[0] == "<input>" and graph.weights[0] == sum(t.nbytes for t in call.leaves())

    reference = step(model, dict(call.kwargs))
    unmodified = _call_step(model, graph, call, ())
    assert torch.equal(unmodified[0], reference[0])
    assert all(torch.equal(a, b) for a, b in zip(unmodified[1], reference[1], strict=True))
    plan = plan_graph(graph.weights, graph.edges)  # acg's classic plan: every component from an entry to an exit
    dropped = sorted(v for seg in plan.segments for v in seg.interior)
    assert len(dropped) > graph.num_vertices // 3
    planned = _call_step(model, graph, call, dropped)
    assert torch.equal(planned[0], reference[0])
    scale = max(g.abs().max().item() for g in reference[1] if g is not None)
    for a, b in zip(planned[1], reference[1], strict=True):
        assert (a is None) == (b is None)
        if a is not None:  # bit-equal unless a call interleaves with kept ops (float sums in another order)
            assert torch.allclose(a, b, rtol=0, atol=1e-6 * scale)


def _call_step(model: torch.nn.Module, graph: OpGraph, call: ModelCall, dropped: list[int]) -> tuple:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(3)
    loss = graph.run_call(call, dropped).loss
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_tables_made_from_buffers_hang_off_the_source() -> None:
    """BERT looks its token types and positions up from buffers: no input reaches those embeddings, yet a plan
    must be able to re-run them inside the call that reads them rather than hold them as its inputs."""
    _, _, graph = _graph("bert")
    vertex_of = {name: v for v, names in enumerate(graph.vertex_nodes) for name in names}
    by_target = {}
    for n in graph.graph_module.graph.nodes:
        if n.op == "call_function" and "embedding" in str(n.target) and n.name in vertex_of:
            by_target[graph.names[vertex_of[n.name]]] = vertex_of[n.name]
    tables = [v for name, v in by_target.items() if "token_type" in name or "position" in name]
    assert len(tables) == 2, by_target  # vertices at all: off the planned paths they would have none
    calls = graph.calls(tables)  # droppable: re-run inside a checkpointed call, not held as its inputs
    assert all(any(v in call for call in calls) for v in tables)
    graph.execution_order(tables)


def test_a_call_with_other_inputs_is_refused_by_its_op_graph() -> None:
    _, _, graph = _graph("gpt2")
    with pytest.raises(PlanError, match="not those the op graph was built for"):
        graph.run_call(ModelCall.bind(tiny("gpt2"), (), batch(seed=1, mask=False)))


def test_the_replay_of_a_calls_step_is_what_the_meter_measures() -> None:
    """Random plans of GPT-2 (tied embedding and head) predicted against measured steps, to the loss's scalar."""
    _assert_replays_as_measured(*_graph("gpt2"), random_plans=4)


def _assert_replays_as_measured(model: torch.nn.Module, call: ModelCall, graph: OpGraph, *, random_plans: int) -> None:
    """The graph profile explains its own step, and the unmodified step and ``random_plans`` random plans are
    predicted to 8 bytes of the meter (the loss's scalar)."""
    profile = profile_graph(model, call, graph, grads="none")
    assert explains_its_step(profile, graph)
    for dropped in [[], *_valid_dropped_sets(graph, random_plans)]:
        predicted = predict_graph_peak(profile, executor_units(graph, dropped)).peak
        measured = measure_step(model, call, dropped, grads="none", chain=graph, baseline=False).measured_peak_bytes
        assert abs(predicted - measured) <= 8, (dropped, predicted, measured)


def test_a_tied_weights_gradients_are_summed_out_of_place_under_the_meter() -> None:
    """NOTE [ accumulation under the meter ]: with a large vocabulary the tied embedding's two gradients decide
    GPT-2's peak; the meter, a dispatch mode, makes the engine sum them into a new buffer, and the replay says
    so (it once assumed the in-place sum of a step without the meter: 1 × the weight under)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=8192, n_positions=64,
                                            use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(0, 8192, (1, 8))
    call = ModelCall.bind(model, (), {"input_ids": ids, "labels": ids.clone()})
    graph = build_op_graph(model, call, graph=trace_model(model, train=True, call=call))
    profile = profile_graph(model, call, graph, grads="none")
    prediction = predict_graph_peak(profile, executor_units(graph, ()))
    assert prediction.where.startswith("gradient accumulation"), prediction.where
    measured = measure_step(model, call, (), grads="none", chain=graph, baseline=False).measured_peak_bytes
    assert abs(prediction.peak - measured) <= 8
    weight = 8192 * 32 * 4
    assert measured >= 3 * weight  # the head's and the embedding's gradients, and their sum


def test_a_profile_whose_replay_misses_its_step_is_not_used() -> None:
    model, call, graph = _graph("gpt2")
    profile = profile_graph(model, call, graph, grads="none")
    assert explains_its_step(profile, graph)
    off = dataclasses.replace(profile, measured_peak_bytes=int(profile.measured_peak_bytes * 1.05))
    assert not explains_its_step(off, graph)


def test_checkpoint_applies_a_graph_plan_to_a_transformer(cache_dir: Path) -> None:
    """``checkpoint(model, algorithm="acg", **call)``: planned on the op graph, trained bit-equal to the model
    (BERT, dropout on), at the plan's sizes and at others, each on an op graph of its own sizes (NOTE [ graph
    plans of a call ])."""
    reference = tiny("bert")
    model = copy.deepcopy(reference)
    first = batch(seed=1)
    remat.client.checkpoint(model, algorithm="acg", cache_dir=cache_dir, **first)
    plan = applied_plan(model)
    assert plan is not None and plan.is_graph_plan and plan.dropped_vertices
    assert isinstance(applied_chain(model), OpGraph)
    for seed in (1, 2):
        expected, got = step(reference, batch(seed=seed)), step(model, batch(seed=seed))
        assert torch.equal(expected[0], got[0])
        assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1], strict=True))
    with pytest.warns(RuntimeWarning, match=r"other sizes than the plan's, .*int64\[2, 16\].* runs the graph plan"):
        shorter = step(model, batch(seed=3, seq=16))
    assert same_step(step(reference, batch(seed=3, seq=16)), shorter)
    (graph16,) = model.__dict__[apply_plan._STATE].sized_chains.values()
    assert isinstance(graph16, OpGraph) and graph16 is not applied_chain(model)
    for kwargs in ({"seed": 4, "seq": 40, "size": 3}, {"seed": 5, "seq": 16}):
        assert same_step(step(reference, batch(**kwargs)), step(model, batch(**kwargs)))
    # The plan's batch was padded, so its graph builds the attention masks; an unpadded call, which the model's
    # own forward would run without them, runs on that graph with a warning: the same loss up to float rounding.
    unpadded = batch(seed=6) | {"attention_mask": torch.ones(2, 32, dtype=torch.int64)}
    with pytest.warns(RuntimeWarning, match="the graph plan runs on its graph, which builds them"):
        got = step(model, unpadded)
    assert torch.allclose(got[0], step(reference, unpadded)[0], rtol=1e-5)


def test_a_graph_plan_made_without_padding_refuses_a_padded_call(cache_dir: Path) -> None:
    """Planned on a batch without padding, the graph holds the model's own decision to leave the masks out; a
    padded call would attend to its padding there, so it is refused (NOTE [ graph plans of a call ])."""
    model = tiny("bert")
    unpadded = batch(seed=1) | {"attention_mask": torch.ones(2, 32, dtype=torch.int64)}
    remat.client.checkpoint(model, algorithm="acg", cache_dir=cache_dir, **unpadded)
    assert applied_plan(model).is_graph_plan
    step(model, unpadded)
    with pytest.raises(PlanMismatchError, match="padding the plan's graph leaves out"):
        model(**batch(seed=2))


def test_an_output_the_loss_does_not_read_leaves_the_replay_whole() -> None:
    """CLIP returns ``logits_per_image``, a transpose of the logits its loss transposes again on its own: that
    node gets no gradient, and counted as one the logits wait for it stopped the replay after 7 of 281 nodes.
    The engine counts dependencies over what the loss reaches; so does the replay, and it predicts the meter."""
    from tests.utils.tiny_transformers import clip_batch

    model = tiny("clip")
    call = ModelCall.bind(model, (), clip_batch(seed=1))
    graph = build_op_graph(model, call, graph=trace_model(model, train=True, call=call))
    _assert_replays_as_measured(model, call, graph, random_plans=3)


def test_a_training_jobs_miss_builds_no_op_graph_unless_acg_is_asked_for(cache_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ graphs on a training job's miss ] in remat.worker.local: the graph's profile and search run inside
    the user's job, so ``checkpoint()`` pays for them only when it applies ``acg``."""
    from remat.worker import pipeline

    def refuse(built: object) -> None:
        raise AssertionError("an op graph was built for a linear plan")

    monkeypatch.setattr(pipeline, "op_graph", refuse)
    model = tiny("gpt2")
    remat.client.checkpoint(model, cache_dir=cache_dir, **batch(seed=1))
    assert applied_plan(model).algorithm == "linear" and not applied_plan(model).is_graph_plan


def test_a_graph_plan_refuses_sizes_at_which_the_model_exports_other_ops(cache_dir: Path) -> None:
    """A batch of one row: export drops Llama's size-1 ops, so its op graph is not the plan's and the plan's
    vertices would name other ops; the call is refused naming the sizes (NOTE [ graph plans of a call ])."""
    model = tiny("llama")
    remat.client.checkpoint(model, algorithm="acg", cache_dir=cache_dir, **batch(seed=1))
    with pytest.raises(PlanMismatchError, match=r"runs at other sizes only where the model exports the same ops.*"
                                                r"int64\[1, 32\].*a chain plan \(linear"):
        model(**batch(seed=2, size=1))
