"""Sharding propagation: the fastest heuristic, and the filler of semi-auto mode.

Groups are visited in graph order; each takes the candidate that is cheapest given the
choices already made around it (its own cost plus its edges to decided neighbours). Then
passes of local improvement (each group re-chooses given all its neighbours) run until
nothing changes. Fixed ops (semi-auto) have one candidate, so their layouts spread to
their neighbours exactly as MindSpore's propagation spreads user strategies.
"""

from __future__ import annotations

import time

import numpy as np

from planner.search.ilp import Solution
from planner.search.problem import StrategyProblem

MAX_PASSES = 8


def solve_propagation(problem: StrategyProblem) -> Solution:
    started = time.perf_counter()
    incident: list[list[tuple[int, np.ndarray]]] = [[] for _ in problem.groups]
    for edge in problem.edges:
        incident[edge.v].append((edge.u, edge.cost))  # [u choice, v choice]
        incident[edge.u].append((edge.v, edge.cost.T))  # [v choice, u choice]
    choice: list[int | None] = [None] * len(problem.groups)
    order = sorted(range(len(problem.groups)), key=lambda g: (len(problem.groups[g].candidates)
                                                               > 1, g))
    for group in order:  # fixed (single-candidate) groups first: they seed the spread
        choice[group] = _best(problem, incident, choice, group)
    decided = [int(c) for c in choice if c is not None]
    for _ in range(MAX_PASSES):
        changed = False
        for group in range(len(problem.groups)):
            best = _best(problem, incident, list(decided), group)
            if best != decided[group]:
                decided[group] = best
                changed = True
        if not changed:
            break
    objective, memory = problem.evaluate(decided)
    status = "feasible" if memory <= problem.memory_limit else "infeasible"
    return Solution(decided, status, objective, 0.0, time.perf_counter() - started,
                    "propagation", {"memory_bytes": memory})


def _best(problem: StrategyProblem, incident: list[list[tuple[int, np.ndarray]]],
          choice: list[int | None], group: int) -> int:
    total = problem.groups[group].cost.astype(float).copy()
    for other, matrix in incident[group]:
        if choice[other] is not None:
            total += matrix[choice[other], :]
    return int(np.argmin(total))
