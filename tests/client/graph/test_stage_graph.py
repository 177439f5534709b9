"""Stage chains: articulation boundaries, in-place safety, fallbacks, and that building leaves no trace."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from remat.client.errors import ModelError, PlanError
from remat.client.graph.stage_graph import StageChain, brute_force_cut_vertices, build_stage_chain, trace_model


class Tiny(nn.Module):
    """conv → bn → in-place ReLU module → residual pair closed by an in-place functional ReLU → head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.conv3 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.conv3(self.conv2(x)) + x, inplace=True)
        return self.fc(torch.flatten(self.pool(y), 1))


class ShapeUser(nn.Module):
    """Reads the batch size before the first layer and uses it after: a non-tensor edge over ``conv``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)
        self.scale = nn.Parameter(torch.full((1,), 2.0))
        self.fc = nn.Linear(2 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = self.conv(x)
        x = x.reshape(n, -1) * self.scale
        return self.fc(torch.tanh(x))


class FunctionalNorm(nn.Module):
    """Batch norm written with F.batch_norm on its own buffers: traced through, so the buffers are get_attr
    nodes and no BatchNorm module is called; the recompute must still not update them twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))
        self.conv2 = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(self.conv1(x), self.mean, self.var, training=self.training, momentum=0.5)
        return self.conv2(torch.tanh(x))


class UntraceableChain(nn.Sequential):
    """A Sequential whose forward branches on a value of its input: fx and torch.export both fail, the
    children are a chain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.isnan().any()):
            raise ValueError("NaN in the input")
        for module in self:
            x = module(x)
        return x


class UntraceableBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 3, 1)
        self.b = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.isnan().any()):
            raise ValueError("NaN in the input")
        return self.a(x) + self.b(x)


class ShapeCheckedChain(nn.Sequential):
    """A Sequential whose forward branches on its input's shape: fx fails, torch.export follows it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError("expects NCHW")
        for module in self:
            x = module(x)
        return x


def _untraceable_chain() -> UntraceableChain:
    return UntraceableChain(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


def _stage_of(chain: StageChain, node: str) -> int:
    return next(i for i, nodes in enumerate(chain.stage_nodes, start=1) if node in nodes)


def test_tiny_boundaries_match_brute_force_and_drop_in_place_targets() -> None:
    chain = build_stage_chain(Tiny(), torch.randn(2, 3, 8, 8))
    assert chain.source == "fx"
    assert chain.cut_vertices == brute_force_cut_vertices(chain)
    assert chain.cut_vertices == ["conv1", "bn1", "relu", "add", "relu_1", "pool", "flatten", "fc"]
    # bn1's output is overwritten by the in-place ReLU module, add's by F.relu(..., inplace=True).
    assert chain.dropped == ["bn1", "add"]
    # fc feeds only the output: cutting there would leave an empty last stage.
    assert chain.boundaries == ["conv1", "relu", "relu_1", "pool", "flatten"]
    assert chain.num_stages == 6
    assert _stage_of(chain, "relu") == _stage_of(chain, "bn1")
    assert _stage_of(chain, "relu_1") == _stage_of(chain, "add") == _stage_of(chain, "conv2")
    assert len(chain.names) == len(set(chain.names)) == 6


def test_resnet18_boundaries_match_brute_force() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    chain = build_stage_chain(model, torch.randn(2, 3, 64, 64))
    assert chain.cut_vertices == brute_force_cut_vertices(chain)
    assert chain.num_stages == 14  # 13 safe boundaries
    assert set(chain.boundaries) <= set(chain.cut_vertices)
    # Every BN or residual add followed by an in-place ReLU stays with that ReLU.
    assert "bn1" in chain.dropped and _stage_of(chain, "bn1") == _stage_of(chain, "relu")
    assert chain.names[:4] == ["conv1", "bn1..relu", "maxpool", "layer1.0"]
    used = [p for i in range(1, chain.num_stages + 1) for p in chain.stage_parameters(i)]
    assert sorted(map(id, used)) == sorted(map(id, model.parameters()))  # each parameter in one stage
    # ... and in its own stage, not a neighbour's (a shifted index would still list each parameter once).
    assert chain.stage_parameters(1) == [model.conv1.weight]
    assert chain.stage_parameters(2) == [model.bn1.weight, model.bn1.bias]


def test_stages_run_one_at_a_time_equal_the_model() -> None:
    torch.manual_seed(0)
    model = ShapeUser().eval()
    x = torch.randn(2, 3, 8, 8)
    chain = build_stage_chain(model, x, train=False)
    assert "conv" in chain.boundaries  # found only because the x.shape edge is ignored
    y = x
    for i in range(1, chain.num_stages + 1):
        y = chain.stage(i)(y)
    assert torch.equal(y, model(x))
    assert torch.equal(chain.run(x), model(x))
    for outside in (0, chain.num_stages + 1):
        with pytest.raises(IndexError, match=rf"stage {outside} is not in 1\.\.{chain.num_stages}"):
            chain.stage(outside)
    n = chain.num_stages
    with pytest.raises(PlanError, match=rf"must be distinct boundaries in 1\.\.{n - 1}$"):
        chain.run(x, checkpoints=(n,))


def test_get_attr_parameters_are_looked_up_live() -> None:
    torch.manual_seed(0)
    model = ShapeUser()
    chain = build_stage_chain(model, torch.randn(2, 3, 8, 8))
    # A parameter read by get_attr (not through a module) belongs to the stage that reads it.
    used = [p for i in range(1, chain.num_stages + 1) for p in chain.stage_parameters(i)]
    assert sorted(map(id, used)) == sorted(map(id, model.parameters()))
    model.double()  # after building: the chain must follow the model, not hold the old tensors
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ref = copy.deepcopy(model)
    loss = chain.run(x, checkpoints=(1,)).sum()
    loss.backward()
    ref_loss = ref(x).sum()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    assert model.scale.grad is not None and torch.equal(model.scale.grad, ref.scale.grad)


def test_building_leaves_model_and_rng_untouched() -> None:
    model = torchvision.models.resnet18(num_classes=10).eval()
    model.layer1.train()  # a mixed mode must come back as it was
    before = copy.deepcopy(model.state_dict())
    flags = [m.training for m in model.modules()]
    x = torch.randn(2, 3, 64, 64)
    rng = torch.get_rng_state()
    build_stage_chain(model, x, train=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(k.startswith("_tensor_constant") for k in vars(model))


def test_untraceable_chain_falls_back_to_children() -> None:
    with pytest.raises(ModelError):
        trace_model(_untraceable_chain())
    torch.manual_seed(0)
    model = _untraceable_chain()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    chain = build_stage_chain(model, x)
    assert chain.source == "children" and chain.graph_module is None
    assert chain.dropped == ["1"]  # child 2 is an in-place ReLU on child 1's output
    assert chain.stage_nodes == [["0"], ["1", "2"], ["3"], ["4"], ["5"], ["6"]]
    assert chain.cut_vertices == brute_force_cut_vertices(chain)
    loss = chain.run(x, checkpoints=(2, 3)).square().sum()
    loss.backward()
    ref_loss = ref(x).square().sum()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert all(torch.equal(p, q) for p, q in zip(model.buffers(), ref.buffers(), strict=True))


def test_a_one_tensor_model_fx_cannot_follow_is_exported_and_cut() -> None:
    """As checkpoint() does for such a model, the CLI's bare tensor is exported before the children are tried:
    the graph's boundaries, not the top-level children (timm's CrossViT: no chain of children at all)."""
    torch.manual_seed(0)
    model = ShapeCheckedChain(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.Tanh(),
                              nn.Conv2d(4, 2, 1))
    with pytest.raises(ModelError):
        trace_model(model)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    chain = build_stage_chain(model, x)
    assert chain.source != "children" and chain.graph_module.meta["remat_tracer"] == "export"
    assert chain.num_stages >= 4
    loss = chain.run_call(x, checkpoints=tuple(range(1, chain.num_stages))).square().sum()
    loss.backward()
    ref_loss = ref(x).square().sum()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def test_neither_traceable_nor_a_chain_is_a_clear_one_line_error() -> None:
    with pytest.raises(ModelError) as info:
        build_stage_chain(UntraceableBranches(), torch.randn(2, 3, 8, 8))
    message = str(info.value)
    assert "\n" not in message
    assert "cannot cut UntraceableBranches into stages" in message
    assert "torch.export cannot trace UntraceableBranches" in message  # tried after fx
    assert "child 'b' does not take the previous output" in message


def test_run_rejects_invalid_checkpoints() -> None:
    chain = build_stage_chain(Tiny(), torch.randn(2, 3, 8, 8))
    for bad in [(0,), (chain.num_stages,), (2, 2)]:
        with pytest.raises(PlanError):
            chain.run(torch.randn(2, 3, 8, 8), checkpoints=bad)


def test_functional_batch_norm_buffers_are_updated_once() -> None:
    torch.manual_seed(0)
    model = FunctionalNorm()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    chain = build_stage_chain(model, x)
    assert torch.equal(model.mean, ref.mean)  # building did not update them
    first = _stage_of(chain, "batch_norm")
    chain.run(x, checkpoints=(first,)).sum().backward()
    ref(x).sum().backward()
    assert torch.equal(model.mean, ref.mean) and torch.equal(model.var, ref.var)
    assert not torch.equal(model.mean, torch.zeros(4))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def test_stochastic_depth_is_a_leaf_so_eval_is_deterministic() -> None:
    from torchvision.ops import StochasticDepth

    model = nn.Sequential(nn.Conv2d(3, 3, 1), StochasticDepth(0.5, "row"), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    gm = trace_model(model, train=True)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "1", "2", "3"]
    chain = build_stage_chain(model, torch.randn(8, 3, 4, 4), train=True)
    model.eval()
    x = torch.randn(8, 3, 4, 4)
    with torch.no_grad():
        assert torch.equal(chain.run(x), model(x))


class TracedConstant(nn.Module):
    """A tensor made inside forward: fx keeps it as ``_tensor_constant0`` on the traced root only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_a_tracer_constant_is_found_on_the_traced_root() -> None:
    torch.manual_seed(0)
    model = TracedConstant()
    x = torch.randn(2, 4)
    chain = build_stage_chain(model, x, train=True)
    assert not hasattr(model, "_tensor_constant0")  # held by the traced root, not the model
    for checkpoints in ((), (1,)):
        assert torch.equal(chain.run(x, checkpoints), model(x))


def test_a_bool_checkpoint_is_refused() -> None:
    chain = build_stage_chain(TracedConstant(), torch.randn(2, 4), train=True)
    with pytest.raises(PlanError, match="must be distinct boundaries"):
        chain.run(torch.randn(2, 4), checkpoints=(True,))


def test_a_chain_of_three_hundred_stages_runs_every_boundary_checkpointed() -> None:
    """Past 256 segments (where small ints stop being shared objects): the last segment is still found and
    run outside checkpoint, and the bound in a refused plan's message is n - 1."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(300)])
    x = torch.randn(3, 2)
    chain = build_stage_chain(model, x, train=True)
    n = chain.num_stages
    assert n == 300
    assert torch.equal(chain.run(x, tuple(range(1, n))), model(x))
    with pytest.raises(PlanError, match=rf"must be distinct boundaries in 1\.\.{n - 1}$"):
        chain.run(x, checkpoints=(n,))


def _small_densenet() -> nn.Module:
    """torchvision's DenseNet (every layer reads the list of all earlier features), two small blocks."""
    torch.manual_seed(0)
    return torchvision.models.DenseNet(growth_rate=4, block_config=(4, 3), num_init_features=8, bn_size=2,
                                       num_classes=5)


def test_a_dense_block_is_cut_inside_every_layer_its_features_kept_as_side_values() -> None:
    """NOTE [side values]: in a dense block no single tensor separates two layers, yet the chain cuts inside
    every layer whose output two or more later layers read, handing the features on as side values."""
    model = _small_densenet()
    x = torch.randn(2, 3, 32, 32)
    chain = build_stage_chain(model, x, train=True)
    by_name = {n.name: n for n in chain.graph_module.graph.nodes}

    def layer(name: str) -> str:
        stack = by_name[name].meta.get("nn_module_stack") or {}
        paths = [str(v[0] if isinstance(v, tuple) else v) for v in stack.values()]
        return next((p for p in reversed(paths) if ".denselayer" in p and p.count(".") == 2), "")

    cut_in = {layer(b) for b in chain.boundaries} - {""}
    expected = {f"features.denseblock{b}.denselayer{i}" for b, count in ((1, 4), (2, 3)) for i in range(1, count)}
    assert cut_in == expected  # every layer but each block's last (whose input only the last layer reads)
    side_layers = {layer(v) for v in chain.side_values} - {""}
    # Features two or more later layers read: layers 1..L-2 of each block (and each block's input).
    assert side_layers == {f"features.denseblock{b}.denselayer{i}" for b, count in ((1, 4), (2, 3))
                           for i in range(1, count - 1)}
    assert not set(chain.side_values) & set(chain.boundaries)


def test_a_dense_chain_checkpointed_everywhere_trains_bit_equal() -> None:
    """Every boundary of the dense chain kept (every segment one stage re-run with the features it reads):
    the loss and every gradient equal the unmodified model's."""
    model = _small_densenet()
    x = torch.randn(2, 3, 32, 32)
    chain = build_stage_chain(copy.deepcopy(model), x, train=True)
    torch.manual_seed(1)
    model(x).square().sum().backward()
    torch.manual_seed(1)
    chain.run(x, tuple(range(1, chain.num_stages))).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), chain.model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_darts_like_cells_have_no_side_values() -> None:
    """A cell output that the next two cells read is an ordinary activation, even where those two are the
    last cells (the dense rule needs a dense container)."""
    from tests.utils.nas_cell import nas_net

    chain = build_stage_chain(nas_net(cells=5), torch.randn(2, 3, 16, 16), train=True)
    assert chain.side_values == ()
