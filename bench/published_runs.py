"""Predicted against published training runs: Megatron-LM SC'21, Table 1.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21, arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T
parameters (vocabulary 51,200, sequence 2048, fp16 mixed precision, dropout 0.1, full
activation recomputation) on DGX A100 80 GB nodes, with the tensor- and pipeline-parallel
sizes, GPU count and global batch of each run and the achieved teraFLOP/s per GPU. The
paper counts a step's FLOPs as (its eq. 3, with recomputation)

    F = 96 B s l h² (1 + s / (6h) + V / (16 l h)),

so the published step time is F / (GPUs × achieved FLOP/s per GPU). Each row is planned
with its configuration pinned (dp, tp, pp, full recompute, Megatron's tensor-parallel
split: `--parallel ...,layout=megatron`; micro-batches, schedule and ZeRO searched), the
kernels of 2021 (no flash attention: `--attention eager`; Megatron's fused softmax,
bias-GELU and bias-dropout-add kernels: `--fusion elementwise`), on the zoo GPT with
separate q, k, v projections (Megatron lays its fused QKV weight out per head, which an
ONNX Split of a [h, 3h] projection cannot express; the FLOPs and parameters are the same).

    python bench/published_runs.py                 # every row
    python bench/published_runs.py --rows 1.7B 7.5B

Prints per row the predicted and published step time, the error, the shares of the
predicted step (compute, communication, bubble), and inside compute the share of the
GEMMs (the matrix-unit kernels) against everything else (memory-bound kernels).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from planner import zoo
from planner.api import plan
from planner.errors import ShardplanError
from planner.humanize import human_bytes
from planner.ops import is_matrix_op
from planner.zoo.gpt import GPTConfig

SEQUENCE = 2048
VOCAB = 51200


@dataclass(frozen=True)
class Row:
    """One run of Table 1."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    teraflops_per_gpu: float  # achieved, as published

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def published_step_s(self) -> float:
        s, h, n = SEQUENCE, self.hidden, self.layers
        flops = 96 * self.batch * s * n * h * h * (1 + s / (6 * h) + VOCAB / (16 * n * h))
        return flops / (self.gpus * self.teraflops_per_gpu * 1e12)


TABLE_1 = (
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def predict(row: Row, folder: Path) -> str:
    config = GPTConfig(layers=row.layers, hidden=row.hidden, heads=row.heads, vocab=VOCAB,
                       max_positions=SEQUENCE, dropout=0.1, dtype="float16", fused_qkv=False)
    path = zoo.save(zoo.build("gpt", config), folder / f"gpt-{row.name}.onnx")
    pins: dict[str, int | str] = {"dp": row.dp, "tp": row.tp, "pp": row.pp,
                                  "recompute": "full", "layout": "megatron"}
    started = time.perf_counter()
    try:
        result = plan(path, profile="a100-80g", devices=row.gpus, batch=row.batch,
                      dims={"seq": SEQUENCE}, parallel=pins, attention="eager",
                      fusion="elementwise")
    except ShardplanError as error:
        return f"| {row.name} | refused: {str(error).splitlines()[0][:90]} |"
    took = time.perf_counter() - started
    p = result.predicted
    published = row.published_step_s()
    step = p.step_time_s
    gemm = other = 0.0
    for op in result.ops:
        seconds = op.cost.forward_s + op.cost.backward_s
        if is_matrix_op(op.op_type):
            gemm += seconds
        else:
            other += seconds
    compute_total = gemm + other or 1.0
    bubble = p.breakdown.get("bubble_s", 0.0)
    fits = "yes" if p.fits else "NO"
    return (f"| {row.name} | {row.dp}/{row.tp}/{row.pp} | {result.parallel.micro_batches} "
            f"| {step:.2f} | {published:.2f} | {100 * (step / published - 1):+.1f} % "
            f"| {100 * p.compute_s / step:.0f} / {100 * p.communication_s / step:.0f} / "
            f"{100 * bubble / step:.0f} | {100 * gemm / compute_total:.0f} / "
            f"{100 * other / compute_total:.0f} | {human_bytes(p.memory.peak)} {fits} "
            f"| {took:.1f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names (default: all)")
    args = parser.parse_args()
    rows = [r for r in TABLE_1 if not args.rows or r.name in args.rows]
    print("| model | dp/tp/pp | micro-batches | predicted s | published s | error "
          "| compute / comm / bubble % | GEMM / other % of compute | memory per GPU "
          "| planned in |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for row in rows:
            print(predict(row, Path(scratch)), flush=True)
    print(f"\n(bench wall time {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
