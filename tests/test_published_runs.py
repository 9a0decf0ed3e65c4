"""The published runs `bench/published_runs.py` predicts are transcribed right, and the
configurations they pin plan (the step times themselves are printed by the bench, not
asserted: tests do not time things)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from published_runs import NEMO_H100, TABLE_1, TABLE_5, Run  # noqa: E402

from planner.zoo.llama import LlamaConfig  # noqa: E402
from planner.zoo.llama import parameter_count as llama_parameter_count  # noqa: E402

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


# -- NVIDIA DGX Cloud Benchmarking 25.02.01 on DGX H100 (NEMO_H100) ---------------------------

#: Each README's BF16 table, per GPU count: (throughput in tokens per second, model flops
#: utilization %), the columns computed from the step time `NEMO_H100` holds.
DGXC_COLUMNS = {
    "llama3.1-8B": {8: (82028, 59.99), 16: (161443, 59.03), 32: (322638, 58.99),
                    64: (645277, 58.99), 128: (1275155, 58.28)},
    "gpt3-175B": {128: (63099, 53.54), 256: (124712, 52.91), 512: (249068, 52.84),
                  1024: (496191, 52.63), 2048: (988057, 52.40)},
}
H100_BF16_PEAK = 989e12  # "for H100 BF16 is 989 TFLOPS", the READMEs' MFU denominator


def _readme_model_flops(model: str) -> float:
    """Model FLOPs per sequence, each README's "Notes" arithmetic with its own figures
    (llama3.1/README_8b.md: Llama 3.1 8B "4.74E+14"; nemo_megatron/README_175b.md: GPT 3
    175b "2.20E+15"), checked against the intermediate sums the READMEs print."""
    if model == "llama3.1-8B":
        s, n, h, f, v, groups, heads = 8192, 32, 4096, 14336, 128256, 8, 32
        attention = 12 * n * h * h * (1 + groups / heads + s / h)
        mlp, embedding = 18 * n * f * h, 6 * v * h
        assert (attention, mlp, embedding) == (20_937_965_568, 33_822_867_456, 3_152_019_456)
    else:
        s, n, h, v = 2048, 96, 12288, 51200
        attention = 24 * n * h * h + 12 * n * h * s
        mlp, embedding = 48 * n * h * h, 6 * v * h
        assert (attention, mlp, embedding) == (376_883_380_224, 695_784_701_952,
                                               3_774_873_600)
    return s * (attention + mlp + embedding)


@pytest.mark.parametrize("run", NEMO_H100, ids=lambda run: run.name)
def test_nemo_h100_step_times_reproduce_the_readme_columns(run: Run) -> None:
    """Tokens per second (sequence × GBS / step) and MFU (GBS × model FLOPs / step / GPUs /
    989 TFLOP/s) from the transcribed step time, GBS and GPU count give the README's own
    columns, to the rounding of the step time (0.01 s, 0.001 s for the 175B) and of MFU
    (0.01 %): a mistyped step, batch or GPU count cannot pass. (The READMEs computed MFU with
    the model FLOPs rounded to three digits, 4.74E+14 and 2.20E+15.)"""
    model = run.name.split("x")[0]
    tokens, mfu = DGXC_COLUMNS[model][run.gpus]
    step_rounding = 0.0005 if model == "gpt3-175B" else 0.005
    relative = step_rounding / run.published_s + 1e-4
    assert run.sequence * run.batch / run.published_s == pytest.approx(tokens, rel=relative)
    flops = float(f"{_readme_model_flops(model):.2e}")
    utilization = run.batch * flops / run.published_s / run.gpus / H100_BF16_PEAK
    assert 100 * utilization == pytest.approx(mfu, rel=relative, abs=0.006)


def test_nemo_h100_configurations_are_the_recipes() -> None:
    """The launch files' arithmetic: GBS 16 per GPU for the 8B (128 on 8) and 16 per node
    for the 175B, GA 32 and 64 micro-batches of one sequence, dp × cp × tp × pp the GPU
    count, the 175B's 96 layers in 8 stages × 6 chunks of 2, NeMo's vocabulary padding to
    a multiple of 128 · tp (128,256 at tp 1; GPT-2 BPE's 50,257 to 50,688 at tp 4)."""
    assert len(NEMO_H100) == 10
    for run in NEMO_H100:
        assert run.dp * run.cp * run.tp * run.pp == run.gpus, run.name
        assert run.micro_batch_size == 1 and run.recompute == "none" and run.zero == 1
        micro_batches = run.batch // (run.dp * run.micro_batch_size)
        if run.family == "llama":
            assert (run.batch, micro_batches, run.cp, run.tp, run.pp) == (16 * run.gpus, 32, 2,
                                                                          1, 1)
            original = 128256
        else:
            assert (run.batch, micro_batches, run.tp, run.pp) == (16 * run.gpus // 8, 64, 4, 8)
            assert run.chunks_per_device == 6 and run.layers // (run.pp * 6) == 2
            assert run.sequence_parallel
            original = 50257
        multiple = 128 * run.tp
        assert run.vocab == -(-original // multiple) * multiple


def test_llama_8b_is_metas_parameter_count() -> None:
    """The zoo LLaMA at the row's sizes has the 8,030,261,248 parameters of
    meta-llama/Llama-3.1-8B (32 layers, hidden 4096, 32 heads, 8 key/value heads, FFN
    14336, vocabulary 128,256, untied head)."""
    run = next(r for r in NEMO_H100 if r.family == "llama")
    config = LlamaConfig(layers=run.layers, hidden=run.hidden, heads=run.heads,
                         kv_heads=run.kv_heads, ffn=run.ffn, vocab=run.vocab)
    assert llama_parameter_count(config) == 8_030_261_248
