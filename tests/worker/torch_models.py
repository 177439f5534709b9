"""Small torch models and a stage-chain adapter for the profiler, meter and measurement tests.

``SequentialChain`` runs an ``nn.Sequential`` whose children are the stages the way
``remat.client.graph.stage_graph.StageChain.run`` does: every segment but the last under non-reentrant
checkpointing, BatchNorm running statistics swapped for clones during the recompute (the stage chain's
earlier way: NOTE [BatchNorm running stats under recompute] in client/graph/stage_chain.py), so the profiler
and ``measure_step`` are tested independently of the fx stage graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _swap_bn_buffers(modules: Sequence[nn.Module]) -> Iterator[None]:
    bns = [m for mod in modules for m in mod.modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(m, m.running_mean, m.running_var, m.num_batches_tracked) for m in bns]
    for m in bns:
        m.running_mean = m.running_mean.clone()
        m.running_var = m.running_var.clone()
        m.num_batches_tracked = m.num_batches_tracked.clone()
    try:
        yield
    finally:
        for m, mean, var, count in saved:
            m.running_mean, m.running_var, m.num_batches_tracked = mean, var, count


class SequentialChain:
    """The StageChain interface over an ``nn.Sequential``: child i is stage i (1-indexed)."""

    def __init__(self, seq: nn.Sequential) -> None:
        self.seq = seq
        self.names = list(seq._modules)  # named_children() would drop a module listed twice
        self.num_stages = len(self.names)

    def stage(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.seq[i - 1]

    def run(self, x: torch.Tensor, checkpoints: Sequence[int] = ()) -> torch.Tensor:
        bounds = (0, *sorted(checkpoints), self.num_stages)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            mods = list(self.seq)[a:b]

            def segment(h: torch.Tensor, mods: list[nn.Module] = mods) -> torch.Tensor:
                for m in mods:
                    h = m(h)
                return h

            if b < self.num_stages:
                x = checkpoint(segment, x, use_reentrant=False, preserve_rng_state=True,
                               context_fn=lambda mods=mods: (contextlib.nullcontext(), _swap_bn_buffers(mods)))
            else:
                handed = [x]
                del x  # as StageChain.run: nothing here keeps the last segment's input alive past its first stage
                return _run_handed(mods, handed)
        return x


def _run_handed(mods: list[nn.Module], handed: list[torch.Tensor]) -> torch.Tensor:
    h = handed.pop()
    for m in mods:
        h = m(h)
    return h


class BasicBlock(nn.Module):
    """A ResNet basic block with an in-place ReLU after the residual add (one stage)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + x)


class Downsample(nn.Module):
    """Strided conv + BN + ReLU: changes the activation size, so stages differ in d_i."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Head(nn.Module):
    """Global average pool, flatten, dropout and a linear classifier in one stage (no output aliasing)."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)))


def small_resnet(width: int = 8, blocks: int = 3, classes: int = 10) -> nn.Sequential:
    """A ResNet-ish chain of 2 + 2·blocks + 1 stages (stem, blocks, downsample, blocks, head)."""
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
    return nn.Sequential(stem, *[BasicBlock(width) for _ in range(blocks)], Downsample(width, 2 * width),
                         *[BasicBlock(2 * width) for _ in range(blocks)], Head(2 * width, classes))


def mlp() -> nn.Sequential:
    """Linear(8→16), ReLU, Linear(16→4): small enough to work every trace field out by hand."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
