"""A NAS-like network (DARTS-style cells) for the graph planner: branches that cross inside every cell.

Each cell reads the two previous cells' outputs, computes four intermediate nodes, each the sum of two ops
applied to earlier nodes (a fixed genotype, so the graph is the same every time), and concatenates them.
No single tensor cuts a cell, and the cell inputs feed nodes across it, so the chain builder sees each
pair of cells as one stage while the op graph sees every op. Torch only; also a ``package.module:callable``
model spec (``tests.utils.nas_cell:nas_net``) for the CLI and benchmarks.
"""

from __future__ import annotations

import torch
from torch import nn

# (op, input) pairs per intermediate node; inputs 0 and 1 are the cell inputs, 2.. the earlier nodes.
GENOTYPE: tuple[tuple[tuple[str, int], tuple[str, int]], ...] = (
    (("sep_conv", 0), ("sep_conv", 1)),
    (("sep_conv", 0), ("dil_conv", 2)),
    (("max_pool", 1), ("skip", 2)),
    (("sep_conv", 3), ("skip", 0)),
)


class ReLUConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int = 1, dilation: int = 1) -> None:
        super().__init__()
        pad = dilation * (kernel - 1) // 2
        self.op = nn.Sequential(nn.ReLU(inplace=False), nn.Conv2d(cin, cout, kernel, padding=pad,
                                                                   dilation=dilation, bias=False),
                                nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


def _op(name: str, channels: int) -> nn.Module:
    if name == "sep_conv":
        return nn.Sequential(ReLUConvBN(channels, channels, 3), ReLUConvBN(channels, channels, 3))
    if name == "dil_conv":
        return ReLUConvBN(channels, channels, 3, dilation=2)
    if name == "max_pool":
        return nn.MaxPool2d(3, stride=1, padding=1)
    if name == "skip":
        return nn.Identity()
    raise ValueError(name)


class Cell(nn.Module):
    def __init__(self, c_prev_prev: int, c_prev: int, channels: int) -> None:
        super().__init__()
        self.pre0 = ReLUConvBN(c_prev_prev, channels)
        self.pre1 = ReLUConvBN(c_prev, channels)
        self.ops = nn.ModuleList(_op(name, channels) for pair in GENOTYPE for name, _ in pair)
        self.inputs = [index for pair in GENOTYPE for _, index in pair]

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = [self.pre0(s0), self.pre1(s1)]
        for node in range(len(GENOTYPE)):
            a, b = 2 * node, 2 * node + 1
            states.append(self.ops[a](states[self.inputs[a]]) + self.ops[b](states[self.inputs[b]]))
        return torch.cat(states[2:], dim=1)


class NASNet(nn.Module):
    """Stem, ``cells`` DARTS-style cells, global pool and a linear classifier."""

    def __init__(self, cells: int = 4, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 3 * channels, 3, padding=1, bias=False), nn.BatchNorm2d(3 * channels))
        c_pp, c_p = 3 * channels, 3 * channels
        self.cells = nn.ModuleList()
        for _ in range(cells):
            self.cells.append(Cell(c_pp, c_p, channels))
            c_pp, c_p = c_p, len(GENOTYPE) * channels
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_p, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.fc(torch.flatten(self.pool(s1), 1))


def nas_net(cells: int = 4, channels: int = 8, classes: int = 10) -> NASNet:
    """The model-spec entry point: a seeded NASNet."""
    torch.manual_seed(0)
    return NASNet(cells=cells, channels=channels, classes=classes)
