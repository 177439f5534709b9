"""Nested re-runs, measured: a chain plan's segments re-run stage by stage during their own backward.

Issue 30 asks for a ≥ 85% cut on ResNet-152 at batch 16, 224²; remat's chain optimum measures 83.3% there,
on a plateau of near-equal peaks (docs/benchmarks.md, "Where ResNet-152's 83.3% stops"). Every planner here
re-runs a dropped stage once. This experiment measures what one more level would give: the plan of
``linear`` (its outer segments) where, inside each checkpointed segment, every stage but the last runs under
its own non-reentrant checkpoint, so that the segment's re-run keeps only its stage outputs and each stage is
re-run a second time during its own backward. Nothing plans this yet; the benchmark only measures it, with
the worker's measured step (the CPU live-storage meter), beside ``none`` and ``linear``, gradients compared
with the unmodified step.

    uv run python benchmarks/nested_checkpoints.py --model resnet152 --batch-size 16 --image-size 224
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from remat.client.graph.built_model import build
from remat.client.graph.stage_chain import StageChain, recompute_contexts
from remat.client.planning.plans import make_plan
from remat.client.request import ModelRequest
from remat.worker import pipeline
from remat.worker.measure import gradient_check, measure_step, time_plans

MIB = 2**20


class NestedChain:
    """``chain``'s plan with one more level: a checkpointed segment runs each of its stages but the last under
    an inner checkpoint (a runner for the measured step, like ``StageChain``)."""

    def __init__(self, chain: StageChain) -> None:
        self.chain = chain

    def run_call(self, call: Any, checkpoints: Sequence[int] = ()) -> Any:
        chain = self.chain
        x, extra = chain.split_call(call)
        env: dict[str, Any] = dict(extra)
        bounds = (0, *sorted(checkpoints), chain.num_stages)
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k] + 1, bounds[k + 1]
            if k == len(bounds) - 2:
                return chain.fold_output(chain._run_handed(lo, hi, [x], env))
            x, new = checkpoint(partial(self._nested, lo, hi), x, dict(env), use_reentrant=False,
                                preserve_rng_state=True, context_fn=partial(recompute_contexts, self._slots(lo, hi)))
            env.update(new)
        raise AssertionError("unreachable")

    run = run_call  # a tensor call: the measured step calls ``run``

    def _slots(self, lo: int, hi: int) -> tuple[Any, ...]:
        return tuple(dict.fromkeys(s for st in self.chain._stages[lo - 1:hi] for s in st.slots))

    def _nested(self, lo: int, hi: int, x: Any, env: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        local = dict(env)
        for i in range(lo, hi):
            x, new = checkpoint(partial(self.chain._segment, i, i), x, dict(local), use_reentrant=False,
                                preserve_rng_state=True, context_fn=partial(recompute_contexts, self._slots(i, i)))
            local.update(new)
        x = self.chain._run_handed(hi, hi, [x], local)
        return x, {k: v for k, v in local.items() if k not in env}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per mode (0: no times)")
    args = parser.parse_args()
    torch.manual_seed(0)
    built = build(ModelRequest(spec=args.model, batch_size=args.batch_size,
                               sample_shape=(3, args.image_size, args.image_size), grads="kept"))
    model, call, chain = built.model, built.example, built.chain
    trace = pipeline.profile(built, timing_repeats=0)
    linear = make_plan(trace, "linear", cost_model="pytorch")
    nested = NestedChain(chain)
    modes = [("none", chain, ()), ("linear", chain, linear.checkpoints),
             ("linear, segments re-run stage by stage", nested, linear.checkpoints)]
    common: dict[str, Any] = {"grads": "kept"}
    peaks = [measure_step(model, call, cps, chain=runner, baseline=False, **common).measured_peak_bytes
             for _, runner, cps in modes]
    checks = gradient_check(model, call, [m[2] for m in modes], runners=[m[1] for m in modes], chain=chain,
                            **common)
    times = (time_plans(model, call, [m[2] for m in modes], runners=[m[1] for m in modes], rounds=args.rounds,
                        **common) if args.rounds else [None] * len(modes))
    print(f"{args.model}, batch {args.batch_size}, {args.image_size}², gradients kept, CPU; "
          f"linear keeps {list(linear.checkpoints)} (predicted {linear.predicted_peak_bytes / MIB:.1f} MiB)")
    print("| plan | measured peak | cut | step | largest gradient difference |")
    print("|---|---:|---:|---:|---:|")
    for (label, _, _), peak, (_, diff), ms in zip(modes, peaks, checks, times, strict=True):
        step = f"{ms:.0f} ms" if ms is not None else "-"
        print(f"| {label} | {peak / MIB:.1f} MiB | {1 - peak / peaks[0]:.1%} | {step} | {diff:.1e} |")


if __name__ == "__main__":
    main()
