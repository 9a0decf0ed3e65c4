"""The cost model against one NVIDIA GPU: a bf16 GEMM shape sweep and a LLaMA-like stack.

    python bench/gpu_check.py [--profile h100-sxm] [--predict-only]

(a) times bf16 GEMMs (squares 1024..16384, skinny and low-K shapes, shapes one tile either
side of a whole wave) with CUDA events, median of repeats after warm-up, against
`op_time(..., shape=GemmShape(...))` of the profile; (b) times forward + backward of a
few LLaMA layers (GQA, SwiGLU, RMSNorm, rotary, scaled_dot_product_attention, bf16)
built in plain torch, against the one-device forward + backward compute that
`planner.api.plan` predicts for the same graph built by `planner.zoo`; (c) plans a
transformers LLaMA (`examples/hf_models.py:llama_gpu`, bf16) exported as `shardplan plan
--module` exports it, on one device with micro-batches and full recompute, trains it with
`executor.module` over NCCL on one process (what `shardplan run --module ... --backend nccl
--nproc 1` runs) and compares the measured step with the plan's predicted step. Each part
prints predicted, measured and their ratio per row. Without a CUDA device it exits with
code 2; `--predict-only` prints the predictions alone, on any machine
(tests/test_gpu_check.py). The whole run is sized to finish in under 5 minutes on one
H100/H200/A100.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodels.compute import op_time
from costmodels.gemm import GemmShape
from costmodels.profile import HardwareProfile, load_profile

#: `planner.api.plan` options for what the plain-torch stack and the executor run: SDPA's
#: flash kernel, every other op its own eager kernel (no torch.compile), bf16 weights and
#: activations.
PLAN_OPTIONS = {"attention": "flash", "fusion": "none", "precision": "bf16"}
NO_CUDA = 2
#: (c)'s module: the builder `shardplan plan/run --module` take, by size
MODULES = {"gpu": "examples/hf_models.py:llama_gpu",
           "tiny": "examples/hf_models.py:llama_gpu_tiny"}
#: (c)'s plan: one device, the batch in micro-batches, every layer recomputed
MODULE_PARALLEL: dict[str, int | str] = {"dp": 1, "micro_batches": 2, "recompute": "full"}
#: a timing spans back-to-back runs for about this long (at most MAX_BACK_TO_BACK runs)
TIMED_SPAN_S = 2e-3
MAX_BACK_TO_BACK = 100
#: at most this many operand sets to rotate over (L2 overflowed three times)
MAX_OPERAND_SETS = 32
#: (c)'s first steps (CUDA context, cuBLAS handles, the allocator's first blocks) are not timed
WARM_UP_STEPS = 2


@dataclass(frozen=True)
class Row:
    """One comparison: what it is, the prediction, the measurement (None: not measured)."""

    label: str
    predicted_s: float
    measured_s: float | None = None


@dataclass(frozen=True)
class StackSize:
    """The LLaMA-like stack both sides build: torch for timing, planner.zoo for the plan."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    torch = _torch()
    has_cuda = torch is not None and torch.cuda.is_available()
    if not has_cuda and not args.predict_only:
        print("gpu_check: no CUDA device found; run it on a machine with an NVIDIA GPU, "
              "or pass --predict-only for the predictions alone")
        return NO_CUDA
    try:
        profile = load_profile(args.profile or _profile_for_gpu(torch if has_cuda else None))
    except LookupError as exc:
        print(f"gpu_check: {exc}")
        return NO_CUDA
    measure = has_cuda and not args.predict_only
    where = f"measuring on {_gpu_name(torch)}" if measure else "predictions only"
    print(f"profile: {profile.name}; {where}")
    _table("GEMM shape sweep, bf16", _gemm_rows(profile, torch if measure else None, args.repeats))
    size = StackSize(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab,
                     args.seq, args.batch)
    _table("LLaMA-like stack, forward + backward, bf16",
           _stack_rows(profile, size, torch if measure else None, args.repeats))
    if args.module != "none":
        _table("transformers LLaMA through executor.module, NCCL, 1 process, training step",
               _module_rows(profile, MODULES[args.module], args.module_batch,
                            args.module_steps, "nccl" if measure else None))
    print(f"(gpu_check wall time {time.perf_counter() - start:.1f} s)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="hardware profile (default: from the GPU's name)")
    parser.add_argument("--predict-only", action="store_true",
                        help="print the predictions only (no GPU needed)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per case")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--module", choices=[*MODULES, "none"], default="gpu",
                        help="(c)'s module size (tiny: for tests; none: skip (c))")
    parser.add_argument("--module-batch", type=int, default=8, help="(c)'s global batch")
    parser.add_argument("--module-steps", type=int, default=6,
                        help=f"(c)'s training steps (the first {WARM_UP_STEPS} not timed)")
    return parser


def _torch():  # type: ignore[no-untyped-def]
    try:
        import torch
    except ImportError:
        return None
    return torch


def _gpu_name(torch) -> str:  # type: ignore[no-untyped-def]
    return str(torch.cuda.get_device_name())


def _profile_for_gpu(torch) -> str:  # type: ignore[no-untyped-def]
    """The bundled profile of the visible GPU; h100-sxm when there is none (--predict-only)."""
    if torch is None:
        return "h100-sxm"
    name = _gpu_name(torch)
    if "H200" in name:
        return "h200-sxm"
    if "H100" in name:
        return "h100-sxm"
    if "A100" in name:
        memory = torch.cuda.get_device_properties(0).total_memory
        return "a100-80g" if memory > 48 * (1 << 30) else "a100-40g"
    raise LookupError(f"no bundled profile for {name!r}; pass --profile")


# -- (a) GEMM shapes -------------------------------------------------------------------------


def gemm_shapes(profile: HardwareProfile) -> list[tuple[str, GemmShape]]:
    """Squares, skinny and low-K shapes, and shapes one tile either side of a whole wave."""
    shapes = [(f"{n}^3", GemmShape(n, n, n)) for n in (1024, 2048, 4096, 8192, 16384)]
    shapes += [(f"skinny {m}x12288x5376", GemmShape(m, 12288, 5376)) for m in (16, 128)]
    shapes += [(f"low-K 8192x8192x{k}", GemmShape(8192, 8192, k)) for k in (256, 1024)]
    if profile.compute_units is not None and profile.gemm_tile is not None:
        units = int(profile.compute_units.value)
        tm, tn, _ = profile.gemm_tile.value
        for tiles in (units, units + 1):
            shapes.append((f"wave edge: {tiles} tiles", GemmShape(tm * tiles, tn, 8192)))
    return shapes


def _gemm_rows(profile: HardwareProfile, torch, repeats: int) -> list[Row]:  # type: ignore[no-untyped-def]
    rows = []
    for label, shape in gemm_shapes(profile):
        predicted = op_time(profile, "MatMul", shape.flops, shape.nbytes(2), "bfloat16",
                            shape=shape)
        measured = None if torch is None else _time_gemm(torch, shape, repeats)
        rows.append(Row(f"{label} ({shape.flops / 1e9:,.1f} GFLOP)", predicted, measured))
    return rows


def _time_gemm(torch, shape: GemmShape, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds of one GEMM of `shape`, its operands read from memory: the runs rotate over
    enough operand sets to overflow the L2 cache three times (a small GEMM's operands would
    otherwise stay in L2 from one run to the next, which a training step's do not)."""
    properties = torch.cuda.get_device_properties(0)
    cache = int(getattr(properties, "L2_cache_size", 64 << 20))
    per_set = (shape.m * shape.k + shape.k * shape.n) * 2
    sets = min(MAX_OPERAND_SETS, max(1, -(-3 * cache // per_set)))
    operands = [(torch.randn(shape.m, shape.k, device="cuda", dtype=torch.bfloat16),
                 torch.randn(shape.k, shape.n, device="cuda", dtype=torch.bfloat16))
                for _ in range(sets)]
    turn = [0]

    def run() -> object:
        a, b = operands[turn[0] % sets]
        turn[0] += 1
        return torch.matmul(a, b)

    return _median_cuda_s(torch, run, repeats)


def _median_cuda_s(torch, run: Callable[[], object], repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of one `run` over `repeats` CUDA-event timings after 3 warm-up runs.
    Each timing spans enough back-to-back runs to last about `TIMED_SPAN_S`: the host
    launches the next run while the device works, so a short kernel is timed without the
    host's launch gap in front of it (one run between two events would include it)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    once = _event_seconds(torch, run, 1)
    back_to_back = max(1, min(MAX_BACK_TO_BACK, int(TIMED_SPAN_S / max(once, 1e-7))))
    return statistics.median(_event_seconds(torch, run, back_to_back) / back_to_back
                             for _ in range(repeats))


def _event_seconds(torch, run: Callable[[], object], count: int) -> float:  # type: ignore[no-untyped-def]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(count):
        run()
    end.record()
    torch.cuda.synchronize()
    return float(begin.elapsed_time(end)) / 1e3


# -- (b) the LLaMA-like stack ---------------------------------------------------------------


def predicted_stack_s(profile: HardwareProfile, size: StackSize) -> tuple[float, dict[str, str]]:
    """One-device forward + backward compute of the planner.zoo LLaMA at `size`."""
    from planner import zoo
    from planner.api import plan

    model = zoo.build("llama", layers=size.layers, hidden=size.hidden, heads=size.heads,
                      kv_heads=size.kv_heads, ffn=size.ffn, vocab=size.vocab,
                      max_positions=size.seq, dtype="bfloat16")
    options = dict(PLAN_OPTIONS)
    with tempfile.TemporaryDirectory() as tmp:
        path = zoo.save(model, Path(tmp) / "llama.onnx")
        result = plan(path, profile=profile, devices=1, batch=size.batch,
                      dims={"seq": size.seq}, mode="data", **options)
    parts = result.predicted.breakdown
    return parts.forward_s + parts.backward_s, options


def _stack_rows(profile: HardwareProfile, size: StackSize, torch, repeats: int) -> list[Row]:  # type: ignore[no-untyped-def]
    predicted, options = predicted_stack_s(profile, size)
    used = ", ".join(f"{k}={v}" for k, v in options.items())
    print(f"plan options passed: {used}")
    measured = None if torch is None else _time_stack(torch, size, max(3, repeats // 4))
    label = (f"{size.layers} layers, hidden {size.hidden}, {size.heads}/{size.kv_heads} heads, "
             f"ffn {size.ffn}, seq {size.seq}, batch {size.batch}")
    return [Row(label, predicted, measured)]


def _time_stack(torch, size: StackSize, repeats: int) -> float:  # type: ignore[no-untyped-def]
    with torch.device("cuda"):  # build on the GPU: a CPU init of 1B parameters takes long
        model = _torch_llama(torch, size).to(dtype=torch.bfloat16)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), device="cuda")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        logits.backward(torch.ones_like(logits))

    return _median_cuda_s(torch, step, repeats)


def _torch_llama(torch, size: StackSize):  # type: ignore[no-untyped-def]
    """The zoo's LLaMA in plain torch: the same ops, weights random (timing only)."""
    nn, functional = torch.nn, torch.nn.functional
    head_dim = size.hidden // size.heads

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(size.hidden))

        def forward(self, x):  # type: ignore[no-untyped-def]
            scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
            return (x.float() * scale).to(x.dtype) * self.weight

    def rotary(x, cos, sin):  # type: ignore[no-untyped-def]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            kv = size.kv_heads * head_dim
            self.norm1, self.norm2 = RMSNorm(), RMSNorm()
            self.q = nn.Linear(size.hidden, size.hidden, bias=False)
            self.k = nn.Linear(size.hidden, kv, bias=False)
            self.v = nn.Linear(size.hidden, kv, bias=False)
            self.o = nn.Linear(size.hidden, size.hidden, bias=False)
            self.gate = nn.Linear(size.hidden, size.ffn, bias=False)
            self.up = nn.Linear(size.hidden, size.ffn, bias=False)
            self.down = nn.Linear(size.ffn, size.hidden, bias=False)

        def forward(self, x, cos, sin):  # type: ignore[no-untyped-def]
            b, s, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).view(b, s, size.heads, head_dim).transpose(1, 2)
            k = self.k(h).view(b, s, size.kv_heads, head_dim).transpose(1, 2)
            v = self.v(h).view(b, s, size.kv_heads, head_dim).transpose(1, 2)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            groups = size.heads // size.kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            attn = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(attn.transpose(1, 2).reshape(b, s, size.hidden))
            h = self.norm2(x)
            return x + self.down(functional.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(size.vocab, size.hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(size.layers))
            self.norm = RMSNorm()
            self.head = nn.Linear(size.hidden, size.vocab, bias=False)
            inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            angles = torch.outer(torch.arange(size.seq).float(), inv)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, ids):  # type: ignore[no-untyped-def]
            x = self.embed(ids)
            cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.head(self.norm(x))

    return Llama()


# -- (c) the user's module, planned and run by shardplan ------------------------------------


def planned_module(profile: HardwareProfile, spec: str, batch: int):  # type: ignore[no-untyped-def]
    """The builder's module exported as `shardplan plan --module` exports it and planned
    on one device of `profile` with `MODULE_PARALLEL` and what the executor runs
    (`PLAN_OPTIONS`, SGD)."""
    from executor.module.launch import export_builder
    from planner.api import plan

    with tempfile.TemporaryDirectory() as tmp:
        path = export_builder(spec, batch, Path(tmp) / "module.onnx")
        return plan(path, profile=profile, devices=1, batch=batch, parallel=MODULE_PARALLEL,
                    optimizer="sgd", **PLAN_OPTIONS)


def _module_rows(profile: HardwareProfile, spec: str, batch: int, steps: int,
                 backend: str | None) -> list[Row]:
    """(c): the plan's predicted step against the measured median of the timed steps;
    `backend` None: the prediction alone."""
    from executor.module.launch import train_module

    planned = planned_module(profile, spec, batch)
    recompute = planned.parallel.recompute
    label = (f"{spec.rpartition(':')[2]}, batch {batch}, {planned.micro_batches} "
             f"micro-batches, recompute {recompute}")
    print(f"\nplanned {spec}: predicted step {planned.predicted.step_time_s * 1e3:,.3f} ms "
          f"on {profile.name}")
    if backend is None:
        return [Row(label, planned.predicted.step_time_s)]
    log = train_module(spec, planned, steps=max(steps, WARM_UP_STEPS + 1), backend=backend,
                       count_steps=1,
                       optimizer="sgd", lr=1e-3)
    timed = log.step_time_s[WARM_UP_STEPS:]
    print(f"recompute segments re-run by the last steps: {log.recomputed}")
    print(f"losses: {', '.join(f'{v:.4f}' for v in log.losses)}")
    print(f"step times ms: {', '.join(f'{v * 1e3:,.1f}' for v in log.step_time_s)}")
    print(log.verdict)
    if log.unplanned:
        print(f"results moved to the plan's layouts: {dict(log.unplanned)}")
    executor_s = statistics.median(timed)
    eager_s, eager_peak = eager_step_s(spec, batch, planned.micro_batches,
                                       recompute == "full", max(steps, WARM_UP_STEPS + 1),
                                       "cuda" if backend == "nccl" else "cpu")
    print(f"executor / torch eager of the same module: {executor_s / eager_s:.2f}")
    gib = 1 << 30
    predicted_peak = planned.predicted.memory.peak
    if not (log.peak_memory_bytes and eager_peak):
        print(f"peak memory: predicted {predicted_peak / gib:.2f} GiB (not measured off a GPU)")
    else:
        print(f"peak memory: predicted {predicted_peak / gib:.2f} GiB; allocated by the "
              f"executor {log.peak_memory_bytes / gib:.2f} GiB "
              f"({predicted_peak / log.peak_memory_bytes:.2f} predicted/measured), by torch "
              f"eager {eager_peak / gib:.2f} GiB ({predicted_peak / eager_peak:.2f})")
    return [Row(label, planned.predicted.step_time_s, executor_s),
            Row("the same module and step in torch eager (no shardplan)",
                planned.predicted.step_time_s, eager_s)]


EagerStep = tuple[Callable[[int], dict], Callable[[dict], None]]


def eager_training(spec: str, batch: int, micro_batches: int, recompute: bool,
                   device: str = "cuda") -> EagerStep:
    """The builder's module trained in plain torch on `device` as the plan trains it: the
    same micro-batches, every decoder layer checkpointed (transformers' gradient
    checkpointing) when the plan recomputes, SGD. Returns `batch_of(step)`, the step's
    whole batch on the device, and `train(whole)`, one step on it."""
    import torch

    from executor.module.launch import load_builder

    module, make_batch, loss_fn = load_builder(spec)()
    module = module.to(device).train()
    inner = getattr(module, "model", module)
    if recompute:
        with warnings.catch_warnings():  # renamed in transformers 5.2x, same behaviour
            warnings.simplefilter("ignore", FutureWarning)
            inner.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

    def batch_of(step: int) -> dict:
        return {k: v.to(device) for k, v in make_batch(step, batch).items()}

    def train(whole: dict) -> None:
        for micro in range(micro_batches):
            part = {k: v.chunk(micro_batches)[micro] for k, v in whole.items()}
            (loss_fn(module(**part), part) / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad()

    return batch_of, train


def eager_step_s(spec: str, batch: int, micro_batches: int, recompute: bool,
                 steps: int, device: str = "cuda") -> tuple[float, int]:
    """Median seconds of a training step of the builder's module in plain torch
    (`eager_training`) after `WARM_UP_STEPS`: what the executor adds is the ratio of the
    two. Also the allocator's peak bytes over the steps (0 off a GPU)."""
    import torch

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    batch_of, train = eager_training(spec, batch, micro_batches, recompute, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(steps):
        whole = batch_of(step)
        synchronize()
        started = time.perf_counter()
        train(whole)
        synchronize()
        times.append(time.perf_counter() - started)
    peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else 0
    del batch_of, train
    if device == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[WARM_UP_STEPS:]), peak


# -- output ----------------------------------------------------------------------------------


def _table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    print("| case | predicted ms | measured ms | predicted / measured |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        measured = "-" if row.measured_s is None else f"{row.measured_s * 1e3:,.3f}"
        ratio = "-" if row.measured_s is None else f"{row.predicted_s / row.measured_s:.2f}"
        print(f"| {row.label} | {row.predicted_s * 1e3:,.3f} | {measured} | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
