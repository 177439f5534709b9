"""Profiler: exact fields on a hand-checkable model, state left untouched, and the oracle test.

The oracle: for several plans, the ``pytorch`` cost model's prediction from the profiled trace must match
the memory measured on a real checkpointed training step of the same model.
"""

from __future__ import annotations

import pytest
import torch

from remat.client.planning.cost_models import pytorch_peak
from remat.client.trace import parse_trace
from remat.worker.measure import measure_step
from remat.worker.profilers import profile
from tests.worker.torch_models import SequentialChain, mlp, small_resnet

F32 = 4


def _profile(model: torch.nn.Module, x: torch.Tensor, grads: str, **kwargs: object):
    return profile(model, x, device="cpu", grads=grads, chain=SequentialChain(model), **kwargs)


@pytest.mark.parametrize("grads", ["none", "kept"])
def test_mlp_fields_by_hand(grads: str) -> None:
    model = mlp()  # Linear(8, 16) -> ReLU -> Linear(16, 4), batch 4
    trace = _profile(model, torch.randn(4, 8), grads, timing_repeats=0)
    s1, s2, s3 = trace.stages
    assert trace.input_bytes == 4 * 8 * F32
    assert [s.output_bytes for s in trace.stages] == [4 * 16 * F32, 4 * 16 * F32, 4 * 4 * F32]
    # addmm saves its input (x_0 for stage 1, x_2 for stage 3); relu saves its result; weights are excluded.
    assert [s.saved_bytes for s in trace.stages] == [0, 0, 0]
    assert (s1.saves_input, s1.saves_output) == (True, False)
    assert (s2.saves_input, s2.saves_output) == (False, True)
    assert (s3.saves_input, s3.saves_output) == (True, False)
    assert [s.forward_peak_bytes for s in trace.stages] == [256, 256, 64]
    # addmm packs its input and weight before it runs, so a recompute ending there stops before the output.
    assert (s1.recompute_peak_bytes, s2.recompute_peak_bytes, s3.recompute_peak_bytes) == (0, 256, 0)
    w1, w3 = (8 * 16 + 16) * F32, (16 * 4 + 4) * F32
    assert [s.param_grad_bytes for s in trace.stages] == ([w1, 0, w3] if grads == "none" else [0, 0, 0])
    # Backward footprints (+4: the engine's scalar gradient of the loss):
    # stage 1: grad out 256 + weight/bias grads (no input grad: x_0 does not require grad);
    # stage 2: saved output 256 + grad out 256 + grad in 256; stage 3: grad out 64 + grad in 256 + grads.
    assert [s.backward_peak_bytes for s in trace.stages] == [256 + w1 + 4, 3 * 256 + 4, 64 + 256 + w3 + 4]
    assert trace.metadata["grads"] == grads
    assert trace.metadata["mode"] == "train"
    assert trace.metadata["batch_size"] == 4 and trace.metadata["input_shape"] == [4, 8]
    assert parse_trace(trace.to_dict()) == trace


def test_parameter_shared_by_two_stages_is_booked_once_in_the_later_stage() -> None:
    lin = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(lin, torch.nn.Tanh(), lin)
    trace = _profile(model, torch.randn(2, 8), "none", timing_repeats=0)
    assert [s.param_grad_bytes for s in trace.stages] == [0, 0, (64 + 8) * F32]


def test_profiling_leaves_the_model_unchanged() -> None:
    model = small_resnet(width=4, blocks=1)
    x = torch.randn(2, 3, 16, 16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    rng = torch.get_rng_state()
    trace = _profile(model, x, "kept", timing_repeats=1)
    assert not model.training
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert trace.has_times and all(s.backward_ms is not None for s in trace.stages)


def test_boundary_storage_is_flagged_not_double_counted() -> None:
    # Each BasicBlock ends in an in-place ReLU that saves its result (the block output) and starts with a
    # conv that saves its input: the same storage, flagged on both sides and left out of saved_bytes.
    model = small_resnet(width=4, blocks=2)
    trace = _profile(model, torch.randn(2, 3, 16, 16), "none", timing_repeats=0)
    blocks = trace.stages[1:3]
    for s in blocks:
        assert s.saves_input and s.saves_output
        # interior: conv1 out, bn1 out (relu'd in place, saved once), conv2 out, bn2's stats and the like.
        assert s.saved_bytes < 5 * s.output_bytes


@pytest.mark.slow
@pytest.mark.parametrize("grads", ["none", "kept"])
def test_oracle_predictions_match_measured_steps(grads: str) -> None:
    model = small_resnet(width=8, blocks=3)  # 9 stages
    x = torch.randn(4, 3, 32, 32)
    chain = SequentialChain(model)
    trace = profile(model, x, device="cpu", grads=grads, chain=chain, timing_repeats=0)
    n = trace.num_stages
    plans = [(), (3, 6), (1, 2, 3, 4, 5, 6, 7, 8), (2, 4, 6, 8), (4,), (1, 5)]
    assert n == 9
    for checkpoints in plans:
        result = measure_step(model, x, checkpoints, grads=grads, chain=chain, trace=trace, baseline=False)
        measured = result.measured_peak_bytes
        predicted = pytorch_peak(trace, checkpoints)
        assert result.predicted_peak_bytes == predicted
        assert abs(predicted / measured - 1) < 0.005, (checkpoints, predicted, measured)


@pytest.mark.cuda
@pytest.mark.parametrize("grads", ["none", "kept"])
def test_cuda_oracle(grads: str) -> None:
    model = small_resnet(width=32, blocks=2).cuda()  # activations of ~1 MiB: allocator rounding stays small
    x = torch.randn(8, 3, 64, 64, device="cuda")
    chain = SequentialChain(model)
    trace = profile(model, x, device="cuda", grads=grads, chain=chain, timing_repeats=1)
    assert trace.metadata["device"] == "cuda" and trace.has_times
    for checkpoints in [(), (2, 4), (1, 3, 5)]:
        result = measure_step(model, x, checkpoints, grads=grads, device="cuda", chain=chain, trace=trace,
                              baseline=False)
        assert result.measured_reserved_bytes >= result.absolute_peak_bytes >= result.measured_peak_bytes
        assert abs(result.prediction_error) < 0.005, (checkpoints, result)


def _live_tensor_bytes() -> int:
    import gc
    import warnings

    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() on every live object touches deprecated module attributes
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def test_profiling_leaves_no_tensors_behind() -> None:
    # In-place ReLUs save their outputs: a pack hook returning such a tensor as itself is a reference cycle
    # through C++ that gc never frees, and every profile of a ResNet leaked its whole forward.
    model = small_resnet(width=16, blocks=2)
    x = torch.randn(4, 3, 32, 32)
    chain = SequentialChain(model)
    _profile(model, x, "kept", timing_repeats=0)  # first-call allocations (gradients) happen here
    before = _live_tensor_bytes()
    for _ in range(2):
        _profile(model, x, "kept", timing_repeats=0)
        profile(model, x, device="cpu", grads="none", chain=chain, timing_repeats=0, precision="autocast_bfloat16")
    assert _live_tensor_bytes() == before
