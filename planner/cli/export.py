"""`shardplan export`: a saved plan in MindSpore's or torch DTensor's terms."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from planner.cli.args import Verbs, check_output


def add_parser(verbs: Verbs) -> None:
    export = verbs.add_parser("export", help="write a plan in another framework's format")
    export.add_argument("plan", help="a strategy JSON written by `shardplan plan -o`")
    export.add_argument("--format", required=True, choices=["mindspore", "dtensor"],
                        help="mindspore: strategy checkpoint JSON; dtensor: placements per "
                             "parameter")
    export.add_argument("--name-prefix", default="", metavar="PREFIX",
                        help="mindspore: the cell path of the planned network in the one "
                             "MindSpore trains, put before every parameter name (\"net.\" "
                             "when it is held as self.net: keys become MatMul_net.w1)")
    export.add_argument("-o", "--output", help="write here instead of standard output")


def run(args: argparse.Namespace) -> int:
    from planner.errors import ShardplanError
    from planner.exports.dtensor import to_dtensor_placements
    from planner.exports.mindspore import to_mindspore_checkpoint
    from planner.plans.model import Plan

    check_output(args.output, "-o", [args.plan])
    loaded = Plan.load(args.plan)
    if args.name_prefix and args.format != "mindspore":
        raise ShardplanError("--name-prefix is for --format mindspore (DTensor placements "
                             "are keyed by the torch module's own names)")
    data = (to_mindspore_checkpoint(loaded, args.name_prefix) if args.format == "mindspore"
            else to_dtensor_placements(loaded))
    text = json.dumps(data, indent=1, sort_keys=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0
