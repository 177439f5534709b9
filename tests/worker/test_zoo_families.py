"""Every torchvision family, end to end: trace, profile, plan, apply, one training step bit-identical.

The registry-wide check (``-m zoo``) is not in the default run, so without this module a change to the stage
cutter, the profiler or ``apply`` could break a whole architecture family (attention windows, channel
shuffles, squeeze-excitation, auxiliary heads, stochastic depth…) and the default run would stay green.
Here one representative per family goes through the real path — ``build_stage_chain`` → ``profile`` →
``make_plan(trace, "linear")`` → ``remat.client.apply`` on a copy — and one training step of the applied
model must equal the unmodified model's exactly (CPU is deterministic): the loss, every parameter gradient
and every buffer (BatchNorm running stats, ``num_batches_tracked``), with dropout and stochastic depth
drawing the same numbers under the same seed.

Cost decides the sizes: the whole default suite must stay well under 15 minutes on a 2-core machine. Batch
2 (the smallest BatchNorm trains on) and 32 px, or 64 px where the model needs it or linear would keep
nothing at 32. Each family uses its cheapest
registered member through ``resolve_model`` unless that member alone costs several seconds for nothing
architectural; then it is torchvision's own class of that family with fewer or narrower blocks — the same
modules and forward code, so the same graph patterns for the cutter: Wide ResNet, EfficientNet v2, ViT and
MaxViT (whose registered member trains only at 224 px). AlexNet and VGG keep their feature stacks and get a
classifier of the same structure (dropouts included) 64 wide: the registered 4096-wide heads hold
60-120M parameters. Inception v3 stays at 299 px, the only size its auxiliary head trains at.

The module runs on one intra-op thread: at these sizes a second thread gains little, and when anything else
is busy on a 2-core machine, OpenMP's spinning workers slow every op by a scheduler slice (measured here with
one other busy process: 664 s for this module on 2 threads, 68 s on 1).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torchvision.models import efficientnet, maxvit, resnet, vision_transformer

from remat.client.apply_plan import applied_chain, apply
from remat.client.graph.built_model import key_for_model
from remat.client.graph.stage_graph import build_stage_chain
from remat.client.model_output import output_tensors
from remat.client.planning.plans import make_plan
from remat.client.zoo import resolve_model
from remat.worker.measure import make_loss
from remat.worker.profilers import profile

pytestmark = pytest.mark.slow

NUM_CLASSES = 10
BATCH = 2  # the smallest batch BatchNorm trains on


@dataclass(frozen=True)
class Family:
    """One family's representative: how to build it and the input side length it trains at."""

    model: str
    """The registered model it stands for (the test id)."""
    build: Callable[[], nn.Module]
    size: int = 32
    outputs: int = 1
    """Tensors it returns in train mode: the main logits, then any auxiliary heads' (all in the loss)."""
    hand_plan: bool = False
    """linear keeps nothing for it (checked): checkpoint every other stage instead, so checkpointing runs."""


def _zoo(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return partial(resolve_model, name, num_classes=NUM_CLASSES, **kwargs)


def _narrow_classifier(name: str, in_features: int, width: int = 64) -> Callable[[], nn.Module]:
    """AlexNet / VGG from the zoo with their classifier (Dropout, Linear, ReLU ×2, Linear) ``width`` wide."""

    def build() -> nn.Module:
        model = resolve_model(name, num_classes=NUM_CLASSES)
        dropout_first = isinstance(model.classifier[0], nn.Dropout)  # AlexNet: Dropout first; VGG: Linear first
        layers: list[nn.Module] = []
        for a, b in ((in_features, width), (width, width)):
            linear, relu, dropout = nn.Linear(a, b), nn.ReLU(inplace=True), nn.Dropout(0.5)
            layers += [dropout, linear, relu] if dropout_first else [linear, relu, dropout]
        model.classifier = nn.Sequential(*layers, nn.Linear(width, NUM_CLASSES))
        return model

    return build


def _wide_resnet() -> nn.Module:
    """wide_resnet50_2's bottlenecks (twice the inner width), one per stage instead of 3-4-6-3."""
    return resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=NUM_CLASSES, width_per_group=128)


def _efficientnet_v2() -> nn.Module:
    """efficientnet_v2_s's Fused-MBConv and MBConv stages, fewer and narrower."""
    setting = [
        efficientnet.FusedMBConvConfig(1, 3, 1, 16, 16, 2),
        efficientnet.FusedMBConvConfig(4, 3, 2, 16, 24, 1),
        efficientnet.MBConvConfig(4, 3, 2, 24, 32, 2, 1.0, 1.0),
    ]
    return efficientnet.EfficientNet(setting, dropout=0.2, stochastic_depth_prob=0.2, num_classes=NUM_CLASSES,
                                     norm_layer=partial(nn.BatchNorm2d, eps=1e-3), last_channel=64)


def _vit() -> nn.Module:
    """A two-layer ViT; dropout on, so the recompute must replay its random numbers."""
    model = vision_transformer.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, dropout=0.1, num_classes=NUM_CLASSES)
    # torchvision zero-initialises the head: every gradient below it would be exactly 0 and equal anyway.
    nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


def _maxvit() -> nn.Module:
    """maxvit_t's MBConv + block/grid attention layers with 4×4 partitions, so that 32 px divides."""
    return maxvit.MaxVit(input_size=(32, 32), stem_channels=16, partition_size=4, block_channels=[16, 32],
                         block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.2, num_classes=NUM_CLASSES)


FAMILIES = [
    # AlexNet's pools need 63 px or more, and linear keeps none of its boundaries (64-128 px tried).
    Family("alexnet", _narrow_classifier("alexnet", 256 * 6 * 6), size=64, hand_plan=True),
    Family("vgg11", _narrow_classifier("vgg11", 512 * 7 * 7), size=64),  # at 32 px linear keeps nothing
    Family("resnet18", _zoo("resnet18"), size=64),  # at 32 px linear keeps nothing
    Family("resnext50_32x4d", _zoo("resnext50_32x4d")),
    Family("wide_resnet50_2", _wide_resnet),
    Family("densenet121", _zoo("densenet121")),
    Family("squeezenet1_1", _zoo("squeezenet1_1")),
    Family("googlenet", _zoo("googlenet"), outputs=3),  # GoogLeNetOutputs(logits, aux_logits2, aux_logits1)
    # InceptionOutputs(logits, aux_logits); the aux head needs a 17×17 map, so 299 px only (the costliest case).
    Family("inception_v3", _zoo("inception_v3"), size=299, outputs=2),
    Family("shufflenet_v2_x0_5", _zoo("shufflenet_v2_x0_5")),
    Family("mobilenet_v2", _zoo("mobilenet_v2", width_mult=0.5)),
    Family("mobilenet_v3_small", _zoo("mobilenet_v3_small")),
    Family("mnasnet0_5", _zoo("mnasnet0_5")),
    Family("efficientnet_b0", _zoo("efficientnet_b0")),
    Family("efficientnet_v2_s", _efficientnet_v2),
    Family("regnet_x_400mf", _zoo("regnet_x_400mf")),
    Family("regnet_y_400mf", _zoo("regnet_y_400mf")),
    Family("convnext_tiny", _zoo("convnext_tiny")),
    Family("swin_t", _zoo("swin_t")),
    Family("swin_v2_t", _zoo("swin_v2_t")),
    Family("vit_b_16", _vit),  # vit_b_16 itself: 86M parameters, and at 32 px linear keeps nothing
    Family("maxvit_t", _maxvit),  # maxvit_t itself: 7×7 partitions, so 224 px only (~25 s on CPU)
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _step(model: nn.Module, x: torch.Tensor, outputs: int) -> torch.Tensor:
    """One training step (no optimizer) under remat's measured loss: cross-entropy on the main output plus
    0.3 × each auxiliary one, so gradients flow through the auxiliary heads as in real training."""
    torch.manual_seed(1)  # dropout / stochastic depth draw the same numbers in both models
    y = model(x)
    assert len(output_tensors(y)) == outputs
    loss = make_loss(y, seed=0)(y)  # labels from its own generator: the same for both models
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_family_trains_identically_under_its_linear_plan(family: Family) -> None:
    torch.manual_seed(0)
    model = family.build()
    shape = (BATCH, 3, family.size, family.size)
    x = torch.randn(shape)

    chain = build_stage_chain(model, x, train=True)
    n = chain.num_stages
    assert n > 1, f"{family.model} was not cut ({chain.source})"
    trace = profile(model, x, device="cpu", grads="none", chain=chain, timing_repeats=0)
    assert trace.num_stages == n
    plan = make_plan(trace, "linear", cost_model="pytorch")
    if family.hand_plan:
        assert not plan.checkpoints, f"linear now keeps {plan.checkpoints}: drop hand_plan for {family.model}"
    checkpoints = tuple(range(2, n, 2)) if family.hand_plan else plan.checkpoints
    assert checkpoints or n < 3, f"linear keeps no boundary of {family.model}'s {n} stages: nothing would recompute"
    key = key_for_model(model, shape, graph=chain.graph_module)
    plan = dataclasses.replace(plan, checkpoints=checkpoints, extra={"key": key.to_dict()})

    ref = copy.deepcopy(model)
    applied = apply(copy.deepcopy(model), plan)
    applied_stages = applied_chain(applied)
    assert applied_stages is not None and applied_stages.num_stages == n
    calls: list[int] = []
    for st in applied_stages._stages:
        st.call = _counted(st.call, calls)  # what runs a stage (stage_chain.stage_entry)

    assert torch.equal(_step(applied, x, family.outputs), _step(ref, x, family.outputs))
    if checkpoints:
        assert len(calls) > n, "no stage was recomputed: the checkpointed path did not run"
    params = list(zip(applied.named_parameters(), ref.named_parameters(), strict=True))
    missing = [name for (name, p), _ in params if p.grad is None]
    assert not missing, missing
    # The gradient reaches the first stage: equality of all-zero gradients would prove nothing.
    names = {id(p): name for name, p in model.named_parameters()}
    first_used = next(ps for ps in map(chain.stage_parameters, range(1, n + 1)) if ps)
    first = [names[id(p)] for p in first_used]
    grads = {name: p.grad for name, p in ref.named_parameters()}
    assert any(grads[name].count_nonzero() for name in first), f"no gradient reaches {first}"
    differing = [name for (name, p), (_, q) in params if not torch.equal(p.grad, q.grad)]
    assert not differing, differing
    buffers = list(zip(applied.named_buffers(), ref.named_buffers(), strict=True))
    differing = [name for (name, b), (_, c) in buffers if not torch.equal(b, c)]
    assert not differing, differing


def _counted(call: Any, calls: list[int]) -> Any:
    """``call``, appending to ``calls`` each time it runs."""

    def counted(*args: Any) -> Any:
        calls.append(1)
        return call(*args)

    return counted
