"""Predicted against published training runs: Megatron-LM SC'21 Table 1, Korthikanti et al.
2022 Table 5, and NVIDIA's DGX Cloud Benchmarking recipes on DGX H100 (NeMo 24.12, BF16).

**Narayanan et al. 2021**, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21, arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T
parameters (vocabulary 51,200, sequence 2048, fp16 mixed precision, dropout 0.1, full
activation recomputation) on DGX A100 80 GB nodes, with the tensor- and pipeline-parallel
sizes, GPU count and global batch of each run and the achieved teraFLOP/s per GPU. The
paper counts a step's FLOPs as (its eq. 3, with recomputation)

    F = 96 B s l h² (1 + s / (6h) + V / (16 l h)),

so the published step time is F / (GPUs × achieved FLOP/s per GPU).

**Korthikanti et al. 2022**, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), Table 5: the end-to-end iteration time of four GPT models
(22B, 175B, 530B, 1T; their Table 3 configurations: tensor parallel 8, data parallel 1,
sequence 2048) with full recomputation and with "present work" (selective recomputation
and sequence parallelism). The transcription is checked against the table's own MFU
column: the model FLOPs 72 B s l h² (1 + s/(6h) + V/(12 l h)) over time × GPUs × 312
TFLOP/s give 41.5, 51.4, 56.0 and 56.3 % (`tests/test_published_runs.py`).

Each run is planned with its configuration pinned: dp, tp, pp, the recompute mode,
sequence parallelism where it ran, Megatron's tensor-parallel split (`layout=megatron`),
no ZeRO (Megatron-LM of 2021-22 had none: its distributed optimizer came later), the
kernels of that Megatron (no flash attention: `--attention eager`; its fused softmax,
bias-GELU and bias-dropout-add kernels: `--fusion elementwise`). Table 1's micro-batch
size, interleaved chunks and DDP (torch DDP reduces gradients behind the backward pass;
Megatron's "local" DDP after it) are the authors' launch script's (`TABLE_1`); Table 5's
micro-batches and schedule are not published, so they are searched (among 1F1B and
interleaved: the zero-bubble schedules came later), with the gradient
reduction after the backward pass (Megatron-LM's `--overlap-grad-reduce` is off by
default).
The model is the zoo GPT with separate q, k, v projections (Megatron lays its fused QKV
weight out per head, which an ONNX Split of a [h, 3h] projection cannot express; the
FLOPs and parameters are the same).

**NVIDIA DGX Cloud Benchmarking recipes, release 25.02.01** (`NEMO_H100`; see its
docstring): BF16 pre-training step times of NeMo 24.12 (Megatron-Core, Transformer
Engine) on DGX H100 nodes (8 H100 SXM 80 GB, NVLink 4, 8 × 400 Gb/s InfiniBand), each with
its recipe's configuration. NVIDIA's Megatron-Bridge / NeMo performance summaries list no
dense BF16 run on H100 (every dense H100 row there is FP8), so this is the modern BF16 set.

    python bench/published_runs.py                 # Table 1 and Table 5 (every row)
    python bench/published_runs.py --rows 1.7B 22B-selective
    python bench/published_runs.py --table nemo-h100   # the DGX H100 rows
    python bench/published_runs.py --table all

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
from typing import Any

from planner import zoo
from planner.api import plan
from planner.errors import ShardplanError
from planner.humanize import human_bytes
from planner.ops import is_matrix_op
from planner.zoo.gpt import GPTConfig
from planner.zoo.llama import LlamaConfig

SEQUENCE = 2048
#: The pipeline schedules Megatron-LM ran in 2021-22, searched where a row does not say
MEGATRON_SCHEDULES = ("1f1b", "interleaved")
VOCAB = 51200
A100_PEAK = 312e12  # dense fp16 tensor-core FLOP/s, the peak both papers quote


@dataclass(frozen=True)
class Run:
    """One published run: the model, how it was split, and its measured step time."""

    source: str  # "SC'21 T1" or "K'22 T5"
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    published_s: float
    recompute: str = "full"
    sequence_parallel: bool = False
    #: What the authors' launch script sets (None: not published, so searched): the
    #: micro-batch size, the model chunks per device of the interleaved schedule (1: plain
    #: 1F1B), and whether torch DDP reduces gradients behind the backward pass (Megatron's
    #: own "local" DDP of 2021 reduces them after it).
    micro_batch_size: int | None = None
    chunks_per_device: int | None = None
    overlap_grad_reduce: bool = False
    #: How each micro-batch's weight gradients joined the step's. Megatron-LM of 2021-22
    #: in fp16 added them with kernels of their own: autograd's `param.grad += grad` (both
    #: DDPs at de7dc40; the contiguous main-gradient buffer's `main_grad.add_` hook became
    #: the local DDP's default on 2021-08-18, commit e8fb052), cast into the fp32 main
    #: gradients by the optimizer; its gradient accumulation fusion (commit 83b1e42,
    #: 2022-02-13) was switched off without fp32 accumulation, which fp16 runs did not use,
    #: until commit 07916bf (2022-09-27). None: the stack's default (NeMo 2's GPTConfig:
    #: `gradient_accumulation_fusion = _grad_accum_fusion_available`, fused).
    grad_accumulation: str | None = "separate"
    #: Its kernels: Megatron-LM's of 2021-22 (`megatron/model/transformer.py`: the jit-fused
    #: bias-GELU and bias-dropout-add, the fused scale-mask-softmax, apex's FusedLayerNorm
    #: as modules of their own: `--fusion megatron`), or a fusing stack's (`elementwise`).
    fusion: str = "megatron"
    #: The model and how it ran, where a row is not a 2021-22 Megatron-LM GPT on A100s:
    #: the zoo family ("gpt" or "llama"), key/value heads (GQA), FFN width, (padded)
    #: vocabulary, sequence, dropout, context-parallel degree, ZeRO stage (Megatron-Core's
    #: distributed optimizer: 1), the gradient bucket (MiB; None: the planner's default),
    #: the profile and the attention kernel.
    family: str = "gpt"
    kv_heads: int | None = None
    ffn: int | None = None
    vocab: int = VOCAB
    sequence: int = SEQUENCE
    dropout: float = 0.1
    cp: int = 1
    zero: int = 0
    bucket_mb: float | None = None
    profile: str = "a100-80g"
    attention: str = "eager"
    dtype: str = "float16"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def model_flops(self) -> float:
        """Korthikanti's model FLOPs per step (no recomputation counted)."""
        s, h, n = SEQUENCE, self.hidden, self.layers
        return 72 * self.batch * s * n * h * h * (1 + s / (6 * h) + VOCAB / (12 * n * h))

    def mfu(self) -> float:
        return self.model_flops() / (self.published_s * self.gpus * A100_PEAK)


def _table_1(name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
             batch: int, teraflops_per_gpu: float, micro_batch_size: int,
             layers_per_chunk: int | None, ddp: str) -> Run:
    """A Table 1 row: its step time from the paper's eq. 3 and the achieved FLOP/s, and its
    launch settings from the authors' script (`examples/sc21/run_table_1.sh`)."""
    s, h, n = SEQUENCE, hidden, layers
    flops = 96 * batch * s * n * h * h * (1 + s / (6 * h) + VOCAB / (16 * n * h))
    chunks = 1 if layers_per_chunk is None else layers // (pp * layers_per_chunk)
    return Run("SC'21 T1", name, heads, hidden, layers, tp, pp, gpus, batch,
               flops / (gpus * teraflops_per_gpu * 1e12), micro_batch_size=micro_batch_size,
               chunks_per_device=chunks, overlap_grad_reduce=ddp == "torch")


#: The runs of Table 1, with the micro-batch size (MBS), layers per interleaved model chunk
#: (`--num-layers-per-virtual-pipeline-stage`, None: 1F1B) and `--DDP-impl` of the authors'
#: launch script, NVIDIA/Megatron-LM commit de7dc40 (2021-08-10), examples/sc21/
#: run_table_1.sh ("scripts that were used to produce the results in the paper").
TABLE_1 = (
    _table_1("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, None, "torch"),
    _table_1("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, None, "torch"),
    _table_1("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, None, "torch"),
    _table_1("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None, "torch"),
    _table_1("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None, "local"),
    _table_1("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, "local"),
    _table_1("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, "local"),
    _table_1("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, "local"),
    _table_1("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, "local"),
    _table_1("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None, "local"),
)

#: Korthikanti et al. 2022, Table 3 (configurations) and Table 5 (iteration time, s).
_K22 = (("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10),
        ("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
        ("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83),
        ("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49))
TABLE_5 = tuple(
    run for name, heads, hidden, layers, tp, pp, gpus, batch, full, present in _K22
    for run in (Run("K'22 T5", f"{name}-full", heads, hidden, layers, tp, pp, gpus, batch,
                    full),
                Run("K'22 T5", f"{name}-selective", heads, hidden, layers, tp, pp, gpus,
                    batch, present, recompute="selective", sequence_parallel=True)))
RUNS = TABLE_1 + TABLE_5

#: NVIDIA DGX Cloud Benchmarking ("Performance Recipes"), release 25.02.01: NVIDIA/
#: dgxc-benchmarking commit 0b71cfd (2025-05-21), https://github.com/NVIDIA/dgxc-benchmarking/
#: tree/0b71cfda5163540778e2a3d2db59858bf62f96f7. "Baseline performance metrics were using
#: workloads on the NVIDIA DGX H100 Reference Architecture" (README.md: 8 × H100 80 GB HBM3
#: per node, NVLink 4, 8 × 400 Gbit/s InfiniBand compute links: the `h100-sxm` profile).
#: Each workload's README gives the BF16 "Training step time (seconds per step)" of the last
#: of 50 steps at each GPU count, beside tokens per second and MFU computed from it (the
#: tests recompute both), and its launch files give the configuration that ran:
#:
#: - Llama 3.1 8B (`llama3.1/README_8b.md`, `llama3.1_8b.yaml`, `launch.sh`: container
#:   `nvcr.io/nvidia/nemo:24.12`): 32 layers, hidden 4096, 32 heads, 8 query groups, FFN
#:   14336 (SwiGLU), RMSNorm, RoPE, untied embeddings, the Llama 3 tokenizer (128,256
#:   tokens; NeMo pads to a multiple of 128 · tp, 128,256 at tp 1), sequence 8192, no
#:   dropout; TP 1, PP 1, CP 2, MBS 1, GBS 16 per GPU (GA 32), no activation recompute,
#:   flash attention (Transformer Engine, `NVTE_FUSED_ATTN=1`), `distributed_fused_adam`
#:   with `overlap_grad_sync` and `overlap_param_sync`, `bucket_cap_mb` 75. The sizes are
#:   Meta's (meta-llama/Llama-3.1-8B `config.json`: 32 layers, hidden 4096, 32 heads, 8
#:   key/value heads, intermediate 14336, vocabulary 128,256).
#: - GPT-3 175B (`nemo_megatron/README_175b.md`, `gpt3_175b_hydra.yaml`, `configure.sh`:
#:   `nemo:24.12`): 96 layers, hidden 12288, 96 heads, FFN 49152, NeMo's GPT defaults
#:   (learned positions, LayerNorm, GELU, biases, tied embeddings), the GPT-2 BPE
#:   tokenizer (50,257, padded to 50,688 at tp 4), sequence 2048, dropout 0.1; TP 4, PP 8,
#:   VP 6, MBS 1, GBS 16 per node (GA 64), sequence parallelism, no recompute,
#:   `distributed_fused_adam` with both overlaps, `bucket_cap_mb` 220. The README's table
#:   title says VP=12; the yaml the launch reads (no VP override) says 6, as does release
#:   25.04's configuration table, so 6 (2 layers per chunk) is what ran. Brown et al. 2020,
#:   Table 2.1: 96 layers, d_model 12288, 96 heads.
#:
#: Distributed optimizer as ZeRO-1: the optimizer states are sharded over the
#: data-parallel (× context-parallel) group, gradients accumulate whole over the
#: micro-batches and are reduce-scattered behind the last backward pass, the updated
#: weights all-gathered. Both recipes also set what the planner does not model: the 175B
#: overlaps its tensor-parallel collectives with the GEMMs (`ub_tp_comm_overlap`,
#: userbuffers) and its pipeline sends with compute (`overlap_p2p_comm`); the model prices
#: both exposed.
#:
#: Not taken (no plan can express them as they ran): Llama 3.1 70B (TP 4, PP 4, CP 2, VP 5)
#: and 405B (TP 8, PP 9, CP 2, VP 7) have dp, cp, tp and pp all above 1 at every published
#: GPU count, four mesh axes against the planner's three (`MAX_MESH_AXES`); the 405B's
#: 7-layer single-stage proxy on 32 GPUs (TP 8, CP 2, dp 2) has three, but Megatron's
#: tensor-parallel layout cannot be pinned beside a context-parallel axis
#: (`layout=megatron` with cp), and searched instead the layout differs from Megatron's;
#: Nemotron-4 15B and 340B use squared-ReLU MLPs, LayerNorm1p and GQA, which no zoo model
#: builds. The FP8 rows of every release are left out: `--precision fp8` runs the GEMMs at
#: the fp8 peak with the bf16 efficiency (the profile notes it is optimistic) and prices
#: none of Transformer Engine's casts and scaling.
_NEMO_8B: dict[str, Any] = dict(family="llama", heads=32, hidden=4096, layers=32, kv_heads=8,
                                ffn=14336, vocab=128256, sequence=8192, dropout=0.0, tp=1,
                                pp=1, cp=2, bucket_mb=75.0)
_NEMO_175B: dict[str, Any] = dict(family="gpt", heads=96, hidden=12288, layers=96,
                                  vocab=50688, sequence=2048, dropout=0.1, tp=4, pp=8,
                                  sequence_parallel=True, chunks_per_device=6,
                                  bucket_mb=220.0)


def _nemo(name: str, sizes: dict[str, Any], gpus: int, batch: int, step_s: float) -> Run:
    """A DGX H100 row: one GPU count of a recipe, its published step time (s)."""
    return Run("DGXC 25.02.01", f"{name}x{gpus}", gpus=gpus, batch=batch,
               published_s=step_s, recompute="none", micro_batch_size=1,
               grad_accumulation=None, fusion="elementwise",
               overlap_grad_reduce=True, zero=1, profile="h100-sxm", attention="flash",
               dtype="bfloat16", **sizes)


NEMO_H100 = (
    *(_nemo("llama3.1-8B", _NEMO_8B, gpus, 16 * gpus, step)
      for gpus, step in ((8, 12.78), (16, 12.99), (32, 13.00), (64, 13.00), (128, 13.16))),
    *(_nemo("gpt3-175B", _NEMO_175B, gpus, 2 * gpus, step)
      for gpus, step in ((128, 8.309), (256, 8.408), (512, 8.42), (1024, 8.453),
                         (2048, 8.49))),
)
TABLES = {"sc21-k22": RUNS, "nemo-h100": NEMO_H100, "all": RUNS + NEMO_H100}


def model_path(row: Run, folder: Path) -> Path:
    """The zoo model of `row` in `folder`, built on first use: the GPT with separate q, k, v
    projections, or the LLaMA (GQA, SwiGLU, RMSNorm, rotary positions)."""
    config: GPTConfig | LlamaConfig
    if row.family == "llama":
        config = LlamaConfig(layers=row.layers, hidden=row.hidden, heads=row.heads,
                             kv_heads=row.kv_heads, ffn=row.ffn, vocab=row.vocab,
                             max_positions=row.sequence, dtype=row.dtype)
    else:
        config = GPTConfig(layers=row.layers, hidden=row.hidden, heads=row.heads,
                           vocab=row.vocab, ffn=row.ffn, max_positions=row.sequence,
                           dropout=row.dropout, dtype=row.dtype, fused_qkv=False)
    stem = f"{row.family}-{row.hidden}x{row.layers}"
    if (row.family, row.vocab, row.sequence, row.dtype) != ("gpt", VOCAB, SEQUENCE, "float16"):
        stem += f"-v{row.vocab}-s{row.sequence}-{row.dtype}"
    path = folder / f"{stem}.onnx"
    if not path.exists():
        zoo.save(zoo.build(row.family, config), path)
    return path


def predict(row: Run, folder: Path) -> str:
    path = model_path(row, folder)
    pins: dict[str, int | str] = {"dp": row.dp, "tp": row.tp, "pp": row.pp, "zero": row.zero,
                                  "recompute": row.recompute}
    if row.cp > 1:  # Megatron-Core's context parallelism: ring attention over "cp"
        pins.update(cp=row.cp, cp_kind="ring")
    if row.tp > 1 or row.cp == 1:  # `layout=megatron` cannot be pinned beside a cp axis
        pins.update(layout="megatron", sp=int(row.sequence_parallel))
    if row.micro_batch_size is not None:
        pins["micro_batches"] = row.batch // (row.dp * row.micro_batch_size)
    if row.chunks_per_device is not None:
        tried = [{"schedule": "1f1b"} if row.chunks_per_device == 1 else
                 {"schedule": "interleaved", "vpp": row.chunks_per_device}]
    else:  # searched, among the schedules that Megatron-LM had (no zero-bubble then)
        tried = [{"schedule": name} for name in MEGATRON_SCHEDULES if row.pp > 1
                 or name == "1f1b"]
    bucket = {} if row.bucket_mb is None else {"bucket_mb": row.bucket_mb}
    started = time.perf_counter()
    found, refusal = [], ""
    for schedule in tried:
        try:
            found.append(plan(path, profile=row.profile, devices=row.gpus, batch=row.batch,
                              dims={"seq": row.sequence}, parallel={**pins, **schedule},
                              attention=row.attention, fusion=row.fusion,
                              grad_accumulation=row.grad_accumulation,
                              overlap_grad_reduce=row.overlap_grad_reduce,
                              # Megatron's loss works on the split logits (its vocabulary-
                              # parallel cross-entropy; under cp each rank's tokens): no gather
                              loss_reads="as-is", **bucket))
        except ShardplanError as error:
            refusal = refusal or str(error).splitlines()[0][:90]
    if not found:
        return f"| {row.source} | {row.name} | refused: {refusal} |"
    result = min(found, key=lambda p: p.predicted.step_time_s)
    took = time.perf_counter() - started
    p = result.predicted
    published = row.published_s
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
    split = f"{row.dp}/{row.tp}/{row.pp}" + (f" cp {row.cp}" if row.cp > 1 else "")
    return (f"| {row.source} | {row.name} | {split} "
            f"| {result.parallel.micro_batches} "
            f"| {step:.2f} | {published:.2f} | {100 * (step / published - 1):+.1f} % "
            f"| {100 * p.compute_s / step:.0f} / {100 * p.communication_s / step:.0f} / "
            f"{100 * bubble / step:.0f} | {100 * gemm / compute_total:.0f} / "
            f"{100 * other / compute_total:.0f} | {human_bytes(p.memory.peak)} {fits} "
            f"| {took:.1f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=sorted(TABLES), default="sc21-k22",
                        help="sc21-k22: Megatron-LM SC'21 Table 1 and Korthikanti et al. "
                             "Table 5 (default); nemo-h100: NVIDIA's DGX H100 recipes "
                             "(NEMO_H100); all: both")
    parser.add_argument("--rows", nargs="*", help="row names (default: all of the table)")
    args = parser.parse_args()
    rows = [r for r in TABLES[args.table] if not args.rows or r.name in args.rows]
    print("| source | model | dp/tp/pp | micro-batches | predicted s | published s | error "
          "| compute / comm / bubble % | GEMM / other % of compute | memory per GPU "
          "| planned in |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for row in rows:
            print(predict(row, Path(scratch)), flush=True)
    print(f"\n(bench wall time {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
