"""What a memory-bound op's backward pass moves, against torch's own backward kernels.

`planner.ops.saving.backward_kernels` prices one unfused op's backward kernels from its rule
(the gradients of its outputs read, of its float inputs written, what it kept read; an
addition's terms get the output's gradient itself). Each case here builds the op with
onnx.helper behind parameters (so that a gradient flows to its inputs), and counts, op by
op, the bytes torch's backward kernels of the same op read and write
(`torch.autograd.grad`, views not counted). `planner.cost.kernels` turns the bytes into the
op's backward multiple, and a fused region into one kernel's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from costmodels.profile import load_profile
from planner.cost.kernels import KernelPolicy, kernel_plan
from planner.cost.pricing import op_times
from planner.importer import import_model
from planner.kinds import AttentionKernel, Fusion
from planner.ops import record_for
from planner.ops.saving import backward_kernels
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.mesh import DeviceMesh
from tests.traffic import NoViews

ROWS, WIDTH = 64, 1024


def _torch_backward(fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]]) -> int:
    """Bytes the backward kernels of `fn` move for inputs of `shapes` (all needing a
    gradient) and a random output gradient."""
    inputs = [torch.randn(shape, requires_grad=True) for shape in shapes]
    out = fn(*inputs)
    grad = torch.randn_like(out)
    counter = NoViews(least=ROWS)
    with counter:
        torch.autograd.grad(out, inputs, grad)
    return counter.bytes


def _analysis(path: Path, nodes: list, inits: list,
              outputs: tuple[str, ...] = ("y",)) -> GraphAnalysis:
    """The graph of `nodes` on an input `x` [ROWS, WIDTH], saved to `path` and imported."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])
    outs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], outs, inits),
                                opset_imports=[helper.make_opsetid("", 20)]), path)
    return GraphAnalysis.of(import_model(path))


def _op_backward(analysis: GraphAnalysis) -> tuple[float, int]:
    """`backward_kernels` (bytes, kernels) of the op named "op", by its record's rule."""
    node = analysis.graph.op("op")
    record = record_for(node.op_type, node.domain)
    assert record is not None
    return backward_kernels(node, record.saves, analysis.graph.tensors, analysis.needs_grad)


def _planned(tmp_path: Path, op: str, shapes: list[tuple[int, ...]],
             **attributes: object) -> tuple[float, GraphAnalysis]:
    """`backward_kernels`' bytes of one ONNX `op` whose inputs are computed from
    parameters."""
    nodes, inits, names = [], [], []
    for k, shape in enumerate(shapes):
        weight = helper.make_tensor(f"p{k}", TensorProto.FLOAT, list(shape),
                                    [0.5] * int(torch.Size(shape).numel()))
        inits.append(weight)
        if shape == (ROWS, WIDTH):  # an activation: the input times a weight
            nodes.append(helper.make_node("Mul", ["x", f"p{k}"], [f"t{k}"], name=f"make{k}"))
            names.append(f"t{k}")
        else:  # a small weight read as it is (a bias, a norm's scale)
            names.append(f"p{k}")
    nodes.append(helper.make_node(op, names, ["y"], name="op", **attributes))
    analysis = _analysis(tmp_path / f"{op}.onnx", nodes, inits)
    moved, _ = _op_backward(analysis)
    return moved, analysis


FULL = (ROWS, WIDTH)


@pytest.mark.parametrize("op,fn,shapes,attributes", [
    ("Gelu", F.gelu, [FULL], {}),
    ("Relu", F.relu, [FULL], {}),
    ("Tanh", torch.tanh, [FULL], {}),
    ("Sigmoid", torch.sigmoid, [FULL], {}),
    ("Exp", torch.exp, [FULL], {}),
    ("Softmax", lambda t: torch.softmax(t, -1), [FULL], {"axis": -1}),
    ("Mul", torch.mul, [FULL, FULL], {}),
    ("Add", torch.add, [FULL, FULL], {}),
    ("Add", torch.add, [FULL, (WIDTH,)], {}),
    ("Sub", torch.sub, [FULL, FULL], {}),
    ("Sqrt", torch.sqrt, [FULL], {}),
    ("Reciprocal", torch.reciprocal, [FULL], {}),
    ("Erf", torch.erf, [FULL], {}),
    ("Sin", torch.sin, [FULL], {}),
    ("Cos", torch.cos, [FULL], {}),
    ("Div", torch.div, [FULL, FULL], {}),
], ids=["gelu", "relu", "tanh", "sigmoid", "exp", "softmax", "mul", "residual-add",
        "bias-add", "sub", "sqrt", "reciprocal", "erf", "sin", "cos", "div"])
def test_an_ops_backward_moves_what_torchs_kernels_move(tmp_path: Path, op: str,
                                                        fn: Callable[..., torch.Tensor],
                                                        shapes: list[tuple[int, ...]],
                                                        attributes: dict) -> None:
    planned, _ = _planned(tmp_path, op, shapes, **attributes)
    assert planned == _torch_backward(fn, shapes)


def test_a_layer_norms_backward_reads_its_input_and_statistics(tmp_path: Path) -> None:
    """LayerNorm's backward reads the output's gradient, its input and the fp32 mean and
    inverse std per row, and writes the gradients of its input, scale and bias; torch's
    kernel also reads the scale (one row's worth), which the rule leaves out."""
    planned, _ = _planned(tmp_path, "LayerNormalization", [FULL, (WIDTH,), (WIDTH,)], axis=-1)
    counted = _torch_backward(lambda t, w, b: F.layer_norm(t, (WIDTH,), w, b),
                              [FULL, (WIDTH,), (WIDTH,)])
    assert planned == pytest.approx(counted, rel=0.02)
    assert planned < counted


def test_the_backward_multiple_of_unfused_and_fused_kernels(tmp_path: Path) -> None:
    """The kernels take the multiple from the bytes: a GELU 1.5x its forward; a bias add
    then a GELU fused into one kernel reads the GELU's gradient and the bias add's inputs
    (kept in place of what only the region reads) and writes their gradients."""
    _, analysis = _planned(tmp_path, "Gelu", [FULL])
    plan = kernel_plan(analysis, KernelPolicy(AttentionKernel.EAGER, Fusion.NONE))
    gelu = plan.ops["op"]
    assert gelu.backward_bytes == pytest.approx(1.5 * gelu.bytes)
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [WIDTH, WIDTH], [0.1] * WIDTH * WIDTH),
             helper.make_tensor("b", TensorProto.FLOAT, [WIDTH], [0.1] * WIDTH)]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="gemm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="bias"),
             helper.make_node("Gelu", ["a"], ["g"], name="gelu"),
             helper.make_node("MatMul", ["g", "w"], ["y"], name="gemm2")]
    analysis = _analysis(tmp_path / "bias_gelu.onnx", nodes, inits)
    fused = kernel_plan(analysis, KernelPolicy(AttentionKernel.EAGER, Fusion.ELEMENTWISE))
    assert ("bias", "gelu") in fused.regions
    region_forward = fused.ops["bias"].bytes + fused.ops["gelu"].bytes
    whole = ROWS * WIDTH * 4
    assert region_forward == pytest.approx(2 * whole + WIDTH * 4)  # m and b in, g out
    backward = fused.ops["bias"].backward_bytes + fused.ops["gelu"].backward_bytes
    # read: dg, m and b (kept); written: dm, db
    assert backward == pytest.approx(3 * whole + 2 * WIDTH * 4)
    bias, gelu = fused.ops["bias"], fused.ops["gelu"]
    assert bias.backward_bytes / bias.bytes == pytest.approx(gelu.backward_bytes / gelu.bytes)


def test_a_tensor_read_by_several_kernels_pays_the_sum_of_its_gradients(
        tmp_path: Path) -> None:
    """Autograd adds the gradients a tensor gets from several consumers (r 2, w 1 per
    extra term): priced with its producer's backward."""
    inits = [helper.make_tensor("p", TensorProto.FLOAT, [ROWS, WIDTH], [0.5] * ROWS * WIDTH)]
    nodes = [helper.make_node("Mul", ["x", "p"], ["t"], name="make"),
             helper.make_node("Gelu", ["t"], ["g"], name="gelu"),
             helper.make_node("Tanh", ["g"], ["a"], name="a"),
             helper.make_node("Sigmoid", ["g"], ["b"], name="b"),
             helper.make_node("Exp", ["g"], ["c"], name="c")]
    analysis = _analysis(tmp_path / "fan_out.onnx", nodes, inits, outputs=("a", "b", "c"))
    plan = kernel_plan(analysis, KernelPolicy(AttentionKernel.EAGER, Fusion.NONE))
    whole = ROWS * WIDTH * 4
    gelu = plan.ops["gelu"]
    assert gelu.backward_bytes == pytest.approx(3 * whole + 2 * 3 * whole)


@pytest.mark.parametrize("op,shapes,launches", [
    ("Add", [FULL, FULL], 0), ("Add", [FULL, (WIDTH,)], 1), ("Mul", [FULL, FULL], 2),
    ("Gelu", [FULL], 1)], ids=["residual-add", "bias-add", "mul", "gelu"])
def test_a_backward_pays_a_launch_per_kernel_it_runs(tmp_path: Path, op: str,
                                                     shapes: list[tuple[int, ...]],
                                                     launches: int) -> None:
    """A tiny op's backward is its kernels' launch floors, not a multiple of the
    forward's: a residual addition runs none (its backward costs nothing), a bias
    addition one reduction, a product one kernel per operand."""
    _, analysis = _planned(tmp_path, op, shapes)
    plan = kernel_plan(analysis, KernelPolicy(AttentionKernel.EAGER, Fusion.NONE))
    assert plan.ops["op"].backward_launches == launches
    profile = load_profile("a100-80g")
    node = analysis.graph.op("op")
    tiny = 1e-6  # a millionth of the op: every kernel at its launch floor
    _, backward = op_times(node, plan, analysis.graph.tensors, [None] * len(node.inputs),
                           tiny, DeviceMesh((1,), ("a0",), 8), profile, None, True, True)
    assert backward == pytest.approx(launches * profile.kernel_launch_s.value)


def test_a_power_runs_its_derivative_formulas_kernels(tmp_path: Path) -> None:
    """Pow by a constant exponent (an RMSNorm's square): eager torch's `pow_backward` is
    three kernels and seven passes; a fused region would run it in one."""
    inits = [helper.make_tensor("p", TensorProto.FLOAT, [ROWS, WIDTH], [0.5] * ROWS * WIDTH),
             helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    nodes = [helper.make_node("Mul", ["x", "p"], ["t"], name="make"),
             helper.make_node("Pow", ["t", "two"], ["y"], name="op")]
    moved, launches = _op_backward(_analysis(tmp_path / "pow.onnx", nodes, inits))
    assert (moved, launches) == (_torch_backward(lambda t: t.pow(2), [FULL]), 3)


def test_a_where_runs_one_kernel_per_branch(tmp_path: Path) -> None:
    """Where with both branches needing a gradient: torch masks the output's gradient
    once per branch, each kernel reading it and the condition."""
    inits = [helper.make_tensor(f"p{k}", TensorProto.FLOAT, [ROWS, WIDTH],
                                [0.5] * ROWS * WIDTH) for k in range(2)]
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    nodes = [helper.make_node("Mul", ["x", "p0"], ["a"], name="make0"),
             helper.make_node("Mul", ["x", "p1"], ["b"], name="make1"),
             helper.make_node("Greater", ["a", "zero"], ["c"], name="cond"),
             helper.make_node("Where", ["c", "a", "b"], ["y"], name="op")]
    moved, launches = _op_backward(_analysis(tmp_path / "where.onnx", nodes, [*inits, zero]))

    def where(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a, b)

    assert (moved, launches) == (_torch_backward(where, [FULL, FULL]), 2)


def test_a_gradient_flows_through_the_ops_downstream_of_a_weight(tmp_path: Path) -> None:
    """`GraphAnalysis.differentiated`: an op on the input alone passes no gradient back,
    the GEMM reading a weight and everything after it do; with no op differentiated a
    plan prices no backward (the same ops, read once by every pricer)."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [WIDTH, WIDTH], [0.0] * WIDTH * WIDTH)
    analysis = _analysis(tmp_path / "g.onnx", [
        helper.make_node("Relu", ["x"], ["r"], name="before"),
        helper.make_node("MatMul", ["r", "w"], ["m"], name="gemm"),
        helper.make_node("Tanh", ["m"], ["y"], name="after"),
    ], [w])
    assert analysis.differentiated == {"gemm", "after"}
    kernels = kernel_plan(analysis, KernelPolicy(AttentionKernel.EAGER, Fusion.NONE))
    assert kernels.ops["before"].backward_launches == 0
    assert kernels.ops["after"].backward_launches == 1
