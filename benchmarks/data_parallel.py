"""A plan's memory and time under data parallelism: one process, DistributedDataParallel and FSDP of the whole
model (FSDP2 ``fully_shard``, FSDP1), unmodified and with the plan applied (NOTE [ plans under data
parallelism ] in remat.client.model_wrappers).

    uv run python benchmarks/data_parallel.py --model resnet50 --batch 16 --side 128
    uv run python benchmarks/data_parallel.py --model hf:gpt2 --batch 2 --seq-len 256

Two ranks (gloo over loopback, one thread each), each training on its own batch (an ``hf:`` model: the
example call's batch, the same on both); gradients kept (zeroed in place) so that the peak is the step's
activations. Peak: the CPU allocator's bytes above their level at the step's start (torch.profiler's
allocation events, which also see what DDP's buckets and FSDP's all-gathers allocate); step time: the least
of ``--rounds`` rounds interleaving each wrapper's two models. Printed by rank 0 as a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_overhead import allocator_peak_mib  # noqa: E402

import remat.client  # noqa: E402
from remat.client.apply_plan import applied_plan  # noqa: E402

WRAPPERS = ("no wrapper", "DDP", "fully_shard (FSDP2), one unit", "FSDP1, one unit")


def _wrap(name: str, model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if name == "DDP":
        return DistributedDataParallel(model)
    if name.startswith("fully_shard"):
        return fully_shard(model)
    if name.startswith("FSDP1"):
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    return model


def _workload(args: argparse.Namespace, rank: int) -> tuple[Callable[[], nn.Module], tuple[Any, ...],
                                                            dict[str, Any], Callable[[nn.Module], torch.Tensor]]:
    """(the unmodified model's builder, the example call's arguments and keyword inputs, one loss of a wrapped
    model on this rank's batch): a torchvision classifier at ``--batch`` × ``--side``², or an ``hf:`` model at
    ``--batch`` × ``--seq-len`` computing its own loss."""
    if args.model.startswith("hf:"):
        from remat.client.hf_models import build_hf_model, hf_example_call

        def build() -> nn.Module:
            torch.manual_seed(0)
            return build_hf_model(args.model)

        _, example = hf_example_call(build(), args.model, batch_size=args.batch, seq_len=args.seq_len, device="cpu")
        return build, (), example, lambda wrapped: wrapped(**example).loss

    def build_classifier() -> nn.Module:
        torch.manual_seed(0)
        return getattr(torchvision.models, args.model)(num_classes=10)

    torch.manual_seed(100 + rank)
    x, y = torch.randn(args.batch, 3, args.side, args.side), torch.randint(0, 10, (args.batch,))
    return build_classifier, (x,), {}, lambda wrapped: nn.functional.cross_entropy(wrapped(x), y)


def _step(wrapped: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]) -> None:
    """One training step, gradients zeroed in place first."""
    for p in wrapped.parameters():
        if p.grad is not None:
            p.grad.zero_()
    loss_of(wrapped).backward()


def _measure(runs: dict[tuple[str, bool], nn.Module], loss_of: Callable[[nn.Module], torch.Tensor],
             rounds: int) -> tuple[dict[tuple[str, bool], float], dict[tuple[str, bool], list[float]]]:
    """Each run's allocator peak (MiB) and step times (ms) of ``rounds`` interleaved rounds, after a first step
    that allocates its gradients."""
    for wrapped in runs.values():
        _step(wrapped, loss_of)
    peaks = {k: allocator_peak_mib(lambda w=w: _step(w, loss_of)) for k, w in runs.items()}
    times: dict[tuple[str, bool], list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, w in runs.items():
            dist.barrier()
            started = time.perf_counter()
            _step(w, loss_of)
            times[k].append((time.perf_counter() - started) * 1e3)
    return peaks, times


def _rank(rank: int, args: argparse.Namespace, cache: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    build, example_args, example_kwargs, loss_of = _workload(args, rank)

    def model(applied: bool) -> nn.Module:
        m = build()
        if applied:
            remat.client.checkpoint(m, *example_args, grads="kept", algorithm=args.algorithm, cache_dir=cache,
                                    **example_kwargs)
        return m

    if rank == 0:
        plan = applied_plan(model(applied=True))
    dist.barrier()
    peaks: dict[tuple[str, bool], float] = {}
    times: dict[tuple[str, bool], list[float]] = {}
    for wrapper in WRAPPERS:  # one wrapper's two models at a time: eight GPT-2s with their gradients need 16 GB
        peak, took = _measure({(wrapper, a): _wrap(wrapper, model(a)) for a in (False, True)}, loss_of, args.rounds)
        peaks.update(peak)
        times.update(took)
        gc.collect()
    if rank == 0:
        params = sum(p.numel() * p.element_size() for p in model(False).parameters()) / 2**20
        rows = [{"wrapper": w, "applied": a, "peak_mib": peaks[w, a], "step_ms": min(times[w, a])}
                for w in WRAPPERS for a in (False, True)]
        Path(out).write_text(json.dumps({"rows": rows, "params_mib": params,
                                         "predicted_mib": plan.predicted_peak_bytes / 2**20,
                                         "baseline_predicted_mib": plan.baseline_peak_bytes / 2**20,
                                         "checkpoints": list(plan.checkpoints)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--side", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence of an hf: model")
    parser.add_argument("--algorithm", default="linear")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("REMAT_DATABASE_URL", f"sqlite:///{Path(tmp) / 'local.sqlite'}")
        out = Path(tmp) / "result.json"
        mp.spawn(_rank, args=(args, str(Path(tmp) / "plans"), str(out)), nprocs=args.world)
        result: dict[str, Any] = json.loads(out.read_text())
    size = f"{args.seq_len} tokens" if args.model.startswith("hf:") else f"{args.side}²"
    print(f"{args.model}, batch {args.batch} per rank at {size}, {args.world} ranks (gloo, 1 thread each), "
          f"gradients kept; torch {torch.__version__}; `{args.algorithm}` checkpoints {result['checkpoints']}, "
          f"predicted {result['predicted_mib']:.1f} MiB of {result['baseline_predicted_mib']:.1f} MiB; "
          f"parameters {result['params_mib']:.1f} MiB\n")
    print(f"| wrapper | unmodified peak | `{args.algorithm}` peak | saved | unmodified step | "
          f"`{args.algorithm}` step |")
    print("|---|---:|---:|---:|---:|---:|")
    by = {(r["wrapper"], r["applied"]): r for r in result["rows"]}
    for w in WRAPPERS:
        plain, planned = by[w, False], by[w, True]
        print(f"| {w} | {plain['peak_mib']:.1f} MiB | {planned['peak_mib']:.1f} MiB | "
              f"{plain['peak_mib'] - planned['peak_mib']:.1f} MiB | {plain['step_ms']:.0f} ms | "
              f"{planned['step_ms']:.0f} ms |")


if __name__ == "__main__":
    main()
