"""Plans for GPT models from 1.3B to 1T parameters on 8 to 3072 devices.

For each (model, devices, profile) the full automatic search runs (op-level meshes and the
joint search over pipeline stages, micro-batches, ZeRO and recompute) and the table prints
the chosen configuration, the predicted step time, the memory per device and the search
time a user waits for (import included). bf16 weights, sequence 2048, Adam.

    python bench/large_models.py                       # the whole table
    python bench/large_models.py --models gpt-1t --devices 3072 --profiles a100-80g
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

# (model, devices, global batch in sequences of 2048): GPT-3 and Megatron-LM batch sizes
# scaled to the device count (GPT-3 175B: 1536 sequences; Megatron 1T: 3072 on 3072 GPUs).
CASES = [
    ("gpt3-1.3b", 8, 64),
    ("gpt3-1.3b", 64, 512),
    ("gpt3-13b", 8, 64),
    ("gpt3-13b", 64, 512),
    ("gpt3-175b", 256, 1536),
    ("gpt3-175b", 1024, 1536),
    ("gpt-1t", 1024, 3072),
    ("gpt-1t", 3072, 3072),
]
PROFILES = ("a100-80g", "ascend-910b")


def run_case(folder: Path, model: str, devices: int, batch: int, profile: str) -> str:
    path = folder / f"{model}.onnx"
    if not path.exists():
        zoo.save(zoo.build(model, dtype="bfloat16"), path)
    started = time.perf_counter()
    try:
        result = plan(path, devices=devices, batch=batch, dims={"seq": 2048}, profile=profile)
    except NoPlanFits as exc:
        return (f"{model:<11}{devices:>6}{batch:>6}  {profile:<12} no plan fits "
                f"({time.perf_counter() - started:.1f} s): {str(exc)[:60]}")
    elapsed = time.perf_counter() - started
    par = result.parallel
    schedule = str(result.pipeline.schedule) if result.pipeline else "-"
    return (f"{model:<11}{devices:>6}{batch:>6}  {profile:<12}{par.dp:>5}{par.tp:>4}{par.pp:>4}"
            f"{par.micro_batches:>5}{par.zero:>5}  {par.recompute:<10}{schedule:<12}"
            f"{human_seconds(result.predicted.step_time_s):>11}"
            f"{human_bytes(result.predicted.memory['peak']):>11}"
            f"{'yes' if result.predicted.fits else 'NO':>5}{elapsed:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="only these presets")
    parser.add_argument("--devices", nargs="*", type=int, help="only these device counts")
    parser.add_argument("--profiles", nargs="*", default=list(PROFILES))
    args = parser.parse_args()
    cases = [c for c in CASES if (not args.models or c[0] in args.models)
             and (not args.devices or c[1] in args.devices)]
    header = (f"{'model':<11}{'devs':>6}{'batch':>6}  {'profile':<12}{'dp':>5}{'tp':>4}{'pp':>4}"
              f"{'mb':>5}{'zero':>5}  {'recompute':<10}{'schedule':<12}{'step time':>11}"
              f"{'memory':>11}{'fits':>5}{'search s':>9}")
    print("automatic search (op-level meshes + pipeline/ZeRO/recompute), bf16, seq 2048, Adam")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as folder:
        for profile in args.profiles:
            for model, devices, batch in cases:
                print(run_case(Path(folder), model, devices, batch, profile), flush=True)


if __name__ == "__main__":
    main()
