"""Builders for the Megatron layout of dynamo exports (tests/test_megatron_layout.py): a
transformer of `nn.Linear` projections on given embeddings, which the dynamo exporter
writes as `MatMul(x, Transpose(W))`."""

from __future__ import annotations

import torch
from torch import nn

Batch = dict[str, torch.Tensor]
WIDTH, HEADS, SEQUENCE = 32, 2, 8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        normed = self.norm1(x)
        q, k, v = (proj(normed).view(b, s, HEADS, w // HEADS).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, s, w))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Dense(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(step: int, size: int) -> Batch:
    generator = torch.Generator().manual_seed(3000 + step)
    return {"x": torch.randn(size, SEQUENCE, WIDTH, generator=generator)}


def _loss(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    return nn.functional.mse_loss(out, batch["x"])


def dense():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return Dense(), _batch, _loss
