"""`shardplan explain`: where a saved plan's step time goes, per layer, and why it won."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from planner.cli.args import Verbs, positive_int


def add_parser(verbs: Verbs) -> None:
    explain = verbs.add_parser("explain", help="explain a plan: per layer, where the step "
                               "time goes, why it beat the others")
    explain.add_argument("plan", help="a strategy JSON written by `shardplan plan -o`")
    explain.add_argument("--json", action="store_true", help="print the explanation as JSON")
    explain.add_argument("--plot", metavar="DIR",
                         help="also draw PNG and SVG figures into DIR (needs matplotlib)")
    explain.add_argument("--top", type=positive_int, default=5, metavar="N",
                         help="how many top ops and collectives to list (default 5)")


def run(args: argparse.Namespace) -> int:
    """Print the explanation; matplotlib is imported only for --plot."""
    from planner.explain import explain, render
    from planner.plans.model import Plan

    loaded = Plan.load(args.plan)
    result = explain(loaded, source=args.plan, top=args.top)
    written: list[Path] = []
    if args.plot:
        from planner.plots import write_plots

        written = write_plots(loaded, result, args.plot, Path(args.plan).stem)
    if args.json:
        data = result.to_json()
        data["plots"] = [str(path) for path in written]
        print(json.dumps(data, indent=1))
    else:
        print(render(result))
        if written:
            print("\nplots: " + ", ".join(str(p) for p in written if p.suffix == ".png")
                  + " (and .svg)")
    return 0
