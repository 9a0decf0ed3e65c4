"""Step time of `executor.parallelize` next to torch written by hand, on the same module.

Run: python bench/module_vs_torch.py [--steps 30] [--batch 8] [--rounds 5]  (about 2 minutes)
Model: `examples.hf_models:llama` (transformers LLaMA, 2 layers, hidden 64, GQA), SGD,
next-token cross-entropy, CPU (gloo), one thread per rank. One table:
  a one-device plan, 1 rank (what `run --nproc 1`  vs  torch eager, 1 process
    runs: compiled local regions, plain weights)
  the module's trace, 1 process (`unsplit`, the     vs  torch eager, 1 process
    reference runs are checked against: op by op)
  data-parallel plan, 2 ranks                       vs  torch DDP, 2 processes
  the same, every op on DTensors (local=False)      vs  torch DDP, 2 processes
  ZeRO 3 plan, 2 ranks                              vs  torch `fully_shard` (FSDP2) on
                                                         each decoder layer and the root
  tensor-parallel plan (Megatron's split), 2 ranks  vs  torch `parallelize_module`
                                                         (Colwise q/k/v/gate/up, Rowwise
                                                         o/down), 2 processes
Each figure is the median step time (forward, loss, backward, SGD) after one warm-up step
(for shardplan's rows the step whose collectives are counted: counting sees every op),
the fastest of `--rounds` rounds, each of which measures every row once in turn.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.hf_models import COLUMN_PARALLEL, ROW_PARALLEL, megatron_strategies  # noqa: E402
from executor.module.launch import export_builder, load_builder, train_module  # noqa: E402
from executor.module.parallelize import unsplit  # noqa: E402
from executor.train import free_port  # noqa: E402
from planner.api import load_graph, plan  # noqa: E402
from planner.plans.model import Plan  # noqa: E402

LLAMA = "examples.hf_models:llama"


def _steps(module: torch.nn.Module, make_batch, loss_fn, batch: int, steps: int
           ) -> list[float]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    times = []
    for step in range(steps + 1):
        data = make_batch(step, batch)
        started = time.perf_counter()
        loss = loss_fn(module(**data), data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return times[1:]


def _torch_worker(rank: int, port: int, kind: str, batch: int, steps: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    module, make_batch, loss_fn = load_builder(LLAMA)()
    module.train()
    def shard(step: int, size: int) -> dict[str, torch.Tensor]:
        return {k: v.chunk(2)[rank] for k, v in make_batch(step, size).items()}

    if kind == "ddp":
        module = torch.nn.parallel.DistributedDataParallel(module)
        times = _steps(module, shard, loss_fn, batch, steps)
    elif kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in [m for m in module.modules()
                      if type(m).__name__.endswith("DecoderLayer")]:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        times = _steps(module, shard, loss_fn, batch, steps)
    else:
        mesh = init_device_mesh("cpu", (2,))
        split = COLUMN_PARALLEL + ROW_PARALLEL
        plan_ = {name: (ColwiseParallel() if name.split(".")[-1] in COLUMN_PARALLEL else
                        RowwiseParallel())
                 for name, _ in module.named_modules() if name.split(".")[-1] in split}
        parallelize_module(module, mesh, plan_)
        times = _steps(module, make_batch, loss_fn, batch, steps)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()
    # Leave as multiprocessing's own children do: gloo objects DTensor and FSDP keep
    # alive can abort the interpreter's teardown ("terminate called without an active
    # exception"), which mp.spawn reports as a failed rank (executor/__main__.py alike).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _torch_ranks(kind: str, batch: int, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "times.json"
        mp.spawn(_torch_worker, args=(free_port(), kind, batch, steps, str(out)), nprocs=2)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5,
                        help="measure everything this many times, keeping each one's fastest")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    eager_module, make_batch, loss_fn = load_builder(LLAMA)()
    eager_module.train()
    module, _, _ = load_builder(LLAMA)()
    module.train()
    traced_module = unsplit(module, make_batch(0, args.batch))
    with tempfile.TemporaryDirectory() as scratch:
        path = export_builder(LLAMA, args.batch, Path(scratch) / "llama.onnx")
        one = plan(path, batch=args.batch, devices=1, profile="cpu", mode="data")
        data = plan(path, batch=args.batch, devices=2, profile="cpu", mode="data",
                    parallel={"zero": 0})
        zero3 = plan(path, batch=args.batch, devices=2, profile="cpu", mode="auto",
                     parallel={"dp": 2, "tp": 1, "pp": 1, "zero": 3})
        tensor = plan(path, batch=args.batch, devices=2, profile="a100-80g", mode="semi",
                      strategies=megatron_strategies(load_graph(path, batch=args.batch)), mesh=(2,))

    def ours(chosen: Plan, local: bool = True) -> Callable[[], list[float]]:
        # the collectives are counted over the first step, which is not timed
        return lambda: train_module(LLAMA, chosen, steps=args.steps + 1,
                                    batch_size=args.batch, local=local,
                                    count_steps=1).step_time_s[1:]

    measures: dict[str, Callable[[], list[float]]] = {
        "eager": lambda: _steps(eager_module, make_batch, loss_fn, args.batch, args.steps),
        "traced": lambda: _steps(traced_module, make_batch, loss_fn, args.batch, args.steps),
        "one": ours(one), "data": ours(data), "data, DTensors": ours(data, local=False),
        "zero3": ours(zero3), "tensor": ours(tensor),
        "ddp": lambda: _torch_ranks("ddp", args.batch, args.steps),
        "fsdp": lambda: _torch_ranks("fsdp", args.batch, args.steps),
        "tp": lambda: _torch_ranks("tp", args.batch, args.steps),
    }
    # Every measurement once per round, in the same order; each keeps its fastest round's
    # median: this shared host only slows a run down, and one pass moved the data-parallel
    # ratio between 0.8 and 1.4 from run to run (10 steps, 3 rounds: 0.62-1.35 over eleven
    # runs; 30 steps, 5 rounds: 0.89-0.94 over three, docs/benchmarks.md).
    best: dict[str, float] = {}
    for _ in range(max(1, args.rounds)):
        for name, measure in measures.items():
            median = statistics.median(measure())
            best[name] = min(best.get(name, median), median)
    rows = [
        ("one-device plan, 1 rank", "one", "torch eager, 1 process", "eager"),
        ("the module's trace, 1 process", "traced", "torch eager, 1 process", "eager"),
        ("data-parallel plan, 2 ranks", "data", "torch DDP, 2 processes", "ddp"),
        ("the same, every op on DTensors", "data, DTensors", "torch DDP, 2 processes", "ddp"),
        ("ZeRO 3 plan, 2 ranks", "zero3", "torch fully_shard, 2 processes", "fsdp"),
        ("tensor-parallel plan, 2 ranks", "tensor", "torch parallelize_module, 2 procs", "tp"),
    ]
    print(f"LLaMA (2 layers, hidden 64, GQA), batch {args.batch} x seq 16, SGD, CPU/gloo; "
          f"median of {args.steps} steps, fastest of {max(1, args.rounds)} round(s)")
    print(f"{'shardplan':34s} {'ms':>7s}   {'torch':34s} {'ms':>7s} {'ratio':>6s}")
    for label, key, theirs, their_key in rows:
        a, b = best[key] * 1e3, best[their_key] * 1e3
        print(f"{label:34s} {a:7.1f}   {theirs:34s} {b:7.1f} {a / b:6.2f}")
    print(f"(bench wall time {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
