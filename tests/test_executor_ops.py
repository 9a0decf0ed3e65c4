"""The torch op interpreter against onnxruntime and ONNX's own node tests.

The executor trains with these ops, so they must match ONNX exactly on the zoo and on
real exports, and let gradients reach every parameter.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from onnx import helper, numpy_helper  # noqa: E402

from executor.interpreter import run_graph, run_nodes, to_tensor  # noqa: E402
from executor.ops import TORCH_OPS  # noqa: E402
from planner.errors import ShardplanError  # noqa: E402
from planner.zoo import BUFFER_SUFFIXES, build  # noqa: E402

TINY = ("gpt-tiny", "bert-tiny", "llama-tiny", "resnet-tiny", "moe-tiny", "seed-mlp")
FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)


def _random_feeds(model: onnx.ModelProto, batch: int = 2, seq: int = 8,
                  vocab: int = 100) -> dict[str, np.ndarray]:
    """Random inputs: token ids below every tiny vocab, masks of ones, floats elsewhere."""
    rng = np.random.default_rng(0)
    inits = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        tensor_type = value.type.tensor_type
        dims = [d.dim_value or (batch if i == 0 else seq)
                for i, d in enumerate(tensor_type.shape.dim)]
        if tensor_type.elem_type == onnx.TensorProto.INT64:
            high = 1 if "mask" in value.name else vocab
            feeds[value.name] = (rng.integers(0, high, dims) if high > 1
                                 else np.ones(dims)).astype(np.int64)
        else:
            feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _check_against_ort(model: onnx.ModelProto) -> None:
    feeds = _random_feeds(model)
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    got = run_graph(model, {k: torch.from_numpy(v) for k, v in feeds.items()})
    assert list(got) == [o.name for o in model.graph.output]
    for want, have in zip(expected, got.values(), strict=True):
        np.testing.assert_allclose(have.detach().numpy(), want, rtol=1e-4, atol=1e-4)


def _check_gradients(model: onnx.ModelProto) -> None:
    """Every trainable float initializer, passed in with requires_grad, gets a finite grad."""
    params = {t.name: to_tensor(numpy_helper.to_array(t)).requires_grad_()
              for t in model.graph.initializer
              if t.data_type in FLOATS and not t.name.endswith(BUFFER_SUFFIXES)}
    assert params
    feeds = {k: torch.from_numpy(v) for k, v in _random_feeds(model).items()}
    out = next(iter(run_graph(model, feeds, params).values()))
    (out.float() ** 2).mean().backward()
    missing = [n for n, p in params.items() if p.grad is None]
    assert not missing, f"no gradient reached {missing}"
    bad = [n for n, p in params.items() if not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients for {bad}"


@pytest.mark.parametrize("family", TINY)
def test_zoo_tiny_matches_onnxruntime(family: str) -> None:
    _check_against_ort(build(family, with_weights=True))


@pytest.mark.parametrize("family", TINY)
def test_zoo_tiny_gradients_reach_every_parameter(family: str) -> None:
    _check_gradients(build(family, with_weights=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_torch_exports_match_onnxruntime(name: str, export_model: Any) -> None:
    """Real TorchScript exports: what PyTorch emits, not what the zoo builds."""
    path: pathlib.Path = export_model(name, "torchscript")
    model = onnx.load(str(path))
    _check_against_ort(model)
    _check_gradients(model)


def test_unknown_op_names_op_and_node() -> None:
    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="weird")
    with pytest.raises(ShardplanError, match=r"weird.*NoSuchOp"):
        run_nodes([node], {"x": torch.zeros(1)})


def test_collectives_go_to_the_callback() -> None:
    """Local programs carry shardplan-domain AllReduce nodes; single-process cannot run them."""
    nodes = [helper.make_node("AllReduce", ["x"], ["s"], domain="shardplan", axes=["dp"]),
             helper.make_node("Mul", ["s", "x"], ["y"])]
    with pytest.raises(ShardplanError, match="AllReduce"):
        run_nodes(nodes, {"x": torch.ones(2)})

    def double(node: onnx.NodeProto, env: dict[str, Any]) -> None:
        env[node.output[0]] = env[node.input[0]] * 2  # a two-device sum of equal shards

    env = {"x": torch.full((2,), 3.0)}
    run_nodes(nodes, env, collective=double)
    assert env["y"].tolist() == [18.0, 18.0]


def test_batch_norm_training_updates_running_stats() -> None:
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    ones, zeros = torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    y, mean, var = TORCH_OPS["BatchNormalization"](
        [x, ones, zeros, zeros, ones], {"training_mode": 1, "momentum": 0.9, "epsilon": 1e-5})
    bn = torch.nn.BatchNorm2d(3, eps=1e-5, momentum=0.1, dtype=torch.float64)
    torch.testing.assert_close(y, bn(x))
    torch.testing.assert_close(mean, bn.running_mean)
    # torch's running var is unbiased; ONNX's (and ours) is the biased batch variance
    n = x.numel() / 3
    torch.testing.assert_close(var, 0.9 + (bn.running_var - 0.9) * (n - 1) / n)


# ------------------------------------------------------------------ ONNX node tests

_NO_TORCH_DTYPE = {"uint16", "uint32", "uint64", "object"}  # torch CPU kernels lack these
_RANDOM = ("test_training_dropout", "test_bernoulli", "test_random")


def _node_cases() -> list[Any]:
    from onnx.backend.test.case.node import collect_testcases

    picked = []
    for case in collect_testcases(None):
        if case.kind != "node" or "_expanded" in case.name:
            continue
        if case.name.startswith(_RANDOM) and "zero_ratio" not in case.name:
            continue
        if not {n.op_type for n in case.model.graph.node} <= set(TORCH_OPS):
            continue
        opset = max((o.version for o in case.model.opset_import
                     if o.domain in ("", "ai.onnx")), default=0)
        if opset >= 13:
            picked.append(case)
    return picked


_CASES = _node_cases()


def _unsupported_dtype(arrays: list[Any]) -> str | None:
    for array in arrays:
        name = np.asarray(array).dtype.name
        if name in _NO_TORCH_DTYPE or name.startswith(("float8", "int4", "uint4", "float4")):
            return name
    return None


def _as_numpy(value: Any) -> np.ndarray:
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.detach().numpy()


@pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
def test_onnx_node_case(case: Any) -> None:
    """Matches ONNX's expected outputs (rtol 1e-3 as onnx's backend tests use)."""
    for inputs, outputs in case.data_sets:
        dtype = _unsupported_dtype([*inputs, *outputs])
        if dtype:
            pytest.skip(f"dtype {dtype} has no torch CPU support")
        feeds = {v.name: to_tensor(np.asarray(a)) for v, a in zip(case.model.graph.input,
                                                                    inputs, strict=False)}
        try:
            got = run_graph(case.model, feeds)
        except ShardplanError as err:
            pytest.skip(f"declared unsupported: {err}")
        assert len(got) == len(outputs)
        for want, have in zip(outputs, got.values(), strict=True):
            want = np.asarray(want)
            # bfloat16 keeps 8 bits: ONNX's reference rounds every intermediate to it, the
            # executor computes fused ops (Attention) in fp32 as their kernels do, so the
            # results may differ by a few bf16 ulps (1/64 relative)
            rtol = 2.0 ** -6 if want.dtype.name == "bfloat16" else 1e-3
            if want.dtype.name == "bfloat16":
                want = want.astype(np.float32)
            array = _as_numpy(have)
            assert array.shape == want.shape
            assert array.dtype == want.dtype
            np.testing.assert_allclose(array, want, rtol=rtol, atol=1e-6)
