"""``remat.client.checkpoint`` across timm's architecture families: planned and trained bit-equal, or refused why.

timm registers over a thousand models in about a hundred modules (one architecture family each). This script
takes one small model of every module (the name with the smallest size word: atto, pico, nano, tiny, small,
…), builds it with random weights and 10 classes, gives ``checkpoint()`` one training batch of two images —
64 px, or the size a fixed-size model is built for at 64 px (``img_size=64``), or its own input size where
neither builds — and trains it beside an unmodified copy, from the same RNG state, for one step.

Reported per family: ``bit-equal`` (loss and every gradient ``torch.equal``), the applied ``linear`` plan's
stages and checkpoints with its predicted peak against the no-checkpoint peak, and the seconds
``checkpoint()`` took; or the one-line refusal, or ``no cut`` when the model trains without checkpoints (a
warning says why). Each model runs in its own process, with a time limit, from an empty plan cache and store.

    uv run python benchmarks/timm_breadth.py                  # every family (about an hour on 2 cores)
    uv run python benchmarks/timm_breadth.py --only vit,swin_transformer,resnet
    uv run python benchmarks/timm_breadth.py --json rows.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

SIZE_WORDS = ("atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "small", "mini", "lite", "t", "s", "b0", "18",
              "050", "100", "b", "m")
"""Words of a timm name that mark a small variant, smallest first; a name without any ranks last."""
SIDE = 64
BATCH = 2
CLASSES = 10


def _size_rank(name: str) -> tuple[int, int, str]:
    """Smaller first: the smallest size word (``xxs24`` counts as ``xxs``), then the shorter name."""
    words = name.replace(".", "_").split("_")
    ranks = [SIZE_WORDS.index(w if w in SIZE_WORDS else w.rstrip("0123456789")) for w in words
             if w in SIZE_WORDS or w.rstrip("0123456789") in SIZE_WORDS]
    return (min(ranks) if ranks else len(SIZE_WORDS), len(name), name)


def families() -> dict[str, str]:
    """timm module → its smallest-sounding model name (no pretrained tags), in module order."""
    import timm

    out = {}
    for module in sorted(timm.list_modules()):
        names = [n for n in timm.list_models(module=module) if "." not in n]
        if names:
            out[module] = min(names, key=_size_rank)
    return out


def _build(name: str) -> tuple[Any, Any, str]:
    """The model and a batch it takes: 64 px (or built for 64 px), else its configured input size."""
    import timm
    import torch

    cfg = timm.models.get_pretrained_cfg(name)
    native = tuple(cfg.input_size) if cfg is not None else (3, 224, 224)
    fixed = bool(getattr(cfg, "fixed_input_size", False))
    attempts: list[tuple[dict[str, Any], tuple[int, ...], str]] = []
    if fixed:
        attempts.append(({"img_size": SIDE}, (native[0], SIDE, SIDE), f"img_size={SIDE}"))
    else:
        attempts.append(({}, (native[0], SIDE, SIDE), f"{SIDE} px"))
    attempts.append(({}, native, "own size " + "x".join(str(d) for d in native[1:])))
    last: Exception | None = None
    for kwargs, shape, label in attempts:
        torch.manual_seed(0)
        try:
            model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)
            x = torch.randn(BATCH, *shape)
            model.train()
            with torch.no_grad():
                model(x)
            return model, x, label
        except Exception as exc:  # noqa: BLE001 - the next size, or the model's own refusal reported
            last = exc
    raise RuntimeError(f"does not build or run: {type(last).__name__}: {str(last).splitlines()[0] if last else ''}")


def _step(model: Any, x: Any) -> tuple[Any, list[Any]]:
    import torch

    torch.manual_seed(11)
    out = model(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    loss = torch.nn.functional.cross_entropy(out.float(), torch.arange(BATCH) % CLASSES)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def run_one(name: str) -> dict[str, Any]:
    """One family's row (run in a child process: ``--child NAME``)."""
    import torch

    import remat.client
    from remat.client.apply_plan import applied_plan
    from remat.client.errors import RematError

    torch.set_num_threads(2)
    row: dict[str, Any] = {"model": name}
    try:
        reference, x, label = _build(name)
    except RuntimeError as exc:
        return {**row, "status": "does not build", "reason": str(exc)[:300]}
    row["input"] = label
    planned = copy.deepcopy(reference)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            remat.client.checkpoint(planned, x, grads="kept")
        except RematError as exc:
            return {**row, "status": "refused", "reason": " ".join(str(exc).split())[:300]}
    row["seconds"] = round(time.perf_counter() - start, 1)
    plan = applied_plan(planned)
    if plan is None:
        said = [str(w.message) for w in caught if "remat" in str(w.message).lower() or "checkpoint" in str(w.message)]
        return {**row, "status": "no cut", "reason": " ".join((said[-1] if said else "no plan").split())[:300]}
    reference.train()
    planned.train()
    expected, got = _step(reference, x), _step(planned, x)
    equal = torch.equal(expected[0], got[0]) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(expected[1], got[1], strict=True))
    return {**row, "status": "bit-equal" if equal else "DIFFERS", "stages": plan.num_stages,
            "checkpoints": len(plan.checkpoints), "peak_mib": round(plan.predicted_peak_bytes / 2**20, 2),
            "none_mib": round(plan.baseline_peak_bytes / 2**20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated timm modules (families)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per family")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the rows here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child)))
        return
    chosen = families()
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        unknown = wanted - set(chosen)
        if unknown:
            parser.error(f"--only: no timm module {sorted(unknown)}")
        chosen = {m: n for m, n in chosen.items() if m in wanted}
    rows = []
    for module, name in chosen.items():
        with tempfile.TemporaryDirectory() as home:
            env = {**os.environ, "HOME": home, "REMAT_PLAN_CACHE_DIR": f"{home}/cache",
                   "REMAT_DATABASE_URL": f"sqlite:///{home}/plans.sqlite", "PYTHONWARNINGS": "ignore"}
            env.pop("REMAT_SERVER", None)
            try:
                done = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True,
                                      text=True, timeout=args.timeout, check=False)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                row = json.loads(lines[-1]) if lines else {
                    "model": name, "status": "crashed",
                    "reason": " ".join((done.stderr.strip().splitlines() or ["?"])[-1].split())[:300]}
            except subprocess.TimeoutExpired:
                row = {"model": name, "status": "timed out", "reason": f"over {args.timeout:.0f} s"}
        row["family"] = module
        rows.append(row)
        detail = (f"{row.get('stages')} stages, {row.get('checkpoints')} checkpoints, "
                  f"{row.get('peak_mib')} of {row.get('none_mib')} MiB, {row.get('seconds')} s"
                  if "stages" in row else row.get("reason", ""))
        print(f"{module:28} {name:34} {row.get('input', ''):18} {row['status']:14} {detail}", flush=True)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    print("; ".join(f"{k}: {v}" for k, v in sorted(counts.items())), f"({len(rows)} families)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
