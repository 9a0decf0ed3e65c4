"""The trace's constant values (`executor.module.constants`): what depends on no value the
step feeds it, computed once per input shape and reused; never a weight's, a random
op's or a buffer's that an op writes."""

from __future__ import annotations

import torch
from torch import nn

from executor.module.constants import constant_nodes


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("frequencies", torch.arange(4, dtype=torch.float32))
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[1]
        positions = torch.arange(rows, device=x.device)
        causal = positions[:, None] >= positions[None, :]  # shape-only
        angles = torch.cos(positions[:, None].float() * self.frequencies[None, :])
        scale = self.proj.weight.sum()  # reads a weight: not constant
        noise = torch.rand(rows)  # random: never constant
        self.running.add_(1.0)  # a buffer an op writes
        drift = self.running.mean()
        scores = x @ x.transpose(-1, -2) * scale + noise + drift
        scores = scores.masked_fill(~causal, float("-inf"))
        return scores.softmax(-1).sum() + angles.sum()


def test_constants_are_what_depends_on_shapes_literals_and_unwritten_buffers() -> None:
    module = torch.export.export(_Block(), (torch.randn(2, 5, 8),)).module()
    nodes = list(module.graph.nodes)
    weights = {str(n.target) for n in nodes if n.op == "get_attr"
               and str(n.target).startswith("proj.")}
    found = constant_nodes(nodes, weights)
    targets = {str(n.target) for n in found}
    # the causal mask from arange, and the cosines of a buffer no op writes (and their sum)
    assert {"aten.arange.default", "aten.ge.Tensor", "aten.cos.default",
            "aten.bitwise_not.default"} <= targets
    by_input = {n.name: n for n in nodes}
    assert by_input["sum_3"] in found  # the cosines' sum: all its inputs are constant
    for name in ("sum_1",  # reads a weight
                 "rand",  # random
                 "add_", "mean",  # the written buffer, and what reads it
                 "transpose", "matmul", "masked_fill", "softmax", "add_2"):  # the input's
        assert by_input[name] not in found, name
    assert all(n.op == "call_function" for n in found)
