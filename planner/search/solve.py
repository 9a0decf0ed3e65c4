"""The solver engines behind one choice problem, and which one runs.

"auto": the elimination DP when it reduces the whole graph and its plan fits (then it is
optimal: the unconstrained optimum is feasible), else CP-SAT warm-started from the DP's or
propagation's plan, unless a bound shows no plan can beat one already found
(`Engine.beat`). "cpsat"/"highs": the exact ILP; "dp": the elimination DP;
"propagation": the greedy heuristic. When a time limit ends the ILP before it found a
plan, the warm start is returned as the best plan so far, with the ILP's bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from planner.search.elimination import solve_elimination
from planner.search.ilp import Solution, lower_bound, solve_ilp
from planner.search.problem import StrategyProblem
from planner.search.propagation import solve_propagation

SOLVERS = ("auto", "cpsat", "highs", "dp", "propagation")


@dataclass(frozen=True)
class Engine:
    solver: str = "auto"
    time_limit: float = 60.0
    #: the step of a plan already found that fits (another search's): where the elimination
    #: DP does not settle the problem, "auto" first bounds every plan of the problem
    #: (`lower_bound`) and solves it only if one could be faster
    beat: float | None = None


BEATEN = "beaten"  # the status of a problem none of whose plans can be faster than `beat`


def solve(problem: StrategyProblem, engine: Engine) -> Solution:
    """One choice per group of `problem`, by `engine`."""
    if engine.solver == "propagation":
        return solve_propagation(problem)
    if engine.solver in ("auto", "dp"):
        found = solve_elimination(problem)
        if found is not None and (found.status == "optimal" or engine.solver == "dp"):
            return found
        if engine.solver == "auto" and engine.beat is not None:
            started = time.perf_counter()
            bound = lower_bound(problem, engine.time_limit)
            if bound is not None and bound > engine.beat:
                return Solution([], BEATEN, float("inf"), bound,
                                time.perf_counter() - started, "lp-bound",
                                {"beat": engine.beat})
        hint = found.choice if found is not None else solve_propagation(problem).choice
        return _best_so_far(problem, solve_ilp(problem, time_limit=engine.time_limit,
                                               solver="cpsat", hint=hint), hint)
    hint = solve_propagation(problem).choice
    solution = solve_ilp(problem, time_limit=engine.time_limit, solver=engine.solver,
                         hint=hint if engine.solver == "cpsat" else None)
    return _best_so_far(problem, solution, hint)


def _best_so_far(problem: StrategyProblem, solution: Solution, hint: list[int]) -> Solution:
    """When the time limit ends the ILP before it found a plan, the warm start is the best
    plan so far: return it with the ILP's bound, so the gap says how far it may be off."""
    if solution.choice or not hint:
        return solution
    objective, memory = problem.evaluate(hint)
    status = "feasible" if memory <= problem.memory_limit else "unknown"
    bound = solution.bound if np.isfinite(solution.bound) else 0.0
    return Solution(list(hint), status, objective, min(bound, objective), solution.time_s,
                    f"{solution.solver}+warm-start",
                    {**solution.detail, "note": "the time limit ended the ILP before it "
                     "found a plan; this is its warm start"})
