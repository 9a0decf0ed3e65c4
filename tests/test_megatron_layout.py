"""Megatron-LM's tensor-parallel split: the baseline's layout and the `layout=megatron` pin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from planner import zoo
from planner.api import plan
from planner.errors import ShardplanError
from planner.importer import import_model
from planner.kinds import CollectiveKind, Phase
from planner.search.megatron import megatron_strategies
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.mesh import DeviceMesh
from planner.zoo.gpt import GPTConfig


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> GraphAnalysis:
    family, config = zoo.preset("llama-tiny")
    path = zoo.save(zoo.build(family, config), tmp_path_factory.mktemp("llama") / "l.onnx")
    return GraphAnalysis.of(import_model(Path(path), batch=2, dims={"seq": 16}))


def _tp_label(strategies, op: str) -> str | None:  # type: ignore[no-untyped-def]
    return next((label for label, axes in strategies[op].assignment if "tp" in axes), None)


def test_megatron_splits_columns_then_rows_and_the_vocabulary(llama: GraphAnalysis) -> None:
    """Column-parallel q, k, v, gate and up (their output dim), row-parallel o and down
    (the contracted dim), the embedding by vocabulary; norms and residuals replicated."""
    mesh = DeviceMesh.build({"dp": 1, "tp": 2}, 8)
    strategies = megatron_strategies(llama.graph, mesh, llama.labels)
    layer = "layers.1."
    labels = llama.labels
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        op = f"{layer}{name}.matmul"
        out = labels[op].outputs[0]
        assert _tp_label(strategies, op) == out[-1], op  # the output (column) dim
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        op = f"{layer}{name}.matmul"
        assert _tp_label(strategies, op) in labels[op].sum_labels, op  # the contracted dim
    for op in (f"{layer}input_layernorm.pow", f"{layer}attn_residual",
               f"{layer}post_attention_layernorm.scale"):
        assert _tp_label(strategies, op) is None, op
    assert _tp_label(strategies, "embed_tokens.gather") in labels["embed_tokens.gather"].sum_labels


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = GPTConfig(layers=2, hidden=256, heads=8, vocab=1024, max_positions=128,
                       fused_qkv=False)
    return zoo.save(zoo.build("gpt", config), tmp_path_factory.mktemp("gpt") / "gpt.onnx")


def test_layout_pin_prices_megatrons_all_reduces(gpt: Path) -> None:
    """Pinned to Megatron's split without sequence parallelism, each layer's two
    row-parallel GEMMs end in a tensor-parallel all-reduce in the forward pass (and their
    transposes in the backward)."""
    pins = {"dp": 2, "tp": 2, "pp": 1, "recompute": "none", "zero": 0}
    pinned = plan(gpt, devices=4, batch=8, dims={"seq": 128},
                  parallel={**pins, "layout": "megatron", "sp": 0})
    forward = [c for c in pinned.collectives
               if c.kind == CollectiveKind.ALL_REDUCE and c.phase == Phase.FORWARD
               and c.axes == ("tp",)]
    reduced = {c.tensor for c in forward}
    assert {f"h.{i}.{block}.c_proj.matmul" for i in (0, 1) for block in ("attn", "mlp")} \
        <= reduced
    searched = plan(gpt, devices=4, batch=8, dims={"seq": 128}, parallel=pins)
    assert searched.predicted.step_time_s <= pinned.predicted.step_time_s


def test_layout_pin_is_checked(gpt: Path) -> None:
    with pytest.raises(ShardplanError, match="--parallel layout=fast: choose one of megatron"):
        plan(gpt, devices=4, batch=8, dims={"seq": 128}, parallel={"tp": 2, "layout": "fast"})
    done = subprocess.run(
        [sys.executable, "-m", "planner.cli", "plan", str(gpt), "--devices", "4", "--batch",
         "8", "--dim", "seq=128", "--parallel", "tp=2,layout=fast"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "layout=fast" in done.stderr
    assert "Traceback" not in done.stderr


def test_sequence_parallelism_pin_swaps_all_reduces_for_scatters_and_gathers(gpt: Path) -> None:
    """`sp=1` (Megatron's layout with sequence parallelism): no tensor-parallel all-reduce
    is left in the forward pass; the row-parallel sums are reduce-scattered along the
    sequence and all-gathered before the next column-parallel GEMM. It fits in less
    activation memory than the layout without it."""
    pins = {"dp": 2, "tp": 2, "pp": 1, "recompute": "none", "zero": 0, "layout": "megatron"}
    plain = plan(gpt, devices=4, batch=8, dims={"seq": 128}, parallel={**pins, "sp": 0})
    sp = plan(gpt, devices=4, batch=8, dims={"seq": 128}, parallel={**pins, "sp": 1})
    forward = {(c.kind, c.tensor) for c in sp.collectives
               if c.phase == Phase.FORWARD and c.axes == ("tp",)}
    assert not any(kind == CollectiveKind.ALL_REDUCE for kind, _ in forward)
    assert (CollectiveKind.REDUCE_SCATTER, "h.0.attn.c_proj.matmul") in forward
    assert (CollectiveKind.ALL_GATHER, "h.0.ln_2") in forward
    assert sp.predicted.memory["activations"] < plain.predicted.memory["activations"]
    assert (plain.parallel.sp, sp.parallel.sp) == (0, 1)
    with pytest.raises(ShardplanError, match="--parallel sp=2"):
        plan(gpt, devices=4, batch=8, dims={"seq": 128}, parallel={"tp": 2, "sp": 2})


#: a transformer of `nn.Linear` projections on given embeddings (6 layers)
DENSE = "executor.module.probe:probe_6"


@pytest.fixture(scope="module")
def dense_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from executor.module.launch import export_builder

    return export_builder(DENSE, 4, tmp_path_factory.mktemp("dense") / "dense.onnx")


def test_megatron_splits_the_linear_layers_of_a_dynamo_export(dense_onnx: Path) -> None:
    """The dynamo exporter writes `nn.Linear` as MatMul(x, Transpose(W)): the GEMM's weight
    is computed from a parameter. Megatron's layout splits it all the same (q, k, v and up
    by their output dim, out and down by the contracted one), and carries the split back
    through the Transpose to the parameter, which is then stored split."""
    from costmodels.profile import load_profile
    from planner.api import load_graph
    from planner.cost.step import TrainingOptions
    from planner.plans.planning import plan_baseline

    graph = load_graph(dense_onnx, batch=4)
    analysis = GraphAnalysis.of(graph)
    mesh = DeviceMesh.build({"dp": 1, "tp": 2}, 8)
    strategies = megatron_strategies(graph, mesh, analysis.labels,
                                     weight_roots=analysis.weight_roots)
    producer = {o: op for op in graph.ops for o in op.outputs}
    kinds = {}
    for op in graph.ops:
        if op.op_type != "MatMul" or op.inputs[1] not in producer:
            continue
        transpose = producer[op.inputs[1]]
        if transpose.op_type != "Transpose":
            continue
        weight = transpose.inputs[0]
        label = _tp_label(strategies, op.name)
        assert label is not None, op.name
        out = analysis.labels[op.name].outputs[0]
        kinds[weight] = "column" if label == out[-1] else (
            "row" if label in analysis.labels[op.name].sum_labels else "other")
        assert _tp_label(strategies, transpose.name) is not None, transpose.name
    for layer in range(6):
        for name, kind in (("q", "column"), ("k", "column"), ("v", "column"),
                           ("out", "row"), ("up", "column"), ("down", "row")):
            assert kinds[f"blocks.{layer}.{name}.weight"] == kind, (layer, name)
    baseline = plan_baseline(graph, load_profile("a100-80g"), 2, "megatron", TrainingOptions())
    split = {name for name, entry in baseline.tensors.items()
             if entry.kind == "parameter" and any(entry.layout.dims)}
    projections = {f"blocks.{i}.{n}.weight" for i in range(6)
                   for n in ("q", "k", "v", "out", "up", "down")}
    assert projections <= split
    # the pin lays the search's tp configurations out the same way
    pinned = plan(dense_onnx, profile="a100-80g", devices=2, batch=4,
                  parallel={"tp": 2, "layout": "megatron", "pp": 1, "micro_batches": 1})
    assert projections <= {name for name, entry in pinned.tensors.items()
                           if entry.kind == "parameter" and any(entry.layout.dims)}


@pytest.mark.slow
def test_the_megatron_baseline_of_a_dynamo_export_trains_as_one_process(
        dense_onnx: Path) -> None:
    """The module executor runs that layout to one process's losses with the plan's
    collectives, no more, no fewer (the attention's heads merged by a view of a
    transposed DTensor whose block, one head per rank, is contiguous while the whole is
    not: `executor.module.kernels.run_op` views a contiguous copy)."""
    from costmodels.profile import load_profile
    from executor.module.launch import train_module, train_module_reference
    from planner.api import load_graph
    from planner.cost.step import TrainingOptions
    from planner.plans.planning import plan_baseline

    baseline = plan_baseline(load_graph(dense_onnx, batch=4), load_profile("cpu"), 2,
                             "megatron", TrainingOptions())
    run = train_module(DENSE, baseline, steps=3, batch_size=4)
    reference = train_module_reference(DENSE, steps=3, batch_size=4)
    assert run.losses == pytest.approx(reference, rel=1e-4)
    assert run.differences == []


def test_the_pin_plans_gpt2s_conv1d_export_without_sequence_parallelism(
        tmp_path: Path) -> None:
    """GPT-2's Conv1D GEMMs read the sequence merged with the batch (a [batch·seq, h]
    view), which tp never splits: Megatron's sequence parallelism has no layout there
    but at a micro-batch of one row, and what it lays out there is no sequence split by
    the plan's reading. Unpinned, the search leaves the configurations without a layout
    out and plans the rest (it refused the whole pin); pinned, `sp=1` is refused in one
    line that says why (it said that no plan fits in 11.8 GiB, while the smallest needed
    1.3 MiB)."""
    from executor.module.launch import export_builder

    path = export_builder("examples.hf_models:gpt2", 8, tmp_path / "gpt2.onnx")
    pinned = {"layout": "megatron", "tp": 2, "dp": 1, "pp": 1}
    found = plan(path, devices=2, batch=8, profile="cpu", parallel=pinned)
    assert (found.parallel.tp, found.parallel.sp) == (2, 0)
    projections = {n for n, e in found.tensors.items() if e.kind == "parameter"
                   and n.endswith(("c_fc.weight", "mlp.c_proj.weight")) and any(e.layout.dims)}
    assert len(projections) == 4  # the MLP's two GEMMs in both layers, split by tp
    with pytest.raises(ShardplanError, match=r"sp=1: \d+ plan\(s\) fit, but none splits "
                                             r"the activations between blocks along the "
                                             r"sequence") as refused:
        plan(path, devices=2, batch=8, profile="cpu", parallel={**pinned, "sp": 1})
    assert "\n" not in str(refused.value)


def test_sequence_parallelism_pins_plan_llamas_dynamo_export(tmp_path: Path) -> None:
    """Megatron's sequence parallelism on LLaMA's dynamo export, down to one row per
    micro-batch: the rotary tables (computed from positions alone) stay whole, and a
    micro-batch of one row keeps its own dims' labels (a size-1 batch labels the graph's
    dims apart from the whole batch's: the kv heads' split was refused as if it split the
    batch). Both had refused the pin."""
    from executor.module.launch import export_builder

    path = export_builder("examples.hf_models:llama", 8, tmp_path / "llama.onnx")
    for micro_batches in (1, 8):
        found = plan(path, devices=2, batch=8, profile="a100-80g",
                     parallel={"layout": "megatron", "tp": 2, "dp": 1, "pp": 1, "sp": 1,
                               "micro_batches": micro_batches})
        assert (found.parallel.tp, found.parallel.sp) == (2, 1)
        assert found.parallel.micro_batches == micro_batches
        rotary = [op for op in found.ops if op.op_type == "Mul" and any(
            b is not None and b.tensor.endswith("inv_freq") for b in op.inputs)]
        assert rotary and all(not any(b.layout.dims[d] for b in op.outputs if b
                                      for d in range(len(b.layout.dims))) for op in rotary)
