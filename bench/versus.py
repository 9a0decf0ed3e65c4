"""Search time of this checkout against another commit, case by case, in one run.

The cases are those of `bench/search.py` (zoo models on 8 to 1024 devices, the graph
imported first) and `bench/large_models.py` (GPT 1.3B to 1T on 8 to 3072 devices, import
included). Each case runs in a fresh interpreter per version, the two versions one after
the other so that both see the same machine load, through the API both versions have
(`planner.zoo`, `planner.api.plan`); the table gives each version's seconds, their ratio,
whether the two found the same configuration (degrees and mesh) and by how much their
predicted step times differ.

    python bench/versus.py --against HEAD~1            # both benches
    python bench/versus.py --against 05abe65 --bench search --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "bench"))

from large_models import CASES, PROFILES  # noqa: E402
from search import MODELS  # noqa: E402

#: One case in a child interpreter: build the zoo model, plan it, print time and result.
CHILD = r"""
import json, sys, time
from pathlib import Path
from planner import zoo
from planner.api import plan
from planner.errors import NoPlanFits
case = json.loads(sys.argv[1])
path = Path(case["folder"]) / (case["model"] + case.get("suffix", "") + ".onnx")
if not path.exists():
    if case.get("dtype"):
        built = zoo.build(case["model"], dtype=case["dtype"])
    else:
        built = zoo.build(*zoo.preset(case["model"]))
    zoo.save(built, path)
model = path
if case["import_first"]:
    import importlib
    import_model = importlib.import_module(case["importer"]).import_model
    model = import_model(path, batch=case["batch"], dims={"seq": case["seq"]})
started = time.perf_counter()
try:
    result = plan(model, devices=case["devices"], profile=case["profile"],
                  **({} if case["import_first"] else
                     {"batch": case["batch"], "dims": {"seq": case["seq"]}}))
    p = result.parallel
    out = {"seconds": time.perf_counter() - started, "step": result.predicted.step_time_s,
           "plan": [p.dp, p.tp, p.pp, p.micro_batches, p.zero, str(p.recompute),
                    list(result.mesh.shape)]}
except NoPlanFits:
    out = {"seconds": time.perf_counter() - started, "step": None, "plan": "no plan fits"}
print(json.dumps(out))
"""


def cases(benches: list[str]) -> list[dict]:
    found = []
    if "search" in benches:
        for model, (seq, per_device) in MODELS.items():
            for devices in (8, 64, 1024):
                found.append({"bench": "search", "model": model, "devices": devices,
                              "batch": per_device * devices, "seq": seq,
                              "profile": "a100-80g", "import_first": True})
    if "large" in benches:
        for profile in PROFILES:
            for model, devices, batch in CASES:
                found.append({"bench": "large", "model": model, "devices": devices,
                              "batch": batch, "seq": 2048, "profile": profile,
                              "import_first": False, "dtype": "bfloat16",
                              "suffix": "-bf16"})
    return found


def run(tree: Path, case: dict) -> dict:
    # The importer's module by what the tree has (an editable install of another checkout
    # would otherwise answer for a module this tree lacks).
    importer = "planner.importer" if (tree / "planner" / "importer").is_dir() \
        else "planner.onnx_import"
    case = {**case, "importer": importer}
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], env=env,
                          capture_output=True, text=True, cwd=tree)
    if done.returncode:
        return {"seconds": float("nan"), "step": None,
                "plan": f"failed: {done.stderr.strip().splitlines()[-1][:60]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compared(a: dict, b: dict) -> str:
    """Whether both found the same configuration, and how far apart their step times are."""
    if a["plan"] != b["plan"]:
        return f"NO: {a['plan']} -> {b['plan']}"
    if a["step"] is None or b["step"] is None:
        return "yes"
    change = (b["step"] - a["step"]) / a["step"]
    return "yes" if abs(change) <= 1e-9 else f"yes, step {100 * change:+.3f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD~1", help="the commit to compare with")
    parser.add_argument("--tree", type=Path, help="a checkout of it (instead of a worktree)")
    parser.add_argument("--bench", default="search,large", help="search, large or both")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (median)")
    parser.add_argument("--only", default="", help="cases whose model contains this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, \
            other_checkout(args.against, args.tree, Path(scratch)) as other:
        _table(other, args, Path(scratch))


@contextlib.contextmanager
def other_checkout(commit: str, tree: Path | None, scratch: Path) -> Iterator[Path]:
    """`tree` where given, else a worktree of `commit` under `scratch`, removed after."""
    if tree is not None:
        yield tree.resolve()
        return
    other = scratch / "other"
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", "-q", str(other),
                    commit], check=True)
    try:
        yield other
    finally:
        subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(other)],
                       check=False)


def _table(other: Path, args: argparse.Namespace, scratch: Path) -> None:
    print(f"search seconds: {args.against} ({other}) against this checkout ({HERE}); "
          f"median of {args.repeat}")
    print(f"{'bench':<7}{'model':<12}{'devices':>8}  {'profile':<12}{'before s':>10}"
          f"{'after s':>10}{'ratio':>8}  same plan")
    ratios = []
    for case in cases(args.bench.split(",")):
        if args.only and args.only not in case["model"]:
            continue
        case = {**case, "folder": str(scratch)}
        before, after = [], []
        for _ in range(args.repeat):
            before.append(run(other, case))
            after.append(run(HERE, case))
        old = statistics.median(r["seconds"] for r in before)
        new = statistics.median(r["seconds"] for r in after)
        ratio = new / old if old > 0 else float("nan")
        ratios.append(ratio)
        print(f"{case['bench']:<7}{case['model']:<12}{case['devices']:>8}  "
              f"{case['profile']:<12}{old:>10.2f}{new:>10.2f}{ratio:>8.2f}  "
              f"{compared(before[-1], after[-1])}",
              flush=True)
    finite = [r for r in ratios if r == r]
    if finite:
        print(f"geometric mean ratio {statistics.geometric_mean(finite):.3f} over "
              f"{len(finite)} cases (below 1: this checkout is faster)")


if __name__ == "__main__":
    main()
