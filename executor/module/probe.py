"""A small transformer for timing the executor's host work (`shardplan calibrate`).

Its kernels take microseconds, so a step's time is mostly the host's: the executor's
Python per op and DTensor's dispatch. `planner.cli.calibrate` plans it at two depths
(`probe_1`, `probe_6`: builders as `executor.module.launch.load_builder` names them),
runs it and fits the host's time per op run into the calibrated profile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: The probe's depths: the slope between them is the time per op run.
PROBE_LAYERS = (1, 6)
PROBE_BATCH = 4
PROBE_SEQUENCE = 8
PROBE_WIDTH = 32

Batch = dict[str, torch.Tensor]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # separate projections, as LLaMA's: Megatron's layout splits them by heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        normed = self.norm1(x)
        q, k, v = (proj(normed).view(b, s, self.heads, w // self.heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).contiguous().reshape(b, s, -1))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Probe(nn.Module):
    """A GPT's blocks at toy sizes on given embeddings (no vocabulary: the probe times
    the host, not an embedding's or a loss's kernels), its kernels microseconds long, so
    a step's time is mostly the host's."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(PROBE_WIDTH, 2) for _ in range(layers))
        self.norm = nn.LayerNorm(PROBE_WIDTH)
        self.head = nn.Linear(PROBE_WIDTH, PROBE_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _batch(step: int, batch_size: int) -> Batch:
    generator = torch.Generator().manual_seed(2000 + step)
    return {"x": torch.randn(batch_size, PROBE_SEQUENCE, PROBE_WIDTH, generator=generator)}


def _loss(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    return nn.functional.mse_loss(output, batch["x"])


def _builder(layers: int) -> Callable[[], tuple[nn.Module, Callable[[int, int], Batch],
                                             Callable[[Any, Batch], torch.Tensor]]]:
    def build() -> tuple[nn.Module, Callable[[int, int], Batch],
                         Callable[[Any, Batch], torch.Tensor]]:
        torch.manual_seed(0)
        return Probe(layers), _batch, _loss
    return build


# the builders `executor.module.launch.load_builder` finds by name, one per depth
probe_1 = _builder(PROBE_LAYERS[0])
probe_6 = _builder(PROBE_LAYERS[1])
