"""Wrappers around a model and an applied plan: which a plan trains under (DDP, FSDP of the whole model,
torch.compile), which are refused, and why.

NOTE [ plans under data parallelism ] A plan replaces the model's own ``forward`` in training: its stages call
the model's layers directly, stage by stage, and re-run some of them in backward. A wrapper that works from
outside the model therefore keeps working, and one that hooks modules *inside* it does not:

- ``DistributedDataParallel`` calls the wrapped module and all-reduces gradients from hooks on the parameters:
  a plan applied before or after wrapping trains bit-equal to DDP without it (2 ranks, gloo, CPU: ResNet-18,
  and a GPT-2 with dropout called with keyword inputs; tests/client/test_distributed.py).
  ``checkpoint(ddp_model, ...)`` plans ``ddp_model.module``, the module DDP calls.
- FSDP sharding the model *as one unit* (``fully_shard(model)``, or ``FullyShardedDataParallel(model)``)
  gathers every parameter before the model's forward runs and keeps them through backward (the root's
  default), so the plan's stages and their re-runs see whole parameters: bit-equal to the same FSDP without a
  plan.
- FSDP units *inside* the model (``fully_shard`` per block, FSDP's ``auto_wrap_policy``) gather a block's
  parameters from hooks on that block's own call, which a plan's stages never make (a stage may end inside a
  block, and a re-run in backward happens before the block's backward hook). Run anyway, the step failed
  with "aten.convolution.default: got mixed torch.Tensor and DTensor" (FSDP2) or "weight should have at least
  three dimensions" (FSDP1). The first training call refuses it instead, naming the unit.
- A model already sharded (or holding ``DTensor`` parameters: tensor parallelism) cannot be traced and cut
  into stages: ``checkpoint`` and ``apply`` refuse it, saying to apply the plan first. ``DataParallel`` copies
  the module per device for every call, copies whose ``forward`` would run the original's stages: refused too.

``torch.compile(model)`` wraps the model the same way: ``checkpoint`` of the compiled wrapper plans the module
it compiles, which then runs as an applied model compiled afterwards does.

FSDP, DTensor and dynamo are looked up only where torch has already imported them: a script that never
imported them holds none, and a plan-cache hit does not pay their import.
"""

from __future__ import annotations

import sys

from torch import nn

from remat.client.errors import ModelError

__all__ = ["refuse_inner_units", "trained_module"]

_HOW = "docs/apply.md, 'Data parallelism'"


def _sharded_unit(model: nn.Module, *, below_root: bool) -> tuple[str, str] | None:
    """(name, how) of the first FSDP unit in ``model`` ("" for ``model`` itself; below it only, with
    ``below_root``), or None."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    for name, module in model.named_modules():
        if below_root and not name:
            continue
        if isinstance(module, fsdp.FSDPModule):
            return name, "fully_shard (FSDP2)"
        if isinstance(module, fsdp.FullyShardedDataParallel):
            return name, "FullyShardedDataParallel"
    return None


def _dtensor_parameter(model: nn.Module) -> str | None:
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None:
        return None
    return next((name for name, p in model.named_parameters() if isinstance(p, tensor.DTensor)), None)


def _wrapped(model: nn.Module) -> nn.Module | None:
    """The module a ``DistributedDataParallel`` or ``torch.compile`` wrapper calls, or None for another module."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return model._orig_mod
    return None


def trained_module(model: nn.Module, who: str) -> nn.Module:
    """The module a plan is made for and applied to: ``model``, or the module that ``DistributedDataParallel``
    and ``torch.compile`` wrappers around it call (NOTE [ plans under data parallelism ]; a compiled model runs
    its plan as NOTE [ torch.compile keeps the plan ] in remat.client.apply_plan says).

    Raises:
        ModelError: ``model`` is sharded by FSDP, holds DTensor parameters, or is wrapped in ``DataParallel``.
    """
    while (inner := _wrapped(model)) is not None:
        model = inner
    if isinstance(model, nn.DataParallel):
        raise ModelError(f"{who}: the model is wrapped in torch.nn.DataParallel, whose per-device copies would "
                         f"not run the plan; train with DistributedDataParallel ({_HOW})")
    unit = _sharded_unit(model, below_root=False)
    if unit is not None:
        name, how = unit
        raise ModelError(f"{who}: {name or 'the model'} is already sharded with {how}, and remat traces and cuts "
                         f"a model's own parameters: call {who} first, then shard the model as one unit ({_HOW})")
    parameter = _dtensor_parameter(model)
    if parameter is not None:
        raise ModelError(f"{who}: parameter {parameter} is a DTensor (tensor parallelism?): remat plans models "
                         f"whose parameters are plain tensors ({_HOW})")
    return model


def refuse_inner_units(model: nn.Module) -> None:
    """At an applied model's first training call: refuse FSDP units inside it and DTensor parameters, which
    the plan's stages would run past (NOTE [ plans under data parallelism ]).

    Raises:
        ModelError: naming the unit or parameter.
    """
    unit = _sharded_unit(model, below_root=True)
    if unit is not None:
        name, how = unit
        raise ModelError(f"remat: {name} was sharded with {how} inside the model the plan was applied to; the "
                         f"plan's stages run its layers without the hooks that gather its parameters. Shard the "
                         f"model as one unit, or train it under DistributedDataParallel ({_HOW})")
    parameter = _dtensor_parameter(model)
    if parameter is not None:  # a model sharded as one unit has its parameters gathered by now
        raise ModelError(f"remat: parameter {parameter} is a DTensor in training (tensor parallelism?): the "
                         f"plan's stages run the model's layers without their hooks ({_HOW})")
