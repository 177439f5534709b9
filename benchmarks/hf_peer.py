"""remat against Hugging Face's own gradient checkpointing: one meter, one run, interleaved timings.

For each model of ``remat-client zoo hf`` (its configuration sizes; the vocabulary is 8,000) this builds the
model from its configuration (random weights), profiles it once and measures, with the worker's measured
step (the CPU live-storage meter, or the caching allocator with ``--device cuda``; gradients kept; float32 or
``--dtype autocast_bfloat16``), four ways to train the same batch:

- ``none``: the model's own forward, nothing checkpointed;
- ``hf``: ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``,
  every block checkpointed (the model's own forward, with transformers' checkpointing);
- ``remat linear``: remat's least-peak plan;
- ``remat budget``: remat's stored frontier plans whose predicted peak fits under ``hf``'s measured one, the
  ``--candidates`` of least estimated recompute each measured, and the fastest measured shown.

Step times come from interleaved rounds (every mode once per round, the fastest of ``--rounds`` kept), so a
busy moment of the machine lands on every mode alike. Gradients are compared with the unmodified step
(``torch.equal`` on CPU: the largest difference is printed, 0 means bit-equal). Prints one markdown table;
docs/benchmarks.md ("remat against Hugging Face's gradient checkpointing") holds the figures.

    uv run python benchmarks/hf_peer.py --models gpt2,llama,bert --batch-size 2 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from torch import nn

from remat.client.graph.built_model import build
from remat.client.hf_models import hf_zoo
from remat.client.planning.plans import frontier_plans, make_plan
from remat.client.request import ModelRequest
from remat.worker import pipeline
from remat.worker.measure import gradient_check, measure_step, time_plans

MIB = 2**20


class HfForward:
    """The model's own forward, with transformers' gradient checkpointing on or off: a runner for the
    measured step (``run_call``), like remat's stage chain."""

    def __init__(self, model: nn.Module, checkpointing: bool) -> None:
        self.model = model
        self.checkpointing = checkpointing

    def run_call(self, call: Any, checkpoints: Any = ()) -> Any:
        # transformers 5 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
        if hasattr(self.model, "activation_checkpointing_enable"):
            enable = lambda: self.model.activation_checkpointing_enable(  # noqa: E731
                activation_checkpointing_kwargs={"use_reentrant": False})
            disable = self.model.activation_checkpointing_disable
        else:
            enable = lambda: self.model.gradient_checkpointing_enable(  # noqa: E731
                gradient_checkpointing_kwargs={"use_reentrant": False})
            disable = self.model.gradient_checkpointing_disable
        if self.checkpointing:
            enable()
        try:
            return self.model(*call.args, **call.kwargs)
        finally:
            disable()


def run(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    [entry] = [m for m in hf_zoo() if m.name == name]
    request = ModelRequest(spec=entry.spec, batch_size=args.batch_size, sample_shape=(args.seq_len,),
                           seq_len=args.seq_len, grads="kept",
                           model_kwargs={**entry.model_kwargs, **json.loads(args.model_kwargs)},
                           device=args.device, dtype=args.dtype)
    built = build(request)
    model, call, chain = built.model, built.example, built.chain
    trace = pipeline.profile(built, timing_repeats=1)
    common = {"grads": "kept", "precision": args.dtype, "device": args.device}
    hf = HfForward(model, checkpointing=True)
    hf_peak = measure_step(model, call, (), chain=hf, baseline=False, **common).measured_peak_bytes
    linear = make_plan(trace, "linear", cost_model="pytorch")
    fitting = sorted((p for p in frontier_plans(trace) if p.predicted_peak_bytes <= hf_peak),
                     key=lambda p: p.recompute_ms or 0.0)[:args.candidates]
    modes: list[tuple[str, Any, tuple[int, ...], int | None]] = [
        ("none", HfForward(model, checkpointing=False), (), None),
        ("hf activation checkpointing", hf, (), None),
        ("remat linear", chain, linear.checkpoints, linear.predicted_peak_bytes),
    ]
    modes += [(f"remat budget ≤ hf peak ({len(p.checkpoints)} kept)", chain, p.checkpoints,
               p.predicted_peak_bytes) for p in fitting]
    rows = []
    for label, runner, checkpoints, predicted in modes:
        measured = measure_step(model, call, checkpoints, chain=runner, baseline=False, **common)
        rows.append({"model": name, "mode": label, "peak": measured.measured_peak_bytes, "predicted": predicted,
                     "stages": chain.num_stages})
    times = time_plans(model, call, [m[2] for m in modes], runners=[m[1] for m in modes], rounds=args.rounds,
                       **common)
    checks = gradient_check(model, call, [m[2] for m in modes], runners=[m[1] for m in modes], chain=chain,
                            **common)
    for row, ms, (_, diff) in zip(rows, times, checks, strict=True):
        row["step_ms"], row["grad_diff"] = ms, diff
    budget_rows = [r for r in rows[3:] if r["peak"] <= rows[1]["peak"]] or rows[3:]
    best = min(budget_rows, key=lambda r: r["step_ms"], default=None)
    if best is not None:
        best["mode"] += f", fastest of {len(rows) - 3} measured"
    return rows[:3] + ([best] if best is not None else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama,bert", help="hf zoo names, comma-separated")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--candidates", type=int, default=4, help="frontier plans under hf's peak to measure")
    parser.add_argument("--model-kwargs", default="{}",
                        help='configuration overrides for every model, JSON: {"attention_probs_dropout_prob": 0}')
    parser.add_argument("--device", default="cpu", help="cpu or cuda (then peaks from the caching allocator)")
    parser.add_argument("--dtype", default="float32", help="the step's precision, e.g. autocast_bfloat16")
    args = parser.parse_args()
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"{where}, {args.dtype}, gradients kept, batch {args.batch_size}, sequence {args.seq_len}, "
          f"torch {torch.__version__}", file=sys.stderr)
    print("| model | mode | activation peak | predicted | step | vs none | largest gradient difference |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        rows = run(name.strip(), args)
        base = rows[0]["step_ms"]
        for r in rows:
            predicted = f"{r['predicted'] / MIB:.1f} MiB" if r["predicted"] is not None else "-"
            print(f"| {r['model']} ({r['stages']} stages) | {r['mode']} | {r['peak'] / MIB:.1f} MiB | {predicted} | "
                  f"{r['step_ms']:.0f} ms | {100 * (r['step_ms'] / base - 1):+.0f}% | {r['grad_diff']:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
