"""One export of a transformer for any sizes (NOTE [ any sizes ] in remat.client.graph.fx_trace).

The oracles: the chain cut from the export at the plan's fixed sizes (same stages, so a plan's boundary
indices mean the same cuts), and the eager model (a training step at every other size, with checkpoints, gives
a loss and every gradient ``torch.equal`` to its own, dropout on). What the code decides on sizes must refuse
the calls it does not hold for, through export's guards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from remat.client.errors import ModelError
from remat.client.graph.fx_trace import ANY_SIZES_GUARDS, export_any_sizes, sizes_refused
from remat.client.graph.model_call import ModelCall
from remat.client.graph.stage_graph import build_stage_chain
from tests.utils.tiny_transformers import batch, chain_step, same_step, step, tiny

ARCHITECTURES = ["gpt2", "llama", "bert", "t5"]


def _leaves(call: ModelCall) -> list[Any]:
    return pytree.tree_flatten((tuple(call.args), dict(call.kwargs)))[0]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_one_export_cuts_like_the_plans_and_trains_exactly_at_every_size(arch: str) -> None:
    model = tiny(arch)
    planned = build_stage_chain(model, ModelCall.bind(model, (), batch(seed=1)))  # the plan's sizes, (2, 32)
    first_other = ModelCall.bind(model, (), batch(seed=2, size=3, seq=24))
    graph = export_any_sizes(model, first_other)
    assert any("sym_size" in str(node.target) for node in graph.graph.nodes)  # sizes are symbols, not numbers
    chain = build_stage_chain(model, first_other, graph=graph, check=False)
    assert chain.layout() == planned.layout(), (chain.names, planned.names)
    n = chain.num_stages
    for size, seq in [(2, 32), (2, 24), (3, 40), (4, 7)]:
        kwargs = batch(seed=10 * size + seq, size=size, seq=seq)
        call = ModelCall.bind(model, (), kwargs)
        assert sizes_refused(graph, _leaves(call)) is None, (size, seq)
        reference = step(model, kwargs)
        for checkpoints in [(), tuple(range(2, n, 3))]:
            assert same_step(reference, chain_step(model, chain, call, checkpoints)), (arch, size, seq, checkpoints)
    # Export assumed no size of 1 (NOTE [ sizes export assumed ]): a batch of one row gets a graph of its own.
    refusal = sizes_refused(graph, _leaves(ModelCall.bind(model, (), batch(size=1, seq=7))))
    assert refusal is not None and "shape[0] is 1, outside the sizes export assumed (2 or more" in refusal


class _Branching(nn.Module):
    """A model whose code decides on a size: ``long`` scales sequences longer than 16 tokens (export writes a
    guard), ``one_row`` a batch of one row (export, given 2 rows or more, assumes 1 never comes: no guard)."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.branch = branch
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if (input_ids.shape[1] > 16) if self.branch == "long" else (h.shape[0] == 1):
            h = h * 2
        return ((self.head(h).squeeze(-1) - labels) ** 2).mean()

    def call(self, size: int, seq: int) -> ModelCall:
        ids = torch.arange(size * seq).reshape(size, seq) % 32
        return ModelCall.bind(self, (), {"input_ids": ids, "labels": torch.zeros(size, seq)})


def test_what_the_code_decides_on_sizes_is_a_guard_that_refuses_other_calls() -> None:
    model = _Branching("long")
    graph = export_any_sizes(model, model.call(2, 32))
    assert sizes_refused(graph, _leaves(model.call(3, 20))) is None
    # The graph holds the long branch only: export's range for the length says so.
    assert sizes_refused(graph, _leaves(model.call(2, 8))) == \
        "input_ids.shape[1] is 8, outside the sizes export assumed (17 or more)"


def test_a_size_of_one_is_outside_what_export_assumed_and_is_refused() -> None:
    model = _Branching("one_row")
    call = model.call
    graph = export_any_sizes(model, call(2, 8))
    assert sizes_refused(graph, _leaves(call(3, 5))) is None
    # The guards module alone let a batch of one through, onto the graph of the other branch.
    guards, indices = graph.meta[ANY_SIZES_GUARDS]
    guards(*(_leaves(call(1, 8))[i] for i in indices))
    assert sizes_refused(graph, _leaves(call(1, 8))) == ("input_ids.shape[0] is 1, outside the sizes export assumed "
                                                         "(2 or more; a size of 1 may take branches the graph does "
                                                         "not hold)")
    refusal = sizes_refused(graph, _leaves(call(3, 5))[:1] + [torch.zeros(3, 6)])
    assert refusal is not None and "labels.shape[1] is 6 where input_ids.shape[1] is 5" in refusal
    assert sizes_refused(graph, [torch.zeros(3, 5, 1, dtype=torch.long), torch.zeros(3, 5)]) == \
        "input_ids has 3 dimensions, the graph's 2"


def test_a_call_that_does_not_bind_to_the_forward_is_refused() -> None:
    model = _Branching("long")
    stray = ModelCall(args=(), kwargs={"input_ids": torch.zeros(2, 4, dtype=torch.long), "mask": None},
                      signature="input_ids: int64[2, 4]; mask=None")
    with pytest.raises(ModelError, match="do not bind to _Branching.forward"):
        export_any_sizes(model, stray)
