"""Measured memory of every planner's plan on torchvision models: the cost model's calibration table.

For each model and gradient convention: build the stage chain, profile it (one trace), let every planner
choose its checkpoints, predict each plan's peak with the ``pytorch`` cost model, then run a real training
step with the plan applied and measure it (remat.worker.measure, NOTE [ measured peak ]). Prints one
markdown table: measured and predicted activation peak, prediction error, saving against no
checkpointing, step time and its overhead.

    uv run python benchmarks/zoo_memory.py --models resnet50,vgg19 --batch-size 2 --image-size 64

Keep sizes small on shared CPUs: every plan costs 2 + rounds training steps (warm-up, metered, timed).
Step times are taken in interleaved rounds (remat.worker.measure.time_plans) so that the time overhead
column compares plans timed under the same load.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import torchvision

from remat.client.stage_graph import build_stage_chain
from remat.worker.measure import make_loss, measure_step, time_plans
from remat.worker.planners import PLANNERS
from remat.worker.planning import make_plan
from remat.worker.profilers import profile

DEFAULT_MODELS = "resnet50,resnet152,vgg19,densenet121,mobilenet_v2"
MIB = 1024 * 1024


def run_model(name: str, *, batch_size: int, image_size: int, grads_list: list[str], device: str,
              algorithms: list[str], timing_repeats: int) -> list[dict[str, Any]]:
    """Profile one model and measure every algorithm's plan under each gradient convention."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).to(device)
    x = torch.randn(batch_size, 3, image_size, image_size, device=device)
    chain = build_stage_chain(model, x, train=True)
    with torch.no_grad():
        loss_fn = make_loss(chain.run(x))
    rows: list[dict[str, Any]] = []
    for grads in grads_list:
        started = time.perf_counter()
        trace = profile(model, x, device=device, grads=grads, chain=chain, model_name=name,
                        timing_repeats=timing_repeats)
        profile_s = time.perf_counter() - started
        plans = [make_plan(trace, algorithm, cost_model="pytorch") for algorithm in algorithms]
        results = [measure_step(model, x, plan.checkpoints, grads=grads, device=device, chain=chain, trace=trace,
                                algorithm=plan.algorithm, baseline=False, timing_repeats=0, loss_fn=loss_fn)
                   for plan in plans]
        times = time_plans(model, x, [p.checkpoints for p in plans], grads=grads, device=device, chain=chain,
                           rounds=timing_repeats, loss_fn=loss_fn)
        base_bytes, base_ms = results[0]["measured_peak_bytes"], times[0]  # algorithms[0] is "none"
        for plan, result, ms in zip(plans, results, times, strict=True):
            rows.append({
                "model": name, "grads": grads, "algorithm": plan.algorithm, "num_stages": trace.num_stages,
                "segments": len(plan.checkpoints) + 1, "checkpoints": list(plan.checkpoints),
                "predicted_bytes": result["predicted_peak_bytes"], "measured_bytes": result["measured_peak_bytes"],
                "error": result["prediction_error"], "saving": 1 - result["measured_peak_bytes"] / base_bytes,
                "step_ms": ms, "overhead": ms / base_ms - 1, "profile_s": profile_s,
            })
            print(f"  {name} grads={grads} {plan.algorithm}: measured {result['measured_peak_bytes'] / MIB:.2f} MiB, "
                  f"predicted {result['predicted_peak_bytes'] / MIB:.2f} MiB ({result['prediction_error']:+.2%}), "
                  f"{ms:.0f} ms", file=sys.stderr)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The calibration table: one row per model × gradient convention × algorithm."""
    lines = ["| model | grads | algorithm | segments | measured MiB | predicted MiB | error | saving vs none "
             "| step ms | time overhead |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['grads']} | {r['algorithm']} | {r['segments']}/{r['num_stages']} | "
                     f"{r['measured_bytes'] / MIB:.2f} | {r['predicted_bytes'] / MIB:.2f} | {r['error']:+.2%} | "
                     f"{r['saving']:.1%} | {r['step_ms']:.0f} | {r['overhead']:+.0%} |")
    errors = [abs(r["error"]) for r in rows]
    if errors:
        lines.append("")
        lines.append(f"{len(rows)} plans; largest |error| {max(errors):.2%}, mean |error| "
                     f"{sum(errors) / len(errors):.2%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated torchvision model names")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--grads", default="none,kept", help="none, kept or both (comma-separated)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--algorithms", default=",".join(PLANNERS), help="planners to run (default: all)")
    parser.add_argument("--timing-repeats", type=int, default=3,
                        help="interleaved timing rounds, every plan once per round (fastest kept)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (1 gives steadier times on a "
                        "shared CPU)")
    parser.add_argument("--json", dest="json_path", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    algorithms = [a for a in args.algorithms.split(",") if a]
    if "none" in algorithms:  # the baseline goes first: every saving is relative to it
        algorithms.remove("none")
    algorithms.insert(0, "none")
    rows: list[dict[str, Any]] = []
    for name in [m for m in args.models.split(",") if m]:
        rows += run_model(name, batch_size=args.batch_size, image_size=args.image_size,
                          grads_list=[g for g in args.grads.split(",") if g], device=args.device,
                          algorithms=algorithms, timing_repeats=args.timing_repeats)
    print(f"batch {args.batch_size}, {args.image_size}x{args.image_size}, device {args.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print(markdown(rows))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
