"""A module's trace away from the CPU, and a one-device plan run as planned on one process
(what `shardplan run --module ... --backend nccl --nproc 1` runs on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from executor.module.launch import (
    export_builder,
    load_builder,
    shared_trace,
    train_module_reference,
)
from executor.module.parallelize import _Trace, parameter_names
from planner.cli import main

LLAMA = "examples.hf_models:llama"
BATCH = 4

pytestmark = pytest.mark.slow


def test_the_trace_moves_what_the_export_made_on_the_cpu_but_not_the_weights() -> None:
    """On a GPU mesh the trace's buffers and constants (rotary frequencies) and the device
    its factory and copy ops name go to the mesh's device; the weights stay where the
    plan put them (the meta device stands in for a GPU: it has the same rules)."""
    module, make_batch, _ = load_builder(LLAMA)()
    trace = _Trace.of(module, make_batch(0, BATCH), shared_trace(LLAMA, BATCH))
    weights = {name for names in parameter_names(module) for name in names}
    graph = trace.graph
    reads = [n for n in graph.graph.nodes if n.op == "get_attr"]
    made = [n for n in reads if str(n.target) not in weights]
    naming = [n for n in graph.graph.nodes
              if n.op == "call_function" and n.kwargs.get("device") is not None]
    assert made and naming  # the LLaMA's rotary frequencies; its arange and .to(device)
    meta = torch.device("meta")

    def held(node: torch.fx.Node) -> torch.Tensor:
        value = graph
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return value

    trace.place_on(meta, weights)
    assert all(held(n).device == meta for n in made)
    assert all(torch.device(n.kwargs["device"]) == meta for n in naming)
    assert all(held(n).device.type == "cpu" for n in reads
               if str(n.target) in weights)


def test_a_one_device_plan_runs_as_planned_on_one_process(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`run --module --nproc 1` of a one-device plan runs the plan (its micro-batches and
    recompute), to the losses of the module trained whole; it is no longer the unsplit
    reference, which a one-device plan does not need."""
    plan_file, log = tmp_path / "plan.json", tmp_path / "log.json"
    assert main(["plan", "--module", LLAMA, "--batch", str(BATCH), "--devices", "1",
                 "--profile", "cpu", "--parallel", "micro_batches=2,recompute=full",
                 "-o", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["run", "--module", LLAMA, "--plan", str(plan_file), "--nproc", "1",
                 "--steps", "3", "--log-json", str(log)]) == 0
    out = capsys.readouterr().out
    assert "collectives: as planned" in out
    written = json.loads(log.read_text())
    assert written["recomputed"] > 0  # the recompute segments re-ran in backward
    alone = train_module_reference(LLAMA, steps=3, batch_size=BATCH)
    assert written["losses"] == pytest.approx(alone, rel=1e-4)


def test_run_reports_the_gpu_peak_beside_the_predicted_one(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run that measured its GPU peak (rank 0's allocator) prints it beside the plan's
    predicted peak per device, and writes it to the log; a CPU run (0) prints no such
    line."""
    from executor.train import RunLog
    from planner.api import plan
    from planner.cli.run import _report
    from planner.humanize import human_bytes

    model = export_builder(LLAMA, BATCH, tmp_path / "llama.onnx")
    chosen = plan(model, devices=1, batch=BATCH, profile="cpu", mode="data")
    log = RunLog(losses=[1.0], step_time_s=[0.1], peak_memory_bytes=3 << 30)
    written = tmp_path / "log.json"
    _report(log, chosen, str(written), compared=False)
    out = capsys.readouterr().out
    assert (f"peak memory 3.0 GiB allocated on rank 0; predicted "
            f"{human_bytes(chosen.predicted.memory.peak)} per device") in out
    assert json.loads(written.read_text())["peak_memory_bytes"] == 3 << 30
    _report(RunLog(losses=[1.0], step_time_s=[0.1]), chosen, None, compared=False)
    assert "peak memory" not in capsys.readouterr().out
