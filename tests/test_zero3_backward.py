"""ZeRO 3 gathers a weight again before the backward pass only where that pass reads it.

autograd keeps a GEMM's weight only for its input's gradient, a norm's scale always, an
embedding table never (a Gather keeps its indices): the module executor gathers a freed
weight when autograd unpacks it, so a plan listing a backward gather of every weight
listed gathers no run issued. An embedding of over 25 MB has a bucket of its own (every
language model's): "collectives differ from the plan: all_gather|dp|backward planned 4
issued 2", and the plan priced an all-gather of the largest weight per micro-batch that
never runs. Recompute re-runs the ops reading a weight, so there it is gathered again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from module_runs import trains_as_one_process

from executor.module.launch import export_builder
from planner.api import load_graph, plan
from planner.kinds import CollectiveKind, Phase
from planner.sharding.analysis import GraphAnalysis, backward_read_weights

BATCH = 4
STEPS = 2

BUILDER = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8192, 832)  # 27 MB: a bucket of its own
        self.norm = nn.LayerNorm(832)
        self.a = nn.Linear(832, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, ids):
        return self.head(torch.tanh(self.a(self.norm(self.emb(ids)))).mean(1))


def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return {"ids": torch.randint(0, 8192, (rows, 6), generator=g)}


def loss(out, b):
    return F.cross_entropy(out, b["ids"][:, 0] % 4)


def trained():
    torch.manual_seed(0)
    return Net(), batch, loss


def head_only():
    torch.manual_seed(0)
    net = Net()
    for module in (net.emb, net.norm, net.a):
        module.requires_grad_(False)
    return net, batch, loss
'''


@pytest.fixture()
def builder(tmp_path: Path) -> Path:
    path = tmp_path / "embedded.py"
    path.write_text(BUILDER)
    return path


def _backward_gathered(chosen) -> set[str]:
    return {c.tensor for c in chosen.collectives
            if c.kind == CollectiveKind.ALL_GATHER and c.phase == Phase.BACKWARD}


def test_the_weights_the_backward_pass_reads(builder: Path, tmp_path: Path) -> None:
    """The table is never read; the norm's scale and shift always (the native kernel
    keeps both); a GEMM's weight where its input needs a gradient, and with the layers
    before the head frozen, not even the head's."""
    for name, expected in (("trained", {"norm.weight", "norm.bias", "a.weight",
                                        "head.weight"}),
                           ("head_only", set())):
        graph = load_graph(export_builder(f"{builder}:{name}", BATCH,
                                          tmp_path / f"{name}.onnx"), batch=BATCH)
        assert set(backward_read_weights(GraphAnalysis.of(graph))) == expected, name


@pytest.mark.parametrize(("name", "parallel", "gathered"), [
    ("trained", {"dp": 2, "zero": 3}, {"norm.weight", "norm.bias", "a.weight",
                                       "head.weight"}),
    ("trained", {"dp": 2, "zero": 3, "recompute": "full", "micro_batches": 2}, None),
    ("head_only", {"dp": 2, "zero": 3}, set())],
    ids=["trained", "recompute", "head-only"])
def test_zero3_gathers_before_the_backward_pass_what_the_run_gathers(
        builder: Path, tmp_path: Path, name: str, parallel: dict,
        gathered: set[str] | None) -> None:
    """Each run issues exactly the planned collectives (the table's bucket is not
    gathered again; under full recompute it is, the embedding re-run)."""
    spec = f"{builder}:{name}"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    trained = {t for t, info in chosen.tensors.items() if info.kind == "parameter"}
    assert _backward_gathered(chosen) == (trained if gathered is None else gathered)
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)
