"""Page faults per training step on CPU, per plan: what glibc's malloc does to the measured recompute.

On CPU torch allocates through ``malloc``. glibc serves large blocks with fresh ``mmap`` pages and gives freed
memory at the top of its heap back to the system (its dynamic mmap and trim thresholds), so a step can fault in
tens of megabytes it freed a moment before, and whether it does depends on the order and sizes of what the step
and the steps before it allocated. A checkpointed plan allocates differently from ``none``, so the measured
overhead of a plan carries the difference of their faults beside its recompute.

This profiles the model once (``pipeline.profile``: the recompute estimate), then times ``none`` and the given
plans in interleaved rounds (``time_plans_rounds``, as validation does), counting each step's minor page faults
(``getrusage``). Per plan: least and median step, measured overhead (least over ``none``'s least), the plan's
``recompute_ms`` estimate and the faults of a step (median over the timed rounds). By default the process
keeps the memory it frees, as remat's own processes do (``remat.client.host_memory``, NOTE [ page faults on
CPU ]); ``--host-malloc default`` leaves glibc's dynamic thresholds:

    uv run python benchmarks/host_faults.py --model vit_b_16 --size 1x64 --grads kept --plans "7;13;18;24;30;32"
    uv run python benchmarks/host_faults.py --host-malloc default --model vit_b_16 --size 1x64 --grads kept \
        --plans "7;13;18;24;30;32"

docs/benchmarks.md ("Step time", "Page faults") holds the figures.
"""

from __future__ import annotations

import argparse
import resource
import statistics
from collections.abc import Sequence
from typing import Any

import torch

import remat.worker.measure as measure
from remat.client.graph import built_model
from remat.client.host_memory import host_malloc, keep_freed_memory
from remat.client.planning.recompute_time import recompute_ms
from remat.client.request import ModelRequest
from remat.worker import pipeline


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def count_faults(faults: dict[tuple[int, ...], list[int]]) -> None:
    """Wrap validation's step so that every step's minor faults are booked by its checkpoints. A benchmark's
    probe: the step is where a plan's allocations happen, and ``time_plans_rounds`` takes no hook."""
    step = measure._step

    def counted(chain: Any, x: Any, loss_fn: Any, checkpoints: Sequence[int], precision: str, *args: Any) -> None:
        before = _faults()
        step(chain, x, loss_fn, checkpoints, precision, *args)
        faults.setdefault(tuple(checkpoints), []).append(_faults() - before)

    measure._step = counted


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vit_b_16")
    parser.add_argument("--size", default="1x64", help="BATCHxSIDE")
    parser.add_argument("--grads", choices=("none", "kept"), default="none")
    parser.add_argument("--plans", required=True, help="checkpoint lists, ';' between plans, ',' within one")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--host-malloc", choices=("kept", "default"), default="kept")
    args = parser.parse_args(argv)
    if args.host_malloc == "kept":
        keep_freed_memory()
    batch, side = (int(v) for v in args.size.split("x"))
    kwargs = {"image_size": side} if args.model.startswith("vit_") else {}
    request = ModelRequest(spec=args.model, batch_size=batch, sample_shape=(3, side, side), model_kwargs=kwargs,
                           grads=args.grads)
    built = built_model.build(request)
    trace = pipeline.profile(built, with_graph=False)
    plans = [(), *(tuple(int(c) for c in p.split(",")) for p in args.plans.split(";"))]
    faults: dict[tuple[int, ...], list[int]] = {}
    count_faults(faults)
    rounds = measure.time_plans_rounds(built.model, built.example, plans, grads=args.grads, rounds=args.rounds,
                                       budget_s=600.0)
    print(f"{args.model}, batch {batch}, {side}², grads {args.grads}, torch {torch.__version__} on "
          f"{torch.get_num_threads()} threads; malloc: {host_malloc()}; profiled step "
          f"{trace.metadata['timing']['step_ms']:.1f} ms\n")
    print("| plan | least ms | median ms | overhead ms | estimate ms | faults per step (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    none_least = min(rounds[0])
    for plan, times in zip(plans, rounds, strict=True):
        steps = faults[plan][1:]  # the first is the untimed warm-up step
        estimate = recompute_ms(trace, plan) if plan else 0.0
        print(f"| {','.join(map(str, plan)) or 'none'} | {min(times):.1f} | {statistics.median(times):.1f} | "
              f"{min(times) - none_least:.1f} | {estimate or 0.0:.1f} | {statistics.median(steps):,.0f} |")


if __name__ == "__main__":
    main()
