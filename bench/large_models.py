"""Plans for GPT models from 1.3B to 1T parameters on 8 to 3072 devices, and for the
models that need the newer dimensions: a LLaMA-8B-class model at 131,072 tokens (context
parallelism) and a Mixtral-8x7B-class mixture of experts (expert parallelism).

For each (model, devices, profile) the full automatic search runs (op-level meshes and the
joint search over pipeline stages, micro-batches, ZeRO and recompute, context and expert
parallelism) and the table prints the chosen configuration, the predicted step time, the
memory per device and the search time a user waits for (import included). bf16 weights,
sequence 2048 (the GPT rows), Adam.

    python bench/large_models.py                       # the GPT table
    python bench/large_models.py --models gpt-1t --devices 3072 --profiles a100-80g
    python bench/large_models.py --new                 # the long-context and MoE rows
    python bench/large_models.py --mixed               # the mixed-cluster rows

The mixed-cluster rows plan each model on a cluster of two device kinds
(`examples/clusters/`), searched and with even data-parallel shares pinned
(`dp_shares=even`: what the executor runs), and, in the same run, on as many devices of
each kind alone and on each group's own devices, so the step times stand side by side.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner import zoo
from planner.api import plan
from planner.errors import NoPlanFits
from planner.humanize import human_bytes, human_seconds
from planner.plans.model import Plan

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


@dataclass(frozen=True)
class NewCase:
    """A row for a dimension the GPT table does not need: a zoo family with its sizes,
    planned at `dims` on `devices` of `profile` (bf16-mixed, Adam)."""

    name: str
    model: str  # the file's name: rows of one model share it
    family: str
    sizes: dict[str, Any] = field(hash=False)
    devices: int
    batch: int
    dims: dict[str, int] = field(hash=False)
    profile: str


# LLaMA 3 8B's shape (Dubey et al. 2024, Table 3) at 128k tokens on 8 nodes of H100s, the
# setting issue 17 names; the zoo's MoE at Mixtral 8x7B's sizes (docs/benchmarks.md).
NEW_CASES = [
    NewCase("llama8b-131k", "llama8b", "llama",
            {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
             "vocab": 128256, "max_positions": 131072}, 64, 8, {"seq": 131072}, "h100-sxm"),
    NewCase("llama8b-4k", "llama8b", "llama",
            {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
             "vocab": 128256, "max_positions": 131072}, 64, 256, {"seq": 4096}, "h100-sxm"),
    NewCase("mixtral-8x7b", "mixtral", "moe",
            {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000,
             "max_positions": 4096, "ffn": 21504, "experts": 8, "top_k": 2,
             "moe_every": 1}, 64, 256, {"seq": 4096}, "h100-sxm"),
]


CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


@dataclass(frozen=True)
class MixedCase:
    """A model on a mixed cluster file, beside the same device count of each of its
    kinds alone (`precision`: one every kind has a peak for)."""

    name: str
    preset: str
    cluster: str  # a file of examples/clusters
    batch: int
    precision: str


MIXED_CASES = [
    MixedCase("gpt3-13b a100+h100", "gpt3-13b", "a100-h100.json", 256, "bf16-mixed"),
    MixedCase("gpt3-13b 910a+910b", "gpt3-13b", "910a-910b.json", 256, "fp16-mixed"),
]


def _timed(path: Path, **options: Any) -> tuple[Plan | str, float]:
    """The plan (or why none fits) and the seconds a user waits for it, import included."""
    started = time.perf_counter()
    try:
        return plan(path, **options), time.perf_counter() - started
    except NoPlanFits as exc:
        return f"no plan fits: {str(exc)[:60]}", time.perf_counter() - started


def _outcome(result: Plan, elapsed: float) -> str:
    """The columns every row ends with: step time, peak memory, fits, search seconds."""
    return (f"{human_seconds(result.predicted.step_time_s):>11}"
            f"{human_bytes(result.predicted.memory['peak']):>11}"
            f"{'yes' if result.predicted.fits else 'NO':>5}{elapsed:>9.1f}")


def _schedule(result: Plan) -> str:
    return str(result.pipeline.schedule) if result.pipeline else "-"


def run_case(folder: Path, model: str, devices: int, batch: int, profile: str) -> str:
    path = folder / f"{model}.onnx"
    if not path.exists():
        zoo.save(zoo.build(model, dtype="bfloat16"), path)
    result, elapsed = _timed(path, devices=devices, batch=batch, dims={"seq": 2048},
                             profile=profile)
    if isinstance(result, str):
        return f"{model:<11}{devices:>6}{batch:>6}  {profile:<12} {result} ({elapsed:.1f} s)"
    par = result.parallel
    return (f"{model:<11}{devices:>6}{batch:>6}  {profile:<12}{par.dp:>5}{par.tp:>4}{par.pp:>4}"
            f"{par.micro_batches:>5}{par.zero:>5}  {par.recompute:<10}{_schedule(result):<12}"
            + _outcome(result, elapsed))


def run_new_case(folder: Path, case: NewCase) -> str:
    path = folder / f"{case.model}.onnx"
    if not path.exists():
        zoo.save(zoo.build(case.family, dtype="bfloat16", **case.sizes), path)
    result, elapsed = _timed(path, devices=case.devices, batch=case.batch, dims=case.dims,
                             profile=case.profile, precision="bf16-mixed")
    if isinstance(result, str):
        return f"{case.name:<14}{case.devices:>5}{case.batch:>6}  {result} ({elapsed:.1f} s)"
    par = result.parallel
    kind = f" {par.cp_kind}" if par.cp > 1 and par.cp_kind else ""
    return (f"{case.name:<14}{case.devices:>5}{case.batch:>6}  {case.profile:<10}"
            f"{par.dp:>4}{par.tp:>4}{par.pp:>4}{par.cp:>4}{par.ep:>4}{par.micro_batches:>5}"
            f"{par.zero:>5}  {par.recompute:<10}{_schedule(result):<10}{kind:<9}"
            + _outcome(result, elapsed))


def print_table(title: str, header: str, rows: Callable[[Path], Iterator[str]]) -> None:
    """A table's title, header and rule, then each row as it is planned (`rows` is given
    a scratch folder for the models it writes)."""
    print(title)
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as folder:
        for row in rows(Path(folder)):
            print(row, flush=True)


def main_new(names: list[str] | None) -> None:
    header = (f"{'model':<14}{'devs':>5}{'batch':>6}  {'profile':<10}{'dp':>4}{'tp':>4}"
              f"{'pp':>4}{'cp':>4}{'ep':>4}{'mb':>5}{'zero':>5}  {'recompute':<10}"
              f"{'schedule':<10}{'cp kind':<9}{'step time':>11}{'memory':>11}{'fits':>5}"
              f"{'search s':>9}")
    print_table("automatic search with context and expert parallelism, bf16-mixed, Adam",
                header, lambda folder: (run_new_case(folder, case) for case in NEW_CASES
                                        if not names or case.name in names))


def _stages(result: Plan) -> str:
    """Where the units (prefix, layers, suffix) went: `h100:30 a100:12`, a stage's groups
    and its unit count, one entry per stage."""
    if result.pipeline is None:
        return "-"
    return " ".join(f"{'+'.join(stage.groups) or '-'}:{_unit_count(result, stage.ops)}"
                    for stage in result.pipeline.stages)


def _unit_count(result: Plan, ops: Any) -> int:
    assert result.pipeline is not None
    return sum(1 for unit in result.pipeline.units
               if any(a <= unit.ops[0] and unit.ops[1] <= b for a, b in ops))


def run_mixed_case(folder: Path, case: MixedCase) -> list[str]:
    """The mixed cluster; each of its kinds alone on as many devices (the cluster were it
    all of one kind); each group alone on its own devices (the cluster without the other
    kinds)."""
    from costmodels.cluster import load_cluster

    path = folder / f"{case.preset}.onnx"
    if not path.exists():
        zoo.save(zoo.build(case.preset, dtype="bfloat16"), path)
    cluster = load_cluster(CLUSTERS / case.cluster)
    runs: list[tuple[str, dict[str, Any]]] = [
        (cluster.describe(), {"cluster": cluster}),
        (f"{cluster.describe()}, even dp", {"cluster": cluster,
                                            "parallel": {"dp_shares": "even"}}),
        *((f"{cluster.devices} × {group.profile.name}",
           {"profile": group.profile, "devices": cluster.devices})
          for group in cluster.groups),
        *((f"{group.devices} × {group.profile.name}",
           {"profile": group.profile, "devices": group.devices})
          for group in cluster.groups)]
    rows = []
    for label, where in runs:
        result, elapsed = _timed(path, batch=case.batch, dims={"seq": 2048},
                                 precision=case.precision, **where)
        if isinstance(result, str):
            rows.append(f"{case.preset:<10}{label:<37} {result} ({elapsed:.1f} s)")
            continue
        par = result.parallel
        if not par.even_shares:  # the replicas' rows per micro-batch, fewest to most
            label += f", dp rows {min(par.dp_shares)}-{max(par.dp_shares)}"
        rows.append(f"{case.preset:<10}{label:<37}{par.dp:>4}{par.tp:>4}{par.pp:>4}"
                    f"{par.micro_batches:>5}{par.zero:>5}  {par.recompute:<10}"
                    f"{_schedule(result):<9}{_stages(result):<24}" + _outcome(result, elapsed))
    return rows


def main_mixed(names: list[str] | None) -> None:
    header = (f"{'model':<10}{'devices':<37}{'dp':>4}{'tp':>4}{'pp':>4}{'mb':>5}{'zero':>5}  "
              f"{'recompute':<10}{'schedule':<9}{'units per stage':<24}{'step time':>11}"
              f"{'memory':>11}{'fits':>5}{'search s':>9}")
    print_table("mixed clusters beside each of their kinds alone, seq 2048, Adam", header,
                lambda folder: (row for case in MIXED_CASES if not names or case.name in names
                                for row in run_mixed_case(folder, case)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="only these presets")
    parser.add_argument("--devices", nargs="*", type=int, help="only these device counts")
    parser.add_argument("--profiles", nargs="*", default=list(PROFILES))
    parser.add_argument("--new", nargs="*", metavar="NAME",
                        help="the long-context and MoE rows instead (all, or these: "
                             f"{', '.join(c.name for c in NEW_CASES)})")
    parser.add_argument("--mixed", nargs="*", metavar="NAME",
                        help="the mixed-cluster rows instead (all, or these: "
                             f"{', '.join(c.name for c in MIXED_CASES)})")
    args = parser.parse_args()
    if args.new is not None:
        main_new(args.new)
        return
    if args.mixed is not None:
        main_mixed(args.mixed)
        return
    cases = [c for c in CASES if (not args.models or c[0] in args.models)
             and (not args.devices or c[1] in args.devices)]
    header = (f"{'model':<11}{'devs':>6}{'batch':>6}  {'profile':<12}{'dp':>5}{'tp':>4}{'pp':>4}"
              f"{'mb':>5}{'zero':>5}  {'recompute':<10}{'schedule':<12}{'step time':>11}"
              f"{'memory':>11}{'fits':>5}{'search s':>9}")
    print_table("automatic search (op-level meshes + pipeline/ZeRO/recompute), bf16, seq 2048, "
                "Adam", header,
                lambda folder: (run_case(folder, model, devices, batch, profile)
                                for profile in args.profiles
                                for model, devices, batch in cases))


if __name__ == "__main__":
    main()
