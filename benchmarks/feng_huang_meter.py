"""Feng & Huang's memory figure, measured their way, beside remat's own, for the same plans of one model.

Feng & Huang's benchmark (jianweif/OptimalGradCheckpointing, README and benchmark code) reports "intermediate
tensors" as the allocator's peak during a training step minus the larger of what was allocated before and
after it, for an input that requires grad, a ``sum()`` loss, after a warm-up step. remat reports the
activation peak above everything alive at the step's start (NOTE [ measured peak ] in remat.worker.measure),
with its own seeded loss and an input that needs no gradient. The two differ by what the step leaves behind
(the input's gradient, gradients born in the step) and by the loss; this prints both for ``none``, the best
chain plan (``linear``), the best nested one (``nested``: one more level of re-runs) and the searched graph
plan (``acg``, with the lower bound no plan goes below), each run by remat's executor, on the CPU's live-storage
meter (remat.worker.memory_meter: the bytes of tensor storages, like ``memory_allocated`` without the CUDA
allocator's rounding).

    uv run python benchmarks/feng_huang_meter.py --models densenet121 --batch-size 32 --image-size 224

docs/benchmarks.md ("Feng & Huang's measurement beside remat's") holds the figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from remat.client.graph.built_model import build
from remat.client.plan import LOWER_BOUND_AT_KEY
from remat.client.request import ModelRequest
from remat.worker import pipeline
from remat.worker.memory_meter import MemoryMeter

MIB = 2**20
ALGORITHMS = ("none", "linear", "nested", "acg")


def their_quantity(step: Any) -> tuple[int, int, int]:
    """(peak − max(start, end), peak above start, end above start) in bytes of ``step()`` as Feng & Huang's
    benchmark measures it, after one warm-up call (so the parameters' and the input's gradients exist and
    accumulate in place)."""
    step()
    meter = MemoryMeter()
    with meter:
        meter.mark_baseline()
        step()
        end = meter.current_above_baseline
        peak = meter.peak_above_baseline
    return peak - max(0, end), peak, end


def their_figure(runner: Any, cuts: tuple[int, ...], x: torch.Tensor) -> tuple[int, int, int]:
    """:func:`their_quantity` of one step as Feng & Huang's benchmark runs it: the input requires grad, the
    loss is ``output.sum()``."""
    return their_quantity(lambda: runner.run(x, cuts).sum().backward())


def profiled_plans(spec: str, args: argparse.Namespace, algorithms: tuple[str, ...]) -> tuple[Any, Any, dict, float,
                                                                                          float]:
    """A model of the benchmark's size, profiled (gradients kept) and planned by ``algorithms`` through the
    worker's pipeline: (built model, trace, plans by algorithm, profile seconds, planning seconds)."""
    request = ModelRequest(spec=spec, batch_size=args.batch_size, sample_shape=(3, args.image_size, args.image_size),
                           grads="kept")
    built = build(request)
    started = time.perf_counter()
    trace = pipeline.profile(built)
    profiled = time.perf_counter()
    by_name = {p.algorithm: p for p in pipeline.plans_for(built, trace, algorithms=algorithms)}
    return built, trace, by_name, profiled - started, time.perf_counter() - profiled


def run(spec: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    built, trace, by_name, profile_s, planning_s = profiled_plans(spec, args, ALGORITHMS)
    plans = [by_name[a] for a in ALGORITHMS]  # the frontier's budget plans left out
    plan_s = profile_s + planning_s
    print(f"{spec}: profile {profile_s:.0f} s, plans {planning_s:.1f} s (the graph search and its bound included)",
          file=sys.stderr)
    ours = pipeline.validate(built, trace, plans, timing_rounds=1, check_gradients=False)
    rows = []
    x = built.example.detach().clone().requires_grad_(True)
    for plan in plans:
        runner, cuts = pipeline._cut(built, plan)
        theirs, peak, end = their_figure(runner, tuple(cuts), x)
        for p in built.model.parameters():
            p.grad = None
        x.grad = None
        if plan.lower_bound_bytes is not None:
            print(f"{spec}: no plan peaks below {plan.lower_bound_bytes / MIB:.1f} MiB in remat's measure "
                  f"({plan.extra.get(LOWER_BOUND_AT_KEY)}): the best plan possible is at most "
                  f"{plan.optimality_gap:.1%} below {plan.algorithm}'s",
                  file=sys.stderr)
        rows.append({"model": spec, "plan": plan.algorithm, "graph": plan.is_graph_plan,
                     "predicted": plan.predicted_peak_bytes, "ours": ours[plan.label].measured_peak_bytes,
                     "theirs": theirs, "their_peak": peak, "their_end": end, "profile_and_plan_s": plan_s})
    return rows


def size_arguments(description: str) -> argparse.ArgumentParser:
    """The options of a benchmark at Feng & Huang's sizes (DenseNet-121 at batch 32, 224², by default)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default="densenet121")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    return parser


def describe_run(args: argparse.Namespace) -> str:
    """The machine and size line printed above a table."""
    return (f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, batch {args.batch_size}, "
            f"{args.image_size}², float32")


def main() -> None:
    args = size_arguments(__doc__.splitlines()[0]).parse_args()
    print(describe_run(args), file=sys.stderr)
    print("| model | plan | remat's measure (predicted) | cut | Feng & Huang's measure | cut | step peak above start "
          "/ left after it |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for spec in args.models.split(","):
        rows = run(spec.strip(), args)
        base = rows[0]
        for r in rows:
            print(f"| {r['model']} | {r['plan']} | {r['ours'] / MIB:.1f} MiB ({r['predicted'] / MIB:.1f}) | "
                  f"{1 - r['ours'] / base['ours']:.1%} | {r['theirs'] / MIB:.1f} MiB | "
                  f"{1 - r['theirs'] / base['theirs']:.1%} | {r['their_peak'] / MIB:.1f} / {r['their_end'] / MIB:.1f} "
                  f"MiB |", flush=True)
        print(f"(profile and plans: {rows[0]['profile_and_plan_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
