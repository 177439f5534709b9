"""What ``remat.client.checkpoint`` adds to a Hugging Face training script's start on a plan-cache hit.

The script: GPT-2 (``AutoConfig.for_model("gpt2", use_cache=False)``, random weights, nothing downloaded),
one batch of token ids (batch 2, sequence 256, CPU), then
``remat.client.checkpoint(model, input_ids=ids, labels=ids.clone())``. Each run is a fresh interpreter, as a
training job is (with or without cached bytecode: below); the figure is the time of the ``checkpoint()`` call
alone (``import remat.client`` is reported beside it), the median of ``--runs`` interpreters.

The first run fills the cache: it exports, probes and profiles GPT-2 here (minutes on a CPU) and writes the
plan, the probe facts and the exported graph to the cache directory. ``--cache DIR`` keeps that directory
between invocations (the fill runs only when DIR holds no plan yet); without it a temporary one is used.
``--mask ones`` (or ``padded``) adds an ``attention_mask`` without padding (or with) to the call: a mask
without padding reads two graphs back (the model's own decisions are asked of the first: NOTE [ masks without
padding ] in client/graph/mask_skips.py). ``--without-graph-cache`` also times hits with the exported-graph
cache turned off (torch.export at every start, as before it existed). ``--split`` runs as many more
interpreters with timers around each step of the hit (importing remat's modules, which the call otherwise
does on first use, export-cache pre-key and load, torch.export if it ran, architecture hash, chain cut, plan
lookup, apply) to say where the time goes.

Bytecode (benchmarks/child_bytecode.py): by default every child compiles each module it imports from source,
torch's and remat's alike, a worst case and how this VM runs everything; ``--bytecode`` reads bytecode cached
beside the plans, as an ordinary install does once it has run and as remat's Docker image does from the start.

    uv run python benchmarks/checkpoint_hit_hf.py --runs 5 --split --without-graph-cache
    uv run python benchmarks/checkpoint_hit_hf.py --cache /tmp/gpt2-cache --layers 2   # n_layer=2, both ways
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
import transformers
transformers.logging.set_verbosity_error()
config = transformers.AutoConfig.for_model("gpt2", use_cache=False{overrides})
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config)
ids = torch.randint(0, config.vocab_size, ({batch}, {seq}))
t_model = time.perf_counter()
import remat.client
t_import = time.perf_counter()
steps = {{}}
if {split}:
    import functools
    t = time.perf_counter()
    import torch.export
    from remat.client import apply_plan, local_plans, plan_lookup, config, graph
    from remat.client.graph import built_model, export_cache, fx_trace, hashing, stage_graph
    steps["import remat's modules"] = time.perf_counter() - t
    def timed(owner, name, label):
        inner = getattr(owner, name)
        @functools.wraps(inner)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                steps[label] = steps.get(label, 0.0) + time.perf_counter() - t
        setattr(owner, name, wrapper)
    timed(export_cache, "pre_keys", "graph pre-key")
    timed(export_cache, "load_graph", "graph load")
    timed(torch.export, "export", "torch.export")
    timed(hashing, "architecture_hash", "architecture hash")
    timed(stage_graph, "build_stage_chain", "chain cut")
    timed(local_plans.LocalPlanCache, "get", "plan lookup")
    timed(local_plans.LocalPlanCache, "get_probe_facts", "probe facts read")
    timed(apply_plan, "apply_with_chain", "apply")
if {no_graph_cache}:  # the behaviour before the graph cache: export at every start
    from remat.client.graph import export_cache
    export_cache.pre_key = lambda *args, **kwargs: None
t_call0 = time.perf_counter()
mask = {{}}
if {mask!r} != "none":
    mask["attention_mask"] = torch.ones_like(ids)
    if {mask!r} == "padded":
        mask["attention_mask"][0, -8:] = 0
remat.client.checkpoint(model, input_ids=ids, labels=ids.clone(), **mask)
t_call = time.perf_counter()
print(json.dumps({{"model_s": t_model - t0, "import_s": t_import - t_model, "call_s": t_call - t_call0,
                  "steps": steps}}))
"""


def run_child(cache: str, args: argparse.Namespace, *, split: bool = False, no_graph_cache: bool = False) -> dict:
    overrides = f", n_layer={args.layers}" if args.layers else ""
    code = CHILD.format(threads=args.threads, root=str(ROOT), overrides=overrides, batch=args.batch, seq=args.seq,
                        split=split, no_graph_cache=no_graph_cache, mask=args.mask)
    with child_environment(cache, bytecode=args.bytecode, REMAT_PLAN_CACHE_DIR=cache,
                           REMAT_DATABASE_URL=f"sqlite:///{cache}/local.sqlite") as env:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"the child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=0, help="n_layer override (0: GPT-2's own 12)")
    parser.add_argument("--mask", choices=("none", "ones", "padded"), default="none",
                        help="attention_mask in the call: none, without padding (all ones), or padded")
    parser.add_argument("--cache", help="cache directory kept between invocations (default: a temporary one)")
    parser.add_argument("--split", action="store_true", help="also time each step of the hit")
    parser.add_argument("--bytecode", action="store_true",
                        help="children write and read cached bytecode, as an ordinary install does (default: "
                             "every module compiled from source at every start)")
    parser.add_argument("--without-graph-cache", action="store_true",
                        help="also time hits that export the model (the exported-graph cache turned off)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or tmp
        Path(cache).mkdir(parents=True, exist_ok=True)
        if not any(Path(cache).glob("*.json")):
            print(f"filling the cache in {cache}: exporting, probing and profiling GPT-2 here (minutes)…",
                  file=sys.stderr, flush=True)
            first = run_child(cache, args)
            print(f"miss: checkpoint() took {first['call_s']:.1f} s", file=sys.stderr, flush=True)
        if args.bytecode:
            run_child(cache, args)  # writes the bytecode the timed runs read
        runs = [run_child(cache, args) for _ in range(args.runs)]
        calls = sorted(r["call_s"] * 1e3 for r in runs)
        imports = statistics.median(r["import_s"] for r in runs) * 1e3
        mask = {"none": "", "ones": ", mask without padding", "padded": ", padded mask"}[args.mask]
        label = f"GPT-2{f' n_layer={args.layers}' if args.layers else ''}, batch {args.batch}, seq {args.seq}{mask}"
        label += ", bytecode cached" if args.bytecode else ", compiled from source"
        print("| model | import remat.client ms | checkpoint() on a hit ms (median) | runs ms |")
        print("|---|---|---|---|")
        print(f"| {label} | {imports:.0f} | {statistics.median(calls):.0f} | {', '.join(f'{c:.0f}' for c in calls)} |")
        if args.without_graph_cache:
            plain = sorted(run_child(cache, args, no_graph_cache=True)["call_s"] * 1e3 for _ in range(args.runs))
            print(f"| {label}, exported at every start | {imports:.0f} | {statistics.median(plain):.0f} | "
                  f"{', '.join(f'{c:.0f}' for c in plain)} |")
        if args.split:
            split = [run_child(cache, args, split=True) for _ in range(args.runs)]
            names = list(dict.fromkeys(name for r in split for name in r["steps"]))
            total = statistics.median(r["call_s"] + r["steps"]["import remat's modules"] for r in split) * 1e3
            print(f"\nwhere a hit's {total:.0f} ms go (median of {args.runs} timed interpreters):\n")
            print("| step | ms |")
            print("|---|---|")
            accounted = 0.0
            for name in names:
                ms = statistics.median(r["steps"].get(name, 0.0) for r in split) * 1e3
                accounted += ms
                print(f"| {name} | {ms:.1f} |")
            print(f"| rest (binding the call, precision, config file, key, removing an earlier plan) | "
                  f"{total - accounted:.1f} |")


if __name__ == "__main__":
    main()
