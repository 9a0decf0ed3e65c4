"""Step time of the executor next to plain torch, on the same model and batch.

Run: python bench/executor_vs_torch.py [--steps 10] [--batch 8] [--seq 64]
Model: transformers' GPT-2 (2 layers, hidden 64), exported by torch (TorchScript) for the
executor, the torch module itself for eager and DDP. One table, four rows, CPU (gloo):
  executor, 1 rank (unsplit reference)      vs  torch eager, 1 process
  executor, data-parallel plan on 2 ranks   vs  torch DDP, 2 processes
Each figure is the median step time (forward, cross-entropy, backward, SGD) after one
warm-up step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from exported_models import build, export

from executor.train import free_port, train, train_reference
from planner.api import plan


def _eager_steps(module: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                 steps: int) -> list[float]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    mask = torch.ones_like(ids)
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        logits = module(ids, mask)
        logits = logits[0] if isinstance(logits, tuple) else getattr(logits, "logits", logits)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return times[1:]


def _ddp_worker(rank: int, port: int, batch: int, seq: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores, as the executor's ranks run
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    example = build("gpt2", batch=batch, seq=seq)
    module = torch.nn.parallel.DistributedDataParallel(example.module.train())
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (batch, seq), generator=generator)
    targets = torch.randint(0, 1000, (batch, seq), generator=generator)
    half = batch // 2
    local = slice(rank * half, (rank + 1) * half)
    times = _eager_steps(module, ids[local], targets[local], steps)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = export("gpt2", "torchscript", out_dir=Path(scratch), batch=2, seq=16)
        dp = plan(model, devices=2, batch=args.batch, dims={"seq": args.seq}, mode="data",
                  profile="cpu")
        reference = train_reference(model, dp, steps=args.steps + 1)
        ranks = train(model, dp, steps=args.steps + 1)
        example = build("gpt2", batch=args.batch, seq=args.seq)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 1000, (args.batch, args.seq), generator=generator)
        targets = torch.randint(0, 1000, (args.batch, args.seq), generator=generator)
        eager = _eager_steps(example.module.train(), ids, targets, args.steps)
        out = Path(scratch) / "ddp.txt"
        mp.spawn(_ddp_worker, args=(free_port(), args.batch, args.seq, args.steps, str(out)),
                 nprocs=2, join=True)
        ddp = json.loads(out.read_text())

    def median_ms(values: list[float]) -> float:
        return 1e3 * statistics.median(values)

    rows = [
        ("executor, 1 rank (reference)", median_ms(reference.step_time_s[1:]),
         "torch eager, 1 process", median_ms(eager)),
        ("executor, data parallel, 2 ranks", median_ms(ranks.step_time_s[1:]),
         "torch DDP, 2 processes", median_ms(ddp)),
    ]
    print(f"GPT-2 (2 layers, hidden 64), batch {args.batch} × seq {args.seq}, SGD, CPU/gloo; "
          f"median of {args.steps} steps")
    print(f"{'shardplan':<36}{'ms':>9}   {'torch':<26}{'ms':>9}{'ratio':>8}")
    for ours, our_ms, theirs, their_ms in rows:
        print(f"{ours:<36}{our_ms:>9.1f}   {theirs:<26}{their_ms:>9.1f}{our_ms / their_ms:>8.2f}")


if __name__ == "__main__":
    main()
