"""Predicted against measured activation peaks of op-graph plans, and a plan search judged by the predictor.

For each model: one profiled step of the unmodified model (``remat.worker.graph_profile.profile_graph``),
then for each plan — no checkpointing, acg's classic plan, random valid dropped sets (uniform subsets, and
acg's plans for randomly perturbed vertex weights, which drop far more) — the predicted peak
(``remat.client.planning.graph_predict.predict_graph_peak``, pure Python) beside the peak ``measure_step`` measures.
With ``--search`` it also runs ``search_plan`` and measures its plan's cut against no checkpointing.

    uv run python benchmarks/graph_predict.py --models tests.utils.nas_cell:nas_net,resnet18 --random 3
    uv run python benchmarks/graph_predict.py --models densenet121,resnet152 --random 0 --search --evaluations 400

Batch 2, 64x64, grads kept, one CPU thread by default (the machine is shared).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.utils.nas_cell as a model spec

from remat.client.errors import PlanError  # noqa: E402
from remat.client.graph.op_graph import build_op_graph  # noqa: E402
from remat.client.model_spec import build_model  # noqa: E402
from remat.client.planning.graph_predict import predict_graph_peak, search_plan  # noqa: E402
from remat.client.planning.planners.acg import plan_graph  # noqa: E402
from remat.worker.graph_profile import executor_units, profile_graph  # noqa: E402
from remat.worker.measure import measure_step  # noqa: E402

MIB = 1024 * 1024


def _dropped(gp: object) -> list[int]:
    return sorted(v for seg in gp.segments for v in seg.interior)  # type: ignore[attr-defined]


def random_plans(graph: object, count: int, seed: int) -> dict[str, list[int]]:
    """``count`` uniform random valid subsets and ``count`` acg plans of randomly perturbed weights."""
    rng = random.Random(seed)
    plans: dict[str, list[int]] = {}
    tries = 0
    while sum(k.startswith("uniform") for k in plans) < count and tries < 200 * max(count, 1):
        tries += 1
        size = rng.randint(1, max(1, (graph.sink - 1) // 3))  # type: ignore[attr-defined]
        d = sorted(rng.sample(range(1, graph.sink), size))  # type: ignore[attr-defined]
        try:
            executor_units(graph, d)  # type: ignore[arg-type]
            graph._build_executor(tuple(d))  # type: ignore[attr-defined] # also refuses reordered random ops
        except PlanError:
            continue
        plans[f"uniform{len(plans)}"] = d
    for k in range(count):
        w = [int(x * rng.uniform(0.05, 3.0)) for x in graph.weights]  # type: ignore[attr-defined]
        d = _dropped(plan_graph(w, graph.edges))  # type: ignore[attr-defined]
        try:
            executor_units(graph, d)  # type: ignore[arg-type]
        except PlanError:
            continue
        plans[f"acg-perturbed{k}"] = d
    return plans


def run(spec: str, *, batch_size: int, image_size: int, grads: str, count: int, seed: int, search: bool,
        evaluations: int) -> None:
    torch.manual_seed(0)
    kwargs = {"aux_logits": True, "init_weights": False} if spec == "googlenet" else {}
    model = build_model(spec, kwargs).train()
    x = torch.randn(batch_size, 3, image_size, image_size)
    graph = build_op_graph(model, x)
    started = time.perf_counter()
    profile = profile_graph(model, x, graph, grads=grads)
    profile_s = time.perf_counter() - started
    name = spec.rsplit(":", 1)[-1]
    print(f"<!-- {name}: {graph.num_vertices} vertices, profile {profile_s:.1f} s, its own step "
          f"{profile.measured_peak_bytes / MIB:.3f} MiB -->", flush=True)
    plans = {"none": [], "acg": _dropped(plan_graph(graph.weights, graph.edges))}
    plans.update(random_plans(graph, count, seed))
    base = None
    for label, dropped in plans.items():
        started = time.perf_counter()
        pred = predict_graph_peak(profile, executor_units(graph, dropped))
        predict_ms = (time.perf_counter() - started) * 1000
        measured = measure_step(model, x, dropped, grads=grads, chain=graph, baseline=False,
                                timing_repeats=0).measured_peak_bytes
        base = measured if label == "none" else base
        err = pred.peak / measured - 1
        print(f"| {name} | {label} | {len(dropped)} | {len(graph.calls(dropped)) if dropped else 0} | "
              f"{pred.peak / MIB:.3f} | {measured / MIB:.3f} | {err:+.3%} | {predict_ms:.0f} | {pred.where} |",
              flush=True)
    if search and base:
        started = time.perf_counter()
        result = search_plan(profile, graph.weights, graph.edges, functools.partial(executor_units, graph),
                             vertex_nodes=graph.vertex_nodes, max_evaluations=evaluations)
        search_s = time.perf_counter() - started
        m = measure_step(model, x, result.dropped, grads=grads, chain=graph, baseline=False, timing_repeats=0)
        acg_measured = measure_step(model, x, plans["acg"], grads=grads, chain=graph, baseline=False,
                                    timing_repeats=0).measured_peak_bytes
        print(f"\nsearch {name}: {result.source}; {result.evaluated} plans judged in {search_s:.0f} s; "
              f"{len(result.dropped)} dropped, {len(graph.calls(result.dropped))} calls")
        print(f"  predicted {result.prediction.peak / MIB:.3f} MiB, measured {m.measured_peak_bytes / MIB:.3f} MiB "
              f"(error {result.prediction.peak / m.measured_peak_bytes - 1:+.3%}); no checkpointing "
              f"{base / MIB:.3f} MiB; cut {1 - m.measured_peak_bytes / base:.1%} (acg classic "
              f"{1 - acg_measured / base:.1%}); peak at {result.prediction.where}")
        print(f"  dropped: {result.dropped}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tests.utils.nas_cell:nas_net,resnet18,resnet50,densenet121,googlenet")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--grads", default="kept", choices=("none", "kept"))
    parser.add_argument("--random", type=int, default=2, help="random plans of each kind per model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--search", action="store_true", help="also search a plan under the predictor")
    parser.add_argument("--evaluations", type=int, default=400, help="plans the search predicts per model")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch_size}, {args.image_size}², grads {args.grads}, CPU, torch {torch.__version__}\n")
    print("| model | plan | dropped | calls | predicted MiB | measured MiB | error | predict ms | peak event |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.models.split(","):
        run(spec, batch_size=args.batch_size, image_size=args.image_size, grads=args.grads, count=args.random,
            seed=args.seed, search=args.search, evaluations=args.evaluations)


if __name__ == "__main__":
    main()
