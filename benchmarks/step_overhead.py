"""What a plan costs in step time, measured, beside what remat estimated, hand-written checkpointing of the same
segments and the unmodified model; and the estimate again from a profile taken beside a noisy neighbour.

For each model and size:

1. profile idle (trace A), then profile again while another process spins on a core (trace B);
2. take the frontier plans of trace A (at most ``--plans``, spread over the frontier, and ``linear``);
3. time, in the same interleaved rounds (least of ``--rounds``, spread = median - least), idle: the unmodified
   model (``model(x)``), remat's ``none`` plan, every plan applied by remat, and every plan as plain
   ``torch.utils.checkpoint(use_reentrant=False)`` over the same stage segments (hand-written, without remat's
   buffer restore);
4. print per plan: estimated ``recompute_ms`` from A and B, measured overhead (plan - none) with its spread
   and read round by round (paired: the median of plan / none within a round, times none's least; bracketed:
   the median over the rounds of the plan's step less the mean of the ``none`` steps run just before and after it),
   the error against the target (within 25%, or 3 ms where the overhead is under 12 ms), and applied /
   hand-written; per model, Spearman's rank correlation of A's and B's estimates over the plans.

    uv run python benchmarks/step_overhead.py --models resnet50,resnet152,densenet121,vit_b_16 --sizes 1x64,4x128

On CUDA (``--device cuda``, ``--dtype autocast_bfloat16``) the same table is timed with device events, each
plan's peak is measured with the caching allocator, ``--budget-fractions`` adds the budget plans the issue's
targets name (``0.5``: the least-recompute plan within half of the no-checkpoint peak), ``--variants`` adds
diagnostic runners for the ``linear`` plan (hand-written without RNG preservation, remat without its
BatchNorm restore) and ``--torch-profile DIR`` writes where one step's time goes (host vs device, kernels,
launches, synchronisations) for the unmodified model and the ``linear`` plan, applied and hand-written:

    python benchmarks/step_overhead.py --device cuda --grads kept --models resnet152 --sizes 16x224 \
        --plans 0 --budget-fractions 0.5 --skip-noisy --variants --torch-profile out/

docs/benchmarks.md ("Step time") holds the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from remat.client.budget_spec import BudgetInfeasibleError
from remat.client.graph import built_model
from remat.client.host_memory import host_malloc, keep_freed_memory
from remat.client.plan import Plan
from remat.client.planning.plans import frontier_plans, make_budget_plan, make_plan
from remat.client.planning.recompute_time import recompute_ms
from remat.client.precision import autocast_context
from remat.client.request import ModelRequest
from remat.client.trace import Trace
from remat.worker import pipeline
from remat.worker.measure import gradient_check, measure_step, time_plans_rounds
from remat.worker.profilers import run_queue, step_timing
from remat.worker.profilers.step_timing import bracketed_overhead

TOLERANCE = 0.25
SMALL_OVERHEAD_MS = 12.0
SMALL_TOLERANCE_MS = 3.0


class HandWritten:
    """The chain's stages under plain ``torch.utils.checkpoint``, segment by segment: non-reentrant, or with
    ``reentrant`` (a diagnostic: what checkpointing costs without a Python hook per saved tensor).

    A reentrant segment runs its forward without grad and, in backward, re-runs it with grad and backpropagates
    it on its own; the non-reentrant one records the segment's graph in forward with a pack hook per saved
    tensor and unpacks each through a hook in backward. The price of reentrant: the segment's output and its
    gradient stay alive through the segment's whole backward (the output is the inner backward's root, the
    gradient an argument of the outer node's call), which is why remat's executor does not use it; the
    variant's measured peak shows that price beside its time. A dummy input that requires grad keeps the
    first segment's parameters in the graph (a reentrant segment whose inputs need no grad gets no backward)."""

    def __init__(self, chain: Any, *, preserve_rng_state: bool = True, reentrant: bool = False) -> None:
        self.chain = chain
        self.preserve_rng_state = preserve_rng_state
        self.reentrant = reentrant

    def run(self, x: Any, checkpoints: Sequence[int] = ()) -> Any:
        n = self.chain.num_stages
        bounds = (0, *sorted(checkpoints), n)
        env: dict[str, Any] = {}
        dummy = (torch.empty(0, device=x.device, requires_grad=True),) if self.reentrant else ()
        for k in range(len(bounds) - 2):
            x, new = checkpoint(self._segment, bounds[k] + 1, bounds[k + 1], *dummy, x, dict(env),
                                use_reentrant=self.reentrant, preserve_rng_state=self.preserve_rng_state)
            env.update(new)
        return self.chain._run_stages(bounds[-2] + 1, n, x, env)

    def _segment(self, lo: int, hi: int, *inputs: Any) -> Any:
        *_, x, env = inputs  # without the reentrant dummy
        return self.chain._segment(lo, hi, x, env)


class WithoutRestore:
    """remat's chain with its BatchNorm buffer restore switched off (a diagnostic: what the restore costs).
    The context function is bound when a segment's forward runs, so patching it during ``run`` suffices."""

    def __init__(self, chain: Any) -> None:
        self.chain = chain

    def run(self, x: Any, checkpoints: Sequence[int] = ()) -> Any:
        from remat.client.graph import stage_chain

        original = stage_chain.recompute_contexts
        stage_chain.recompute_contexts = lambda slots: (contextlib.nullcontext(), contextlib.nullcontext())
        try:
            return self.chain.run(x, checkpoints)
        finally:
            stage_chain.recompute_contexts = original


class CompiledSegments:
    """remat's chain with each run of stages between two checkpoints, checkpointed or the last, run as one
    ``torch.compile``d function (inductor's defaults) inside the eager checkpoint: tried on 2026-12-07 and not
    adopted (docs/benchmarks.md, "torch.compile of an applied model"). Each segment gets a code object of its
    own: dynamo keeps compiled code per code object, and one shared by every segment passed its recompile limit
    (8), which sent the remaining segments back to eager without a word."""

    def __init__(self, chain: Any) -> None:
        self.chain = chain
        self.compiled: dict[tuple[int, int], Callable[..., Any]] = {}
        chain._run_handed = self._run_handed  # this chain's own, for every run (the applied model's forward)

    def _run_handed(self, lo: int, hi: int, handed: list[Any], env: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled():
            return type(self.chain)._run_handed(self.chain, lo, hi, handed, env)
        fn = self.compiled.get((lo, hi))
        if fn is None:
            fn = self.compiled[(lo, hi)] = torch.compile(self._segment_function(lo, hi))
        x, new = fn(handed.pop(), env)
        env.update(new)
        return x

    def _segment_function(self, lo: int, hi: int) -> Callable[..., Any]:
        chain, stages = self.chain, type(self.chain)._run_handed  # the class's: the stages one after another

        def segment(x: Any, env: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            local = dict(env)
            x = stages(chain, lo, hi, [x], local)
            return x, {k: v for k, v in local.items() if k not in env}

        code = segment.__code__.replace(co_name=f"segment_{lo}_{hi}")
        return types.FunctionType(code, segment.__globals__, code.co_name, None, segment.__closure__)


class Unmodified:
    """The model itself, whatever the checkpoints (the reference every overhead is read against)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def run(self, x: Any, checkpoints: Sequence[int] = ()) -> Any:
        return self.model(x)


@contextlib.contextmanager
def neighbour() -> Iterator[None]:
    """A CPU-bound process beside the profile: one core spinning in Python (until this process ends, killed
    included: it checks its parent every few ms)."""
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100_000): pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def wall_clock() -> Iterator[None]:
    """The CPU clock as it was before NOTE [ time beside a neighbour ]: wall time, the waits not read."""
    tasks = run_queue.TASKS
    run_queue.TASKS = "/nonexistent/task"
    try:
        yield
    finally:
        run_queue.TASKS = tasks


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


def cuda_peak_mib(fn: Any) -> float:
    """The caching allocator's peak during ``fn`` above what was allocated when it started."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2**20


def compiled_rows(built: Any, plan: Plan, args: argparse.Namespace) -> dict[str, tuple[float, float, float, float]]:
    """(allocator peak MiB, least and median step ms over ``args.rounds`` interleaved rounds, the first step's
    seconds) eager and compiled, unmodified and with ``plan`` applied. With ``--grads kept`` the gradients stay
    allocated (zeroed in place), so that the peak is the step's activations; with ``none`` they are set to None
    before each step (the peak holds the gradients born in backward, as the ``none`` prediction does). With
    ``--compiled applied`` the compiled unmodified model (minutes of inductor on a deep model) is left out;
    ``--compiled segments`` times the eager rows beside the plan with each segment compiled
    (``CompiledSegments``). Every variant is built and warmed first, then timed in rounds, one step of each per
    round: this VM's speed moves within a minute, and one variant's steps after another's read that too."""
    import copy

    from remat.client.apply_plan import applied_chain, apply

    x = built.example
    cuda = x.device.type == "cuda"
    modes = [("eager none", False, False), ("eager linear", True, False), ("compiled none", False, True),
             ("compiled linear", True, True)]
    if args.compiled == "applied":
        modes = [m for m in modes if m[0] != "compiled none"]
    if args.compiled == "segments":
        modes = [m for m in modes if not m[2]] + [("compiled segments linear", True, False)]
    kept = args.grads == "kept"
    torch._dynamo.reset()
    steps: dict[str, Callable[[], None]] = {}
    found: dict[str, tuple[float, float]] = {}
    for label, applied, compiled in modes:
        model = copy.deepcopy(built.model).train()
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if kept else None
        if applied:
            apply(model, plan, key=built.key, strict=False)
        if label == "compiled segments linear":
            CompiledSegments(applied_chain(model))
        run = torch.compile(model) if compiled else model

        def step(model: torch.nn.Module = model, run: Any = run) -> None:
            for p in model.parameters():
                if kept:
                    p.grad.zero_()  # type: ignore[union-attr]
                else:
                    p.grad = None
            with autocast_context(args.dtype, x.device.type):
                loss = run(x).float().sum()
            loss.backward()

        started = time.perf_counter()
        step()  # the compiler's work, where it compiles
        if cuda:
            torch.cuda.synchronize()
        first_s = time.perf_counter() - started
        step()
        found[label] = (cuda_peak_mib(step) if cuda else allocator_peak_mib(step), first_s)
        steps[label] = step
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(args.rounds):
        for label, step in steps.items():
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times[label].append((time.perf_counter() - started) * 1e3)
    return {label: (found[label][0], min(times[label]), statistics.median(times[label]), found[label][1])
            for label in steps}


def least_and_spread(rounds: Sequence[float]) -> tuple[float, float]:
    """The step's least over the rounds and the median's distance above it (``time_plans_spread``'s figures)."""
    return min(rounds), statistics.median(rounds) - min(rounds)


def paired_overhead(plan_rounds: Sequence[float], none_rounds: Sequence[float]) -> float:
    """The overhead read round by round: the median of plan / none within a round, times none's least. A slow
    minute of the host slows both steps of a round alike, so it cancels in the round's ratio, where the
    difference of two leasts taken in different rounds keeps it."""
    ratios = [p / n for p, n in zip(plan_rounds, none_rounds, strict=True) if n > 0]
    return (statistics.median(ratios) - 1.0) * min(none_rounds) if ratios else 0.0


@contextlib.contextmanager
def profile_reads() -> Iterator[list[tuple[list[float], list[float], list[float]]]]:
    """The step times of every overhead a profile reads (``step_timing.bracketed_overhead``), recorded as it reads them:
    (the checkpointed step's rounds, the ``none`` steps' just before, just after), the one-segment step's first."""
    read: list[tuple[list[float], list[float], list[float]]] = []
    original = step_timing.bracketed_overhead

    def recording(plan_ms: Sequence[float], before_ms: Sequence[float], after_ms: Sequence[float]) -> float:
        read.append((list(plan_ms), list(before_ms), list(after_ms)))
        return original(plan_ms, before_ms, after_ms)

    step_timing.bracketed_overhead = recording
    try:
        yield read
    finally:
        step_timing.bracketed_overhead = original


def leasts_overhead(plan_ms: Sequence[float], none_ms: Sequence[float]) -> float:
    """The overhead as the profiler read it before it bracketed its steps: the difference of the two leasts."""
    return min(plan_ms) - min(none_ms)


def estimate_read_as(trace: Trace, checkpoints: Sequence[int],
                     read: Sequence[tuple[list[float], list[float], list[float]]],
                     overhead: Callable[[Sequence[float], Sequence[float]], float] = leasts_overhead) -> float | None:
    """The plan's recompute estimate had the profile read its two overheads from the same rounds by ``overhead``
    (of the checkpointed step's rounds and every ``none`` step of the profile): the profiler's calibration
    (``step_timing.calibrate``) and the plan's estimate (``recompute_time.recompute_ms``) on them."""
    if not read:
        return None
    none_ms = [ms for _, before, after in read for ms in (*before, *after)]
    one = overhead(read[0][0], none_ms)
    every = overhead(read[1][0], none_ms) if len(read) > 1 else None
    forward = [s.forward_ms or 0.0 for s in trace.stages]
    recompute, checkpoint_ms, _ = step_timing.calibrate(forward, one, every)
    stages = tuple(dataclasses.replace(s, recompute_ms=r) for s, r in zip(trace.stages, recompute, strict=True))
    repriced = dataclasses.replace(trace, stages=stages, metadata={**trace.metadata, "checkpoint_ms": checkpoint_ms})
    return recompute_ms(repriced, checkpoints) or 0.0


def in_target(estimate: float, measured: float) -> bool:
    if measured < SMALL_OVERHEAD_MS:
        return abs(estimate - measured) <= SMALL_TOLERANCE_MS
    return abs(estimate - measured) <= TOLERANCE * measured


def where_time_goes(built: Any, runners: dict[str, tuple[Any, Sequence[int]]], args: argparse.Namespace,
                    out_dir: str) -> dict[str, dict[str, float]]:
    """One profiled training step per runner (after a warm one): wall time, the device's busy time (the union
    of its kernels' and copies' intervals), kernel count, launches, and the host's synchronisations; the
    top host ops by self time go to ``out_dir``. A step whose wall time far exceeds its device-busy time is
    host-bound: its cost is launches and Python, not arithmetic."""
    import os

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from remat.worker.measure import make_loss

    x = built.example
    cuda = x.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), autocast_context(args.dtype, x.device.type):
        loss_fn = make_loss(built.chain.run(x))
    os.makedirs(out_dir, exist_ok=True)
    summary: dict[str, dict[str, float]] = {}
    for label, (runner, cps) in runners.items():
        def step(runner: Any = runner, cps: Sequence[int] = cps) -> None:
            for p in built.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            with autocast_context(args.dtype, x.device.type):
                loss = loss_fn(runner.run(x, cps))
            loss.backward()
            if cuda:
                torch.cuda.synchronize()

        step()
        step()
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            step()
        wall = (time.perf_counter() - started) * 1e3
        events = prof.events()
        device = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
        busy, cursor = 0.0, float("-inf")
        for start, end in device:
            if end > cursor:
                busy += end - max(start, cursor)
                cursor = end
        host = [e for e in events if e.device_type == DeviceType.CPU]
        syncs = [e for e in host if "Synchronize" in e.name or "Memcpy" in e.name or e.name == "aten::item"
                 or e.name == "aten::_local_scalar_dense"]
        summary[label] = {
            "wall_ms": wall, "device_busy_ms": busy / 1e3, "device_ops": float(len(device)),
            "launches": float(sum(1 for e in host if "LaunchKernel" in e.name or e.name.startswith("cuLaunch"))),
            "syncs": float(len(syncs)), "sync_ms": sum(e.cpu_time_total for e in syncs) / 1e3,
            "aten_ops": float(sum(1 for e in host if e.name.startswith("aten::"))),
        }
        safe = "".join(c if c.isalnum() else "_" for c in label)
        with open(os.path.join(out_dir, f"{built.request.name}_{x.shape[0]}_{args.dtype}_{safe}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            if cuda:
                f.write("\n")
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    return summary


def run_one(name: str, batch: int, hw: int, args: argparse.Namespace) -> dict[str, Any]:
    # torchvision's ViTs take their image size as an argument (they train at 224² otherwise).
    kwargs = {"image_size": hw} if name.startswith("vit_") else {}
    kwargs.update(args.model_kwargs)
    request = ModelRequest(spec=name, batch_size=batch, sample_shape=(3, hw, hw), model_kwargs=kwargs,
                           grads=args.grads, device=args.device, dtype=args.dtype)
    built = built_model.build(request)
    started = time.perf_counter()
    with profile_reads() as idle_read:
        idle = pipeline.profile(built)
    profile_s = time.perf_counter() - started
    noisy_wall = None
    if args.skip_noisy:
        noisy = idle
    else:
        with neighbour():
            noisy = pipeline.profile(built)
            if args.wall_clock:
                with wall_clock():
                    noisy_wall = pipeline.profile(built)
    plans = pick_plans(idle, args.plans)
    none_peak = make_plan(idle, "none").predicted_peak_bytes
    names: dict[tuple[int, ...], str] = {}
    for fraction in (float(f) for f in args.budget_fractions.split(",") if f):
        try:
            plan = make_budget_plan(idle, max(1, int(none_peak * fraction)))
        except BudgetInfeasibleError as exc:
            print(f"{name}: no budget plan at {fraction:.0%}: {exc}")
            continue
        if plan.checkpoints and all(p.checkpoints != plan.checkpoints for p in plans):
            plans.append(plan)
        names.setdefault(plan.checkpoints, f"budget {fraction:.0%} ({plan.label})")
    chain, hand, plain = built.chain, HandWritten(built.chain), Unmodified(built.model)
    # Every plan's step, applied then hand-written, is followed by a step of remat's ``none``, so that each has a
    # ``none`` step just before and just after it in every round (bracketed_overhead).
    count = len(plans)
    runners = [plain, chain] + [r for _ in plans for r in (chain, chain)] + [r for _ in plans for r in (hand, chain)]
    cuts = [(), ()] + [c for p in plans for c in (p.checkpoints, ())] * 2
    applied_at = [2 + 2 * k for k in range(count)]
    hand_at = [2 + 2 * count + 2 * k for k in range(count)]
    linear = make_plan(idle, "linear")
    variants = {"hand-written, no RNG preservation": HandWritten(chain, preserve_rng_state=False),
                "remat, no BatchNorm restore": WithoutRestore(chain),
                "hand-written reentrant": HandWritten(chain, reentrant=True)}
    if not (args.variants and linear.checkpoints):
        variants = {}
    runners += list(variants.values())
    cuts += [linear.checkpoints] * len(variants)
    common = {"grads": args.grads, "device": args.device, "precision": args.dtype}
    rounds = time_plans_rounds(built.model, built.example, cuts, runners=runners, rounds=args.rounds,
                               budget_s=args.budget, **common)
    times = [least_and_spread(r) for r in rounds]
    unmodified, none = times[0], times[1]
    noisy_rounds = None
    if args.noisy_measure:
        with neighbour():
            noisy_rounds = time_plans_rounds(built.model, built.example, cuts[: 2 + 2 * count],
                                             runners=runners[: 2 + 2 * count], rounds=args.rounds,
                                             budget_s=args.budget, **common)
    cuda = args.device.startswith("cuda")

    def peak_mib(runner: Any, cps: Sequence[int]) -> float:
        return measure_step(built.model, built.example, cps, chain=runner, baseline=False,
                            **common).measured_peak_bytes / 2**20

    # The machine's speed at the measurement against the profile's: the no-checkpoint step read as the profile
    # reads it (step_timing.baseline_step over every ``none`` step of the rounds) over the profiled step.
    profiled_step = idle.metadata.get("timing", {}).get("step_ms") or 0.0
    measured_step, _ = step_timing.baseline_step([rounds[i] for i in range(1, 2 + 4 * count, 2)])
    speed = measured_step / profiled_step if profiled_step > 0 else 1.0
    rows = []
    for k, plan in enumerate(plans):
        applied, handwritten = times[applied_at[k]], times[hand_at[k]]
        overhead = applied[0] - none[0]
        est_a = plan.recompute_ms or 0.0
        est_leasts = estimate_read_as(idle, plan.checkpoints, idle_read)
        est_b = recompute_ms(noisy, plan.checkpoints) or 0.0
        est_wall = (recompute_ms(noisy_wall, plan.checkpoints) or 0.0) if noisy_wall is not None else None
        rows.append({"plan": names.get(plan.checkpoints, plan.label), "k": len(plan.checkpoints),
                     "last": max(plan.checkpoints),
                     "peak_mib": plan.predicted_peak_bytes / 2**20, "estimate_idle": est_a, "estimate_noisy": est_b,
                     "overhead": overhead, "spread": max(applied[1], none[1]),
                     "hand_overhead": handwritten[0] - none[0], "applied_vs_hand": applied[0] / handwritten[0],
                     "estimate_noisy_wall": est_wall,
                     "in_target": in_target(est_a, overhead), "in_target_noisy": in_target(est_b, overhead),
                     "step_ms": applied[0], "hand_ms": handwritten[0]})
        if cuda:
            rows[-1].update(measured_mib=peak_mib(chain, plan.checkpoints),
                            hand_measured_mib=peak_mib(hand, plan.checkpoints))
        i, j = applied_at[k], hand_at[k]
        paired = paired_overhead(rounds[i], rounds[1])
        bracketed = bracketed_overhead(rounds[i], rounds[i - 1], rounds[i + 1])
        rows[-1].update(paired_overhead=paired, in_target_paired=in_target(est_a, paired),
                        in_target_noisy_paired=in_target(est_b, paired),
                        bracketed_overhead=bracketed, in_target_bracketed=in_target(est_a, bracketed),
                        in_target_noisy_bracketed=in_target(est_b, bracketed),
                        hand_bracketed=bracketed_overhead(rounds[j], rounds[j - 1], rounds[j + 1]),
                        estimate_leasts=est_leasts,
                        in_target_leasts_bracketed=est_leasts is not None and in_target(est_leasts, bracketed))
        # The measurement's own repeatability: the same segments checkpointed by hand, read the same way, held to
        # the same tolerance (two measurements of one recompute).
        rows[-1]["hand_agrees"] = in_target(rows[-1]["hand_bracketed"], bracketed)
        # The estimate at the speed the machine ran the measurement at: scaled by the measured ``none`` step over
        # the profiled one. Not what the target holds (a plan's estimate is made before its training runs); what
        # it says is how much of a miss is the machine's speed between the profile and the measurement.
        at_speed = est_a * speed
        rows[-1].update(estimate_at_speed=at_speed, in_target_at_speed=in_target(at_speed, bracketed))
        if noisy_rounds is not None:
            noisy_times = [least_and_spread(r) for r in noisy_rounds]
            noisy_overhead = noisy_times[i][0] - noisy_times[1][0]
            noisy_paired = paired_overhead(noisy_rounds[i], noisy_rounds[1])
            noisy_bracketed = bracketed_overhead(noisy_rounds[i], noisy_rounds[i - 1], noisy_rounds[i + 1])
            rows[-1].update(noisy_bracketed=noisy_bracketed,
                            in_target_noisy_vs_noisy_bracketed=in_target(est_b, noisy_bracketed))
            rows[-1].update(noisy_overhead=noisy_overhead, noisy_spread=max(noisy_times[i][1], noisy_times[1][1]),
                            in_target_noisy_vs_noisy=in_target(est_b, noisy_overhead), noisy_paired=noisy_paired,
                            in_target_noisy_vs_noisy_paired=in_target(est_b, noisy_paired))
    variant_rows = {label: times[2 + 4 * count + i] for i, label in enumerate(variants)}
    variant_checks: dict[str, dict[str, float]] = {}
    if variants:
        # What each runner of the linear plan holds and computes: its measured peak and its largest gradient
        # difference from the unmodified step (0: bit-equal), beside remat's and hand-written's.
        checked = {"remat linear": chain, "hand-written linear": hand, **variants}
        diffs = gradient_check(built.model, built.example, [linear.checkpoints] * len(checked),
                               runners=list(checked.values()), **common)
        variant_checks = {label: {"peak_mib": peak_mib(runner, linear.checkpoints), "grad_diff": diff}
                          for (label, runner), (_, diff) in zip(checked.items(), diffs, strict=True)}
    same_frontier = ({p.checkpoints for p in frontier_plans(idle)} == {p.checkpoints for p in frontier_plans(noisy)})
    rho = spearman([r["estimate_idle"] for r in rows], [r["estimate_noisy"] for r in rows]) if len(rows) > 1 else 1.0
    profiled = None
    if args.torch_profile and linear.checkpoints:
        profiled = where_time_goes(built, {"unmodified": (plain, ()), "remat none": (chain, ()),
                                           "remat linear": (chain, linear.checkpoints),
                                           "hand-written linear": (hand, linear.checkpoints),
                                           **{label: (r, linear.checkpoints) for label, r in variants.items()}},
                                   args, args.torch_profile)
    compiled = compiled_rows(built, linear, args) if args.compiled else None
    return {"model": name, "batch": batch, "hw": hw, "stages": idle.num_stages, "profile_s": profile_s,
            "compiled": compiled, "variants": variant_rows, "variant_checks": variant_checks,
            "linear_predicted_mib": linear.predicted_peak_bytes / 2**20, "profiled": profiled, "dtype": args.dtype,
            "none_mib": peak_mib(chain, ()) if cuda else None, "none_predicted_mib": none_peak / 2**20,
            "unmodified": unmodified, "none": none, "speed": speed, "rows": rows, "spearman": rho,
            "same_frontier": same_frontier,
            "checkpoint_ms": (idle.checkpoint_ms, noisy.checkpoint_ms),
            "step_idle": idle.metadata.get("timing", {}).get("step_ms"),
            "step_noisy": noisy.metadata.get("timing", {}).get("step_ms"),
            "step_noisy_wall": noisy_wall.metadata.get("timing", {}).get("step_ms") if noisy_wall else None,
            "waited_share": (idle.metadata.get("timing", {}).get("waited_share"),
                             noisy.metadata.get("timing", {}).get("waited_share"))}


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def print_result(r: dict[str, Any]) -> None:
    wall = f", {r['step_noisy_wall']:.1f} ms on the wall clock" if r["step_noisy_wall"] is not None else ""
    waited = " / ".join(f"{w:.0%}" if w is not None else "-" for w in r["waited_share"])
    print(f"\n### {r['model']}, batch {r['batch']}, {r['hw']}², {r['stages']} stages "
          f"(profile {r['profile_s']:.0f} s; profiled step {r['step_idle']:.1f} ms idle, {r['step_noisy']:.1f} ms "
          f"beside the neighbour{wall}; waited {waited}; checkpoint_ms {r['checkpoint_ms'][0]:.2f} / "
          f"{r['checkpoint_ms'][1]:.2f})\n")
    print(f"unmodified {r['unmodified'][0]:.1f} ms ± {r['unmodified'][1]:.1f}, remat none {r['none'][0]:.1f} ms "
          f"± {r['none'][1]:.1f}; Spearman idle vs noisy estimates {r['spearman']:.3f}; same frontier: "
          f"{'yes' if r['same_frontier'] else 'no'}\n")
    has_wall = any(row["estimate_noisy_wall"] is not None for row in r["rows"])
    print("| plan | checkpoints | last | predicted peak MiB | estimate idle ms (its rounds read as leasts) "
          "| estimate noisy ms | "
          + ("estimate noisy, wall clock ms | " if has_wall else "")
          + "measured overhead ms (spread) | paired ms | bracketed ms | in target idle / noisy (paired; bracketed) "
            "| hand-written overhead ms (bracketed) | applied / hand |")
    print("|---|---:|---:|---:|---:|---:|" + ("---:|" if has_wall else "") + "---:|---:|---:|---|---:|---:|")
    if not r["rows"]:
        print("| (the frontier is the no-checkpoint plan alone: no checkpoint lowers the predicted peak) |"
              + " |" * 10)
    for row in r["rows"]:
        wall_cell = f"{row['estimate_noisy_wall']:.1f} | " if has_wall else ""
        leasts = f" ({row['estimate_leasts']:.1f})" if row["estimate_leasts"] is not None else ""
        print(f"| {row['plan']} | {row['k']} | {row['last']} | {row['peak_mib']:.1f} | {row['estimate_idle']:.1f}"
              f"{leasts} | "
              f"{row['estimate_noisy']:.1f} | {wall_cell}{row['overhead']:.1f} ({row['spread']:.1f}) | "
              f"{row['paired_overhead']:.1f} | {row['bracketed_overhead']:.1f} | {_yes(row['in_target'])} / "
              f"{_yes(row['in_target_noisy'])} ({_yes(row['in_target_paired'])} / "
              f"{_yes(row['in_target_noisy_paired'])}; {_yes(row['in_target_bracketed'])} / "
              f"{_yes(row['in_target_noisy_bracketed'])}) | "
              f"{row['hand_overhead']:.1f} ({row['hand_bracketed']:.1f}) | {row['applied_vs_hand']:.3f} |")
    if r["rows"]:
        def count(flag: str) -> str:
            return f"{sum(bool(row[flag]) for row in r['rows'])} of {len(r['rows'])}"

        print(f"\nIn target against the bracketed overhead: idle profile {count('in_target_bracketed')}, the same "
              f"rounds read as leasts {count('in_target_leasts_bracketed')}, the profile beside the neighbour "
              f"{count('in_target_noisy_bracketed')}; hand-written checkpointing of the same segments "
              f"{count('hand_agrees')} (the measurement's own repeatability); the idle profile's estimates "
              f"scaled by the measured over the profiled step ({r['speed']:.2f}) {count('in_target_at_speed')}.")
    if r["rows"] and "noisy_overhead" in r["rows"][0]:
        print("\nBeside the neighbour, the noisy profile's estimate against the overhead measured there too:\n")
        print("| plan | estimate noisy ms | overhead measured beside the neighbour ms (spread) | paired ms | "
              "bracketed ms | in target (paired; bracketed) |")
        print("|---|---:|---:|---:|---:|---|")
        for row in r["rows"]:
            print(f"| {row['plan']} | {row['estimate_noisy']:.1f} | {row['noisy_overhead']:.1f} "
                  f"({row['noisy_spread']:.1f}) | {row['noisy_paired']:.1f} | {row['noisy_bracketed']:.1f} | "
                  f"{_yes(row['in_target_noisy_vs_noisy'])} ({_yes(row['in_target_noisy_vs_noisy_paired'])}; "
                  f"{_yes(row['in_target_noisy_vs_noisy_bracketed'])}) |")
        print()
    if r["none_mib"] is not None:
        unmodified = r["unmodified"][0]
        print(f"\nOn the device ({r['dtype']}): none {r['none_mib']:.0f} MiB measured "
              f"({r['none_predicted_mib']:.0f} predicted), unmodified step {unmodified:.1f} ms\n")
        print("| plan | measured MiB (predicted) | cut | step ms | vs unmodified | hand-written step ms (MiB) "
              "| applied / hand |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for row in r["rows"]:
            print(f"| {row['plan']} | {row['measured_mib']:.0f} ({row['peak_mib']:.0f}) | "
                  f"{1 - row['measured_mib'] / r['none_mib']:.1%} | {row['step_ms']:.1f} | "
                  f"{row['step_ms'] / unmodified - 1:+.1%} | {row['hand_ms']:.1f} ({row['hand_measured_mib']:.0f}) | "
                  f"{row['applied_vs_hand']:.3f} |")
    for label, (ms, spread) in r["variants"].items():
        print(f"variant, linear plan: {label}: {ms:.1f} ms ± {spread:.1f}")
    if r["variant_checks"]:
        print(f"\nlinear plan ({r['linear_predicted_mib']:.1f} MiB predicted), each runner's measured peak and "
              "largest gradient difference from the unmodified step:\n")
        print("| runner | measured peak MiB | largest gradient difference |")
        print("|---|---:|---:|")
        for label, v in r["variant_checks"].items():
            print(f"| {label} | {v['peak_mib']:.1f} | {v['grad_diff']:.1e} |")
    if r["profiled"]:
        print("\n| one profiled step | wall ms | device busy ms | device ops | launches | aten ops | syncs (ms) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for label, v in r["profiled"].items():
            print(f"| {label} | {v['wall_ms']:.1f} | {v['device_busy_ms']:.1f} | {v['device_ops']:.0f} | "
                  f"{v['launches']:.0f} | {v['aten_ops']:.0f} | {v['syncs']:.0f} ({v['sync_ms']:.1f}) |")
    if r["compiled"]:
        print("\ntorch.compile, linear plan: allocator peak above the step's start / least, median step of the "
              "interleaved rounds (first step) — "
              + ", ".join(f"{label} {peak:.1f} MiB / {least:.1f}, {median:.1f} ms ({first:.1f} s)"
                          for label, (peak, least, median, first) in r["compiled"].items()))
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
    parser.add_argument("--compiled", nargs="?", const="all", choices=("all", "applied", "segments"),
                        help="torch.compile rows for the linear plan: step time and allocator peak (applied: "
                             "leave out compiling the unmodified model; segments: eager rows and the plan with "
                             "each segment compiled, CompiledSegments)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32",
                        help="the step's precision(s), comma-separated, e.g. float32,autocast_bfloat16")
    parser.add_argument("--budget-fractions", default="",
                        help="also the budget plans at these shares of the no-checkpoint peak, e.g. 0.5")
    parser.add_argument("--skip-noisy", action="store_true", help="no profile beside a neighbour process")
    parser.add_argument("--wall-clock", action="store_true",
                        help="also profile beside the neighbour on the plain wall clock (the run-queue waits not "
                             "subtracted: NOTE [ time beside a neighbour ]), for the estimates it gives")
    parser.add_argument("--variants", action="store_true",
                        help="diagnostic runners for linear: no RNG preservation, no BatchNorm restore, "
                             "reentrant checkpointing; with each runner's measured peak and gradient difference")
    parser.add_argument("--model-kwargs", type=json.loads, default={},
                        help='JSON keyword arguments for every model\'s constructor, e.g. \'{"width_per_group": 4}\'')
    parser.add_argument("--torch-profile", metavar="DIR", help="where one step's time goes, per runner")
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON lines")
    parser.add_argument("--host-malloc", choices=("kept", "default"), default="kept",
                        help="kept: freed memory stays in the process, as in remat's workers and CLI (NOTE [ page "
                             "faults on CPU ]); default: glibc's dynamic thresholds")
    args = parser.parse_args(argv)
    if args.host_malloc == "kept":
        keep_freed_memory()
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    for dtype in args.dtype.split(","):
        args.dtype = dtype
        print(f"torch {torch.__version__}, {where}, {dtype}, grads {args.grads}, malloc: {host_malloc()}")
        for size in args.sizes.split(","):
            batch, hw = (int(v) for v in size.split("x"))
            for name in args.models.split(","):
                result = run_one(name, batch, hw, args)
                print_result(result)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(result, default=str) + "\n")

if __name__ == "__main__":
    main()
