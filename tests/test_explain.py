"""`shardplan explain` / `compare` and the plots: every figure must come from the plan."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from costmodels.schedule import pipeline_time
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.cli.progress import Progress as _Progress
from planner.explain import JSON_KEYS, explain, find_units
from planner.kinds import Schedule
from planner.plans.model import Plan
from planner.plots import schedule_events


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An op-level plan, a pipeline plan and a data-parallel plan of gpt-tiny; a seed plan."""
    folder = tmp_path_factory.mktemp("explain")
    model = folder / "m.onnx"
    onnx.save(zoo.build("gpt-tiny"), model)
    seed = folder / "seed.onnx"
    onnx.save(zoo.build("seed"), seed)
    made = {
        "op": plan(model, devices=4, batch=8, dims={"seq": 16}),
        "pipe": plan(model, devices=4, batch=8, dims={"seq": 16},
                     parallel={"pp": 2, "dp": 2, "micro_batches": 4}),
        "data": plan(model, devices=4, batch=8, dims={"seq": 16}, mode="data"),
        "seed": plan(seed, devices=2, batch=8, mode="data"),
    }
    paths = {name: made[name].save(folder / f"{name}.json") for name in made}
    paths["model"] = model
    return paths


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_explain_op_level_names_layers_terms_and_baselines(
        plans: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(["explain", str(plans["op"])], capsys)
    assert code == 0
    loaded = Plan.load(plans["op"])
    for unit in ("prefix", "layer 0", "suffix"):
        assert unit in out
    assert "where the step time goes" in out and "backward compute" in out
    for name, brief in loaded.baselines.items():
        ratio = brief.step_time_s / loaded.predicted.step_time_s
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{name}:"))
        if abs(ratio - 1) >= 0.005:
            shown = ratio if ratio > 1 else 1 / ratio
            assert f"{shown:.2f}×" in line, line
        assert "does not fit" in line or "vs" in line or "same step time" in line


def test_explain_pipeline_shows_stages_bubble_and_rivals(
        plans: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(["explain", str(plans["pipe"]), "--top", "3"], capsys)
    assert code == 0
    assert "pipeline bubble" in out and "× 4 micro-batches" in out
    assert re.search(r"^\s+1\s+layer 1", out, re.M)  # the stage table
    top = out.split("top ops")[1].split("\n\n")[0].strip().splitlines()[1:]
    assert len(top) == 3
    assert "why this plan" in out and "data-parallel:" in out


@pytest.mark.parametrize("name", ["op", "pipe", "data"])
def test_terms_add_up_to_the_step_time(plans: dict[str, Path], name: str) -> None:
    loaded = Plan.load(plans[name])
    ex = explain(loaded)
    total = sum(t.time_s for t in ex.terms)
    assert total == pytest.approx(loaded.predicted.step_time_s, rel=1e-6)
    assert not any(t.name.startswith("not itemised") for t in ex.terms)
    covered = sorted(i for u in ex.units for first, end in u.ops for i in range(first, end))
    assert covered == list(range(len(loaded.ops)))


def test_pipeline_units_add_up_to_their_stage(plans: dict[str, Path]) -> None:
    """Per unit compute + collectives of one stage = micro-batches × the stage's times."""
    loaded = Plan.load(plans["pipe"])
    ex = explain(loaded)
    m = loaded.pipeline.micro_batches
    for stage in loaded.pipeline.stages:
        mine = [u for u in ex.units if u.stage == stage.device_stage]
        summed = sum(u.forward_s + u.backward_s + u.collective_s for u in mine)
        assert summed == pytest.approx(m * (stage.forward_s + stage.backward_s),
                                       rel=1e-6)


def test_units_without_pipeline_match_the_planner_layers(plans: dict[str, Path]) -> None:
    """The plan-only grouping equals `planner.layers.find_units` on the imported graph."""
    from planner.importer import import_model
    from planner.layers import find_blocks
    from planner.layers import find_units as graph_units

    loaded = Plan.load(plans["data"])
    assert loaded.pipeline is None
    units, how = find_units(loaded)
    assert "repeated layers" in how
    graph = import_model(plans["model"], batch=8, dims={"seq": 16})
    expected = graph_units(graph, find_blocks(graph))
    assert [u.name for u in units] == list(expected.names)
    assert [u.ranges[0][0] for u in units] == list(expected.bounds[:-1])


def test_explain_json_has_the_documented_keys(plans: dict[str, Path],
                                              capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(["explain", str(plans["pipe"]), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert set(data) == {*JSON_KEYS, "plots"}
    loaded = Plan.load(plans["pipe"])
    assert data["step_time_s"] == loaded.predicted.step_time_s
    baselines = {r["name"]: r for r in data["rivals"] if r["source"] == "baseline"}
    assert set(baselines) == set(loaded.baselines)
    for name, rival in baselines.items():
        assert rival["ratio"] == pytest.approx(
            loaded.baselines[name].step_time_s / loaded.predicted.step_time_s)
    assert all({"name", "split", "forward_s", "total_s", "stage"} <= set(u)
               for u in data["units"])
    times = [item["time_s"] for item in data["top_ops"]]
    assert times == sorted(times, reverse=True)
    assert data["communication"]["phases"] == ["forward", "backward", "gradient"]


def test_the_chosen_plan_is_not_its_own_rival(plans: dict[str, Path]) -> None:
    loaded = Plan.load(plans["pipe"])
    names = [r.name for r in explain(loaded).rivals if r.source == "alternative"]
    mine = (f"pp={loaded.parallel.pp} dp={loaded.parallel.dp} tp={loaded.parallel.tp} "
            f"mb={loaded.parallel.micro_batches} zero={loaded.parallel.zero} "
            f"recompute={loaded.parallel.recompute}")
    assert mine not in names
    assert len(names) == len(loaded.alternatives) - 1


def test_compare_side_by_side_and_flags_other_models(plans: dict[str, Path],
                                                     capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(["compare", str(plans["op"]), str(plans["pipe"])], capsys)
    assert code == 0
    for row in ("mesh", "dp", "tp", "pp", "micro_batches", "zero", "recompute", "step time",
                "communication", "bubble", "activations", "fits"):
        assert re.search(rf"^\s*{row}\b", out, re.M), row
    assert "different models" not in out
    code, out, _ = _run(["compare", str(plans["op"]), str(plans["seed"]), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert [Path(e["source"]).name for e in data["plans"]] == ["op.json", "seed.json"]
    assert data["plans"][0]["ratio"] == 1.0
    assert any(note.startswith("different models") for note in data["notes"])


def test_plots_are_written(plans: dict[str, Path], tmp_path: Path,
                           capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    for name in ("op", "pipe"):
        code, out, _ = _run(["explain", str(plans[name]), "--plot", str(tmp_path)], capsys)
        assert code == 0 and "plots:" in out
        for figure in ("layers", "memory", "schedule", "communication"):
            for suffix in ("png", "svg"):
                path = tmp_path / f"{name}-{figure}.{suffix}"
                assert path.stat().st_size > 10_000, path


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2),
                                             ("zb-h1", 1), ("zbv", 2)])
def test_schedule_timeline_matches_the_schedule_formula(plans: dict[str, Path], schedule: str,
                                                        chunks: int) -> None:
    """Equal stages: the simulated timeline ends when costmodels.schedule says."""
    loaded = Plan.load(plans["pipe"])
    p, m = 4, 8
    stage = {"forward_s": 1.0, "backward_s": 2.0, "recompute_s": 0.0, "p2p_s": 0.0,
             "zero_s": 0.0, "gradient_sync_s": 0.0, "optimizer_s": 0.0,
             "weight_gradient_s": 1.0}
    pipeline = dataclasses.replace(
        loaded.pipeline, schedule=Schedule(schedule), virtual_stages=chunks, micro_batches=m,
        stages=tuple(dataclasses.replace(loaded.pipeline.stages[0], device_stage=s, **stage)
                     for s in range(p)))
    events = schedule_events(dataclasses.replace(loaded, pipeline=pipeline))
    end = max(e.end for e in events)
    assert end == pytest.approx(pipeline_time([3.0] * p, m, schedule, chunks))
    forwards = [e for e in events if e.kind == "forward"]
    assert len(forwards) == p * m * chunks
    weights = [e for e in events if e.kind == "weight gradients"]  # W drawn apart
    assert len(weights) == (p * m * chunks if schedule.startswith("zb") else 0)


@pytest.mark.parametrize("argv,needle", [
    (["explain", "{missing}"], "no such plan file"),
    (["explain", "{other}"], "schema"),
    (["explain", "{text}"], "not valid JSON"),
    (["compare", "{plan}"], "two or more"),
    (["explain", "{plan}", "--top", "0"], "must be at least 1"),
])
def test_bad_input_exits_2_with_one_line(plans: dict[str, Path], tmp_path: Path,
                                         argv: list[str], needle: str,
                                         capsys: pytest.CaptureFixture) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"name": "not a plan"}')
    text = tmp_path / "text.json"
    text.write_text("hello")
    values = {"missing": str(tmp_path / "absent.json"), "other": str(other),
              "text": str(text), "plan": str(plans["op"])}
    code, _, err = _run([a.format(**values) for a in argv], capsys)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_missing_matplotlib_exits_2_with_one_line(plans: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = _run(["explain", str(plans["op"]), "--plot", str(tmp_path / "p")],
                          capsys)
    assert code == 2 and out == ""
    assert "matplotlib" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_planner_imports_without_matplotlib() -> None:
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "import planner.cli, planner.explain, planner.plots, planner.api")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr


def test_progress_is_silent_for_a_quick_plan() -> None:
    stream = io.StringIO()
    quick = _Progress(stream, delay_s=60.0)
    quick("mesh 4: optimal")
    quick.close()
    assert stream.getvalue() == ""
    slow = _Progress(stream, delay_s=0.0)
    slow("mesh 2x2: optimal")
    slow.close()
    assert "mesh 2x2: optimal" in stream.getvalue()


def test_the_summary_says_how_weights_are_held(tmp_path: Path) -> None:
    """dp/tp/zero do not say it: a weight stored split by its first reader and gathered
    whole for another (here the tied head's transpose) is FSDP-like storage; tensor
    parallel weights are used in place; ZeRO-3 is named as such."""
    from planner.report import summary

    path = zoo.save(zoo.build("gpt-tiny"), tmp_path / "gpt.onnx")
    gathered = plan(path, devices=2, batch=4, dims={"seq": 8}, mode="semi",
                    strategies={"wte.gather": [[2, 1], [1, 1]],
                                "lm_head.tied_transpose": [[1, 1]]})
    line = next(x for x in summary(gathered).splitlines() if x.startswith("weights"))
    assert "1 stored split and gathered before each use" in line and "FSDP-like" in line
    in_place = plan(path, devices=2, batch=4, dims={"seq": 8}, mode="semi",
                    strategies={"h.0.attn.c_proj.matmul": [[1, 1, 2], [2, 1]]})
    line = next(x for x in summary(in_place).splitlines() if x.startswith("weights"))
    assert "split and used in place" in line and "FSDP-like" not in line
    zero3 = plan(path, devices=2, batch=4, dims={"seq": 8}, parallel={"dp": 2, "zero": 3})
    line = next(x for x in summary(zero3).splitlines() if x.startswith("weights"))
    assert "ZeRO-3 stores each 1/2 over dp" in line


def test_explain_names_a_separate_gradient_accumulation(
        plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Under `--grad-accumulation separate` the optimizer term carries the gradients'
    accumulation over micro-batches, and `explain` says so; fused, it is the optimizer."""
    separate = plan(plans["model"], devices=4, batch=8, dims={"seq": 16},
                    parallel={"dp": 4, "micro_batches": 2}, grad_accumulation="separate")
    path = separate.save(tmp_path / "separate.json")
    code, out, _ = _run(["explain", str(path)], capsys)
    assert code == 0 and "optimizer and gradient accumulation" in out
    code, out, _ = _run(["explain", str(plans["pipe"])], capsys)
    assert code == 0 and "optimizer and gradient accumulation" not in out
