"""The live-storage meter on tensor programs whose memory is known to the byte (NOTE [ meter exactness ])."""

from __future__ import annotations

import torch
from torch import nn

from remat.worker.memory_meter import MemoryMeter, storage_key

KIB = 1024
MIB = 1024 * 1024


def test_alloc_and_free() -> None:
    with MemoryMeter() as meter:
        a = torch.ones(256)  # 1 KiB
        b = a * 2
        assert meter.current_bytes == 2 * KIB
        del b
    assert meter.current_bytes == KIB
    assert meter.peak_bytes == 2 * KIB
    assert meter.num_storages == 1
    del a
    assert meter.current_bytes == 0  # deaths after exit are still booked


def test_out_argument_into_empty_tensor_is_remeasured() -> None:
    # Fix 1: the out= tensor is born with 0 bytes and resized by the op.
    with MemoryMeter() as meter:
        a = torch.ones(256 * KIB)
        b = torch.add(a, 1, out=torch.empty(0))
    assert meter.current_bytes == 2 * MIB
    assert b.untyped_storage().nbytes() == MIB


def test_resize_of_a_followed_storage() -> None:
    with MemoryMeter() as meter:
        e = torch.empty(0)
        e.resize_(1000)
        assert meter.current_bytes == 4000
        e.resize_(500)  # shrinking the shape keeps the storage
        assert meter.current_bytes == 4000
        del e
    assert meter.current_bytes == 0
    assert meter.peak_bytes == 4000


def test_growth_of_a_storage_born_before_the_meter_is_new_memory() -> None:
    pre = torch.empty(10)
    with MemoryMeter() as meter:
        pre.resize_(110)
    assert meter.current_bytes == 400
    del pre
    assert meter.current_bytes == 0


def test_views_and_inplace_ops_are_not_new() -> None:
    with MemoryMeter() as meter:
        a = torch.ones(16, 16)
        views = [a.view(256), a[3:], a.t(), a.as_strided((4,), (2,)), a.unsqueeze(0), a.reshape(256)]
        a.add_(1)
        a.relu_()
        assert meter.current_bytes == 1 * KIB
        del a
        assert meter.current_bytes == 1 * KIB  # the views keep the storage alive
        del views
        assert meter.current_bytes == 0


def test_unannotated_alias_of_a_preexisting_storage_is_not_new() -> None:
    # Fix 2: _unsafe_view has no alias annotation but returns the input's storage.
    x = torch.ones(100)
    with MemoryMeter() as meter:
        v = torch.ops.aten._unsafe_view(x, [10, 10])
        w = x.view(4, 25)
    assert storage_key(v) == storage_key(x) == storage_key(w)
    assert meter.current_bytes == 0


def test_set_to_another_storage() -> None:
    src = torch.ones(100)
    with MemoryMeter() as meter:
        e = torch.empty(0)
        e.set_(src)  # now shares a storage born before the meter: nothing new
        assert meter.current_bytes == 0
        f = torch.ones(50)
        g = torch.empty(0)
        g.set_(f)
        assert meter.current_bytes == 200
    assert storage_key(e) == storage_key(src)


def test_peak_reset_and_baseline() -> None:
    with MemoryMeter() as meter:
        a = torch.ones(1024)  # 4 KiB
        tmp = torch.ones(2048)
        del tmp
        assert meter.peak_bytes == 12 * KIB
        assert meter.mark_baseline() == 4 * KIB
        assert meter.peak_bytes == 4 * KIB
        b = a + 1
        c = b + 1
        del b
        assert meter.peak_above_baseline == 8 * KIB
        assert meter.current_above_baseline == 4 * KIB
        meter.reset_peak()
        assert meter.peak_bytes == meter.current_bytes == 8 * KIB
    del a, c


def test_training_step_books_gradients_and_frees_saved_tensors() -> None:
    lin = nn.Linear(64, 32, bias=False)  # weight 8 KiB, born before the meter
    x = torch.randn(16, 64)
    with MemoryMeter() as meter:
        y = torch.relu(lin(x))  # 2 KiB, saved by relu
        assert meter.current_bytes == 2 * KIB
        y.sum().backward()
        del y
    assert lin.weight.grad is not None
    # Only the weight gradient outlives the step; the peak held the output, its gradient and more.
    assert meter.current_bytes == 8 * KIB
    assert meter.peak_bytes >= 8 * KIB + 2 * 2 * KIB


def test_other_devices_are_ignored() -> None:
    with MemoryMeter() as meter:
        m = torch.empty(1000, device="meta")
        a = torch.ones(10)
    assert meter.current_bytes == 40
    del m, a


def test_peak_op_names_where_the_peak_is() -> None:
    with MemoryMeter() as meter:
        meter.label = "phase-a"
        a = torch.ones(10)
        meter.label = "phase-b"
        b = torch.cat([a, a])
        del b
        meter.label = "phase-c"
        c = a * 2
    assert meter.peak_label == "phase-b"
    assert meter.peak_op is not None and "cat" in meter.peak_op
    del a, c
