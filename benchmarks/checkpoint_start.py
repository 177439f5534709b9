"""What ``remat.client.checkpoint`` adds to a training script's start on a plan-cache hit.

Each run is a fresh interpreter, as a training job is: it imports torch, builds the model and one batch
(the baseline), then imports remat.client and calls ``checkpoint`` with the plan already in the disk cache.
The figure is the time from after the batch exists to after ``checkpoint`` returns, split into the import and
the call; the median of ``--runs`` fresh interpreters. One warm-up run fills the cache first. Every module is
compiled from source in each interpreter unless ``--bytecode`` (then the warm-up writes the bytecode the
timed runs read; benchmarks/child_bytecode.py).

    uv run python benchmarks/checkpoint_start.py                  # the user model of the tests, and resnet18
    uv run python benchmarks/checkpoint_start.py --runs 9
    uv run python benchmarks/checkpoint_start.py --derived        # the hit of a plan derived at a new batch
    uv run python benchmarks/checkpoint_start.py --bytecode       # bytecode cached, as an ordinary install

With ``--derived`` the store first gets profiles at batch 2 and 4 (two runs of the script on a slice of the
batch), so the warm-up run at the full batch derives its trace instead of profiling (checked in the store), and
the timed runs hit that derived plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from child_bytecode import child_environment  # a sibling script, not a package

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
sys.path.insert(0, {root!r})
t_torch = time.perf_counter()
{build}
t_model = time.perf_counter()
import remat.client
t_import = time.perf_counter()
remat.client.checkpoint(model, x, cache_dir={cache!r})
t_call = time.perf_counter()
heavy = [m for m in ("sqlalchemy", "celery", "fastapi", "httpx") if m in sys.modules]
print(json.dumps({{"torch_s": t_torch - t0, "model_s": t_model - t_torch, "import_s": t_import - t_model,
                  "call_s": t_call - t_import, "heavy": heavy}}))
"""

MODELS = {
    "user model (tests/utils/user_model.py), 8x3x32x32":
        "from tests.utils.user_model import user_model, user_batches\nmodel = user_model()\nx = user_batches(1)[0][0]",
    "torchvision resnet18, 8x3x224x224":
        "import torchvision\nmodel = torchvision.models.resnet18()\nx = torch.randn(8, 3, 224, 224)",
    "torchvision resnet50, 32x3x224x224":
        "import torchvision\nmodel = torchvision.models.resnet50()\nx = torch.randn(32, 3, 224, 224)",
}


def run_child(build: str, cache: str, threads: int, bytecode: bool) -> dict:
    code = CHILD.format(threads=threads, root=str(ROOT), build=build, cache=cache)
    with child_environment(cache, bytecode=bytecode, REMAT_DATABASE_URL=f"sqlite:///{cache}/local.sqlite") as env:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                             cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_derived(cache: str) -> None:
    from sqlalchemy import select

    from remat.service.models import TraceRow
    from remat.service.store import PlanStore

    with PlanStore(f"sqlite:///{cache}/local.sqlite") as store, store.db.read_session() as session:
        derived = [m for (m,) in session.execute(select(TraceRow.trace_metadata)) if (m or {}).get("derived_from")]
    if len(derived) != 1:
        raise SystemExit(f"expected the full batch's trace to be derived, found {len(derived)} derived traces")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--derived", action="store_true", help="time the hit of a plan derived at a new batch size")
    parser.add_argument("--bytecode", action="store_true",
                        help="bytecode cached, as an ordinary install (default: every module compiled from source)")
    args = parser.parse_args()
    print("| model | import remat.client ms | checkpoint() on a cache hit ms | total added ms | "
          "sqlalchemy/celery/fastapi/httpx loaded |")
    print("|---|---|---|---|---|")
    for label, build in MODELS.items():
        with tempfile.TemporaryDirectory() as cache:
            if args.derived:
                for batch in (2, 4):
                    run_child(f"{build}\nx = x[:{batch}].contiguous()", cache, args.threads, args.bytecode)
            run_child(build, cache, args.threads, args.bytecode)  # profiles (or derives), fills the cache
            if args.derived:
                _check_derived(cache)
            runs = [run_child(build, cache, args.threads, args.bytecode) for _ in range(args.runs)]
        imp = statistics.median(r["import_s"] for r in runs) * 1e3
        call = statistics.median(r["call_s"] for r in runs) * 1e3
        total = statistics.median((r["import_s"] + r["call_s"]) for r in runs) * 1e3
        heavy = sorted({m for r in runs for m in r["heavy"]}) or ["none"]
        print(f"| {label} | {imp:.0f} | {call:.0f} | {total:.0f} | {', '.join(heavy)} |", flush=True)


if __name__ == "__main__":
    main()
