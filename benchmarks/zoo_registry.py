"""Every torchvision classifier through the pipeline: does it plan, what does `linear` save, how good is the
prediction — the registry table of docs/benchmarks.md.

Each model runs in its own process (one model's memory or crash cannot touch the next), at batch 2 and the
model's default CPU input (128 px, or its own where it only runs there: ViT, MaxViT, Inception v3), under
both gradient conventions: remat.worker.pipeline.run with the ``none`` and ``linear`` plans, each measured by
a real training step and gradient-checked against the step without checkpoints. The rows are the same
``ZooRow``s `remat-client zoo` prints; one JSON line per model and convention goes to ``--out`` as it finishes,
so a run cut short keeps what it measured and ``--resume`` continues it.

    uv run python benchmarks/zoo_registry.py --out registry.jsonl            # all 80 (hours on 2 cores)
    uv run python benchmarks/zoo_registry.py --out registry.jsonl --models 'resnet*,vit_b_16'
    uv run python benchmarks/zoo_registry.py --table registry.jsonl          # the markdown table
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
ALGORITHMS = ("none", "linear")


def run_one(model: str, grads: str, batch_size: int) -> dict[str, Any]:
    """One model under one gradient convention, in this process: its ZooRow plus the seconds it took."""
    import torch

    from remat.client.errors import RematError
    from remat.client.report import ModelReport
    from remat.client.request import default_request
    from remat.client.zoo_batch import ZooRow
    from remat.worker import pipeline

    torch.set_num_threads(1)  # steadier step times on a shared machine; the table says so
    started = time.perf_counter()
    request = default_request(model, batch_size=batch_size, sample_shape=None, device="cpu", grads=grads)
    try:
        result = pipeline.run(request, algorithms=list(ALGORITHMS), timing_rounds=2)
        report = ModelReport.from_measured(request, result.key.to_dict(), list(result.plans),
                                           dict(result.measurements), from_store=False,
                                           device_name=result.device_name)
        row = ZooRow.from_report(report).to_dict()
    except RematError as exc:
        row = ZooRow.failed(request.name, str(exc), request.input_shape).to_dict()
    return {**row, "grads": grads, "seconds": round(time.perf_counter() - started, 1),
            "torch_version": torch.__version__}


def sweep(models: list[str], *, out: Path, grads_list: list[str], batch_size: int, timeout_s: int,
          resume: bool) -> None:
    done: set[tuple[str, str]] = set()
    if resume and out.exists():
        for line in out.read_text().splitlines():
            entry = json.loads(line)
            done.add((entry["model"].removeprefix("torchvision:"), entry["grads"]))
    for model in models:
        for grads in grads_list:
            if (model, grads) in done:
                continue
            cmd = [sys.executable, __file__, "--one", model, "--grads", grads, "--batch-size", str(batch_size)]
            started = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode == 0 and lines:
                    entry = json.loads(lines[-1])
                else:
                    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                    entry = {"model": f"torchvision:{model}", "status": "failed", "grads": grads,
                             "reason": f"process exited {proc.returncode}: {tail[:300]}"}
            except subprocess.TimeoutExpired:
                entry = {"model": f"torchvision:{model}", "status": "failed", "grads": grads,
                         "reason": f"took more than {timeout_s} s"}
            entry.setdefault("seconds", round(time.perf_counter() - started, 1))
            with out.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            print(f"{model} grads={grads}: {entry['status']} in {entry['seconds']} s"
                  + (f" ({entry['reason']})" if entry.get("reason") else ""), file=sys.stderr, flush=True)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2%}" if abs(value) < 0.1 else f"{value:.1%}"


def table(path: Path) -> str:
    """Markdown: one line per model, both conventions side by side, then the counts."""
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for e in entries:
        by_model.setdefault(e["model"].removeprefix("torchvision:"), {})[e["grads"]] = e
    lines = ["| model | input | stages | none peak MiB (grads none / kept) | linear saving (none / kept) | "
             "prediction error (none / kept) | step overhead (none / kept) | grads equal | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    failed: list[str] = []
    planned = 0
    for model, conv in by_model.items():
        rows = [conv.get("none"), conv.get("kept")]
        bad = [r for r in rows if r is not None and r["status"] == "failed"]
        if bad:
            failed.append(f"{model}: {bad[0]['reason']}")
            continue
        ok = [r for r in rows if r is not None]
        if not ok:
            continue
        planned += 1
        shape = "×".join(str(d) for d in ok[0]["input_shape"])

        def pair(field: str, fmt: Any, rows: list[Any] = rows) -> str:
            return " / ".join("-" if r is None or r.get(field) is None else fmt(r[field]) for r in rows)

        grads_ok = all(r.get("grad_check_passed") for r in ok)
        peaks = pair("none_peak_bytes", lambda b: f"{b / MIB:.1f}")
        lines.append(f"| {model} | {shape} | {ok[0]['num_stages']} | {peaks}"
                     f" | {pair('saving', lambda v: f'{v:.1%}')} | {pair('prediction_error', lambda v: f'{v:+.2%}')}"
                     f" | {pair('overhead', lambda v: f'{v:+.0%}')} | {'yes' if grads_ok else 'NO'} | "
                     f"{sum(r['seconds'] for r in ok):.0f} |")
    lines.append("")
    lines.append(f"{planned} of {len(by_model)} models planned, applied and gradient-checked; {len(failed)} refused.")
    lines += [f"- {f}" for f in failed]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON lines written as models finish")
    parser.add_argument("--models", default=None, help="glob(s), comma-separated (default: the whole registry)")
    parser.add_argument("--grads", default="none,kept")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per model and convention")
    parser.add_argument("--resume", action="store_true", help="skip what --out already holds")
    parser.add_argument("--table", type=Path, help="print the markdown table of a finished --out file")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.grads, args.batch_size)))
        return 0
    if args.table:
        print(table(args.table))
        return 0
    if args.out is None:
        parser.error("--out FILE (or --table FILE) is needed")
    from remat.client.zoo_batch import select_models

    sweep(select_models("torchvision", args.models), out=args.out,
          grads_list=[g for g in args.grads.split(",") if g], batch_size=args.batch_size, timeout_s=args.timeout,
          resume=args.resume)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
