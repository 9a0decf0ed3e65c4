"""Training precision: bytes per parameter by category, activation and GEMM dtypes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from costmodels.precision import (
    OPTIMIZER_MOMENTS,
    OPTIMIZER_TRAFFIC,
    default_precision,
    parameter_bytes,
    policy,
)
from planner import zoo
from planner.api import plan
from planner.errors import ShardplanError
from planner.kinds import Precision


@pytest.mark.parametrize("precision,total", [
    ("fp32", 16), ("tf32", 16), ("bf16", 8), ("fp16", 8), ("bf16-mixed", 18),
    ("fp16-mixed", 18), ("fp8", 18)])
def test_adam_bytes_per_parameter(precision: str, total: float) -> None:
    """Megatron-LM's table (docs/source/distrib_optimizer.md): fp32 16 B, bf16 weights
    with fp32 main gradients 18 B; pure 16-bit AdamW keeps 16-bit moments: 8 B."""
    assert parameter_bytes(Precision(precision), 4, "adam").total == total


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
    bad = subprocess.run([*base, "--precision", "fp4"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--precision" in bad.stderr


class _Traffic(TorchDispatchMode):
    """Bytes each aten op reads (its distinct tensor inputs) and writes (its outputs), over
    tensors of at least `least` elements (a step counter is not memory traffic)."""

    def __init__(self, least: int) -> None:
        super().__init__()
        self.least, self.bytes = least, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        seen: dict[int, int] = {}
        for value in pytree.tree_leaves((args, kwargs or {})):
            if isinstance(value, torch.Tensor) and value.numel() >= self.least:
                seen[id(value)] = value.nbytes
        written = [v.nbytes for v in pytree.tree_leaves(out)
                   if isinstance(v, torch.Tensor) and v.numel() >= self.least]
        self.bytes += sum(seen.values()) + sum(written)
        return out


@pytest.mark.parametrize("name,make", [
    ("adam", lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False)),
    ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False)),
    ("momentum", lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=False)),
    ("sgd", lambda p: torch.optim.SGD(p, lr=1e-3, foreach=False))])
def test_the_unfused_optimizer_traffic_is_what_torch_optim_runs(name: str, make) -> None:
    """The unfused passes of OPTIMIZER_TRAFFIC are the bytes torch.optim's own kernels
    read and write in a step (after the first, which creates the states), counted op by
    op; fused, a step reads and writes each byte once."""
    weight = torch.nn.Parameter(torch.randn(4096))
    optimizer = make([weight])
    for _ in range(2):
        weight.grad = torch.randn(4096)
        counter = _Traffic(least=4096)
        with counter:
            optimizer.step()
    param_bytes = weight.nbytes
    state_bytes = OPTIMIZER_MOMENTS[name] * param_bytes
    per_weight, per_state = OPTIMIZER_TRAFFIC[name].passes(fused=False)
    assert counter.bytes == per_weight * param_bytes + per_state * state_bytes
    assert OPTIMIZER_TRAFFIC[name].passes(fused=True) == (3.0, 2.0 if state_bytes else 0.0)
