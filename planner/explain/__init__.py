"""Explain a plan from its JSON alone: per layer, where the step time goes, why it won.

Every figure is read or summed from the plan file: each op's `cost`, the collectives, the
`pipeline` section, the units the planner found, and the alternatives and baselines the
search priced beside it. Nothing is re-planned or re-imported, so `explain` works on a
plan whose model file is gone (the demo plans a temporary file) or lives on another
machine, and in milliseconds for a 175B plan.

`units` groups the ops, `figures` sums the plan's figures per term, op class, unit and
stage, `rivals` gives the alternatives' and baselines' verdicts, `model` holds the
Explanation (`JSON_KEYS`), `explanation` assembles it, `render` prints it, `compare` is
`shardplan compare`.
"""

from planner.explain.compare import compare_rows, render_compare
from planner.explain.explanation import explain
from planner.explain.model import (
    JSON_KEYS,
    Explanation,
    Rival,
    StageRow,
    Term,
    TopItem,
    UnitReport,
)
from planner.explain.render import render
from planner.explain.units import Unit, find_units, op_split

__all__ = ["JSON_KEYS", "Explanation", "Rival", "StageRow", "Term", "TopItem", "Unit",
           "UnitReport", "compare_rows", "explain", "find_units", "op_split", "render",
           "render_compare"]
