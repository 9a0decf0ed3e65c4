"""Rows' positions in the batch on one rank's rows (`executor.module.positions`).

transformers indexes the padding mask by the batch's row numbers
(`mask[arange(batch)[:, None, None, None], kv]`): under dp=2 GPT-2's mask was gathered to
every rank once per forward pass, a collective the plan does not list ("collectives differ
from the plan: all_gather|dp|forward planned 0 issued 3"), because a batch key the module
never reads (`labels`, laid out whole) had turned every local op off. A module using the
row numbers as values (`x + arange(batch)[:, None]`) trained wrong under dp=2, exit 0:
rank 1 numbered its rows from 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from module_runs import trains_as_one_process

from executor.module.launch import export_builder, load_builder, shared_trace
from executor.module.parallelize import _Trace
from executor.module.positions import row_positions
from planner.api import plan

BATCH = 8

BUILDER = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 16)

    def forward(self, ids, mask, labels=None):
        rows = torch.arange(ids.shape[0], device=ids.device)
        h = torch.tanh(self.a(self.emb(ids)))
        if {pick}:
            kept = mask[rows[:, None], torch.arange(ids.shape[1])[None, :]]  # transformers'
            h = h * kept[..., None]
        return self.b(h{extra})


def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    mask = (torch.rand(rows, 6, generator=g) > 0.3).long()
    mask[:, 0] = 1
    ids = torch.randint(0, 16, (rows, 6), generator=g)
    return {{"ids": ids, "mask": mask, "labels": torch.where(mask > 0, ids, -100)}}


def loss(out, b):
    return F.cross_entropy(out.flatten(0, 1), b["labels"].flatten())


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''

#: the forward's row numbers as values besides the index
AS_VALUES = " + 0.1 * rows[:, None, None].to(h.dtype)"


def _builder(folder: Path, extra: str, pick: bool = True) -> str:
    path = folder / "positions_module.py"
    path.write_text(BUILDER.format(extra=extra, pick=pick))
    return f"{path}:build"


def test_row_numbers_read_only_by_an_index_of_the_rows_are_found(tmp_path: Path) -> None:
    spec = _builder(tmp_path, "")
    module, make_batch, _ = load_builder(spec)()
    trace = _Trace.of(module, make_batch(0, BATCH), shared_trace(spec, BATCH))
    numbers, picks = row_positions(trace.graph)
    assert len(picks) == 1 and numbers
    # read as values too, they are not this rank's numbers
    spec = _builder(tmp_path, AS_VALUES)
    module, make_batch, _ = load_builder(spec)()
    trace = _Trace.of(module, make_batch(0, BATCH), shared_trace(spec, BATCH))
    numbers, picks = row_positions(trace.graph)
    assert not numbers and not picks


@pytest.mark.parametrize(("extra", "pick"), [("", True), (AS_VALUES, False)],
                         ids=["mask", "values"])
def test_rows_picked_by_their_positions_train_as_one_process_with_the_planned_collectives(
        tmp_path: Path, extra: str, pick: bool) -> None:
    """The mask: "collectives differ" before; the row numbers as values: 0.513094
    against one process's 0.581511 at step 1 before. (Both at once are right too, the
    pick then on DTensors: it gathers the mask, which the run reports.)"""
    spec = _builder(tmp_path, extra, pick)
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 0})
    run = trains_as_one_process(spec, chosen, steps=3, batch_size=BATCH)
    assert run.unplanned == {}
