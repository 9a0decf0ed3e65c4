"""Plan a user's module and train it with the plan on local ranks, from a builder.

A builder is a function `FN()` returning `(module, make_batch, loss_fn)`
(`examples/hf_models.py`), named as "FILE.py:FN" or "package.module:FN" so that every rank
can build the same module itself (same seed, same weights). `plan_module` exports the
module with torch's default exporter and plans it; `train_module` starts one gloo process
per device, parallelizes the module on each and trains it; `train_module_reference`
trains the module as it is in this process, on the whole batch: what the ranks must equal.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from executor.module.trace import export_program, save_model
from executor.train import free_port
from planner.errors import ShardplanError
from planner.plans.model import Plan

Builder = Callable[[], tuple[torch.nn.Module, Callable[[int, int], dict[str, torch.Tensor]],
                             Callable[..., torch.Tensor]]]


def load_builder(spec: str) -> Builder:
    """The function "FILE.py:FN" or "package.module:FN" names."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ShardplanError(f"--module {spec!r}: give FILE.py:FUNCTION or MODULE:FUNCTION")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ShardplanError(f"--module {spec!r}: {where} is not a file")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ShardplanError(f"--module {spec!r}: cannot import {where}: {exc}") from exc
    builder = getattr(module, name, None)
    if not callable(builder):
        raise ShardplanError(f"--module {spec!r}: {where} has no function {name}")
    return builder


def plan_module(spec: str, *, batch_size: int, path: str | os.PathLike | None = None,
                **plan_options: Any) -> Plan:
    """Export the builder's module (training mode, one global batch of `batch_size`) and
    plan it with `planner.api.plan(**plan_options)`; the ONNX file goes to `path` (a
    scratch file when None)."""
    from planner.api import plan

    module, make_batch, _ = load_builder(spec)()
    module.train()
    program = export_program(module, make_batch(0, batch_size))
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(path) if path is not None else Path(scratch) / "module.onnx"
        save_model(program, target)
        return plan(target, **plan_options)


@dataclass
class ModuleRunLog:
    losses: list[float] = field(default_factory=list)
    #: rank 0's gradient collective calls ("kind|axes" -> calls over the run)
    gradient_calls: dict[str, int] = field(default_factory=dict)
    #: results DTensor gave in another layout than the plan's, moved to the plan's
    unplanned: dict[str, int] = field(default_factory=dict)


def _scalar(loss: torch.Tensor) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def _rank(rank: int, world: int, port: int, spec: str, plan_json: str, steps: int,
          lr: float, batch_size: int, out: str) -> None:
    from executor.module.parallelize import parallelize, state_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=5))
    try:
        plan = Plan.from_json(json.loads(plan_json))
        module, make_batch, loss_fn = load_builder(spec)()
        module.train()
        module = parallelize(module, plan, make_batch(0, batch_size))
        state = state_of(module)
        optimizer = torch.optim.SGD(module.parameters(), lr=lr)
        log = ModuleRunLog()
        for step in range(steps):
            batch = make_batch(step, batch_size)
            loss = state.loss(loss_fn, module(**batch), batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            log.losses.append(_scalar(loss))
        if rank == 0:
            log.gradient_calls = dict(state.gradient_calls)
            log.unplanned = dict(state.unplanned)
            Path(out).write_text(json.dumps(log.__dict__))
    finally:
        dist.destroy_process_group()


def train_module(spec: str, plan: Plan, *, steps: int = 5, lr: float = 0.1,
                 batch_size: int) -> ModuleRunLog:
    """Train the builder's module with `plan` on one gloo process per device (SGD)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "log.json")
        try:
            mp.start_processes(_rank, args=(plan.mesh.size, free_port(), spec,
                                            json.dumps(plan.to_json()), steps, lr,
                                            batch_size, out),
                               nprocs=plan.mesh.size, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise ShardplanError(f"a rank failed: {last}") from exc
        data: Mapping[str, Any] = json.loads(Path(out).read_text())
    return ModuleRunLog(list(data["losses"]), dict(data["gradient_calls"]),
                        dict(data["unplanned"]))


def train_module_reference(spec: str, *, steps: int = 5, lr: float = 0.1,
                           batch_size: int) -> list[float]:
    """The builder's module trained as it is, in this process, on the whole batch."""
    module, make_batch, loss_fn = load_builder(spec)()
    module.train()
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        batch = make_batch(step, batch_size)
        loss = loss_fn(module(**batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses
