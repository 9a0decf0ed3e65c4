"""`torchrun --nproc-per-node N -m executor MODEL --plan plan.json [--steps K] ...`
and `torchrun --nproc-per-node N -m executor --module FILE.py:FN --plan plan.json ...`

The same runs as `shardplan run` (the ONNX graph, or your module through
`executor.parallelize`), with the ranks started by torchrun (single- or multi-node):
rendezvous through torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
Rank 0 prints the losses (and for a module whether the collectives were the plan's) and
writes `--log-json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING

from planner.errors import ShardplanError

if TYPE_CHECKING:
    from executor.train import RunLog


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--module", default="", help="FILE.py:FN or MODULE:FN, the builder")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--log-json", default="")
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--resume", default="")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--loss", default="auto", choices=["auto", "graph", "ce", "mse"])
    parser.add_argument("--data", default="")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("python -m executor: start it with torchrun (RANK and WORLD_SIZE are not set), "
              "or use `shardplan run`", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if bool(args.module) == bool(args.model):
        print("python -m executor: give MODEL.onnx or --module FILE.py:FN (one of them)",
              file=sys.stderr)
        return 2
    try:
        with _checkpoint_lock(rank, args.checkpoint):
            log = _module(rank, world, args) if args.module else _graph(rank, world, args)
    except ShardplanError as exc:
        print(f"rank {rank}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if rank == 0:
        for step, loss in enumerate(log.losses):
            print(f"step {step + 1}: loss {loss:.6f}")
        if args.module:  # (the graph runner writes its own --log-json)
            print(log.verdict)
            if args.log_json:
                with open(args.log_json, "w") as out:
                    json.dump(log.to_json(), out, indent=1)
    return 0


def _checkpoint_lock(rank: int, checkpoint: str) -> contextlib.AbstractContextManager[None]:
    """Rank 0 writes the marker and renames the finished checkpoint, so it holds the
    folder's lock for the run, as `shardplan run`'s launcher does: a second run writing the
    same folder is refused before it starts."""
    if rank != 0 or not checkpoint:
        return contextlib.nullcontext()
    from executor.checkpoint import check_target, writing

    check_target(checkpoint)
    return writing(checkpoint)


def _graph(rank: int, world: int, args: argparse.Namespace) -> RunLog:
    """The ONNX-graph runner's run on this rank (`executor.train.run_rank`)."""
    from executor.train import RunSettings, run_rank

    settings = RunSettings(args.model, args.plan, args.steps, args.lr, args.seed,
                           args.optimizer, args.log_json, resume=args.resume,
                           checkpoint=args.checkpoint, loss=args.loss, data=args.data,
                           checkpoint_every=args.checkpoint_every)
    return run_rank(rank, world, "env://", settings)


def _module(rank: int, world: int, args: argparse.Namespace) -> RunLog:
    """The module path's run on this rank (`executor.module.launch.run_module_rank`),
    from the module's kept export when there is one (`executor.module.cache`: after
    `shardplan plan --module`, say); ranks that find none export it each."""
    from executor.module.launch import Checkpoints, ModuleRun, run_module_rank, shared_trace
    from planner.plans.model import Plan

    plan = Plan.load(args.plan)
    if plan.global_batch is None:
        raise ShardplanError(f"{args.plan} names no global batch")
    run = ModuleRun(args.module, json.dumps(plan.to_json()), args.steps, args.lr,
                    plan.global_batch, args.backend, args.optimizer,
                    Checkpoints(args.resume, args.checkpoint, args.checkpoint_every),
                    trace=shared_trace(args.module, plan.global_batch))
    return run_module_rank(rank, world, "env://", run)


if __name__ == "__main__":
    # End as multiprocessing ends the ranks `shardplan run` starts: flush, then leave
    # without the interpreter's teardown. There, C++ objects still held by DTensor's
    # meshes (gloo's threads) are destroyed in an order that can abort the process after
    # a clean run ("terminate called without an active exception", SIGABRT: seen under
    # load in the test suite, once per few hundred runs).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
