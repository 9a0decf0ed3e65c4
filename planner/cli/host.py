"""The executor's own time per op run on this host, for `shardplan calibrate`.

On a CPU rank the host runs every op itself, one after another: beside each kernel's
time (which the rest of the calibration measures) a step pays the executor's Python per
op, and for an op through DTensor its dispatch (a sharding rule looked up, local shapes
computed, a result wrapped), which is several times a plain op's. The cost model prices
both per op run (`device.host_op_s`, `planner.cost.pricing.op_times`) and what a step
pays once beside them (`device.host_step_s`).

They are measured here on the executor itself: a small transformer
(`executor.module.probe.Probe`) at two
depths, each planned data parallel (every op on plain tensors) and with Megatron's
tensor-parallel layout (its projections and attention through DTensor) on the profile
just measured, and trained. Step time less the predicted time grows with the op runs by
the host's time per op run: the data-parallel slope between the depths is a plain op
run's; the tensor-parallel one, less its plain op runs, a DTensor op run's; what the
shallow data-parallel run leaves is the step's own (`costmodels.calibrate.fit_host`).
Forward and backward passes are taken to cost the host alike per op (a DTensor add:
11.8 µs forward, 13.0 µs backward here; a plain one 1.8 and 2.8).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from costmodels.calibrate import HostSample, with_host_times
from costmodels.measure import lower_quartile
from costmodels.profile import load_profile
from executor.module.launch import export_builder, train_module
from executor.module.probe import PROBE_BATCH, PROBE_LAYERS
from planner.api import load_graph, plan
from planner.cost.pricing import input_batch_axes, runs_locally
from planner.cost.step import TrainingOptions
from planner.graph import PlanningGraph
from planner.plans.model import Plan
from planner.plans.planning import plan_baseline
from planner.sharding.analysis import GraphAnalysis


def _spec(layers: int) -> str:
    return f"executor.module.probe:probe_{layers}"


#: The probe's plans: data parallel (every op on plain tensors) and the Megatron baseline
#: (tensor parallel inside the node: the projections and attention through DTensor).
PROBE_PLANS = ("data", "tensor")
#: Steps each run takes before the timed ones (the first builds its caches, the second
#: still runs slower on this host)
WARM_UP = 2


def _probe_plan(graph: PlanningGraph, profile: Path, devices: int, kind: str) -> Plan:
    if kind == "data":
        return plan(graph, profile=str(profile), devices=devices, mode="data")
    return plan_baseline(graph, load_profile(profile), devices, "megatron", TrainingOptions())


def op_runs(analysis: GraphAnalysis, planned: Plan) -> tuple[int, int]:
    """(plain, DTensor) op runs of one step of `planned`, a plan of `analysis`'s graph:
    every op forward, and backward where a gradient flows, as `planner.cost.pricing.
    runs_locally` says the host runs it: what `planner.cost.pricing.op_times` prices host
    time for."""
    ops = {node.name: node for node in analysis.graph.ops}
    batch_axes = input_batch_axes(planned.tensors[name].layout
                                  for name in analysis.graph.inputs
                                  if name in planned.tensors)
    local = distributed = 0
    for entry in planned.ops:
        node = ops[entry.name]
        runs = 1 + (node.name in analysis.differentiated)
        if runs_locally(node, entry.assignment,
                        [b.layout if b else None for b in entry.outputs], analysis,
                        batch_axes):
            local += runs
        else:
            distributed += runs
    return local, distributed


def measure(profile: Path, nproc: int, steps: int,
            progress: Callable[[str], None] | None = None) -> list[HostSample]:
    """Each probe depth planned data and tensor parallel on `nproc` ranks with
    `profile`, and the lower quartile of `steps` step times the executor takes on each
    plan after its warm-up (other processes only ever add time, as for every point the
    calibration measures)."""
    say = progress or (lambda _text: None)
    samples = []
    batch = PROBE_BATCH * max(1, nproc // 2)
    with tempfile.TemporaryDirectory() as scratch:
        for layers in PROBE_LAYERS:
            spec = _spec(layers)
            model = export_builder(spec, batch, Path(scratch) / f"probe{layers}.onnx")
            analysis = GraphAnalysis.of(load_graph(model, batch=batch))  # once per depth
            for kind in PROBE_PLANS:
                planned = _probe_plan(analysis.graph, profile, nproc, kind)
                log = train_module(spec, planned, steps=steps + WARM_UP, batch_size=batch,
                                   optimizer="adamw", lr=1e-3, count_steps=1)
                local, distributed = op_runs(analysis, planned)
                sample = HostSample(kind, layers, local, distributed,
                                    planned.predicted.step_time_s,
                                    lower_quartile(log.step_time_s[WARM_UP:]))
                say(f"executor, {kind}-parallel probe of {layers} layer(s): {local} plain "
                    f"and {distributed} DTensor op runs a step, {sample.measured_s * 1e3:.1f}"
                    f" ms, {sample.predicted_s * 1e3:.1f} ms predicted")
                samples.append(sample)
    return samples


def calibrate_host(profile: Path, nproc: int = 2, quick: bool = False,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure the executor's host time on `nproc` gloo ranks and write it into the
    calibrated `profile` (`device.host_op_s`, `device.host_step_s`); returns its data."""
    samples = measure(profile, nproc, 5 if quick else 12, progress)
    data = with_host_times(json.loads(profile.read_text(encoding="utf-8")), samples, quick)
    profile.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return data
