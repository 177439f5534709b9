"""What a plan costs in step time, measured, beside what remat estimated, hand-written checkpointing of the same
segments and the unmodified model; and the estimate again from a profile taken beside a noisy neighbour.

For each model and size:

1. profile idle (trace A), then profile again while another process spins on a core (trace B);
2. take the frontier plans of trace A (at most ``--plans``, spread over the frontier, and ``linear``);
3. time, in the same interleaved rounds (least of ``--rounds``, spread = median - least), idle: the unmodified
   model (``model(x)``), remat's ``none`` plan, every plan applied by remat, and every plan as plain
   ``torch.utils.checkpoint(use_reentrant=False)`` over the same stage segments (hand-written, without remat's
   buffer restore);
4. print per plan: estimated ``recompute_ms`` from A and B, measured overhead (plan - none) with its spread,
   the error against the target (within 25%, or 3 ms where the overhead is under 12 ms), and applied /
   hand-written; per model, Spearman's rank correlation of A's and B's estimates over the plans.

    uv run python benchmarks/step_overhead.py --models resnet50,resnet152,densenet121,vit_b_16 --sizes 1x64,4x128

docs/benchmarks.md ("Step time") holds the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from remat.client.graph import built_model
from remat.client.plan import Plan
from remat.client.planning.plans import frontier_plans, make_plan
from remat.client.planning.recompute_time import recompute_ms
from remat.client.request import ModelRequest
from remat.worker import pipeline
from remat.worker.measure import time_plans_spread

TOLERANCE = 0.25
SMALL_OVERHEAD_MS = 12.0
SMALL_TOLERANCE_MS = 3.0


class HandWritten:
    """The chain's stages under plain non-reentrant ``torch.utils.checkpoint``, segment by segment."""

    def __init__(self, chain: Any) -> None:
        self.chain = chain

    def run(self, x: Any, checkpoints: Sequence[int] = ()) -> Any:
        n = self.chain.num_stages
        bounds = (0, *sorted(checkpoints), n)
        env: dict[str, Any] = {}
        for k in range(len(bounds) - 2):
            x, new = checkpoint(self.chain._segment, bounds[k] + 1, bounds[k + 1], x, dict(env), use_reentrant=False)
            env.update(new)
        return self.chain._run_stages(bounds[-2] + 1, n, x, env)


class Unmodified:
    """The model itself, whatever the checkpoints (the reference every overhead is read against)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def run(self, x: Any, checkpoints: Sequence[int] = ()) -> Any:
        return self.model(x)


@contextlib.contextmanager
def neighbour() -> Iterator[None]:
    """A CPU-bound process beside the profile: one core spinning in Python."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait()


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


def pick_plans(trace: Any, count: int) -> list[Plan]:
    """At most ``count`` frontier plans spread over the frontier (distinct checkpoints), and ``linear``."""
    front = sorted({p.checkpoints: p for p in frontier_plans(trace) if p.checkpoints}.values(),
                   key=lambda p: p.predicted_peak_bytes)
    if len(front) > count:
        front = [front[round(i * (len(front) - 1) / (count - 1))] for i in range(count)] if count > 1 else []
    linear = make_plan(trace, "linear")
    if linear.checkpoints and all(p.checkpoints != linear.checkpoints for p in front):
        front.append(linear)
    return front


def allocator_peak_mib(fn: Any) -> float:
    """Peak of the CPU allocator's bytes above their level when ``fn`` starts, from the profiler's allocation
    events: the one meter that sees what compiled (inductor) code allocates, as eager code's."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        stack.extend(node.children)
    allocations.sort()
    start = allocations[0][2] - allocations[0][1]
    return (max(total for _, _, total in allocations) - start) / 2**20


def compiled_rows(built: Any, plan: Plan, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """(allocator peak MiB, least step ms of ``args.rounds``) eager and compiled, unmodified and with ``plan``
    applied; gradients kept allocated (zeroed in place) so that the peak is the step's activations."""
    import copy

    from remat.client.apply_plan import apply

    x = built.example
    out: dict[str, tuple[float, float]] = {}
    for label, applied, compiled in (("eager none", False, False), ("eager linear", True, False),
                                     ("compiled none", False, True), ("compiled linear", True, True)):
        torch._dynamo.reset()
        model = copy.deepcopy(built.model).train()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        if applied:
            apply(model, plan, key=built.key, strict=False)
        run = torch.compile(model) if compiled else model

        def step(model: torch.nn.Module = model, run: Any = run) -> None:
            for p in model.parameters():
                p.grad.zero_()  # type: ignore[union-attr]
            run(x).sum().backward()

        step()
        step()
        peak = allocator_peak_mib(step)
        times = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            step()
            times.append((time.perf_counter() - started) * 1e3)
        out[label] = (peak, min(times))
    return out


def in_target(estimate: float, measured: float) -> bool:
    if measured < SMALL_OVERHEAD_MS:
        return abs(estimate - measured) <= SMALL_TOLERANCE_MS
    return abs(estimate - measured) <= TOLERANCE * measured


def run_one(name: str, batch: int, hw: int, args: argparse.Namespace) -> dict[str, Any]:
    # torchvision's ViTs take their image size as an argument (they train at 224² otherwise).
    kwargs = {"image_size": hw} if name.startswith("vit_") else {}
    request = ModelRequest(spec=name, batch_size=batch, sample_shape=(3, hw, hw), model_kwargs=kwargs,
                           grads=args.grads)
    built = built_model.build(request)
    started = time.perf_counter()
    idle = pipeline.profile(built)
    profile_s = time.perf_counter() - started
    with neighbour():
        noisy = pipeline.profile(built)
    plans = pick_plans(idle, args.plans)
    chain, hand, plain = built.chain, HandWritten(built.chain), Unmodified(built.model)
    runners = [plain, chain] + [chain] * len(plans) + [hand] * len(plans)
    cuts = [(), ()] + [p.checkpoints for p in plans] * 2
    times = time_plans_spread(built.model, built.example, cuts, runners=runners, rounds=args.rounds,
                              budget_s=args.budget)
    unmodified, none = times[0], times[1]
    noisy_times = None
    if args.noisy_measure:
        with neighbour():
            noisy_times = time_plans_spread(built.model, built.example, cuts[: 2 + len(plans)],
                                            runners=runners[: 2 + len(plans)], rounds=args.rounds,
                                            budget_s=args.budget)
    rows = []
    for k, plan in enumerate(plans):
        applied, handwritten = times[2 + k], times[2 + len(plans) + k]
        overhead = applied[0] - none[0]
        est_a = plan.recompute_ms or 0.0
        est_b = recompute_ms(noisy, plan.checkpoints) or 0.0
        rows.append({"plan": plan.label, "k": len(plan.checkpoints), "last": max(plan.checkpoints),
                     "peak_mib": plan.predicted_peak_bytes / 2**20, "estimate_idle": est_a, "estimate_noisy": est_b,
                     "overhead": overhead, "spread": max(applied[1], none[1]),
                     "hand_overhead": handwritten[0] - none[0], "applied_vs_hand": applied[0] / handwritten[0],
                     "in_target": in_target(est_a, overhead), "in_target_noisy": in_target(est_b, overhead)})
        if noisy_times is not None:
            noisy_overhead = noisy_times[2 + k][0] - noisy_times[1][0]
            rows[-1].update(noisy_overhead=noisy_overhead, noisy_spread=max(noisy_times[2 + k][1], noisy_times[1][1]),
                            in_target_noisy_vs_noisy=in_target(est_b, noisy_overhead))
    same_frontier = ({p.checkpoints for p in frontier_plans(idle)} == {p.checkpoints for p in frontier_plans(noisy)})
    rho = spearman([r["estimate_idle"] for r in rows], [r["estimate_noisy"] for r in rows]) if len(rows) > 1 else 1.0
    compiled = compiled_rows(built, make_plan(idle, "linear"), args) if args.compiled else None
    return {"model": name, "batch": batch, "hw": hw, "stages": idle.num_stages, "profile_s": profile_s,
            "compiled": compiled,
            "unmodified": unmodified, "none": none, "rows": rows, "spearman": rho, "same_frontier": same_frontier,
            "checkpoint_ms": (idle.checkpoint_ms, noisy.checkpoint_ms),
            "step_idle": idle.metadata.get("timing", {}).get("step_ms"),
            "step_noisy": noisy.metadata.get("timing", {}).get("step_ms")}


def print_result(r: dict[str, Any]) -> None:
    print(f"\n### {r['model']}, batch {r['batch']}, {r['hw']}², {r['stages']} stages "
          f"(profile {r['profile_s']:.0f} s; profiled step {r['step_idle']:.1f} ms idle, {r['step_noisy']:.1f} ms "
          f"beside the neighbour; checkpoint_ms {r['checkpoint_ms'][0]:.2f} / {r['checkpoint_ms'][1]:.2f})\n")
    print(f"unmodified {r['unmodified'][0]:.1f} ms ± {r['unmodified'][1]:.1f}, remat none {r['none'][0]:.1f} ms "
          f"± {r['none'][1]:.1f}; Spearman idle vs noisy estimates {r['spearman']:.3f}; same frontier: "
          f"{'yes' if r['same_frontier'] else 'no'}\n")
    print("| plan | checkpoints | last | predicted peak MiB | estimate idle ms | estimate noisy ms | measured "
          "overhead ms (spread) | in target idle / noisy | hand-written overhead ms | applied / hand |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    if not r["rows"]:
        print("| (the frontier is the no-checkpoint plan alone: no checkpoint lowers the predicted peak) |"
              + " |" * 9)
    for row in r["rows"]:
        print(f"| {row['plan']} | {row['k']} | {row['last']} | {row['peak_mib']:.1f} | {row['estimate_idle']:.1f} | "
              f"{row['estimate_noisy']:.1f} | {row['overhead']:.1f} ({row['spread']:.1f}) | "
              f"{'yes' if row['in_target'] else 'no'} / {'yes' if row['in_target_noisy'] else 'no'} | "
              f"{row['hand_overhead']:.1f} | {row['applied_vs_hand']:.3f} |")
    if r["rows"] and "noisy_overhead" in r["rows"][0]:
        print("\nBeside the neighbour, the noisy profile's estimate against the overhead measured there too:\n")
        print("| plan | estimate noisy ms | overhead measured beside the neighbour ms (spread) | in target |")
        print("|---|---:|---:|---|")
        for row in r["rows"]:
            print(f"| {row['plan']} | {row['estimate_noisy']:.1f} | {row['noisy_overhead']:.1f} "
                  f"({row['noisy_spread']:.1f}) | {'yes' if row['in_target_noisy_vs_noisy'] else 'no'} |")
        print()
    if r["compiled"]:
        c = r["compiled"]
        print(f"\ntorch.compile, linear plan: allocator peak above the step's start / step time — eager unmodified "
              f"{c['eager none'][0]:.1f} MiB / {c['eager none'][1]:.1f} ms, eager applied "
              f"{c['eager linear'][0]:.1f} MiB / {c['eager linear'][1]:.1f} ms, compiled unmodified "
              f"{c['compiled none'][0]:.1f} MiB / {c['compiled none'][1]:.1f} ms, compiled applied "
              f"{c['compiled linear'][0]:.1f} MiB / {c['compiled linear'][1]:.1f} ms\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,resnet152,densenet121,vit_b_16")
    parser.add_argument("--sizes", default="1x64,4x128", help="BATCHxSIDE, comma-separated")
    parser.add_argument("--plans", type=int, default=6, help="frontier plans per model (and linear)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds of timed rounds after two")
    parser.add_argument("--grads", choices=("none", "kept"), default="none")
    parser.add_argument("--noisy-measure", action="store_true",
                        help="also time the plans beside the neighbour (the noisy profile's own conditions)")
    parser.add_argument("--compiled", action="store_true",
                        help="torch.compile rows for the linear plan: step time and allocator peak")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for size in args.sizes.split(","):
        batch, hw = (int(v) for v in size.split("x"))
        for name in args.models.split(","):
            print_result(run_one(name, batch, hw, args))


if __name__ == "__main__":
    main()
