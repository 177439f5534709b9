"""A one-tensor call of a model whose forward has more parameters, left at their defaults (timm's ViT:
``forward(x, attn_mask=None, is_causal=False)``): traced holding the defaults, cut into a chain, and trained
bit-equal to the unmodified model. Traced as proxies, ``if attn_mask is not None`` took the branch no such call
takes, and the chain was refused ("forward takes 3 inputs; the example gives 1")."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import remat.client
from remat.client.apply_plan import applied_plan
from remat.client.graph import fx_trace
from remat.client.graph.stage_graph import build_stage_chain


class _OptionalMask(nn.Module):
    """Blocks with dropout whose forward takes a mask and a flag it only reads when they are given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Tanh()) for _ in range(5))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, flip: bool = False,
                *, scale: float = 2.0) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if mask is not None:
                x = x * mask
        if flip:
            x = -x
        return self.head(x * scale)


def _grads_after_step(model: nn.Module, run: object, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(3)
    loss = run(x).square().sum()  # type: ignore[operator]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_the_forwards_defaults_are_held_as_constants() -> None:
    model = _OptionalMask()
    assert fx_trace.call_defaults(model) == {"mask": None, "flip": False, "scale": 2.0}
    gm = fx_trace.trace_model(model)
    defaults = {n.target: n.args[0] for n in gm.graph.nodes if n.op == "placeholder" and n.args}
    assert list(defaults.values()) == [None, False, 2.0]


def test_a_one_tensor_call_is_cut_and_trains_bit_equal_at_every_boundary() -> None:
    model = _OptionalMask()
    x = torch.randn(4, 16)
    chain = build_stage_chain(copy.deepcopy(model), x, train=True)
    assert chain.num_stages >= 5, chain.names
    expected = _grads_after_step(model, model, x)
    everywhere = tuple(range(1, chain.num_stages))
    got = _grads_after_step(chain.model, lambda v: chain.run(v, everywhere), x)
    assert torch.equal(expected[0], got[0])
    for a, b in zip(expected[1], got[1], strict=True):
        assert torch.equal(a, b)
    for i in range(1, chain.num_stages + 1):  # the profiler's path: one stage at a time, on the same call
        chain.bind_inputs(x)
        assert callable(chain.stage(i))


def test_timm_vit_plans_and_trains_like_the_unmodified_model(cache_dir: Path) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, embed_dim=32,
                                  num_heads=2, drop_rate=0.1, proj_drop_rate=0.1, num_classes=5)
    planned = copy.deepcopy(reference)
    x = torch.randn(2, 3, 32, 32)
    assert remat.client.checkpoint(planned, x, grads="kept", cache_dir=cache_dir) is planned
    plan = applied_plan(planned)
    assert plan is not None and plan.checkpoints, "the test needs a plan that recomputes something"
    reference.train()
    planned.train()
    expected = _grads_after_step(reference, reference, x)
    got = _grads_after_step(planned, planned, x)
    assert torch.equal(expected[0], got[0])
    for a, b in zip(expected[1], got[1], strict=True):
        assert torch.equal(a, b)
