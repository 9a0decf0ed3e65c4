"""`shardplan compare`: two or more saved plans side by side."""

from __future__ import annotations

import argparse
import json

from planner.cli.args import Verbs
from planner.errors import ShardplanError


def add_parser(verbs: Verbs) -> None:
    compare = verbs.add_parser("compare", help="compare plans side by side")
    compare.add_argument("plans", nargs="+", metavar="PLAN",
                         help="two or more strategy JSON files")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")


def run(args: argparse.Namespace) -> int:
    from planner.explain import compare_rows, render_compare
    from planner.plans.model import Plan

    if len(args.plans) < 2:
        raise ShardplanError("compare: give two or more plan files, e.g. "
                             "`shardplan compare a.json b.json`")
    data = compare_rows([(path, Plan.load(path)) for path in args.plans])
    print(json.dumps(data, indent=1) if args.json else render_compare(data))
    return 0
