"""Search time and predicted step time of the automatic planner on zoo models.

Run: python bench/search.py [--devices 8,64,1024] [--models bert-large,gpt2-xl,...]
One row per (model, devices): the chosen mesh and degrees, predicted step time and peak
memory, whether it fits, the solver's status, and the wall time of the whole search
(every mesh shape, the baselines and the final pricing), which is what a user waits for.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from planner import zoo
from planner.api import plan
from planner.errors import NoPlanFits
from planner.humanize import human_bytes, human_seconds
from planner.importer import import_model

#: (preset, sequence length, sequences per device in the global batch)
MODELS = {
    "bert-large": (512, 8),
    "gpt2-xl": (1024, 1),
    "llama-7b": (2048, 1),
    "gpt3-175b": (2048, 1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="8,64,1024")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--profile", default="a100-80g")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--layers-scan", action="store_true",
                        help="instead: search time of a GPT at 12..96 layers on 8 devices")
    args = parser.parse_args()
    if args.layers_scan:
        _layers_scan(args)
        return
    devices_list = [int(d) for d in args.devices.split(",")]
    print(f"automatic search on {args.profile}, solver {args.solver}, 2-axis meshes, layers tied")
    header = (f"{'model':<12}{'devices':>8}{'mesh':>10}{'dp':>6}{'tp':>6}{'step time':>13}"
              f"{'peak mem':>12}{'fits':>6}{'status':>10}{'search s':>10}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            seq, per_device = MODELS[name]
            family, config = zoo.preset(name)
            path = zoo.save(zoo.build(family, config), Path(scratch) / f"{name}.onnx")
            for devices in devices_list:
                batch = per_device * devices
                graph = import_model(path, batch=batch, dims={"seq": seq})
                started = time.perf_counter()
                try:
                    result = plan(graph, profile=args.profile, devices=devices,
                                  solver=args.solver, time_limit=args.time_limit)
                except NoPlanFits as exc:
                    elapsed = time.perf_counter() - started
                    print(f"{name:<12}{devices:>8}  no plan fits ({elapsed:.1f} s): "
                          f"{str(exc)[:80]}")
                    continue
                elapsed = time.perf_counter() - started
                shape = "x".join(map(str, result.mesh.shape))
                print(f"{name:<12}{devices:>8}{shape:>10}{result.parallel.dp:>6}"
                      f"{result.parallel.tp:>6}{human_seconds(result.predicted.step_time_s):>13}"
                      f"{human_bytes(result.predicted.memory['peak']):>12}"
                      f"{'yes' if result.predicted.fits else 'no':>6}"
                      f"{result.solver.status:>10}{elapsed:>10.1f}", flush=True)


def _layers_scan(args: argparse.Namespace) -> None:
    """Planning cost against depth: with repeated layers tied it should grow linearly."""
    print("GPT (hidden 1024, 16 heads), 8 devices, batch 8, seq 1024: search time by depth")
    print(f"{'layers':>8}{'ops':>8}{'import s':>10}{'search s':>10}{'step time':>13}")
    with tempfile.TemporaryDirectory() as scratch:
        for layers in (12, 24, 48, 96):
            config = zoo.FAMILIES["gpt"](layers=layers, hidden=1024, heads=16)
            path = zoo.save(zoo.build("gpt", config), Path(scratch) / f"gpt{layers}.onnx")
            started = time.perf_counter()
            graph = import_model(path, batch=8, dims={"seq": 1024})
            imported = time.perf_counter() - started
            started = time.perf_counter()
            result = plan(graph, profile=args.profile, devices=8, solver=args.solver)
            elapsed = time.perf_counter() - started
            print(f"{layers:>8}{len(graph.ops):>8}{imported:>10.2f}{elapsed:>10.2f}"
                  f"{human_seconds(result.predicted.step_time_s):>13}", flush=True)


if __name__ == "__main__":
    main()
