"""The backend registry: one backend per device name, and what a backend answers instead of a device branch."""

from __future__ import annotations

import re
import typing

import pytest
import torch

from remat.client.devices import DEVICES, QUEUE_PATTERN, queue_device
from remat.client.errors import ModelError
from remat.client.graph import built_model
from remat.client.graph.write_probe import preserved_state
from remat.client.request import ModelRequest
from remat.worker.profilers import BACKENDS, Backend, backend_for
from remat.worker.profilers.cpu import CpuBackend
from remat.worker.profilers.cuda import CudaBackend


def test_every_device_name_has_a_backend_and_every_backend_a_device_name() -> None:
    assert tuple(BACKENDS) == DEVICES
    for name, backend in BACKENDS.items():
        assert issubclass(backend, Backend) and backend.name == name


def test_the_service_schemas_and_the_cli_take_exactly_the_device_names() -> None:
    from remat.client.cli_common import model_options
    from remat.service.schemas import JobCreate, ZooCreate

    for schema in (JobCreate, ZooCreate):
        assert typing.get_args(schema.model_fields["device"].annotation) == DEVICES

    command = model_options(lambda **_: None)
    (option,) = [p for p in command.__click_params__ if p.name == "device"]
    assert tuple(option.type.choices) == DEVICES


@pytest.mark.parametrize("queue, device", [("cpu", "cpu"), ("cuda", "cuda"), ("cuda-h100", "cuda")])
def test_a_queue_names_its_device(queue: str, device: str) -> None:
    assert re.fullmatch(QUEUE_PATTERN, queue) and queue_device(queue) == device


@pytest.mark.parametrize("queue", ["plan", "gpu", "cud", "cuda-", "cuda-H100", "-cpu"])
def test_other_queues_are_not_profiling_queues(queue: str) -> None:
    assert not re.fullmatch(QUEUE_PATTERN, queue)


def test_backend_for_an_unknown_device_lists_the_known_ones() -> None:
    known = " or ".join(DEVICES)  # "cpu or cuda"
    with pytest.raises(ValueError, match=rf"^remat profiler: device 'meta' is not supported; use {known}$"):
        backend_for("meta")


def test_backend_for_cuda_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^remat profiler: device 'cuda' asked for, but torch sees no CUDA "
                                         r"device$"):
        backend_for("cuda:0")


def test_building_on_cuda_without_a_gpu_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    request = ModelRequest(spec="resnet18", batch_size=2, sample_shape=(3, 32, 32), device="cuda")
    with pytest.raises(ModelError, match=r"^--device cuda: torch sees no CUDA device on this machine$"):
        built_model.build(request)


def test_fit_has_no_meaning_on_cpu() -> None:
    request = ModelRequest(spec="resnet18", batch_size=2, sample_shape=(3, 32, 32), device="cpu")
    assert built_model.fit_bytes_for(request) is None


def test_the_cpu_backend_has_no_allocator_readings() -> None:
    backend = backend_for("cpu:0")
    assert isinstance(backend, CpuBackend) and backend.device == torch.device("cpu")
    assert (backend.reserved_bytes(), backend.peak_reserved_bytes(), backend.requested_bytes("peak")) == (None,) * 3
    assert backend.rng_devices == () and backend.device_rng_state() is None
    assert not (backend.warm_up_first or backend.meter_counts_resident or backend.fixed_memory)
    with pytest.raises(NotImplementedError):
        backend.capacity_bytes()


def test_the_cuda_backend_is_the_caching_allocator() -> None:
    # Class-level answers only: asking for readings needs a GPU (tests/worker/test_profilers.py's cuda tests).
    assert CudaBackend.warm_up_first and CudaBackend.meter_counts_resident
    assert CudaBackend.fixed_memory


@pytest.mark.parametrize("devices", [[], [torch.device("cpu")], [torch.device("meta")]])
def test_preserved_state_restores_the_cpu_rng_whatever_devices_it_is_given(devices: list[torch.device]) -> None:
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with preserved_state(model, devices=devices):
        torch.rand(100)
    assert torch.equal(torch.rand(4), expected)
