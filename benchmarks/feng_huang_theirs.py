"""Feng & Huang's own solver and executor beside remat's plans: one model, one meter, one process.

Their repository (jianweif/OptimalGradCheckpointing, commit c691465) parses a model into a graph, solves for the
optimal graph checkpointing with their ``ArbitrarySolver`` and runs the answer with their ``Segment``
(reentrant ``torch.utils.checkpoint`` on each run-graph edge). This runs exactly that on the CPU, then
measures their plan, their parsed graph without checkpoints and their unmodified model with the meter of
benchmarks/feng_huang_meter.py (their quantity: a step's peak minus the larger of what was allocated before and
after it, an input that requires grad, a ``sum()`` loss, a warm-up step first), and remat's ``none``,
``linear`` and ``acg`` with the same meter, in the same process, of two models: torchvision's of the same architecture,
and their own module of it (their net/densenet.py is the older torchvision DenseNet, whose layers return the
running concatenation: a single tensor remat can cut at inside a dense block, as their solver does).

Their code is read from a checkout given with ``--their-repo`` and not edited. The one patch it needs on
today's torchvision is applied in memory before their ``net`` package is imported: torchvision's model modules
no longer export ``model_urls`` and ``load_state_dict_from_url``, which their model files import (for
pretrained weights, never used here); they are set to an empty dict and None. Their ``networkx`` and ``tqdm``
come from remat's environment (torch's and huggingface_hub's dependencies).

    git clone https://github.com/jianweif/OptimalGradCheckpointing /tmp/fh   # on a machine with network
    uv run python benchmarks/feng_huang_theirs.py --their-repo /tmp/fh --arch densenet121 --batch-size 32

docs/benchmarks.md ("Feng & Huang's own code, side by side") holds the figures.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from feng_huang_meter import run as run_remat_meter  # noqa: E402 - a sibling script, not a package
from feng_huang_meter import their_quantity  # noqa: E402

MIB = 2**20
_TORCHVISION_MODULES = ("alexnet", "densenet", "inception", "resnet", "vgg")
"""The torchvision model modules their net/ files import ``model_urls``/``load_state_dict_from_url`` from."""
_REMAT_NAMES = {"densenet121": "densenet121", "resnet152": "resnet152", "resnet50": "resnet50"}


def patch_torchvision() -> None:
    """The in-memory patch their model files need (module docstring): names torchvision dropped."""
    for name in _TORCHVISION_MODULES:
        module = importlib.import_module(f"torchvision.models.{name}")
        if not hasattr(module, "model_urls"):
            module.model_urls = {}  # type: ignore[attr-defined]
        if not hasattr(module, "load_state_dict_from_url"):
            module.load_state_dict_from_url = None  # type: ignore[attr-defined]


def run_theirs(repo: Path, arch: str, shape: tuple[int, ...]) -> list[dict[str, Any]]:
    """Parse, solve and measure with their code: the unmodified net, the parsed graph and the solved plan."""
    patch_torchvision()
    sys.path.insert(0, str(repo))
    graph = importlib.import_module("graph")
    solver = importlib.import_module("solver")
    utils = importlib.import_module("utils")
    factory = importlib.import_module("net.model_factory")
    utils.set_reproductibility(2020)
    net = factory.model_factory[arch]()
    utils.disable_dropout(arch, net)
    net.train()
    started = time.perf_counter()
    try:
        parsed, source, target = graph.parse_computation_graph(net, [torch.rand(*shape)])
        parser = "their torch.jit parser"
    except Exception:  # noqa: BLE001 - their benchmark's own fallback, as benchmark.py does
        with torch.no_grad():
            parsed, source, target = net.parse_graph(torch.rand(*shape))
        parser = "their manual parse_graph"
    parse_s = time.perf_counter() - started
    started = time.perf_counter()
    run_graph, best_cost = solver.ArbitrarySolver().solve(parsed, source, target)
    solve_s = time.perf_counter() - started
    run_segment = graph.Segment(run_graph, source, target, do_checkpoint=True)
    parsed_segment = graph.Segment(parsed, source, target, do_checkpoint=False)
    graph.set_segment_training(run_segment, train=True)
    graph.set_segment_training(parsed_segment, train=True)
    print(f"<!-- {arch}: {parser} in {parse_s:.0f} s, {parsed.number_of_nodes()} vertices, "
          f"{parsed.number_of_edges()} edges; ArbitrarySolver in {solve_s:.0f} s, their cost {best_cost:g} -->",
          flush=True)
    x = torch.rand(*shape, requires_grad=True)  # their reentrant checkpoint needs an input that requires grad
    rows = []
    for name, forward in (("theirs: unmodified model", net), ("theirs: parsed graph, no checkpoints",
                                                                parsed_segment.forward),
                          ("theirs: ArbitrarySolver's plan", run_segment.forward)):
        theirs, peak, end = their_quantity(lambda f=forward: f(x).sum().backward())
        rows.append({"plan": name, "theirs": theirs, "peak": peak, "end": end})
        net.zero_grad(set_to_none=True)
        x.grad = None
    # Their backward check, and remat's: gradients of the plan against the unmodified net's, bit for bit.
    y = torch.rand(*shape, requires_grad=True)
    net(y).sum().backward()
    reference = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    run_segment.forward(y).sum().backward()
    worst = max(float((p.grad - r).abs().max() / max(float(r.norm()), 1e-2))
                for p, r in zip(net.parameters(), reference, strict=True))
    equal = all(torch.equal(p.grad, r) for p, r in zip(net.parameters(), reference, strict=True))
    rows[-1]["gradients"] = f"largest relative difference {worst:.1e}{', bit-equal' if equal else ''}"
    return rows


def run_remat(spec: str, label: str, batch: int, size: int) -> list[dict[str, Any]]:
    """remat's none, linear and acg of ``spec``, with the same meter (feng_huang_meter.run)."""
    args = argparse.Namespace(batch_size=batch, image_size=size)
    return [{"plan": f"remat on {label}: {r['plan']}", "theirs": r["theirs"], "peak": r["their_peak"],
             "end": r["their_end"], "remat": r["ours"], "predicted": r["predicted"]}
            for r in run_remat_meter(spec, args)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--their-repo", type=Path, required=True,
                        help="a checkout of jianweif/OptimalGradCheckpointing")
    parser.add_argument("--arch", default="densenet121", choices=sorted(_REMAT_NAMES))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--remat-on", default="torchvision,theirs",
                        help="the models remat plans beside theirs: torchvision's of --arch, and their net/ module "
                             "of it (net.densenet:densenet121, importable once their checkout is on the path); '' "
                             "for none")
    args = parser.parse_args()
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    print(f"<!-- CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, input {list(shape)}, float32 -->")
    rows = run_theirs(args.their_repo, args.arch, shape)
    for which in filter(None, args.remat_on.split(",")):
        family = args.arch.rstrip("0123456789")
        spec = _REMAT_NAMES[args.arch] if which == "torchvision" else f"net.{family}:{args.arch}"
        rows += run_remat(spec, f"{which}'s {args.arch}", args.batch_size, args.image_size)
    base = rows[0]["theirs"]
    print("| plan | Feng & Huang's measure | MB | cut vs their unmodified model | peak above start / left after | "
          "remat's measure (predicted) | notes |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ours = f"{r['remat'] / MIB:.1f} MiB ({r['predicted'] / MIB:.1f})" if "remat" in r else ""
        print(f"| {r['plan']} | {r['theirs'] / MIB:.1f} MiB | {r['theirs'] / 1e6:.0f} | {1 - r['theirs'] / base:.1%} | "
              f"{r['peak'] / MIB:.1f} / {r['end'] / MIB:.1f} MiB | {ours} | {r.get('gradients', '')} |", flush=True)


if __name__ == "__main__":
    main()
