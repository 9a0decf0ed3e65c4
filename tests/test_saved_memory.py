"""What autograd keeps, summed over a GPT layer, against Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198) counts
the bytes one transformer layer keeps for the backward pass in 16-bit training with
dropout: §4.1, eq. 1: sbh(34 + 5as/h) without parallelism; §4.2.2, eq. 2: with tensor
parallelism over t, sbh(10 + 24/t + 5as/(ht)); eq. 3: with sequence parallelism too,
sbh/t (34 + 5as/h); with flash attention the s² terms vanish.
The layout is Megatron-LM's (`planner.search.megatron`), on the zoo GPT with separate q, k,
v projections (a fused [h, 3h] projection's Split cannot carry the head split).
The planner's per-op rules (`planner.ops.saving`) and kernels (`planner.cost.kernels`)
must add up to the same, plus what the formulas leave out: a layer norm's fp32 mean and
inverse std per row (2 · 4 bytes for each of 2 norms) and, under flash attention, the
kernel's fp32 log-sum-exp per query row.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from costmodels.profile import load_profile
from planner import zoo
from planner.cost.kernels import KernelPolicy, kernel_plan
from planner.cost.oplevel import priced_choice
from planner.cost.step import TrainingOptions
from planner.importer import import_model
from planner.kinds import AttentionKernel, AxisRole, Fusion
from planner.search.megatron import megatron_strategies
from planner.sharding.analysis import GraphAnalysis
from planner.sharding.mesh import DeviceMesh
from planner.zoo.gpt import GPTConfig

S, B, H, A = 64, 2, 128, 4  # sequence, micro-batch, hidden, heads
LAYER = "h.1."  # a middle layer: its own tensors and the next layer's input


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> GraphAnalysis:
    config = GPTConfig(layers=3, hidden=H, heads=A, vocab=256, max_positions=S, dropout=0.1,
                       dtype="bfloat16", fused_qkv=False)
    path = zoo.save(zoo.build("gpt", config), tmp_path_factory.mktemp("gpt") / "gpt.onnx")
    return GraphAnalysis.of(import_model(Path(path), batch=B, dims={"seq": S}))


def _layer_bytes(analysis: GraphAnalysis, policy: KernelPolicy, tp: int = 1,
                 sequence_parallel: bool = False) -> float:
    """Bytes one device keeps for one layer under Megatron's split over `tp`."""
    graph = analysis.graph
    mesh = DeviceMesh.build({AxisRole.DATA: 1, AxisRole.TENSOR: tp}, 8)
    strategies = megatron_strategies(graph, mesh, analysis.labels,
                                     sequence_parallel=sequence_parallel)
    options = TrainingOptions(attention=policy.attention, fusion=policy.fusion)
    priced = priced_choice(analysis, mesh, strategies, load_profile("a100-80g"), options)
    return sum(cost.saved_bytes for node, cost in zip(graph.ops, priced.costs, strict=True)
               if node.name.startswith(LAYER))


def _extras(flash: bool, tp: int = 1) -> float:
    norms = 2 * S * B * 2 * 4  # two layer norms, fp32 mean and inverse std per row
    log_sum_exp = B * A * S * 4 / tp if flash else 0.0
    return norms + log_sum_exp


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_eager_attention_keeps_korthikanti_bytes(gpt: GraphAnalysis, tp: int) -> None:
    """Eq. 2 (eq. 1 at t = 1): sbh(10 + 24/t + 5as/(ht)) under eager attention with the
    elementwise chains fused (Megatron's fused softmax and bias-GELU kernels)."""
    sbh = S * B * H
    expected = sbh * (10 + 24 / tp + 5 * A * S / (H * tp)) + _extras(False)
    got = _layer_bytes(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.ELEMENTWISE), tp)
    assert got == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallelism_divides_every_term_by_t(gpt: GraphAnalysis, tp: int) -> None:
    """§4.2.2, eq. 3: with sequence parallelism sbh/t (34 + 5as/h): the norms, dropouts and
    the column-parallel GEMMs' inputs are kept split along the sequence."""
    sbh = S * B * H
    expected = sbh / tp * (34 + 5 * A * S / H) + _extras(False) / tp
    got = _layer_bytes(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.ELEMENTWISE), tp,
                       sequence_parallel=True)
    assert got == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("tp", [1, 4])
def test_flash_attention_keeps_the_s_linear_form(gpt: GraphAnalysis, tp: int) -> None:
    """Flash attention: no s² term, sbh(10 + 24/t), and its softmax statistics."""
    expected = S * B * H * (10 + 24 / tp) + _extras(True, tp)
    got = _layer_bytes(gpt, KernelPolicy(AttentionKernel.FLASH, Fusion.ELEMENTWISE), tp)
    assert got == pytest.approx(expected, rel=1e-9)


def test_unfused_ops_keep_what_eager_autograd_keeps(gpt: GraphAnalysis) -> None:
    """One kernel per op keeps every intermediate a rule asks for: the decomposed tanh
    GELU keeps x for x³ (8sbh), tanh's output (8sbh) and both factors of the last product
    (16sbh) where the fused kernel keeps only its input (8sbh): 24sbh more."""
    sbh = S * B * H
    fused = _layer_bytes(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.ELEMENTWISE))
    eager = _layer_bytes(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.NONE))
    assert eager - fused == pytest.approx(24 * sbh, rel=1e-9)


def test_selective_recompute_drops_exactly_the_attention_cores(gpt: GraphAnalysis) -> None:
    """Korthikanti §4.2: selective recompute keeps 34sbh of 34sbh + 5as²b."""
    plan = kernel_plan(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.ELEMENTWISE))
    tensors = gpt.graph.tensors
    dropped = sum(plan.saved[name] * tensors[name].nbytes
                  for name in plan.dropped_by_selective if name.startswith(LAYER))
    assert dropped == pytest.approx(5 * A * S * S * B, rel=1e-9)
    assert len(plan.cores) == 3  # one per layer


def test_fused_elementwise_reads_and_writes_once(gpt: GraphAnalysis) -> None:
    """The bias-GELU region of an MLP reads the GEMM's output and the bias, and writes
    the GELU's output: one pass over memory, one launch, instead of a pass per node."""
    plan = kernel_plan(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.ELEMENTWISE))
    region = next(r for r in plan.regions if f"{LAYER}mlp.gelu.mul" in r)
    assert f"{LAYER}mlp.c_fc.bias_add" in region
    moved = sum(plan.ops[op].bytes for op in region)
    ffn = S * B * 4 * H * 2
    scalars = 5 * 2  # the tanh formula's constants 0.5, 3, 0.044715, sqrt(2/pi), 1
    assert moved == pytest.approx(2 * ffn + 4 * H * 2 + scalars, rel=1e-9)
    assert sum(plan.ops[op].launches for op in region) == 1
    unfused = kernel_plan(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.NONE))
    assert sum(unfused.ops[op].bytes for op in region) > 8 * moved


def test_flash_core_moves_no_s_squared_bytes(gpt: GraphAnalysis) -> None:
    """A flash core reads q, k, v and writes its output once; both GEMMs' FLOPs stay and
    the backward is 5 GEMMs to the forward's 2."""
    flash = kernel_plan(gpt, KernelPolicy(AttentionKernel.FLASH, Fusion.NONE))
    eager = kernel_plan(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.NONE))
    core = next(c for c in flash.cores if c.first.startswith(LAYER))
    ops = (core.first, *core.between, core.last)
    assert sum(flash.ops[op].bytes for op in ops) < 0.2 * sum(eager.ops[op].bytes for op in ops)
    assert sum(flash.ops[op].flops for op in ops) >= sum(
        gpt.graph.op(op).flops for op in (core.first, core.last))
    first, last = flash.ops[core.first], flash.ops[core.last]
    forward = first.flops + last.flops
    backward = first.backward_ratio * first.flops + last.backward_ratio * last.flops
    assert backward / forward == pytest.approx(2.5)


def test_a_fused_softmax_writes_its_probabilities_and_dropout_runs_after_it(
        gpt: GraphAnalysis) -> None:
    """Megatron's fused scale-mask-softmax reads the scores and writes the probabilities
    (2 · a s² b bytes each way in 16-bit, and the causal mask); the attention dropout is
    a kernel of its own that reads them and writes its output and a 1-byte mask."""
    plan = kernel_plan(gpt, KernelPolicy(AttentionKernel.EAGER, Fusion.ELEMENTWISE))
    core = f"{LAYER}attn.core."
    softmax = next(r for r in plan.regions if f"{core}softmax" in r)
    assert f"{core}scale" in softmax and f"{core}dropout" not in softmax
    scores = A * S * S * B * 2
    mask = B * S * S  # the causal mask, read once (bool)
    constants = 2 * 2  # the scale and the fill value
    moved = sum(plan.ops[op].bytes for op in softmax)
    assert moved == pytest.approx(2 * scores + mask + constants, rel=1e-9)
    dropout = plan.ops[f"{core}dropout"]
    assert dropout.launches == 1
    ratio_and_mode = 2 + 1  # the dropout ratio (16-bit) and training_mode (bool)
    assert dropout.bytes == pytest.approx(2 * scores + scores / 2 + ratio_and_mode, rel=1e-9)
