"""A model a user would write (not from any zoo), and batches for it: torch only, so a fresh interpreter can
import it without loading anything else of the test suite."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SHAPE = (8, 3, 32, 32)


class Block(nn.Module):
    """A residual block with BatchNorm (buffers a recompute must not update twice) and dropout (RNG)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.relu(self.bn(self.conv(x))))


class UserNet(nn.Module):
    def __init__(self, depth: int = 6, channels: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(depth)])
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


def user_model(seed: int = 0, **kw: int) -> UserNet:
    torch.manual_seed(seed)
    return UserNet(**kw)


def user_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(SHAPE, generator=g), torch.randint(0, 10, (SHAPE[0],), generator=g)) for _ in range(n)]
