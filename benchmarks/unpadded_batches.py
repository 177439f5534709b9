"""Batches without padding: the attention path of the model's own forward against the masked one.

NOTE [ masks without padding ] (client/graph/mask_skips.py): transformers leaves out an attention mask without
padding (SDPA's ``is_causal``, or no mask for an encoder) and builds one with padding. An export always built it,
so before remat exported a call with the model's own decision, every batch without padding (fixed-length chunks
of text with their all-ones mask) trained on another attention path than the model's. For each model of
``remat-client zoo hf`` (its configuration sizes, random weights) and one batch with an all-ones
``attention_mask``, this cuts two chains from the same model: ``masked``, exported building every mask (as
before), and ``as the model`` (exported with the model's own decisions: the mask left out). Each is profiled and
planned (``linear``), and measured with the worker's measured step (the CPU live-storage meter or the caching
allocator; gradients kept), and timed in interleaved rounds beside the model's own forward (``none``, eager).
Gradients are compared with the eager step (``torch.equal`` on CPU; 0 means bit-equal).

    uv run python benchmarks/unpadded_batches.py --models gpt2,llama,bert --batch-size 2 --seq-len 256

docs/benchmarks.md ("Batches without padding") holds the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from hf_peer import MIB, HfForward  # a sibling script, not a package: the model's own forward as a runner

from remat.client.graph.built_model import build
from remat.client.graph.fx_trace import export_model
from remat.client.graph.mask_skips import MASK_SKIPS, mask_decisions
from remat.client.graph.model_call import ModelCall
from remat.client.graph.stage_graph import build_stage_chain
from remat.client.hf_models import hf_zoo
from remat.client.planning.plans import make_plan
from remat.client.request import ModelRequest
from remat.worker.measure import gradient_check, measure_step, time_plans
from remat.worker.profilers import profile


def run(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    [entry] = [m for m in hf_zoo() if m.name == name]
    request = ModelRequest(spec=entry.spec, batch_size=args.batch_size, sample_shape=(args.seq_len,),
                           seq_len=args.seq_len, grads="kept",
                           model_kwargs={**entry.model_kwargs, **json.loads(args.model_kwargs)},
                           device=args.device, dtype=args.dtype)
    built = build(request)
    model = built.model
    eager = HfForward(model, checkpointing=False)
    kwargs = dict(built.example.kwargs)
    kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
    call = ModelCall.bind(model, (), kwargs)
    common = {"grads": "kept", "precision": args.dtype, "device": args.device}
    masked = export_model(model, call, mask_skips=())
    decided = mask_decisions(masked, call.flat_inputs()) or ()
    graphs = {"masked": masked, "as the model": export_model(model, call, mask_skips=decided)}
    modes: list[tuple[str, Any, tuple[int, ...], int | None]] = [("none (the model's forward)", eager, (),
                                                                  None)]
    stages = {}
    for label, graph in graphs.items():
        chain = build_stage_chain(model, call, graph=graph, check=False)
        stages[label] = (chain.num_stages, graph.meta[MASK_SKIPS])
        trace = profile(model, call, device=args.device, grads="kept", chain=chain, model_name=name,
                        model_hash="0" * 64, precision=args.dtype, timing_repeats=1)
        linear = make_plan(trace, "linear", cost_model="pytorch")
        modes.append((f"{label}, no checkpoints", chain, (), None))
        modes.append((f"{label}, linear", chain, tuple(linear.checkpoints), linear.predicted_peak_bytes))
    rows = []
    for label, runner, checkpoints, predicted in modes:
        measured = measure_step(model, call, checkpoints, chain=runner, baseline=False, **common)
        rows.append({"model": name, "mode": label, "peak": measured.measured_peak_bytes, "predicted": predicted})
    times = time_plans(model, call, [m[2] for m in modes], runners=[m[1] for m in modes], rounds=args.rounds,
                       **common)
    checks = gradient_check(model, call, [m[2] for m in modes], runners=[m[1] for m in modes], chain=eager,
                            **common)
    for row, ms, (_, diff) in zip(rows, times, checks, strict=True):
        row["step_ms"], row["grad_diff"] = ms, diff
    print(f"{name}: decisions {decided}; stages and decisions per chain {stages}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama,bert", help="hf zoo names, comma-separated")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-kwargs", default="{}", help="configuration overrides for every model, JSON")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (then peaks from the caching allocator)")
    parser.add_argument("--dtype", default="float32", help="the step's precision, e.g. autocast_bfloat16")
    args = parser.parse_args()
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"{where}, {args.dtype}, gradients kept, batch {args.batch_size}, sequence {args.seq_len}, all-ones "
          f"attention_mask, torch {torch.__version__}", file=sys.stderr)
    print("| model | graph, plan | activation peak | predicted | step | vs none | largest gradient difference |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        rows = run(name.strip(), args)
        base = rows[0]["step_ms"]
        for r in rows:
            predicted = f"{r['predicted'] / MIB:.1f} MiB" if r["predicted"] is not None else "-"
            print(f"| {r['model']} | {r['mode']} | {r['peak'] / MIB:.1f} MiB | {predicted} | {r['step_ms']:.0f} ms | "
                  f"{100 * (r['step_ms'] / base - 1):+.0f}% | {r['grad_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
