"""Side values priced plan by plan: predicted against measured peaks of many plans of one hf model.

docs/cost-model.md ("Side values"): how long a transformer's side values (masks, position biases, an encoder's
output) live in backward depends on the plan. This profiles one model of ``remat-client zoo hf`` (its
configuration sizes, random weights; float32; gradients kept) and measures, with the worker's measured step
(the CPU live-storage meter), every plan of one checkpoint and ``--random`` random plans of 2 to 5. For each it
prints the measured peak and two predictions: the planners' tables (side values as resident: an upper bound)
and ``pytorch_peak`` (their lifetimes under that plan), with the candidate that decides the exact one.

``--search`` asks what minimising the bound costs instead: a descent under the exact price (toggle one
checkpoint while it lowers the peak) from ``linear``'s plan and 30 random plans; it prints the least exact peak
found beside ``linear``'s. No plan is measured then.

    uv run python benchmarks/side_values.py --model t5
"""

from __future__ import annotations

import argparse
import json
import random

from remat.client.graph.built_model import build
from remat.client.hf_models import hf_zoo
from remat.client.planning.cost_models import peak_candidates, pytorch_peak, tables_peak
from remat.client.planning.plans import make_plan
from remat.client.request import ModelRequest
from remat.client.trace import Trace
from remat.worker import pipeline
from remat.worker.measure import measure_step


def search(trace: Trace, rng: random.Random) -> None:
    """Descend under ``pytorch_peak`` from ``linear``'s plan and 30 random ones; print the least peak found."""
    n = trace.num_stages
    linear = make_plan(trace, "linear", cost_model="pytorch").checkpoints
    best = (pytorch_peak(trace, linear), linear)
    starts = [linear] + [tuple(sorted(rng.sample(range(1, n), rng.randint(2, min(8, n - 1))))) for _ in range(30)]
    for start in starts:
        current = (pytorch_peak(trace, start), start)
        improved = True
        while improved:
            improved = False
            for c in range(1, n):
                candidate = tuple(sorted(set(current[1]) ^ {c}))
                peak = pytorch_peak(trace, candidate)
                if peak < current[0]:
                    current, improved = (peak, candidate), True
        best = min(best, current)
    print(f"linear {list(linear)}: exact {pytorch_peak(trace, linear):,} B (tables {tables_peak(trace, linear):,}); "
          f"least exact peak found from 31 starts: {best[0]:,} B at {list(best[1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="t5", help="an hf zoo name without 'hf:' (default t5)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--random", type=int, default=25, help="random plans besides the one-checkpoint ones")
    parser.add_argument("--model-kwargs", default="{}", help="configuration overrides, JSON")
    parser.add_argument("--search", action="store_true", help="search plans under the exact price instead")
    args = parser.parse_args()
    [entry] = [m for m in hf_zoo() if m.name == args.model]
    request = ModelRequest(spec=entry.spec, batch_size=args.batch_size, sample_shape=(args.seq_len,),
                           seq_len=args.seq_len, grads="kept",
                           model_kwargs={**entry.model_kwargs, **json.loads(args.model_kwargs)})
    built = build(request)
    trace = pipeline.profile(built, timing_repeats=0)
    n = trace.num_stages
    rng = random.Random(0)
    if args.search:
        search(trace, rng)
        return
    plans = [(), *((c,) for c in range(1, n))]
    plans += [tuple(sorted(rng.sample(range(1, n), rng.randint(2, min(5, n - 1))))) for _ in range(args.random)]
    print(f"{entry.spec}: {n} stages, {len(trace.side_values)} side values, batch {args.batch_size}, "
          f"{args.seq_len} tokens")
    print("| plan | measured B | tables (bound) | exact | deciding candidate |")
    print("|---|---:|---:|---:|---|")
    worst = {"bound": 0.0, "exact": 0.0}
    for plan in plans:
        measured = measure_step(built.model, built.example, plan, grads="kept", chain=built.chain, trace=trace,
                                baseline=False).measured_peak_bytes
        bound, exact = tables_peak(trace, plan), pytorch_peak(trace, plan)
        errors = {"bound": (bound - measured) / measured, "exact": (exact - measured) / measured}
        for k, e in errors.items():
            worst[k] = max(worst[k], abs(e), key=abs)
        print(f"| {list(plan)} | {measured:,} | {errors['bound']:+.2%} | {errors['exact']:+.2%} | "
              f"{peak_candidates(trace, plan)[0][1]} |", flush=True)
    print(f"\n{len(plans)} plans; largest |error|: tables {worst['bound']:.2%}, exact {worst['exact']:.2%}")


if __name__ == "__main__":
    main()
