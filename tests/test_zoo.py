"""Model zoo: tiny models run in onnxruntime, big ones build fast with absent weights, and
graph parameter counts agree with the closed-form formulas and the literature."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper, shape_inference

from planner import zoo
from planner.errors import ModelError

TINY = ["gpt-tiny", "bert-tiny", "llama-tiny", "resnet-tiny", "moe-tiny"]
BATCH, SEQ = 2, 8
FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}


def _feed(family: str, config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if family == "resnet":
        size = (BATCH, config.in_channels, config.image_size, config.image_size)
        return {"pixel_values": rng.standard_normal(size).astype(np.float32)}
    return {"input_ids": rng.integers(0, config.vocab, (BATCH, SEQ), dtype=np.int64)}


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(["logits"], feed)[0]


def _bind(model: onnx.ModelProto, **dims: int) -> onnx.ModelProto:
    """Copy with the symbolic graph input/output dims replaced by concrete values."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for value in [*out.graph.input, *out.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_value = dims[dim.dim_param]
    return out


def _untyped_outputs(model: onnx.ModelProto) -> list[str]:
    """Node outputs that strict shape inference leaves without a fully static shape."""
    inferred = shape_inference.infer_shapes(_bind(model, batch=BATCH, seq=SEQ),
                                            strict_mode=True)
    typed = {v.name: v.type for v in [*inferred.graph.value_info, *inferred.graph.output]}
    bad = []
    for node in inferred.graph.node:
        for name in node.output:
            t = typed.get(name)
            ok = (t is not None and t.tensor_type.elem_type != 0
                  and t.tensor_type.HasField("shape")
                  and all(d.HasField("dim_value") for d in t.tensor_type.shape.dim))
            if not ok:
                bad.append(f"{node.op_type}:{name}")
    return bad


# ----------------------------------------------------------------------------------------
# Tiny models run
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_runs_in_onnxruntime(name: str) -> None:
    family, config = zoo.preset(name)
    model = zoo.build(family, config, with_weights=True, seed=1)
    logits = _run(model, _feed(family, config, np.random.default_rng(0)))
    if family == "resnet":
        assert logits.shape == (BATCH, config.num_classes)
    else:
        assert logits.shape == (BATCH, SEQ, config.vocab)
    assert np.isfinite(logits).all()
    assert logits.std() > 0


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_decoder_is_causal(name: str) -> None:
    family, config = zoo.preset(name)
    model = zoo.build(family, config, with_weights=True)
    ids = _feed(family, config, np.random.default_rng(0))["input_ids"]
    changed = ids.copy()
    changed[:, 5] = (changed[:, 5] + 1) % config.vocab
    before, after = _run(model, {"input_ids": ids}), _run(model, {"input_ids": changed})
    np.testing.assert_allclose(before[:, :5], after[:, :5], rtol=0, atol=1e-6)
    assert not np.allclose(before[:, 5:], after[:, 5:])


def test_bert_optional_inputs_run() -> None:
    config = dataclasses.replace(zoo.preset("bert-tiny")[1], head="classifier",
                                 token_type_input=True, attention_mask_input=True)
    model = zoo.build("bert", config, with_weights=True)
    assert [i.name for i in model.graph.input] == ["input_ids", "token_type_ids",
                                                   "attention_mask"]
    rng = np.random.default_rng(0)
    mask = np.ones((BATCH, SEQ), np.int64)
    mask[1, 5:] = 0
    feed = {**_feed("bert", config, rng), "attention_mask": mask,
            "token_type_ids": rng.integers(0, 2, (BATCH, SEQ), dtype=np.int64)}
    logits = _run(model, feed)
    assert logits.shape == (BATCH, config.num_labels) and np.isfinite(logits).all()
    # Padding is masked out: changing a padded token leaves row 1 unchanged.
    feed["input_ids"] = feed["input_ids"].copy()
    feed["input_ids"][1, 6] = (feed["input_ids"][1, 6] + 1) % config.vocab
    np.testing.assert_allclose(_run(model, feed)[1], logits[1], atol=1e-6)


# ----------------------------------------------------------------------------------------
# MoE routing against a plain numpy GShard reference
# ----------------------------------------------------------------------------------------


def _moe_reference(w: dict[str, np.ndarray], p: str, x: np.ndarray, config) -> np.ndarray:
    """Top-k routing per sequence, rank-major slot priority, tokens over capacity dropped."""
    def gelu(v: np.ndarray) -> np.ndarray:
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))

    logits = x @ w[f"{p}.gate.weight"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        top = np.argsort(-probs[b], axis=-1)[:, : config.top_k]
        gates = np.take_along_axis(probs[b], top, -1)
        gates /= gates.sum(-1, keepdims=True)
        load = np.zeros(config.experts, int)
        for r in range(config.top_k):
            for s in range(x.shape[1]):
                e = top[s, r]
                if load[e] >= config.capacity_per_expert:
                    continue
                load[e] += 1
                h = gelu(x[b, s] @ w[f"{p}.experts.c_fc.weight"][e]
                         + w[f"{p}.experts.c_fc.bias"][e])
                y = h @ w[f"{p}.experts.c_proj.weight"][e] + w[f"{p}.experts.c_proj.bias"][e]
                out[b, s] += gates[s, r] * y
    return out


@pytest.mark.parametrize("capacity", [None, 2])
def test_moe_layer_matches_reference(capacity: int | None) -> None:
    config = dataclasses.replace(zoo.preset("moe-tiny")[1], capacity=capacity)
    model = zoo.build("moe", config, with_weights=True, seed=3)
    for t in model.graph.initializer:  # non-zero biases make the check sharper
        if t.name.endswith(".bias"):
            noise = np.random.default_rng(len(t.name)).normal(0, 0.1, tuple(t.dims))
            t.CopyFrom(numpy_helper.from_array(noise.astype(np.float32), t.name))
    extractor = onnx.utils.Extractor(shape_inference.infer_shapes(model))
    layer = extractor.extract_model(["h.1.ln_2"], ["h.1.mlp.combine.matmul"])
    x = np.random.default_rng(0).standard_normal((BATCH, SEQ, config.hidden)).astype(np.float32)
    session = ort.InferenceSession(layer.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    got = session.run(None, {"h.1.ln_2": x})[0]
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    expected = _moe_reference(w, "transformer.h.1.mlp", x.astype(np.float64), config)
    np.testing.assert_allclose(got, expected, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Graph validity and conventions
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("name", TINY)
def test_checker_and_static_shapes(name: str, with_weights: bool) -> None:
    model = zoo.build(name, with_weights=with_weights)
    zoo.check(model)
    assert _untyped_outputs(model) == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", TINY)
def test_half_precision_variants_are_valid(name: str, dtype: str) -> None:
    family, config = zoo.preset(name)
    opset = 22 if family == "resnet" and dtype == "bfloat16" else config.opset
    model = zoo.build(family, config, dtype=dtype, opset=opset)
    zoo.check(model)
    assert _untyped_outputs(model) == []
    assert model.graph.output[0].type.tensor_type.elem_type == zoo.DTYPES[dtype]


@pytest.mark.parametrize("opset", [18, 21])
def test_newer_opsets_are_valid(opset: int) -> None:
    model = zoo.build("llama-tiny", opset=opset)  # ReduceMean takes axes as input from 18
    zoo.check(model)
    assert _untyped_outputs(model) == []


@pytest.mark.parametrize("name", TINY)
def test_graph_conventions(name: str) -> None:
    model = zoo.build(name)
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert "Shape" not in {n.op_type for n in model.graph.node}
    # float initializer <=> trainable parameter (or a named BatchNorm buffer)
    assert all(t.data_type in FLOATS for t in model.graph.initializer)
    first = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert first.dim_param == "batch"
    assert model.graph.output[0].name == "logits"


def test_absent_weights_are_external_and_consecutive() -> None:
    model = zoo.build("gpt-tiny", dtype="float16")
    offset = 0
    for t in model.graph.initializer:
        entries = {e.key: e.value for e in t.external_data}
        assert t.data_location == TensorProto.EXTERNAL and not t.raw_data
        assert entries["location"] == "gpt.weights"
        assert int(entries["offset"]) == offset
        assert int(entries["length"]) == 2 * int(np.prod(t.dims))
        offset += int(entries["length"])


def test_hf_parameter_names() -> None:
    names = {t.name for t in zoo.build("gpt-tiny").graph.initializer}
    assert {"transformer.h.0.attn.c_attn.weight", "transformer.wte.weight"} <= names
    names = {t.name for t in zoo.build("llama-tiny").graph.initializer}
    assert "model.layers.1.self_attn.k_proj.weight" in names
    names = {t.name for t in zoo.build("resnet-tiny").graph.initializer}
    assert {"layer2.0.downsample.1.running_var", "fc.weight"} <= names


def test_save_and_load_tiny_with_weights(tmp_path: Path) -> None:
    family, config = zoo.preset("gpt-tiny")
    path = zoo.save(zoo.build(family, config, with_weights=True), tmp_path / "tiny.onnx")
    feed = _feed(family, config, np.random.default_rng(0))
    assert _run(onnx.load(path), feed).shape == (BATCH, SEQ, config.vocab)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"]


# ----------------------------------------------------------------------------------------
# Parameter counts
# ----------------------------------------------------------------------------------------

VARIANTS = [
    ("gpt", {"tied_head": False, "ffn": 48}),
    ("bert", {"head": "classifier", "num_labels": 5}),
    ("llama", {"kv_heads": 1, "tied_head": True}),
    ("resnet", {"block": "bottleneck", "layers": (1, 2), "image_size": 16}),
    ("moe", {"moe_every": 1, "experts": 3, "top_k": 1}),
]


@pytest.mark.parametrize("name", [*TINY, "gpt2-small", "bert-large", "llama-7b", "resnet50",
                                  "resnet18", "moe-small"])
def test_graph_parameter_count_matches_formula(name: str) -> None:
    family, config = zoo.preset(name)
    assert zoo.initializer_parameter_count(zoo.build(family, config)) == (
        zoo.parameter_count(family, config))


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_variant_parameter_count_matches_formula(family: str, overrides: dict) -> None:
    config = dataclasses.replace(zoo.preset(f"{family}-tiny")[1], **overrides)
    assert zoo.initializer_parameter_count(zoo.build(family, config)) == (
        zoo.parameter_count(family, config))


@pytest.mark.parametrize(("name", "literature"), [
    ("gpt2-small", 124_439_808),  # tied head, Hugging Face gpt2
    ("gpt2-xl", 1_557_611_200),
    ("bert-base", 110e6),
    ("bert-large", 335e6),
    ("llama-7b", 6.74e9),
    ("resnet50", 25_557_032),  # torchvision
    ("resnet18", 11_689_512),
    ("gpt3-175b", 175e9),
    ("gpt3-1.3b", 1.3e9),  # the paper's names are rounded to two figures: 2 % tolerance
    ("gpt3-6.7b", 6.7e9),
    ("gpt3-13b", 13e9),
    ("gpt-1t", 1008e9),  # Narayanan et al. 2021, Table 1: 1008 B
])
def test_parameter_count_matches_literature(name: str, literature: float) -> None:
    tolerance = 0.02 if name.startswith("gpt3-") and name != "gpt3-175b" else 0.01
    assert zoo.parameter_count(*zoo.preset(name)) == pytest.approx(literature, rel=tolerance)


def test_gpt3_175b_builds_fast_and_small(tmp_path: Path) -> None:
    family, config = zoo.preset("gpt3-175b")
    assert (config.layers, config.hidden, config.heads, config.vocab,
            config.max_positions) == (96, 12288, 96, 50257, 2048)
    start = time.perf_counter()
    model = zoo.build(family, config)
    assert time.perf_counter() - start < 10
    path = zoo.save(model, tmp_path / "gpt3.onnx")
    assert path.stat().st_size < 20 * 2**20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt3.onnx"]  # no weights file
    loaded = onnx.load(path, load_external_data=False)
    assert zoo.initializer_parameter_count(loaded) == pytest.approx(175e9, rel=0.01)
    entries = {e.key: e.value for e in loaded.graph.initializer[0].external_data}
    assert entries["location"] == "gpt3.weights"
    zoo.check(loaded)


# ----------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "overrides", "field"), [
    ("gpt", {"hidden": 100}, "hidden"),
    ("gpt", {"layers": 0}, "layers"),
    ("gpt", {"dtype": "int8"}, "dtype"),
    ("gpt", {"opset": 13}, "opset"),
    ("gpt", {"hiddn": 64}, "hiddn"),
    ("bert", {"head": "pooler"}, "head"),
    ("llama", {"kv_heads": 3}, "kv_heads"),
    ("llama", {"hidden": 4064, "heads": 32}, "heads"),  # odd head dim: no rotary
    ("llama", {"rope_theta": "big"}, "rope_theta"),
    ("resnet", {"layers": ()}, "layers"),
    ("resnet", {"dtype": "bfloat16"}, "opset"),
    ("moe", {"top_k": 9}, "top_k"),
    ("moe", {"capacity": 0}, "capacity"),
])
def test_bad_config_names_the_field(family: str, overrides: dict, field: str) -> None:
    with pytest.raises(ModelError, match=f"'{field}'"):
        zoo.build(family, **overrides)


def test_unknown_names_and_oversized_inline_weights() -> None:
    with pytest.raises(ModelError, match="family"):
        zoo.build("transformer-xl")
    with pytest.raises(ModelError, match="preset"):
        zoo.preset("gpt5")
    with pytest.raises(ModelError, match="GPTConfig"):
        zoo.build("gpt", zoo.preset("bert-tiny")[1])
    with pytest.raises(ModelError, match="with_weights=False"):
        zoo.build("gpt", layers=1, hidden=1024, heads=8, vocab=2**20, with_weights=True)


@pytest.mark.parametrize("family", ["gpt", "llama", "moe"])
def test_a_graph_past_the_node_bound_is_refused_before_it_is_built(family: str) -> None:
    """`zoo gpt --layers 100000` ran out of memory building 3.4 M nodes (protobuf crashed)."""
    started = time.perf_counter()
    with pytest.raises(ModelError, match=r"100000 layers: its graph would have about [\d,]+ "
                                          r"nodes .* use fewer layers"):
        zoo.build(family, layers=100_000)
    assert time.perf_counter() - started < 10
    assert len(zoo.build(family, layers=6).graph.node) < zoo.MAX_NODES
