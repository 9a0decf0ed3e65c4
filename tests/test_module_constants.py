"""The trace's constant values (`executor.module.constants`): what depends on no value the
step feeds it, computed once per input shape and reused; never a weight's, a random
op's or a buffer's that an op writes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from executor.module.constants import constant_nodes
from executor.module.launch import export_builder, load_builder
from executor.module.parallelize import parallelize, state_of
from executor.train import free_port
from planner.api import plan


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


class _Counted(TorchDispatchMode):
    """Counts the aten ops run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_a_planned_run_builds_its_constants_once_per_input_shape(tmp_path: Path) -> None:
    """The LLaMA's causal mask and rotary tables are built by the first step only: the
    second runs no `arange`, `cos` or `sin` (eager runs them every step)."""
    spec = "examples.hf_models:llama"
    chosen = plan(export_builder(spec, 8, tmp_path / "llama.onnx"), batch=8, devices=1,
                  profile="cpu", mode="data")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        module, make_batch, loss_fn = load_builder(spec)()
        module.train()
        module = parallelize(module, chosen, make_batch(0, 8))
        state = state_of(module)
        assert state.run.constants
        counts = []
        for step in range(2):
            with _Counted() as counted:
                state.train_step(loss_fn, make_batch(step, 8))
            counts.append(counted.seen)
        for op in ("aten.arange", "aten.cos", "aten.sin"):
            assert counts[0][op] > 0 and counts[1][op] == 0, (op, counts[0][op], counts[1][op])
        assert len(state.run._folded) == 1  # one input shape so far
    finally:
        dist.destroy_process_group()
