"""Per-stage meshes: pipeline stages on (dp, tp) shapes of their own (issue 17, item 4).

The model: a LLaMA whose head (a 256k vocabulary) outweighs a small body (hidden 1024), on
8 A100s in two stages of four. Under a 5 GiB limit the body fits without recompute only
split over tp, while the head stage is fastest split over dp: the search finds a plan with
a mesh per stage that beats every plan sharing one shape, and keeps the faster.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from wide_head import SETTINGS

from costmodels.profile import load_profile
from planner.api import load_graph, plan
from planner.cli import main
from planner.cost.pipeline import Pricer, ShapedPricer
from planner.cost.step import TrainingOptions
from planner.errors import PlanFileError, ShardplanError
from planner.explain.explanation import explain
from planner.explain.render import render
from planner.exports.dtensor import to_dtensor_placements
from planner.exports.mindspore import to_mindspore_checkpoint
from planner.graph import dtype_itemsize
from planner.kinds import RECOMPUTE_MODES, Runnable
from planner.plans.model import Plan
from planner.plans.stagemesh import op_meshes, per_stage_meshes, refuse_stage_meshes
from planner.report import summary
from planner.search.decisions import Choice
from planner.search.joint import pipeline_config
from planner.search.stagemeshes import shape_layout
from planner.search.stages import StageTables, solve_shaped, solve_stages
from planner.sharding.analysis import GraphAnalysis
from planner.validate import validate


@pytest.fixture(scope="module")
def model(wide_head_llama: Path) -> Path:
    return wide_head_llama


@pytest.fixture(scope="module")
def shaped(model: Path) -> Plan:
    return plan(model, parallel={"pp": 2}, **SETTINGS)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def shared(model: Path) -> Plan:
    return plan(model, parallel={"pp": 2, "stage_mesh": "shared"},
                **SETTINGS)  # type: ignore[arg-type]


def _shapes(chosen: Plan) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    assert chosen.pipeline is not None
    return [(tuple((s.mesh or chosen.mesh).axis_names), tuple((s.mesh or chosen.mesh).shape))
            for s in chosen.pipeline.stages]


def test_the_search_keeps_stage_meshes_where_faster(shaped: Plan, shared: Plan) -> None:
    assert per_stage_meshes(shaped.pipeline)
    shapes = _shapes(shaped)
    assert len(set(shapes)) == 2 and all(size == (2, 4) for _, size in shapes)
    assert shaped.mesh == shaped.pipeline.stages[0].mesh  # the plan's mesh is stage 0's
    assert not per_stage_meshes(shared.pipeline)
    assert shaped.predicted.fits and shared.predicted.fits
    assert shaped.predicted.step_time_s < shared.predicted.step_time_s
    # the search's exact price is the built plan's
    assert shaped.solver.objective == pytest.approx(shaped.predicted.step_time_s, rel=1e-12)
    # the stage of another shape receives the block its first reader wants (the head
    # stage splits the batch over dp=4: a quarter of the activation), never scattered
    sends = shaped.pipeline.sends
    assert sends and all(not s.scatter_axes for s in sends)
    for send in sends:
        entry = shaped.tensors[send.tensor]
        whole = math.prod(entry.shape) * dtype_itemsize(entry.dtype)
        assert send.bytes * 4 == whole


def test_each_op_is_laid_on_its_stages_mesh(shaped: Plan, model: Path) -> None:
    assert shaped.pipeline is not None
    meshes = op_meshes(shaped.mesh, shaped.pipeline, len(shaped.ops))
    for stage in shaped.pipeline.stages:
        for first, end in stage.ops:
            used = {axis for op in shaped.ops[first:end] for b in op.inputs if b
                    for axis in b.layout.used_axes}
            assert used <= set(stage.mesh.axis_names)
            assert all(meshes[k] == stage.mesh for k in range(first, end))
    graph = load_graph(model, batch=shaped.model.batch, dims=shaped.model.bound_dims)
    report = validate(shaped, graph)
    assert report.ok, report.problems
    assert report.checked["collectives"] > 0


def test_a_plan_with_stage_meshes_round_trips(shaped: Plan, tmp_path: Path) -> None:
    path = shaped.save(tmp_path / "plan.json")
    again = Plan.load(path)
    assert _shapes(again) == _shapes(shaped)
    assert validate(again).ok
    # stage meshes that do not hold the plan's devices, and layouts over an axis its stage lacks
    data = json.loads(path.read_text())
    data["pipeline"]["stages"][1]["mesh"]["shape"] = [2, 2]
    with pytest.raises(PlanFileError, match=r"stages\[\]\.mesh: the stages' meshes hold 6 "):
        Plan.from_json(data, "edited.json")
    data = json.loads(path.read_text())
    data["pipeline"]["stages"][1]["mesh"] = data["pipeline"]["stages"][0]["mesh"]
    with pytest.raises(PlanFileError, match="is not one of the mesh's axes"):
        Plan.from_json(data, "edited.json")


def test_validate_checks_a_resharded_send(shaped: Plan) -> None:
    assert shaped.pipeline is not None
    sends = list(shaped.pipeline.sends)
    sends[0] = replace(sends[0], bytes=sends[0].bytes // 4)  # as if it arrived split by dp
    edited = replace(shaped, pipeline=replace(shaped.pipeline, sends=tuple(sends)))
    problems = validate(edited).problems
    assert any("bytes, but its layout holds" in p for p in problems)


def test_readers_name_the_stage_meshes(shaped: Plan) -> None:
    line = "stages     each on a mesh of its own shape: 0: tp=4; 1: dp=4"
    assert line in summary(shaped).splitlines()
    assert line in render(explain(shaped)).splitlines()
    for reader in (lambda: refuse_stage_meshes(shaped.mesh, shaped.pipeline, "the executor"),
                   lambda: to_dtensor_placements(shaped),
                   lambda: to_mindspore_checkpoint(shaped)):
        with pytest.raises(ShardplanError, match="stage_mesh=shared"):
            reader()


def _replicated_tables(model: Path, micro_batch_size: int) -> tuple[Pricer, StageTables]:
    """A (dp=4, tp=1) stage's pricer and DP tables of the model, every op replicated."""
    micro = GraphAnalysis.of(load_graph(model, batch=micro_batch_size, dims={"seq": 2048}))
    hardware, training = load_profile("a100-80g"), TrainingOptions()
    choice = Choice(pp=2, dp=4, tp=1, micro_batches=8, zero=1)
    layout = shape_layout(micro, hardware, choice, training, 4, 1, {})
    pricer = Pricer(layout.profile, pipeline_config(choice, training), hardware, layout.mesh)
    return pricer, StageTables(pricer)


def test_one_shape_for_every_stage_prices_as_the_shared_pricer(model: Path) -> None:
    """ShapedPricer over stages of one shape is the plain Pricer, figure for figure; the
    DP over one option per stage is `solve_stages`."""
    plain, table = _replicated_tables(model, 4)
    shaped = ShapedPricer.of_shapes(
        [(4, 1), (4, 1)], lambda _, resharded, __: Pricer(plain.profile, plain.config,
                                                     plain.hardware, plain.mesh,
                                                     resharded=resharded))
    devices = [[(0, 5)], [(5, plain.profile.count)]]
    modes = [RECOMPUTE_MODES[0]] * 2
    assert shaped.price(devices, modes) == plain.price(devices, modes)
    limits = [float(80 * 2**30)] * 2
    alone = solve_stages([table, table], limits, RECOMPUTE_MODES)
    both = solve_shaped([[table], [table]], limits, RECOMPUTE_MODES)
    assert both is not None and alone is not None
    assert (both[0], both[1]) == alone and both[2] == [0, 0]


def test_solve_shaped_takes_the_lighter_option_per_stage(model: Path) -> None:
    """Two options: one halves every range that starts at the first unit (stage 0's) and
    doubles the rest, the other the reverse: each stage takes its lighter one."""
    _, base = _replicated_tables(model, 4)
    options = []
    for first, rest in ((0.5, 2.0), (2.0, 0.5)):
        table = StageTables.__new__(StageTables)
        table.__dict__.update(base.__dict__)
        factor = np.where(base.starts == 0, first, rest)[:, None]
        table.time = {mode: values * factor for mode, values in base.time.items()}
        options.append(table)
    found = solve_shaped([options] * 2, [np.inf, np.inf], RECOMPUTE_MODES)
    assert found is not None
    assert found[2] == [0, 1]


def test_the_cli_refuses_to_run_or_export_stage_meshes(shaped: Plan, model: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Before any rank starts: exit 2 and one line naming the stages' shapes and the pin."""
    path = shaped.save(tmp_path / "plan.json")
    for argv in (["run", str(model), "--plan", str(path), "--nproc", "8", "--steps", "1"],
                 ["export", str(path), "--format", "mindspore", "-o", str(tmp_path / "m.json")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "stage_mesh=shared" in err
        assert "0: tp=4; 1: dp=4" in err or "0: dp=4; 1: tp=4" in err


def test_stage_meshes_on_a_dynamo_export(tmp_path: Path) -> None:
    """The main input: torch's default exporter's graph of a transformers LLaMA (hidden
    256, vocabulary 2048), on 8 A100s in two stages. The head stage runs dp=4 where the
    body runs dp=2 × tp=2, and the plan validates against the export op by op."""
    from executor.module.launch import export_builder

    path = export_builder("examples.hf_models:llama_medium", 16, tmp_path / "llama.onnx")
    chosen = plan(path, batch=16, devices=8, parallel={"pp": 2})
    assert per_stage_meshes(chosen.pipeline)
    assert len(set(_shapes(chosen))) == 2
    graph = load_graph(path, batch=chosen.model.batch, dims=chosen.model.bound_dims)
    report = validate(chosen, graph)
    assert report.ok, report.problems
    assert report.checked["ops"] == len(graph.ops)


def test_stage_meshes_with_interleaved_chunks(model: Path) -> None:
    """Interleaved chunks wrap around the devices: each device takes its fastest shape
    for its chunks (`best_per_device`), the sends between shapes are resharded, and the
    plan validates against the model."""
    pins = {"pp": 4, "schedule": "interleaved"}
    chosen = plan(model, parallel=pins, **SETTINGS)  # type: ignore[arg-type]
    one = plan(model, parallel={**pins, "stage_mesh": "shared"},
               **SETTINGS)  # type: ignore[arg-type]
    assert chosen.pipeline is not None and chosen.pipeline.virtual_stages == 2
    assert all(len(stage.ops) == 2 for stage in chosen.pipeline.stages)
    assert len(set(_shapes(chosen))) == 2 and not per_stage_meshes(one.pipeline)
    assert chosen.predicted.step_time_s < one.predicted.step_time_s
    assert chosen.solver.objective == pytest.approx(chosen.predicted.step_time_s, rel=1e-12)
    meshes = {s.device_stage: s.mesh for s in chosen.pipeline.stages}
    assert all(not send.scatter_axes for send in chosen.pipeline.sends
               if meshes[send.from_stage] != meshes[send.to_stage])
    graph = load_graph(model, batch=chosen.model.batch, dims=chosen.model.bound_dims)
    report = validate(chosen, graph)
    assert report.ok, report.problems


def test_a_plan_for_the_executors_keeps_one_shape(model: Path, shaped: Plan) -> None:
    """What the executors run (`executor.schedule.RUNNABLE`: `plan --module` plans for the
    module executor): the search keeps one shape for every stage and no zero-bubble
    schedule (`shaped` is ZB-H1 on two shapes), without the user's pins saying so."""
    from executor.schedule import RUNNABLE

    assert per_stage_meshes(shaped.pipeline) and shaped.pipeline.schedule == "zb-h1"
    one_shape = plan(model, parallel={"pp": 2}, runnable=Runnable(stage_meshes=False),
                     **SETTINGS)  # type: ignore[arg-type]
    assert one_shape.pipeline is not None and not per_stage_meshes(one_shape.pipeline)
    assert one_shape.pipeline.schedule == "zb-h1"
    chosen = plan(model, parallel={"pp": 2}, runnable=RUNNABLE,
                  **SETTINGS)  # type: ignore[arg-type]
    assert chosen.pipeline is not None and not per_stage_meshes(chosen.pipeline)
    assert RUNNABLE.schedules is not None and chosen.pipeline.schedule in RUNNABLE.schedules
    assert "runnable" not in chosen.dumps()
