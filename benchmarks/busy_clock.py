"""The CPU clock beside busy neighbours (NOTE [ time beside a neighbour ], worker/profilers/run_queue.py).

1. ``steps``: one model's training step (``model(x).sum().backward()``), timed ``--rounds`` times by the CPU
   backend's clock alone, then beside each load of ``--loads`` (``spin``: a Python process spinning on a core;
   ``torch``: a process multiplying matrices on torch's threads; ``idle``: nothing), and alone again. Per load:
   the least and median wall time, the least and median of the clock's time (wall less the run-queue waits it
   books), and the waited share.
2. ``profiles``: the model profiled ``--repeats`` times alone and beside one spinning process, alternately:
   per profile the profiled step, the one-segment overhead it calibrates the recompute by, the ratio it gives,
   the waited share, and the ``linear`` plan's estimated recompute: whether a profile beside the neighbour
   gives what one alone gives, within what profiles alone give each other; beside it, the estimate the same
   rounds give with both overheads read as the difference of two leasts (how the profiler read them before it
   bracketed its checkpointed steps, NOTE [ timing a plan ]), and each estimate's range and standard deviation
   over the profiles.

    uv run python benchmarks/busy_clock.py steps --model resnet50 --size 4x128 --rounds 12
    uv run python benchmarks/busy_clock.py profiles --model densenet121 --size 4x128 --repeats 3

docs/benchmarks.md ("Step time") holds the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torchvision

from remat.client.graph import built_model
from remat.client.host_memory import keep_freed_memory
from remat.client.planning.plans import make_plan
from remat.client.request import ModelRequest
from remat.worker import pipeline
from remat.worker.profilers.cpu import CpuBackend

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import estimate_read_as, profile_reads  # noqa: E402 - a sibling script, not a package

_UNTIL_PARENT_ENDS = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
LOADS = {
    "idle": [],
    "spin": [_UNTIL_PARENT_ENDS + "    for _ in range(100_000): pass"],
    "torch": [_UNTIL_PARENT_ENDS + "    import torch\n    a = torch.randn(512, 512)\n"
              "    for _ in range(100): a @ a"],
}


@contextlib.contextmanager
def load(spec: str) -> Iterator[None]:
    """``spin``, ``2spin``, ``torch``, ``idle``: processes that run until this one ends (killed included)."""
    count = int(spec[0]) if spec[0].isdigit() else 1
    codes = LOADS[spec.lstrip("0123456789")] * count
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in codes]
    try:
        time.sleep(1.0 if procs else 0.0)  # started and busy
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def steps(args: argparse.Namespace) -> None:
    batch, side = (int(v) for v in args.size.split("x"))
    # ViT and MaxViT take their image size (what `remat-client plan --input-shape` passes them too).
    sized = {"image_size": side} if args.model.startswith(("vit_", "maxvit")) else {}
    model = getattr(torchvision.models, args.model)(**sized)
    x = torch.randn(batch, 3, side, side)
    clock = CpuBackend()

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        model(x).sum().backward()

    print(f"{args.model}, batch {batch}, {side}², torch {torch.__version__} on {torch.get_num_threads()} threads; "
          f"{args.rounds} steps per load\n")
    print("| load | wall least ms | wall median ms | clock least ms | clock median ms | waited | neighbours |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec in ["idle", *args.loads.split(","), "idle"]:
        with load(spec):
            step()
            timed = [clock.timed(step) for _ in range(args.rounds)]
        wall, ms = [t.wall_ms for t in timed], [t.ms for t in timed]
        share = sum(t.waited_ms for t in timed) / sum(wall)
        counted = [t.neighbours for t in timed if t.neighbours is not None]
        neighbours = f"{statistics.mean(counted):.2f}" if counted else "-"
        print(f"| {spec} | {min(wall):.1f} | {statistics.median(wall):.1f} | {min(ms):.1f} | "
              f"{statistics.median(ms):.1f} | {share:.0%} | {neighbours} |", flush=True)


def profiles(args: argparse.Namespace) -> None:
    batch, side = (int(v) for v in args.size.split("x"))
    kwargs = {"image_size": side} if args.model.startswith("vit_") else {}
    request = ModelRequest(spec=args.model, batch_size=batch, sample_shape=(3, side, side), model_kwargs=kwargs,
                           grads=args.grads, device="cpu")
    built = built_model.build(request)
    print(f"{args.model}, batch {batch}, {side}², grads {args.grads}, torch {torch.__version__} on "
          f"{torch.get_num_threads()} threads\n")
    print("| profile | step ms | one-segment overhead ms | recompute / forward | waited | linear's recompute ms "
          "| same rounds, read as leasts |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    estimates: dict[str, list[float]] = {}
    for k in range(args.repeats):
        for spec in ("idle", "spin"):
            with load(spec), profile_reads() as read:
                trace = pipeline.profile(built)
            timing = trace.metadata["timing"]
            linear = make_plan(trace, "linear")
            as_leasts = estimate_read_as(trace, linear.checkpoints, read) or 0.0
            where = "alone" if spec == "idle" else "beside one spinning process"
            estimates.setdefault(f"{where}, bracketed", []).append(linear.recompute_ms or 0.0)
            estimates.setdefault(f"{where}, leasts", []).append(as_leasts)
            print(f"| {where} ({k + 1}) | "
                  f"{timing['step_ms']:.1f} | {timing.get('one_segment_overhead_ms', 0.0):.1f} | "
                  f"{timing.get('recompute_to_forward', 1.0):.2f} | {timing['waited_share']:.0%} | "
                  f"{linear.recompute_ms or 0.0:.1f} | {as_leasts:.1f} |", flush=True)
    print()
    for name, values in estimates.items():
        print(f"linear's recompute, {name}: {min(values):.1f}-{max(values):.1f} ms "
              f"(mean {statistics.mean(values):.1f}, sd {statistics.pstdev(values):.1f})")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("steps", "profiles"))
    parser.add_argument("--model", default="resnet50", help="a torchvision classifier")
    parser.add_argument("--size", default="4x128", help="BATCHxSIDE")
    parser.add_argument("--rounds", type=int, default=12, help="steps: timed steps per load")
    parser.add_argument("--loads", default="spin,2spin,3spin,torch",
                        help="steps: the loads, comma-separated (spin, 2spin, 3spin, torch)")
    parser.add_argument("--repeats", type=int, default=3, help="profiles: profiles alone and beside, each")
    parser.add_argument("--grads", choices=("none", "kept"), default="none")
    parser.add_argument("--host-malloc", choices=("kept", "default"), default="kept",
                        help="kept: freed memory stays in the process, as in remat's workers and CLI (NOTE [ page "
                             "faults on CPU ]); default: glibc's dynamic thresholds")
    args = parser.parse_args(argv)
    if args.host_malloc == "kept":
        keep_freed_memory()
    steps(args) if args.what == "steps" else profiles(args)


if __name__ == "__main__":
    main()
