"""The measured time–memory curve: budget plans at 70% and 50% of the no-checkpoint peak and the minimum.

For each model: build, profile (one trace), compute the Pareto frontier (timed), pick the budget plans,
then measure every plan with a real training step (peak and step time, timed in interleaved rounds) through
the pipeline's own ``validate``. Prints one markdown table; docs/benchmarks.md ("Budgets") holds the figures.

    uv run python benchmarks/budget_curve.py --models resnet152,vit_b_16,gpt2-shape

``gpt2-shape`` is a decoder-only transformer language model of GPT-2 small's shape (12 layers, width 768,
12 heads, vocabulary 50,257, tied embeddings; its context is the benchmark's sequence length, where GPT-2's is
1,024), written here with torch only; it is trained on random tokens
with cross-entropy over every position (its logits are returned as (batch, vocabulary, sequence)). Its
embeddings are untied unless ``--tied`` (GPT-2's tied input and output embedding, whose two gradient
contributions the profiler books since: docs/cost-model.md, "Tied weights").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import torch
from torch import nn

from remat.client.budget_spec import BudgetInfeasibleError, pick_for_budget
from remat.client.graph import built_model
from remat.client.planning.plans import frontier_plans, make_plan
from remat.client.request import ModelRequest
from remat.worker import pipeline

MIB = 2**20


class Block(nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a 4x GELU MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT2Shape(nn.Module):
    """Decoder-only LM of GPT-2 small's shape; forward(tokens) -> logits (batch, vocabulary, sequence)."""

    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50257,
                 context: int = 1024, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:  # GPT-2 ties them; see the module docstring for why the benchmark does not by default
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.tok(tokens) + self.pos.weight)  # sequences of exactly `context` tokens
        return self.head(self.ln(x)).transpose(1, 2)


def build(name: str, batch: int, image: int, seq: int, grads: str, tied: bool = False) -> Any:
    if name == "gpt2-shape":
        request = ModelRequest(spec="custom:gpt2-shape", batch_size=batch, sample_shape=(seq,), grads=grads)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 50257, (batch, seq), generator=gen)
        return built_model.build_from_model(request, GPT2Shape(context=seq, tied=tied).train(), tokens)
    size = 224 if name.startswith("vit") else image
    return built_model.build(ModelRequest(spec=name, batch_size=batch, sample_shape=(3, size, size), grads=grads))


def run(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    built = build(name, args.batch_size, args.image_size, args.seq_len, args.grads, args.tied)
    trace = pipeline.profile(built, timing_repeats=args.timing_repeats)
    started = time.process_time()
    frontier = frontier_plans(trace)
    frontier_s = time.process_time() - started
    none = make_plan(trace, "none", cost_model="pytorch")
    plans = [none]
    for share in args.shares:
        budget_bytes = int(none.predicted_peak_bytes * share)
        try:
            plan = pick_for_budget(frontier, budget_bytes, peak=lambda p: p.predicted_peak_bytes)
        except BudgetInfeasibleError as exc:
            print(f"  {name} {share:.0%}: {exc}", file=sys.stderr)
            continue
        plans.append(dataclasses.replace(plan, algorithm=f"budget {share:.0%}", budget_bytes=budget_bytes))
    plans.append(make_plan(trace, "linear", cost_model="pytorch"))
    measured = pipeline.validate(built, trace, plans, timing_rounds=args.timing_repeats, check_gradients=False)
    base = measured["none"]
    rows = []
    for plan in plans:
        m = measured[plan.label]
        est = plan.recompute_ms / base.step_ms if plan.recompute_ms is not None and base.step_ms else None
        rows.append({"model": name, "plan": plan.algorithm, "stages": trace.num_stages,
                     "frontier_points": len(frontier), "frontier_s": frontier_s,
                     "checkpoints": len(plan.checkpoints), "predicted": plan.predicted_peak_bytes,
                     "measured": m.measured_peak_bytes, "saving": 1 - m.measured_peak_bytes / base.measured_peak_bytes,
                     "overhead": m.step_ms / base.step_ms - 1, "estimated_overhead": est})
        print(f"  {rows[-1]}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet152,vit_b_16,gpt2-shape")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grads", default="kept")
    parser.add_argument("--shares", default="0.7,0.5")
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tied", action="store_true", help="gpt2-shape with tied embeddings, as GPT-2")
    args = parser.parse_args()
    args.shares = [float(s) for s in args.shares.split(",")]
    torch.set_num_threads(args.threads)
    print("| model | stages | plan | predicted MiB | measured MiB | saving vs none | step-time overhead "
          "(measured) | recompute estimate | frontier points | frontier s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for r in run(name, args):
            est = "-" if r["estimated_overhead"] is None else f"{r['estimated_overhead']:+.0%}"
            print(f"| {r['model']} | {r['stages']} | {r['plan']} | {r['predicted'] / MIB:.2f} | "
                  f"{r['measured'] / MIB:.2f} | {r['saving']:.1%} | {r['overhead']:+.0%} | {est} | "
                  f"{r['frontier_points']} | {r['frontier_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
