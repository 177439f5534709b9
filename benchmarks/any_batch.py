"""Plans for any batch size from two small profiles (issue 27), measured.

For each model: profile at ``--from`` batch sizes (2 and 4), derive the trace at each ``--at`` batch size
(remat.client.derived_trace), and compare it field by field with a real profile at that batch (every stage
field, peak level and graph vertex; times excluded). Then measure a training step at each ``--at`` batch
with the derived trace's plans (none, linear, chen-sqrt, uniform, the frontier's middle point) and report the
largest prediction error. With ``--max-batch BYTES``, also: the largest batch the derived plans say fits,
against the truth found by measured steps (a binary search in which each probed batch is profiled, its least-
memory plan planned on that real profile and its step measured), beside the answer with one-level plans alone
(``linear``: no ``nested`` plans searched) and with chain plans alone (no graph plans: ``acg`` searched on a
graph profile derived at each batch).

    uv run python benchmarks/any_batch.py --models resnet50,densenet121 --image-size 64 --at 8,16,32
    uv run python benchmarks/any_batch.py --models resnet50 --image-size 64 --max-batch 200MiB --at ""
    uv run python benchmarks/any_batch.py --models hf:gpt2 --seq-len 128 --at 8,16

With ``--along seq_len`` the sizes are a token model's sequence lengths at ``--batch-size`` (issue 27, item 4):
the trace is fitted in the length with the degree its attention needs (three lengths for attention that holds
its scores) and compared at the ``--at`` lengths the same way:

    uv run python benchmarks/any_batch.py --models hf:gpt2 --along seq_len --batch-size 2 --from 64,128,192 \
        --at 256,512

Prints markdown rows; CPU, float32, gradients kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from remat.client.budget_spec import parse_budget
from remat.client.derived_trace import LEVELS, fit_batches, fit_lengths
from remat.client.graph.built_model import build
from remat.client.planning.max_batch import best_plan, largest_batch
from remat.client.planning.plans import frontier_plans, make_plan
from remat.client.request import ModelRequest
from remat.client.trace import Trace
from remat.worker import pipeline

MIB = 2**20
MEASURED = ("none", "linear", "chen-sqrt", "uniform")


def _request(model: str, batch: int, sample: tuple[int, ...]) -> ModelRequest:
    """An image model at ``sample``; an ``hf:`` token model at sequence length ``sample[0]``."""
    seq_len = sample[0] if model.startswith("hf:") and len(sample) == 1 else None
    return ModelRequest(spec=model, batch_size=batch, sample_shape=sample, device="cpu", grads="kept",
                        seq_len=seq_len, model_kwargs=dict(MODEL_KWARGS))


MODEL_KWARGS: dict[str, Any] = {}
"""``--model-kwargs``: configuration overrides for every model of the run (``{"n_layer": 6}``)."""


def _leaves(tree: Any, path: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_leaves(value, f"{path}.{key}" if path else key))
        return out
    if isinstance(tree, list):
        out = {}
        for i, value in enumerate(tree):
            out.update(_leaves(value, f"{path}[{i}]"))
        return out
    return {path: tree}


def differences(derived: Trace, profiled: Trace) -> tuple[int, int, list[str]]:
    """(fields compared, fields that differ, the first few differences) over everything but times."""
    skip = ("derived_from", "profiler", "device_name")
    def kept(tree: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in _leaves(tree).items()
                if not k.endswith("_ms") and k.split(".")[0].split("[")[0] not in skip}

    a, b = kept(derived.to_dict()), kept(profiled.to_dict())
    keys = sorted(set(a) | set(b))
    differing = [k for k in keys if a.get(k, 0) != b.get(k, 0)]
    differing.sort(key=lambda k: LEVELS in k)  # a stage field first: a level differs where it is not the peak
    diff = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in differing]
    fields = sum(1 for k in differing if LEVELS not in k)
    return len(keys), len(diff), [f"{fields} outside peak levels", *diff[:5]]


def measure(model: str, sample: tuple[int, ...], batch: int, trace: Trace, plans: list[Any]) -> dict[str, Any]:
    built = build(_request(model, batch, sample))
    return pipeline.validate(built, trace, plans, timing_rounds=1, check_gradients=False)


def run_fields_and_predictions(model: str, sample: tuple[int, ...], sources: list[int], targets: list[int],
                               along: str = "batch", batch_size: int = 2) -> None:
    def at(size: int) -> tuple[int, tuple[int, ...]]:  # (batch, sample) of the profile at ``size``
        return (size, sample) if along == "batch" else (batch_size, (size,))

    started = time.perf_counter()
    profiles = [pipeline.profile(build(_request(model, *at(s)))) for s in sources]
    fit = fit_batches(profiles) if along == "batch" else fit_lengths(profiles)
    print(f"<!-- {model}: profiles at {sources} in {time.perf_counter() - started:.0f} s; {fit.describe()} -->")
    for size in targets:
        derived = fit.trace_at(size)
        batch, sample = at(size)
        profiled = pipeline.profile(build(_request(model, batch, sample)))
        compared, differing, examples = differences(derived, profiled)
        levels = sum(len(v) for s in derived.stages for v in s.extra.get(LEVELS, {}).values())
        plans = [make_plan(derived, a, cost_model="pytorch") for a in MEASURED]
        front = frontier_plans(derived)
        plans.append(front[len(front) // 2])
        measured = measure(model, sample, batch, derived, plans)
        errors = {p.label: measured[p.label].measured_peak_bytes / p.predicted_peak_bytes - 1 for p in plans}
        worst = max(errors, key=lambda k: abs(errors[k]))
        print(f"| {model} | {list(sample)} | {batch} | {compared} ({levels} peak levels) | {differing} | "
              f"{plans[1].predicted_peak_bytes / MIB:.1f} MiB | {errors[worst]:+.3%} ({worst}) |"
              + (f" {'; '.join(examples)}" if examples else ""))
        sys.stdout.flush()


def feasible(model: str, sample: tuple[int, ...], batch: int, limit: int) -> tuple[bool, int]:
    """The truth at ``batch``: a real profile, its least-memory plan (the graph plan searched on that batch's own
    graph profile included), a measured step within ``limit``?"""
    built = build(_request(model, batch, sample))
    trace = pipeline.profile(built)
    plans = [best_plan(trace, None)]
    if built.graph_profile is not None and trace.graph is not None:
        plans.append(pipeline.graph_planned(built, trace, make_plan(trace, "acg")))
    plan = min(plans, key=lambda p: p.predicted_peak_bytes)
    m = pipeline.validate(built, trace, [plan], timing_rounds=1, check_gradients=False)[plan.label]
    assert m.measured_peak_bytes is not None
    return m.measured_peak_bytes <= limit, m.measured_peak_bytes


def run_max_batch(model: str, sample: tuple[int, ...], sources: list[int], limit: int) -> None:
    builts = [build(_request(model, b, sample)) for b in sources]
    profiles = [pipeline.profile(b) for b in builts]
    fit = fit_batches(profiles)
    graph_plan_at = (pipeline.graph_plan_at_any_batch(builts[0], [b.graph_profile for b in builts], fit.sizes)
                     if all(b.graph_profile is not None for b in builts) and profiles[0].graph is not None else None)
    del builts[1:]
    answer = largest_batch(fit, lambda b: limit, graph_plan_at=graph_plan_at)
    chains = largest_batch(fit, lambda b: limit)  # the answer before graph plans were searched (2026-12-08)
    one_level = largest_batch(fit, lambda b: limit, nested=False)  # the answer before nested plans were searched
    ok, measured = feasible(model, sample, answer.batch_size, limit)
    low, high, probes = answer.batch_size, None, 1
    if ok:  # search upwards for the truth: the first batch whose measured step is over
        step = 1
        while high is None:
            probes += 1
            fits, _ = feasible(model, sample, low + step, limit)
            if fits:
                low, step = low + step, step * 2
            else:
                high = low + step
        while high - low > 1:
            probes += 1
            middle = (low + high) // 2
            low, high = (middle, high) if feasible(model, sample, middle, limit)[0] else (low, middle)
    truth = low if ok else None
    verdict = ("equal" if truth == answer.batch_size else
               f"answer {truth - answer.batch_size} below" if truth and truth > answer.batch_size else "ABOVE")
    print(f"| {model} | {list(sample)} | {limit / MIB:.0f} MiB | {one_level.batch_size} | {chains.batch_size} | "
          f"{answer.batch_size} "
          f"(`{answer.plan.algorithm}`, {answer.plan.predicted_peak_bytes / MIB:.1f} MiB predicted, "
          f"{measured / MIB:.1f} MiB measured) | {truth} ({probes} measured probes) | {verdict} |")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50,resnet152,densenet121")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--sample", default=None, help="a sample shape instead of 3,S,S (vit_b_16: 3,224,224)")
    parser.add_argument("--from", dest="sources", default="2,4")
    parser.add_argument("--at", default="8,16,32")
    parser.add_argument("--max-batch", default=None, metavar="BYTES", help="also answer max-batch at this limit")
    parser.add_argument("--seq-len", type=int, default=None, help="hf: token models: tokens per sample")
    parser.add_argument("--model-kwargs", default="{}", help="JSON configuration overrides, e.g. {\"n_layer\": 6}")
    parser.add_argument("--along", choices=("batch", "seq_len"), default="batch",
                        help="the size --from and --at count: batch sizes, or a token model's sequence lengths")
    parser.add_argument("--batch-size", type=int, default=2, help="with --along seq_len: the batch of every profile")
    args = parser.parse_args()
    MODEL_KWARGS.update(json.loads(args.model_kwargs))
    sample = ((args.seq_len,) if args.seq_len else tuple(int(d) for d in args.sample.split(",")) if args.sample
              else (3, args.image_size, args.image_size))
    sources = [int(b) for b in args.sources.split(",")]
    targets = [int(b) for b in args.at.split(",") if b]
    for model in args.models.split(","):
        if targets:
            run_fields_and_predictions(model, sample, sources, targets, args.along, args.batch_size)
        if args.max_batch:
            limit = parse_budget(args.max_batch).bytes
            assert limit is not None
            run_max_batch(model, sample, sources, limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
