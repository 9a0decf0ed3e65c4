"""Export a user's module for planning and train it with a plan on local ranks, from a
builder.

A builder is a function `FN()` returning `(module, make_batch, loss_fn)`
(`examples/hf_models.py`), named as "FILE.py:FN" or "package.module:FN" (imported as
`python -m` would, the working folder first) so that every rank can build the same module
itself (same seed, same weights). `export_builder` exports the module with torch's default
exporter for `planner.api.plan` (`shardplan plan --module` does both); `train_module`
starts one process per device, parallelizes the module on each and trains it;
`train_module_reference` trains the module as it is in this process, on the whole batch:
what the ranks must equal.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from executor.checkpoint import marker_for, writing
from executor.module.cache import keep_trace, kept_trace, trace_digest
from executor.module.layouts import check_frozen, weight_buckets
from executor.module.localstep import LocalAdamW, LocalSGD
from executor.module.run import LossShare, reduced_losses
from executor.module.trace import (
    MAX_SHARED_TRACE_BYTES,
    SavedTrace,
    export_program,
    save_model,
    state_bytes,
)
from executor.ranks import follow_launcher, reported_to_launcher, run_ranks
from executor.runtime import MeshComm
from executor.schedule import check_runnable
from executor.support import check_degrees, refuse_inference
from executor.timeouts import DEFAULT_TIMEOUT_S, check_timeout
from executor.train import RunLog, check_checkpoints, free_port, issues_per_run
from planner.errors import ShardplanError
from planner.plans.model import Plan
from planner.plans.stagemesh import refuse_stage_meshes
from planner.sharding.derive import OPTIMIZER_OP
from planner.validate import refuse_invalid

Builder = Callable[[], tuple[torch.nn.Module, Callable[[int, int], dict[str, torch.Tensor]],
                             Callable[..., torch.Tensor]]]


def load_builder(spec: str) -> Builder:
    """The function "FILE.py:FN" or "package.module:FN" names."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ShardplanError(f"--module {spec!r}: give FILE.py:FUNCTION or MODULE:FUNCTION")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ShardplanError(f"--module {spec!r}: {where} is not a file")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        folder = str(path.resolve().parent)
        if folder not in sys.path:  # as `python FILE.py` does: the files beside it import
            sys.path.insert(0, folder)
        try:
            loaded.loader.exec_module(module)
        except Exception as exc:
            raise ShardplanError(f"--module {spec!r}: running {where} raised "
                                 f"{_first_line(exc)}") from exc
    else:
        if os.getcwd() not in sys.path:  # as `python -m` does: the working folder's modules
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise ShardplanError(f"--module {spec!r}: cannot import {where}: "
                                 f"{_first_line(exc)}") from exc
    builder = getattr(module, name, None)
    if not callable(builder):
        raise ShardplanError(f"--module {spec!r}: {where} has no function {name}")
    return _checked(spec, builder)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _checked(spec: str, builder: Callable[[], Any]) -> Builder:
    """`builder` whose failures and wrong results are one line naming the spec: it must
    return (module, make_batch, loss_fn), an `nn.Module` and two functions."""
    @functools.wraps(builder)  # `__wrapped__`: the user's function, whose file keys traces
    def build() -> Any:
        try:
            found = builder()
        except Exception as exc:
            raise ShardplanError(f"--module {spec!r}: the builder raised "
                                 f"{_first_line(exc)}") from exc
        if not (isinstance(found, tuple | list) and len(found) == 3
                and isinstance(found[0], torch.nn.Module) and callable(found[1])
                and callable(found[2])):
            got = (f"{len(found)} items" if isinstance(found, tuple | list)
                   else type(found).__name__)
            raise ShardplanError(f"--module {spec!r}: the builder returned {got}; return "
                                 "(module, make_batch, loss_fn): an nn.Module, a function of "
                                 "(step, rows) giving the batch's dict of tensors, and a "
                                 "function of (output, batch) giving the loss")
        return tuple(found)
    return build


def example_batch(make_batch: Callable[[int, int], Mapping[str, Any]], step: int,
                  rows: int) -> Mapping[str, Any]:
    """`make_batch(step, rows)`, each tensor's dim 0 checked to be those rows: the
    contract every split and micro-batch reads (a sequence-first module's `[seq, batch]`
    ids exported with the sequence as the batch, planned at that length, and failed the
    rank with exit 4, "a batch of [8] rows: the plan is for a global batch of 4")."""
    batch = make_batch(step, rows)
    if not isinstance(batch, Mapping):
        return batch  # (`check_example` names what it should be)
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != rows:
            raise ShardplanError(
                f"make_batch({step}, {rows}) gave {name} of shape {tuple(value.shape)}: dim 0 "
                f"of every tensor it returns must be the batch's {rows} rows; a "
                "sequence-first module ([seq, batch] inputs, nn.Transformer's default "
                "batch_first=False) is not run yet: give batch-first tensors "
                "(batch_first=True) or transpose inside forward")
    return batch


def export_builder(spec: str, batch_size: int, path: str | os.PathLike) -> Path:
    """The builder's module exported to `path` as the planner reads it (training mode, the
    example batch `make_batch(0, batch_size)`, the batch dim symbolic)."""
    saved = shared_trace(spec, batch_size)
    if saved is not None:
        shutil.copyfile(saved.model, path)
        return Path(path)
    module, make_batch, _ = load_builder(spec)()
    module.train()
    return save_model(export_program(module, example_batch(make_batch, 0, batch_size)),
                      Path(path))


@dataclass(frozen=True)
class _Exported:
    """What exporting the builder's module once gave: the trace written for every process
    (None: too large), and the module's parameters by their names and the frozen ones,
    which the launcher checks against the plan before any rank starts."""

    trace: SavedTrace | None
    parameters: list[tuple[str, ...]]
    frozen: frozenset[str]
    refused: str | None = None  # why the module executor does not run it (a training norm)


_exported: dict[tuple[object, ...], _Exported] = {}


def shared_trace(spec: str, batch_size: int) -> SavedTrace | None:
    """The builder's module exported once at (spec, batch) and written for every process
    that needs it: the plan's export, the reference run and every rank read it instead of
    exporting again, and so do later processes (`executor.module.cache`: kept under a
    digest of everything the trace depends on). In this process the key holds the
    builder's file, its size and modification time, so an edited builder is looked up
    anew. None: the module is too large to write twice (`MAX_SHARED_TRACE_BYTES`); each
    rank exports it as before."""
    return _export_once(spec, batch_size).trace


def _export_once(spec: str, batch_size: int) -> _Exported:
    """The builder's module built and exported once per (spec, batch, builder file as it
    is now): `shared_trace`'s trace, and its parameters for the launcher's check."""
    from executor.module.parallelize import (
        frozen_names,
        parameter_names,
        refuse_training_norms,
    )

    builder = load_builder(spec)
    source = Path(inspect.unwrap(builder).__code__.co_filename)  # the user's file
    stamp = source.stat() if source.is_file() else None
    key = (spec, batch_size, str(source), stamp and (stamp.st_mtime_ns, stamp.st_size))
    if key not in _exported:
        module, make_batch, _ = builder()
        module.train()
        trace = None
        if state_bytes(module) <= MAX_SHARED_TRACE_BYTES:
            example = example_batch(make_batch, 0, batch_size)
            digest = trace_digest(source if source.is_file() else None, spec, module, example)
            trace = kept_trace(digest) or keep_trace(digest, export_program(module, example))
        try:
            refuse_training_norms(module)
            refused = None
        except ShardplanError as exc:
            refused = str(exc)
        _exported[key] = _Exported(trace, parameter_names(module), frozen_names(module),
                                   refused)
    return _exported[key]


@dataclass
class ModuleRunLog(RunLog):
    """What a run of the module did: `executor.train.RunLog`'s record ("collectives" are
    calls over the run, "kind|axes|phase"), the results DTensor gave in another layout
    than the plan's (moved to the plan's), the recompute segments rank 0 re-ran in its
    backward passes, and what rank 0 held after the last step: elements of its
    parameters (what the optimizer updates: chunks under ZeRO) and of whole weights."""

    unplanned: dict[str, int] = field(default_factory=dict)
    recomputed: int = 0
    parameter_elements: int = 0
    resident_weight_elements: int = 0
    loss_on_rows: bool = False  # the loss ran on each rank's rows (executor.module.rowloss)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "unplanned": self.unplanned,
                "recomputed": self.recomputed,
                "parameter_elements": self.parameter_elements,
                "resident_weight_elements": self.resident_weight_elements,
                "loss_on_rows": self.loss_on_rows}


def planned_calls(plan: Plan, steps: int) -> dict[str, int]:
    """The collective calls the plan says `steps` steps issue: each activation collective
    as `executor.train.issues_per_run` counts it, each bucket of weight collectives as one
    call (this path issues a bucket as one call)."""
    calls: Counter = Counter()
    for c in plan.collectives:
        if c.op != OPTIMIZER_OP:
            calls[f"{c.kind}|{','.join(c.axes)}|{c.phase}"] += issues_per_run(
                c.phase, plan.micro_batches, steps)
    for bucket in weight_buckets(plan):
        calls[f"{bucket.kind}|{','.join(bucket.axes)}|{bucket.phase}"] += issues_per_run(
            bucket.phase, plan.micro_batches, steps)
    return dict(calls)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


OPTIMIZERS = ("sgd", "adamw")


def plan_fuses_optimizer(plan: Plan) -> bool:
    """Whether the plan priced the optimizer step as fused kernels, one pass over each
    tensor (its kernels' fusion, `planner.cost.pricing.optimizer_seconds`), rather than
    torch.optim's passes one after another: the runner's AdamW runs as priced. A plan
    file that records no fusion is read as unfused, a profile's default."""
    fusion = plan.step.fusion
    return fusion is not None and fusion.fuses


def make_optimizer(name: str, module: torch.nn.Module, lr: float, fused: bool = False
                   ) -> torch.optim.Optimizer:
    """SGD or AdamW over the module's parameters (DTensors or not). Over DTensors the
    update runs as one multi-tensor (foreach) op per step rather than one op per
    parameter: each DTensor op pays its dispatch on the host (on one CPU rank, 69 against
    121 µs a step for the 2-layer LLaMA's SGD); torch defaults to foreach only on GPUs.
    SGD over DTensors updates each rank's blocks where a gradient has its parameter's
    placements (`LocalSGD`: 32 µs there, without DTensor's dispatch); AdamW likewise
    (`LocalAdamW`), in the kernels the plan priced its step in (`fused`:
    `plan_fuses_optimizer`): torch's fused kernel (130 µs against 493 through DTensor's
    multi-tensor dispatch), else its multi-tensor passes (336 µs). Its last bits differ
    from an unsplit run's per-tensor AdamW, as torch's kernels differ among themselves."""
    params = list(module.parameters())
    distributed = any(isinstance(p, DTensor) for p in params)
    if name == "sgd":
        return LocalSGD(params, lr=lr, foreach=True) if distributed \
            else torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        if not distributed:
            return torch.optim.AdamW(params, lr=lr)
        return LocalAdamW(params, lr=lr, fused=True) if fused \
            else LocalAdamW(params, lr=lr, foreach=True)
    raise ShardplanError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


@dataclass(frozen=True)
class Checkpoints:
    """Where a run starts from and saves to (empty: nowhere), and how often it saves."""

    resume: str = ""
    save: str = ""
    every: int = 0  # also save every N steps (0: at the end only)


@dataclass(frozen=True)
class ModuleRun:
    """One training run of a builder's module with a plan, as every rank starts it."""

    spec: str
    plan_json: str
    steps: int
    lr: float
    batch_size: int
    backend: str = "gloo"
    optimizer: str = "sgd"
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    local: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S  # a dead or stopped rank ends the run within this
    launcher: int = 0  # the pid ranks follow (executor.ranks.follow_launcher); 0 = none
    trace: SavedTrace | None = None  # the module's export, written once for every rank
    # the first steps whose collectives are counted against the plan (None: every step):
    # a dispatch mode sees every op to catch DTensor's, which costs a few microseconds of
    # host time per op, and a step issues what the one before it did
    count_steps: int | None = None


def run_module_rank(rank: int, world: int, init_method: str, run: ModuleRun
                    ) -> ModuleRunLog:
    """Join the process group (`init_method`: a TCP address, or "env://" under torchrun),
    parallelize the module, train it; rank 0's log also holds the collectives."""
    from executor.module import state as checkpoints
    from executor.module.counting import CollectiveCount, group_axes
    from executor.module.parallelize import parallelize, state_of

    torch.set_num_threads(1)
    if run.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(run.backend, init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=run.timeout_s))
    saving = run.checkpoints
    try:
        plan = Plan.from_json(json.loads(run.plan_json))
        module, make_batch, loss_fn = load_builder(run.spec)()
        module.train()
        module = parallelize(module, plan, make_batch(0, run.batch_size), local=run.local,
                             saved=run.trace)
        state = state_of(module)
        optimizer = make_optimizer(run.optimizer, module, run.lr, plan_fuses_optimizer(plan))
        axes = group_axes(state.mesh)
        issued: Counter = Counter()
        log = ModuleRunLog(predicted_step_time_s=plan.predicted.step_time_s)
        marker = marker_for(plan, "module", run.optimizer)
        if saving.resume:  # (the launcher checked it; under torchrun, this is the check)
            check_checkpoints(plan, "module", run.optimizer, resume=saving.resume)
        done = checkpoints.load(saving.resume, state, optimizer).steps \
            if saving.resume else 0
        counted = run.steps if run.count_steps is None else min(run.count_steps, run.steps)
        weight_calls: Counter = Counter()
        # each step's loss as this rank's share, the sums over the ranks taken for all
        # steps at once after them (`reduced_losses`): one collective, not one a step
        shares: list[LossShare | torch.Tensor] = []
        for k, step in enumerate(range(done, done + run.steps)):
            batch = make_batch(step, run.batch_size)
            started = time.perf_counter()
            shares.append(state.train_step_share(loss_fn, batch, (
                lambda phase: CollectiveCount(issued, axes, phase)) if k < counted else None))
            optimizer.step()
            optimizer.zero_grad()
            if k + 1 == counted:  # (ZeRO 1 and 2 rebuild the whole weights in step())
                weight_calls = Counter(state.weight_calls)
            if run.backend == "nccl":  # the step's kernels done: its time, not its launch
                torch.cuda.synchronize()
            log.step_time_s.append(time.perf_counter() - started)
            if saving.save and saving.every and (step + 1) % saving.every == 0:
                checkpoints.save(saving.save, state, optimizer, step + 1, marker)
        log.losses = reduced_losses(shares)
        if saving.save and not (saving.every and (done + run.steps) % saving.every == 0):
            checkpoints.save(saving.save, state, optimizer, done + run.steps, marker)
        issued.update(weight_calls)
        issued = _stage_sums(issued, state.comm)
        if rank == 0:
            log.collectives = {"planned": planned_calls(plan, counted),
                               "issued": {k: v for k, v in issued.items() if not k.endswith(
                                   ("|loss", "|recompute", f"|{checkpoints.PHASE}"))}}
            log.counted_steps = counted
            log.recomputed = state.record.recomputed
            log.parameter_elements = sum(_local(p).numel() for p in module.parameters())
            log.resident_weight_elements = state.weights.resident_elements()
            log.unplanned = dict(state.record.unplanned)
            log.loss_on_rows = state.row_loss is not None
            if run.backend == "nccl":  # what the plan's predicted peak is checked against
                log.peak_memory_bytes = int(torch.cuda.max_memory_allocated())
        # Leave together: a rank that tears its gloo pairs down while a peer still
        # completes a pipeline send can abort it ("terminate called without an active
        # exception", seen once in a loaded CI run of the interleaved schedule).
        dist.barrier()
        return log
    finally:
        dist.destroy_process_group()


def _stage_sums(issued: Counter, comm: MeshComm) -> Counter:
    """The calls of one rank per pipeline stage (every rank of a stage issues the same
    ones), summed: what the plan lists once per stage. Every rank takes part."""
    mesh = comm.mesh
    representative = all(c == 0 for a, c in zip(mesh.axis_names, comm.coord, strict=True)
                         if a != "pp")
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, (representative, dict(issued)))
    total: Counter = Counter()
    for chosen, calls in records:
        if chosen:
            total.update(calls)
    return total


def _rank(rank: int, world: int, port: int, run: ModuleRun, out: str) -> None:
    if run.launcher:
        follow_launcher(run.launcher)
    with reported_to_launcher():
        log = run_module_rank(rank, world, f"tcp://127.0.0.1:{port}", run)
    if rank == 0:
        Path(out).write_text(json.dumps(log.to_json()))


def train_module(spec: str, plan: Plan, *, steps: int = 5, lr: float = 0.1,
                 batch_size: int | None = None, backend: str = "gloo",
                 optimizer: str = "sgd", checkpoints: Checkpoints | None = None,
                 local: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                 count_steps: int | None = None) -> ModuleRunLog:
    """Train the builder's module with `plan` on one process per device: gloo on CPU, or
    NCCL with one GPU per process. The global batch is the plan's unless given. With
    `checkpoints`, the run starts from a checkpoint saved under any plan of the module
    (`steps` more steps, the batches continuing from its step) and saves its own.
    `local=False` runs every op on DTensors (`executor.parallelize`'s `local`). A rank
    that fails, dies or stops answering for `timeout_s` ends the run with `RunFailed`;
    no rank outlives the call (`executor.ranks`). The module is exported once, here
    (`shared_trace`), and every rank reads that export. Collectives are counted over the
    first `count_steps` steps (None: all; 0: none, to time the run as the Python API
    runs it)."""
    timeout_s = check_timeout(timeout_s)
    # Everything the plan states that its own sections imply (ep 1 among them), before
    # any rank starts (the module's export is not at hand: its ops and layouts are
    # checked as the ranks build); context parallelism this runner does not run, by name.
    refuse_invalid(plan, None, "")
    refuse_inference(plan)
    check_degrees(plan.parallel, graph=False)
    refuse_stage_meshes(plan.mesh, plan.pipeline, "the executor")
    if plan.pipeline is not None:
        check_runnable(plan.pipeline.schedule)  # a zero-bubble schedule, by name
    saving = checkpoints or Checkpoints()
    if saving.save or saving.resume:
        from executor.module.state import refuse_pipelined

        refuse_pipelined(plan)  # before any rank starts
    batch_size = batch_size or plan.global_batch
    if batch_size is None:
        raise ShardplanError("the plan names no global batch: give batch_size")
    if optimizer not in OPTIMIZERS:
        raise ShardplanError(f"--optimizer {optimizer!r}: choose one of "
                             f"{', '.join(OPTIMIZERS)}")
    check_checkpoints(plan, "module", optimizer, saving.resume, saving.save)
    load_builder(spec)  # a wrong name is reported here, before any rank starts
    if backend not in ("gloo", "nccl"):
        raise ShardplanError(f"--backend {backend!r}: choose gloo or nccl")
    if backend == "nccl" and torch.cuda.device_count() < plan.mesh.size:
        raise ShardplanError(f"--backend nccl: the plan needs {plan.mesh.size} GPUs, this "
                             f"machine has {torch.cuda.device_count()}")
    exported = _export_once(spec, batch_size)
    if exported.refused:  # (a batch norm in training mode), before any rank starts
        raise ShardplanError(exported.refused)
    # a weight frozen or unfrozen since planning, before any rank starts
    check_frozen(plan, exported.parameters, exported.frozen)
    with writing(saving.save), tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "log.json")
        run = ModuleRun(spec, json.dumps(plan.to_json()), steps, lr, batch_size,
                        backend, optimizer, saving, local, timeout_s, os.getpid(),
                        exported.trace, count_steps)
        run_ranks(_rank, (plan.mesh.size, free_port(), run, out), plan.mesh.size,
                  timeout_s=timeout_s)
        data: Mapping[str, Any] = json.loads(Path(out).read_text())
    return ModuleRunLog(**data)


def train_module_reference(spec: str, *, steps: int = 5, lr: float = 0.1,
                           batch_size: int, optimizer: str = "sgd", traced: bool = True
                           ) -> list[float]:
    """The builder's module trained in this process on the whole batch: its trace with
    the split runs' dropout masks (`executor.module.parallelize.unsplit`), or with
    `traced=False` the module's own forward (torch's dropout masks)."""
    from executor.module.parallelize import refuse_nothing_to_train, refuse_training_norms, unsplit

    module, make_batch, loss_fn = load_builder(spec)()
    refuse_nothing_to_train(module)
    module.train()
    if traced:
        refuse_training_norms(module)  # the trace, like the split run, cannot follow them
        module = unsplit(module, make_batch(0, batch_size),
                         saved=shared_trace(spec, batch_size))
    update = make_optimizer(optimizer, module, lr)
    losses = []
    for step in range(steps):
        batch = make_batch(step, batch_size)
        loss = loss_fn(module(**batch), batch)
        loss.backward()
        update.step()
        update.zero_grad()
        losses.append(float(loss.detach()))
    return losses
