"""Nested re-runs, measured: a chain plan's segments re-run stage by stage during their own backward.

Issue 30 asks for a ≥ 85% cut on ResNet-152 at batch 16, 224²; remat's chain optimum measures 83.3% there,
on a plateau of near-equal peaks (docs/benchmarks.md, "Where ResNet-152's 83.3% stops"). Every planner here
re-runs a dropped stage once. This experiment measures what one more level would give: the plan of
``linear`` (its outer segments) where, inside each checkpointed segment, every stage but the last runs under
its own non-reentrant checkpoint, so that the segment's re-run keeps only its stage outputs and each stage is
re-run a second time during its own backward (``StageChain.run(..., nested=True)``), and the outer segments of
least nested peak (remat.client.planning.nested, not a registered planner yet), each beside its predicted
peak; measured with the worker's measured step (the CPU live-storage meter), beside ``none`` and ``linear``,
gradients compared with the unmodified step.

    uv run python benchmarks/nested_checkpoints.py --model resnet152 --batch-size 16 --image-size 224
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from remat.client.graph.built_model import build
from remat.client.graph.stage_chain import NestedRun
from remat.client.hf_models import hf_zoo
from remat.client.planning.nested import nested_peak, nested_plan
from remat.client.planning.plans import make_plan
from remat.client.request import ModelRequest
from remat.worker import pipeline
from remat.worker.measure import gradient_check, measure_step, time_plans

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample of an hf: model")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per mode (0: no times)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.model.startswith("hf:"):  # the hf zoo's configuration of it (remat-client zoo hf)
        [entry] = [m for m in hf_zoo() if m.spec == args.model]
        request = ModelRequest(spec=args.model, batch_size=args.batch_size, sample_shape=(args.seq_len,),
                               seq_len=args.seq_len, grads="kept", model_kwargs=dict(entry.model_kwargs))
    else:
        request = ModelRequest(spec=args.model, batch_size=args.batch_size,
                               sample_shape=(3, args.image_size, args.image_size), grads="kept")
    built = build(request)
    model, call, chain = built.model, built.example, built.chain
    trace = pipeline.profile(built, timing_repeats=0)
    linear = make_plan(trace, "linear", cost_model="pytorch")
    nested = NestedRun(chain)
    outer = nested_plan(trace)
    modes = [("none", chain, ()), ("linear", chain, linear.checkpoints),
             ("linear's segments, re-run stage by stage", nested, linear.checkpoints),
             (f"least nested peak ({len(outer)} kept), re-run stage by stage", nested, outer)]
    common: dict[str, Any] = {"grads": "kept"}
    peaks = [measure_step(model, call, cps, chain=runner, baseline=False, **common).measured_peak_bytes
             for _, runner, cps in modes]
    checks = gradient_check(model, call, [m[2] for m in modes], runners=[m[1] for m in modes], chain=chain,
                            **common)
    times = (time_plans(model, call, [m[2] for m in modes], runners=[m[1] for m in modes], rounds=args.rounds,
                        **common) if args.rounds else [None] * len(modes))
    size = f"{args.seq_len} tokens" if args.model.startswith("hf:") else f"{args.image_size}²"
    print(f"{args.model}, batch {args.batch_size}, {size}, gradients kept, CPU; "
          f"linear keeps {list(linear.checkpoints)}, the least nested peak {list(outer)}")
    predicted = [linear.baseline_peak_bytes, linear.predicted_peak_bytes, nested_peak(trace, linear.checkpoints),
                 nested_peak(trace, outer)]
    print("| plan | measured peak | predicted | cut | step | largest gradient difference |")
    print("|---|---:|---:|---:|---:|---:|")
    for (label, _, _), peak, guess, (_, diff), ms in zip(modes, peaks, predicted, checks, times, strict=True):
        step = f"{ms:.0f} ms" if ms is not None else "-"
        print(f"| {label} | {peak / MIB:.2f} MiB | {guess / MIB:.2f} MiB ({(guess - peak) / peak:+.2%}) | "
              f"{1 - peak / peaks[0]:.1%} | {step} | {diff:.1e} |")


if __name__ == "__main__":
    main()
