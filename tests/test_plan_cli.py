"""End-to-end planning through the API and the CLI, and the CLI's answers to bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.plans.model import Plan
from planner.plans.schema import SCHEMA_FILE

SCHEMA = json.loads(SCHEMA_FILE.read_text())


@pytest.fixture(scope="module")
def gpt_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, config = zoo.preset("gpt-tiny")
    return zoo.save(zoo.build(family, config), tmp_path_factory.mktemp("zoo") / "gpt.onnx")


def _assert_valid_plan(data: dict, compute_ops: set[str]) -> None:
    jsonschema.validate(data, SCHEMA)
    assert compute_ops <= {op["name"] for op in data["ops"]}
    for op in data["ops"]:
        for binding, factors in zip(op["inputs"], op["strategy"], strict=True):
            if binding is not None:
                assert len(factors) == len(data["tensors"][binding["tensor"]]["shape"])


def test_data_parallel_plan_is_schema_valid_and_round_trips(gpt_tiny: Path) -> None:
    result = plan(gpt_tiny, profile="a100-80g", devices=4, batch=8, dims={"seq": 16},
                  mode="data")
    data = result.to_json()
    _assert_valid_plan(data, {op.name for op in result.ops})
    assert data["parallel"]["dp"] == 4 and data["mesh"]["shape"] == [4]
    assert data["mesh"]["intra_node"] == [True]
    assert data["solver"]["name"] == "data-parallel" and data["solver"]["gap"] == 0
    again = Plan.from_json(json.loads(result.dumps()))
    assert again.to_json() == json.loads(result.dumps())


def test_data_parallel_splits_batch_and_syncs_every_parameter(gpt_tiny: Path) -> None:
    result = plan(gpt_tiny, profile="a100-80g", devices=4, batch=8, dims={"seq": 16},
                  mode="data")
    assert result.tensors["input_ids"].layout.dims[0] == ("dp",)
    assert result.tensors["logits"].layout.dims[0] == ("dp",)
    parameters = {name for name, t in result.tensors.items() if t.kind == "parameter"}
    synced = {c.tensor for c in result.collectives if c.phase == "gradient"}
    assert synced == parameters
    assert all(c.kind == "all_reduce" and c.axes == ("dp",) for c in result.collectives)
    for name in parameters:
        assert result.tensors[name].layout.is_replicated
    p = result.predicted
    assert p.step_time_s == pytest.approx(p.compute_s + p.communication_s)
    assert p.memory["peak"] == sum(p.memory[k] for k in
                                   ("parameters", "gradients", "optimizer", "activations",
                                    "workspace"))


def test_more_devices_cut_activation_memory_not_parameters(gpt_tiny: Path) -> None:
    two, four, eight = (plan(gpt_tiny, devices=n, batch=8, dims={"seq": 16},
                             mode="data").predicted.memory for n in (2, 4, 8))
    assert eight["parameters"] == two["parameters"]
    # Batch-split activations shrink as 1/devices; weight-derived ones (the tied head's
    # transposed table) stay: halving steps must halve the difference.
    assert two["activations"] > four["activations"] > eight["activations"]
    assert two["activations"] - four["activations"] == pytest.approx(
        2 * (four["activations"] - eight["activations"]), rel=0.01)


def test_indivisible_batch_is_refused(gpt_tiny: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["plan", str(gpt_tiny), "--devices", "8", "--batch", "6", "--dim", "seq=16",
                 "--mode", "data"])
    assert code == 2
    assert "batch 6 cannot be split into 8" in capsys.readouterr().err


def test_cli_writes_plan_and_prints_summary(gpt_tiny: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", str(gpt_tiny), "--profile", "h100-sxm", "--devices", "8", "--batch", "16",
                 "--dim", "seq=32", "-o", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "step time" in text and "communication" in text and "optimizer" in text
    _assert_valid_plan(json.loads(out.read_text()), set())


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "{missing}"], "no such file"),
        (["plan", "{text}", "--batch", "2"], "not a readable ONNX model"),
        (["plan", "{cut}", "--batch", "2"], "ONNX"),
        (["plan", "{model}"], "unbound symbolic dims"),
        (["plan", "{model}", "--batch", "8", "--dim", "seq=8", "--profile", "tpu-v9"],
         "unknown"),
        (["plan", "{model}", "--batch", "8", "--dim", "seq=8", "--profile", "{bad_profile}"],
         "bad.json"),
        (["plan", "{model}", "--batch", "24", "--dim", "seq=8", "--devices", "12"],
         "cannot form 12 devices"),
        (["plan", "{model}", "--batch", "8", "--dim", "seq"], "expected NAME=VALUE"),
        (["plan", "{model}", "--devices", "0"], "must be at least 1"),
        (["zoo", "gpt", "--layerz", "3", "-o", "{out}"], "unknown option '--layerz'"),
        (["zoo", "transformer-xxl", "-o", "{out}"], "unknown model family"),
        (["profiles", "show", "nope"], "unknown"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], needle: str, gpt_tiny: Path,
                                         tmp_path: Path) -> None:
    text = tmp_path / "text.onnx"
    text.write_text("hello\n")
    cut = tmp_path / "cut.onnx"
    whole = gpt_tiny.read_bytes()
    cut.write_bytes(whole[: len(whole) // 3])
    bad_profile = tmp_path / "bad.json"
    bad_profile.write_text('{"schema": "shardplan.hardware-profile/1", "name": 3}')
    values = {"missing": str(tmp_path / "absent.onnx"), "text": str(text), "cut": str(cut),
              "model": str(gpt_tiny), "bad_profile": str(bad_profile),
              "out": str(tmp_path / "x.onnx")}
    args = [a.format(**values) for a in argv]
    run = subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert needle in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_175b_gpt_on_1024_a100s_does_not_fit(tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    """The zoo's GPT-3 plans from its graph alone; pure DP needs far more than 80 GB."""
    path = tmp_path / "gpt3.onnx"
    assert main(["zoo", "gpt3-175b", "-o", str(path)]) == 0
    assert not list(tmp_path.glob("*.weights"))
    started = time.perf_counter()
    code = main(["plan", str(path), "--profile", "a100-80g", "--devices", "1024", "--batch",
                 "1024", "--dim", "seq=2048", "--mode", "data"])
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    assert code == 3
    for category in ("parameters", "gradients", "optimizer", "activations"):
        assert category in captured.err
    assert "needs" in captured.err and "per device" in captured.err
    assert elapsed < 120  # "in seconds" on this machine; generous for slow CI


def test_zoo_cli_builds_from_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "g.onnx"
    assert main(["zoo", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab",
                 "100", "-o", str(path)]) == 0
    assert "172.0 K parameters" in capsys.readouterr().out
    graph_plan = plan(path, devices=2, batch=2, dims={"seq": 8}, mode="data")
    assert graph_plan.model.parameters == zoo.parameter_count(
        "gpt", zoo.FAMILIES["gpt"](layers=2, hidden=64, heads=4, vocab=100))


def test_profiles_list(capsys: pytest.CaptureFixture) -> None:
    assert main(["profiles"]) == 0
    listed = capsys.readouterr().out
    for name in ("ascend-910a", "ascend-910b", "a100-40g", "a100-80g", "h100-sxm", "h200-sxm",
                 "cpu"):
        assert name in listed


def test_op_without_rule_is_kept_replicated_with_one_warning(tmp_path: Path) -> None:
    """LRN has no sharding rule: it stays in the plan, replicated, and is named once."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("LRN", ["a"], ["b"], name="lrn1", size=3),
             helper.make_node("LRN", ["b"], ["c"], name="lrn2", size=3),
             helper.make_node("Relu", ["c"], ["y"], name="relu_out")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "lrn.onnx"
    onnx.save(model, str(path))
    result = plan(path, devices=2, batch=4, mode="data")
    ops = {op.name: op for op in result.ops}
    assert set(ops) == {"relu", "lrn1", "lrn2", "relu_out"}
    assert ops["relu"].assignment == {"d0": ("dp",)}
    assert ops["lrn1"].assignment == {} and "no sharding rule" in ops["lrn1"].note
    assert [b.layout.is_replicated for b in ops["lrn1"].inputs] == [True]
    gathers = [c for c in result.collectives if c.kind == "all_gather"]
    assert [(c.tensor, c.phase) for c in gathers] == [("a", "forward")]
    lrn_warnings = [w for w in result.warnings if "LRN" in w]
    assert len(lrn_warnings) == 1 and lrn_warnings[0].startswith("2 op(s)")


def test_data_mode_refuses_pins_it_cannot_honour(gpt_tiny: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """`--mode data` is the plain data-parallel baseline: a pin it already satisfies is
    fine, any other is an error (it used to be dropped, planning zero=0 for zero=1)."""
    chosen = plan(gpt_tiny, devices=2, batch=4, dims={"seq": 8}, mode="data",
                  parallel={"dp": 2, "zero": 0, "recompute": "none"})
    assert chosen.parallel.zero == 0
    assert main(["plan", str(gpt_tiny), "--devices", "2", "--batch", "4", "--dim", "seq=8",
                 "--mode", "data", "--parallel", "zero=1"]) == 2
    assert "--parallel zero=1: --mode data plans the data-parallel baseline" in \
        capsys.readouterr().err
    assert main(["plan", str(gpt_tiny), "--devices", "2", "--batch", "4", "--dim", "seq=8",
                 "--mode", "data", "--mesh", "2"]) == 2


CONSOLE = """
import atexit, sys
atexit.register(lambda: print("exit handlers ran", file=sys.stderr))
from planner.cli import console
sys.argv = ["shardplan", *sys.argv[1:]]
console()
"""


@pytest.mark.parametrize("limit, code", [(None, 0), ("0.0001", 3)])
def test_the_console_script_ends_after_writing_everything(gpt_tiny: Path, tmp_path: Path,
                                                          limit: str | None,
                                                          code: int) -> None:
    """The console script ends the process without unwinding after a plan
    (`planner.cli.ending`): the plan file and the summary are whole and the exit handlers
    ran; where no plan fits, the process unwinds as before, with exit 3 and its message."""
    out = tmp_path / "plan.json"
    args = ["plan", str(gpt_tiny), "--batch", "8", "--dim", "seq=16", "--devices", "2",
            "-o", str(out), *(["--memory-limit", limit] if limit else [])]
    run = subprocess.run([sys.executable, "-c", CONSOLE, *args], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == code, run.stderr
    assert run.stderr.rstrip().endswith("exit handlers ran")
    if code == 3:
        assert "shardplan: error: no plan fits" in run.stderr and not out.exists()
        return
    assert Plan.load(out).to_json() == json.loads(out.read_text())
    assert run.stdout.endswith("\n") and "step time" in run.stdout
    assert run.stdout.rstrip().splitlines()[-1].lstrip().startswith("mesh ")  # the last row
