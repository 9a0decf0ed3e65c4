"""The op-level search's table against the plan it builds, per mesh, in one run.

What the ILP and the elimination DP minimise (`planner.search.problem`: each candidate's
compute and collectives, its weights' optimizer pass and gradient reduction, each edge's
moves) is meant to be the price the plan builder gives the chosen plan
(`planner.cost.oplevel`). Where the two differ, the search can keep a choice that the built
price ranks below another on the same mesh. This plans each case on each of its meshes
(op-level only: `mesh=`) and prints the table's objective (the solver record's), the
built step, the end-of-step gradient reduction the built step hides behind the backward
pass (`schedule_overlap`), and what is left:

    left = objective − step

The table prices each weight's reduction exposed as the schedule leaves it when the
backward compute is long enough to hide it (`planner.cost.buckets.exposed_share`), on the
gradient the precision keeps; `left` is 0 where the two agree, and shows what the linear
table cannot say: reductions that outlast the backward compute (the table is cheaper),
an `--overlap` floor (applied per weight in the table, to the whole reduction in the
step), a weight read twice.

    python bench/surrogate.py                # every case
    python bench/surrogate.py --only bert    # cases whose name contains this
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from planner.api import plan  # noqa: E402
from planner.cli import main  # noqa: E402
from planner.plans.model import Plan  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    zoo: tuple[str, ...]  # `shardplan zoo` arguments before -o
    devices: int
    batch: int
    dims: dict[str, int]
    meshes: tuple[tuple[int, ...], ...]
    overlap: float = 0.0


CASES = (
    Case("bert-base fp32", ("bert-base",), 16, 32, {"seq": 512},
         ((16,), (2, 8), (4, 4), (8, 2))),
    Case("gpt3-1.3b bf16-mixed", ("gpt3-1.3b", "--dtype", "bfloat16"), 8, 32,
         {"seq": 2048}, ((8,), (2, 4), (4, 2))),
    Case("gpt2-small fp32 (tied head)", ("gpt2-small",), 8, 32, {"seq": 1024}, ((8,),)),
    Case("llama-tiny fp32", ("llama-tiny",), 4, 32, {"seq": 64}, ((4,), (2, 2))),
    Case("bert-base fp32 --overlap 0.5", ("bert-base",), 16, 32, {"seq": 512},
         ((2, 8),), overlap=0.5),
)


@dataclass(frozen=True)
class Row:
    mesh: tuple[int, ...]
    objective: float  # the table's: what the solver minimised
    step: float  # the built plan's predicted step
    synced: float  # S: the plan's end-of-step gradient reduction, seconds
    hidden: float  # the part of it the built step hides behind the backward pass

    @property
    def left(self) -> float:
        """The table's objective over the built step (0: the two agree)."""
        return self.objective - self.step


def row_of(chosen: Plan) -> Row:
    breakdown = chosen.predicted.breakdown
    return Row(tuple(chosen.mesh.shape), chosen.solver.objective,
               chosen.predicted.step_time_s, breakdown.gradient_communication_s,
               breakdown.hidden_communication_s)


def measure(model: Path, case: Case) -> list[Row]:
    """The case planned on each of its meshes (the op-level search alone)."""
    return [row_of(plan(model, devices=case.devices, batch=case.batch, dims=case.dims,
                        mesh=list(mesh), overlap=case.overlap))
            for mesh in case.meshes]


def build(case: Case, folder: Path) -> Path:
    target = folder / f"{case.zoo[0]}-{abs(hash(case.zoo))}.onnx"
    if not target.exists():
        with contextlib.redirect_stdout(io.StringIO()):
            if main(["zoo", *case.zoo, "-o", str(target)]) != 0:
                raise SystemExit(f"could not build {' '.join(case.zoo)}")
    return target


def report(cases: Sequence[Case], folder: Path) -> None:
    print(f"{'case':<32} {'mesh':>6} {'objective':>12} {'built step':>12} {'hidden':>10} "
          f"{'left':>10} {'left %':>8}")
    for case in cases:
        for row in measure(build(case, folder), case):
            mesh = "x".join(map(str, row.mesh))
            print(f"{case.name:<32} {mesh:>6} {row.objective * 1e3:9.3f} ms "
                  f"{row.step * 1e3:9.3f} ms {row.hidden * 1e3:7.3f} ms "
                  f"{row.left * 1e3:7.3f} ms {100 * row.left / row.objective:+7.2f}",
                  flush=True)


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="cases whose name contains this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report([c for c in CASES if args.only in c.name], Path(scratch))


if __name__ == "__main__":
    main_()
