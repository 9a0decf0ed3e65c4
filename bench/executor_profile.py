"""Where the executor's step goes: one device, torch.profiler, the executor beside eager.

    python bench/executor_profile.py [--module tiny|gpu] [--top 15]

Plans the builder's module (`bench/gpu_check.py`'s (c): one device, 2 micro-batches, full
recompute, bf16, SGD), parallelizes it in this process (a one-rank process group: NCCL
on a GPU, gloo on the CPU) and profiles two training steps after warm-up, then the same
module and step in torch eager. Prints each one's wall time per step, the device's busy
time per step (kernels), and the ops that take the most self time on the device and on
the host. The gap between wall and device time is what the host adds (Python, dispatch,
waits); the op tables say which kernels differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_check import MODULES, WARM_UP_STEPS, eager_training, planned_module  # noqa: E402

from costmodels.profile import load_profile  # noqa: E402
from executor.module.launch import load_builder, shared_trace  # noqa: E402
from executor.module.parallelize import parallelize, state_of  # noqa: E402
from planner.plans.model import Plan  # noqa: E402

PROFILED_STEPS = 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", choices=list(MODULES), default="gpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--profile", default="h200-sxm", help="the plan's hardware profile")
    parser.add_argument("--top", type=int, default=15, help="rows of each op table")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    spec = MODULES[args.module]
    planned = planned_module(load_profile(args.profile), spec, args.batch)
    print(f"{spec} on {torch.cuda.get_device_name() if cuda else 'the CPU'}: predicted step "
          f"{planned.predicted.step_time_s * 1e3:,.1f} ms ({args.profile})")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        _profile_executor(spec, planned, args.batch, device, args.top)
        _profile_eager(spec, planned, args.batch, device, args.top)
    finally:
        dist.destroy_process_group()
    return 0


def _profile_executor(spec: str, planned: Plan, batch: int, device: str, top: int) -> None:
    module, make_batch, loss_fn = load_builder(spec)()
    module.train()
    module = parallelize(module, planned, make_batch(0, batch), saved=shared_trace(spec, batch))
    state = state_of(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step(k: int) -> None:
        state.train_step(loss_fn, make_batch(k, batch))
        optimizer.step()
        optimizer.zero_grad()

    _profiled("executor", step, device, top)


def _profile_eager(spec: str, planned: Plan, batch: int, device: str, top: int) -> None:
    recompute = planned.parallel.recompute == "full"
    batch_of, train = eager_training(spec, batch, planned.micro_batches, recompute, device)
    _profiled("torch eager", lambda k: train(batch_of(k)), device, top)


def _profiled(name: str, step: Callable[[int], None], device: str, top: int) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for k in range(WARM_UP_STEPS):
        step(k)
    synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for k in range(PROFILED_STEPS):
            step(WARM_UP_STEPS + k)
        synchronize()
        wall = (time.perf_counter() - started) / PROFILED_STEPS
    events = prof.key_averages()
    print(f"\n== {name}: {wall * 1e3:,.1f} ms per step (profiled, wall)")
    if device == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # not their ops
        busy = sum(e.self_device_time_total for e in kernels) / 1e3 / PROFILED_STEPS
        print(f"device busy {busy:,.1f} ms per step (kernels' time)")
        print(events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


if __name__ == "__main__":
    sys.exit(main())
