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
import concurrent.futures
import itertools
import json
import multiprocessing
import sys
import time
import traceback
from typing import Any

import torch

from remat.client.graph import built_model
from remat.client.planning.planners import PLANNERS
from remat.client.planning.plans import make_plan
from remat.client.request import ModelRequest
from remat.worker import pipeline

DEFAULT_MODELS = "resnet50,resnet152,vgg19,densenet121,mobilenet_v2"
MIB = 1024 * 1024


def run_model(name: str, *, batch_size: int, image_size: int, grads_list: list[str], device: str,
              algorithms: list[str], timing_repeats: int,
              precisions: tuple[str, ...] = ("float32",)) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Profile one model and measure every algorithm's plan under each precision and gradient convention.

    The steps are the pipeline's own (remat.worker.pipeline: build, profile, validate), so this table measures
    exactly what `remat-client plan` and the workers store. Returns the rows and every profiled trace as
    ``{"<model>/<precision>/<grads>": trace dict}``, so that the cost model can be re-evaluated later against
    the same measurements without the device.
    """
    rows: list[dict[str, Any]] = []
    traces: dict[str, Any] = {}
    for precision, grads in itertools.product(precisions, grads_list):
        request = ModelRequest(spec=name, batch_size=batch_size, sample_shape=(3, image_size, image_size),
                               device=device, grads=grads, dtype=precision)
        built = built_model.build(request)
        started = time.perf_counter()
        trace = pipeline.profile(built, timing_repeats=timing_repeats)
        profile_s = time.perf_counter() - started
        traces[f"{name}/{precision}/{grads}"] = trace.to_dict()
        # graph_planned: acg's graph plan searched under the graph predictor, as `plan MODEL` stores it.
        plans = [pipeline.graph_planned(built, trace, make_plan(trace, algorithm, cost_model="pytorch"))
                 for algorithm in algorithms]
        measured = pipeline.validate(built, trace, plans, timing_rounds=timing_repeats, check_gradients=False)
        base_bytes, base_ms = measured["none"].measured_peak_bytes, measured["none"].step_ms
        for plan in plans:
            result = measured[plan.algorithm]
            measured_bytes, predicted, ms = result.measured_peak_bytes, result.predicted_peak_bytes, result.step_ms
            rows.append({
                "model": name, "precision": precision, "grads": grads, "algorithm": plan.algorithm,
                "num_stages": trace.num_stages,
                # A graph plan (acg on the op graph) cuts inside stages: its size is what it recomputes.
                "segments": (f"{len(plan.dropped_vertices)} of {plan.num_vertices} vertices recomputed"
                             if plan.dropped_vertices is not None
                             else f"{len(plan.checkpoints) + 1}/{trace.num_stages}"),
                "checkpoints": list(plan.checkpoints), "dropped_vertices": plan.dropped_vertices,
                "predicted_bytes": predicted,
                "measured_bytes": measured_bytes,
                "error": result.prediction_error, "saving": 1 - measured_bytes / base_bytes,
                "step_ms": ms, "overhead": ms / base_ms - 1, "profile_s": profile_s,
                "reserved_bytes": result.measured_reserved_bytes,
                "reserved_before_bytes": result.extra.get("reserved_before_bytes"),
                "absolute_bytes": result.absolute_peak_bytes, "requested_bytes": result.requested_peak_bytes,
                "device_name": result.device_name, "torch_version": torch.__version__,
            })
            said = ("no pytorch prediction (graph plan)" if predicted is None else
                    f"predicted {predicted / MIB:.2f} MiB ({result.prediction_error:+.2%})")
            print(f"  {name} {precision} grads={grads} {plan.algorithm}: measured {measured_bytes / MIB:.2f} MiB, "
                  f"{said}, {ms:.0f} ms", file=sys.stderr)
    return rows, traces


def run_model_fresh(name: str, **kwargs: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`run_model` in a new process (CUDA): every model starts with an empty caching allocator, so the
    reserved figures are the model's own and not what earlier models left cached and fragmented."""
    context = multiprocessing.get_context("spawn")  # never fork a process that has initialised CUDA
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(run_model, name, **kwargs).result()


def reserved_markdown(rows: list[dict[str, Any]]) -> str:
    """CUDA only: what the caching allocator held beside what tensors needed, per plan (absolute bytes)."""
    lines = ["| model | precision | grads | algorithm | allocated peak MiB | reserved peak MiB | reserved before "
             "step MiB | requested activation MiB | allocated activation MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['precision']} | {r['grads']} | {r['algorithm']} | "
                     f"{r['absolute_bytes'] / MIB:.0f} | {r['reserved_bytes'] / MIB:.0f} | "
                     f"{r['reserved_before_bytes'] / MIB:.0f} | {r['requested_bytes'] / MIB:.2f} | "
                     f"{r['measured_bytes'] / MIB:.2f} |")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The calibration table: one row per model × gradient convention × algorithm."""
    lines = ["| model | precision | grads | algorithm | segments | measured MiB | predicted MiB | error "
             "| saving vs none | step ms | time overhead |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['precision']} | {r['grads']} | {r['algorithm']} | "
                     f"{r['segments']} | {r['measured_bytes'] / MIB:.2f} | "
                     + ("- | - | " if r["predicted_bytes"] is None else
                        f"{r['predicted_bytes'] / MIB:.2f} | {r['error']:+.2%} | ") + f"{r['saving']:.1%} | "
                     f"{r['step_ms']:.0f} | {r['overhead']:+.0%} |")
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    if errors:
        lines.append("")
        lines.append(f"{len(errors)} predicted plans; largest |error| {max(errors):.2%}, mean |error| "
                     f"{sum(errors) / len(errors):.2%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated torchvision model names")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--grads", default="none,kept", help="none, kept or both (comma-separated)")
    parser.add_argument("--precision", default="float32",
                        help="comma-separated precisions: float32, autocast_bfloat16, ... (remat.client.precision)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--algorithms", default=",".join(PLANNERS), help="planners to run (default: all)")
    parser.add_argument("--timing-repeats", type=int, default=3,
                        help="interleaved timing rounds, every plan once per round (fastest kept)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (1 gives steadier times on a "
                        "shared CPU)")
    parser.add_argument("--json", dest="json_path", help="also write the rows to this JSON file (after each model)")
    parser.add_argument("--fresh-process", action="store_true",
                        help="run each model in a new process (always on CUDA)")
    parser.add_argument("--traces-out", help="write every profiled trace to this JSON file, keyed model/grads")
    parser.add_argument("--search-evaluations", type=int, default=pipeline.SEARCH_EVALUATIONS,
                        help="plans the graph search predicts for acg (default: what plan MODEL uses)")
    args = parser.parse_args(argv)
    pipeline.SEARCH_EVALUATIONS = args.search_evaluations
    if args.threads:
        torch.set_num_threads(args.threads)
    algorithms = [a for a in args.algorithms.split(",") if a]
    if "none" in algorithms:  # the baseline goes first: every saving is relative to it
        algorithms.remove("none")
    algorithms.insert(0, "none")
    rows: list[dict[str, Any]] = []
    traces: dict[str, Any] = {}
    failed = []
    for name in [m for m in args.models.split(",") if m]:
        runner = run_model_fresh if args.device.startswith("cuda") or args.fresh_process else run_model
        try:
            model_rows, model_traces = runner(
                name, batch_size=args.batch_size, image_size=args.image_size,
                grads_list=[g for g in args.grads.split(",") if g], device=args.device, algorithms=algorithms,
                timing_repeats=args.timing_repeats, precisions=tuple(p for p in args.precision.split(",") if p))
            rows += model_rows
            traces.update(model_traces)
        except Exception:  # one model's failure must not lose the others' figures
            traceback.print_exc()
            failed.append(name)
        # Written after every model: a run cut off by a time limit still leaves what it measured.
        if args.json_path:
            with open(args.json_path, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
        if args.traces_out:
            with open(args.traces_out, "w", encoding="utf-8") as f:
                json.dump(traces, f)
    device_name = rows[0]["device_name"] if rows else args.device
    print(f"batch {args.batch_size}, {args.image_size}x{args.image_size}, device {args.device} ({device_name}), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    if rows and rows[0].get("reserved_bytes") is not None:
        print(reserved_markdown(rows) + "\n")
    print(markdown(rows))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
