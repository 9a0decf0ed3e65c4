"""Planning time and memory on long chains, by phase, and against another checkout.

The issue's scale target is a 200,000-op chain planned in a minute within 6 GiB. This
plans `chain_model(n, width=16)` (MatMul → Add → Relu → Mul repeated, weights declared and
absent: `tests/test_robustness.py`) with `shardplan plan --devices 8 --batch 8`, each run
in a fresh process, and prints its wall time split where the CLI's progress lines fall
(seconds into the run when the op-level meshes were solved and when the joint search
ended, which runs first since 2026-12-06; "after": building the plan and the baselines
and writing the file), its peak RSS and its plan file's size.

    python bench/scale.py                               # 20,000 and 50,000 ops
    python bench/scale.py --ops 200000
    python bench/scale.py --against HEAD~1 --repeat 2   # another commit, runs alternating
    python bench/scale.py --tree ../old                 # another checkout
    python bench/scale.py --model shared-constant --ops 20000   # another shape of graph

`--model` plans another of `tests/test_scale.py`'s shapes instead (`BUILDERS`):
`shared-constant`, Relu and an Add of one constant alternating, so that every op fuses
into one kernel region and the constant is a weight every unit reads; `many-outputs`,
Relus of the input, each a graph output (each was quadratic until 2026-12-06); `relu`,
a plain chain of Relus on a [batch, 16] input, and `static-relu`, the same on a static
[8, 16] input, which has no other batch to be imported again at for micro-batches.

With `--against` (a worktree of that commit, as `bench/versus.py` makes) or `--tree` both
versions plan the same file, one run after the other (the order alternating per repeat,
as a machine's speed drifts), the two plan files are compared byte for byte, and the ratio
of the medians is printed: a change that must not alter plans is checked and timed in one
run.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE / "tests"), str(HERE / "bench")]

from test_robustness import _save, chain_model  # noqa: E402
from test_scale import BUILDERS, PLAN_AND_MEASURE  # noqa: E402
from versus import other_checkout  # noqa: E402

PROGRESS = re.compile(r"\[\s*([0-9.]+) s\] (mesh |joint search)")


@dataclass(frozen=True)
class Run:
    seconds: float
    meshes_done: float | None  # the last op-level mesh's progress line, s into the run
    joint_done: float | None  # the joint search's line
    peak_rss_bytes: int
    plan_bytes: int


def plan_once(tree: Path, model: Path, out: Path) -> Run:
    """One `shardplan plan` of `model` by the code in `tree`, in a fresh process started
    outside any checkout (so that `tree`, first on the path, is the code that runs)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", PLAN_AND_MEASURE, str(model), str(out)], env=env,
                          cwd=out.parent, capture_output=True, text=True, check=True)
    figures = json.loads(done.stdout)
    if figures["code"] != 0:
        raise SystemExit(f"{tree}: plan of {model} exited {figures['code']}: "
                         f"{figures['stderr'].strip().splitlines()[-1]}")
    marks: dict[str, float] = {}
    for seconds, what in PROGRESS.findall(figures["stderr"]):
        marks[what.strip()] = float(seconds)  # the last line of each kind
    return Run(figures["seconds"], marks.get("mesh"), marks.get("joint search"),
               figures["peak_rss_bytes"], out.stat().st_size)


def _row(ops: int, label: str, runs: list[Run], width: int) -> str:
    run = min(runs, key=lambda r: r.seconds)  # the phases of the fastest run

    def mark(value: float | None) -> str:
        return f"{value:9.1f}" if value is not None else f"{'-':>9}"

    marks = [m for m in (run.meshes_done, run.joint_done) if m is not None]
    after = run.seconds - max(marks) if marks else None  # the search runs both, either first
    times = ", ".join(f"{r.seconds:.1f}" for r in runs)
    return (f"{ops:>9,}  {label:<{width}} {statistics.median(r.seconds for r in runs):8.1f}"
            f"{mark(run.meshes_done)}{mark(run.joint_done)}{mark(after)}"
            f"{max(r.peak_rss_bytes for r in runs) / 2**20:10.0f}"
            f"{run.plan_bytes / 1e6:9.1f}   {times}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, nargs="+", default=[20_000, 50_000])
    parser.add_argument("--against", help="another commit to plan the same chains")
    parser.add_argument("--tree", type=Path, help="a checkout of it (instead of a worktree)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per version (median)")
    parser.add_argument("--model", choices=["chain", *BUILDERS], default="chain",
                        help="the shape of graph planned (default: the MatMul chain)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        with contextlib.ExitStack() as stack:
            trees = [("this", HERE)]
            if args.against or args.tree:
                other = stack.enter_context(other_checkout(args.against, args.tree, work))
                trees.append((args.against or str(args.tree), other))
            _table(args, trees, work)


def _table(args: argparse.Namespace, trees: list[tuple[str, Path]], work: Path) -> None:
    width = max(len(label) for label, _ in trees) + 1
    print(f"{'ops':>9}  {'version':<{width}} {'median s':>8}{'meshes':>9}{'joint':>9}"
          f"{'after':>9}{'peak MiB':>10}{'plan MB':>9}   runs (s)")
    for ops in args.ops:
        model = (BUILDERS[args.model](ops, work / f"{args.model}{ops}.onnx")
                 if args.model in BUILDERS else
                 _save(chain_model(ops, width=16), work / f"chain{ops}" / "chain.onnx"))
        runs: dict[str, list[Run]] = {label: [] for label, _ in trees}
        files = {label: work / f"plan{k}-{ops}.json" for k, (label, _) in enumerate(trees)}
        for repeat in range(args.repeat):
            for label, tree in trees if repeat % 2 == 0 else trees[::-1]:
                runs[label].append(plan_once(tree, model, files[label]))
        for label, _ in trees:
            print(_row(ops, label, runs[label], width), flush=True)
        if len(trees) == 2:
            (this, _), (other, _) = trees
            same = filecmp.cmp(files[this], files[other], shallow=False)
            ratio = (statistics.median(r.seconds for r in runs[this])
                     / statistics.median(r.seconds for r in runs[other]))
            print(f"{'':>9}  this / {other}: {ratio:.3f} of the time; plan files "
                  f"{'byte-identical' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
