"""Train with a plan on N local ranks (gloo), or as one process for reference.

`train(model, plan, nproc, steps)` spawns the ranks, feeds every rank the same synthetic
global batch (each keeps its shard, the seed's `num_shards`/`shard_id`), runs forward,
the cross-entropy loss, backward, the plan's gradient sums and an SGD step, and returns
the losses, step times and collective counts of rank 0.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor import checkpoint as checkpoints
from executor.runtime import PlanRunner, check_plan_matches, onnx_weights
from planner.api import load_graph
from planner.errors import ShardplanError
from planner.graph import PlanningGraph
from planner.planfile import Plan


@dataclass
class RunLog:
    losses: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    predicted_step_time_s: float = 0.0
    collectives: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"losses": self.losses, "step_time_s": self.step_time_s,
                "predicted_step_time_s": self.predicted_step_time_s,
                "collectives": self.collectives}


LOSSES = ("auto", "graph", "ce", "mse")


def loss_kind(graph: PlanningGraph, wanted: str = "auto") -> tuple[str, str]:
    """(kind, output): the model's own scalar loss output when it has one, else
    cross-entropy on integer-class logits."""
    scalar = [o for o in graph.outputs if graph.tensors[o].numel == 1
              and graph.tensors[o].is_float]
    if wanted not in LOSSES:
        raise ShardplanError(f"--loss {wanted!r}: choose one of {', '.join(LOSSES)}")
    if wanted in ("auto", "graph") and scalar:
        return "graph", scalar[0]
    if wanted == "graph":
        raise ShardplanError(f"{graph.path} has no scalar loss output; use --loss ce or mse")
    return ("ce" if wanted == "auto" else wanted), graph.outputs[0]


def batch_data(graph: PlanningGraph, seed: int, kind: str, output: str,
               data: str = "") -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The global batch: `<data>/<input>.npy` (and `targets.npy`) when given, else
    synthetic: valid token ids for embeddings, normal floats, class or float targets."""
    generator = torch.Generator().manual_seed(seed + 1)
    feeds: dict[str, torch.Tensor] = {}
    for name in graph.inputs:
        info = graph.tensors[name]
        stored = Path(data) / f"{name}.npy" if data else None
        if stored is not None and stored.exists():
            array = np.load(stored, allow_pickle=False)
            if tuple(array.shape) != info.shape:
                raise ShardplanError(f"{stored}: shape {list(array.shape)}, but input {name} "
                                     f"is {list(info.shape)} in the plan")
            feeds[name] = torch.from_numpy(array.astype(info.dtype))
        elif info.dtype.startswith("int"):
            high = min((graph.tensors[graph.op(c).inputs[0]].shape[0] for c in info.consumers
                        if graph.op(c).op_type == "Gather" and graph.op(c).inputs[1] == name),
                       default=2)
            feeds[name] = torch.randint(0, high, info.shape, generator=generator,
                                        dtype=getattr(torch, info.dtype))
        else:
            feeds[name] = torch.randn(info.shape, generator=generator)
    if kind == "graph":
        return feeds, None
    shape = graph.tensors[output].shape
    stored = Path(data) / "targets.npy" if data else None
    if stored is not None and stored.exists():
        return feeds, torch.from_numpy(np.load(stored, allow_pickle=False))
    if kind == "ce":
        return feeds, torch.randint(0, shape[-1], shape[:-1], generator=generator)
    return feeds, torch.randn(shape, generator=generator)


def synthetic_batch(graph: PlanningGraph, seed: int) -> tuple[dict[str, torch.Tensor],
                                                              torch.Tensor | None, str]:
    """Inputs, targets and the output to train, as a default run draws them."""
    kind, output = loss_kind(graph)
    feeds, targets = batch_data(graph, seed, kind, output)
    return feeds, targets, output


OPTIMIZERS = ("sgd", "adamw")


def _fault_drill(rank: int) -> int | None:
    """SHARDPLAN_FAULT="RANK:STEP" kills that rank before that step (for fault tests)."""
    spec = os.environ.get("SHARDPLAN_FAULT", "")
    victim, _, step = spec.partition(":")
    return int(step) if spec and victim == str(rank) and step.isdigit() else None


def _optimizer(runner: PlanRunner, name: str, lr: float) -> torch.optim.Optimizer:
    """Elementwise optimizers act on local shards exactly as on the whole tensor."""
    params = [p for p in runner.params.values() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ShardplanError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


def _steps(runner: PlanRunner, graph: PlanningGraph, steps: int, lr: float, seed: int,
           log: RunLog, optimizer: str, resume: str = "", checkpoint: str = "",
           loss: str = "auto", data: str = "") -> None:
    kind, output = loss_kind(graph, loss)
    feeds, targets = batch_data(graph, seed, kind, output, data)
    step = _optimizer(runner, optimizer, lr)
    done = checkpoints.load(resume, runner.params, step) if resume else 0
    fault = _fault_drill(runner.comm.rank)
    for _ in range(steps):
        if fault is not None and done == fault:
            os._exit(17)  # a fault drill: this rank dies in the middle of training
        started = time.perf_counter()
        values, layouts = runner.forward(feeds)
        local, reported = runner.loss(values, layouts, output, targets, kind)
        local.backward()
        runner.sync_gradients()
        step.step()
        step.zero_grad(set_to_none=True)
        log.step_time_s.append(time.perf_counter() - started)
        log.losses.append(reported)
        done += 1
    if checkpoint:
        checkpoints.save(checkpoint, runner.params, step, done)


@dataclass(frozen=True)
class RunSettings:
    model: str
    plan_path: str
    steps: int = 5
    lr: float = 0.1
    seed: int = 0
    optimizer: str = "sgd"
    out: str = ""  # where rank 0 writes the RunLog JSON ("" = nowhere)
    resume: str = ""  # a checkpoint directory to start from
    checkpoint: str = ""  # where to save the final state
    loss: str = "auto"  # graph | ce | mse | auto (the graph's own loss, else ce)
    data: str = ""  # a folder of <input>.npy arrays (and targets.npy); "" = synthetic
    timeout_s: float = 120.0  # a dead rank makes the others fail within this


def run_rank(rank: int, world: int, init_method: str, settings: RunSettings) -> RunLog:
    """One rank of a run (spawned here, or started by torchrun with init_method env://)."""
    # Ranks share the host's cores: one thread pool each, sized to its share (as torchrun
    # does with OMP_NUM_THREADS), or small ops thrash.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=settings.timeout_s))
    try:
        plan = Plan.load(settings.plan_path)
        if plan.mesh.size != world:
            raise ShardplanError(f"the plan is for {plan.mesh.size} devices but {world} ranks "
                                 "were started; start as many ranks as the plan has devices")
        graph = _graph_for(settings.model, plan)
        runner = PlanRunner(graph, plan, rank, settings.seed, onnx_weights(settings.model))
        log = RunLog(predicted_step_time_s=plan.predicted.step_time_s)
        _steps(runner, graph, settings.steps, settings.lr, settings.seed, log,
               settings.optimizer, settings.resume, settings.checkpoint, settings.loss,
               settings.data)
        issued = {f"{k}|{','.join(a)}|{p}": n for (k, a, p), n in runner.counters.issued.items()
                  if n}
        log.collectives = {"issued": issued}
        if rank == 0 and settings.out:
            Path(settings.out).write_text(json.dumps(log.to_json()))
        return log
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, settings: RunSettings) -> None:
    run_rank(rank, world, f"tcp://127.0.0.1:{port}", settings)


def _graph_for(model: str | os.PathLike, plan: Plan) -> PlanningGraph:
    """The model imported with the dims the plan was made for."""
    return load_graph(model, batch=plan.model.batch, dims=plan.model.bound_dims)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def train(model: str | os.PathLike, plan: Plan, *, steps: int = 5, lr: float = 0.1,
          seed: int = 0, optimizer: str = "sgd", resume: str = "",
          checkpoint: str = "", loss: str = "auto", data: str = "") -> RunLog:
    """Run `plan` on as many local gloo ranks as its mesh has devices."""
    check_plan_matches(plan, _graph_for(model, plan))  # refuse before any rank starts
    with tempfile.TemporaryDirectory() as scratch:
        plan_path = Path(scratch) / "plan.json"
        plan.save(plan_path)
        out = Path(scratch) / "log.json"
        settings = RunSettings(str(model), str(plan_path), steps, lr, seed, optimizer, str(out),
                               resume=str(resume), checkpoint=str(checkpoint), loss=loss,
                               data=str(data))
        try:
            mp.spawn(_worker, args=(plan.mesh.size, _free_port(), settings),
                     nprocs=plan.mesh.size, join=True)
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise ShardplanError(f"rank {exc.error_index} failed ({last}); the other ranks "
                                 "were stopped") from None
        except mp.ProcessExitedException as exc:
            raise ShardplanError(f"rank {exc.error_index} died (exit code {exc.exit_code}); "
                                 "the other ranks were stopped") from None
        data = json.loads(out.read_text())
    return RunLog(**data)


def train_reference(model: str | os.PathLike, plan: Plan, *, steps: int = 5, lr: float = 0.1,
                    seed: int = 0, optimizer: str = "sgd", loss: str = "auto",
                    data: str = "") -> RunLog:
    """The same model, data and optimizer in one process with nothing split."""
    from planner.api import plan as make_plan

    graph = _graph_for(model, plan)
    check_plan_matches(plan, graph)
    try:  # price the one-device run on the plan's hardware where that profile is bundled
        single = make_plan(graph, devices=1, mode="data", profile=plan.cluster.profile)
    except ShardplanError:
        single = make_plan(graph, devices=1, mode="data", profile="cpu")
    runner = PlanRunner(graph, single, 0, seed, onnx_weights(str(model)))
    log = RunLog(predicted_step_time_s=single.predicted.step_time_s)
    _steps(runner, graph, steps, lr, seed, log, optimizer, loss=loss, data=data)
    return log


def planned_counts(plan: Plan, steps: int) -> dict[str, int]:
    """What the plan says a run of `steps` steps issues, keyed like RunLog.collectives."""
    counts: dict[str, int] = {}
    for c in plan.collectives:
        key = f"{c.kind}|{','.join(c.axes)}|{c.phase}"
        counts[key] = counts.get(key, 0) + steps
    return counts


