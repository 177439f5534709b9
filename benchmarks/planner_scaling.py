"""Wall time of the exact planners against the number of stages (not a timed test: a table to read).

    uv run python benchmarks/planner_scaling.py            # cubic at 50..400, linear at 10^3..10^6,
                                                           # the budget frontier at 100..2000
    uv run python benchmarks/planner_scaling.py --quick    # smaller sizes, for a smoke run

Traces are random (seeded): output and saved bytes drawn log-uniformly between 1 KiB and 64 MiB, so sizes
span the range of real networks. Only the planner call is timed; building the trace is not. Each size runs
``--repeat`` times and the best time is kept (the least disturbed by the rest of the machine).
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from collections.abc import Callable, Sequence

from remat.client.planning.planners import budget, cubic, linear
from remat.client.trace import Stage, Trace


def random_trace(n: int, seed: int) -> Trace:
    """A trace of n stages with log-uniform sizes, built without JSON validation (it is the timed code's input)."""
    rng = random.Random(seed)

    def size() -> int:
        return int(2 ** rng.uniform(10, 26))

    stages = tuple(Stage(name=f"s{i}", output_bytes=size(), saved_bytes=size(), saves_input=rng.random() < 0.5,
                         saves_output=rng.random() < 0.3, forward_ms=rng.uniform(0.05, 5.0)) for i in range(n))
    return Trace(input_bytes=size(), stages=stages)


def time_planner(fn: Callable[[Trace], tuple[int, ...]], n: int, repeat: int) -> float:
    trace = random_trace(n, seed=n)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(trace)
        best = min(best, time.perf_counter() - start)
    return best


def print_table(name: str, fn: Callable[[Trace], tuple[int, ...]], sizes: Sequence[int], repeat: int) -> None:
    """Print a markdown table row by row, so a long run shows progress."""
    print("| planner | n | seconds | growth vs previous n |\n|---|---:|---:|---:|", flush=True)
    previous: float | None = None
    for n in sizes:
        seconds = time_planner(fn, n, repeat)
        growth = f"×{seconds / previous:.1f}" if previous else "—"
        print(f"| {name} | {n:,} | {seconds:.3f} | {growth} |", flush=True)
        previous = seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cubic_sizes = [25, 50, 100] if args.quick else [50, 100, 200, 400]
    linear_sizes = [10**3, 10**4] if args.quick else [10**3, 10**4, 10**5, 10**6]
    print(f"# planner scaling on {platform.node()} ({platform.processor() or platform.machine()}), "
          f"Python {platform.python_version()}, best of {args.repeat}\n")
    print_table("cubic", cubic.plan, cubic_sizes, args.repeat)
    print()
    print_table("linear", linear.plan, linear_sizes, args.repeat)
    print()
    frontier_sizes = [100, 200] if args.quick else [100, 200, 500, 1000, 2000]
    print_table("budget (whole frontier)", budget.pareto_frontier, frontier_sizes, args.repeat)


if __name__ == "__main__":
    main()
