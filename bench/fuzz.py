"""A long fuzz run of shardplan's entry points: `python bench/fuzz.py --cases 2000 --seed 1`.

Generates cases with tests/fuzz_cases.py (malformed ONNX files, hardware profiles and plan
JSON, plus valid ones), runs each through the CLI with tests/fuzz_runner.py in a worker
process with a per-case timeout, prints the counts per class and outcome, then every
failure with the command that replays it. Exits 1 when any case produced a traceback,
crash, hang, bad exit code, malformed message or wrong answer; 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fuzz_runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000, help="number of cases")
    parser.add_argument("--seed", type=int, default=1, help="corpus seed")
    parser.add_argument("--start", type=int, default=0, help="index of the first case")
    parser.add_argument("--only", type=int, nargs="+", metavar="INDEX",
                        help="run just these case indices (replay a failure)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per case")
    parser.add_argument("--verbose", action="store_true", help="print every case's outcome")
    args = parser.parse_args(argv)
    indices = args.only or range(args.start, args.start + args.cases)
    started = time.perf_counter()

    def progress(result: fuzz_runner.Result) -> None:
        if args.verbose or result.outcome not in fuzz_runner.ACCEPTABLE:
            print(f"  {result.index:>6} {result.cls:<22} {result.outcome:<11} "
                  f"{result.seconds:6.2f} s  {result.note[:70]}", flush=True)

    results = fuzz_runner.run_corpus(args.seed, indices, timeout_s=args.timeout,
                                    progress=progress)
    elapsed = time.perf_counter() - started
    print(fuzz_runner.format_table(results))
    slowest = max(results, key=lambda r: r.seconds)
    print(f"{len(results)} cases of seed {args.seed} in {elapsed:.1f} s "
          f"({elapsed / max(len(results), 1) * 1e3:.0f} ms per case; slowest: case "
          f"{slowest.index} [{slowest.cls}] {slowest.seconds:.1f} s)")
    bad = fuzz_runner.failures(results)
    for result in bad:
        print(fuzz_runner.describe(result, args.seed))
    known = len(bad) - len(fuzz_runner.new_failures(results))
    print(f"{len(bad)} failures ({known} of them known issues: docs/robustness.md)" if bad
          else "no failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
