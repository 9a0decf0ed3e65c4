"""Builders for tests/test_module_rowloss.py: one small MLP, three losses over its rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _batch(step: int, size: int) -> Batch:
    generator = torch.Generator().manual_seed(step)
    return {"x": torch.randn(size, 8, generator=generator)}


def _targets(batch: Batch) -> torch.Tensor:
    return (batch["x"][:, :4].argmax(dim=1)).long()


def _mean(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(out, _targets(batch))


def _sum(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(out, _targets(batch), reduction="sum") / 64


def _coupled(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each row against the batch's mean: not a sum of per-row terms."""
    return ((out - out.mean(dim=0)) ** 2).mean()


def mean_loss() -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)
    return _MLP(), _batch, _mean


def sum_loss() -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)
    return _MLP(), _batch, _sum


def coupled_loss() -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)
    return _MLP(), _batch, _coupled
