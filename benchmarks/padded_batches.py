"""Training an applied transformer on batches padded to their longest sequence (NOTE [ other sizes ]).

A collator that pads each batch to its longest sequence (transformers' ``DataCollatorWithPadding``, the
default) gives most batches a length of their own. The script: GPT-2 from its configuration (``--layers``
blocks, random weights, nothing downloaded), ``remat.client.checkpoint`` on one batch at ``--plan-seq``
tokens, then ``--steps`` SGD steps on batches whose lengths are drawn uniformly from ``--lengths`` (one seeded
sequence of lengths and token ids, the same for every runner). Runners, each on a fresh copy of the model and
a fresh copy of the plan cache (the plan filled once beforehand, no exported graph of another size on disk):

- ``unmodified``: the model's own forward;
- ``remat``: the applied plan (a call at new sizes runs on the one export for any sizes);
- ``remat, a later start``: the same, started again on a copy of the plan cache ``remat`` left (the export for
  any sizes comes back from disk, NOTE [ any sizes on disk ]);
- ``remat, one export per size``: the same with that export turned off, as before it existed (each new size
  is exported and cut on its own).

Reported per runner: the whole run, the first step at other sizes than the plan's (it pays the export), the
median step at a length seen for the first time (after that first one) and at one seen before, and whether every loss is
``torch.equal`` to the unmodified model's (dropout on, same seeds).

    uv run python benchmarks/padded_batches.py --layers 6 --steps 30

``--architectures`` checks instead every allow-listed transformer (``remat.client.hf_models``, at the zoo's
sizes or alike), with and without an attention mask: the plan chain at (2, 32), the export for any sizes from a
call at (3, 24) (its time, export and cut), whether it is cut into the same stages, and whether a training step
on it with checkpoints at (1, 40), (4, 40), (3, 17) and (2, 32) is bit-equal to the eager model's (``refused``
where its guards, or the sizes export assumed, refuse the size: a batch of one row always is); then, as a later
start would, the same graph read back from disk from a call at (4, 9) (its time, read and cut from the first
cut's stored probe facts, without running the model), which must be cut into the same stages, refuse the same
sizes and train bit-equal too.
"""

from __future__ import annotations

import argparse
import copy
import functools
import random
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def _model(layers: int) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model("gpt2", n_layer=layers, use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _batch(vocab: int, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _train(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times, losses = [], []
    for i, kwargs in enumerate(batches):
        torch.manual_seed(100 + i)
        started = time.perf_counter()
        loss = model(**kwargs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
        losses.append(loss.detach())
    return times, losses


def _runner(name: str, base: torch.nn.Module, plan_batch: dict[str, Any], batches: list[dict[str, torch.Tensor]],
            plan_cache: Path | None, work: Path) -> tuple[list[float], list[torch.Tensor]]:
    import remat.client
    from remat.client import apply_plan
    from remat.client.errors import ModelError

    model = copy.deepcopy(base)
    if plan_cache is None:
        return _train(model, batches)
    cache = _cache_of(work, name)
    shutil.copytree(_cache_of(work, "remat") if "later start" in name else plan_cache, cache)
    remat.client.checkpoint(model, cache_dir=cache, **plan_batch)
    export_any_sizes = apply_plan.export_any_sizes
    if "per size" in name:
        def refused(*args: Any, **kwargs: Any) -> None:
            raise ModelError("turned off by the benchmark")

        apply_plan.export_any_sizes = refused  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _train(model, batches)
    finally:
        apply_plan.export_any_sizes = export_any_sizes


def _cache_of(work: Path, name: str) -> Path:
    """The plan cache a runner trains with (a later start's is a copy of ``remat``'s, as that run left it)."""
    return work / name.replace(" ", "_").replace(",", "")


def _check_architectures() -> None:
    import torch.utils._pytree as pytree

    from remat.client.errors import ModelError
    from remat.client.graph.fx_trace import (
        ANY_SIZES_GUARDS,
        any_sizes_probe_facts,
        export_any_sizes,
        keep_any_sizes_probe_facts,
        sizes_refused,
    )
    from remat.client.graph.model_call import ModelCall
    from remat.client.graph.stage_graph import build_stage_chain
    from remat.client.hf_models import HF_ARCHITECTURES, build_hf_model, hf_zoo, input_kind

    sizes = {model.name: model.model_kwargs for model in hf_zoo()}
    decoder = sizes["llama"]
    sizes.update(mistral=dict(decoder), qwen2=dict(decoder), roberta=dict(sizes["bert"]),
                 bart={"encoder_layers": 2, "decoder_layers": 2, "d_model": 256, "encoder_ffn_dim": 512,
                       "decoder_ffn_dim": 512, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                       "vocab_size": 8000})

    def kwargs(model: torch.nn.Module, causal: bool, batch: int, seq: int, seed: int, mask: bool) -> dict:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, int(model.config.vocab_size), (batch, seq), generator=gen)
        out: dict[str, torch.Tensor] = {"input_ids": ids}
        if mask:
            out["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
            out["attention_mask"][0, -1] = 0
        out["labels"] = ids.clone() if causal else torch.randint(3, int(model.config.vocab_size), (batch, seq),
                                                                 generator=gen)
        return out

    def step(model: torch.nn.Module, run: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(3)
        loss = run().loss
        loss.backward()
        return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    def same(a: Any, b: Any) -> bool:
        return torch.equal(a[0], b[0]) and all((x is None and y is None) or (x is not None and y is not None and
                                                                              torch.equal(x, y))
                                               for x, y in zip(a[1], b[1], strict=True))

    print("| architecture | mask | stages | same stages as the plan's | export and cut | a later start: read back "
          "and cut | (1, 40), (4, 40), (3, 17), (2, 32) |")
    print("|---|---|---:|---|---:|---:|---|")
    for name, arch in HF_ARCHITECTURES.items():
        if input_kind(f"hf:{name}") != "tokens":  # ViT's images; CLIP's captions come with images
            continue
        for mask in (False, True):
            model = build_hf_model(f"hf:{name}", sizes[name]).train()
            causal = arch.task == "causal-lm"
            try:
                planned = build_stage_chain(model, ModelCall.bind(model, (), kwargs(model, causal, 2, 32, 1, mask)))
            except ModelError as exc:
                print(f"| {name} | {'yes' if mask else 'no'} | refused at planning: {str(exc)[:80]}… | | | | |")
                continue
            with tempfile.TemporaryDirectory() as cache:
                started = time.perf_counter()
                first = ModelCall.bind(model, (), kwargs(model, causal, 3, 24, 2, mask))
                graph = export_any_sizes(model, first, cache_dir=Path(cache))
                chain = build_stage_chain(model, first, graph=graph, check=False)
                keep_any_sizes_probe_facts(graph, chain.probe_facts, Path(cache))
                took = time.perf_counter() - started
                # A later start: the graph read back from disk (its guards asked as data), from a call at other
                # sizes, is cut into the same stages and refuses and trains as the fresh one does.
                started = time.perf_counter()
                later = ModelCall.bind(model, (), kwargs(model, causal, 4, 9, 3, mask))
                read_back = export_any_sizes(model, later, cache_dir=Path(cache))
                read_chain = build_stage_chain(model, later, graph=read_back, check=False,
                                               facts=any_sizes_probe_facts(read_back, Path(cache)))
                read_took = time.perf_counter() - started
            stored = (ANY_SIZES_GUARDS not in read_back.meta and not read_chain.probed
                      and read_chain.layout() == chain.layout())
            results = []
            for batch, seq in [(1, 40), (4, 40), (3, 17), (2, 32)]:
                values = kwargs(model, causal, batch, seq, 7, mask)
                call = ModelCall.bind(model, (), values)
                flat = pytree.tree_flatten((tuple(call.args), dict(call.kwargs)))[0]
                refused = sizes_refused(graph, flat)
                stored = stored and refused == sizes_refused(read_back, flat)
                if refused:
                    results.append("refused")
                    continue
                checkpoints = tuple(range(2, chain.num_stages, 3))
                eager = step(model, functools.partial(model, **values))
                equal = all(same(eager, step(model, functools.partial(c.run_call, call, checkpoints)))
                            for c in (chain, read_chain))
                results.append("bit-equal" if equal else "DIFFERS")
            print(f"| {name} | {'yes' if mask else 'no'} | {chain.num_stages} | "
                  f"{'yes' if chain.layout() == planned.layout() else 'NO'} | {took:.1f} s | "
                  f"{read_took:.2f} s{'' if stored else ' (NOT the same graph)'} | {', '.join(results)} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--plan-seq", type=int, default=128)
    parser.add_argument("--lengths", default="64:128", help="lo:hi, inclusive")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--architectures", action="store_true", help="check every allow-listed transformer instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.architectures:
        warnings.simplefilter("ignore")
        _check_architectures()
        return
    lo, hi = (int(part) for part in args.lengths.split(":"))
    base = _model(args.layers)
    vocab = base.config.vocab_size
    rng = random.Random(0)
    lengths = [rng.randint(lo, hi) for _ in range(args.steps)]
    batches = [_batch(vocab, args.batch, n, seed=i) for i, n in enumerate(lengths)]
    plan_batch = _batch(vocab, args.batch, args.plan_seq, seed=10_000)
    print(f"GPT-2, {args.layers} blocks, batch {args.batch}, plan at {args.plan_seq} tokens; {args.steps} steps at "
          f"{len(set(lengths))} lengths drawn from {lo}..{hi}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        import remat.client

        plan_cache = work / "plan"
        started = time.perf_counter()
        remat.client.checkpoint(copy.deepcopy(base), cache_dir=plan_cache, **plan_batch)
        print(f"plan filled in {time.perf_counter() - started:.1f} s", flush=True)
        shutil.rmtree(plan_cache / "graphs", ignore_errors=True)  # graphs of the plan's sizes come back on the hit
        results = {}
        for name in ("unmodified", "remat", "remat, a later start", "remat, one export per size"):
            results[name] = _runner(name, base, plan_batch, batches, None if name == "unmodified" else plan_cache,
                                    work)
    reference = results["unmodified"][1]
    print()
    print("| runner | whole run | first step at other sizes | new length, median step | seen length, median "
          "step | losses equal to unmodified |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (times, losses) in results.items():
        seen: set[int] = set()
        new_steps, seen_steps = [], []
        for n, t in zip(lengths, times, strict=True):
            (seen_steps if n in seen else new_steps).append(t)
            seen.add(n)
        first_other = next(t for n, t in zip(lengths, times, strict=True) if n != args.plan_seq)
        equal = all(torch.equal(a, b) for a, b in zip(reference, losses, strict=True))
        print(f"| {name} | {sum(times):.1f} s | {first_other * 1000:.0f} ms | "
              f"{statistics.median(new_steps[1:]) * 1000:.0f} ms | "
              f"{statistics.median(seen_steps) * 1000 if seen_steps else float('nan'):.0f} ms | "
              f"{'yes' if equal else 'NO'} |")


if __name__ == "__main__":
    main()
