"""How far the best graph plan found can be from the best there is: the certified bound of the relaxed step.

For each model, at one size: the searched graph plan (``acg``) and the best chain plans' predicted peaks, the
step's forced memory (no plan of any kind goes below it, NOTE [forced memory]) and the relaxed step's MILP
bound (no one-level graph plan goes below it, NOTE [relaxed step]) with the solver's time, and the MILP's own
plan judged by the predictor. The slow path a worker runs with ``REMAT_CERTIFY_S``.

    uv run python benchmarks/certified_bound.py --models densenet121 --batch-size 32 --image-size 224 --seconds 300

docs/benchmarks.md ("The certified bound") holds the figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from remat.client.errors import PlanError
from remat.client.planning.graph_predict import forced_peak, predict_graph_peak
from remat.client.planning.relaxed_step import Relaxation, certified_bound
from remat.worker.graph_profile import executor_units

sys.path.insert(0, str(Path(__file__).parent))
from feng_huang_meter import describe_run, profiled_plans, size_arguments  # noqa: E402 - a sibling script, not a package

MIB = 2**20


def run(spec: str, args: argparse.Namespace) -> str:
    built, _, plans, profile_s, planning_s = profiled_plans(spec, args, ("linear", "nested", "acg"))
    searched = time.perf_counter()
    graph, profile = built.op_graph, built.graph_profile
    forced = forced_peak(profile).peak
    relax = Relaxation.of(profile, graph.vertex_nodes, graph.edges)
    built_s = time.perf_counter() - searched
    cert = certified_bound(relax, floor=forced, seconds=args.seconds)
    try:
        milp_plan = f"{predict_graph_peak(profile, executor_units(graph, cert.dropped or ())).peak / MIB:.1f} MiB"
    except PlanError as exc:
        milp_plan = f"refused by the executor ({str(exc)[:60]}…)"
    acg = plans["acg"].predicted_peak_bytes
    print(f"{spec}: {len(graph.vertex_nodes)} vertices; profile {profile_s:.0f} s, plans {planning_s:.1f} s, "
          f"relaxation {built_s:.1f} s, MILP {cert.seconds:.0f} s "
          f"({'solved' if cert.optimal else 'time limit'}); its relaxed best "
          f"{(cert.relaxed_best or 0) / MIB:.1f} MiB; its plan predicted {milp_plan}", file=sys.stderr)
    none = plans["acg"].baseline_peak_bytes
    return (f"| {spec} | {none / MIB:.1f} | {plans['linear'].predicted_peak_bytes / MIB:.1f} | "
            f"{plans['nested'].predicted_peak_bytes / MIB:.1f} | **{acg / MIB:.1f}** | {forced / MIB:.1f} "
            f"({1 - forced / acg:.0%}) | **{cert.bound / MIB:.1f}** ({1 - cert.bound / acg:.0%}) | "
            f"{cert.seconds:.0f} s{'' if cert.optimal else ', time limit'} |")


def main() -> None:
    parser = size_arguments(__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="the MILP's time limit per model")
    args = parser.parse_args()
    print(f"{describe_run(args)}, gradients kept; predicted peaks in MiB", file=sys.stderr)
    print("| model | none | `linear` | `nested` | `acg` | forced memory (gap to `acg`) | certified bound (gap) "
          "| MILP |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in args.models.split(","):
        print(run(spec.strip(), args), flush=True)


if __name__ == "__main__":
    main()
