"""A module's frozen weights (`requires_grad=False`, as fine-tuning leaves an embedding or
a backbone) are state in the plan: no gradient reaches them, none is summed, no optimizer
state is kept. Planned as weights, the run's gradient sums waited for a gradient that never
came, so no gradient was summed at all: each rank stepped on its own rows (4.209895
against one process's 4.198841 at step 2, "collectives differ")."""

from __future__ import annotations

from pathlib import Path

import pytest
from module_runs import trains_as_one_process

from executor.module.launch import export_builder, train_module
from executor.module.layouts import check_parameters
from planner.api import load_graph, plan
from planner.errors import ShardplanError
from planner.sharding.analysis import GraphAnalysis

BATCH = 4
STEPS = 3

BUILDER = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, ids):
        return self.b(torch.relu(self.a(self.emb(ids))))


def batch(step, rows):
    return {"ids": torch.randint(0, 64, (rows, 8),
                                 generator=torch.Generator().manual_seed(step))}


def loss(out, b):
    return nn.functional.cross_entropy(out.flatten(0, 1), b["ids"].flatten())


def frozen():
    torch.manual_seed(0)
    net = Net()
    net.emb.weight.requires_grad_(False)
    net.a.weight.requires_grad_(False)
    return net, batch, loss


def trainable():
    torch.manual_seed(0)
    return Net(), batch, loss


def with_unused():
    torch.manual_seed(0)
    net = Net()
    net.pooler = nn.Linear(64, 64)  # never read by the forward
    return net, batch, loss
'''

FROZEN = ("emb.weight", "a.weight")


@pytest.fixture()
def builder(tmp_path: Path) -> Path:
    path = tmp_path / "finetune.py"
    path.write_text(BUILDER)
    return path


def test_frozen_weights_are_state_and_train_as_one_process(builder: Path,
                                                           tmp_path: Path) -> None:
    spec = f"{builder}:frozen"
    exported = export_builder(spec, BATCH, tmp_path / "frozen.onnx")
    chosen = plan(exported, devices=2, batch=BATCH, profile="cpu",
                  parallel={"dp": 2, "zero": 1})
    assert all(chosen.tensors[name].kind == "buffer" for name in FROZEN)
    assert not any(c.tensor in FROZEN for c in chosen.collectives)
    trained = plan(export_builder(f"{builder}:trainable", BATCH, tmp_path / "all.onnx"),
                   devices=2, batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 1})
    # no gradients or optimizer state for the frozen weights
    assert chosen.predicted.memory.optimizer < trained.predicted.memory.optimizer
    assert chosen.predicted.memory.gradients < trained.predicted.memory.gradients
    assert trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH).unplanned == {}


def test_a_plan_that_disagrees_on_what_is_frozen_is_refused(builder: Path,
                                                            tmp_path: Path) -> None:
    """A plan made before the module froze a weight (or after it unfroze one)."""
    trained = plan(export_builder(f"{builder}:trainable", BATCH, tmp_path / "all.onnx"),
                   devices=2, batch=BATCH, profile="cpu", mode="data")
    names = [(n,) for n, e in trained.tensors.items() if e.kind == "parameter"]
    with pytest.raises(ShardplanError, match=r"parameter emb.weight is frozen "
                                             r"\(requires_grad=False\) in the module, but "
                                             r"the plan .* trains it: plan the module again"):
        check_parameters(trained, names, frozen=set(FROZEN))
    held = plan(export_builder(f"{builder}:frozen", BATCH, tmp_path / "frozen.onnx"),
                devices=2, batch=BATCH, profile="cpu", mode="data")
    with pytest.raises(ShardplanError, match=r"parameter emb.weight is trained by the module, "
                                             r"but the plan .* holds it frozen"):
        check_parameters(held, names + [(n,) for n in FROZEN if (n,) not in names])


def test_a_pipeline_stage_takes_each_exported_op_whole(builder: Path, tmp_path: Path) -> None:
    """The model has no repeated layers, so its units are FLOP-equal chunks of ops; a cut
    fell between the Transpose and the MatMul that `nn.Linear`'s one `aten.linear` became,
    and the rank failed ("the plan sends val_1 from chunk 0, which the traced module does
    not compute there"). Cuts now fall between the exported program's nodes."""
    spec = f"{builder}:trainable"
    exported = export_builder(spec, BATCH, tmp_path / "all.onnx")
    graph = load_graph(exported, batch=BATCH)
    assert graph.source_ops["node_MatMul_1"] == graph.source_ops["node_Transpose_0"]
    units = GraphAnalysis.of(graph).units
    for bound in units.bounds[1:-1]:
        before, after = graph.ops[bound - 1].name, graph.ops[bound].name
        assert graph.source_ops.get(before) != graph.source_ops.get(after)
    chosen = plan(exported, devices=2, batch=BATCH, profile="cpu",
                  parallel={"pp": 2, "micro_batches": 2, "schedule": "1f1b"})
    assert trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH).unplanned == {}


def test_a_parameter_the_forward_never_reads_stays_as_it_is(builder: Path,
                                                             tmp_path: Path) -> None:
    """The export leaves out a parameter no op reads, and so does the plan; the run was
    refused in the ranks ("module parameters the plan does not name: pooler.bias,
    pooler.weight"). No gradient reaches it: it stays in the module, whole."""
    spec = f"{builder}:with_unused"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "unused.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 3})
    assert "pooler.weight" not in chosen.tensors
    assert trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH).unplanned == {}


def test_a_fine_tuning_run_resumed_from_a_trained_one_keeps_the_trained_weights(
        builder: Path, tmp_path: Path) -> None:
    """Train every weight, checkpoint, then resume with some frozen (fine-tuning): the
    frozen weights were not in the checkpoint the run read, and kept their initial values
    (a sweep of 2026-12-06: 3.913922 at the resumed step against 3.822535). The resumed
    step's loss is the same whichever weights it goes on to train."""
    from executor.module.launch import Checkpoints

    first = plan(export_builder(f"{builder}:trainable", BATCH, tmp_path / "all.onnx"),
                 devices=2, batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 1})
    saved = str(tmp_path / "trained")
    train_module(f"{builder}:trainable", first, steps=2, batch_size=BATCH,
                 checkpoints=Checkpoints(save=saved))
    tuned = plan(export_builder(f"{builder}:frozen", BATCH, tmp_path / "frozen.onnx"),
                 devices=2, batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 1})
    resumed = train_module(f"{builder}:frozen", tuned, steps=1, batch_size=BATCH,
                           checkpoints=Checkpoints(resume=saved))
    again = train_module(f"{builder}:trainable", first, steps=1, batch_size=BATCH,
                         checkpoints=Checkpoints(resume=saved))
    assert resumed.losses == pytest.approx(again.losses, rel=1e-5)


def test_a_run_resumed_with_weights_unfrozen_trains_them_from_fresh_optimizer_state(
        builder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Fine-tune with some weights frozen and checkpoint, then resume with every weight
    trained (gradual unfreezing): the checkpoint holds the frozen weights' values but no
    optimizer state for them, and every rank failed ("Missing key in checkpoint
    state_dict: optim/emb.weight/exp_avg"; "it was saved from another model"). They now
    start their AdamW state fresh, as torch's optimizer does for a parameter group added
    later: the resumed steps are one process's, which the CLI says before the ranks
    start."""
    import torch

    from executor.module.launch import Checkpoints, load_builder
    from planner.cli import main

    tuned = plan(export_builder(f"{builder}:frozen", BATCH, tmp_path / "frozen.onnx"),
                 devices=2, batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 1})
    saved = str(tmp_path / "tuned")
    first = train_module(f"{builder}:frozen", tuned, steps=2, batch_size=BATCH,
                         optimizer="adamw", checkpoints=Checkpoints(save=saved))
    whole = plan(export_builder(f"{builder}:trainable", BATCH, tmp_path / "all.onnx"),
                 devices=2, batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 1})
    resumed = train_module(f"{builder}:trainable", whole, steps=2, batch_size=BATCH,
                           optimizer="adamw", checkpoints=Checkpoints(resume=saved))

    module, make_batch, loss_fn = load_builder(f"{builder}:frozen")()
    update = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for step in range(4):
        if step == 2:  # unfrozen: a parameter group of their own, its state fresh
            update.add_param_group({"params": [p for p in module.parameters()
                                               if not p.requires_grad]})
            module.requires_grad_(True)
        batch = make_batch(step, BATCH)
        value = loss_fn(module(**batch), batch)
        value.backward()
        update.step()
        update.zero_grad()
        losses.append(float(value.detach()))
    assert first.losses + resumed.losses == pytest.approx(losses, rel=1e-4)

    whole.save(tmp_path / "all.json")
    assert main(["run", "--module", f"{builder}:trainable", "--plan",
                 str(tmp_path / "all.json"), "--nproc", "2", "--steps", "1",
                 "--optimizer", "adamw", "--resume", saved]) == 0
    assert (f"{saved}: a.weight, emb.weight frozen when saved, trained now: their "
            "optimizer state starts fresh") in capsys.readouterr().err


def test_a_weight_frozen_since_planning_is_refused_before_any_rank_starts(
        builder: Path, tmp_path: Path) -> None:
    """The ranks refused it (exit 4, "rank 1 failed (...)") after each had started and
    exported the module; the launcher now asks the module it exported once."""
    tuned = plan(export_builder(f"{builder}:frozen", BATCH, tmp_path / "frozen.onnx"),
                 devices=2, batch=BATCH, profile="cpu", parallel={"dp": 2})
    with pytest.raises(ShardplanError) as refused:
        train_module(f"{builder}:trainable", tuned, steps=1, batch_size=BATCH)
    assert str(refused.value).startswith("parameter emb.weight is trained by the module, but "
                                         "the plan for")


def test_a_module_with_every_weight_frozen_is_refused() -> None:
    """Nothing to train: the reference's backward raised a traceback, the ranks a
    misleading "the loss does not depend on the model's output"."""
    import torch

    from executor.module.parallelize import refuse_nothing_to_train

    net = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ShardplanError, match=r"every parameter of Linear is frozen "
                                             r"\(requires_grad=False\): there is nothing"):
        refuse_nothing_to_train(net)


BLOCKS = '''
import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(step, rows):
    return {"ids": torch.randint(0, 64, (rows, 8),
                                 generator=torch.Generator().manual_seed(step))}


def loss(out, b):
    return F.cross_entropy(out.flatten(0, 1), b["ids"].flatten())


def first_frozen():
    torch.manual_seed(0)
    net = Net()
    net.blocks[0].requires_grad_(False)
    return net, batch, loss
'''


def test_a_move_the_plan_does_not_share_is_made_again(tmp_path: Path) -> None:
    """With its first block frozen the model has no repeated layers, and its units are
    chunks of ops that cut that block: Megatron's tp=2 plan reduce-scatters the embedding
    for the block's norm and again for its residual add, a unit later (the plan shares
    one move between reads of one recompute region only). The run shared one move
    between both reads: "collectives differ from the plan: reduce_scatter|tp|forward
    planned 9 issued 6", the losses right. It now moves where the plan lists a move."""
    path = tmp_path / "blocks.py"
    path.write_text(BLOCKS)
    spec = f"{path}:first_frozen"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"tp": 2, "layout": "megatron"})
    moves = [(c.op, c.tensor) for c in chosen.collectives
             if c.kind.value == "reduce_scatter" and c.tensor == "embedding"]
    assert len(moves) == 2  # the case: two reads of one value in one layout, both moved
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)
