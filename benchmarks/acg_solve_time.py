"""``acg``'s solver time on the op graph of every torchvision classifier (issue 10's "under 1 s" target).

For each model: build it (random weights), trace its op graph at batch 2 and its default CPU input (the
registry sweep's sizes: 128 px, ViT and Inception v3 at their own), then time Feng & Huang's division tree and
bound search (``plan_graph``, the classic objective) — the part of ``acg`` that runs wherever a trace carries a
graph, the service included. The predictor search that ``plan MODEL`` adds on CPU is bounded separately
(2,000 predictions, docs/algorithms.md). Memory and build times are not measured here.

    uv run python benchmarks/acg_solve_time.py                      # all classifiers, minutes on 2 cores
    uv run python benchmarks/acg_solve_time.py --models 'resnet*,densenet121'
"""

from __future__ import annotations

import argparse
import time

import torch

from remat.client.errors import RematError
from remat.client.graph.op_graph import build_op_graph
from remat.client.model_spec import build_model
from remat.client.planning.planners.acg import plan_graph
from remat.client.request import default_request
from remat.client.zoo_batch import select_models


def solve_time(name: str, repeats: int) -> tuple[int, float]:
    """(vertices, fastest of ``repeats`` solves in seconds) for one model's op graph."""
    torch.manual_seed(0)
    request = default_request(name, batch_size=2, sample_shape=None, device="cpu", grads="kept")
    model = build_model(request.spec, {}).train()
    x = torch.randn(request.input_shape)
    graph = build_op_graph(model, x)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        plan_graph(graph.weights, graph.edges)
        best = min(best, time.perf_counter() - started)
    return graph.num_vertices, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="glob(s), comma-separated (default: every classifier)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = select_models("torchvision", args.models)
    print("| model | op-graph vertices | acg solve ms |\n|---|---:|---:|")
    times: list[tuple[float, str]] = []
    for name in names:
        try:
            vertices, seconds = solve_time(name, args.repeats)
        except (RematError, RuntimeError) as exc:
            print(f"| {name} | — | refused: {str(exc).splitlines()[0][:80]} |", flush=True)
            continue
        times.append((seconds, name))
        print(f"| {name} | {vertices} | {seconds * 1000:.1f} |", flush=True)
    if times:
        slowest = max(times)
        print(f"\n{len(times)} models; slowest {slowest[1]} {slowest[0] * 1000:.1f} ms; "
              f"median {sorted(times)[len(times) // 2][0] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
