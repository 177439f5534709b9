"""Measured cases that make each term found calibrating on a GPU decide the peak, on CPU's exact meter.

Each test builds a model where one term matters, checks that the profiler records it, that the prediction
matches the measured step, and that the same trace *without* the term would mispredict: so a regression in
the profiler or the model shows up as a failure, not as a silently larger error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from remat.client.planning.cost_models import peak_candidates, pytorch_peak
from remat.client.trace import Trace
from remat.worker.measure import measure_step
from remat.worker.profilers import profile
from tests.worker.torch_models import SequentialChain


def _without(trace: Trace, **fields: Any) -> Trace:
    """The same trace with some stage fields reset for every stage (what a profiler without them wrote)."""
    stages = tuple(dataclasses.replace(s, **fields) for s in trace.stages)
    return dataclasses.replace(trace, stages=stages)


def _measured(model: nn.Module, x: torch.Tensor, checkpoints: tuple[int, ...], trace: Trace, **kwargs: Any) -> int:
    chain = SequentialChain(model)
    result = measure_step(model, x, checkpoints, chain=chain, trace=trace, baseline=False, timing_repeats=0,
                          **kwargs)
    assert result.predicted_peak_bytes == pytorch_peak(trace, checkpoints)
    return result.measured_peak_bytes


def _wide_mlp() -> nn.Sequential:
    """Eight Linear(512, 512)+ReLU stages: at batch 2 the weights' bf16 copies (0.5 MiB each) dwarf activations."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(8)])


@pytest.mark.parametrize("grads", ["none", "kept"])
def test_autocast_cast_cache_decides_and_is_predicted(grads: str) -> None:
    model, x = _wide_mlp(), torch.randn(2, 512)
    trace = profile(model, x, device="cpu", grads=grads, chain=SequentialChain(model), timing_repeats=0,
                    precision="autocast_bfloat16")
    assert trace.metadata["dtype"] == "autocast_bfloat16"
    assert all(s.cast_bytes == 512 * 512 * 2 + 512 * 2 for s in trace.stages)  # weight and bias in bf16
    no_cast = _without(trace, cast_bytes=0, cast_unsaved_bytes=0)
    for checkpoints in [(), (4,), (2, 4, 6), (1, 2, 3, 4, 5, 6, 7)]:
        measured = _measured(model, x, checkpoints, trace, grads=grads, precision="autocast_bfloat16")
        assert pytorch_peak(trace, checkpoints) == pytest.approx(measured, rel=0.005), checkpoints
        if checkpoints == (1, 2, 3, 4, 5, 6, 7) and grads == "kept":
            # Every stage checkpointed: only the cast cache holds the copies, and it decides the peak.
            assert peak_candidates(trace, checkpoints)[0][1].startswith("forward of stage")
            assert pytorch_peak(no_cast, checkpoints) < 0.8 * measured


class _AddOne(nn.Module):
    """x + 1: a new tensor, and autograd saves nothing for it (a frameless stage)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1.0


def test_a_frameless_segment_keeps_no_input() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 4096), nn.ReLU()), _AddOne(), _AddOne(),
                          nn.Sequential(nn.Linear(4096, 64), nn.ReLU()), nn.Linear(64, 8))
    x = torch.randn(16, 64)
    trace = profile(model, x, device="cpu", grads="kept", chain=SequentialChain(model), timing_repeats=0)
    assert [s.saves_nothing for s in trace.stages] == [False, True, True, False, False]
    framed = _without(trace, saves_nothing=False)
    checkpoints = (1, 3)  # segment (1, 3] is the two additions: its checkpoint frame does not outlive it
    measured = _measured(model, x, checkpoints, trace, grads="kept")
    assert pytorch_peak(trace, checkpoints) == pytest.approx(measured, rel=0.005)
    assert pytorch_peak(framed, checkpoints) - measured == pytest.approx(trace.stages[0].output_bytes, rel=0.01)


class _SavesBigGradInFloat64(torch.autograd.Function):
    """Saves a tensor 8x its input; its backward returns a float64 gradient that the engine casts back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x.repeat(1, 8))
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (big,) = ctx.saved_tensors
        del big  # unpacked and unused: a recomputed node's copy dies here, a plain node's stays saved
        return grad.double()  # the engine casts this back to float32 after backward() returns


class _CastInValidate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SavesBigGradInFloat64.apply(x)


def test_a_recomputed_stage_frees_its_saved_tensors_before_the_engine_casts_its_gradient() -> None:
    # The engine's validate_outputs casts the float64 gradient to float32 after backward() returns: a plain
    # node still holds its saved tensor then, a recomputed node (saved tensors unpacked into locals) does not.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), _CastInValidate(), nn.Linear(256, 16))
    x = torch.randn(64, 256)
    trace = profile(model, x, device="cpu", grads="kept", chain=SequentialChain(model), timing_repeats=0)
    stage = trace.stages[1]
    assert 0 < stage.recomputed_backward_peak_bytes < stage.backward_peak_bytes
    plain_backward = _without(trace, recomputed_backward_peak_bytes=0)
    checkpoints = (1, 2)  # stage 2 alone in a recomputed segment
    measured = _measured(model, x, checkpoints, trace, grads="kept")
    assert pytorch_peak(trace, checkpoints) == pytest.approx(measured, rel=0.005)
    assert pytorch_peak(plain_backward, checkpoints) > 1.05 * measured
    assert pytorch_peak(trace, ()) == pytest.approx(_measured(model, x, (), trace, grads="kept"), rel=0.005)
