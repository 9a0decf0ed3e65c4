"""`torchrun --nproc-per-node N -m executor MODEL --plan plan.json [--steps K] ...`

The same run as `shardplan run`, with the ranks started by torchrun (single- or
multi-node): rendezvous through torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Rank 0 prints the losses and writes `--log-json`.
"""

from __future__ import annotations

import argparse
import os
import sys

from planner.errors import ShardplanError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor", description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--plan", required=True)
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
    from executor.train import RunSettings, run_rank

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    settings = RunSettings(args.model, args.plan, args.steps, args.lr, args.seed,
                           args.optimizer, args.log_json, resume=args.resume,
                           checkpoint=args.checkpoint, loss=args.loss, data=args.data,
                           checkpoint_every=args.checkpoint_every)
    try:
        log = run_rank(rank, world, "env://", settings)
    except ShardplanError as exc:
        print(f"rank {rank}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if rank == 0:
        for step, loss in enumerate(log.losses):
            print(f"step {step + 1}: loss {loss:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
