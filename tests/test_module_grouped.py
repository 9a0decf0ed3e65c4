"""Grouped-query attention run with K and V as they are (`executor.module.grouped`): the
trace's repeat of each K/V head is taken out where attention runs locally, and the
attention is the same."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.fx import GraphModule

from examples.hf_models import megatron_strategies
from executor.module.grouped import group_attention
from executor.module.launch import (
    export_builder,
    load_builder,
    shared_trace,
    train_module,
    train_module_reference,
)
from executor.module.layouts import read_layouts
from executor.module.local import LocalPlan
from executor.module.parallelize import _Trace, parameter_names
from planner.api import load_graph, plan

LLAMA = "examples.hf_models:llama"
BATCH = 4
SDPA = torch.ops.aten.scaled_dot_product_attention.default


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_builder(LLAMA, BATCH, tmp_path_factory.mktemp("grouped") / "llama.onnx")


def _trace() -> tuple[GraphModule, dict, dict[str, str]]:
    module, make_batch, _ = load_builder(LLAMA)()
    module.train()
    trace = _Trace.of(module, make_batch(0, BATCH), shared_trace(LLAMA, BATCH))
    reads = {name: name for names in parameter_names(module) for name in names}
    return trace.graph, make_batch(0, BATCH), reads


def _local_nodes(graph: GraphModule, reads: dict[str, str], chosen) -> frozenset[str]:
    names = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    layouts = read_layouts(chosen, names, {n.name for n in graph.graph.nodes})
    return LocalPlan.of(graph, layouts, chosen.mesh, reads).nodes


def _ops(graph: GraphModule) -> Counter:
    return Counter(str(n.target) for n in graph.graph.nodes if n.op == "call_function")


def test_local_attention_reads_the_grouped_heads_and_computes_the_same(
        exported: Path) -> None:
    """On a data-parallel plan each layer's SDPA reads K and V grouped (2 key/value heads
    for 4 query heads) with `enable_gqa=True`; the repeats' nodes are gone, and the logits
    and every weight's gradient are those of the trace as exported."""
    chosen = plan(exported, devices=2, batch=BATCH, profile="cpu", mode="data")
    graph, data, reads = _trace()
    before = _ops(graph)
    assert group_attention(graph, _local_nodes(graph, reads, chosen)) == 2
    after = _ops(graph)
    assert before["aten.expand.default"] - after["aten.expand.default"] == 4
    assert before["aten.clone.default"] - after["aten.clone.default"] == 4
    for node in graph.graph.nodes:
        if node.target is SDPA:
            assert node.kwargs["enable_gqa"]
            assert [a.meta["val"].shape[1] for a in node.args[:3]] == [4, 2, 2]
    reference, _, _ = _trace()
    outputs = []
    for module in (graph, reference):
        weights = [p for _, p in sorted(module.named_parameters())]
        logits = module(**data)  # the trace's one output
        outputs.append((logits, torch.autograd.grad(logits.square().mean(), weights)))
    (ours, our_grads), (theirs, their_grads) = outputs
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for mine, expected in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-6)


def test_attention_on_split_heads_keeps_the_repeat(exported: Path) -> None:
    """Under Megatron's split the heads are split over the ranks and attention runs on
    DTensors: nothing is rewritten."""
    chosen = plan(exported, devices=2, batch=BATCH, profile="a100-80g", mode="semi",
                  strategies=megatron_strategies(load_graph(exported, batch=BATCH)),
                  mesh=(2,))
    graph, _, reads = _trace()
    before = _ops(graph)
    assert group_attention(graph, _local_nodes(graph, reads, chosen)) == 0
    assert _ops(graph) == before


def test_a_recompute_segment_edge_is_kept(exported: Path) -> None:
    """A repeat whose node a recompute segment starts or ends at stays (the run finds its
    segments by those names)."""
    chosen = plan(exported, devices=2, batch=BATCH, profile="cpu", mode="data")
    graph, _, reads = _trace()
    local = _local_nodes(graph, reads, chosen)
    first = next(n for n in graph.graph.nodes if n.target is SDPA)
    edge = first.args[1].args[0].name  # inside the first layer's key repeat
    assert group_attention(graph, local, {edge}) == 1


@pytest.mark.slow
def test_grouped_attention_with_dropout_draws_the_unsplit_masks(tmp_path: Path) -> None:
    """With dropout on the attention probabilities, the rewritten trace draws every mask
    where the export put it (`executor.module.run.node_places`): the one-device and
    2-rank data-parallel runs equal the unsplit reference (before, the erased repeats
    renumbered every later draw: 1.1e-3 relative after 5 steps)."""
    spec = f"{Path(__file__).resolve().parent / 'grouped_models.py'}:llama_attention_dropout"
    model = export_builder(spec, BATCH, tmp_path / "llama.onnx")
    alone = train_module_reference(spec, steps=5, batch_size=BATCH)
    for devices in (1, 2):
        chosen = plan(model, batch=BATCH, devices=devices, profile="cpu", mode="data")
        run = train_module(spec, chosen, steps=5, batch_size=BATCH)
        assert run.losses == pytest.approx(alone, rel=1e-4), devices
        assert run.differences == []
