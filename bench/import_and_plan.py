"""Import and data-parallel planning time for zoo GPT models from 125M to 175B parameters.

Run: python bench/import_and_plan.py [--devices 1024] [--repeat 3]
Prints one row per model: build (zoo), save, import, plan, and JSON size. Weight data is
never written or read; the 175B graph is a few MB.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from planner import zoo
from planner.api import plan
from planner.importer import import_model

MODELS = ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-7b", "llama-13b",
          "gpt3-175b")


def _median_seconds(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", default="a100-80g")
    args = parser.parse_args()
    print(f"zoo GPT-family models, data-parallel plan on {args.devices} × {args.profile}, "
          f"batch {args.devices}, seq {args.seq}; median of {args.repeat} runs")
    header = (f"{'model':<12}{'params':>12}{'ops':>7}{'onnx MB':>9}{'build s':>9}"
              f"{'import s':>10}{'plan s':>9}{'plan MB':>9}{'pred. step s':>14}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as scratch:
        for name in MODELS:
            family, config = zoo.preset(name)
            path = Path(scratch) / f"{name}.onnx"
            build_s, model = _median_seconds(partial(zoo.build, family, config), args.repeat)
            zoo.save(model, path)
            import_s, graph = _median_seconds(
                partial(import_model, path, batch=args.devices, dims={"seq": args.seq}),
                args.repeat)
            plan_s, result = _median_seconds(
                partial(plan, graph, profile=args.profile, devices=args.devices, mode="data"),
                args.repeat)
            size = len(result.dumps()) / 1e6
            print(f"{name:<12}{graph.parameter_count / 1e9:>11.2f}B{len(graph.ops):>7}"
                  f"{path.stat().st_size / 1e6:>9.2f}{build_s:>9.3f}{import_s:>10.3f}"
                  f"{plan_s:>9.3f}{size:>9.2f}{result.predicted.step_time_s:>14.3f}")


if __name__ == "__main__":
    main()
