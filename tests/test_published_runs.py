"""The published runs `bench/published_runs.py` predicts are transcribed right, and the
configurations they pin plan (the step times themselves are printed by the bench, not
asserted: tests do not time things)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from published_runs import TABLE_1, TABLE_5  # noqa: E402

#: Korthikanti et al. 2022, Table 5: model FLOPs utilisation of "present work", per model.
PUBLISHED_MFU = {"22B": 0.415, "175B": 0.514, "530B": 0.560, "1T": 0.563}


@pytest.mark.parametrize("name", sorted(PUBLISHED_MFU))
def test_table_5_times_reproduce_its_mfu_column(name: str) -> None:
    """The iteration time, GPUs and batch transcribed for each model give the MFU the table
    prints beside them, to the rounding of both (times to 0.01 s, MFU to 0.1 %), so a
    mistyped figure cannot pass."""
    run = next(r for r in TABLE_5 if r.name == f"{name}-selective")
    rounding = run.mfu() * 0.005 / run.published_s + 0.0005
    assert run.mfu() == pytest.approx(PUBLISHED_MFU[name], abs=rounding)


def test_table_5_full_recompute_is_the_published_speed_up_slower() -> None:
    """Table 5's throughput increase of present work over full recompute: 29.0, 31.8,
    29.7 and 32.1 %."""
    increase = {"22B": 0.290, "175B": 0.318, "530B": 0.297, "1T": 0.321}
    for name, expected in increase.items():
        full = next(r for r in TABLE_5 if r.name == f"{name}-full")
        present = next(r for r in TABLE_5 if r.name == f"{name}-selective")
        assert full.published_s / present.published_s - 1 == pytest.approx(expected,
                                                                           abs=0.0015)


def test_table_1_runs_keep_the_papers_arithmetic() -> None:
    """Table 1: dp = GPUs / (tp · pp) is a whole number for every row; the 1T row's step
    is the paper's eq. 3 over 3072 GPUs at 163 TFLOP/s."""
    for run in TABLE_1:
        assert run.dp * run.tp * run.pp == run.gpus
    trillion = TABLE_1[-1]
    s, h, n, v = 2048, 25600, 128, 51200
    flops = 96 * 3072 * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    assert trillion.published_s == pytest.approx(flops / (3072 * 163e12))


def test_korthikanti_configurations_are_model_parallel_only() -> None:
    """Table 3 of Korthikanti et al. runs every model with data parallel 1."""
    assert {run.dp for run in TABLE_5} == {1}
    assert {run.recompute for run in TABLE_5} == {"full", "selective"}


def test_table_1_launch_settings_divide_the_batch_and_the_layers() -> None:
    """The authors' script's micro-batch size divides each replica's share of the batch, and
    its layers per interleaved chunk divide each device's layers (Megatron-LM asserts both),
    so each pinned run is one Megatron could launch."""
    for run in TABLE_1:
        assert run.micro_batch_size is not None and run.chunks_per_device is not None
        assert (run.batch // run.dp) % run.micro_batch_size == 0, run.name
        assert run.layers % (run.pp * run.chunks_per_device) == 0, run.name
    interleaved = {r.name: r.chunks_per_device for r in TABLE_1 if r.chunks_per_device > 1}
    assert interleaved == {"76.1B": 3, "145.6B": 2, "310.1B": 2, "529.6B": 3}
    assert {r.name for r in TABLE_1 if r.overlap_grad_reduce} == {"1.7B", "3.6B", "7.5B",
                                                                  "18.4B"}
