"""Predicted vs measured time of single ops and collectives on this machine.

Run: python bench/cost_vs_measured.py [--profile NAME_OR_JSON] [--nproc 2] [--keep FILE]
Without --profile it first calibrates this machine (costmodels.calibrate, full run; --keep
saves that profile) and then measures separately, so the comparison is out of sample; two
more columns then show the prediction with the profile fields docs/cost-model.md proposes
(per-dtype GEMM ramp, per-collective bandwidth factors) set from that calibration. Every
case runs in all ranks at once (one torch thread each, as calibration does); collectives
use gloo on 127.0.0.1.
Prints one row per case: the cost model's prediction, the measured lower-quartile time,
and their ratio; then the median ratio overall and per group. Op FLOPs and bytes follow
planner.ops.cost_op's conventions, so a row shows what the planner would charge for that op.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from costmodels.calibrate import (
    FULL_TIMEOUT_S,
    build_profile,
    measurement_plan,
)
from costmodels.communication import CommGroup, best_algorithm
from costmodels.compute import op_time
from costmodels.measure import Plan, median_over_ranks, run_ranks, slowest_over_ranks
from costmodels.profile import HardwareProfile, load_profile
from planner.ops import record_for

MATMUL = (("float32", 32), ("float32", 64), ("float32", 128), ("float32", 256),
          ("float32", 512), ("float32", 1024), ("bfloat16", 64), ("bfloat16", 256),
          ("bfloat16", 1024))
ELEMENTS = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
COLLECTIVE_BYTES = (1 << 10, 1 << 16, 1 << 20, 1 << 23, 1 << 25)
ONNX_OP = {"add": "Add", "mul": "Mul", "gelu": "Gelu"}
ITEMSIZE = {"float32": 4, "bfloat16": 2}
PEAK_KEY = {"float32": "fp32", "bfloat16": "bf16"}


def _flops_per_element(op_type: str) -> float:
    """The elementwise op's FLOPs per output element, as the planner counts them."""
    record = record_for(op_type)
    assert record is not None
    return record.work.flops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile name or JSON (default: calibrate first)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="also write the calibrated profile here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    proposed = None
    if args.profile:
        profile = load_profile(args.profile)
    else:
        profile, proposed = _calibrate(args.nproc, args.keep)
    print(f"measuring ({args.nproc} ranks) ...", file=sys.stderr)
    plan = Plan(matmul=MATMUL,
                elementwise=tuple((op, n) for op in ONNX_OP for n in ELEMENTS),
                collectives=COLLECTIVES, collective_bytes=COLLECTIVE_BYTES,
                group_sizes=(args.nproc,), target_s=0.3, min_reps=2, rounds=3)
    results = run_ranks(plan, args.nproc)
    rows = _rows(profile, proposed, results, args.nproc)
    _print(profile, proposed, rows, time.monotonic() - started)


def _calibrate(nproc: int, keep: Path | None) -> tuple[HardwareProfile, None]:
    """Calibrate (full run) and load the profile it writes.

    Calibrated profiles carry the per-dtype GEMM ramp and per-collective factors, so the
    predictions below already use everything calibration measured.
    """
    print(f"calibrating ({nproc} ranks) ...", file=sys.stderr)
    plan = measurement_plan(nproc, quick=False)
    results = run_ranks(plan, nproc, "gloo", FULL_TIMEOUT_S)
    data = build_profile(results, plan, nproc, "gloo")
    with tempfile.TemporaryDirectory() as scratch:
        path = keep or Path(scratch) / "calibrated.json"
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        profile = load_profile(path)
    return profile, None


def _rows(profile: HardwareProfile, proposed: HardwareProfile | None, results,
          nproc: int) -> list[tuple[str, str, float, float, float | None]]:
    """(group, case, predicted, measured, predicted with the proposed fields)."""
    rows = []
    both = (profile, proposed or profile)
    matmul = median_over_ranks(results, "matmul", ("dtype", "n"))
    for (dtype, n), seconds in sorted(matmul.items(),
                                      key=lambda kv: (kv[0][0] != "float32", kv[0][1])):
        flops, nbytes = 2.0 * n**3, 3.0 * n * n * ITEMSIZE[dtype]
        now, later = (op_time(p, "MatMul", flops, nbytes, dtype) for p in both)
        rows.append(("matmul", f"{dtype} {n}^3", now, seconds, later))
    for (op, numel), seconds in sorted(median_over_ranks(results, "elementwise",
                                                         ("op", "numel")).items()):
        onnx = ONNX_OP[op]
        inputs = 2 if op in ("add", "mul") else 1
        nbytes = 4.0 * numel * (inputs + 1)
        predicted = op_time(profile, onnx, _flops_per_element(onnx) * numel, nbytes,
                            "float32")
        rows.append(("elementwise", f"{onnx} {numel:,} fp32", predicted, seconds, predicted))
    group = CommGroup(nproc, nproc, nproc)
    for (kind, p, nbytes), seconds in sorted(slowest_over_ranks(results).items()):
        algorithm, now = best_algorithm(profile, kind, nbytes, group)
        later = best_algorithm(both[1], kind, nbytes, group)[1]
        rows.append(("collective", f"{kind} p={p} {_size(nbytes)} ({algorithm})", now,
                     seconds, later))
    return rows


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def _print(profile: HardwareProfile, proposed: HardwareProfile | None, rows,
           elapsed: float) -> None:
    print(f"profile: {profile.name} ({profile.path})")
    header = "| group | case | predicted us | measured us | ratio |"
    if proposed is not None:
        ramps = proposed.matmul_overhead_s  # type: ignore[attr-defined]
        text = ", ".join(f"{k} {float(v.value) * 1e6:.1f}" for k, v in ramps.items())
        header += f" with proposed fields (R: {text} us; collective factors) us | ratio |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    ratios: dict[str, list[float]] = {}
    later_ratios: dict[str, list[float]] = {}
    for group, case, predicted, measured, later in rows:
        ratios.setdefault(group, []).append(predicted / measured)
        line = f"| {group} | {case} | {_us(predicted)} | {_us(measured)} | " \
               f"{predicted / measured:.2f} |"
        if proposed is not None and later is not None:
            later_ratios.setdefault(group, []).append(later / measured)
            line += f" {_us(later)} | {later / measured:.2f} |"
        print(line)
    print()
    for name, table in (("predicted", ratios), ("with proposed fields", later_ratios)):
        if not table:
            continue
        everything = [r for values in table.values() for r in values]
        print(f"median ratio ({name} / measured): {statistics.median(everything):.2f} over "
              f"{len(everything)} cases; " + "; ".join(
                  f"{g} {statistics.median(r):.2f}" for g, r in table.items()))
    print(f"(bench wall time {elapsed:.0f} s)")


if __name__ == "__main__":
    main()
