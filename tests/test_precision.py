"""Training precision: bytes per parameter by category, activation and GEMM dtypes."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch

from costmodels.memory import training_memory
from costmodels.precision import (
    accumulation_bytes,
    default_precision,
    optimizer_step_bytes,
    parameter_bytes,
    policy,
)
from costmodels.profile import load_profile
from planner import zoo
from planner.api import plan
from planner.cost.kernels import KernelPolicy, kernel_plan
from planner.errors import ShardplanError
from planner.importer import import_model
from planner.kinds import AttentionKernel, Fusion, Precision
from planner.plans.model import Plan
from planner.sharding.analysis import GraphAnalysis
from tests.traffic import NoViews, Traffic


@pytest.mark.parametrize("precision,total", [
    ("fp32", 16), ("tf32", 16), ("bf16", 8), ("fp16", 8), ("bf16-mixed", 18),
    ("fp16-mixed", 20), ("fp8", 18)])
def test_adam_bytes_per_parameter(precision: str, total: float) -> None:
    """Megatron-LM's table (docs/source/distrib_optimizer.md): fp32 16 B, bf16 weights
    with fp32 main gradients 18 B, fp16 weights with fp16 gradients 20 B (the fp32 main
    gradients made at the step); pure 16-bit AdamW keeps 16-bit moments: 8 B."""
    assert parameter_bytes(Precision(precision), 4, "adam").total == total


@pytest.mark.parametrize("zero", [0, 1])
def test_fp16_main_gradients_count_only_where_they_outgrow_the_activations(zero: int) -> None:
    """fp16-mixed keeps 16-bit gradients through the backward pass; the fp32 main
    gradients exist at the step, when no activations are held. So the peak is the larger
    of the backward pass's (activations) and the step's (main gradients), which shard
    with the optimizer states under ZeRO 1 (Megatron-LM's distributed optimizer)."""
    elements, dp = 1_000_000, 4
    main = 4 * (elements / dp if zero else elements)

    def peak(activations: float) -> float:
        return training_memory(parameter_bytes=2 * elements, parameter_elements=elements,
                               parameter_itemsize=2, activation_bytes=activations,
                               workspace_bytes=0.0, zero=zero, dp=dp,
                               precision=Precision.FP16_MIXED, rounded=False).peak

    states = 2 * elements + 2 * elements + 12 * (elements / dp if zero else elements)
    assert peak(10 * main) == pytest.approx(states + 10 * main)  # the backward pass's
    assert peak(main / 4) == pytest.approx(states + main)  # the step's
    bf16 = training_memory(parameter_bytes=2 * elements, parameter_elements=elements,
                           parameter_itemsize=2, activation_bytes=0.0, workspace_bytes=0.0,
                           precision=Precision.BF16_MIXED, rounded=False)
    assert bf16.peak == 18 * elements and bf16.workspace == 0


def test_a_precision_left_unset_is_the_graphs_own() -> None:
    assert default_precision("float32") is Precision.FP32
    assert default_precision("bfloat16") is Precision.BF16_MIXED
    assert parameter_bytes(None, 2, "adam") == parameter_bytes(Precision.BF16_MIXED, 2, "adam")
    assert parameter_bytes(None, 4, "sgd").total == 8
    with pytest.raises(ValueError, match="unknown precision"):
        policy("fp4")


@pytest.fixture(scope="module")
def gpt32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("precision") / "gpt.onnx"
    onnx.save(zoo.build("gpt2-small", layers=2, hidden=256, heads=4, vocab=2048), path)
    return path


def _plan(path: Path, **options):
    return plan(path, devices=1, batch=8, dims={"seq": 128}, mode="data", **options)


def test_bf16_mixed_halves_weights_and_activations_of_an_fp32_export(gpt32: Path) -> None:
    fp32 = _plan(gpt32)
    mixed = _plan(gpt32, precision="bf16-mixed")
    assert fp32.step.precision == "fp32" and mixed.step.precision == "bf16-mixed"
    a, b = fp32.predicted.memory, mixed.predicted.memory
    assert b["parameters"] == pytest.approx(a["parameters"] / 2, rel=1e-6)
    assert b["gradients"] == a["gradients"]  # fp32 main gradients either way
    assert b["optimizer"] == pytest.approx(a["optimizer"] * 12 / 8, rel=1e-6)
    assert b["activations"] == pytest.approx(a["activations"] / 2, rel=0.02)
    # 16x the GEMM peak (19.5 -> 312 TFLOP/s on an A100), half the bytes; kernel ramps and
    # launches weigh on a model this small.
    assert mixed.predicted.step_time_s < fp32.predicted.step_time_s / 2


def test_tf32_and_fp8_run_gemms_at_their_own_peaks(gpt32: Path) -> None:
    """TF32 keeps fp32 bytes but runs GEMMs on the tensor cores; fp8 runs them at the fp8
    peak with bf16 storage; a device without an fp8 peak refuses in one line."""
    fp32 = _plan(gpt32, profile="h100-sxm")
    tf32 = _plan(gpt32, profile="h100-sxm", precision="tf32")
    bf16 = _plan(gpt32, profile="h100-sxm", precision="bf16-mixed")
    fp8 = _plan(gpt32, profile="h100-sxm", precision="fp8")
    assert tf32.predicted.memory == fp32.predicted.memory
    assert tf32.predicted.compute_s < fp32.predicted.compute_s
    assert fp8.predicted.memory == bf16.predicted.memory
    assert fp8.predicted.compute_s < bf16.predicted.compute_s
    with pytest.raises(ShardplanError, match="no fp8 peak"):
        _plan(gpt32, profile="a100-80g", precision="fp8")


def test_cli_prints_the_precision_and_refuses_an_unknown_one(gpt32: Path) -> None:
    base = [sys.executable, "-m", "planner.cli", "plan", str(gpt32), "--devices", "1",
            "--batch", "8", "--dim", "seq=128", "--mode", "data"]
    done = subprocess.run([*base, "--precision", "bf16-mixed", "--attention", "eager"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "precision  bf16-mixed: 2 B weights + 4 B gradients + 4 B master + 8 B adam " \
           "= 18 B per parameter" in done.stdout
    assert "kernels    attention eager, fusion elementwise" in done.stdout
    fp16 = subprocess.run([*base, "--precision", "fp16-mixed"], capture_output=True,
                          text=True, timeout=120)
    assert "precision  fp16-mixed: 2 B weights + 2 B gradients + 4 B master + 8 B adam " \
           "+ 4 B fp32 gradients at the step = 20 B per parameter" in fp16.stdout
    bad = subprocess.run([*base, "--precision", "fp4"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--precision" in bad.stderr


def _optimizer_steps(names: tuple[str, ...], fused: bool) -> list[tuple[str, Callable]]:
    made = {"adam": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False, fused=fused),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False, fused=fused),
            "momentum": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=False,
                                                  fused=fused),
            "sgd": lambda p: torch.optim.SGD(p, lr=1e-3, foreach=False, fused=fused)}
    return [(name, made[name]) for name in names]


def _counted_step(make: Callable, master: torch.nn.Parameter, step: Callable[[], None]
                  ) -> int:
    """Bytes the second of two optimizer steps reads and writes (the first creates the
    states), counted op by op; `step` runs after the update (a copy back, a check)."""
    optimizer = make([master])
    for _ in range(2):
        master.grad = torch.randn(master.shape, dtype=master.dtype)
        counter = Traffic(least=master.numel())
        with counter:
            optimizer.step()
            step()
    return counter.bytes


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name,make", _optimizer_steps(("adam", "adamw", "momentum", "sgd"),
                                                       fused=False))
def test_the_optimizer_traffic_is_what_torch_optim_runs(name: str, make: Callable,
                                                        fused: bool) -> None:
    """`optimizer_step_bytes` in fp32 is the bytes torch.optim's own kernels read and
    write in a step, counted op by op: unfused, its single-tensor kernels one after
    another; fused (`fused=True`, one kernel), each byte once."""
    make = dict(_optimizer_steps((name,), fused))[name]
    weight = torch.nn.Parameter(torch.randn(4096))
    counted = _counted_step(make, weight, lambda: None)
    assert counted == 4096 * optimizer_step_bytes(policy("fp32"), name, fused)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_a_mixed_precision_step_moves_what_its_kernels_do(precision: str) -> None:
    """A `-mixed` step as Megatron-LM runs it, in torch's kernels: under fp16 the 16-bit
    gradient cast into the fp32 main gradient (`_copy_model_grads_to_main_grads`) and the
    loss scaler's unscale and inf/NaN check of it; the fused Adam update of the fp32
    master from the fp32 main gradient; the 16-bit weights copied back from the master.
    The bytes they move, counted op by op, are `optimizer_step_bytes`."""
    dtype = torch.float16 if precision.startswith("fp16") else torch.bfloat16
    master = torch.nn.Parameter(torch.randn(4096))
    weight = torch.empty(4096, dtype=dtype)
    kept = torch.randn(4096, dtype=dtype)  # fp16: the accumulated 16-bit gradient
    found_inf, inverse_scale = torch.zeros(()), torch.full((), 1 / 1024)

    def cast_unscale_update_copy_back(optimizer_step: Callable[[], None]) -> Callable[[], None]:
        def step() -> None:
            if dtype == torch.float16:
                master.grad = kept.float()
                torch._amp_foreach_non_finite_check_and_unscale_(
                    [master.grad], found_inf, inverse_scale)
            optimizer_step()
            with torch.no_grad():
                weight.copy_(master)
        return step

    optimizer = torch.optim.Adam([master], lr=1e-3, fused=True)
    for _ in range(2):
        if dtype == torch.bfloat16:
            master.grad = torch.randn(4096)  # bf16: the fp32 main gradient accumulated
        counter = Traffic(least=4096)
        with counter:
            cast_unscale_update_copy_back(optimizer.step)()
    assert counter.bytes == 4096 * optimizer_step_bytes(policy(precision), "adam", True)
    # 4 B gradient, 8 master, 16 moments, 6 copied back; fp16: 6 cast, 8 unscaled
    assert optimizer_step_bytes(policy(precision), "adam", True) == \
        (48 if dtype == torch.float16 else 34)


@pytest.mark.parametrize("micro_batches", [1, 2, 5])
def test_autograd_accumulates_fp32_gradients_as_priced(micro_batches: int) -> None:
    """Eager torch over several micro-batches: the first backward pass hands its gradient
    to the weight, each later one adds into it (`AccumulateGrad`: r kept, r new, w kept).
    The bytes counted op by op beyond those of the same passes with the gradient dropped
    before each are `accumulation_bytes` of fp32."""
    weight = torch.nn.Parameter(torch.randn(4096))
    scale = torch.randn(4096)

    def traffic(keep: bool) -> int:
        weight.grad = None
        counter = NoViews(least=4096)
        with counter:
            for _ in range(micro_batches):
                if not keep:
                    weight.grad = None
                (weight * scale).sum().backward()
        return counter.bytes

    added = traffic(keep=True) - traffic(keep=False)
    assert added == 4096 * accumulation_bytes(policy("fp32"), micro_batches)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_a_mixed_precision_accumulation_moves_what_its_kernels_do(precision: str) -> None:
    """Under bf16-mixed each micro-batch's 16-bit gradient joins an fp32 main gradient:
    cast into it the first time, added after (Megatron-LM's `main_grad.add_`); under
    fp16-mixed the first 16-bit gradient is kept as it is and the later ones added to it
    in 16 bits (autograd's `AccumulateGrad`; the fp32 cast waits for the step): the bytes
    torch's kernels move are `accumulation_bytes`."""
    dtype = torch.float16 if precision.startswith("fp16") else torch.bfloat16
    grads = [torch.randn(4096).to(dtype) for _ in range(3)]
    main = torch.zeros(4096)
    counter = Traffic(least=4096)
    with counter:
        if dtype == torch.float16:
            kept = grads[0]
            for grad in grads[1:]:
                kept.add_(grad)
        else:
            main.copy_(grads[0])
            for grad in grads[1:]:
                main.add_(grad)
    assert counter.bytes == 4096 * accumulation_bytes(policy(precision), 3)
    assert accumulation_bytes(policy(precision), 3) == (
        2 * 6 if dtype == torch.float16 else 6 + 2 * 10)


def test_accumulation_is_priced_where_kernels_run_it(gpt32: Path) -> None:
    """`--grad-accumulation separate` adds the accumulation's memory pass to the step,
    `fused` (inside the weight-gradient GEMMs) nothing; the default follows the kernels:
    fused on an A100 (fused kernels), separate on the executor's `cpu` profile."""
    def planned(profile: str, accumulation: str | None):
        return plan(gpt32, devices=1, batch=8, dims={"seq": 128}, profile=profile,
                    parallel={"micro_batches": 4}, grad_accumulation=accumulation)

    fused, separate = planned("a100-80g", "fused"), planned("a100-80g", "separate")
    assert planned("a100-80g", None).step.grad_accumulation == "fused"
    assert planned("cpu", None).step.grad_accumulation == "separate"
    assert (fused.step.grad_accumulation, separate.step.grad_accumulation) == (
        "fused", "separate")
    a100 = load_profile("a100-80g")
    bandwidth = a100.memory_bandwidth_Bps.value * a100.memory_efficiency.value
    elements = sum(math.prod(t.shape) for t in separate.tensors.values()
                   if t.kind == "parameter")
    extra = elements * accumulation_bytes(policy("fp32"), 4) / bandwidth
    assert separate.predicted.breakdown.optimizer_s - fused.predicted.breakdown.optimizer_s \
        == pytest.approx(extra, rel=1e-9)
    assert separate.predicted.step_time_s == pytest.approx(
        fused.predicted.step_time_s + extra, rel=1e-9)
    assert Plan.from_json(separate.to_json()).step.grad_accumulation == "separate"


def test_cli_takes_the_kernels_of_megatron_and_a_separate_accumulation(gpt32: Path) -> None:
    """`--fusion megatron --grad-accumulation separate` reach the plan's step section and
    the summary; an unknown word is refused by the parser, exit 2."""
    base = [sys.executable, "-m", "planner.cli", "plan", str(gpt32), "--devices", "1",
            "--batch", "8", "--dim", "seq=128", "--parallel", "micro_batches=2"]
    done = subprocess.run([*base, "--fusion", "megatron", "--grad-accumulation", "separate"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fusion megatron" in done.stdout
    assert "accumulated by kernels of their own" in done.stdout
    default = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert "accumulated in the weight-gradient GEMMs" in default.stdout  # a100: fused
    bad = subprocess.run([*base, "--grad-accumulation", "later"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_megatron_fusion_keeps_a_norm_apart(gpt32: Path) -> None:
    """Under `megatron` no fused region holds a LayerNormalization with another op;
    under `elementwise` one does (the residual addition and the norm after it)."""
    graph = import_model(gpt32, batch=8, dims={"seq": 128})
    analysis = GraphAnalysis.of(graph)

    def norm_regions(fusion: Fusion) -> list[tuple[str, ...]]:
        regions = kernel_plan(analysis, KernelPolicy(AttentionKernel.EAGER, fusion)).regions
        return [r for r in regions
                if any(graph.op(op).op_type == "LayerNormalization" for op in r)]

    assert any(len(r) > 1 for r in norm_regions(Fusion.ELEMENTWISE))
    assert norm_regions(Fusion.MEGATRON) == []


@pytest.fixture(scope="module")
def gpt16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("precision16") / "gpt16.onnx"
    onnx.save(zoo.build("gpt2-small", layers=2, hidden=256, heads=4, vocab=2048,
                        dtype="bfloat16"), path)
    return path


@pytest.mark.parametrize("zero", [0, 1])
def test_gradient_reductions_move_the_gradient_the_precision_keeps(gpt16: Path,
                                                                   zero: int) -> None:
    """A weight's gradient reduction moves the gradient the precision keeps: fp32 under
    bf16-mixed (Megatron-LM for bf16, NeMo's `grad_reduce_in_fp32`), 16-bit under
    fp16-mixed; a ZeRO gather moves the weights as stored. The plan lists those bytes and
    prices them: the bf16-mixed reductions take longer."""
    def planned(precision: str):
        return plan(gpt16, devices=2, batch=8, dims={"seq": 128}, profile="a100-80g",
                    mode="auto", parallel={"dp": 2, "tp": 1, "pp": 1, "zero": zero},
                    precision=precision)

    bf16, fp16 = planned("bf16-mixed"), planned("fp16-mixed")
    weights = {name: math.prod(t.shape) * 2 for name, t in bf16.tensors.items()
               if t.kind == "parameter"}
    for chosen, per_element in ((bf16, 4), (fp16, 2)):
        synced = [c for c in chosen.collectives if c.tensor in weights]
        assert synced
        for collective in synced:
            expected = weights[collective.tensor] * (
                1 if collective.kind == "all_gather" else per_element / 2)
            assert collective.bytes == pytest.approx(expected, abs=1), collective
    reductions = [c for c in bf16.collectives if c.tensor in weights and c.kind != "all_gather"]
    assert reductions
    assert sum(c.time_s for c in reductions) > sum(
        c.time_s for c in fp16.collectives if c.tensor in weights and c.kind != "all_gather")
