"""The Python API: `plan(model, profile=..., devices=...) -> Plan`."""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from enum import StrEnum
from typing import TypeVar

from costmodels.cluster import Cluster, load_cluster
from costmodels.precision import default_precision, policy
from costmodels.profile import HardwareProfile, load_profile
from planner.cost.buckets import DEFAULT_BUCKET_MB
from planner.cost.kernels import accumulation_for
from planner.cost.step import TrainingOptions
from planner.errors import ModelError, ShardplanError
from planner.graph import DEFAULT_CAPACITY_FACTOR, PlanningGraph
from planner.importer import import_model, rebind, retyped
from planner.kinds import (
    AttentionKernel,
    Fusion,
    GradAccumulation,
    LossReads,
    Precision,
    Runnable,
)
from planner.plans.model import Plan
from planner.plans.planning import plan_data_parallel, plan_search
from planner.search.options import SearchOptions

MODES = ("data", "semi", "auto")
Choice = TypeVar("Choice", bound=StrEnum)
GIB = 1 << 30

@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused for the block, and resumed after as it was.

    Planning allocates millions of small objects, almost none of them in reference cycles
    (what it drops, reference counting frees at once); each pass of the collector walks
    every young object still alive, and a 200,000-op chain's plan spent 15 s of 171 in
    them even at thresholds of (100,000, 50, 100), with a higher peak than without them
    (3.92 GB against 3.74: docs/robustness.md, "Planning large graphs"). Blocks nest: an
    inner one leaves the collector as the outer one set it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()



def load_graph(
    model: str | os.PathLike | PlanningGraph,
    *,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    capacity_factor: float | None = None,
) -> PlanningGraph:
    """Import `model`, or re-bind a planning graph to `batch` and `dims` (from the model it
    keeps, without the file) where its binding differs; dims not given keep its values.
    `capacity_factor` sizes mixture-of-experts routers' token selections (default 1.25,
    or the graph's own)."""
    if isinstance(model, PlanningGraph):
        return rebind(model, batch=batch, dims=dims, capacity_factor=capacity_factor)
    return import_model(model, batch=batch, dims=dims,
                        capacity_factor=DEFAULT_CAPACITY_FACTOR if capacity_factor is None
                        else capacity_factor)


#: the most ops a graph may have to be planned: planning takes about 19 KiB of memory and
#: a few milliseconds per op (a 200,000-op chain: 3.7 GiB at its peak, minutes;
#: docs/robustness.md, "Planning large graphs"), so a graph past it is refused after its
#: import rather than run out of a 6 GiB machine's memory
MAX_PLANNED_OPS = 250_000

#: the device memories `--memory-limit` accepts, in GiB: outside, a figure is a typo
MEMORY_LIMIT_GIB = (2.0 ** -20, 2.0 ** 20)


@collector_paused()
def plan(
    model: str | os.PathLike | PlanningGraph,
    *,
    profile: str | os.PathLike | HardwareProfile = "a100-80g",
    devices: int = 8,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    mode: str = "auto",
    strategies: Mapping[str, Sequence[Sequence[int]]] | None = None,
    solver: str = "auto",
    time_limit: float = 60.0,
    parallel: Mapping[str, int | str] | None = None,
    mesh: Sequence[int] | None = None,
    max_mesh_axes: int = 2,
    tie_layers: bool = True,
    optimizer: str = "adam",
    memory_limit_gib: float | None = None,
    inference: bool = False,
    overlap: float = 0.0,
    precision: str | Precision | None = None,
    attention: str | AttentionKernel | None = None,
    fusion: str | Fusion | None = None,
    grad_accumulation: str | GradAccumulation | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    overlap_grad_reduce: bool = True,
    loss_reads: str | LossReads = LossReads.ROWS,
    capacity_factor: float | None = None,
    progress: Callable[[str], None] | None = None,
    cluster: str | os.PathLike | Cluster | None = None,
    runnable: Runnable | None = None,
) -> Plan:
    """Plan a training step of `model` on `devices` devices of `profile`, or on a
    `cluster` (a cluster file or `costmodels.cluster.Cluster`), which takes the place of
    both: groups of devices of different kinds, planned by the pipeline search with each
    stage on one kind (`--mode auto`, training with a batch).

    `mode`: "data" (data-parallel baseline), "semi" (the ops named in `strategies`, by
    name or glob pattern, keep their MindSpore-style tuples; the solver fills the rest) or
    "auto" (everything searched). The plan says in `plan.predicted.fits` whether it fits
    device memory; when no plan can fit, `NoPlanFits` (CLI exit code 3) is raised.
    `inference` plans a forward pass only; `overlap` is the share (0..1) of gradient
    synchronisation hidden behind the backward pass at least (the schedule may hide more);
    `bucket_mb` the bucket (MiB) gradient reductions and ZeRO gathers are issued in
    (default PyTorch DDP's 25; 0: one collective per tensor); `overlap_grad_reduce` whether
    the gradient reduction runs behind the backward pass as torch DDP and FSDP issue it
    (default) or after it, as Megatron-LM does without `--overlap-grad-reduce`. `precision`
    (`costmodels.precision`; default: the graph's own dtype, a 16-bit graph in its `-mixed`
    form) decides the bytes per parameter and the dtype activations and GEMMs run in;
    `attention` ("flash" or "eager") and `fusion` ("elementwise", "megatron" or "none")
    the kernels (default: the profile's, `device.kernels`); `grad_accumulation` ("fused" or
    "separate") whether each micro-batch's weight gradients are accumulated inside the
    weight-gradient GEMMs or by kernels of their own (default: fused with fused kernels,
    separate without, `planner.cost.kernels.accumulation_for`). The plan's `step`
    section records them all. `loss_reads` ("rows", default, or "as-is") how the loss
    outside the graph reads its outputs: whole rows, each output gathered along every
    dim but its rows (priced, searched and run with the forward pass), or as the plan
    leaves them (a loss that works on split outputs, as Megatron-LM's vocabulary-parallel
    cross-entropy does: nothing priced). `capacity_factor` sizes each expert's token
    batch behind a mixture-of-experts router as a multiple of its even share (default
    1.25, `planner.importer.routing`). `runnable`, where given, is what the executor the
    plan is for runs (`planner.kinds.Runnable`: its pipeline schedules, whether
    per-stage meshes), among which the search makes what is not pinned (`shardplan plan
    --module` plans for the module executor, `executor.schedule.RUNNABLE`).
    """
    if mode not in MODES:
        raise ShardplanError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "semi" and not strategies:
        raise ShardplanError("--mode semi needs strategies (--strategies FILE) for some ops")
    if mode != "semi" and strategies:
        raise ShardplanError("strategies are only used with --mode semi")
    mixed = None
    if cluster is not None:
        mixed = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
        profile, devices = mixed.lead.profile, mixed.devices
        if not mixed.mixed:  # one group: its profile's plain cluster
            mixed = None
        elif mode != "auto" or inference or mesh:
            raise ShardplanError(
                f"--cluster {mixed.path or mixed.name}: a mixed cluster is planned by the "
                "pipeline search, each stage on one kind of device: plan training in "
                "--mode auto without --mesh")
    if (parallel or {}).get("dp_shares") == "speed" and mixed is None:
        raise ShardplanError("--parallel dp_shares=speed: data-parallel replicas share the "
                             "batch by speed only on a mixed cluster (--cluster FILE with "
                             "groups of different devices); on one kind every share is even")
    hardware = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    if mixed is None:  # each group of a cluster file was checked as it was read
        hardware.check_device_count(devices)
    if memory_limit_gib is not None and not (
            MEMORY_LIMIT_GIB[0] <= memory_limit_gib <= MEMORY_LIMIT_GIB[1]):
        raise ShardplanError(f"--memory-limit {memory_limit_gib}: a device memory in GiB, "
                             f"between 1 KiB ({MEMORY_LIMIT_GIB[0]:.2g}) and 1 PiB "
                             f"({MEMORY_LIMIT_GIB[1]:.0f})")
    if not 0.0 <= overlap <= 1.0:
        raise ShardplanError(f"--overlap {overlap}: a share between 0 and 1")
    if not math.isfinite(bucket_mb) or bucket_mb < 0:
        raise ShardplanError(f"--bucket-mb {bucket_mb}: a bucket size in MiB, 0 or more "
                             "(0: one collective per tensor)")
    if not math.isfinite(time_limit) or time_limit <= 0:
        raise ShardplanError(f"--time-limit {time_limit}: must be a positive number of seconds")
    graph = load_graph(model, batch=batch, dims=dims, capacity_factor=capacity_factor)
    if len(graph.ops) > MAX_PLANNED_OPS:
        raise ModelError(f"{graph.path}: {len(graph.ops):,} ops, more than the planner plans "
                         f"({MAX_PLANNED_OPS:,}: each op takes memory and time in every "
                         "configuration priced); plan a model with fewer layers")
    chosen = _choice(Precision, precision, "--precision") or default_precision(
        graph.stored_float_dtype)
    graph = retyped(graph, policy(chosen).storage_dtype)
    training = TrainingOptions(
        optimizer=optimizer,
        memory_limit_bytes=int(memory_limit_gib * GIB) if memory_limit_gib else None,
        inference=inference, overlap=overlap, precision=chosen,
        attention=_choice(AttentionKernel, attention, "--attention")
        or hardware.default_attention,
        fusion=_choice(Fusion, fusion, "--fusion") or hardware.default_fusion,
        accumulation=accumulation_for(
            hardware, _choice(Fusion, fusion, "--fusion"),
            _choice(GradAccumulation, grad_accumulation, "--grad-accumulation")),
        bucket_mb=float(bucket_mb), overlap_grad_reduce=bool(overlap_grad_reduce),
        loss_reads=_choice(LossReads, loss_reads, "--loss-reads") or LossReads.ROWS,
    )
    if mode == "data":
        if mesh or strategies:
            raise ShardplanError("--mode data plans the data-parallel baseline; --mesh and "
                                 "--strategies apply to --mode semi or auto")
        baseline = plan_data_parallel(graph, hardware, devices, training)
        _check_baseline_pins(baseline, parallel or {})
        return baseline
    options = SearchOptions(
        mode=mode, solver=solver, time_limit=time_limit, max_mesh_axes=max_mesh_axes,
        mesh=tuple(mesh) if mesh else None, parallel=dict(parallel or {}),
        runnable=runnable or Runnable(),
        strategies=dict(strategies or {}), tie_layers=tie_layers,
    )
    return plan_search(graph, hardware, devices, options, training, progress, mixed)


def _check_baseline_pins(baseline: Plan, pins: Mapping[str, int | str]) -> None:
    """`--mode data` with `--parallel` pins: each must be what the baseline is (a pin it
    cannot honour is an error, never silently dropped)."""
    config = baseline.parallel
    for key, value in pins.items():
        have = getattr(config, key, None) if key != "recompute" else config.recompute.value
        if have is None or str(have) != str(value):
            raise ShardplanError(
                f"--parallel {key}={value}: --mode data plans the data-parallel baseline "
                f"(dp={config.dp}, tp=1, pp=1, zero=0, micro_batches=1, recompute=none); "
                "pin other values with --mode auto")


def _choice(kind: type[Choice], value: str | Choice | None, flag: str) -> Choice | None:
    """`value` as a member of the StrEnum `kind` (None stays None); a one-line error names
    the flag and its choices."""
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ShardplanError(f"{flag} {value!r}: choose one of "
                             f"{', '.join(member.value for member in kind)}") from None
