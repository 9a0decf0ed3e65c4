"""Torch kernels a traced graph calls that DTensor cannot shard on every device, written
in ops it can.

DTensor registers sharding rules for the fused attention kernels of CUDA (flash and
memory-efficient) but not for the CPU one (`_scaled_dot_product_flash_attention_for_cpu`),
so on CPU ranks `scaled_dot_product_attention` runs as its mathematical definition,
softmax(q kᵀ · scale + mask) v, in the fused kernels' memory layout. Its matmuls, softmax
and elementwise ops keep a batch or head split without any communication.
"""

from __future__ import annotations

import math

import torch

from planner.errors import ShardplanError


def attention_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, *, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention`'s result, from its definition."""
    if dropout_p:
        raise ShardplanError("attention dropout inside scaled_dot_product_attention is not "
                             "run by executor.parallelize on CPU yet; train with "
                             "attention_dropout=0")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    if is_causal:
        length, source = query.shape[-2], key.shape[-2]
        causal = torch.ones(length, source, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    # The fused kernels return heads innermost in memory ([b, s, h, d] strides), and the
    # traced graph views the transposed result without a copy: keep that layout.
    return out.transpose(-3, -2).contiguous().transpose(-3, -2)
