"""Fuzz cases for shardplan's user entry points, generated deterministically from a seed.

A case is one input a user could hand shardplan (an ONNX file, a hardware profile or a
plan JSON; mostly broken, some valid), the command line they would run on it, and what
must not happen (`expect`: a certainly-bad input must not plan, a valid one must). Case
`i` of seed `s` depends on `(s, i)` alone, so any failure is replayed with
`python bench/fuzz.py --seed s --only i`. The class of case `i` is `CLASSES[i % n]`, so a
corpus of any size covers every class about equally. tests/fuzz_runner.py runs them.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    """One input and the command run on it; `{dir}` in argv is the case's folder."""

    files: dict[str, bytes]
    argv: list[str]
    names: tuple[str, ...]  # an exit-2 message must contain one of these (file or field)
    expect: str = "any"  # any | reject (exit 0 would be wrong) | accept (must exit 0)
    links: dict[str, str] = field(default_factory=dict)  # name -> target; {out} is outside
    check_plan: bool = False  # also load plan.json and match it to model.onnx (executor)
    note: str = ""
    index: int = -1
    cls: str = ""


# =========================================================================== base inputs

ZOO_BASES = ("seed-mlp", "gpt-tiny", "bert-tiny", "llama-tiny", "resnet-tiny", "moe-tiny")


def _value(name: str, elem: int, shape: list[Any] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _weight(name: str, shape: tuple[int, ...], seed: int = 0) -> TensorProto:
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return numpy_helper.from_array(data, name)


def _ints(name: str, values: list[int]) -> TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _model(graph: onnx.GraphProto, **kwargs: Any) -> onnx.ModelProto:
    opsets = [helper.make_opsetid("", 17), *kwargs.pop("extra_opsets", [])]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8, **kwargs)


def _helper_mlp() -> onnx.ModelProto:
    """Gemm → Relu → MatMul → Softmax with inline weights and full value_info."""
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="act"),
             helper.make_node("MatMul", ["r", "w2"], ["z"], name="fc2"),
             helper.make_node("Softmax", ["z"], ["y"], name="softmax", axis=-1)]
    graph = helper.make_graph(
        nodes, "mlp", [_value("x", TensorProto.FLOAT, ["batch", 16])],
        [_value("y", TensorProto.FLOAT, ["batch", 8])],
        [_weight("w1", (16, 32)), _weight("b1", (32,), 1), _weight("w2", (32, 8), 2)],
        value_info=[_value("h", TensorProto.FLOAT, ["batch", 32]),
                    _value("r", TensorProto.FLOAT, ["batch", 32]),
                    _value("z", TensorProto.FLOAT, ["batch", 8])])
    return _model(graph)


def _helper_reshape() -> onnx.ModelProto:
    """An exporter's shape chain: Shape → Gather → Mul → Concat → Reshape, then MatMul."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "i0"], ["b"], name="g0", axis=0),
             helper.make_node("Gather", ["s", "i1"], ["q"], name="g1", axis=0),
             helper.make_node("Mul", ["b", "q"], ["bq"], name="mul"),
             helper.make_node("Unsqueeze", ["bq", "axes0"], ["bq1"], name="unsq"),
             helper.make_node("Concat", ["bq1", "c8"], ["target"], name="concat", axis=0),
             helper.make_node("Reshape", ["x", "target"], ["flat"], name="reshape"),
             helper.make_node("MatMul", ["flat", "w"], ["m"], name="proj"),
             helper.make_node("Add", ["m", "bias"], ["y"], name="bias_add")]
    inits = [numpy_helper.from_array(np.array(0, dtype=np.int64), "i0"),
             numpy_helper.from_array(np.array(1, dtype=np.int64), "i1"),
             _ints("axes0", [0]), _ints("c8", [8]), _weight("w", (8, 8)),
             _weight("bias", (8,), 3)]
    graph = helper.make_graph(nodes, "reshape", [_value("x", TensorProto.FLOAT,
                                                        ["batch", "seq", 8])],
                              [_value("y", TensorProto.FLOAT, None)], inits)
    return _model(graph)


def _helper_function() -> onnx.ModelProto:
    """A dynamo-style local function (domain `local`) between two MatMuls."""
    body = [helper.make_node("Constant", [], ["half"], value_float=0.5),
            helper.make_node("Mul", ["X", "half"], ["m"]),
            helper.make_node("Tanh", ["m"], ["t"]),
            helper.make_node("Add", ["t", "X"], ["Y"])]
    function = helper.make_function("local", "LocalAct", ["X"], ["Y"], body,
                                    [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("LocalAct", ["h"], ["a"], name="act", domain="local"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "function", [_value("x", TensorProto.FLOAT, ["batch", 16])],
                              [_value("y", TensorProto.FLOAT, ["batch", 4])],
                              [_weight("w1", (16, 16)), _weight("w2", (16, 4), 1)])
    return _model(graph, functions=[function], extra_opsets=[helper.make_opsetid("local", 1)])


def _helper_conv() -> onnx.ModelProto:
    """Conv → Relu → GlobalAveragePool → Flatten → Gemm: an image classifier in miniature."""
    nodes = [helper.make_node("Conv", ["x", "k"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "w"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "conv", [_value("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                              [_value("y", TensorProto.FLOAT, ["batch", 5])],
                              [_weight("k", (4, 3, 3, 3)), _weight("w", (4, 5), 1)])
    return _model(graph)


HELPER_BASES: dict[str, Callable[[], onnx.ModelProto]] = {
    "helper-mlp": _helper_mlp, "helper-reshape": _helper_reshape,
    "helper-function": _helper_function, "helper-conv": _helper_conv,
}
BASES = (*ZOO_BASES, *HELPER_BASES)


@cache
def base_bytes(name: str) -> bytes:
    """The serialized base model (zoo models keep their weights as absent external data)."""
    if name in HELPER_BASES:
        return HELPER_BASES[name]().SerializeToString()
    from planner import zoo

    return zoo.build(name).SerializeToString()


def base_model(name: str) -> onnx.ModelProto:
    """A fresh, mutable copy of a base model."""
    return onnx.load_model_from_string(base_bytes(name))


@cache
def base_plan(name: str, devices: int) -> bytes:
    """A valid plan JSON of a base model, planned from a file named model.onnx."""
    from planner.api import plan

    with tempfile.TemporaryDirectory(prefix="shardplan-fuzz-base-") as folder:
        path = Path(folder) / "model.onnx"
        path.write_bytes(base_bytes(name))
        args, dims = bind_args(base_bytes(name))
        batch = 8 if "--batch" in args else None  # divisible: the batch is split
        result = plan(path, devices=devices, batch=batch, dims=dims, time_limit=10.0)
        return result.dumps().encode()


def bind_args(data: bytes) -> tuple[list[str], dict[str, int]]:
    """`--batch`/`--dim` flags binding every symbolic input dim of the (mutated) model."""
    try:
        model = onnx.load_model_from_string(data)
    except Exception:
        return ["--batch", "2"], {}
    initializers = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers]
    symbols: list[str] = []
    for value in inputs:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param and dim.dim_param not in symbols:
                symbols.append(dim.dim_param)
    batch = None
    if inputs and inputs[0].type.tensor_type.shape.dim:
        batch = inputs[0].type.tensor_type.shape.dim[0].dim_param or None
    args = ["--batch", "2"] if batch else []
    dims = {s: 4 for s in symbols if s != batch and "=" not in s}
    for symbol in dims:
        args.append(f"--dim={symbol}=4")
    return args, dims


# =========================================================================== case classes

CaseMaker = Callable[[random.Random], Case]
CLASSES: dict[str, CaseMaker] = {}


def case_class(name: str) -> Callable[[CaseMaker], CaseMaker]:
    def register(maker: CaseMaker) -> CaseMaker:
        CLASSES[name] = maker
        return maker

    return register


def generate(seed: int, index: int) -> Case:
    """Case `index` of the corpus of `seed`: the same on every run and machine."""
    rng = random.Random(f"shardplan-fuzz/{seed}/{index}")
    names = list(CLASSES)
    cls = names[index % len(names)]
    case = CLASSES[cls](rng)
    case.index, case.cls = index, cls
    return case


def onnx_case(model: onnx.ModelProto | bytes, note: str, expect: str = "any",
              files: dict[str, bytes] | None = None, links: dict[str, str] | None = None,
              devices: int = 2) -> Case:
    """`shardplan plan model.onnx` with the dims bound, writing the plan to out.json."""
    data = model if isinstance(model, bytes) else model.SerializeToString()
    args, _ = bind_args(data)
    argv = ["plan", "{dir}/model.onnx", "--devices", str(devices), *args, "--time-limit", "10",
            "-o", "{dir}/out.json"]
    return Case({"model.onnx": data, **(files or {})}, argv, ("model.onnx",), expect,
                links or {}, note=note)


def _pick_base(rng: random.Random, bases: tuple[str, ...] = BASES) -> tuple[str, onnx.ModelProto]:
    name = rng.choice(bases)
    return name, base_model(name)


# --------------------------------------------------------------------------- ONNX bytes


@case_class("onnx/valid")
def _onnx_valid(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    return onnx_case(model, f"{name} unchanged", expect="accept")


@case_class("onnx/truncate")
def _onnx_truncate(rng: random.Random) -> Case:
    name = rng.choice(BASES)
    data = base_bytes(name)
    cut = rng.choice([0, 1, 2, rng.randrange(len(data)), len(data) - 1])
    return onnx_case(data[:cut], f"{name} cut at byte {cut} of {len(data)}")


@case_class("onnx/bitflip")
def _onnx_bitflip(rng: random.Random) -> Case:
    name = rng.choice(BASES)
    data = bytearray(base_bytes(name))
    flips = rng.choice([1, 1, 2, 4, 16])
    for _ in range(flips):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return onnx_case(bytes(data), f"{name} with {flips} bits flipped")


@case_class("onnx/splice")
def _onnx_splice(rng: random.Random) -> Case:
    name = rng.choice(BASES)
    data = bytearray(base_bytes(name))
    start = rng.randrange(len(data))
    span = rng.randrange(1, 64)
    how = rng.choice(["random", "duplicate", "zero", "text"])
    if how == "random":
        data[start:start + span] = rng.randbytes(span)
    elif how == "duplicate":
        data[start:start] = data[start:start + span]
    elif how == "zero":
        data[start:start + span] = bytes(span)
    else:
        data = bytearray(b"not an onnx file\n" * rng.randrange(1, 4))
    return onnx_case(bytes(data), f"{name}: {how} bytes at {start} (+{span})")


# --------------------------------------------------------------------------- ONNX protos

ODD_ELEM_TYPES = (0, TensorProto.STRING, TensorProto.COMPLEX64, TensorProto.COMPLEX128,
                  TensorProto.FLOAT8E4M3FN, TensorProto.INT4, TensorProto.UINT4,
                  TensorProto.BOOL, TensorProto.INT8, TensorProto.DOUBLE, TensorProto.FLOAT16,
                  TensorProto.INT64, 31, 999, -3)
ODD_DIMS = (-1, -7, 0, 1, 3, 1 << 31, 1 << 40, 1 << 62, (1 << 63) - 1)


def _value_infos(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    graph = model.graph
    return [*graph.input, *graph.output, *graph.value_info]


@case_class("onnx/dtype")
def _onnx_dtype(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    elem = rng.choice(ODD_ELEM_TYPES)
    target = rng.choice(["input", "initializer", "output", "cast"])
    graph = model.graph
    if target == "initializer" and graph.initializer:
        tensor = rng.choice(graph.initializer)
        tensor.data_type = elem
        return onnx_case(model, f"{name}: initializer {tensor.name} dtype {elem}")
    if target == "cast":
        for node in graph.node:
            for attr in node.attribute:
                if attr.name == "to":
                    attr.i = elem
                    return onnx_case(model, f"{name}: {node.name} casts to {elem}")
    values = list(graph.output) if target == "output" else list(graph.input)
    value = rng.choice(values)
    value.type.tensor_type.elem_type = elem
    return onnx_case(model, f"{name}: {target} {value.name} dtype {elem}")


@case_class("onnx/dims")
def _onnx_dims(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    size = rng.choice(ODD_DIMS)
    graph = model.graph
    if rng.random() < 0.4 and graph.initializer:
        tensor = rng.choice(graph.initializer)
        if tensor.dims:
            axis = rng.randrange(len(tensor.dims))
            tensor.dims[axis] = size
        else:
            tensor.dims.append(size)
        return onnx_case(model, f"{name}: initializer {tensor.name} dims {list(tensor.dims)}")
    value = rng.choice(_value_infos(model))
    dims = value.type.tensor_type.shape.dim
    if not dims:
        dims.add()
    dim = dims[rng.randrange(len(dims))]
    dim.Clear()
    dim.dim_value = size
    return onnx_case(model, f"{name}: {value.name} dim set to {size}")


@case_class("onnx/cycle")
def _onnx_cycle(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    nodes = model.graph.node
    consumers = [i for i, n in enumerate(nodes) if any(n.input)]
    i = rng.choice(consumers)
    # only a node that depends on node i closes a cycle (another later node is mere disorder)
    reached, frontier = {i}, set(nodes[i].output)
    for j in range(i + 1, len(nodes)):
        if frontier.intersection(nodes[j].input):
            reached.add(j)
            frontier.update(nodes[j].output)
    later = [j for j in sorted(reached) if nodes[j].output and nodes[j].output[0]]
    j = rng.choice(later)
    slot = rng.choice([k for k, t in enumerate(nodes[i].input) if t])
    nodes[i].input[slot] = nodes[j].output[0]
    kind = "self-loop" if i == j else "back edge"
    return onnx_case(model, f"{name}: {kind} {nodes[j].name} -> {nodes[i].name}",
                     expect="reject")


@case_class("onnx/unsorted")
def _onnx_unsorted(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    nodes = list(model.graph.node)
    rng.shuffle(nodes)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return onnx_case(model, f"{name}: nodes shuffled", expect="accept")


def _dangling(rng: random.Random, model: onnx.ModelProto) -> str:
    node = rng.choice([n for n in model.graph.node if any(n.input)])
    slot = rng.choice([k for k, t in enumerate(node.input) if t])
    node.input[slot] = "ghost_tensor"
    return f"{node.name} input {slot} renamed to ghost_tensor"


def _two_producers(rng: random.Random, model: onnx.ModelProto) -> str:
    nodes = [n for n in model.graph.node if n.output and n.output[0]]
    first, second = rng.sample(nodes, 2)
    second.output[0] = first.output[0]
    return f"{first.name} and {second.name} both write {first.output[0]}"


def _twice_initialized(rng: random.Random, model: onnx.ModelProto) -> str:
    tensor = TensorProto()
    tensor.CopyFrom(rng.choice(model.graph.initializer))
    tensor.dims.append(2)
    model.graph.initializer.append(tensor)
    return f"initializer {tensor.name} defined twice"


def _input_overwritten(rng: random.Random, model: onnx.ModelProto) -> str:
    node = rng.choice([n for n in model.graph.node if n.output and n.output[0]])
    node.output[0] = model.graph.input[0].name
    return f"{node.name} writes graph input {model.graph.input[0].name}"


def _ghost_output(rng: random.Random, model: onnx.ModelProto) -> str:
    model.graph.output.append(_value("ghost_output", TensorProto.FLOAT, None))
    return "graph output ghost_output is never produced"


NAME_MUTATIONS: dict[str, Callable[[random.Random, onnx.ModelProto], str]] = {
    "dangling": _dangling, "two-producers": _two_producers,
    "twice-initialized": _twice_initialized, "input-overwritten": _input_overwritten,
    "ghost-output": _ghost_output,
}


@case_class("onnx/names")
def _onnx_names(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    kind = rng.choice([*NAME_MUTATIONS, "same-node-names", "empty-node-names"])
    if kind in NAME_MUTATIONS:
        return onnx_case(model, f"{name}: {NAME_MUTATIONS[kind](rng, model)}", expect="reject")
    for node in model.graph.node:
        node.name = "dup" if kind == "same-node-names" else ""
    return onnx_case(model, f"{name}: {kind}")


@case_class("onnx/value-info")
def _onnx_value_info(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    graph = model.graph
    kind = rng.choice(["no-value-info", "untyped-output", "untyped-input", "no-outputs",
                       "no-input-shape"])
    if kind == "no-value-info":
        del graph.value_info[:]
    elif kind == "untyped-output":
        rng.choice(graph.output).ClearField("type")
    elif kind == "untyped-input":
        graph.input[0].ClearField("type")
    elif kind == "no-outputs":
        del graph.output[:]
    else:
        graph.input[0].type.tensor_type.ClearField("shape")
    expect = "reject" if kind in ("no-outputs", "untyped-input", "no-input-shape") else "any"
    return onnx_case(model, f"{name}: {kind}", expect=expect)


def _control_flow_node(kind: str, source: str, out: str) -> onnx.NodeProto:
    """A minimal If / Loop / Scan reading `source` and writing `out`."""
    elem = TensorProto.FLOAT
    if kind == "If":
        branches = {
            branch: helper.make_graph([helper.make_node("Identity", [source], [f"{branch}_y"])],
                                      branch, [], [_value(f"{branch}_y", elem, None)])
            for branch in ("then_branch", "else_branch")}
        return helper.make_node("If", ["fuzz_cond"], [out], name="fuzz_if", **branches)
    if kind == "Loop":
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
             helper.make_node("Add", ["v_in", "v_in"], ["v_out"])], "body",
            [_value("i", TensorProto.INT64, []), _value("cond_in", TensorProto.BOOL, []),
             _value("v_in", elem, None)],
            [_value("cond_out", TensorProto.BOOL, []), _value("v_out", elem, None)])
        return helper.make_node("Loop", ["fuzz_trips", "fuzz_cond", source], [out],
                                name="fuzz_loop", body=body)
    body = helper.make_graph([helper.make_node("Neg", ["x_i"], ["y_i"])], "scan_body",
                             [_value("x_i", elem, None)], [_value("y_i", elem, None)])
    return helper.make_node("Scan", [source], [out], name="fuzz_scan", body=body,
                            num_scan_inputs=1)


@case_class("onnx/control-flow")
def _onnx_control_flow(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    graph = model.graph
    kind = rng.choice(["If", "Loop", "Scan"])
    producer = rng.choice([n for n in graph.node if n.output and n.output[0]])
    node = _control_flow_node(kind, producer.output[0], "fuzz_cf_out")
    graph.initializer.extend([numpy_helper.from_array(np.array(True), "fuzz_cond"),
                              numpy_helper.from_array(np.array(2, dtype=np.int64),
                                                      "fuzz_trips")])
    where = rng.choice(["graph", "function"])
    if where == "function":
        inputs = [t for t in node.input if t.startswith("fuzz_")] + [producer.output[0]]
        function = helper.make_function("fuzzfn", "Hidden", inputs, ["fuzz_cf_out"], [node],
                                        [helper.make_opsetid("", 17)])
        model.functions.append(function)
        model.opset_import.append(helper.make_opsetid("fuzzfn", 1))
        node = helper.make_node("Hidden", inputs, ["fuzz_cf_out"], name="hidden",
                                domain="fuzzfn")
    position = list(graph.node).index(producer) + 1
    graph.node.insert(position, node)
    graph.output.append(_value("fuzz_cf_out", TensorProto.FLOAT, None))
    return onnx_case(model, f"{name}: {kind} in the {where} after {producer.name}",
                     expect="reject")


@case_class("onnx/custom-domain")
def _onnx_custom_domain(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    node = rng.choice(model.graph.node)
    kind = rng.choice(["domain", "domain-declared", "unknown-op", "ms-domain"])
    if kind == "unknown-op":
        node.op_type = "FancyOp"
    elif kind == "ms-domain":
        node.domain = "com.microsoft"
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    else:
        node.domain = "com.example"
        if kind == "domain-declared":
            model.opset_import.append(helper.make_opsetid("com.example", 1))
    return onnx_case(model, f"{name}: {node.name} {kind}")


def _wrap_in_function(rng: random.Random, model: onnx.ModelProto, kind: str) -> str:
    graph = model.graph
    node = rng.choice([n for n in graph.node if n.domain in ("", "ai.onnx") and n.input])
    inputs, outputs = [t for t in node.input if t], [t for t in node.output if t]
    inner = onnx.NodeProto()
    inner.CopyFrom(node)
    inner.name = ""
    body = [inner]
    if kind == "recursive":
        body = [helper.make_node("Wrapped", inputs, outputs, domain="fuzzfn")]
    elif kind == "undefined-input":
        inner.input[0] = "not_in_function"
    if kind == "doubling":  # each level calls the one below twice: 2^40 nodes inlined
        for level in range(40):
            model.functions.append(helper.make_function(
                "fuzzfn", f"Level{level}", inputs, outputs, body,
                [helper.make_opsetid("", 17), helper.make_opsetid("fuzzfn", 1)]))
            body = [helper.make_node(f"Level{level}", inputs, [f"{o}_first" for o in outputs],
                                     domain="fuzzfn"),
                    helper.make_node(f"Level{level}", inputs, outputs, domain="fuzzfn")]
    function = helper.make_function("fuzzfn", "Wrapped", inputs, outputs, body,
                                    [helper.make_opsetid("", 17),
                                     helper.make_opsetid("fuzzfn", 1)])
    model.functions.append(function)
    if kind == "duplicate":
        model.functions.append(function)
    if kind != "undeclared-domain":
        model.opset_import.append(helper.make_opsetid("fuzzfn", 1))
    call = helper.make_node("Wrapped", inputs, outputs, name=node.name, domain="fuzzfn")
    graph.node.insert(list(graph.node).index(node), call)
    graph.node.remove(node)
    return f"{node.name} wrapped in a local function ({kind})"


@case_class("onnx/function")
def _onnx_function(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    kind = rng.choice(["plain", "recursive", "undefined-input", "duplicate",
                       "undeclared-domain", "doubling"])
    note = _wrap_in_function(rng, model, kind)
    return onnx_case(model, f"{name}: {note}",
                     expect="reject" if kind in ("recursive", "doubling") else "any")


@case_class("onnx/opset")
def _onnx_opset(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    kind = rng.choice(["version", "remove", "duplicate", "ai.onnx"])
    entry = next(e for e in model.opset_import if e.domain in ("", "ai.onnx"))
    version = rng.choice([-1, 0, 1, 12, 13, 21, 23, 30, 1 << 40])
    if kind == "version":
        entry.version = version
    elif kind == "remove":
        model.opset_import.remove(entry)
    elif kind == "duplicate":
        model.opset_import.append(helper.make_opsetid("", version))
    else:
        entry.domain = "ai.onnx"
    expect = "reject" if kind == "remove" or (kind == "version" and version < 13) else "any"
    return onnx_case(model, f"{name}: opset {kind} {version}", expect=expect)


def _odd_attribute(rng: random.Random) -> onnx.AttributeProto:
    name = rng.choice(["axis", "perm", "to", "alpha", "equation", "value", "axes", "zz"])
    value = rng.choice([100, -100, 1 << 62, [5, 0], [], "bogus", 1e300, float("nan"),
                        numpy_helper.from_array(np.zeros((0, 3), np.float32))])
    if value == []:
        return helper.make_attribute(name, value, attr_type=onnx.AttributeProto.INTS)
    return helper.make_attribute(name, value)


@case_class("onnx/attribute")
def _onnx_attribute(rng: random.Random) -> Case:
    name, model = _pick_base(rng)
    node = rng.choice(model.graph.node)
    attr = _odd_attribute(rng)
    kept = [a for a in node.attribute if a.name != attr.name]
    del node.attribute[:]
    node.attribute.extend([*kept, attr])
    return onnx_case(model, f"{name}: {node.name}.{attr.name} = {_short(attr)}")


def _short(attr: onnx.AttributeProto) -> str:
    text = str(helper.get_attribute_value(attr))
    return text if len(text) < 40 else text[:37] + "..."


@case_class("onnx/constant")
def _onnx_constant(rng: random.Random) -> Case:
    """A Constant node whose tensor lies about its size or type (the folder evaluates it)."""
    name, model = _pick_base(rng)
    value = TensorProto(name="c", data_type=rng.choice([TensorProto.INT64, TensorProto.FLOAT,
                                                        TensorProto.STRING, 0]))
    value.dims.extend(rng.choice([[1 << 40], [3], [-2], [1 << 20, 1 << 20], []]))
    value.raw_data = rng.randbytes(rng.choice([0, 3, 8, 24]))
    node = helper.make_node("Constant", [], ["fuzz_const"], name="fuzz_const", value=value)
    shape = helper.make_node("ConstantOfShape", ["fuzz_const"], ["fuzz_filled"],
                             name="fuzz_filled")
    model.graph.node.insert(0, node)
    model.graph.node.insert(1, shape)
    model.graph.output.append(_value("fuzz_filled", TensorProto.FLOAT, None))
    return onnx_case(model, f"{name}: Constant dims {list(value.dims)} "
                            f"({len(value.raw_data)} bytes)")


# --------------------------------------------------------------------------- external data

OUTSIDE_TARGETS = {
    "absolute": ("/etc/passwd", "reject"),
    "dotdot": ("../outside/secret.bin", "reject"),
    "deep-dotdot": ("sub/../../outside/secret.bin", "reject"),
    "inner-dotdot": ("sub/../weights.bin", "reject"),
    "backslash-dotdot": ("..\\outside\\secret.bin", "reject"),
    "symlink-file": ("link.bin", "reject"),
    "symlink-dir": ("linkdir/secret.bin", "reject"),
    "nul-byte": ("weights\x00.bin", "reject"),
    "empty": ("", "reject"),
    "inside": ("weights.bin", "accept"),
    "inside-sub": ("sub/weights.bin", "accept"),
    "inside-symlink": ("inlink.bin", "accept"),
    "absent-inside": ("never_written.weights", "accept"),
}
EXTERNAL_BASES = ("seed-mlp", "gpt-tiny", "helper-mlp", "helper-conv")


def _externalize(model: onnx.ModelProto, location: str, rng: random.Random) -> str:
    """Point one float initializer (or a Constant's tensor) at `location`."""
    floats = [t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT
              and len(t.dims) > 1]
    tensor = rng.choice(floats)
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    length = int(np.prod(tensor.dims)) * 4
    for key, value in (("location", location), ("offset", "0"), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)
    return tensor.name


@case_class("onnx/external-data")
def _onnx_external_data(rng: random.Random) -> Case:
    name, model = _pick_base(rng, EXTERNAL_BASES)
    kind = rng.choice(list(OUTSIDE_TARGETS))
    location, expect = OUTSIDE_TARGETS[kind]
    tensor = _externalize(model, location, rng)
    files = {"weights.bin": b"\0" * 64, "sub/weights.bin": b"\0" * 64}
    links = {"link.bin": "{out}/secret.bin", "linkdir": "{out}", "inlink.bin": "weights.bin"}
    case = onnx_case(model, f"{name}: {tensor} at {location!r} ({kind})", expect, files, links)
    case.names = ("model.onnx",)
    return case


@case_class("onnx/external-fields")
def _onnx_external_fields(rng: random.Random) -> Case:
    """Offsets and lengths the executor would seek to: negative, text, huge, missing."""
    name, model = _pick_base(rng, EXTERNAL_BASES)
    tensor_name = _externalize(model, "weights.bin", rng)
    tensor = next(t for t in model.graph.initializer if t.name == tensor_name)
    key = rng.choice(["offset", "length", "location", "checksum", "bogus"])
    value = rng.choice(["-1", "abc", "", str(1 << 70), "1e3", " 4"])
    entries = [e for e in tensor.external_data if e.key != key]
    del tensor.external_data[:]
    tensor.external_data.extend(entries)
    if rng.random() < 0.8:
        tensor.external_data.add(key=key, value=value)
    return onnx_case(model, f"{name}: {tensor_name} external {key}={value!r}",
                     files={"weights.bin": b"\0" * 64})


# --------------------------------------------------------------------------- profiles

PROFILE_DIR = REPO / "hardware_profiles"


def _profile_case(text: bytes, rng: random.Random, note: str, expect: str = "any") -> Case:
    if rng.random() < 0.2:
        argv = ["profiles", "show", "{dir}/profile.json"]
    else:
        devices = rng.choice([1, 2, 4, 8, 16])
        argv = ["plan", "{dir}/model.onnx", "--profile", "{dir}/profile.json", "--devices",
                str(devices), "--batch", "8", "--time-limit", "10", "-o", "{dir}/out.json"]
    files = {"profile.json": text, "model.onnx": base_bytes("seed-mlp")}
    return Case(files, argv, ("profile.json",), expect, note=note)


def _bundled_profile(rng: random.Random) -> tuple[str, Any]:
    path = rng.choice(sorted(PROFILE_DIR.glob("*.json")))
    return path.stem, json.loads(path.read_text())


def json_paths(data: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a JSON value (containers and leaves), root excluded."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(
        data, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from json_paths(value, (*prefix, key))


def get_path(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def set_path(data: Any, path: tuple[Any, ...], value: Any) -> None:
    get_path(data, path[:-1])[path[-1]] = value


def delete_path(data: Any, path: tuple[Any, ...]) -> None:
    del get_path(data, path[:-1])[path[-1]]


def _leaves(data: Any, kinds: tuple[type, ...]) -> list[tuple[Any, ...]]:
    return [p for p in json_paths(data) if isinstance(get_path(data, p), kinds)
            and not isinstance(get_path(data, p), bool)]


def _dump(data: Any) -> bytes:
    return json.dumps(data, indent=1, allow_nan=True).encode()


def show_path(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


@case_class("profile/valid")
def _profile_valid(rng: random.Random) -> Case:
    stem, data = _bundled_profile(rng)
    return _profile_case(_dump(data), rng, f"{stem} unchanged")


@case_class("profile/missing-field")
def _profile_missing(rng: random.Random) -> Case:
    stem, data = _bundled_profile(rng)
    path = rng.choice([p for p in json_paths(data) if not isinstance(p[-1], int)])
    delete_path(data, path)
    required = path[-1] in ("name", "description", "sources", "device", "topology", "value",
                            "source", "memory_bytes", "memory_bandwidth_Bps", "peak_flops",
                            "matmul_efficiency", "memory_efficiency", "kernel_launch_s",
                            "levels", "bandwidth_Bps", "latency_s", "efficiency", "group_size",
                            "devices_per_node")
    return _profile_case(_dump(data), rng, f"{stem}: {show_path(path)} removed",
                         "reject" if required else "any")


@case_class("profile/nan")
def _profile_nan(rng: random.Random) -> Case:
    stem, data = _bundled_profile(rng)
    path = rng.choice(_leaves(data, (int, float)))
    value = rng.choice([math.nan, math.inf, -math.inf])
    set_path(data, path, value)
    return _profile_case(_dump(data), rng, f"{stem}: {show_path(path)} = {value}", "reject")


@case_class("profile/negative")
def _profile_negative(rng: random.Random) -> Case:
    stem, data = _bundled_profile(rng)
    path = rng.choice(_leaves(data, (int, float)))
    value = rng.choice([-1, -1e9, 0, 0.0, -0.0])
    set_path(data, path, value)
    # a GEMM ramp of 0 s and a device that runs no collective behind compute are valid
    zero_allowed = "matmul_overhead_s" in path or "compute_overlap" in path
    expect = "any" if value == 0 and zero_allowed else "reject"
    return _profile_case(_dump(data), rng, f"{stem}: {show_path(path)} = {value}", expect)


@case_class("profile/wrong-type")
def _profile_wrong_type(rng: random.Random) -> Case:
    stem, data = _bundled_profile(rng)
    path = rng.choice(_leaves(data, (int, float, str)))
    old = get_path(data, path)
    choices = ["12", [1], {}, True, None] if not isinstance(old, str) else [12, [], {}, False]
    value = rng.choice(choices)
    set_path(data, path, value)
    fixed = isinstance(path[-1], str) and path[-1] in ("value", "source", "note", "name",
                                                        "description", "group_size", "schema")
    expect = "reject" if fixed or path[0] == "sources" else "any"
    return _profile_case(_dump(data), rng, f"{stem}: {show_path(path)} = {value!r}", expect)


@case_class("profile/extreme")
def _profile_extreme(rng: random.Random) -> Case:
    stem, data = _bundled_profile(rng)
    path = rng.choice(_leaves(data, (int, float)))
    value = rng.choice([1e308, 1e-308, 5e-324, 10 ** 400, 1 << 63, 1e-30, 1e30, 0.999999])
    set_path(data, path, value)
    return _profile_case(_dump(data), rng, f"{stem}: {show_path(path)} = {value!r:.12}")


@case_class("profile/structure")
def _profile_structure(rng: random.Random) -> Case:
    stem, data = _bundled_profile(rng)
    levels = data["topology"]["levels"]
    kind = rng.choice(["reverse-levels", "no-levels", "duplicate-level", "group-size",
                       "extra-field", "dtype-key", "per-node", "allowed"])
    if kind == "reverse-levels":
        levels.reverse()
    elif kind == "no-levels":
        levels.clear()
    elif kind == "duplicate-level":
        levels.insert(0, json.loads(json.dumps(levels[0])))
    elif kind == "group-size":
        rng.choice(levels)["group_size"] = rng.choice([1, 3, 5, 1 << 40, None])
    elif kind == "extra-field":
        objects = [p for p in json_paths(data) if isinstance(get_path(data, p), dict)]
        get_path(data, rng.choice(objects))["unexpected"] = 1
    elif kind == "dtype-key":
        data["device"]["peak_flops"]["fp64"] = data["device"]["peak_flops"].popitem()[1]
    elif kind == "per-node":
        data["topology"]["devices_per_node"]["value"] = rng.choice([3, 1 << 40, 1])
    else:
        data["topology"]["allowed_devices_within_node"] = {
            "value": rng.choice([[2, 1], [], [0, 8], [1, 2, 3]]), "source": "derived",
            "note": "fuzz"}
    return _profile_case(_dump(data), rng, f"{stem}: {kind}")


@case_class("profile/not-json")
def _profile_not_json(rng: random.Random) -> Case:
    stem, data = _bundled_profile(rng)
    text = _dump(data)
    kind = rng.choice(["truncated", "garbage", "latin1", "empty", "array", "null", "bom",
                       "string"])
    body = {"truncated": text[:rng.randrange(len(text))], "garbage": rng.randbytes(200),
            "latin1": "{\"name\": \"caf\xe9\"}".encode("latin-1"), "empty": b"",
            "array": b"[1, 2]", "null": b"null", "bom": b"\xef\xbb\xbf" + text,
            "string": b"\"a100-80g\""}[kind]
    return _profile_case(body, rng, f"{stem}: {kind}", "reject")


# --------------------------------------------------------------------------- plans

PLAN_BASES = (("seed-mlp", 2), ("gpt-tiny", 4), ("helper-conv", 2))


def _plan_case(rng: random.Random, mutate: Callable[[dict[str, Any]], tuple[str, str]]) -> Case:
    """Export a (mutated) plan, then load it and match it to its model as `run` does."""
    base, devices = rng.choice(PLAN_BASES)
    data = json.loads(base_plan(base, devices))
    note, expect = mutate(data)
    return _plan_bytes_case(rng, base, _dump(data), f"{base}: {note}", expect)


def _plan_bytes_case(rng: random.Random, base: str, text: bytes, note: str,
                     expect: str) -> Case:
    form = rng.choice(["dtensor", "mindspore"])
    files = {"plan.json": text, "model.onnx": base_bytes(base)}
    return Case(files, ["export", "{dir}/plan.json", "--format", form], ("plan.json",
                "model.onnx"), expect, check_plan=True, note=note)


@case_class("plan/valid")
def _plan_valid(rng: random.Random) -> Case:
    return _plan_case(rng, lambda data: ("unchanged", "accept"))


@case_class("plan/not-json")
def _plan_not_json(rng: random.Random) -> Case:
    base, devices = rng.choice(PLAN_BASES)
    text = base_plan(base, devices)
    kind = rng.choice(["truncated", "garbage", "latin1", "empty", "array", "number"])
    body = {"truncated": text[:rng.randrange(len(text))], "garbage": rng.randbytes(100),
            "latin1": b"{\"schema\": \"\xe9\"}", "empty": b"", "array": b"[]",
            "number": b"42"}[kind]
    return _plan_bytes_case(rng, base, body, f"{base}: {kind}", "reject")


PLAN_REQUIRED = {("schema",), ("model",), ("cluster",), ("mesh",), ("parallel",), ("ops",),
                 ("tensors",), ("collectives",), ("predicted",), ("solver",),
                 ("model", "sha256"), ("model", "bound_dims"), ("mesh", "shape"),
                 ("mesh", "axes"), ("mesh", "devices_per_node")}


@case_class("plan/missing-field")
def _plan_missing(rng: random.Random) -> Case:
    def mutate(data: dict[str, Any]) -> tuple[str, str]:
        paths = [p for p in json_paths(data) if len(p) <= 4 and not isinstance(p[-1], int)]
        path = rng.choice(paths if rng.random() < 0.7 else sorted(PLAN_REQUIRED))
        delete_path(data, path)
        return f"{show_path(path)} removed", "reject" if path in PLAN_REQUIRED else "any"

    return _plan_case(rng, mutate)


def _other_type(rng: random.Random, old: Any) -> Any:
    if isinstance(old, bool):
        return rng.choice(["yes", 1, None])
    if isinstance(old, int | float):
        return rng.choice(["7", [7], {"v": 7}, None, True, 1.5, -3, 1 << 70])
    if isinstance(old, str):
        return rng.choice([7, ["a"], {"a": 1}, None, ""])
    if isinstance(old, list):
        return rng.choice(["list", 3, {"0": old}, None, [None], [[]]])
    return rng.choice(["object", 3, [], None, [old]])


@case_class("plan/wrong-type")
def _plan_wrong_type(rng: random.Random) -> Case:
    def mutate(data: dict[str, Any]) -> tuple[str, str]:
        path = rng.choice(list(json_paths(data)))
        value = _other_type(rng, get_path(data, path))
        set_path(data, path, value)
        return f"{show_path(path)} = {json.dumps(value)[:40]}", "any"

    return _plan_case(rng, mutate)


def _layout_paths(data: dict[str, Any]) -> list[tuple[Any, ...]]:
    tensors = [("tensors", name, "layout") for name in data["tensors"]]
    bindings = [("ops", i, side, j, "layout") for i, op in enumerate(data["ops"])
                for side in ("inputs", "outputs") for j, b in enumerate(op[side]) if b]
    return tensors + bindings


def _split_layout_paths(data: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [p for p in _layout_paths(data) if any(get_path(data, p)["dims"])]


def _mutate_layout(rng: random.Random, data: dict[str, Any]) -> tuple[str, str]:
    """Layouts that cannot be laid on the mesh, or a mesh that does not fit the cluster."""
    kind = rng.choice(["unknown-axis", "axis-twice", "rank", "mesh-shape", "mesh-axes",
                       "mesh-size", "partial-axis", "indivisible", "too-many-axes"])
    layout_path = rng.choice(_split_layout_paths(data) or _layout_paths(data))
    layout = get_path(data, layout_path)
    mesh = data["mesh"]
    if kind == "unknown-axis":
        layout["dims"][0] = ["zz"]
    elif kind == "axis-twice":
        layout["dims"][0] = [mesh["axes"][0], mesh["axes"][0]]
    elif kind == "rank":
        layout["dims"].append([])
    elif kind == "mesh-shape":
        mesh["shape"] = [rng.choice([0, -2, 3, 1 << 40]), *mesh["shape"][1:]]
    elif kind == "mesh-axes":
        mesh["axes"] = [f"renamed{i}" for i in range(len(mesh["axes"]))]
        return f"{kind} (axes in use: {_axes_in_use(data)})", "reject" if _axes_in_use(
            data) else "any"
    elif kind == "mesh-size":
        mesh["shape"] = [s * 2 for s in mesh["shape"]]
    elif kind == "partial-axis":
        layout["partial"] = ["nope"]
    elif kind == "too-many-axes":
        mesh["shape"], mesh["axes"] = [1, 1, 1, 1], ["a", "b", "c", "d"]
    else:
        _make_indivisible(data, layout_path)
    return f"{kind} at {show_path(layout_path)}", "reject"


def _axes_in_use(data: dict[str, Any]) -> list[str]:
    layouts = [get_path(data, p) for p in _layout_paths(data)]
    return sorted({a for layout in layouts for axes in [*layout["dims"], layout["partial"]]
                   for a in axes})


def _make_indivisible(data: dict[str, Any], layout_path: tuple[Any, ...]) -> None:
    layout = get_path(data, layout_path)
    tensor = layout_path[1] if layout_path[0] == "tensors" else get_path(
        data, layout_path[:-1])["tensor"]
    shape = data["tensors"][tensor]["shape"]
    dim = next((i for i, axes in enumerate(layout["dims"]) if axes), None)
    if dim is None:
        layout["dims"] = [["zz"]] * len(layout["dims"]) or [["zz"]]
        return
    shape[dim] = shape[dim] + 1 if shape[dim] > 1 else 3


@case_class("plan/layout")
def _plan_layout(rng: random.Random) -> Case:
    return _plan_case(rng, lambda data: _mutate_layout(rng, data))


@case_class("plan/sha256")
def _plan_sha(rng: random.Random) -> Case:
    def mutate(data: dict[str, Any]) -> tuple[str, str]:
        digest = data["model"]["sha256"]
        kind = rng.choice(["flip", "short", "upper", "text"])
        position = rng.randrange(len(digest))
        flipped = digest[:position] + ("0" if digest[position] != "0" else "1") + digest[
            position + 1:]
        data["model"]["sha256"] = {"flip": flipped, "short": digest[:12], "upper": flipped.upper(),
                                   "text": "not a digest"}[kind]
        return f"sha256 {kind}", "reject"

    return _plan_case(rng, mutate)


@case_class("plan/model-swap")
def _plan_model_swap(rng: random.Random) -> Case:
    """The plan is intact but model.onnx is another file: the executor must refuse."""
    base, devices = rng.choice(PLAN_BASES)
    other = rng.choice([b for b in BASES if b != base])
    case = _plan_bytes_case(rng, base, base_plan(base, devices), f"{base} plan on {other}",
                            "reject")
    case.files["model.onnx"] = base_bytes(other)
    return case


@case_class("plan/dims")
def _plan_dims(rng: random.Random) -> Case:
    def mutate(data: dict[str, Any]) -> tuple[str, str]:
        model = data["model"]
        value = rng.choice([0, -4, 3, 1 << 40, "8", 2.5, None, "double"])
        if model["bound_dims"] and rng.random() < 0.7:
            key = rng.choice(sorted(k for k in model["bound_dims"] if k != "batch") or ["batch"])
            if value == "double":  # valid, divisible, but not what the plan's shapes are for
                value = model["bound_dims"][key] * 2
            model["bound_dims"][key] = value
            return f"bound_dims.{key} = {value!r}", "reject"
        model["bound_dims"]["ghost"] = 4
        return "bound_dims.ghost added", "reject"

    return _plan_case(rng, mutate)


@case_class("plan/ops")
def _plan_ops(rng: random.Random) -> Case:
    def mutate(data: dict[str, Any]) -> tuple[str, str]:
        ops = data["ops"]
        index = rng.randrange(len(ops))
        kind = rng.choice(["remove", "rename", "duplicate", "unknown-tensor", "strategy"])
        name = ops[index]["name"]
        if kind == "remove":
            ops.pop(index)
        elif kind == "rename":
            ops[index]["name"] = "renamed_op"
        elif kind == "duplicate":
            ops.append(json.loads(json.dumps(ops[index])))
        elif kind == "unknown-tensor":
            bound = [b for b in ops[index]["inputs"] + ops[index]["outputs"] if b]
            rng.choice(bound)["tensor"] = "ghost_tensor"
        else:
            ops[index]["strategy"] = [[0, -1]]
        expect = "reject" if kind in ("remove", "rename", "unknown-tensor") else "any"
        return f"op {name}: {kind}", expect

    return _plan_case(rng, mutate)


@case_class("plan/numbers")
def _plan_numbers(rng: random.Random) -> Case:
    def mutate(data: dict[str, Any]) -> tuple[str, str]:
        path = rng.choice([p for p in _leaves(data, (int, float)) if p[0] in (
            "predicted", "cluster", "parallel", "collectives", "model", "solver")])
        value = rng.choice([math.nan, math.inf, -1, 0, 1 << 70, -1e300])
        set_path(data, path, value)
        return f"{show_path(path)} = {value}", "any"

    return _plan_case(rng, mutate)


# =========================================================================== held-out classes
# The classes an adversarial run outside the project found (issue 18), each a generator:
# command-line values, plan and strategies files that break a parser's bounds, hand-edited
# plans that only a re-derivation catches, ops that contradict their own shapes, names
# that would forge a message line, and executor inputs checked before any rank starts.

CLI_BASES = ("seed-mlp", "gpt-tiny")
#: (flags, the flag the message must name): each must be refused (exit 2, one line).
BAD_PLAN_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--dim", "seq=8", "--dim", "seq=16"), "--dim"),
    (("--parallel", "dp=8,dp=2"), "--parallel"),
    (("--parallel", "dp=2", "--parallel", "tp=2"), "--parallel"),
    (("--time-limit", "nan"), "--time-limit"),
    (("--time-limit", "inf"), "--time-limit"),
    (("--time-limit", "-1"), "--time-limit"),
    (("--memory-limit", "1e-300"), "--memory-limit"),
    (("--memory-limit", "nan"), "--memory-limit"),
    (("--memory-limit", "inf"), "--memory-limit"),
    (("--memory-limit", "1e300"), "--memory-limit"),
    (("--devices", "1000000000000000000000000000000"), "devices"),
    (("--devices", "1000000000"), "devices"),
    (("--devices", "1e9"), "--devices"),
    (("--devices", "0"), "--devices"),
    (("--capacity-factor", "nan"), "--capacity-factor"),
    (("--bucket-mb", "inf"), "--bucket-mb"),
)
BAD_RUN_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--lr", "nan"), "--lr"), (("--lr", "inf"), "--lr"), (("--lr", "-0.1"), "--lr"),
    (("--timeout", "nan"), "--timeout"), (("--timeout", "0"), "--timeout"),
    (("--steps", "0"), "--steps"), (("--nproc", "-2"), "--nproc"),
)


@case_class("cli/flags")
def _cli_flags(rng: random.Random) -> Case:
    """Repeated, contradictory, non-finite or absurd flag values: refused at once."""
    base = rng.choice(CLI_BASES)
    if rng.random() < 0.7:
        flags, named = rng.choice(BAD_PLAN_FLAGS)
        devices = [] if any(f == "--devices" for f in flags) else ["--devices", "2"]
        args, _ = bind_args(base_bytes(base))
        if "--dim" in flags:  # the case's own --dim pair replaces the binding of seq
            args = [a for a in args if not a.startswith("--dim=seq")]
        argv = ["plan", "{dir}/model.onnx", *devices, *args, *flags, "--time-limit", "10"]
        if "--time-limit" in flags:
            argv = argv[:-2]
        files = {"model.onnx": base_bytes(base)}
    else:
        flags, named = rng.choice(BAD_RUN_FLAGS)
        argv = ["run", "{dir}/model.onnx", "--plan", "{dir}/plan.json", "--nproc", "1", *flags]
        files = {"model.onnx": base_bytes(base), "plan.json": base_plan(base, 2)}
    return Case(files, argv, (named,), "reject", note=f"{base}: {' '.join(flags)}")


def _deep(kind: str, depth: int) -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    return b'{"a": ' * depth + b"1" + b"}" * depth


@case_class("plan/json-bounds")
def _plan_json_bounds(rng: random.Random) -> Case:
    """Plan files that break a JSON parser's bounds: nesting thousands deep, integers of
    thousands of digits, duplicate keys (the last would win), non-finite numbers, bytes
    that are not UTF-8."""
    base, devices = rng.choice(PLAN_BASES)
    text = base_plan(base, devices)
    kind = rng.choice(["deep-array", "deep-object", "deep-field", "big-int", "duplicate-ops",
                       "duplicate-tensor", "infinite", "nan-literal", "latin1", "bom"])
    if kind.startswith("deep-") and kind != "deep-field":
        body = _deep(kind[5:], rng.choice([1000, 5000, 100_000]))
    elif kind == "deep-field":
        body = text.replace(b'"solver": {', b'"solver": {"x": ' + _deep("object", 3000) + b", ", 1)
    elif kind == "big-int":
        digits = b"9" * rng.choice([5000, 100_000])
        body = text.replace(b'"micro_batches": ', b'"micro_batches": ' + digits + b", \"x\": ", 1)
        body = body if body != text else text[:-1] + b', "x": ' + digits + b"}"
    elif kind == "duplicate-ops":
        body = text.rstrip()[:-1] + b', "ops": []}'
    elif kind == "duplicate-tensor":
        data = json.loads(text)
        name = rng.choice(sorted(data["tensors"]))
        entry = json.dumps({name: data["tensors"][name]}).encode()[1:-1]
        body = text.replace(b'"tensors": {', b'"tensors": {' + entry + b", ", 1)
    elif kind == "infinite":
        body = text.replace(b'"step_time_s": ', b'"step_time_s": 1e400, "x": ', 1)
    elif kind == "nan-literal":
        body = text.replace(b'"step_time_s": ', b'"step_time_s": NaN, "x": ', 1)
    elif kind == "latin1":
        body = text.replace(b'"schema": "', b'"schema": "\xe9', 1)
    else:
        body = b"\xef\xbb\xbf" + text
    return _plan_bytes_case(rng, base, body, f"{base}: {kind}",
                            "any" if kind == "bom" else "reject")


PIPELINE_PINS = {"pp": 2, "dp": 2, "zero": 1, "micro_batches": 2, "schedule": "1f1b"}


@cache
def base_pinned_plan(name: str, devices: int, pins: tuple[tuple[str, Any], ...]) -> bytes:
    """A valid plan JSON of a base model planned with `--parallel` pins."""
    from planner.api import plan

    with tempfile.TemporaryDirectory(prefix="shardplan-fuzz-base-") as folder:
        path = Path(folder) / "model.onnx"
        path.write_bytes(base_bytes(name))
        _, dims = bind_args(base_bytes(name))
        result = plan(path, devices=devices, batch=8, dims=dims, parallel=dict(pins),
                      time_limit=10.0)
        return result.dumps().encode()


def _tamper(rng: random.Random, data: dict[str, Any]) -> str:
    """One hand edit that keeps the file loadable but makes the plan wrong: only a
    re-derivation from the model (`validate`) can see it."""
    collectives = data["collectives"]
    kinds = ["duplicate-gradient", "broadcast-gradient", "zero-edited", "parallel-dp",
             "parallel-tp", "drop-sends", "empty-sends", "drop-reduce-scatter",
             "axes-swapped"]
    kind = rng.choice(kinds)
    gradient = [c for c in collectives if c["phase"] in ("gradient", "zero")]
    if kind == "duplicate-gradient" and gradient:
        collectives.append(dict(rng.choice(gradient)))
    elif kind == "broadcast-gradient" and gradient:
        rng.choice(gradient)["kind"] = "broadcast"
    elif kind == "zero-edited":
        data["parallel"]["zero"] = 0 if data["parallel"].get("zero") else 1
    elif kind == "parallel-dp":
        data["parallel"]["dp"] = 7
    elif kind == "parallel-tp":
        data["parallel"]["tp"] = data["parallel"].get("tp", 1) * 2
    elif kind == "drop-sends":
        data["collectives"] = [c for c in collectives if c["kind"] != "send_recv"]
    elif kind == "empty-sends" and data.get("pipeline"):
        data["pipeline"]["sends"] = []
    elif kind == "drop-reduce-scatter":
        data["collectives"] = [c for c in collectives if c["kind"] != "reduce_scatter"]
    elif kind == "axes-swapped" and gradient:
        chosen = rng.choice(gradient)
        others = [a for a in data["mesh"]["axes"] if a not in chosen["axes"]]
        chosen["axes"] = others[:1] or ["nope"]
    else:
        data["parallel"]["dp"] = 7
        kind = "parallel-dp"
    return kind


@case_class("plan/tampered")
def _plan_tampered(rng: random.Random) -> Case:
    """A plan edited by hand where the edit still loads: `validate PLAN MODEL` and the
    executor's checks before any rank starts must refuse it."""
    if rng.random() < 0.5:
        base, devices = "gpt-tiny", 4
        text = base_pinned_plan(base, devices, tuple(sorted(PIPELINE_PINS.items())))
    else:
        base, devices = rng.choice(PLAN_BASES)
        text = base_plan(base, devices)
    data = json.loads(text)
    before = json.dumps(data, sort_keys=True)
    kind = _tamper(rng, data)
    expect = "any" if json.dumps(data, sort_keys=True) == before else "reject"
    files = {"plan.json": _dump(data), "model.onnx": base_bytes(base)}
    return Case(files, ["validate", "{dir}/plan.json", "{dir}/model.onnx"],
                ("plan.json", "model.onnx"), expect, check_plan=True, note=f"{base}: {kind}")


def _contradiction(kind: str) -> onnx.ModelProto:
    """A small graph whose one op contradicts the shapes it is given or declares."""
    x = _value("x", TensorProto.FLOAT, [4, 32])
    inits = [_weight("w", (32, 8))]
    if kind == "declared-output":
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
        out = _value("y", TensorProto.FLOAT, [4, 99])
    elif kind == "concat-axis":
        nodes = [helper.make_node("Concat", ["x", "x"], ["y"], name="cat", axis=9)]
        out = _value("y", TensorProto.FLOAT, None)
    elif kind == "split-sizes":
        inits.append(_ints("sizes", [30, 30]))
        nodes = [helper.make_node("Split", ["x", "sizes"], ["y", "y2"], name="split", axis=1)]
        out = _value("y", TensorProto.FLOAT, None)
    elif kind == "reshape-count":
        inits.append(_ints("target", [5, 30]))
        nodes = [helper.make_node("Reshape", ["x", "target"], ["y"], name="rs")]
        out = _value("y", TensorProto.FLOAT, None)
    elif kind == "einsum-label":
        nodes = [helper.make_node("Einsum", ["x", "w"], ["y"], name="es",
                                  equation="ij,jk->iz")]
        out = _value("y", TensorProto.FLOAT, None)
    elif kind == "transpose-perm":
        nodes = [helper.make_node("Transpose", ["x"], ["y"], name="tr", perm=[0, 5])]
        out = _value("y", TensorProto.FLOAT, None)
    elif kind == "softmax-axis":
        nodes = [helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=7)]
        out = _value("y", TensorProto.FLOAT, None)
    else:  # gather-axis
        inits.append(_ints("idx", [0, 1]))
        nodes = [helper.make_node("Gather", ["x", "idx"], ["y"], name="ga", axis=-9)]
        out = _value("y", TensorProto.FLOAT, None)
    return _model(helper.make_graph(nodes, kind, [x], [out], inits))


CONTRADICTIONS = ("declared-output", "concat-axis", "split-sizes", "reshape-count",
                  "einsum-label", "transpose-perm", "softmax-axis", "gather-axis")


@case_class("onnx/contradiction")
def _onnx_contradiction(rng: random.Random) -> Case:
    kind = rng.choice(CONTRADICTIONS)
    return onnx_case(_contradiction(kind), kind, "reject")


@case_class("onnx/training-info")
def _onnx_training_info(rng: random.Random) -> Case:
    """External data hidden in `ModelProto.training_info` obeys the folder rule too."""
    name, model = _pick_base(rng, EXTERNAL_BASES)
    kind = rng.choice(list(OUTSIDE_TARGETS))
    location, expect = OUTSIDE_TARGETS[kind]
    hidden = _weight("hidden_state", (4, 4))
    hidden.ClearField("raw_data")
    hidden.ClearField("float_data")
    hidden.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "64")):
        hidden.external_data.add(key=key, value=value)
    info = model.training_info.add()
    info.initialization.CopyFrom(helper.make_graph([], "init", [], [], [hidden]))
    files = {"weights.bin": b"\0" * 64, "sub/weights.bin": b"\0" * 64}
    links = {"link.bin": "{out}/secret.bin", "linkdir": "{out}", "inlink.bin": "weights.bin"}
    case = onnx_case(model, f"{name}: training_info tensor at {location!r} ({kind})",
                     "reject" if expect == "reject" else "any", files, links)
    case.names = ("model.onnx",)
    return case


FORGED = ("a\nshardplan: error: forged", "b\rshardplan: error: forged",
          "c\x1b[2Kshardplan: error: forged", "d\u2028shardplan: error: forged")


@case_class("names/escape")
def _names_escape(rng: random.Random) -> Case:
    """A name carrying a line break or a terminal escape, in a graph that is refused: the
    refusal stays one line (a second `shardplan: error:` line would be forged)."""
    forged = rng.choice(FORGED)
    model = base_model("helper-mlp")
    kind = rng.choice(["custom-op", "cycle", "dangling"])
    node = rng.choice(list(model.graph.node))
    node.name = forged
    if kind == "custom-op":
        node.op_type = "NoSuchOp" + forged[:1]
    elif kind == "cycle":
        node.input[0] = node.output[0]
    else:
        node.input[0] = forged
    return onnx_case(model, f"{kind} with name {forged!r}", "reject")


def _strategies_body(rng: random.Random, kind: str) -> tuple[str, bytes]:
    """A strategies file (name, bytes) that breaks a parser's bounds."""
    pin = b'"fc1": [[1, 1], [1, 2]]'
    if kind == "deep-json":
        return "s.json", b'{"fc1": ' + _deep("array", rng.choice([1000, 5000])) + b"}"
    if kind == "big-int":
        return "s.json", b'{"fc1": [[1, 1], [1, ' + b"9" * 5000 + b"]]}"
    if kind == "duplicate-key":
        return "s.json", b"{" + pin + b', "fc1": [[1, 1], [2, 1]]}'
    if kind == "latin1":
        return "s.json", b'{"fc\xe91": [[1, 1], [1, 2]]}'
    if kind == "yaml-int-key":
        return "s.yaml", b"7: [[1, 1], [1, 2]]\n"
    if kind == "yaml-deep":
        return "s.yaml", b"fc1: " + b"[" * 50_000 + b"]" * 50_000 + b"\n"
    if kind == "yaml-bomb":
        lines = [b'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
        lines += [f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 9)}]".encode()
                  for i in range(1, 10)]
        return "s.yaml", b"\n".join(lines) + b"\nfc1: *a9\n"
    return "s.yaml", b"fc1: [[1, 1], [1, 2]\n  bad: : indentation\n"


@case_class("strategies/bounds")
def _strategies_bounds(rng: random.Random) -> Case:
    kind = rng.choice(["deep-json", "big-int", "duplicate-key", "latin1", "yaml-int-key",
                       "yaml-deep", "yaml-bomb", "yaml-syntax"])
    name, body = _strategies_body(rng, kind)
    argv = ["plan", "{dir}/model.onnx", "--devices", "2", "--batch", "8", "--mode", "semi",
            "--strategies", f"{{dir}}/{name}", "--time-limit", "10"]
    return Case({"model.onnx": base_bytes("helper-mlp"), name: body}, argv, (name,),
                "reject", note=f"strategies {kind}")


def _npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=array.dtype == object)
    return buffer.getvalue()


@case_class("run/inputs")
def _run_inputs(rng: random.Random) -> Case:
    """Executor inputs that must be refused before any rank starts: data arrays of the
    wrong shape, type or index range, corrupt or object arrays, outputs and checkpoints
    in places that cannot hold them."""
    base = "gpt-tiny"
    plan_text = base_plan(base, 4)
    data = json.loads(plan_text)
    batch = int(data["model"]["bound_dims"].get("batch", 8))
    seq = int(data["model"]["bound_dims"].get("seq", 4))
    vocab = int(next(t["shape"][0] for n, t in data["tensors"].items() if "wte" in n))
    kind = rng.choice(["shape", "dtype", "index-range", "negative-index", "object", "corrupt",
                       "targets-range", "log-under-file", "checkpoint-under-file",
                       "resume-not-checkpoint"])
    files = {"model.onnx": base_bytes(base), "plan.json": plan_text, "file.txt": b"x"}
    ids = np.zeros((batch, seq), dtype=np.int64)
    extra: list[str] = ["--data", "{dir}/data"]
    named = "data"
    if kind == "shape":
        files["data/input_ids.npy"] = _npy(np.zeros((batch + 1, seq), dtype=np.int64))
    elif kind == "dtype":
        files["data/input_ids.npy"] = _npy(np.zeros((batch, seq), dtype=np.float32))
    elif kind == "index-range":
        files["data/input_ids.npy"] = _npy(ids + vocab)
    elif kind == "negative-index":
        files["data/input_ids.npy"] = _npy(ids - 1)
    elif kind == "object":
        files["data/input_ids.npy"] = _npy(np.array([{"a": 1}] * batch, dtype=object))
    elif kind == "corrupt":
        files["data/input_ids.npy"] = _npy(ids)[:60]
    elif kind == "targets-range":
        files["data/input_ids.npy"] = _npy(ids)
        files["data/targets.npy"] = _npy(np.full((batch, seq), 1_000_000, dtype=np.int64))
    elif kind == "log-under-file":
        extra, named = ["--log-json", "{dir}/file.txt/log.json"], "log.json"
    elif kind == "checkpoint-under-file":
        extra, named = ["--checkpoint", "{dir}/file.txt/ck"], "ck"
    else:
        files["user/.metadata"] = b""
        files["user/notes.txt"] = b"mine"
        extra, named = ["--resume", "{dir}/user"], "user"
    argv = ["run", "{dir}/model.onnx", "--plan", "{dir}/plan.json", "--nproc", "4",
            "--steps", "1", *extra]
    return Case(files, argv, (named,), "reject", note=f"{base}: {kind}")
