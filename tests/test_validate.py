"""`shardplan validate`: valid plans pass; each kind of tampering is found and named."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from planner import zoo
from planner.api import plan
from planner.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("validate")
    model = folder / "gpt.onnx"
    onnx.save(zoo.build("gpt-tiny", hidden=128, heads=4, vocab=512, layers=2), model)
    found = {"model": model}
    for name, pins in (("tensor", {"dp": 2, "tp": 2}),
                       ("pipeline", {"pp": 2, "dp": 2, "micro_batches": 2, "zero": 1,
                                     "recompute": "selective", "schedule": "1f1b"})):
        chosen = plan(model, devices=4, batch=8, dims={"seq": 16}, profile="cpu",
                      parallel=pins)
        found[name] = chosen.save(folder / f"{name}.json")
    return found


def _validate(plan_file: Path, model: Path | None, capsys) -> tuple[int, str]:
    argv = ["validate", str(plan_file)] + ([str(model)] if model else [])
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("name", ["tensor", "pipeline"])
def test_plans_the_planner_writes_are_valid(files: dict[str, Path], name: str,
                                            capsys) -> None:
    for model in (None, files["model"]):
        code, text = _validate(files[name], model, capsys)
        assert code == 0, text
        assert "valid" in text
    assert main(["validate", str(files[name]), str(files["model"]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["checked"]["ops"] > 0


def _tampered(source: Path, tmp_path: Path, change) -> Path:
    data = json.loads(source.read_text())
    change(data)
    target = tmp_path / "tampered.json"
    target.write_text(json.dumps(data))
    return target


def _first_split_binding(data: dict) -> tuple[dict, dict]:
    for op in data["ops"]:
        for binding in op["inputs"]:
            if binding and any(binding["layout"]["dims"]) and \
                    data["tensors"][binding["tensor"]]["kind"] == "activation":
                return op, binding
    raise AssertionError("no split activation input in the plan")


def test_a_layout_its_assignment_does_not_imply_is_found(files: dict[str, Path],
                                                         tmp_path: Path, capsys) -> None:
    def change(data: dict) -> None:
        _, binding = _first_split_binding(data)
        binding["layout"]["dims"] = [[] for _ in binding["layout"]["dims"]]

    code, text = _validate(_tampered(files["tensor"], tmp_path, change), files["model"], capsys)
    assert code == 2 and "assignment implies" in text


def test_a_missing_collective_is_found(files: dict[str, Path], tmp_path: Path,
                                       capsys) -> None:
    def change(data: dict) -> None:
        index = next(i for i, c in enumerate(data["collectives"])
                     if c["phase"] == "backward" and c["op"] != "optimizer"
                     and c["kind"] != "send_recv")
        del data["collectives"][index]

    code, text = _validate(_tampered(files["tensor"], tmp_path, change), files["model"], capsys)
    assert code == 2 and "missing backward" in text


def test_a_missing_gradient_sum_is_found(files: dict[str, Path], tmp_path: Path,
                                         capsys) -> None:
    def change(data: dict) -> None:
        data["collectives"] = [c for c in data["collectives"] if c["phase"] != "gradient"]

    code, text = _validate(_tampered(files["tensor"], tmp_path, change), files["model"], capsys)
    assert code == 2 and "gradient must be summed" in text


def test_an_unlisted_redistribution_is_found_without_the_model(
        files: dict[str, Path], tmp_path: Path, capsys) -> None:
    def change(data: dict) -> None:  # read whole what is stored split: an all-gather
        _, binding = _first_split_binding(data)
        data["tensors"][binding["tensor"]]["layout"] = dict(binding["layout"])
        binding["layout"] = {**binding["layout"],
                             "dims": [[] for _ in binding["layout"]["dims"]]}
        data["collectives"] = [c for c in data["collectives"]
                               if not (c["tensor"] == binding["tensor"]
                                       and c["phase"] == "forward")]

    code, text = _validate(_tampered(files["tensor"], tmp_path, change), None, capsys)
    assert code == 2 and "do not list" in text


@pytest.mark.parametrize("change,needle", [
    (lambda d: d["pipeline"]["stages"][1]["ops"].__setitem__(0, [0, 5]), "exactly once"),
    (lambda d: d["pipeline"]["stages"][1].__setitem__("ranks", [0, 1]), "block"),
    (lambda d: d["parallel"].__setitem__("pp", 3), "parallel.pp"),
    (lambda d: d["pipeline"].__setitem__("global_batch", 99), "global batch"),
    (lambda d: d["pipeline"]["stages"][0]["recompute_segments"].append(  # stage 1's op
        [d["pipeline"]["stages"][1]["ops"][0][0], d["pipeline"]["stages"][1]["ops"][0][0] + 1]),
     "not inside"),
    (lambda d: d["pipeline"]["stages"][0]["recompute_segments"].append([10_000, 10_001]),
     "lies outside the plan's"),  # refused on load: readers index the ops by it
    # refused on load too: every reader walks the ranges' ops, ranges times ops where
    # they repeat (20,000 copies of a stage's range took validate minutes)
    (lambda d: d["pipeline"]["stages"][0].__setitem__(
        "ops", d["pipeline"]["stages"][0]["ops"] * 20_000), "exactly once"),
    (lambda d: d["pipeline"]["stages"][1].__setitem__(
        "recompute_segments", [d["pipeline"]["stages"][1]["ops"][0]] * 2),
     "recomputed once at most"),
])
def test_pipeline_tampering_is_found(files: dict[str, Path], tmp_path: Path, capsys,
                                     change, needle: str) -> None:
    code, text = _validate(_tampered(files["pipeline"], tmp_path, change), None, capsys)
    assert code == 2 and needle in text, text


def test_another_models_plan_is_refused(files: dict[str, Path], tmp_path: Path,
                                        capsys) -> None:
    other = tmp_path / "other.onnx"
    onnx.save(zoo.build("gpt-tiny", hidden=128, heads=4, vocab=512, layers=3), other)
    code, text = _validate(files["tensor"], other, capsys)
    assert code == 2 and "sha256" in text


def test_an_extra_gradient_sum_and_a_wrong_strategy_tuple_are_found(
        files: dict[str, Path], tmp_path: Path, capsys) -> None:
    def change(data: dict) -> None:
        weight = next(c["tensor"] for c in data["collectives"]
                      if c["phase"] == "gradient" and c["axes"] == ["dp"])
        data["collectives"].append({"kind": "all_reduce", "tensor": weight, "axes": ["tp"],
                                    "bytes": 4, "phase": "gradient", "op": "optimizer",
                                    "time_s": 0.0})
        op = next(op for op in data["ops"] if any(max(t, default=1) > 1
                                                  for t in op["strategy"]))
        op["strategy"] = [[1] * len(t) for t in op["strategy"]]

    code, text = _validate(_tampered(files["tensor"], tmp_path, change), files["model"], capsys)
    assert code == 2
    assert "the assignments need ['dp']" in text
    assert "does not match its input layouts" in text


@pytest.fixture(scope="module")
def data_plan(files: dict[str, Path]) -> Path:
    """An op-level data-parallel plan: each weight's gradient one all-reduce (ZeRO 0)."""
    chosen = plan(files["model"], devices=2, batch=8, dims={"seq": 16}, profile="cpu",
                  mode="data")
    return chosen.save(files["model"].parent / "data.json")


def test_an_op_level_plan_validates_clean(data_plan: Path, files: dict[str, Path],
                                          capsys) -> None:
    code, text = _validate(data_plan, files["model"], capsys)
    assert code == 0, text


def _first_gradient(data: dict, kind: str) -> dict:
    return next(c for c in data["collectives"] if c["op"] == "optimizer"
                and c["kind"] == kind and c["phase"] == "gradient")


@pytest.mark.parametrize("change,needle", [
    (lambda d: d["collectives"].append(dict(_first_gradient(d, "all_reduce"))),
     "2× gradient all_reduce over ['dp'] listed, but its gradient sum needs 1×"),
    (lambda d: _first_gradient(d, "all_reduce").__setitem__("kind", "broadcast"),
     "1× gradient broadcast over ['dp'] listed"),
    (lambda d: d["parallel"].update(dp=7, tp=4), "parallel dp=7 tp=4 pp=1 is 28 devices"),
    (lambda d: d["predicted"].__setitem__("step_time_s", float("inf")),
     "predicted.step_time_s is inf"),
])
def test_op_level_tampering_is_found(data_plan: Path, files: dict[str, Path], tmp_path: Path,
                                     capsys, change, needle: str) -> None:
    code, text = _validate(_tampered(data_plan, tmp_path, change), files["model"], capsys)
    assert code == 2 and needle in text, text


def _gradient_weight(data: dict) -> str:
    return _first_gradient(data, "reduce_scatter")["tensor"]


@pytest.mark.parametrize("change,needle,alone", [
    (lambda d: d.__setitem__("collectives", [c for c in d["collectives"]
                                             if c["kind"] != "send_recv"]),
     "the plan lacks its forward send_recv over ['pp']", True),
    (lambda d: d["pipeline"].__setitem__("sends", []),
     "but the plan lacks that send", True),
    (lambda d: d["parallel"].__setitem__("zero", 0),
     "needs 1× gradient all_reduce over ['dp']", False),
    (lambda d: d["parallel"].update(dp=7, tp=4), "parallel dp=7 tp=4 pp=2 is 56 devices", True),
    (lambda d: d["parallel"].__setitem__("dp", 1), "parallel.dp is 1 but the mesh", True),
    (lambda d: d["pipeline"]["stages"][0].__setitem__("forward_s", 1e400),
     "pipeline.stages[0].forward_s is inf", True),
    # an op's own numbers, read off its entry (the paths as the file writes them)
    (lambda d: d["ops"][3]["cost"].__setitem__("backward_s", -1.0),
     "ops[3].cost.backward_s is -1.0", True),
])
def test_pipeline_re_derivation_finds_tampering(files: dict[str, Path], tmp_path: Path,
                                                capsys, change, needle: str,
                                                alone: bool) -> None:
    tampered = _tampered(files["pipeline"], tmp_path, change)
    code, text = _validate(tampered, files["model"], capsys)
    assert code == 2 and needle in text, text
    if needle.startswith("needs"):  # the ZeRO-1 steps are named with their weight
        assert f"weight {_gradient_weight(json.loads(files['pipeline'].read_text()))}" in text
    if alone:  # found from the plan's own sections too
        code, text = _validate(tampered, None, capsys)
        assert code == 2 and needle in text, text


def test_the_executor_refuses_what_validate_rejects(files: dict[str, Path],
                                                    tmp_path: Path) -> None:
    from executor.train import preflight
    from planner.errors import PlanFileError
    from planner.plans.model import Plan

    tampered = _tampered(files["pipeline"], tmp_path,
                         lambda d: d["pipeline"].__setitem__("sends", []))
    with pytest.raises(PlanFileError, match=r"does not validate against .*lacks that send"):
        preflight(files["model"], Plan.load(tampered))
