"""Exact strategy choice as an integer linear program (Alpa's formulation, tightened).

Variables: a one-hot choice s[g, i] per op group, and for every edge a joint variable
e[r, c] per pair of (row class, column class) of its cost matrix, where candidates with
identical rows (columns) are merged. Marginal constraints tie e to s:

    sum_c e[r, c] = sum_{i in r} s[u, i]        sum_r e[r, c] = sum_{j in c} s[v, j]

which keeps the LP relaxation tight (see ../shared/ENVIRONMENT.md's solver study). Memory:
sum of chosen memories plus W <= limit, with W >= each group's chosen workspace (its
largest output) and W >= each edge's chosen collective buffer. Objective: chosen costs
plus edge costs, in seconds.

Solved with OR-tools CP-SAT (one worker, LP-heavy linearization, eager LP rows, no probing
or presolve: this proves optimality here, fast, and deterministically) or with HiGHS
through scipy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.search.problem import StrategyProblem

COST_RESOLUTION = 1e8  # CP-SAT needs integers: the largest cost coefficient maps to this


@dataclass
class Solution:
    choice: list[int]
    status: str  # optimal | feasible | infeasible | unknown
    objective: float  # seconds, recomputed exactly from the problem
    bound: float  # best proven lower bound, seconds
    time_s: float
    solver: str
    detail: dict = field(default_factory=dict)

    @property
    def gap(self) -> float:
        if self.status == "optimal":
            return 0.0
        if not np.isfinite(self.objective) or self.objective <= 0:
            return float("inf")
        return max(0.0, (self.objective - self.bound) / self.objective)


@dataclass
class _Model:
    """A binary program in sparse form, shared by both back ends."""

    costs: list[float] = field(default_factory=list)
    memory: list[float] = field(default_factory=list)
    equalities: list[tuple[list[int], list[float]]] = field(default_factory=list)
    workspace_rows: list[tuple[list[int], list[float]]] = field(default_factory=list)
    choice_vars: list[list[int]] = field(default_factory=list)

    def new_var(self, cost: float = 0.0, memory: float = 0.0) -> int:
        self.costs.append(cost)
        self.memory.append(memory)
        return len(self.costs) - 1


def _classes(matrix: np.ndarray, axis: int) -> list[list[int]]:
    """Indices with identical rows (axis=0) or columns (axis=1)."""
    lines = matrix if axis == 0 else matrix.T
    found: dict[bytes, list[int]] = {}
    for index, line in enumerate(lines):
        found.setdefault(np.round(line, 15).tobytes(), []).append(index)
    return list(found.values())


def solve_min_memory(problem: StrategyProblem, *, time_limit: float = 30.0) -> float:
    """The smallest peak memory (bytes) any choice needs, ignoring time (for exit code 3)."""
    model = _build(problem)
    _, values, _ = _solve_highs(model, problem, time_limit, minimize_memory=True)
    if values is None:
        return float("inf")
    choice = [int(np.argmax([values[v] for v in ids])) for ids in model.choice_vars]
    return problem.evaluate(choice)[1]


#: Above the LP's optimum by more than its solver's tolerances: HiGHS meets its primal and
#: dual feasibility tolerances (1e-7) on costs rescaled to 1e6 at most.
BOUND_TOLERANCE = 1e-6


def lower_bound(problem: StrategyProblem, time_limit: float = 60.0) -> float | None:
    """A bound under the step the plan builder prices for every choice of the problem
    that fits: the LP relaxation of `problem.floor()` under the memory limit, less its
    tolerance (`BOUND_TOLERANCE`, relative). None where the LP has no optimum (nothing
    fits even fractionally, or the time ran out): no bound."""
    floor = problem.floor()
    status, _, bound = _solve_highs(_build(floor), floor, time_limit, relaxed=True)
    if status != "optimal":
        return None
    return bound - BOUND_TOLERANCE * abs(bound)


def _build(problem: StrategyProblem) -> _Model:
    model = _Model()
    for group in problem.groups:
        ids = [model.new_var(float(c), float(m)) for c, m in zip(group.cost, group.memory,
                                                                  strict=True)]
        model.choice_vars.append(ids)
        model.equalities.append((ids, [1.0] * len(ids)))
        model.workspace_rows.append((ids, [float(w) for w in group.workspace]))
    for edge in problem.edges:
        both = np.concatenate([edge.cost, edge.buffer], axis=1)
        rows = _classes(both, 0)
        cols = _classes(np.concatenate([edge.cost, edge.buffer], axis=0), 1)
        if len(rows) == 1 and len(cols) == 1:
            # Every pair costs the same: a constant, carried by the first choice var.
            base, buffer = float(edge.cost[0, 0]), float(edge.buffer[0, 0])
            for var in model.choice_vars[edge.u]:
                model.costs[var] += base
            if buffer:
                ids = model.choice_vars[edge.u]
                model.workspace_rows.append((ids, [buffer] * len(ids)))
            continue
        joint = {(r, c): model.new_var(float(edge.cost[rows[r][0], cols[c][0]]))
                 for r in range(len(rows)) for c in range(len(cols))}
        if edge.buffer.any():
            model.workspace_rows.append((list(joint.values()), [
                float(edge.buffer[rows[r][0], cols[c][0]]) for r, c in joint]))
        u_vars, v_vars = model.choice_vars[edge.u], model.choice_vars[edge.v]
        for r, members in enumerate(rows):
            ids = [joint[(r, c)] for c in range(len(cols))] + [u_vars[i] for i in members]
            model.equalities.append((ids, [1.0] * len(cols) + [-1.0] * len(members)))
        for c, members in enumerate(cols):
            ids = [joint[(r, c)] for r in range(len(rows))] + [v_vars[j] for j in members]
            model.equalities.append((ids, [1.0] * len(rows) + [-1.0] * len(members)))
    return model


def solve_ilp(problem: StrategyProblem, *, time_limit: float = 60.0, solver: str = "cpsat",
              hint: Sequence[int] | None = None, seed: int = 0) -> Solution:
    """The cheapest choice under the memory limit (or the best found within the limit)."""
    started = time.perf_counter()
    model = _build(problem)
    if solver == "cpsat":
        status, values, bound = _solve_cpsat(model, problem, time_limit, hint, seed)
    elif solver == "highs":
        status, values, bound = _solve_highs(model, problem, time_limit)
    else:
        raise ValueError(f"unknown solver {solver!r}; use cpsat or highs")
    elapsed = time.perf_counter() - started
    detail = {"variables": len(model.costs), "constraints": len(model.equalities) + 1,
              "groups": len(problem.groups), "edges": len(problem.edges)}
    if values is None:
        return Solution([], status, float("inf"), bound, elapsed, solver, detail)
    choice = [int(np.argmax([values[v] for v in ids])) for ids in model.choice_vars]
    objective, _ = problem.evaluate(choice)
    return Solution(choice, status, objective, min(bound, objective), elapsed, solver, detail)


def _scale(model: _Model) -> float:
    largest = max((abs(c) for c in model.costs), default=0.0)
    return COST_RESOLUTION / largest if largest > 0 else 1.0


def _solve_cpsat(model: _Model, problem: StrategyProblem, time_limit: float,
                 hint: Sequence[int] | None, seed: int) -> tuple[str, list[float] | None, float]:
    from ortools.sat.python import cp_model

    cp = cp_model.CpModel()
    variables = [cp.new_bool_var(f"x{i}") for i in range(len(model.costs))]
    for ids, coefs in model.equalities:
        if len(ids) == len(coefs) and all(c == 1.0 for c in coefs):
            cp.add_exactly_one(variables[i] for i in ids)
        else:
            cp.add(sum(int(c) * variables[i] for i, c in zip(ids, coefs, strict=True)) == 0)
    memory_unit = max(1.0, problem.memory_limit / 1e9)  # keep byte counts in CP-SAT's range
    workspace_cap = int(problem.memory_limit / memory_unit) + 1
    workspace = cp.new_int_var(0, workspace_cap, "workspace")
    for ids, sizes in model.workspace_rows:
        cp.add(workspace >= sum(int(np.ceil(s / memory_unit)) * variables[i]
                                for i, s in zip(ids, sizes, strict=True)))
    cp.add(sum(int(np.ceil(m / memory_unit)) * variables[i]
               for i, m in enumerate(model.memory) if m) + workspace
           <= int(problem.memory_limit / memory_unit))
    scale = _scale(model)
    cp.minimize(sum(round(c * scale) * variables[i]
                    for i, c in enumerate(model.costs) if c))
    if hint is not None:
        for ids, chosen in zip(model.choice_vars, hint, strict=True):
            for index, var in enumerate(ids):
                cp.add_hint(variables[var], index == chosen)
    engine = cp_model.CpSolver()
    engine.parameters.max_time_in_seconds = float(time_limit)
    engine.parameters.num_workers = 1
    engine.parameters.linearization_level = 2
    engine.parameters.random_seed = seed
    # Measured on transformer problems (bench/search.py): the LP does the work here;
    # eager LP rows, no probing and no presolve prove the same optima 6-9x faster.
    engine.parameters.add_lp_constraints_lazily = False
    engine.parameters.cp_model_probing_level = 0
    engine.parameters.cp_model_presolve = False
    code = engine.Solve(cp)
    status = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible",
              cp_model.INFEASIBLE: "infeasible"}.get(code, "unknown")
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return status, None, float("inf")
    values = [float(engine.Value(v)) for v in variables]
    return status, values, engine.BestObjectiveBound() / scale


def _solve_highs(model: _Model, problem: StrategyProblem, time_limit: float,
                 minimize_memory: bool = False, relaxed: bool = False
                 ) -> tuple[str, list[float] | None, float]:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n = len(model.costs) + 1  # the last variable is the workspace W (bytes)
    rows, cols, vals = [], [], []
    for row, (ids, coefs) in enumerate(model.equalities):
        rows += [row] * len(ids)
        cols += ids
        vals += coefs
    equal = coo_matrix((vals, (rows, cols)), shape=(len(model.equalities), n))
    rhs_eq = np.array([1.0 if all(c == 1.0 for c in coefs) else 0.0
                       for _, coefs in model.equalities])
    w_rows, w_cols, w_vals = [], [], []
    for row, (ids, sizes) in enumerate(model.workspace_rows):
        w_rows += [row] * (len(ids) + 1)
        w_cols += [*ids, n - 1]
        w_vals += [*sizes, -1.0]
    workspace = coo_matrix((w_vals, (w_rows, w_cols)), shape=(len(model.workspace_rows), n))
    memory = np.array([*model.memory, 1.0]).reshape(1, -1)
    constraints = [
        LinearConstraint(equal, rhs_eq, rhs_eq),
        LinearConstraint(workspace, -np.inf, 0.0),
    ]
    if minimize_memory:
        objective = memory.reshape(-1)
    else:
        constraints.append(LinearConstraint(memory, -np.inf, problem.memory_limit))
        objective = np.array([*model.costs, 0.0])
    # HiGHS stops within an absolute gap of 1e-6: seconds (and bytes) are rescaled so the
    # largest coefficient is 1e6 and that gap is negligible.
    largest = float(np.max(np.abs(objective))) if objective.size else 0.0
    scale = 1e6 / largest if largest > 0 else 1.0
    objective = objective * scale
    integrality = np.zeros(n) if relaxed else np.ones(n)
    integrality[-1] = 0
    upper = np.ones(n)
    upper[-1] = problem.memory_limit if np.isfinite(problem.memory_limit) else np.inf
    if minimize_memory:
        upper[-1] = np.inf
    result = milp(objective, constraints=constraints,
                  integrality=integrality, bounds=Bounds(np.zeros(n), upper),
                  options={"time_limit": float(time_limit), "disp": False,
                           "mip_rel_gap": 1e-9})
    if result.x is None:
        status = "infeasible" if result.status == 2 else "unknown"
        return status, None, float("inf")
    status = "optimal" if result.status == 0 else "feasible"
    bound = float(getattr(result, "mip_dual_bound", result.fun) or result.fun) / scale
    return status, list(result.x[:-1]), bound
