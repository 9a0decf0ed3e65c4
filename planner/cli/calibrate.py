"""`shardplan calibrate`: the command line of costmodels.calibrate, which measures the machine,
and (on gloo) of planner.cli.host, which times the executor's own host work per op.

The measuring and the profile it writes stay in costmodels, usable without this CLI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from planner.cli.args import Verbs


def add_parser(verbs: Verbs) -> None:
    calibrate = verbs.add_parser("calibrate", help="measure this machine and write a profile")
    calibrate.add_argument("--nproc", type=int, default=2,
                           help="ranks to start (one per core or GPU; default 2)")
    calibrate.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                           help="torch.distributed backend (gloo: CPU, nccl: CUDA GPUs)")
    calibrate.add_argument("--quick", action="store_true",
                           help="fewer sizes and shorter repeats: a rough profile in seconds, "
                                "for trying the flow (the full run takes about a minute)")
    calibrate.add_argument("-o", "--output", type=Path, required=True,
                           help="where to write the profile JSON")
    calibrate.add_argument("--no-executor", action="store_true",
                           help="skip timing the executor's own host time per op on a "
                                "small model (gloo only: about 11 s on a 2-core machine; "
                                "the profile then prices the device's work alone)")


def run(args: argparse.Namespace) -> int:
    """Measure and write the profile, with progress on stderr; bad input is ShardplanError."""
    from costmodels.calibrate import calibrate

    def say(text: str) -> None:
        print(f"calibrate: {text}", file=sys.stderr, flush=True)

    calibrate(args.nproc, args.backend, args.output, progress=say, quick=args.quick)
    if args.backend == "gloo" and not args.no_executor:
        # a CPU rank runs every op itself: its host time is part of each op's
        from planner.cli.host import calibrate_host

        calibrate_host(args.output, args.nproc, args.quick, progress=say)
        say(f"wrote the executor's host times into {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`shardplan calibrate ARGV`, for callers that hold only the calibrate flags."""
    from planner.cli import main as shardplan

    return shardplan(["calibrate", *(sys.argv[1:] if argv is None else argv)])
