"""`shardplan validate`: check a saved plan, alone or against the model it was made for."""

from __future__ import annotations

import argparse
import json
import sys

from planner.cli.args import Verbs, one_line


def add_parser(verbs: Verbs) -> None:
    validate = verbs.add_parser("validate", help="check a plan: schema, mesh, pipeline, "
                                "collectives, and (given the model) ops, layouts, shapes")
    validate.add_argument("plan", metavar="PLAN", help="the strategy JSON")
    validate.add_argument("model", metavar="MODEL", nargs="?",
                          help="the ONNX model it was made for (imported at the plan's dims)")
    validate.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(args: argparse.Namespace) -> int:
    """Exit 0 when the plan is valid, 2 with every problem listed otherwise."""
    from planner.api import load_graph
    from planner.plans.model import Plan
    from planner.validate import validate

    loaded = Plan.load(args.plan)
    graph = None
    if args.model:
        graph = load_graph(args.model, batch=loaded.model.batch,
                           dims=loaded.model.bound_dims,
                           capacity_factor=loaded.model.capacity_factor)
    report = validate(loaded, graph)
    against = f" against {args.model}" if args.model else ""
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        checked = ", ".join(f"{n} {what}" for what, n in report.checked.items())
        if report.ok:
            print(f"{args.plan}: valid{against} ({checked} checked)")
        for problem in report.problems:
            print(f"{args.plan}: {one_line(problem)}", file=sys.stderr)
    if not report.ok:  # the list above, then the one error line every refusal ends with
        count = len(report.problems)
        print(f"shardplan: error: {one_line(args.plan)}: {count} problem"
              f"{'s' if count > 1 else ''} found{one_line(against)}; re-create the plan with "
              "`shardplan plan -o`", file=sys.stderr)
    return 0 if report.ok else 2
