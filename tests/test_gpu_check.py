"""bench/gpu_check.py on a machine without a GPU: the predictions run, the timing refuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from costmodels.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
SMALL = ["--layers", "1", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512",
         "--seq", "128", "--vocab", "512"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)


def test_predict_only_prints_the_three_tables_without_measurements() -> None:
    result = _run("--predict-only", "--profile", "a100-80g", "--module", "tiny", *SMALL)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "profile: a100-80g; predictions only" in out
    assert "GEMM shape sweep, bf16" in out and "LLaMA-like stack, forward + backward" in out
    assert "| wave edge: 108 tiles" in out and "| wave edge: 109 tiles" in out
    assert "plan options passed:" in out and "gpu_check wall time" in out
    assert "transformers LLaMA through executor.module, NCCL, 1 process" in out
    assert "| llama_gpu_tiny, batch 8, 2 micro-batches, recompute full |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| case")]
    assert len(rows) == 13 and all(line.endswith("| - | - |") for line in rows)


def test_without_cuda_it_exits_2_with_one_line() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = _run(*SMALL)
    assert result.returncode == 2
    assert result.stdout.count("\n") == 1 and "no CUDA device" in result.stdout


def test_the_sweep_brackets_a_whole_wave_of_the_profile() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import gemm_shapes

    shapes = dict(gemm_shapes(load_profile("h100-sxm")))
    assert shapes["wave edge: 132 tiles"].m == 128 * 132
    assert shapes["wave edge: 133 tiles"].m == 128 * 133
    assert not any(label.startswith("wave") for label, _ in gemm_shapes(load_profile("cpu")))
