"""Per-stage meshes against one shared shape, side by side (issue 17, item 4).

A LLaMA whose head (a 256k vocabulary) outweighs each of its small layers is planned
with a pinned pipeline depth three ways: stages free to take their own (dp, tp) shapes
and device counts, every stage on one shape (`stage_mesh=shared`), and, for reference,
with nothing pinned. Each row prints the stages' device counts and shapes, the predicted
step, the peak memory and the planner's wall time; `vs shared` is the shared plan's step
over this one's.

    python bench/stage_meshes.py                      # 8, 16 and 32 A100s, pp=2 and 4
    python bench/stage_meshes.py --devices 8 --pp 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.api import plan
from planner.plans.model import Plan
from planner.plans.stagemesh import describe_stage_meshes, per_stage_meshes
from planner.zoo import build


def _stages(chosen: Plan) -> str:
    pipeline = chosen.pipeline
    if pipeline is None:
        return "one stage: " + " × ".join(f"{a}={n}" for a, n in zip(
            chosen.mesh.axis_names, chosen.mesh.shape, strict=True))
    if per_stage_meshes(pipeline):
        return describe_stage_meshes(chosen.mesh, pipeline)
    return f"{len(pipeline.stages)} × " + " × ".join(
        f"{a}={n}" for a, n in zip(chosen.mesh.axis_names, chosen.mesh.shape, strict=True)
        if a != "pp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--pp", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--profile", default="a100-80g")
    parser.add_argument("--memory-limit", type=float, default=5.0, help="GiB per device")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "llama_wide_head.onnx"
        onnx.save(build("llama", layers=8, hidden=1024, heads=16, vocab=256000,
                        max_positions=2048), model)
        print(f"LLaMA 8 layers, hidden 1024, vocab 256000; seq 2048, batch 4 × devices, "
              f"{args.profile}, --memory-limit {args.memory_limit}")
        print(f"{'devs':>4} {'pins':<22} {'step':>10} {'vs shared':>9} {'peak GiB':>8} "
              f"{'plan s':>6}  stages")
        for devices in args.devices:
            for pp in args.pp:
                rows = []
                for pins in ({"pp": pp}, {"pp": pp, "stage_mesh": "shared"}, {}):
                    started = time.perf_counter()
                    chosen = plan(model, profile=args.profile, devices=devices,
                                  batch=4 * devices, dims={"seq": 2048},
                                  memory_limit_gib=args.memory_limit, parallel=pins)
                    rows.append((pins, chosen, time.perf_counter() - started))
                shared = rows[1][1].predicted.step_time_s
                for pins, chosen, seconds in rows:
                    step = chosen.predicted.step_time_s
                    label = ",".join(f"{k}={v}" for k, v in pins.items()) or "(none)"
                    print(f"{devices:>4} {label:<22} {step:>9.3f}s {shared / step:>8.2f}x "
                          f"{chosen.predicted.memory.peak / 2**30:>8.1f} "
                          f"{seconds:>6.1f}  {_stages(chosen)}")


if __name__ == "__main__":
    main()
