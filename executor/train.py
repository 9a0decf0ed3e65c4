"""Train with a plan on N local ranks (gloo), or as one process for reference.

`train(model, plan, steps)` spawns the ranks, feeds every rank the same synthetic global
batch (each keeps its shard), cuts it into the plan's micro-batches, runs each rank's
pipeline stage through the plan's schedule (`executor.pipeline`), the plan's gradient sums,
ZeRO sharding and the optimizer (`executor.update`), and returns the losses, step times,
collective counts (summed over one rank per pipeline stage) and what every rank did.
`train_reference` trains the same model on the whole global batch in one process.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from executor import checkpoint as checkpoints
from executor.data import check_data, global_shape
from executor.pipeline import PipelineEngine
from executor.ranks import follow_launcher, reported_to_launcher, run_ranks
from executor.runtime import Placement, PlanRunner, onnx_weights
from executor.schedule import (
    build_stages,
    check_pipeline_section,
    check_schedule,
    weight_holders,
)
from executor.support import check_degrees, check_supported, refuse_inference
from executor.timeouts import DEFAULT_TIMEOUT_S, check_timeout
from executor.update import WeightUpdate, check_zero, tied_groups
from executor.weights import read_weights
from planner.errors import ShardplanError
from planner.graph import PlanningGraph
from planner.importer import import_model, rebind
from planner.kinds import AxisRole
from planner.plans.model import Plan
from planner.plans.stagemesh import refuse_stage_meshes
from planner.sharding.analysis import GraphAnalysis
from planner.validate import check_model_digest, check_plan_matches


@dataclass
class RunLog:
    losses: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    predicted_step_time_s: float = 0.0
    collectives: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)  # per rank: stage, counts, state sizes
    weights: str = ""  # how the weights were had, when not read from the model
    peak_memory_bytes: int = 0  # rank 0's GPU allocator peak over the run; 0 on the CPU
    counted_steps: int | None = None  # the first steps "collectives" covers (None: all)

    def to_json(self) -> dict:
        return {"losses": self.losses, "step_time_s": self.step_time_s,
                "predicted_step_time_s": self.predicted_step_time_s,
                "collectives": self.collectives, "ranks": self.ranks,
                "weights": self.weights, "peak_memory_bytes": self.peak_memory_bytes,
                "counted_steps": self.counted_steps}

    @property
    def verdict(self) -> str:
        """One line: "collectives: as planned", or each difference from the plan."""
        counted = self.counted_steps
        if counted == 0:
            return "collectives: not counted"
        differences = self.differences
        verdict = "collectives: as planned" if not differences else \
            "collectives differ from the plan: " + ", ".join(differences)
        if counted is not None and counted < len(self.losses):
            verdict += f" (counted over the first {counted} of {len(self.losses)} steps)"
        return verdict

    @property
    def differences(self) -> list[str]:
        """Each "kind|axes|phase planned P issued I" where the run's collectives
        ("issued") differ from the plan's ("planned")."""
        planned = self.collectives.get("planned", {})
        issued = self.collectives.get("issued", {})
        return [f"{k} planned {planned.get(k, 0)} issued {issued.get(k, 0)}"
                for k in sorted(set(planned) | set(issued))
                if planned.get(k, 0) != issued.get(k, 0)]


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
               data: str = "", micro_batches: int = 1, rows_dim: int = 0,
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The global batch: `<data>/<input>.npy` (and `targets.npy`) when given, else
    synthetic: valid token ids for embeddings, normal floats, class or float targets.
    `graph` may be imported at the micro-batch: the data are drawn at micro_batches times
    its batch, exactly as for the graph of the whole batch; `rows_dim` is the output's
    batch dim (`GraphAnalysis.rows_dim`)."""
    generator = torch.Generator().manual_seed(seed + 1)
    feeds: dict[str, torch.Tensor] = {}
    for name in graph.inputs:
        info = graph.tensors[name]
        shape = global_shape(graph, name, micro_batches, graph.batch_inputs.get(name))
        stored = Path(data) / f"{name}.npy" if data else None
        if stored is not None and stored.exists():
            array = np.load(stored, allow_pickle=False)
            if tuple(array.shape) != shape:
                raise ShardplanError(f"{stored}: shape {list(array.shape)}, but input {name} "
                                     f"is {list(shape)} in the plan's step")
            feeds[name] = torch.from_numpy(array.astype(info.dtype))
        elif info.dtype.startswith("int"):
            high = min((graph.tensors[graph.op(c).inputs[0]].shape[0] for c in info.consumers
                        if graph.op(c).op_type == "Gather" and graph.op(c).inputs[1] == name),
                       default=2)
            feeds[name] = torch.randint(0, high, shape, generator=generator,
                                        dtype=getattr(torch, info.dtype))
        else:
            feeds[name] = torch.randn(shape, generator=generator)
    if kind == "graph":
        return feeds, None
    shape = global_shape(graph, output, micro_batches, rows_dim)
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


def micro_batches_of(graph: PlanningGraph, feeds: dict[str, torch.Tensor],
                     targets: torch.Tensor | None, count: int, rows_dim: int = 0,
                     ) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor | None]]:
    """The global batch cut along its batch dims into `count` equal micro-batches, in
    order (inputs without a batch dim go to every micro-batch whole); the targets along
    the output's batch dim `rows_dim`."""
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    for name, value in feeds.items():
        dim = graph.batch_inputs.get(name)
        for k in range(count):
            parts[k][name] = value if dim is None else value.chunk(count, dim)[k]
    if targets is None:
        return parts, [None] * count
    return parts, list(targets.chunk(count, rows_dim))


def _fault_drill(rank: int, spec: str = "") -> int | None:
    """SHARDPLAN_FAULT="RANK:STEP" kills that rank before that step (for fault tests).
    Ranks forked from the fork server get the caller's value through RunSettings."""
    spec = spec or os.environ.get("SHARDPLAN_FAULT", "")
    victim, _, step = spec.partition(":")
    return int(step) if spec and victim == str(rank) and step.isdigit() else None


def _engine(analysis: GraphAnalysis, plan: Plan | None, rank: int, seed: int, model: str,
            optimizer: str, lr: float, loss: str) -> PipelineEngine:
    """This rank's runner (its stage's weights only), weight update and schedule; without
    a plan, the unsplit reference on one device."""
    graph = analysis.graph
    kind, output = loss_kind(graph, loss)
    placement = Placement.of_plan(plan) if plan is not None else Placement.unsplit(graph)
    holders = weight_holders(plan) if plan is not None else None
    mesh = placement.mesh
    device = 0
    if AxisRole.PIPELINE in mesh.axis_names:
        device = int(np.unravel_index(rank, mesh.shape)[mesh.axis_names.index(
            AxisRole.PIPELINE)])
    held = None if holders is None else {name for name, stages in holders.items()
                                         if device in stages}
    runner = PlanRunner(analysis, placement, rank, seed, onnx_weights(model), held)
    stages = build_stages(graph, plan.pipeline if plan is not None else None, mesh, output,
                          runner.needs_grad)
    tied = tied_groups(runner.comm, {n: h for n, h in (holders or {}).items()
                                     if graph.tensors[n].kind == "parameter"})
    zero = plan.parallel.zero if plan is not None else 0
    update = WeightUpdate(runner, zero, optimizer, lr, tied)
    return PipelineEngine(runner, stages, update, output, kind)


def _steps(engine: PipelineEngine, graph: PlanningGraph, steps: int, seed: int,
           log: RunLog, resume: str = "", checkpoint: str = "", loss: str = "auto",
           data: str = "", fault_spec: str = "", checkpoint_every: int = 0,
           marker: dict[str, Any] | None = None) -> None:
    kind, output = loss_kind(graph, loss)
    count = engine.stages.micro_batches
    rows_dim = engine.runner.analysis.rows_dim(output)
    feeds, targets = batch_data(graph, seed, kind, output, data, count, rows_dim)
    micro_feeds, micro_targets = micro_batches_of(graph, feeds, targets, count, rows_dim)
    update = engine.update
    params = engine.runner.params
    done = checkpoints.load(resume, params, update.optimizer, update.targets) if resume else 0
    engine.runner.step = done  # dropout draws its masks by the step: go on from the saved one
    fault = _fault_drill(engine.runner.comm.rank, fault_spec)

    def save(at_step: int) -> None:
        assert marker is not None, "a run that saves passes its checkpoint's marker"
        checkpoints.save(checkpoint, params, update.optimizer, at_step, marker, update.targets)

    for _ in range(steps):
        if fault is not None and done == fault:
            os._exit(17)  # a fault drill: this rank dies in the middle of training
        started = time.perf_counter()
        reported = engine.step(micro_feeds, micro_targets)
        log.step_time_s.append(time.perf_counter() - started)
        log.losses.append(reported)
        done += 1
        if checkpoint and checkpoint_every and done % checkpoint_every == 0:
            save(done)
    if checkpoint and not (checkpoint_every and done % checkpoint_every == 0):
        save(done)


def _rank_record(engine: PipelineEngine) -> dict:
    """What one rank did: its stage, collectives, p2p messages, recompute, state sizes."""
    runner = engine.runner
    counters = runner.counters
    return {
        "rank": runner.comm.rank, "stage": engine.device,
        "representative": all(c == 0 for a, c in zip(runner.mesh.axis_names,
                                                      runner.comm.coord, strict=True)
                              if a != "pp"),
        "issued": {f"{k}|{','.join(a)}|{p}": n for (k, a, p), n in counters.issued.items()
                   if n},
        "received": dict(counters.received),
        "recompute_calls": counters.recompute_calls,
        "actions": [f"{a.kind}{a.micro}@{a.chunk}" for a in engine.actions],  # per step
        "parameters": sorted(n for n, p in runner.params.items() if p.requires_grad),
        "parameter_elements": sum(p.numel() for p in runner.params.values()
                                  if p.requires_grad),
        "optimizer_tensor_elements": sum(t.numel() for t in engine.update.targets.values()),
        "optimizer_state_elements": engine.update.state_elements(),
    }


def _issued(records: list[dict]) -> dict[str, int]:
    """Collectives of one rank per pipeline stage, summed: each planned collective once
    (every rank of a stage issues the same ones)."""
    total: Counter = Counter()
    for record in records:
        if record["representative"]:
            total.update({k: v for k, v in record["issued"].items()
                          if not k.endswith("|recompute")})
    return dict(total)


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
    timeout_s: float = DEFAULT_TIMEOUT_S  # a dead or stopped rank ends the run within this
    fault: str = ""  # SHARDPLAN_FAULT of the caller (a fault drill), see _fault_drill
    checkpoint_every: int = 0  # also save every N steps (atomically), so a kill loses < N
    launcher: int = 0  # the pid ranks follow (executor.ranks.follow_launcher); 0 = none


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
        marker = checkpoints.marker_for(plan, "graph", settings.optimizer)
        if settings.resume:  # (the launcher checked it; under torchrun, this is the check)
            checkpoints.check_resume(settings.resume, marker)
        graph = graph_for(settings.model, plan)
        check_plan_matches(plan, graph)
        engine = _engine(GraphAnalysis.of(graph), plan, rank, settings.seed, settings.model,
                         settings.optimizer, settings.lr, settings.loss)
        log = RunLog(predicted_step_time_s=plan.predicted.step_time_s)
        _steps(engine, graph, settings.steps, settings.seed, log, settings.resume,
               settings.checkpoint, settings.loss, settings.data, settings.fault,
               settings.checkpoint_every, marker)
        records: list = [None] * world
        dist.all_gather_object(records, _rank_record(engine))
        log.ranks = records
        log.collectives = {"issued": _issued(records)}
        if rank == 0 and settings.out:
            Path(settings.out).write_text(json.dumps(log.to_json()))
        return log
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, settings: RunSettings) -> None:
    if settings.launcher:
        follow_launcher(settings.launcher)
    with reported_to_launcher():
        run_rank(rank, world, f"tcp://127.0.0.1:{port}", settings)
    # Everything is written and the process group is gone. Tearing down an interpreter
    # that loaded torch takes seconds per rank on a busy host: leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def graph_for(model: str | os.PathLike | PlanningGraph, plan: Plan) -> PlanningGraph:
    """The model imported with the dims the plan was made for (at its micro-batch); the
    file's digest is checked first, so another model gets "made for another model"
    rather than an error about its dims."""
    import hashlib

    if isinstance(model, PlanningGraph):
        return rebind(model, batch=plan.model.batch, dims=plan.model.bound_dims)
    try:
        digest = hashlib.sha256(Path(model).read_bytes()).hexdigest()
    except OSError as exc:
        raise ShardplanError(f"{model}: cannot read the model ({exc.strerror})") from None
    check_model_digest(plan, digest, str(model))
    return import_model(model, batch=plan.model.batch, dims=plan.model.bound_dims,
                        capacity_factor=plan.model.capacity_factor)


def whole_batch_graph(plan: Plan, micro: PlanningGraph) -> PlanningGraph:
    """The model at the step's whole batch (micro_batch_size × micro_batches), re-bound
    from the micro-batch graph."""
    count = plan.micro_batches
    if count == 1:
        return micro
    if not micro.batch:
        raise ShardplanError(f"{micro.path}: the plan has {count} micro-batches but the model "
                             "has no batch dimension to cut")
    dims = {k: v for k, v in plan.model.bound_dims.items() if k != micro.batch_symbol}
    return rebind(micro, batch=micro.batch * count, dims=dims)


def preflight(model: str | os.PathLike, plan: Plan, loss: str = "auto", data: str = ""
              ) -> str:
    """Refuse, before any rank starts, a plan for another model or one this executor
    cannot run (its stages, schedule or ZeRO stage), a weights file that is not whole, or
    `--data` that does not hold the step's arrays, with the one-line reason. Returns the
    run's note on its weights ("" when the model's own are read)."""
    from planner.validate import refuse_invalid

    refuse_inference(plan)
    check_degrees(plan.parallel)
    refuse_stage_meshes(plan.mesh, plan.pipeline, "the executor")
    graph = graph_for(model, plan)
    check_plan_matches(plan, graph)
    check_supported(graph)
    refuse_invalid(plan, graph, f" against {model}")
    weights = read_weights(model, load=False)  # a weights file that is there must be whole
    kind, output = loss_kind(graph, loss)
    analysis = GraphAnalysis.of(graph)
    check_data(graph, data, kind, output, plan.micro_batches, analysis.rows_dim(output))
    check_pipeline_section(plan)
    check_schedule(build_stages(graph, plan.pipeline, plan.mesh, output,
                                analysis.needs_grad))
    check_zero(plan.parallel.zero)
    return weights.note


def check_checkpoints(plan: Plan, runner: str, optimizer: str, resume: str = "",
                      checkpoint: str = "") -> None:
    """Before any rank starts: `checkpoint` is a folder saving may create or replace, and
    `resume` a checkpoint this run (runner, optimizer, plan) can resume from."""
    if checkpoint:
        checkpoints.check_target(checkpoint)
    if resume:
        checkpoints.check_resume(resume, checkpoints.marker_for(plan, runner, optimizer))


def free_port() -> int:
    """A TCP port on localhost no one listens on now, for a local process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def train(model: str | os.PathLike, plan: Plan, *, steps: int = 5, lr: float = 0.1,
          seed: int = 0, optimizer: str = "sgd", resume: str = "",
          checkpoint: str = "", loss: str = "auto", data: str = "",
          checkpoint_every: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> RunLog:
    """Run `plan` on as many local gloo ranks as its mesh has devices. A rank that
    fails, dies or stops answering for `timeout_s` ends the run with `RunFailed`; no
    rank outlives the call (`executor.ranks`)."""
    check_checkpoints(plan, "graph", optimizer, resume, checkpoint)
    weights_note = preflight(model, plan, loss, data)
    with checkpoints.writing(checkpoint), tempfile.TemporaryDirectory() as scratch:
        plan_path = Path(scratch) / "plan.json"
        plan.save(plan_path)
        out = Path(scratch) / "log.json"
        settings = RunSettings(str(model), str(plan_path), steps, lr, seed, optimizer, str(out),
                               resume=str(resume), checkpoint=str(checkpoint), loss=loss,
                               data=str(data), fault=os.environ.get("SHARDPLAN_FAULT", ""),
                               checkpoint_every=checkpoint_every,
                               timeout_s=check_timeout(timeout_s), launcher=os.getpid())
        run_ranks(_worker, (plan.mesh.size, free_port(), settings), plan.mesh.size,
                  timeout_s=settings.timeout_s)
        logged = json.loads(out.read_text())
    logged["weights"] = weights_note
    return RunLog(**logged)


def train_reference(model: str | os.PathLike, plan: Plan, *, steps: int = 5, lr: float = 0.1,
                    seed: int = 0, optimizer: str = "sgd", loss: str = "auto",
                    data: str = "", predicted_step_time_s: float = 0.0) -> RunLog:
    """The same model, data and optimizer in one process with nothing split (the plan
    gives the dims and micro-batches: the reference trains the whole step's batch).
    `predicted_step_time_s` is what the caller priced for one device, for the log."""
    micro = graph_for(model, plan)
    check_plan_matches(plan, micro)
    kind, output = loss_kind(micro, loss)
    check_data(micro, data, kind, output, plan.micro_batches,
               GraphAnalysis.of(micro).rows_dim(output))
    graph = whole_batch_graph(plan, micro)
    engine = _engine(GraphAnalysis.of(graph), None, 0, seed, str(model), optimizer, lr, loss)
    log = RunLog(predicted_step_time_s=predicted_step_time_s,
                 weights=read_weights(model, load=False).note)
    _steps(engine, graph, steps, seed, log, loss=loss, data=data)
    return log


def planned_counts(plan: Plan, steps: int) -> dict[str, int]:
    """What the plan says a run of `steps` steps issues, keyed like RunLog.collectives.

    The plan lists every collective of one step on the ranks holding it: forward,
    backward and point-to-point entries happen once per micro-batch (ZeRO 2's
    reduce-scatter is a backward entry), gradient entries once per step; a weight held by
    two pipeline stages is listed once per holder, with the sum between the holders.
    """
    counts: Counter = Counter()
    for c in plan.collectives:
        key = f"{c.kind}|{','.join(c.axes)}|{c.phase}"
        counts[key] += issues_per_run(c.phase, plan.micro_batches, steps)
    return dict(counts)


def issues_per_run(phase: str, micro_batches: int, steps: int) -> int:
    """How often a run of `steps` steps issues a collective the plan lists in `phase`:
    once per micro-batch (forward, backward) or once per step (gradient)."""
    return steps * (1 if phase == "gradient" else micro_batches)
