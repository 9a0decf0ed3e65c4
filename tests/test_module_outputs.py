"""What a module's forward takes and gives, beyond tensors of rows: its outputs in any
structure torch exports (a tuple, a dict of logits and extras), which the loss function
gets in that structure (a dict was taken for one leaf of itself and failed the rank:
"`leaves` has length 1 but the spec refers to a pytree that holds 2 items"); and a 0-d
input, which every micro-batch reads whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from module_runs import trains_as_one_process

from executor.module.launch import export_builder
from planner.api import plan

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

    def forward(self, ids):
        hidden = torch.relu(self.emb(ids))
        return {"logits": self.a(hidden), "aux": hidden.mean()}


def batch(step, rows):
    return {"ids": torch.randint(0, 64, (rows, 8),
                                 generator=torch.Generator().manual_seed(step))}


def loss(out, b):
    return (nn.functional.cross_entropy(out["logits"].flatten(0, 1), b["ids"].flatten())
            + 0.1 * out["aux"])


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"pp": 2, "micro_batches": 2,
                                                  "schedule": "1f1b"}], ids=["dp", "pp"])
def test_a_forward_returning_a_dict_trains_as_one_process(tmp_path: Path,
                                                          parallel: dict) -> None:
    builder = tmp_path / "dict_outputs.py"
    builder.write_text(BUILDER)
    spec = f"{builder}:build"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    # no move the plan does not make: under dp the traced `mean` is two exported ops,
    # ReduceMean and Squeeze, and the plan all-reduces the pending sum between them; the
    # run makes that all-reduce at the traced node's output (recorded as a move of its
    # own before: `mean: (Partial(avg),) -> (Replicate(),)`)
    assert trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH).unplanned == {}


SCALAR_INPUT = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.a = nn.Linear(32, 64)

    def forward(self, ids, scale):
        return self.a(torch.relu(self.emb(ids))) * scale


def batch(step, rows):
    return {"ids": torch.randint(0, 64, (rows, 8),
                                 generator=torch.Generator().manual_seed(step)),
            "scale": torch.tensor(0.5)}


def loss(out, b):
    return nn.functional.cross_entropy(out.flatten(0, 1), b["ids"].flatten())


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''


@pytest.mark.parametrize("parallel", [{"dp": 2, "micro_batches": 2},
                                      {"pp": 2, "micro_batches": 2, "schedule": "1f1b"}],
                         ids=["dp-micro", "pp"])
def test_a_scalar_in_the_batch_goes_whole_to_every_micro_batch(tmp_path: Path,
                                                                parallel: dict) -> None:
    """A 0-d input (a step's setting) has no rows: it was refused in the ranks ("input
    scale: () does not split into 1 micro-batches along dim 0")."""
    builder = tmp_path / "scalar_input.py"
    builder.write_text(SCALAR_INPUT)
    spec = f"{builder}:build"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    assert trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH).unplanned == {}


SCALARS = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.t = nn.Parameter(torch.tensor(1.5))  # a learnable temperature
        self.r = nn.Linear(16, 1)  # a bias of one element

    def forward(self, x):
        h = torch.tanh(self.a(x) * self.t)
        return h, self.r(h).squeeze(-1)


def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(rows, 16, generator=g)}


def loss(out, b):
    return F.mse_loss(out[0], torch.sin(b["x"])) + F.mse_loss(out[1], b["x"][:, 0])


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''


@pytest.mark.parametrize("parallel", [{"dp": 2, "zero": 1}, {"tp": 2},
                                      {"pp": 2, "micro_batches": 2, "schedule": "1f1b"}],
                         ids=["dp", "tp", "pp"])
def test_a_parameter_of_one_element_is_trained(tmp_path: Path, parallel: dict) -> None:
    """A learnable scalar (`nn.Parameter(torch.tensor(1.5))`, the bias of a
    `Linear(16, 1)`) exports as a one-element initializer, which the importer took for a
    constant: the plan did not name it and every rank refused the module ("module
    parameters the plan does not name: r.bias"). The export now declares them."""
    builder = tmp_path / "scalars.py"
    builder.write_text(SCALARS)
    spec = f"{builder}:build"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    assert chosen.tensors["t"].kind == "parameter" and chosen.tensors["r.bias"].kind == \
        "parameter"
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)


UNREAD = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)
        self.c = nn.Linear(16, 3)  # its output is returned, and the loss does not read it

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h), self.c(h)


def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(rows, 16, generator=g)}


def loss(out, b):
    return F.mse_loss(out[0], torch.sin(b["x"][:, :4]))


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''


@pytest.mark.parametrize(("parallel", "optimizer"), [
    ({"dp": 2, "zero": 0}, "sgd"), ({"dp": 2, "zero": 1}, "adamw"),
    ({"dp": 2, "zero": 2}, "sgd"), ({"dp": 2, "zero": 3, "micro_batches": 2}, "adamw")],
    ids=["zero0", "zero1-adamw", "zero2", "zero3-micro-adamw"])
def test_weights_only_an_unread_output_depends_on_train_as_one_process(
        tmp_path: Path, parallel: dict, optimizer: str) -> None:
    """`c` gets no gradient: the plan's bucket holding it waited for it, so no gradient
    of the bucket was summed and each rank stepped on its own rows' (0.753503 at step 3
    against one process's 0.661790, "collectives differ from the plan: all_reduce|dp|
    gradient planned 3 issued 0"). The bucket is now summed with zeros in its place, and
    `c` keeps no gradient, so AdamW leaves it as one process does."""
    from executor.module.launch import train_module, train_module_reference

    builder = tmp_path / "unread.py"
    builder.write_text(UNREAD)
    spec = f"{builder}:build"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    run = train_module(spec, chosen, steps=STEPS, batch_size=BATCH, optimizer=optimizer)
    alone = train_module_reference(spec, steps=STEPS, batch_size=BATCH, optimizer=optimizer)
    assert run.losses == pytest.approx(alone, rel=1e-4)
    assert run.differences == []


TOPK = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        values, _ = torch.topk(self.a(x), 4, dim=-1)
        return self.b(values)


def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(rows, 16, generator=g)}


def loss(out, b):
    return F.mse_loss(out, torch.sin(b["x"][:, :4]))


def build():
    torch.manual_seed(0)
    return Net(), batch, loss
'''


def test_a_stage_starting_at_a_multi_output_op_takes_its_getitems(tmp_path: Path) -> None:
    """The export names `topk`'s ONNX node `node_topk__1`, which no traced node is named
    after; the second stage's first traced node was then the next GEMM's, and `topk` and
    its `getitem` ran on the first stage: "pipeline chunk 1 reads getitem from chunk 0,
    which the plan does not send"."""
    builder = tmp_path / "topk.py"
    builder.write_text(TOPK)
    spec = f"{builder}:build"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu",
                  parallel={"pp": 2, "micro_batches": 2, "schedule": "1f1b"})
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)


def test_outputs_of_two_pipeline_stages_are_refused_naming_them(tmp_path: Path) -> None:
    """The loss reads every output on one stage; a plan computing them on two failed the
    rank with "plan this module's own export", which it was."""
    from executor.module.launch import train_module
    from executor.ranks import RunFailed

    builder = tmp_path / "unread.py"
    builder.write_text(UNREAD)
    spec = f"{builder}:build"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu",
                  parallel={"pp": 2, "micro_batches": 2, "schedule": "1f1b"})
    if len({stage.device_stage for stage in chosen.pipeline.stages}) < 2:
        pytest.skip("the plan put both outputs on one stage")
    with pytest.raises(RunFailed, match=r"the plan computes the module's output \w+ on "
                                        r"pipeline chunk \d and others on chunk \d"):
        train_module(spec, chosen, steps=1, batch_size=BATCH)


def _own_loop_gradients(rank: int, port: int, plan_file: str, builder: str,
                        out: str) -> None:
    """Rank `rank` of 2: the user's own loop (`shardplan.loss(...).backward()`, no
    `train_step`) on `builder`'s module; each parameter's largest gradient difference
    from one process's on the whole batch, None for one without a gradient on both."""
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from executor.module.launch import load_builder
    from executor.module.parallelize import parallelize
    from planner.plans.model import Plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        eager, make_batch, loss_fn = load_builder(builder)()
        module, _, _ = load_builder(builder)()
        module = parallelize(module, Plan.load(plan_file), make_batch(0, BATCH))
        found: dict[str, float | None] = {}
        for step in range(2):
            data = make_batch(step, BATCH)
            eager.zero_grad()
            module.zero_grad()
            loss_fn(eager(**data), data).backward()
            module.shardplan.loss(loss_fn, module(**data), data).backward()
            for (name, ours), theirs in zip(module.named_parameters(), eager.parameters(),
                                            strict=True):
                if ours.grad is None or theirs.grad is None:
                    found[name] = None if ours.grad is theirs.grad is None else 1.0
                    continue
                grad = ours.grad.full_tensor() if isinstance(ours.grad, DTensor) \
                    else ours.grad
                found[name] = max(found.get(name) or 0.0,
                                  float((grad - theirs.grad).abs().max()))
        if rank == 0:
            Path(out).write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def test_an_unread_output_in_the_users_own_loop_gives_one_process_gradients(
        tmp_path: Path) -> None:
    """The bucket holding `c`, which gets no gradient, was summed only after
    `train_step`'s backward pass: in the user's own loop it waited for ever, and each
    rank kept its own rows' gradients of `a` and `b` (exit 0). It is now summed at the end
    of any backward pass that reached a weight."""
    import json

    from executor.ranks import run_ranks
    from executor.train import free_port

    builder = tmp_path / "unread.py"
    builder.write_text(UNREAD)
    spec = f"{builder}:build"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 0})
    plan_file, out = tmp_path / "plan.json", tmp_path / "found.json"
    chosen.save(plan_file)
    run_ranks(_own_loop_gradients, (free_port(), str(plan_file), spec, str(out)), 2,
              timeout_s=300)
    found = json.loads(out.read_text())
    assert found["c.weight"] is None and found["c.bias"] is None, found
    assert all(found[name] < 1e-5 for name in ("a.weight", "a.bias", "b.weight",
                                               "b.bias")), found


OWN_LOSS = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):  # returns its own loss beside its logits, as transformers' models do
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 5)

    def forward(self, x, y):
        logits = self.b(torch.tanh(self.a(x)))
        return {"loss": F.cross_entropy(logits, y, ignore_index=-100), "logits": logits}


def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(rows, 16, generator=g), "y": torch.randint(0, 5, (rows,), generator=g)}


def ignoring(step, rows):  # some targets ignored, more on one rank's rows than the other's
    found = batch(step, rows)
    found["y"][torch.arange(rows) % 3 == 1] = -100
    return found


def build():
    torch.manual_seed(0)
    return Net(), batch, lambda out, b: out["loss"]


def build_ignoring():
    torch.manual_seed(0)
    return Net(), ignoring, lambda out, b: out["loss"]


def penalised():
    torch.manual_seed(0)
    net = Net()
    return net, batch, lambda out, b: out["loss"] + 0.01 * net.a.weight.pow(2).sum()
'''


@pytest.mark.parametrize(("builder_fn", "parallel"), [
    ("build", {"dp": 2, "zero": 0}), ("build", {"dp": 2, "zero": 3}),
    ("build_ignoring", {"dp": 2, "zero": 0})], ids=["zero0", "zero3", "ignored"])
def test_a_model_returning_its_own_loss_beside_its_logits_trains_as_one_process(
        tmp_path: Path, builder_fn: str, parallel: dict) -> None:
    """The loss's gradient was taken with respect to both outputs, the loss output being
    computed from the logits, and back-propagated from both: every rank failed ("Trying to
    backward through the graph a second time"). It now starts from the outputs the loss
    reads itself. With targets ignored unevenly over the ranks, the plan's mean over kept
    targets (two sums reduced, then divided) is one process's too."""
    builder = tmp_path / "own.py"
    builder.write_text(OWN_LOSS)
    spec = f"{builder}:{builder_fn}"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel=parallel)
    trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH)


def test_a_weight_penalty_in_the_loss_is_refused_naming_it(tmp_path: Path) -> None:
    """`loss_fn` reading a module weight read, under ZeRO, this rank's chunk of it (half the
    penalty on two ranks, exit 0), and on DTensors its gradient never reached the weight."""
    from executor.module.launch import train_module
    from executor.ranks import RunFailed

    builder = tmp_path / "own.py"
    builder.write_text(OWN_LOSS)
    spec = f"{builder}:penalised"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "model.onnx"), devices=2,
                  batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 3})
    with pytest.raises(RunFailed, match=r"loss_fn reads a tensor of shape \(\d+,\) that "
                                        r"needs a gradient and is not the model's output"):
        train_module(spec, chosen, steps=1, batch_size=BATCH)


def test_a_model_computing_its_own_loss_is_planned_as_onnx_defines_the_loss(
        tmp_path: Path) -> None:
    """The export's `SoftmaxCrossEntropyLoss` had no sharding rule: planned replicated,
    it gathered the logits to every rank. It is now planned as the ops ONNX defines it by
    (`planner.importer.functions`): the rows split over dp, and the mean's two sums are
    the only values the forward pass reduces (a few bytes each), no logits gathered."""
    builder = tmp_path / "own.py"
    builder.write_text(OWN_LOSS)
    chosen = plan(export_builder(f"{builder}:build", BATCH, tmp_path / "model.onnx"),
                  devices=2, batch=BATCH, profile="cpu", parallel={"dp": 2, "zero": 0})
    assert not any("no sharding rule" in w for w in chosen.warnings)
    assert any(op.name.startswith("node_cross_entropy_loss__") for op in chosen.ops)
    forward = [c for c in chosen.collectives if c.phase.value == "forward"]
    assert forward and all(c.kind.value == "all_reduce" and c.bytes <= 8 for c in forward)
