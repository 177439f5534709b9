"""Two ranks (gloo, CPU) training ResNet-18 under DDP and FSDP, and a two-block GPT-2 under DDP, with and
without a plan, for tests/client/test_distributed.py: ``python distributed_ranks.py OUT_DIR`` writes ``rank<k>.json``.

Every model starts from the same seed; each rank trains on its own batch, so gradients are reduced across
ranks. A plan is made once (rank 0 profiles, rank 1 then hits the plan cache) with ``chen-sqrt``, which
checkpoints at this size (``linear`` keeps everything here). Each scenario records whether the applied
model's gradients are ``torch.equal`` to the unmodified model's under the same wrapper, and how many tensors
the forward saved outside the plan's checkpoints (all of them without a plan), or the one-line refusal.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel
from torchvision.models.resnet import BasicBlock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.utils, run as a script

import remat.client  # noqa: E402
from remat.client.apply_plan import applied_plan  # noqa: E402
from tests.utils.tiny_transformers import batch, tiny  # noqa: E402

WORLD = 2


def _model(applied: bool) -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    if applied:
        remat.client.checkpoint(model, torch.zeros(2, 3, 32, 32), algorithm="chen-sqrt")
    return model


def _step(wrapped: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """One training step; the number of tensors the forward saved for backward outside any checkpoint."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = wrapped(x)
    nn.functional.cross_entropy(out, y).backward()
    return saved[0]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]


def _fsdp1_grads(wrapped: FullyShardedDataParallel) -> list[torch.Tensor]:
    with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
        return [p.grad.clone() for p in wrapped.module.parameters()]


def _compare(wrap: Callable[[nn.Module], nn.Module], grads: Callable[[nn.Module], list[torch.Tensor]],
             x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    result: dict[str, Any] = {}
    runs = []
    for name in ("unmodified", "applied"):
        wrapped = wrap(_model(applied=name == "applied"))
        result[f"saved_{name}"] = _step(wrapped, x, y)
        runs.append(grads(wrapped))
    result["equal"] = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    return result


def _refusal(run: Callable[[], Any]) -> dict[str, str] | None:
    """What ``run`` raised (the error's type and message: another error than remat's is recorded too, so that
    one scenario failing leaves the others' results), or None."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


def _shard_blocks(model: nn.Module) -> nn.Module:
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in layer:
            fully_shard(block)
    fully_shard(model)
    return model


def _wrap_then_checkpoint(x: torch.Tensor) -> DistributedDataParallel:
    """A DDP wrapper given to ``checkpoint`` at a batch size no plan was made for: each rank profiles the
    module inside the wrapper, whose hooks on the parameters see those steps' backward passes."""
    wrapped = DistributedDataParallel(_model(applied=False))
    returned = remat.client.checkpoint(wrapped, torch.zeros_like(x), algorithm="chen-sqrt")
    assert returned is wrapped and applied_plan(wrapped.module) is not None
    return wrapped


def _dtensor_parameter() -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    model = _model(applied=False)
    mesh = init_device_mesh("cpu", (WORLD,))
    model.fc.weight = nn.Parameter(distribute_tensor(model.fc.weight.detach(), mesh, [Replicate()]))
    remat.client.checkpoint(model, torch.zeros(2, 3, 32, 32))


def _dtensor_parameter_after_the_plan(x: torch.Tensor, y: torch.Tensor) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    model = _model(applied=True)
    mesh = init_device_mesh("cpu", (WORLD,))
    model.fc.weight = nn.Parameter(distribute_tensor(model.fc.weight.detach(), mesh, [Replicate()]))
    _step(model, x, y)


def _gpt2_under_ddp(rank: int) -> dict[str, Any]:
    """A two-block GPT-2 (dropout on) called with keyword inputs, computing its own loss, under DDP: the
    dropout masks of both runs drawn from the same seed."""
    result: dict[str, Any] = {}
    runs = []
    for name in ("unmodified", "applied"):
        model = tiny("gpt2")
        if name == "applied":
            remat.client.checkpoint(model, **batch(seed=9), algorithm="chen-sqrt")
        wrapped = DistributedDataParallel(model)
        saved = [0]

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved[0] += 1
            return t

        torch.manual_seed(5)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = wrapped(**batch(seed=rank)).loss
        loss.backward()
        result[f"saved_{name}"] = saved[0]
        runs.append([p.grad for p in model.parameters()])
    result["equal"] = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    return result


def _rank(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    if rank == 0:  # profiles and plans; the other rank waits, then hits the plan cache
        _model(applied=True)
        remat.client.checkpoint(tiny("gpt2"), **batch(seed=9), algorithm="chen-sqrt")
    dist.barrier()
    torch.manual_seed(100 + rank)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    fsdp1 = {"device_id": torch.device("cpu"), "use_orig_params": True}
    results: dict[str, Any] = {
        "ddp": _compare(DistributedDataParallel, lambda m: _grads(m.module), x, y),
        "ddp_gpt2": _gpt2_under_ddp(rank),
        "fully_shard_one_unit": _compare(fully_shard, _grads, x, y),
        "fsdp1_one_unit": _compare(lambda m: FullyShardedDataParallel(m, **fsdp1), _fsdp1_grads, x, y),
        "fully_shard_blocks": _refusal(lambda: _step(_shard_blocks(_model(applied=True)), x, y)),
        "fsdp1_blocks": _refusal(lambda: _step(FullyShardedDataParallel(
            _model(applied=True), auto_wrap_policy=ModuleWrapPolicy({BasicBlock}), **fsdp1), x, y)),
        "sharded_first": _refusal(lambda: remat.client.checkpoint(fully_shard(_model(applied=False)),
                                                                  torch.zeros(2, 3, 32, 32))),
        "data_parallel": _refusal(lambda: remat.client.checkpoint(nn.DataParallel(_model(applied=False)),
                                                                  torch.zeros(2, 3, 32, 32))),
        "dtensor_parameter": _refusal(_dtensor_parameter),
        "dtensor_parameter_after_the_plan": _refusal(lambda: _dtensor_parameter_after_the_plan(x, y)),
    }
    # DDP wrapped before the plan, on a cold cache: the plan is made and applied for the module DDP trains, and
    # the wrapper returned.
    x, y = torch.randn(3, 3, 32, 32), torch.randint(0, 10, (3,))
    reference, wrapped = DistributedDataParallel(_model(applied=False)), _wrap_then_checkpoint(x)
    results["ddp_wrapped_first"] = {"saved_unmodified": _step(reference, x, y), "saved_applied": _step(wrapped, x, y),
                                    "equal": all(torch.equal(a, b) for a, b in zip(
                                        _grads(reference.module), _grads(wrapped.module), strict=True))}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(sys.argv[1],), nprocs=WORLD)
