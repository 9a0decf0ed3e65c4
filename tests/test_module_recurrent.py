"""Recurrent layers (ONNX's RNN, GRU, LSTM) split along the batch.

They had no sharding rule: planned replicated, their inputs gathered to every rank (no
data parallelism for the model at all), the batch trace lost the rows there and refused
micro-batches, and the module executor's ranks then failed on DTensor ("Operator
aten.mkldnn_rnn_layer.default does not have a sharding strategy registered"). Each row
runs its own recurrence, so the batch splits and nothing else does (`axes.recurrent`,
proven against ONNX's evaluator in `tests/test_nodetests.py`); torch's kernels read the
parameters themselves in the backward pass, which the export lays out with slices and
concatenations (LSTM's gates reordered), so ZeRO 3 gathers them again
(`saving.weights_read_backward`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from module_runs import trains_as_one_process

from executor.module.launch import export_builder
from planner.api import load_graph, plan
from planner.ops import labels_for

BATCH = 8

BUILDER = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.rnn = nn.{kind}(16, 16, batch_first=True)
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        return self.head(h)


def batch(step, rows):
    return {{"ids": torch.randint(0, 32, (rows, 6),
                                 generator=torch.Generator().manual_seed(step))}}


def loss(out, b):
    return F.cross_entropy(out[:, :-1].flatten(0, 1), b["ids"][:, 1:].flatten())


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''


def _builder(folder: Path, kind: str) -> str:
    path = folder / f"{kind.lower()}_module.py"
    path.write_text(BUILDER.format(kind=kind))
    return f"{path}:build"


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_a_recurrent_layer_splits_along_the_batch(tmp_path: Path, kind: str) -> None:
    model = export_builder(_builder(tmp_path, kind), BATCH, tmp_path / "model.onnx")
    graph = load_graph(model, batch=BATCH)
    node = next(op for op in graph.ops if op.op_type == kind)
    labels = labels_for(node, graph.tensors)
    assert labels is not None
    # the export runs the layer sequence-first: X [steps, batch, features]; only the
    # batch splits, and the weights W, R, B are whole
    assert [label for label in labels.inputs[0] if label not in labels.whole_labels] == [
        labels.inputs[0][1]]
    assert all(set(w) <= labels.whole_labels for w in labels.inputs[1:4] if w)
    # two GEMMs per step and row: 6 steps × 8 rows × 2 × (W + R) elements, and the gates
    gates = 3 if kind == "GRU" else 4
    weights = gates * 16 * (16 + 16)
    assert node.flops == 6 * BATCH * (2 * weights + 10 * gates * 16)
    chosen = plan(model, devices=2, batch=BATCH, profile="cpu", parallel={"dp": 2})
    assert not any("no sharding rule" in w for w in chosen.warnings)
    assert not any("micro-batches" in w for w in chosen.warnings)


@pytest.mark.parametrize(("kind", "parallel"), [
    ("GRU", {"dp": 2, "zero": 3, "micro_batches": 2}),
    ("LSTM", {"dp": 2, "zero": 3, "micro_batches": 2}),
    ("LSTM", {"pp": 2, "micro_batches": 2, "schedule": "1f1b"})],
    ids=["gru-zero3", "lstm-zero3", "lstm-pp"])
def test_a_recurrent_layer_trains_as_one_process(tmp_path: Path, kind: str,
                                                 parallel: dict) -> None:
    """ZeRO 3 gathers the layer's parameters again for its backward pass: before, the
    plan listed none ("the plan lists no backward all_gather of rnn.weight_ih_l0"). A
    stage ending at the LSTM sends what its ONNX node `node_lstm__0` computes, the traced
    `getitem` of the layer's outputs, which the module executor now takes it for (it took
    it for a helper of the next layer's: "the plan sends getitem from chunk 0, which the
    traced module does not compute there")."""
    spec = _builder(tmp_path, kind)
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    trains_as_one_process(spec, chosen, steps=3, batch_size=BATCH)
