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
    export.add_argument("-o", "--output", help="write here instead of standard output")


def run(args: argparse.Namespace) -> int:
    from planner.exports.dtensor import to_dtensor_placements
    from planner.exports.mindspore import to_mindspore_checkpoint
    from planner.plans.model import Plan

    check_output(args.output, "-o", [args.plan])
    loaded = Plan.load(args.plan)
    data = (to_mindspore_checkpoint(loaded) if args.format == "mindspore"
            else to_dtensor_placements(loaded))
    text = json.dumps(data, indent=1, sort_keys=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0
