"""Issue 18, item 4: parsers are bounded and inputs checked, not trusted.

Plans, hardware profiles and `--strategies` files go through `planner.userfiles`: nesting,
integer size and YAML aliases are bounded, duplicate keys refused, decode errors name the
byte; each failure is one line naming the file and exit 2. Also: an exact op name in a
strategies file wins over any glob, whatever the order, and external data hidden in
`training_info` is refused like any other.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf.message import Message
from onnx import TensorProto, helper, numpy_helper

from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.importer import import_model
from planner.importer.load import _all_tensors
from planner.importer.prepare import inlined_nodes
from planner.plans.model import Plan
from planner.userfiles import MAX_DEPTH

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "hardware_profiles" / "a100-80g.json"


def _refused(argv: list[str], file: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The CLI exits 2 with exactly one error line, naming `file`; that line."""
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("shardplan: error:")]
    assert code == 2 and len(lines) == 1 and len(err.strip().splitlines()) == 1, err
    assert f"shardplan: error: {file}: " in lines[0], lines[0]
    assert len(lines[0]) < 600, lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, config = zoo.preset("seed-mlp")
    return zoo.save(zoo.build(family, config), tmp_path_factory.mktemp("m") / "seed.onnx")


@pytest.fixture(scope="module")
def plan_text(seed: Path) -> str:
    return plan(str(seed), devices=2, batch=32, mode="data").dumps()


def _semi(seed: Path, strategies: Path, *extra: str) -> list[str]:
    return ["plan", str(seed), "--devices", "2", "--batch", "32", "--mode", "semi",
            "--strategies", str(strategies), *extra]


# ================================================================ nesting

@pytest.mark.parametrize("verb", [["validate"], ["explain"], ["export", "--format", "dtensor"]],
                         ids=["validate", "explain", "export"])
@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, '{"a": ' * 5000 + "1" + "}" * 5000,
                                  "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)],
                         ids=["arrays", "objects", "one-past-the-bound"])
def test_deeply_nested_plans_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         verb: list[str], text: str) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text(text)
    line = _refused([*verb, str(deep)], deep, capsys)
    assert f"nested more than {MAX_DEPTH} levels deep" in line


def test_a_plan_nested_to_the_bound_is_not_refused_for_its_depth(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "deep.json"
    file.write_text("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    line = _refused(["validate", str(file)], file, capsys)
    assert "a plan is a JSON object" in line


@pytest.mark.parametrize(("name", "text"), [
    ("deep.json", "[" * 5000 + "]" * 5000),
    ("deep.yaml", "[" * 50_000 + "]" * 50_000),
    ("block.yaml", "".join(f"{'  ' * k}- \n" for k in range(200))),
])
def test_deeply_nested_strategies_are_refused(seed: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str], name: str,
                                              text: str) -> None:
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    file = tmp_path / name
    file.write_text(text)
    assert "nested more than" in _refused(_semi(seed, file), file, capsys)


# ================================================================ integers, duplicates

def test_a_plan_integer_of_5000_digits_is_refused(plan_text: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "plan.json"
    file.write_text(plan_text.replace('"schema"', f'"extra": {"9" * 5000}, "schema"', 1))
    line = _refused(["validate", str(file)], file, capsys)
    assert "an integer of 5000 digits (at most 1000)" in line


def test_a_profile_integer_of_5000_digits_is_refused(seed: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "profile.json"
    file.write_text(PROFILE.read_text().replace('"name"', f'"x": -{"1" * 5000}, "name"', 1))
    line = _refused(["plan", str(seed), "--batch", "32", "--profile", str(file)], file, capsys)
    assert "an integer of 5000 digits" in line


def test_a_plan_with_a_duplicate_key_is_refused(plan_text: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "plan.json"
    file.write_text(plan_text.rstrip().removesuffix("}") + ', "ops": []}')
    for verb in ("validate", "explain"):
        line = _refused([verb, str(file)], file, capsys)
        assert "the key 'ops' appears twice in one object" in line


def test_a_profile_with_a_duplicate_key_is_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "profile.json"
    file.write_text(PROFILE.read_text().replace('"name"', '"name": "x", "name"', 1))
    line = _refused(["profiles", "show", str(file)], file, capsys)
    assert "the key 'name' appears twice" in line


@pytest.mark.parametrize(("name", "text"), [
    ("pins.json", '{"matmul1": [[1, 1], [1, 2]], "matmul1": [[1, 1], [1, 1]]}'),
    ("pins.yaml", "matmul1: [[1, 1], [1, 2]]\nmatmul1: [[1, 1], [1, 1]]\n"),
])
def test_strategies_with_a_duplicate_key_are_refused(seed: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     name: str, text: str) -> None:
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    file = tmp_path / name
    file.write_text(text)
    assert "the key 'matmul1' appears twice" in _refused(_semi(seed, file), file, capsys)


# ================================================================ encodings

def test_latin1_bytes_are_named_by_offset_line_and_column(
        seed: Path, plan_text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "plan.json"
    bad.write_bytes(b'{\n  "schema": "caf\xe9"\n}\n')
    expected = "not UTF-8 text: byte 0xe9 at offset 18 (line 2, column 17)"
    assert expected in _refused(["validate", str(bad)], bad, capsys)
    assert expected in _refused(["profiles", "show", str(bad)], bad, capsys)
    assert expected in _refused(["plan", str(seed), "--batch", "32", "--profile", str(bad)],
                                bad, capsys)
    assert expected in _refused(_semi(seed, bad), bad, capsys)


# ================================================================ YAML

@pytest.fixture
def yaml_module() -> object:
    return pytest.importorskip("yaml")


def test_a_yaml_integer_key_is_refused(seed: Path, tmp_path: Path, yaml_module: object,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "pins.yaml"
    file.write_text("1: [[1, 1], [1, 2]]\n")
    assert "op name 1 must be a non-empty string" in _refused(_semi(seed, file), file, capsys)


def _billion_laughs() -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    return "\n".join([*lines, "matmul1: *i", ""])


@pytest.mark.parametrize(("text", "message"), [
    (_billion_laughs(), "expands to more than 1000000 values through its aliases"),
    ("x: &x [1, 2]\n" + "".join(f"k{k}: *x\n" for k in range(101)), "more than 100 aliases"),
    ("matmul1: &a [*a]\n", "an alias refers to a node that contains it"),
    ("matmul1: [[" + "1" * 5000 + "]]\n", "an integer of 5000 digits"),
    ("matmul1: [[1, 1]\n  oops: : [\n", "line 2, column 3"),
], ids=["billion-laughs", "many-aliases", "cycle", "big-int", "syntax"])
def test_hostile_yaml_gets_one_short_line(seed: Path, tmp_path: Path, yaml_module: object,
                                          capsys: pytest.CaptureFixture[str], text: str,
                                          message: str) -> None:
    file = tmp_path / "pins.yaml"
    file.write_text(text)
    started = time.perf_counter()
    line = _refused(_semi(seed, file), file, capsys)
    assert time.perf_counter() - started < 15
    assert "not valid YAML (line" in line and message in line


def test_a_shared_yaml_value_is_echoed_short(seed: Path, tmp_path: Path, yaml_module: object,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A value within the bounds but wrong is shown cut short, not printed whole."""
    file = tmp_path / "pins.yaml"
    file.write_text("a: &a [" + ", ".join(["-1"] * 1000) + "]\nb: &b [" +
                    ", ".join(["*a"] * 90) + "]\nstrategies:\n  matmul1: *b\n")
    line = _refused(_semi(seed, file), file, capsys)
    assert "strategy of 'matmul1' must be a list of lists of positive integers" in line
    assert line.endswith("...]") or line.endswith("...")


def test_yaml_anchors_within_the_bounds_still_load(seed: Path, tmp_path: Path,
                                                   yaml_module: object,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "pins.yaml"
    file.write_text("matmul1: &tp [[1, 1], [1, 2]]\nmatmul2: [[1, 2], [2, 1]]\nrelu: *tp\n")
    out = tmp_path / "plan.json"
    code = main(_semi(seed, file, "-o", str(out)))
    err = capsys.readouterr().err
    # relu has one input: the anchor's two tuples do not fit it, and that is what is said
    assert code == 2 and "relu" in err and len(err.strip().splitlines()) == 1, err
    file.write_text("base: &tp [[1, 1], [1, 2]]\nstrategies:\n  matmul1: *tp\n")
    assert main(_semi(seed, file, "-o", str(out))) == 0
    assert _strategy(out, "matmul1") == [[1, 1], [1, 2]]


# ================================================================ exact names and globs

def _strategy(plan_file: Path, op: str) -> list[list[int]]:
    entry = next(o for o in json.loads(plan_file.read_text())["ops"] if o["name"] == op)
    return entry["strategy"]


EXACT, GLOB = [[1, 1], [1, 2]], [[2, 1], [1, 1]]


@pytest.mark.parametrize("order", ["exact-first", "glob-first"])
def test_an_exact_op_name_wins_over_a_glob_in_either_order(
        seed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], order: str) -> None:
    entries = [("matmul1", EXACT), ("matmul*", GLOB)]
    if order == "glob-first":
        entries.reverse()
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps(dict(entries)))
    out = tmp_path / "plan.json"
    assert main(_semi(seed, pins, "-o", str(out))) == 0, capsys.readouterr().err
    assert _strategy(out, "matmul1") == EXACT
    assert _strategy(out, "matmul2") == GLOB
    assert Plan.load(out).model.sha256  # the plan written loads back


def test_two_globs_at_odds_over_one_op_are_refused_naming_both(
        seed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps({"matmul*": GLOB, "*1": EXACT}))
    code = main(_semi(seed, pins))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "op matmul1 is matched by the strategy patterns 'matmul*' and '*1'" in err
    pins.write_text(json.dumps({"matmul*": GLOB, "*1": EXACT, "matmul1": EXACT}))
    assert main(_semi(seed, pins)) == 0, capsys.readouterr().err


# ================================================================ training_info

def _mlp_with_training_info(location: str) -> onnx.ModelProto:
    family, config = zoo.preset("seed-mlp")
    model = zoo.build(family, config)
    value = numpy_helper.from_array(np.zeros((2,), np.float32), "lr")
    value.ClearField("raw_data")
    value.data_location = TensorProto.EXTERNAL
    value.external_data.add(key="location", value=location)
    init = helper.make_graph([], "init", [], [], initializer=[value])
    model.training_info.add(initialization=init, algorithm=helper.make_graph([], "algo", [], []))
    return model


def test_external_data_hidden_in_training_info_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.bin").write_bytes(b"secret")
    folder = tmp_path / "model"
    folder.mkdir()
    file = folder / "model.onnx"
    file.write_bytes(_mlp_with_training_info("../outside/secret.bin").SerializeToString())
    line = _refused(["plan", str(file), "--devices", "2", "--batch", "32"], file, capsys)
    assert "tensor lr keeps its data at location '../outside/secret.bin'" in line


def _name_every_tensor(root: Message) -> list[str]:
    """Give every TensorProto anywhere in the message tree, found by the descriptors, a
    name of its own; those names."""
    found: list[str] = []
    stack = [root]
    while stack:
        message = stack.pop()
        if isinstance(message, TensorProto):
            message.name = f"tensor{len(found)}"
            found.append(message.name)
        for descriptor, value in message.ListFields():
            if descriptor.type == descriptor.TYPE_MESSAGE:
                stack.extend([value] if isinstance(value, Message) else value)
    return found


def test_the_external_data_check_sees_every_tensor_of_the_model() -> None:
    """Whatever field holds a tensor (a graph's, an attribute's, a function's, a
    subgraph's, training_info's), the check's walk visits it."""
    model = _mlp_with_training_info("w.bin")
    tensor = numpy_helper.from_array(np.zeros((2,), np.float32), "t")
    sparse = helper.make_sparse_tensor(tensor, numpy_helper.from_array(
        np.array([0], np.int64), "i"), [4])
    branch = helper.make_graph([helper.make_node("Constant", [], ["b"], value=tensor)], "b",
                               [], [], initializer=[tensor], sparse_initializer=[sparse])
    node = helper.make_node("If", ["c"], ["o"], then_branch=branch, else_branch=branch)
    node.attribute.append(helper.make_attribute("ts", [tensor, tensor]))
    node.attribute.append(helper.make_attribute("sp", sparse))
    node.attribute.append(helper.make_attribute("sps", [sparse]))
    model.graph.node.append(node)
    model.graph.sparse_initializer.append(sparse)
    model.functions.append(helper.make_function("f", "F", [], [], [node], []))
    model.training_info[0].algorithm.node.append(node)
    everywhere = _name_every_tensor(model)
    assert len(everywhere) > 20
    assert sorted(t.name for t in _all_tensors(model)) == sorted(everywhere)


def _nested_functions(depth: int, calls: int = 2, in_branch: bool = False) -> onnx.ModelProto:
    """`f0` a Relu; each `f{k}` calls `f{k-1}` `calls` times; the graph calls the deepest
    (from an If's branch when `in_branch`): calls**depth Relus once inlined."""
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    functions = [helper.make_function("local", "f0", ["x"], ["y"],
                                      [helper.make_node("Relu", ["x"], ["y"])], opsets)]
    for k in range(1, depth + 1):
        body = [helper.make_node(f"f{k - 1}", ["x"], [f"h{c}"], domain="local")
                for c in range(calls - 1)]
        body.append(helper.make_node(f"f{k - 1}", ["x"], ["y"], domain="local"))
        functions.append(helper.make_function("local", f"f{k}", ["x"], ["y"], body, opsets))
    call = helper.make_node(f"f{depth}", ["x"], ["y"], domain="local")
    value = helper.make_tensor_value_info
    if in_branch:
        branch = helper.make_graph([call], "branch", [], [value("y", TensorProto.FLOAT, None)])
        call = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)
    graph = helper.make_graph([call], "nested", [value("x", TensorProto.FLOAT, ["batch", 16]),
                                                 value("c", TensorProto.BOOL, [])],
                              [value("y", TensorProto.FLOAT, ["batch", 16])])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8, functions=functions)


@pytest.mark.parametrize("in_branch", [False, True])
def test_local_functions_that_expand_past_the_bound_are_refused_before_inlining(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], in_branch: bool) -> None:
    """A 3 KB file whose functions each call the one below twice, forty deep, is 2^40
    nodes once inlined: ONNX's inliner ran until memory ran out (9 GB in 2 minutes). The
    expansion is counted first, per function once, and refused naming the function."""
    path = tmp_path / "nested.onnx"
    onnx.save(_nested_functions(40, in_branch=in_branch), path)
    assert main(["plan", str(path), "--devices", "2", "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "local function local.f20 expands to 1,048,576 nodes once inlined, more than " \
           "shardplan plans (1,000,000)" in err


def test_a_local_function_calling_itself_is_refused_naming_the_cycle(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _nested_functions(2)
    model.functions[0].node[0].CopyFrom(helper.make_node("f2", ["x"], ["y"], domain="local"))
    path = tmp_path / "cycle.onnx"
    onnx.save(model, path)
    assert main(["plan", str(path), "--devices", "2", "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "local function local.f2 calls itself (local.f2 -> local.f1 -> local.f0 -> " \
           "local.f2)" in err, err


def test_local_functions_within_the_bound_are_counted_and_inlined(tmp_path: Path) -> None:
    """Three calls a level, eight deep: 3^8 = 6,561 Relus counted; the import inlines them
    (and drops the calls whose outputs nothing reads: one Relu is left)."""
    model = _nested_functions(8, calls=3)
    assert inlined_nodes(model, "nested.onnx") == 3 ** 8
    path = tmp_path / "nested.onnx"
    onnx.save(model, path)
    graph = import_model(path, batch=8)
    assert [node.op_type for node in graph.ops] == ["Relu"]


def test_a_model_of_thousands_of_unbound_dims_is_named_in_a_short_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """2,000 inputs with a symbol each: the error named every one (100 KB on one line);
    now the first eight and how many more."""
    value = helper.make_tensor_value_info
    inputs = [value(f"x{i}", TensorProto.FLOAT, [f"s{i}", 16]) for i in range(2000)]
    outputs = [value(f"y{i}", TensorProto.FLOAT, [f"s{i}", 16]) for i in range(2000)]
    nodes = [helper.make_node("Relu", [f"x{i}"], [f"y{i}"]) for i in range(2000)]
    path = tmp_path / "dims.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "dims", inputs, outputs),
                                opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    assert main(["plan", str(path), "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 1000, len(err)
    assert "s7 (input x7 dim 0; bind with --dim s7=N); and 1992 more" in err
    small = tmp_path / "small.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes[:1], "small", inputs[:1], outputs[:1]),
                                opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              small)
    extra = [f"--dim=zz{i}=2" for i in range(300)]
    assert main(["plan", str(small), "--devices", "2", "--batch", "8", *extra]) == 2
    err = capsys.readouterr().err
    assert "--dim names no input dim: zz0, zz1, " in err and len(err) < 1000, err
