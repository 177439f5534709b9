"""apply(): a checkpointed training step is bit-identical to the unmodified model's (CPU), and nothing
the user relies on (parameters, state_dict keys, optimizers, eval/no_grad behaviour) changes."""

from __future__ import annotations

import copy
import inspect
import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torchvision
from torch import nn

from remat.client.apply_plan import applied_chain, applied_plan, apply, remove
from remat.client.errors import PlanMismatchError
from remat.client.graph.built_model import key_for_model
from remat.client.graph.stage_graph import StageChain
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey

SHAPE = (2, 3, 64, 64)


def _plan(num_stages: int, checkpoints: tuple[int, ...], key: PlanKey | None = None) -> Plan:
    return Plan(
        algorithm="test",
        cost_model="classic",
        checkpoints=checkpoints,
        predicted_peak_bytes=0,
        baseline_peak_bytes=0,
        num_stages=num_stages,
        extra={"key": key.to_dict()} if key is not None else {},
    )


def _step(model: nn.Module, x: torch.Tensor, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def _assert_same_step(model: nn.Module, ref: nn.Module, x: torch.Tensor) -> None:
    """One training step on both: loss, every gradient and every buffer bit-identical."""
    assert torch.equal(_step(model, x), _step(ref, x))
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    assert all(g is not None and torch.equal(g, h) for g, h in grads)
    # BatchNorm running stats (and num_batches_tracked) end the step as without checkpointing.
    buffers = list(zip(model.named_buffers(), ref.named_buffers(), strict=True))
    differing = [name for (name, b), (_, c) in buffers if not torch.equal(b, c)]
    assert not differing, differing


@pytest.fixture(scope="module")
def resnet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _applied_resnet(resnet: nn.Module, checkpoints: tuple[int, ...] = (3, 7, 10)) -> tuple[nn.Module, nn.Module]:
    model, ref = copy.deepcopy(resnet), copy.deepcopy(resnet)
    key = key_for_model(model, SHAPE)
    assert apply(model, _plan(14, checkpoints, key)) is model
    return model, ref


def test_resnet_step_is_bit_identical(resnet: nn.Module) -> None:
    model, ref = _applied_resnet(resnet)
    chain = applied_chain(model)
    assert chain is not None and chain.num_stages == 14
    calls = []
    for st in chain._stages:  # make sure the checkpointed path is what ran
        st.call = _counted(st.call, calls)  # what runs a stage (stage_chain.stage_entry)
    _assert_same_step(model, ref, torch.randn(SHAPE))
    # 14 stages on the forward plus the recomputed stages 1..10 of the three checkpointed segments.
    assert len(calls) == 14 + 10


def test_vgg_dropout_in_checkpointed_segments_is_bit_identical() -> None:
    torch.manual_seed(0)
    model = torchvision.models.vgg11(num_classes=10)
    # The same classifier structure (Linear, ReLU, Dropout ×2, Linear) at a width a CPU test can afford.
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(
        nn.Linear(512, 64), nn.ReLU(True), nn.Dropout(), nn.Linear(64, 64), nn.ReLU(True), nn.Dropout(),
        nn.Linear(64, 10),
    )
    ref = copy.deepcopy(model)
    key = key_for_model(model, SHAPE)
    n = 20
    plan = _plan(n, (n // 2, n - 1), key)
    apply(model, plan)
    chain = applied_chain(model)
    assert chain is not None and chain.num_stages == n
    # Both classifier dropouts sit in the checkpointed segment n//2+1 .. n-1, not in the last one.
    dropout_stages = [i for i, nodes in enumerate(chain.stage_nodes, 1) for node in nodes if "classifier_2" in node
                      or "classifier_5" in node]
    assert len(dropout_stages) == 2 and all(n // 2 < i < n for i in dropout_stages), chain.stage_nodes
    x = torch.randn(SHAPE)
    with torch.no_grad():  # dropout is really on: other seeds, other outputs
        assert not torch.equal(ref(x), ref(x))
    _assert_same_step(model, ref, x)


def test_eval_and_no_grad_run_the_original_forward(resnet: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    model, ref = _applied_resnet(resnet)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the stage chain ran")

    monkeypatch.setattr(StageChain, "run", refuse)
    x = torch.randn(SHAPE)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))  # train mode, no grad: BN stats updated once, as in ref
    model.eval()
    ref.eval()
    assert torch.equal(model(x), ref(x))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), ref.buffers(), strict=True))


def test_parameters_optimizer_and_state_dict_are_the_originals(resnet: nn.Module) -> None:
    model = copy.deepcopy(resnet)
    ref = copy.deepcopy(resnet)
    keys = list(model.state_dict())
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before apply
    apply(model, _plan(14, (5, 9), key_for_model(model, SHAPE)))
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    assert list(model.state_dict()) == keys
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    x = torch.randn(SHAPE)
    for _ in range(2):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        _assert_same_step(model, ref, x)
        optimizer.step()
        ref_optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    # A checkpoint saved from the applied model loads into a plain one, and back.
    plain = copy.deepcopy(resnet)
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    assert applied_plan(model) is not None
    assert remove(model) is model and applied_plan(model) is None and "forward" not in vars(model)


def test_a_pickled_applied_model_loads_with_its_plan_and_trains_identically(resnet: nn.Module) -> None:
    """``torch.save(model)`` of an applied model: its chains do not pickle (fx graph modules); it used to fail.
    The loaded model keeps the plan and cuts its chain again at its first training call."""
    model, ref = _applied_resnet(resnet)
    _assert_same_step(model, ref, torch.randn(SHAPE))  # the chain exists when it is saved
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert applied_plan(loaded) == applied_plan(model) and applied_chain(loaded) is None
    assert loaded.forward.__self__ is loaded
    for p, q in zip(loaded.parameters(), ref.parameters(), strict=True):
        p.grad, q.grad = None, None
    _assert_same_step(loaded, ref, torch.randn(SHAPE))
    chain = applied_chain(loaded)
    assert chain is not None and chain.num_stages == 14


def test_the_applied_forward_has_the_models_signature(resnet: nn.Module) -> None:
    """Tools read ``inspect.signature(model.forward)``: transformers' Trainer keeps the dataset columns it names
    (of ``(*args, **kwargs)``, none)."""
    model, _ = _applied_resnet(resnet)
    assert inspect.signature(model.forward) == inspect.signature(copy.deepcopy(resnet).forward)
    assert list(inspect.signature(model.forward).parameters) == ["x"]


def test_mismatched_plans_are_refused(resnet: nn.Module) -> None:
    model = copy.deepcopy(resnet)
    key = key_for_model(model, SHAPE)
    other = copy.deepcopy(resnet)
    other.fc = nn.Linear(512, 11)
    with pytest.raises(PlanMismatchError, match="model_hash"):
        apply(other, _plan(14, (5,), key))
    with pytest.raises(PlanMismatchError, match="torch_version"):
        apply(model, _plan(14, (5,), PlanKey(**{**key.to_dict(), "torch_version": "1.13"})))
    with pytest.raises(PlanMismatchError, match="14 stages"):
        apply(model, _plan(9, (5,), key))
    with pytest.raises(PlanMismatchError, match="14 stages"):
        apply(model, _plan(9, (5,), key), strict=False)  # boundary indices would mean other cuts
    assert applied_plan(model) is None

    # The input signature is checked at the first training call.
    apply(model, _plan(14, (5,), key))
    with pytest.raises(PlanMismatchError, match=r"input_shape: plan \[2, 3, 64, 64\] vs input \[4, 3, 64, 64\]"):
        model(torch.randn(4, 3, 64, 64))
    apply(model, _plan(14, (5,), key), strict=False)
    model(torch.randn(4, 3, 64, 64)).sum().backward()


def test_precision_is_checked_at_the_first_training_call(resnet: nn.Module) -> None:
    model, ref = copy.deepcopy(resnet), copy.deepcopy(resnet)
    key = key_for_model(model, SHAPE, dtype="autocast_bfloat16")
    apply(model, _plan(14, (3, 7, 10), key))
    x = torch.randn(SHAPE)
    with pytest.raises(PlanMismatchError, match=r"dtype: plan autocast_bfloat16 vs this call's float32 \(the plan was "
                                                 r"made under autocast: train under the same autocast"):
        model(x)
    apply(model, _plan(14, (3, 7, 10), key))
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(
            PlanMismatchError, match=r"autocast_float16 \(the loop trains under autocast: call checkpoint\(\) inside "
                                     r"the same torch.autocast, or, with accelerate's mixed precision, inside "
                                     r"`with accelerator.autocast\(\):`, to plan for autocast_float16\)$"):
        model(x)
    # Under the plan's own autocast the step equals the unmodified model's: the recompute re-enters autocast.
    apply(model, _plan(14, (3, 7, 10), key))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same_step(model, ref, x)

    plain = copy.deepcopy(resnet)
    apply(plain, _plan(14, (5,), key_for_model(plain, SHAPE)))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(PlanMismatchError, match="float32 vs"):
        plain(x)


def test_plan_without_key_builds_at_first_training_call(resnet: nn.Module) -> None:
    model, ref = copy.deepcopy(resnet), copy.deepcopy(resnet)
    apply(model, _plan(14, (4, 8)))
    assert applied_chain(model) is None
    _assert_same_step(model, ref, torch.randn(SHAPE))
    assert applied_chain(model) is not None

    wrong = copy.deepcopy(resnet)
    apply(wrong, _plan(13, (4, 8)))
    with pytest.raises(PlanMismatchError, match="14 stages"):
        wrong(torch.randn(SHAPE))


def test_unsupported_call_signature_warns_instead_of_silently_skipping_the_plan(resnet: nn.Module) -> None:
    model, _ = _applied_resnet(resnet)
    with pytest.warns(RuntimeWarning, match="ran without checkpointing") as warned:
        model(x=torch.randn(SHAPE)).sum().backward()
    assert warned[0].filename == __file__  # the warning names the line that called the model
    assert applied_chain(model) is not None  # the plan is still applied for ordinary calls


@pytest.fixture
def deterministic_cuda() -> Iterator[None]:
    """cuDNN's default weight-gradient kernels accumulate with atomics, so two identical steps differ in the
    last bits (seen on an H100: 19 of conv1's 9408 weight gradients off by up to 5e-5). With deterministic
    kernels and without TF32 the recompute must reproduce the reference exactly."""
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
         torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) = saved


@pytest.mark.cuda
def test_cuda_step_matches(resnet: nn.Module, deterministic_cuda: None) -> None:
    model, ref = copy.deepcopy(resnet).cuda(), copy.deepcopy(resnet).cuda()
    key = key_for_model(model, SHAPE)
    assert key.device == "cuda"
    apply(model, _plan(14, (3, 7, 10), key))
    x = torch.randn(SHAPE, device="cuda")
    torch.testing.assert_close(_step(model, x), _step(ref, x), rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    for b, c in zip(model.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=0, atol=0)
    with pytest.raises(PlanMismatchError, match="device: plan cuda vs input cpu"):
        apply(model.cpu(), _plan(14, (3,), key))(torch.randn(SHAPE))


def test_shufflenet_boundaries_carry_one_tensor_and_train_identically() -> None:
    """Its channel split makes a tuple an articulation node of the graph; no stage may end there."""
    from remat.client.graph.stage_graph import build_stage_chain

    torch.manual_seed(0)
    model = torchvision.models.shufflenet_v2_x0_5(num_classes=10)
    ref, probe = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(SHAPE)
    chain = build_stage_chain(probe, x, train=True)
    value = x
    for i in range(1, chain.num_stages + 1):  # every stage hands one tensor to the next
        with torch.no_grad():
            value = chain.stage(i)(value)
        assert isinstance(value, torch.Tensor), (i, chain.names[i - 1], type(value))
    n = chain.num_stages
    assert n > 10
    apply(model, _plan(n, tuple(range(2, n, 3)), key_for_model(model, SHAPE)))
    _assert_same_step(model, ref, x)


def test_a_graph_plan_for_another_op_graph_is_refused_at_the_first_training_call() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).train()
    plan = Plan(algorithm="acg", cost_model="classic", checkpoints=(), dropped_vertices=(1,), num_vertices=50,
                predicted_peak_bytes=1, baseline_peak_bytes=2, num_stages=3)
    apply(model, plan)
    with pytest.raises(PlanMismatchError, match="op graph has .* vertices, the plan's 50"):
        model(torch.randn(2, 4))


def test_a_recompute_stopping_early_costs_no_traceback(resnet: nn.Module,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ early stop through fx ]: every checkpointed segment's recompute ends in an exception; unwinding
    it through a stage must not extract a traceback (fx's ``GraphModule.__call__`` did, reading source files)."""
    import traceback

    model, _ = _applied_resnet(resnet)
    x = torch.randn(SHAPE)
    extracted: list[int] = []
    extract = traceback.StackSummary.extract

    def counting(*args: Any, **kwargs: Any) -> Any:
        extracted.append(1)
        return extract(*args, **kwargs)

    monkeypatch.setattr(traceback.StackSummary, "extract", counting)
    model(x).square().mean().backward()  # three checkpointed segments, three early stops
    assert extracted == []


def test_a_compiled_applied_model_runs_its_plan(resnet: nn.Module) -> None:
    """NOTE [ torch.compile keeps the plan ]: under torch.compile the training forward is the plan's
    checkpointed chain (stages recomputed, gradients and buffers bit-equal), with one warning."""
    torch._dynamo.reset()
    model, ref = _applied_resnet(resnet)
    chain = applied_chain(model)
    assert chain is not None
    calls: list[int] = []
    for st in chain._stages:
        st.call = _counted(st.call, calls)
    compiled = torch.compile(model)
    x = torch.randn(SHAPE)
    with pytest.warns(RuntimeWarning, match="torch.compile") as warned:
        loss = _step(compiled, x)
    assert [w.filename for w in warned if "torch.compile" in str(w.message)] == [__file__]  # the user's line
    assert torch.equal(loss, _step(ref, x))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert len(calls) == 14 + 10  # as in test_resnet_step_is_bit_identical: the checkpointed path ran


def _counted(call: Any, calls: list[int]) -> Any:
    """``call``, appending to ``calls`` each time it runs."""

    def counted(*args: Any) -> Any:
        calls.append(1)
        return call(*args)

    return counted
