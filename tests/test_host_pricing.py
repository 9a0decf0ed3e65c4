"""The host's own time per op run and per step (`device.host_op_s`, `device.host_step_s`),
priced where a profile states it: every op run adds a plain op's or a DTensor op's time
(`planner.cost.pricing.runs_locally`), the step its own, and nothing else changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodels.profile import load_profile
from planner import zoo
from planner.api import load_graph, plan
from planner.cli.host import op_runs
from planner.cost.step import TrainingOptions
from planner.plans.planning import plan_baseline
from planner.sharding.analysis import GraphAnalysis
from planner.zoo.gpt import GPTConfig

CPU = Path(__file__).resolve().parents[1] / "hardware_profiles" / "cpu.json"
LOCAL_S, DISTRIBUTED_S, STEP_S = 10e-6, 200e-6, 3e-3


def _cited(value: float) -> dict:
    return {"value": value, "source": "measured-2026-11-29", "note": "a test's figure"}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The bundled cpu profile, and the same with host times."""
    folder = tmp_path_factory.mktemp("profiles")
    data = json.loads(CPU.read_text(encoding="utf-8"))
    data["name"] = "cpu-host"
    data["device"]["host_op_s"] = {
        f"{phase}_{kind}": _cited(LOCAL_S if kind == "local" else DISTRIBUTED_S)
        for phase in ("forward", "backward") for kind in ("local", "distributed")}
    data["device"]["host_step_s"] = _cited(STEP_S)
    hosted = folder / "cpu-host.json"
    hosted.write_text(json.dumps(data), encoding="utf-8")
    return CPU, hosted


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = GPTConfig(layers=2, hidden=64, heads=4, vocab=128, max_positions=16,
                       fused_qkv=False)
    return zoo.save(zoo.build("gpt", config), tmp_path_factory.mktemp("gpt") / "gpt.onnx")


def _analysis(model: Path) -> GraphAnalysis:
    return GraphAnalysis.of(load_graph(model, batch=4, dims={"seq": 16}))


def test_a_data_parallel_step_adds_a_plain_op_run_each_and_the_steps_own(
        gpt: Path, profiles: tuple[Path, Path]) -> None:
    bare, hosted = (plan(gpt, profile=str(p), devices=2, batch=4, dims={"seq": 16},
                         mode="data") for p in profiles)
    local, distributed = op_runs(_analysis(gpt), hosted)
    assert distributed == 0 and local > len(hosted.ops)  # forward, and most ops backward
    added = hosted.predicted.step_time_s - bare.predicted.step_time_s
    assert added == pytest.approx(local * LOCAL_S + STEP_S, rel=1e-9)
    assert hosted.predicted.breakdown["optimizer_s"] == pytest.approx(
        bare.predicted.breakdown["optimizer_s"] + STEP_S, rel=1e-9)


def test_a_tensor_parallel_step_adds_its_dtensor_op_runs_at_their_own_time(
        gpt: Path, profiles: tuple[Path, Path]) -> None:
    """Megatron's layout: the projections and attention run through DTensor, the norms
    and residuals on plain tensors, the weights' transposes with their reads."""
    bare, hosted = (plan_baseline(load_graph(gpt, batch=4, dims={"seq": 16}),
                                  load_profile(p), 2, "megatron", TrainingOptions())
                    for p in profiles)
    local, distributed = op_runs(_analysis(gpt), hosted)
    assert distributed > 0 and local > 0
    added = hosted.predicted.step_time_s - bare.predicted.step_time_s
    assert added == pytest.approx(local * LOCAL_S + distributed * DISTRIBUTED_S + STEP_S,
                                  rel=1e-9)


def test_a_profile_without_host_times_prices_none(gpt: Path) -> None:
    profile = load_profile(CPU)
    assert profile.host_op_s is None and profile.host_step_s is None
    assert profile.host_seconds(False, False) == 0.0 and profile.step_host_seconds == 0.0


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["host_op_s"].pop("backward_local"), "host_op_s.backward_local is missing"),
    (lambda d: d["host_op_s"]["forward_local"].update(value=-1e-6),
     "host_op_s.forward_local.value must be a finite number >= 0"),
    (lambda d: d["host_op_s"].update(sideways=_cited(1e-6)), "sideways is not a known field"),
    (lambda d: d["host_step_s"].update(value="fast"), "host_step_s.value must be a number"),
])
def test_host_fields_are_checked(profiles: tuple[Path, Path], tmp_path: Path, edit,  # type: ignore[no-untyped-def]
                                 message: str) -> None:
    from costmodels.profile import ProfileError

    data = json.loads(profiles[1].read_text(encoding="utf-8"))
    edit(data["device"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ProfileError, match=message.replace(".", r"\.")):
        load_profile(path)


def test_how_the_host_runs_an_op_follows_the_batchs_axes(gpt: Path) -> None:
    """As the module executor decides (`executor.module.local`): an op splitting exactly
    its batch over the inputs' axes runs on plain tensors, a replicated op holding the
    batch only where the batch is not split, any op through DTensor where the inputs are
    split otherwise; a weight's transpose always with its read."""
    from planner.cost.pricing import input_batch_axes, runs_locally
    from planner.sharding.layout import Layout

    analysis = _analysis(gpt)
    graph = analysis.graph
    gather = next(op for op in graph.ops if op.op_type == "Gather"
                  and analysis.batch_labels.get(op.name))
    batch = {label: ("dp",) for label in analysis.batch_labels[gather.name]}
    outputs = [None] * len(gather.outputs)
    assert runs_locally(gather, batch, outputs, analysis, ("dp",))
    assert not runs_locally(gather, batch, outputs, analysis, ("a0",))
    assert not runs_locally(gather, {}, outputs, analysis, ("dp",))  # replicated, batch split
    assert runs_locally(gather, {}, outputs, analysis, ())  # replicated, batch whole
    assert not runs_locally(gather, batch, outputs, analysis, None)
    assert runs_locally(gather, batch, outputs, analysis)  # the search: any axes
    weights = next(op for op in graph.ops
                   if all(o in analysis.weight_roots for o in op.outputs if o))
    assert runs_locally(weights, {}, [None], analysis, None)
    split, rows = Layout((("dp",), ()), ()), Layout((("dp",), ("tp",)), ())
    assert input_batch_axes([split, split]) == ("dp",)
    assert input_batch_axes([Layout(((), ()), ())]) == ()
    assert input_batch_axes([rows]) is None
    assert input_batch_axes([split, Layout((("tp",), ()), ())]) is None
