"""Shape-only attention masks the export materialises run as `is_causal` (or no mask),
as eager transformers runs them (`executor.module.masks`)."""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph

from executor.module import masks
from executor.module.launch import load_builder, shared_trace
from executor.module.masks import MaskKind, mask_kind, shape_only
from executor.module.parallelize import _Trace
from executor.module.run import run_unsplit

aten = torch.ops.aten


def test_mask_kinds() -> None:
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    assert mask_kind(causal) is MaskKind.CAUSAL
    lowest = torch.finfo(torch.float32).min
    additive = torch.zeros(6, 6).masked_fill(~causal[0, 0], lowest).expand(2, 1, 6, 6)
    assert mask_kind(additive) is MaskKind.CAUSAL
    assert mask_kind(torch.ones(2, 1, 6, 6, dtype=torch.bool)) is MaskKind.NONE
    padded = causal.clone()
    padded[1, :, :, 0] = False  # a padding mask: row 1's first token hidden
    assert mask_kind(padded) is MaskKind.OTHER
    bias = torch.arange(6.0).expand(6, 6)  # ALiBi-like: added, not a mask
    assert mask_kind(bias) is MaskKind.OTHER
    assert mask_kind(torch.ones(4, 6, dtype=torch.bool).tril()) is MaskKind.OTHER


def test_only_masks_from_shapes_are_shape_only() -> None:
    graph = Graph()
    ids = graph.placeholder("ids")
    ones = graph.call_function(aten.new_ones.default, (ids, [4, 4]))
    from_shape = graph.call_function(aten.tril.default, (ones,))
    from_values = graph.call_function(aten.gt.Scalar, (ids, 0))
    assert shape_only(from_shape)
    assert not shape_only(from_values)


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "kind"), [("examples.hf_models:llama", MaskKind.CAUSAL),
                                            ("examples.hf_models:gpt2", MaskKind.CAUSAL),
                                            ("examples.hf_models:bert", MaskKind.NONE)])
def test_the_trace_runs_the_mask_eager_runs(spec: str, kind: MaskKind) -> None:
    """The transformers models' exports build their masks from shapes; the trace sees
    them as causal (decoders) or keep-all (BERT without padding), runs SDPA as eager
    does, and gives eager's output (LLaMA: no dropout)."""
    module, make_batch, _ = load_builder(spec)()
    module.train()
    batch = make_batch(0, 4)
    trace = _Trace.of(module, batch, shared_trace(spec, 4))
    trace.share_parameters(dict(module.named_parameters(remove_duplicate=False)))
    output = trace.outputs(run_unsplit(trace.graph, trace.inputs((), batch), 0, 1))
    nodes = [n for n in trace.graph.graph.nodes if n.target is masks.SDPA]
    assert nodes and all(set(n.meta["shardplan.mask"].values()) == {kind} for n in nodes)
    if spec.endswith("llama"):
        eager, _, _ = load_builder(spec)()
        eager.train()
        expected = eager(**batch).detach()
        assert torch.allclose(output.detach(), expected, rtol=1e-5, atol=1e-6)
