"""Which ops of a traced module run on plain local tensors (`executor.module.local`): all
that the plan splits as data parallelism would, none that it splits otherwise."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.fx import GraphModule

from examples.hf_models import megatron_strategies
from executor.module.launch import export_builder, load_builder, shared_trace
from executor.module.layouts import read_layouts
from executor.module.local import LocalPlan, is_size
from executor.module.parallelize import _Trace, parameter_names
from planner.api import load_graph, plan
from planner.plans.model import Plan
from planner.sharding.layout import Layout

LLAMA = "examples.hf_models:llama"
BATCH = 4


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[GraphModule, dict, Path]:
    module, make_batch, _ = load_builder(LLAMA)()
    module.train()
    path = export_builder(LLAMA, BATCH, tmp_path_factory.mktemp("local") / "llama.onnx")
    trace = _Trace.of(module, make_batch(0, BATCH), shared_trace(LLAMA, BATCH))
    reads = {name: name for names in parameter_names(module) for name in names}
    return trace.graph, reads, path


def _local(graph: GraphModule, reads: dict, chosen: Plan) -> tuple[LocalPlan, Counter]:
    names = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    layouts = read_layouts(chosen, names, {n.name for n in graph.graph.nodes})
    found = LocalPlan.of(graph, layouts, chosen.mesh, reads)
    others = Counter(str(n.target) for n in graph.graph.nodes
                     if n.op == "call_function" and not is_size(n) and
                     n.name not in found.nodes)
    return found, others


def test_a_data_parallel_plan_runs_every_op_on_the_batch_locally(traced: tuple) -> None:
    graph, reads, path = traced
    chosen = plan(path, devices=2, batch=BATCH, profile="cpu", mode="data",
                  parallel={"zero": 0})
    found, others = _local(graph, reads, chosen)
    assert found.batch_axes == ("dp",) and found.degree == 2
    # what is left runs on whole tensors the graph makes (positions, rotary tables):
    # no op on the batch's rows goes through DTensor
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and node.name not in found.nodes and isinstance(
                value, torch.Tensor):
            assert not any(isinstance(s, torch.SymInt) for s in value.shape), node.name
    assert "aten.scaled_dot_product_attention.default" not in others
    assert sum(others.values()) < len(found.nodes) / 4
    # so every weight is read as a plain tensor (WeightSync.leaves), as DDP reads it
    assert found.local_weights(graph, reads) == set(reads.values())


def test_a_tensor_parallel_plan_keeps_its_split_ops_on_dtensors(traced: tuple) -> None:
    graph, reads, path = traced
    chosen = plan(path, devices=2, batch=BATCH, profile="a100-80g", mode="semi",
                  strategies=megatron_strategies(load_graph(path, batch=BATCH)), mesh=(2,))
    found, others = _local(graph, reads, chosen)
    assert found.batch_axes == () and found.degree == 1
    assert others["aten.linear.default"] == 14  # every projection splits a weight
    # the norms and residual adds between the layers are whole on both ranks: local
    norms = [n for n in graph.graph.nodes if n.target is torch.ops.aten.rsqrt.default]
    assert norms and all(n.name in found.nodes for n in norms)
    # the projections' weights stay DTensors; the norms', the embedding's and the head's,
    # whole on both ranks (Megatron's pins split only the projections) and read by local
    # ops only, are plain reads
    plain = found.local_weights(graph, reads)
    assert {n for n in plain if "norm" in n} == {n for n in reads.values() if "norm" in n}
    assert {"model.lm_head.weight", "model.model.embed_tokens.weight"} <= plain
    assert not any("_proj." in name for name in plain)


def test_natural_layouts_follow_the_symbolic_dim(traced: tuple) -> None:
    graph, _, _ = traced
    found = LocalPlan(("dp",), 2, frozenset())
    values = [n.meta["val"] for n in graph.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)]
    batched = next(v for v in values if v.dim() == 3 and isinstance(v.shape[0], torch.SymInt))
    assert found.natural(batched) == Layout.split(3, 0, ("dp",))
    whole = next(v for v in values if not any(isinstance(s, torch.SymInt) for s in v.shape))
    assert found.natural(whole) == Layout.replicated(whole.dim())
