"""Chains of models called with several inputs (Hugging Face transformers), cut from their exported graphs.

The oracle is the eager model: one training step of the chain, with no, every and some boundaries
checkpointed, must give a loss and every parameter gradient ``torch.equal`` to the model's own step from the
same RNG state (dropout on: RNG replay is under test too).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.client.errors import ModelError, PlanError
from remat.client.graph.fidelity import custom_functions, routing_ops
from remat.client.graph.fx_trace import export_any_sizes
from remat.client.graph.model_call import ModelCall, synthetic_call
from remat.client.graph.stage_graph import build_stage_chain
from tests.utils.tiny_transformers import batch, chain_step, classifier_batch, same_step, step, tiny

ARCHITECTURES = ["gpt2", "llama", "bert", "t5"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chain_of_a_transformer_trains_like_the_model(arch: str) -> None:
    model = tiny(arch)
    kwargs = batch()
    call = ModelCall.bind(model, (), kwargs)
    chain = build_stage_chain(model, call)
    assert chain.graph_module.meta["remat_tracer"] == "export"
    # Cut between and inside the two blocks (and the encoder's and decoder's of T5), not only around them.
    assert chain.num_stages >= 8, chain.names
    # The attention mask every block reads is a side value handed to each stage, not a boundary.
    assert chain.side_values and not set(chain.side_values) & set(chain.boundaries)
    reference = step(model, kwargs)
    n = chain.num_stages
    for checkpoints in [(), tuple(range(1, n)), tuple(range(2, n, 3))]:
        assert same_step(reference, chain_step(model, chain, call, checkpoints)), (arch, checkpoints)
    assert type(chain.run_call(call, ())).__name__ == type(model(**kwargs)).__name__  # the ModelOutput comes back


def test_mixture_of_experts_is_refused_with_the_reason() -> None:
    model = tiny("mixtral")
    call = ModelCall.bind(model, (), batch())
    with pytest.raises(ModelError, match=r"MixtralForCausalLM routes tokens by their values \(aten.topk"):
        build_stage_chain(model, call)


@pytest.mark.parametrize("arch", ["gpt2-classifier", "llama-classifier"])
def test_a_classifier_pooling_by_token_ids_is_planned(arch: str) -> None:
    """A decoder classifier pools each row's last token that is not padding with ``argmax`` over
    ``arange * (input_ids != pad)``: a position picked from the token ids, not code picked from activations
    (NOTE [ routing by activations ]). It was refused as a mixture of experts; its chain trains bit-equal."""
    model = tiny(arch)
    kwargs = classifier_batch()
    call = ModelCall.bind(model, (), kwargs)
    chain = build_stage_chain(model, call)
    assert any("argmax" in str(n.target) for n in chain.graph_module.graph.nodes)
    # Cut between and inside the blocks although the pooling reads input_ids again at the end: token ids are
    # held like the call's other inputs (NOTE [ token ids are held ]); the transformer was one stage before.
    assert chain.main_handed and chain.num_stages >= 8, chain.names
    reference = step(model, kwargs)
    for checkpoints in [(), tuple(range(1, chain.num_stages))]:
        assert same_step(reference, chain_step(model, chain, call, checkpoints)), checkpoints
    # At any sizes the sequence length is a symbol read off a tensor: a size, not a value that routes.
    assert routing_ops(export_any_sizes(model, call).graph) == []


class _Router(nn.Module):
    """Two experts and a gate: each row runs the expert its gate scores highest."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 2)
        self.experts = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1) + 0 * ids.argmax(-1)  # ids' argmax alone would not route
        out = self.experts(x).view(x.shape[0], 2, 8)
        return out.gather(1, choice.view(-1, 1, 1).expand(-1, 1, 8)).squeeze(1)


def test_routing_by_scores_is_refused_and_pooling_by_ids_is_not() -> None:
    model = _Router()
    call = ModelCall.bind(model, (torch.randn(4, 8), torch.randint(0, 9, (4, 5))), {})
    with pytest.raises(ModelError, match=r"_Router routes tokens by their values \(aten.argmax: a mixture"):
        build_stage_chain(model, call)
    # A classifier's pooling at any sizes: argmax(arange(hidden.size(1)) * ids), the length read off a float.
    graph = torch.fx.Graph()
    hidden, ids = graph.placeholder("hidden"), graph.placeholder("ids")
    hidden.meta["val"], ids.meta["val"] = torch.zeros(4, 5, 8), torch.zeros(4, 5, dtype=torch.long)
    length = graph.call_function(torch.ops.aten.sym_size.int, (hidden, 1))
    length.meta["val"] = 5
    positions = graph.call_function(torch.ops.aten.arange.default, (length,))
    positions.meta["val"] = torch.zeros(5, dtype=torch.long)
    product = graph.call_function(torch.ops.aten.mul.Tensor, (positions, ids))
    product.meta["val"] = torch.zeros(4, 5, dtype=torch.long)
    graph.output(graph.call_function(torch.ops.aten.argmax.default, (product, -1)))
    assert routing_ops(graph) == []  # a position picked from token ids and a size
    ids.meta["val"] = torch.zeros(4, 5)
    assert routing_ops(graph) == ["argmax"]  # picked from floating-point values, it routes


def test_a_custom_autograd_function_is_named_when_export_loses_its_backward() -> None:
    """BLOOM's GeLU is a ``torch.autograd.Function`` in training; export differentiates its forward instead of
    running its backward, so the gradients differ in their last bits. The refusal names the function instead
    of blaming control flow."""
    model = tiny("bloom")
    kwargs = batch()
    loss = model(**kwargs).loss
    assert custom_functions(loss) == ["GeLUFunction"]
    assert custom_functions(tiny("gpt2")(**kwargs).loss) == []
    with pytest.raises(ModelError, match=r"BloomForCausalLM cannot be planned exactly: .*applies "
                                         r"torch.autograd.Function GeLUFunction, whose own backward"):
        build_stage_chain(model, ModelCall.bind(model, (), kwargs))


class _Branchy(nn.Module):
    """Control flow on a tensor's values: no graph holds both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x) * scale
        return self.b(x) * scale


def test_data_dependent_control_flow_is_refused_naming_the_tracer_and_the_line() -> None:
    model = _Branchy()
    call = ModelCall.bind(model, (torch.randn(4, 8), torch.ones(4, 1)), {})
    with pytest.raises(ModelError, match=r"torch.export cannot trace _Branchy: .* at test_export_chain.py:\d+: "
                                         r"`if x.sum\(\) > 0:`$"):
        build_stage_chain(model, call)


class _LayerDrop(nn.Module):
    """LayerDrop as transformers writes it (M2M100/NLLB, wav2vec2): each layer skipped at random in training."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.layerdrop = 0.05

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            dropout_probability = torch.rand([])
            if self.training and dropout_probability < self.layerdrop:
                continue
            x = layer(x) * scale
        return x


def test_layerdrop_is_refused_saying_how_to_plan_it() -> None:
    model = _LayerDrop().train()
    call = ModelCall.bind(model, (torch.randn(4, 8), torch.ones(4, 1)), {})
    with pytest.raises(ModelError, match=r"`if self.training and dropout_probability < self.layerdrop:`; LayerDrop "
                                         r"skips layers at random.*set the configuration's layerdrop fields to 0"):
        build_stage_chain(model, call)


def test_a_call_has_one_spelling() -> None:
    model = tiny("gpt2")
    kwargs = batch(mask=False)
    keyword = ModelCall.bind(model, (), kwargs)
    positional = ModelCall.bind(model, (kwargs["input_ids"],), {"labels": kwargs["labels"]})
    assert keyword.signature == positional.signature
    assert keyword.signature == "input_ids: int64[2, 32]; labels: int64[2, 32]"
    flagged = ModelCall.bind(model, (), {**kwargs, "use_cache": False, "token_type_ids": None})
    assert "use_cache=False" in flagged.signature and "token_type_ids=None" in flagged.signature
    assert keyword.describe_difference(flagged) == "token_type_ids: absent vs None; use_cache: absent vs False"
    assert synthetic_call(flagged.signature, model, "cpu").signature == flagged.signature
    one = ModelCall.bind(model, (kwargs["input_ids"],), {})
    assert one.signature == "" and one.single_tensor is kwargs["input_ids"]


def test_inputs_that_cannot_be_traced_are_named() -> None:
    model = tiny("gpt2")
    with pytest.raises(PlanError, match=r"input labels: a set cannot be traced"):
        ModelCall.bind(model, (), {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": {1, 2}})
    with pytest.raises(PlanError, match="do not fit _Branchy.forward"):
        ModelCall.bind(_Branchy(), (torch.zeros(2, 8),), {"tokens": torch.zeros(2)})
    with pytest.raises(PlanError, match="passes no tensor"):
        ModelCall.bind(model, (), {"use_cache": False})


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_decoder_called_without_a_mask_keeps_its_eager_attention_path(arch: str) -> None:
    """Without an attention mask transformers leaves causality to SDPA's is_causal when it runs eagerly, and
    builds an explicit mask when it exports: the exported graph takes the eager path, so it trains bit-equal
    (Llama's gradients differed in their last bits before, and the model was refused)."""
    model = tiny(arch)
    kwargs = batch(mask=False)
    call = ModelCall.bind(model, (), kwargs)
    chain = build_stage_chain(model, call)
    sdpa = [n for n in chain.graph_module.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert sdpa and all(len(n.args) > 3 and n.args[3] is None for n in sdpa)  # no materialised mask
    reference = step(model, kwargs)
    assert same_step(reference, chain_step(model, chain, call, tuple(range(1, chain.num_stages, 2))))
