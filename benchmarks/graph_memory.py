"""Graph plans against chain plans, measured: does cutting inside blocks beat the best chain plan?

For each model: the stage chain with ``none`` and ``linear`` (the exact chain optimum of the ``pytorch``
cost model), and the op graph with ``acg`` (Feng & Huang's planner on vertex output sizes, the classic
objective), each run as a real training step and measured (remat.worker.measure.measure_step, NOTE
[ measured peak ]). Prints a markdown table: measured activation peak, cut against no checkpointing, step
time and its overhead, the acg plan's classic value and solver time.

    uv run python benchmarks/graph_memory.py --models resnet50,densenet121 --batch-size 2 --image-size 64

Model specs are the CLI's (torchvision names, ``package.module:callable``); the DARTS-like cell model of
the tests is ``tests.utils.nas_cell:nas_net`` (run from the repository root).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.utils.nas_cell as a model spec

from remat.client.graph.op_graph import build_op_graph  # noqa: E402
from remat.client.graph.stage_graph import build_stage_chain  # noqa: E402
from remat.client.model_spec import build_model  # noqa: E402
from remat.client.planning.planners.acg import plan_graph  # noqa: E402
from remat.client.planning.plans import make_plan  # noqa: E402
from remat.worker.measure import measure_step  # noqa: E402
from remat.worker.profilers import profile  # noqa: E402

MIB = 1024 * 1024


def run(spec: str, *, batch_size: int, image_size: int, grads: str, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    kwargs = {"aux_logits": True, "init_weights": False} if spec in ("googlenet", "inception_v3") else {}
    model = build_model(spec, kwargs)
    model.train()
    x = torch.randn(batch_size, 3, image_size, image_size)
    chain = build_stage_chain(model, x)
    trace = profile(model, x, chain=chain, grads=grads, timing_repeats=0)
    linear = make_plan(trace, "linear", cost_model="pytorch")
    rows = []
    m = measure_step(model, x, linear.checkpoints, grads=grads, chain=chain, timing_repeats=repeats)
    base_peak, base_ms = m.baseline_measured_peak_bytes, m.baseline_step_ms
    rows.append({"model": spec, "plan": "none (chain)", "stages": chain.num_stages, "peak": base_peak,
                 "ms": base_ms})
    rows.append({"model": spec, "plan": "linear (chain)", "stages": chain.num_stages,
                 "peak": m.measured_peak_bytes, "ms": m.step_ms, "kept": len(linear.checkpoints)})
    graph = build_op_graph(model, x)
    started = time.perf_counter()
    gp = plan_graph(graph.weights, graph.edges)
    solve_s = time.perf_counter() - started
    dropped = sorted(v for seg in gp.segments for v in seg.interior)
    g = measure_step(model, x, dropped, grads=grads, chain=graph, timing_repeats=repeats, baseline=False)
    rows.append({"model": spec, "plan": "acg (graph)", "stages": graph.num_vertices, "peak": g.measured_peak_bytes,
                 "ms": g.step_ms, "kept": len(gp.kept) - 2, "classic": gp.value, "solve_s": solve_s,
                 "calls": len(graph.calls(dropped))})
    for row in rows:
        row["cut"] = 1 - row["peak"] / base_peak
        row["overhead"] = row["ms"] / base_ms - 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,resnet152,densenet121,googlenet,inception_v3,"
                                            "tests.utils.nas_cell:nas_net")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--grads", default="kept", choices=("none", "kept"))
    parser.add_argument("--timing-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"batch {args.batch_size}, {args.image_size}² (inception_v3: 299², which its auxiliary head needs), "
          f"grads {args.grads}, CPU, torch {torch.__version__}\n")
    print("| model | plan | vertices | kept | measured peak MiB | cut | step ms | overhead | acg solve s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.models.split(","):
        size = 299 if spec == "inception_v3" else args.image_size
        for r in run(spec, batch_size=args.batch_size, image_size=size, grads=args.grads,
                     repeats=args.timing_repeats):
            solve = f"{r['solve_s']:.3f}" if "solve_s" in r else ""
            print(f"| {r['model']} | {r['plan']} | {r['stages']} | {r.get('kept', '')} | {r['peak'] / MIB:.1f} | "
                  f"{r['cut']:.1%} | {r['ms']:.0f} | {r['overhead']:+.0%} | {solve} |", flush=True)


if __name__ == "__main__":
    main()
