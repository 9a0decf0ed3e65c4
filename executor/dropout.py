"""Dropout masks that any split of a tensor draws alike: a hash of (draw, global index).

A rank that holds one block of a tensor (a batch shard, a tensor-parallel slice, one
micro-batch of the step) must keep exactly the elements one device training the whole
batch keeps, or a split run's losses drift from one device's (2-3e-3 relative after five
GPT-2 steps with a per-rank `torch.rand`). So the mask is not drawn from a stream: each
element's keep bit is a counter-based hash of its draw (seed, step, op) and its global
coordinates, as Philox-style counter RNGs (Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3", SC'11) and Megatron-LM's model-parallel RNG tracker make random
numbers a function of where they are used. The hash is MurmurHash3's 32-bit finaliser
(fmix32) chained over the coordinates: every input bit reaches every output bit, and it
needs only shifts, xors and multiplies, done here in int64 on 16-bit halves so no product
overflows. A recomputed forward (activation checkpointing) draws the same mask again for
free, since nothing is consumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_FMIX_1 = 0x85EBCA6B  # MurmurHash3 fmix32 multipliers
_FMIX_2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9  # 2^32 / phi: spreads consecutive keys apart
_UNIFORM_BITS = 24  # float32 holds 24-bit integers exactly


@dataclass(frozen=True)
class DropoutSite:
    """Where one Dropout draws: the draw's key and the block of the global tensor held.

    `offsets[d]` is where this rank's block starts along dim d of the tensor one device
    would hold for the whole step (the micro-batch's place in the batch included).
    """

    seed: int
    step: int
    op: int  # the op's index in the graph: each Dropout draws its own mask
    offsets: tuple[int, ...]

    def key(self) -> int:
        """One 32-bit key per (seed, step, op)."""
        h = 0
        for part in (self.seed, self.step, self.op):
            h = _fmix32_int(((h ^ (part & _MASK32)) + _GOLDEN) & _MASK32)
        return h


def _mul32(h: torch.Tensor, constant: int) -> torch.Tensor:
    """(h * constant) mod 2^32 for 0 <= h < 2^32, in int64 without overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (h * low + (((h * high) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX_1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX_2)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    return int(_fmix32(torch.tensor(h, dtype=torch.int64)).item())


def uniform(site: DropoutSite, shape: Sequence[int],
            device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform [0, 1) floats for the block of `shape` at `site.offsets` (float32, exact
    multiples of 2^-24): the same value for the same global element under any split,
    computed on `device` (a GPU draws its masks where they are used)."""
    if len(shape) != len(site.offsets):
        raise ValueError(f"a block of rank {len(shape)} at offsets {site.offsets}")
    h = torch.full((1,) * len(shape), site.key(), dtype=torch.int64, device=device)
    for dim, (size, offset) in enumerate(zip(shape, site.offsets, strict=True)):
        view = [1] * len(shape)
        view[dim] = size
        index = torch.arange(offset, offset + size, dtype=torch.int64,
                             device=device).reshape(view)
        h = _fmix32(((h ^ (index & _MASK32)) + _GOLDEN) & _MASK32)
    h = h.expand(tuple(shape))
    return (h >> (32 - _UNIFORM_BITS)).to(torch.float32) * (2.0 ** -_UNIFORM_BITS)


def keep_mask(site: DropoutSite, shape: Sequence[int], ratio: float,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """True where an element is kept: its uniform draw is at least `ratio`."""
    return uniform(site, shape, device) >= ratio
