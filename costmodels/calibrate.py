"""Measure this machine with torch and write a hardware profile of it.

`shardplan calibrate [--nproc N] [--backend gloo|nccl] -o profile.json` starts N ranks
(costmodels.measure), each with one torch thread, and measures while all of them run:

Each point is the lower quartile of its per-call times (costmodels.measure says why).

* matmul n x n @ n x n over n and dtypes: the peak is the best sustained rate, so
  `matmul_efficiency` is 1; the ramp R of costmodels.compute (t = F / P + R) is fitted by
  least squares on the relative error into `matmul_overhead_s` per dtype, and the whole
  size curve goes into the note;
* `memory_bandwidth_Bps`: x.copy_(y) of a large preallocated fp32 buffer, read + write;
* `kernel_launch_s`: torch.add on one-element tensors;
* `compute_overlap`: an all_reduce alone, matmuls alone and the two issued together
  (`overlap_share`): how much of a collective hides behind compute (none on a CPU host,
  where gloo's threads need the cores the ranks compute on);
* each collective over message sizes for groups of 2..N ranks. The per-step latency a and
  bus bandwidth B of the level come from a least-squares fit of the ring all_reduce formula
  t = 2(p-1) a + 2(p-1)/p n / B (relative error, a, B >= 0); the other collectives' own fits
  give their bandwidth as a factor of B (`collective_factors` of the level, and the note).

Every number cites a `measured-<date>` source that states what was run. The fabric between
nodes cannot be measured on one machine: the profile gives it a nominal 10 GbE NIC per
node, cited as such. The written file is loaded back with load_profile before returning.

The `shardplan calibrate` verb itself is planner/cli/calibrate.py; nothing here imports the CLI.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from costmodels.communication import ring_terms
from costmodels.measure import Plan, Results, median_over_ranks, run_ranks, slowest_over_ranks
from costmodels.profile import SCHEMA, load_profile
from planner.errors import ShardplanError

#: Wall-clock limits of one measurement run (the full one must end within 3 minutes).
FULL_TIMEOUT_S = 170.0
QUICK_TIMEOUT_S = 60.0
#: Fitted collectives besides all_reduce, reported as bandwidth factors.
FACTOR_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: Nominal NIC of the calibrated "cluster" of such machines (not measurable here).
NOMINAL_NIC_BPS = 10e9 / 8
NOMINAL_NIC_EFFICIENCY = 1448 / 1538  # TCP payload per full Ethernet frame at MTU 1500


@dataclass(frozen=True)
class RingFit:
    """alpha (s per step) and bus bandwidth (B/s) fitted to one collective's points."""

    kind: str
    latency_s: float
    bandwidth_Bps: float
    points: int  # points the fit kept
    dropped: int  # points dropped as outliers
    worst_error: float  # largest |predicted / measured - 1| over the kept points


#: The compute before each timed gloo collective (`Plan.step_burst_s`): about what runs
#: between two collectives of a small tensor-parallel step here (llama_medium: 2-4 ms). A
#: GPU's collectives are timed back to back: NCCL's kernels queue behind the compute on
#: the device, with no host threads to wake.
STEP_BURST_S = 2e-3


def measurement_plan(nproc: int, quick: bool, backend: str = "gloo") -> Plan:
    """The sizes to measure: a few for tests (quick), more for a real profile."""
    groups = tuple(range(2, nproc + 1))
    if backend == "nccl":  # GPUs: larger work to reach the asymptotes
        sizes = (256, 1024, 2048, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
        return Plan(matmul=tuple((d, n) for d in ("float32", "bfloat16", "float16")
                                 for n in sizes),
                    copy_bytes=1 << 30, dispatch_calls=2000,
                    collectives=("all_reduce", "all_gather", "reduce_scatter"),
                    collective_bytes=(4, 1 << 20, 1 << 24, 1 << 28),
                    group_sizes=groups, target_s=0.05 if quick else 0.2, min_reps=5,
                    overlap_bytes=1 << 28, overlap_matmul=4096)
    if quick:
        return Plan(matmul=(("float32", 32), ("float32", 128), ("float32", 512),
                            ("bfloat16", 128), ("bfloat16", 512)),
                    copy_bytes=16 << 20, dispatch_calls=500,
                    collectives=("all_reduce", "all_gather", "reduce_scatter"),
                    collective_bytes=(4, 1 << 18, 1 << 22),
                    group_sizes=groups, target_s=0.04, min_reps=3, max_reps=200, rounds=1,
                    overlap_bytes=1 << 22, step_burst_s=STEP_BURST_S)
    return Plan(matmul=tuple((d, n) for d in ("float32", "bfloat16")
                             for n in (32, 64, 128, 256, 512, 1024)),
                copy_bytes=64 << 20, dispatch_calls=2000,
                collectives=("all_reduce", *FACTOR_KINDS),
                collective_bytes=(4, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 23, 1 << 24,
                                  1 << 25),
                group_sizes=groups, target_s=0.3, min_reps=2, max_reps=2000, rounds=3,
                overlap_bytes=1 << 24, step_burst_s=STEP_BURST_S)


def fit_ring(kind: str, points: Sequence[tuple[int, float, float]],
             outlier: float = 0.5) -> RingFit:
    """Fit t = steps(p) a + factor(p) n / B to (p, nbytes, seconds) points.

    Least squares on the relative error, so the latency (small messages) and the bandwidth
    (large ones) both count; a latency the data drive negative is the smallest message's
    time per step instead (a profile's latency is positive). A point
    more than `outlier` off the fit is dropped and the fit redone, for at most a third of
    the points: one burst of load on a shared host must not set the link's numbers.
    """
    if len(points) < 2:
        raise ShardplanError(f"cannot fit {kind}: need at least 2 measured sizes, got "
                             f"{len(points)}")
    kept = list(points)
    while True:
        solution, errors = _solve_ring(kind, kept)
        worst = int(np.argmax(np.abs(errors)))
        if abs(errors[worst]) <= outlier or len(points) - len(kept) >= len(points) // 3 \
                or len(kept) <= 2:
            break
        del kept[worst]
    return RingFit(kind, float(solution[0]), float(1.0 / solution[1]), len(kept),
                   len(points) - len(kept), float(np.max(np.abs(errors))))


def _solve_ring(kind: str, points: Sequence[tuple[int, float, float]],
                ) -> tuple[np.ndarray, np.ndarray]:
    rows = np.array([[ring_terms(kind, p)[0] / t, ring_terms(kind, p)[1] * n / t]
                     for p, n, t in points])
    target = np.ones(len(points))
    solution = np.linalg.lstsq(rows, target, rcond=None)[0]
    if solution[0] <= 0:
        # The sizes leave no latency the fit can see (load noise on the small messages).
        # A profile's latency is positive, so take it from the smallest message, which is
        # little else (the quick and full runs start at 8 B): an upper bound, measured;
        # the bandwidth is fitted to what that latency leaves of each point.
        latency = _smallest_message_latency(kind, points)
        rest = target - rows[:, 0] * latency
        per_byte = float(rows[:, 1] @ rest / (rows[:, 1] @ rows[:, 1]))
        solution = np.array([latency, per_byte])
    if solution[1] <= 0:
        # Time did not grow with size (load noise on a shared host): take the latency from
        # the smallest message and the bandwidth from the largest, a conservative fit.
        largest = max(points, key=lambda point: point[1])
        seconds_per_byte = largest[2] / (ring_terms(kind, largest[0])[1] * largest[1])
        solution = np.array([_smallest_message_latency(kind, points), seconds_per_byte])
    return solution, rows @ solution - 1.0


def _smallest_message_latency(kind: str, points: Sequence[tuple[int, float, float]]
                              ) -> float:
    """The smallest message's time per latency step: an upper bound of the latency."""
    smallest = min(points, key=lambda point: point[1])
    return smallest[2] / max(ring_terms(kind, smallest[0])[0], 1e-12)


def fit_ramp(points: Sequence[tuple[float, float]], peak: float) -> float:
    """R in t = F / peak + R, least squares on the relative error; never negative."""
    residual = np.array([t - f / peak for f, t in points])
    weight = np.array([1.0 / t**2 for _, t in points])
    return max(0.0, float(residual @ weight / weight.sum()))


def calibrate(nproc: int = 2, backend: str = "gloo", output: Path | None = None,
              progress: Callable[[str], None] | None = None, quick: bool = False,
              ) -> dict[str, Any]:
    """Measure this machine and write a profile JSON to `output`; returns the profile data."""
    if output is None:
        raise ShardplanError("calibrate needs an output path (-o profile.json)")
    output = Path(output)
    if not output.parent.is_dir():
        raise ShardplanError(f"{output}: the folder {output.parent} does not exist")
    _check_request(nproc, backend)
    say = progress or (lambda _text: None)
    started = time.monotonic()
    plan = measurement_plan(nproc, quick, backend)
    say(f"measuring with {nproc} {backend} ranks ({'quick' if quick else 'full'} run)")
    results = run_ranks(plan, nproc, backend, QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S,
                        progress=lambda text: say(f"[{time.monotonic() - started:5.1f} s] "
                                                  f"{text}"))
    data = build_profile(results, plan, nproc, backend, quick)
    try:
        output.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ShardplanError(f"{output}: cannot write the profile ({exc.strerror or exc})"
                             ) from None
    load_profile(output)  # the file must pass the same checks as a bundled profile
    say(f"wrote {output} in {time.monotonic() - started:.1f} s")
    return data


def _check_request(nproc: int, backend: str) -> None:
    if nproc < 2:
        raise ShardplanError(f"--nproc {nproc}: calibration needs at least 2 processes to "
                             f"measure collectives")
    if backend not in ("gloo", "nccl"):
        raise ShardplanError(f"--backend {backend}: use gloo or nccl")
    if backend == "nccl":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < nproc:
            raise ShardplanError(f"--backend nccl needs {nproc} CUDA devices, this machine "
                                 f"has {count}; use --backend gloo for a CPU profile")


def build_profile(results: Sequence[Results], plan: Plan, nproc: int, backend: str,
                  quick: bool = False) -> dict[str, Any]:
    """Fit the measurements and lay them out in the hardware-profile schema."""
    date = datetime.date.today().isoformat()
    key = f"measured-{date}"
    compute = _compute_section(results, key)
    overlap = _overlap_entry(results, plan, key)
    fits = collective_fits(results)
    ring = fits["all_reduce"]
    factors = {k: fit.bandwidth_Bps / ring.bandwidth_Bps for k, fit in fits.items()
               if k != "all_reduce"}
    fit_text = "; ".join(f"{f.kind}: a {f.latency_s * 1e6:.0f} us, B {f.bandwidth_Bps / 1e9:.2f}"
                         f" GB/s ({f.points} sizes, worst {f.worst_error:.0%} off"
                         f"{f', {f.dropped} outlier dropped' if f.dropped else ''})"
                         for f in fits.values())
    intra: dict[str, Any] = {
        "name": f"{backend}-loopback" if backend == "gloo" else f"{backend}-intra-node",
        "group_size": nproc,
        "bandwidth_Bps": _cited(ring.bandwidth_Bps, key,
                                f"bus bandwidth B of the ring all_reduce fit over groups of "
                                f"{_groups_text(nproc)} ranks and all sizes; per-collective "
                                f"fits: {fit_text}"),
        "efficiency": _cited(1.0, "derived", "bandwidth_Bps is already the fitted sustained "
                             "bus bandwidth, so no further discount"),
        "latency_s": _cited(ring.latency_s, key, "per-step latency a of the same fit "
                            "(t = 2(p-1) a + 2(p-1)/p n / B)"),
    }
    if factors:
        intra["collective_factors"] = {
            k: _cited(v, key, f"{k} fit bandwidth / all_reduce fit bandwidth")
            for k, v in factors.items()}
    intra["collective_times"] = measured_times(results, key)
    nic_share = NOMINAL_NIC_BPS / nproc
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "name": f"calibrated-{backend}",
        "description": (f"Calibrated {date}: {_cpu_model()}, {nproc} {backend} ranks with one "
                        f"torch thread each; a nominal 10 GbE NIC between such nodes"),
        "sources": {
            key: _measurement_citation(results, plan, nproc, backend, quick, date),
            "ieee-802.3ae": "IEEE Std 802.3ae-2002, 10 Gb/s Ethernet: 10 Gb/s data rate. "
                            "Tag P: a nominal line rate; one machine has no second node.",
            "ethernet-tcp-framing": "IEEE Std 802.3 frame overhead (preamble 8 B, header 14 B, "
                                    "FCS 4 B, inter-packet gap 12 B) and the IPv4 (RFC 791, "
                                    "20 B), TCP (RFC 9293, 20 B) and timestamp option (RFC "
                                    "7323, 12 B) headers: 1448 B of payload per 1538 B frame.",
            "derived": "Derived from other numbers of this profile; each note shows how.",
        },
        "device": {
            "memory_bytes": _cited(_memory_total() // nproc, key,
                                   f"physical memory (/proc/meminfo MemTotal) split between "
                                   f"the {nproc} ranks"),
            **compute,
            **({"compute_overlap": overlap} if overlap else {}),
        },
        "topology": {
            "devices_per_node": _cited(nproc, key, f"one rank per measured process, {nproc} "
                                       f"on {os.cpu_count()} logical CPUs"),
            "levels": [
                intra,
                {"name": "ethernet-10g-nominal", "group_size": None,
                 "bandwidth_Bps": _cited(nic_share, "derived",
                                         f"nominal: one 10 GbE NIC per node (ieee-802.3ae: "
                                         f"1.25e9 B/s) shared by its {nproc} ranks"),
                 "efficiency": _cited(NOMINAL_NIC_EFFICIENCY, "ethernet-tcp-framing",
                                      "TCP payload share of a full frame at MTU 1500; gloo's "
                                      "own overhead is not included"),
                 "latency_s": _cited(ring.latency_s, "derived",
                                     "U: assumed equal to the measured loopback step latency, "
                                     "which gloo's software path dominates")},
            ],
        },
    }
    return data


@dataclass(frozen=True)
class MatmulFit:
    """One dtype's matmul measurements: best rate, fitted ramp and the size curve."""

    dtype: str
    peak_flops: float
    best_n: int
    ramp_s: float
    curve: tuple[tuple[int, float], ...]  # (n, rate / peak)


def matmul_fits(results: Sequence[Results]) -> dict[str, MatmulFit]:
    """Per dtype: peak = best sustained rate over n; ramp R of t = F / peak + R."""
    by_dtype: dict[str, list[tuple[int, float]]] = {}
    for (dtype, n), seconds in sorted(median_over_ranks(results, "matmul",
                                                        ("dtype", "n")).items()):
        by_dtype.setdefault(dtype, []).append((n, seconds))
    fits = {}
    for dtype, points in by_dtype.items():
        rates = [(n, 2.0 * n**3 / s) for n, s in points]
        best_n, peak = max(rates, key=lambda item: item[1])
        ramp = fit_ramp([(2.0 * n**3, s) for n, s in points], peak)
        fits[dtype] = MatmulFit(dtype, peak, best_n, ramp,
                                tuple((n, rate / peak) for n, rate in rates))
    return fits


def measured_times(results: Sequence[Results], key: str) -> dict[str, Any]:
    """Each collective's measured points, cited (`LinkLevel.collective_times`): where a
    backend switches algorithm or protocol with the size, the points follow it and the
    ring fit's straight line does not (gloo's all_reduce on this host: 4 MiB in 4.1 ms,
    10 MB in 12, 32 MiB in 25, against the fit's 3.4, 7.9 and 24.5)."""
    return {kind: {"value": [[p, int(n), float(f"{s:.4g}")] for p, n, s in found],
                   "source": key,
                   "note": "[group size, bytes (the larger form), seconds]: the slowest "
                           "member's lower quartile per point, the same points the fit "
                           "reads"}
            for kind, found in collective_points(results).items()}


def collective_points(results: Sequence[Results]
                      ) -> dict[str, list[tuple[int, float, float]]]:
    """Each collective kind's (group size, bytes, seconds) points, the slowest member's."""
    points: dict[str, list[tuple[int, float, float]]] = {}
    for (kind, p, nbytes), seconds in sorted(slowest_over_ranks(results).items()):
        points.setdefault(kind, []).append((p, float(nbytes), seconds))
    return points


def collective_fits(results: Sequence[Results]) -> dict[str, RingFit]:
    """A ring fit per measured collective kind, over all its group sizes and messages."""
    points = collective_points(results)
    if "all_reduce" not in points:
        raise ShardplanError("calibration measured no all_reduce; cannot fit the link")
    return {kind: fit_ring(kind, pts) for kind, pts in points.items()}


def overlap_share(transfer_s: float, compute_s: float, together_s: float) -> float:
    """The share of the shorter of a transfer and a compute burst that runs behind the
    other when both are issued together: 1 when together they take the longer one's time,
    0 when they take the sum (`device.compute_overlap`)."""
    shorter = min(transfer_s, compute_s)
    if shorter <= 0:
        return 1.0
    return float(min(1.0, max(0.0, (transfer_s + compute_s - together_s) / shorter)))


def _overlap_entry(results: Sequence[Results], plan: Plan, key: str
                   ) -> dict[str, Any] | None:
    """`device.compute_overlap` from each rank's three timings (median over ranks); None
    when no rank measured them."""
    measured = [r.overlap for r in results if {"transfer", "compute", "both"} <= set(r.overlap)]
    if not measured:
        return None
    transfer, compute, both = (float(np.median([m[k] for m in measured]))
                               for k in ("transfer", "compute", "both"))
    share = overlap_share(transfer, compute, both)
    return _cited(share, key, f"all_reduce of {plan.overlap_bytes >> 20} MiB over all ranks "
                  f"alone {transfer * 1e3:.2f} ms, fp32 {plan.overlap_matmul}^3 matmuls alone "
                  f"{compute * 1e3:.2f} ms, issued together {both * 1e3:.2f} ms (lower "
                  "quartile per rank, median over ranks): share = (alone + alone - together)"
                  " / shorter")


def _compute_section(results: Sequence[Results], key: str) -> dict[str, Any]:
    fits = matmul_fits(results)
    if "float32" not in fits:
        raise ShardplanError("calibration measured no fp32 matmul; cannot write a profile")
    peaks = {_PEAK_KEY[f.dtype]: _cited(f.peak_flops, key,
                                        f"best sustained {f.dtype} matmul rate, at n = "
                                        f"{f.best_n} (lower quartile per rank, median over "
                                        f"ranks); a measured rate, not a datasheet peak")
             for f in fits.values()}
    curves = "; ".join(
        f"{_PEAK_KEY[f.dtype]} rate / peak by n ("
        + ", ".join(f"{n}: {fraction:.2f}" for n, fraction in f.curve)
        + f"); ramp R = {f.ramp_s * 1e6:.1f} us" for f in fits.values())
    copy = [r.copy for r in results if r.copy]
    bandwidth = float(np.median([2 * c["bytes"] / c["seconds"] for c in copy]))
    dispatch = float(np.median([r.dispatch_s for r in results]))
    section: dict[str, Any] = {
        "memory_bandwidth_Bps": _cited(bandwidth, key,
                                       f"x.copy_(y) of {int(copy[0]['bytes']) >> 20} MiB fp32, "
                                       f"read + write, lower quartile per rank, median over "
                                       f"ranks"),
        "peak_flops": peaks,
        "matmul_efficiency": _cited(1.0, "derived",
                                    "peak_flops holds measured sustained rates, so the large-"
                                    f"GEMM asymptote is 1. Size curve (n x n x n): {curves}. "
                                    f"costmodels.compute models it as t = F / P + R"),
        "memory_efficiency": _cited(1.0, "derived", "memory_bandwidth_Bps is already a "
                                    "measured sustained rate"),
        "kernel_launch_s": _cited(dispatch, key, "torch.add on one-element tensors, per call"),
    }
    section["matmul_overhead_s"] = {
        _PEAK_KEY[f.dtype]: _cited(max(f.ramp_s, 1e-9), key, f"{f.dtype} GEMM ramp R "
                                   f"fitted to the size curve (see matmul_efficiency)")
        for f in fits.values()}
    return section


_PEAK_KEY = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _cited(value: float | int, source: str, note: str) -> dict[str, Any]:
    if isinstance(value, float):
        value = float(f"{value:.4g}")
    return {"value": value, "source": source, "note": note}


def _measurement_citation(results: Sequence[Results], plan: Plan, nproc: int, backend: str,
                          quick: bool, date: str) -> str:
    import torch

    matmul = sorted({n for _, n in plan.matmul})
    dtypes = sorted({d for d, _ in plan.matmul})
    sizes = ", ".join(_bytes_text(b) for b in plan.collective_bytes)
    return (f"Measured on {date} by `shardplan calibrate --nproc {nproc} --backend {backend}`"
            f"{' (quick run)' if quick else ''}: {_cpu_model()}, {os.cpu_count()} logical "
            f"CPUs, Python {platform.python_version()}, torch {torch.__version__}. {nproc} "
            f"ranks started together, one torch thread each, every point measured in all "
            f"ranks at once; each point timed in {plan.rounds} passes over the plan, each "
            f"pass one warm-up call then a repeat count agreed by the ranks for about "
            f"{plan.target_s / plan.rounds:.2g} s (at least {plan.min_reps} calls); the point "
            f"is the lower quartile of all its per-call times (interference from other "
            f"processes only adds time). Matmul: a @ b on "
            f"n x n tensors, n in {matmul}, dtypes {', '.join(dtypes)}. Copy: x.copy_(y) on "
            f"{_bytes_text(plan.copy_bytes)} fp32 tensors. Dispatch: {plan.dispatch_calls} "
            f"calls of torch.add on one-element tensors. Collectives over {backend} on "
            f"127.0.0.1, groups of {_groups_text(nproc)} ranks: "
            f"{', '.join(plan.collectives)} on fp32 buffers of {sizes} (the gathered or "
            f"unreduced size), slowest rank's value"
            f"{_burst_text(plan)}. "
            f"The host may be shared, so re-running can move numbers by up to 2x.")


def _burst_text(plan: Plan) -> str:
    if not plan.step_burst_s:
        return ", the calls back to back"
    return (f", each call after {plan.step_burst_s * 1e3:g} ms of fp32 "
            f"{plan.overlap_matmul}^3 matmuls, only the call timed, "
            f"as a training step issues its collectives after its kernels")


def _groups_text(nproc: int) -> str:
    return "2" if nproc == 2 else f"2 to {nproc}"


def _bytes_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        raise ShardplanError("cannot read this machine's memory size") from None



@dataclass(frozen=True)
class HostSample:
    """One run of the executor's host-time probe (`planner.cli.host`): a model of
    `layers` layers trained under a plan of this profile, its op runs per step counted by
    how they run (every op forward, and backward where a gradient flows; on plain tensors
    or through DTensor: `planner.sharding.batch.runs_as_data_parallel`)."""

    plan: str  # "data" or "tensor": the probe's plan
    layers: int
    local_runs: int
    distributed_runs: int
    predicted_s: float  # the plan's step on the profile without host time
    measured_s: float  # median step the executor took

    @property
    def unpredicted_s(self) -> float:
        return self.measured_s - self.predicted_s


@dataclass(frozen=True)
class HostFit:
    """The host's seconds per op run (on plain tensors, through DTensor) and per step."""

    local_s: float
    distributed_s: float
    step_s: float


def fit_host(samples: Sequence[HostSample]) -> HostFit:
    """The host's times from the probe's runs: per plain op run, the growth of the
    data-parallel plan's unpredicted time (measured − predicted) between its shallowest
    and deepest run over the op runs it adds; per DTensor op run, the same growth under
    the tensor-parallel plan less its added plain op runs; per step, what the shallowest
    data-parallel run leaves beyond its op runs. None below 0 (noise cannot make the host
    faster than the device), a DTensor op run never below a plain one."""
    def ends(kind: str) -> tuple[HostSample, HostSample]:
        runs = sorted((s for s in samples if s.plan == kind),
                      key=lambda s: s.local_runs + s.distributed_runs)
        if len(runs) < 2 or runs[0].layers == runs[-1].layers:
            raise ShardplanError(f"the host-time fit needs {kind}-parallel probes of two "
                                 "depths")
        return runs[0], runs[-1]

    low, high = ends("data")
    added = high.local_runs - low.local_runs
    if added <= 0 or high.distributed_runs != low.distributed_runs:
        raise ShardplanError("the data-parallel probes must differ in plain op runs only")
    local = max(0.0, (high.unpredicted_s - low.unpredicted_s) / added)
    step = max(0.0, low.unpredicted_s - (low.local_runs + low.distributed_runs) * local)
    low, high = ends("tensor")
    added = high.distributed_runs - low.distributed_runs
    if added <= 0:
        raise ShardplanError("the tensor-parallel probes add no DTensor op runs")
    distributed = max(local, (high.unpredicted_s - low.unpredicted_s
                              - (high.local_runs - low.local_runs) * local) / added)
    return HostFit(local, distributed, step)


def with_host_times(data: dict[str, Any], samples: Sequence[HostSample],
                    quick: bool = False) -> dict[str, Any]:
    """The calibrated profile `data` with `device.host_op_s` and `device.host_step_s`
    fitted to the executor's probes (`fit_host`), cited to a source of their own."""
    fit = fit_host(samples)
    date = datetime.date.today().isoformat()
    key = f"measured-{date}-executor"
    runs = "; ".join(
        f"{s.plan} parallel, {s.layers} layer{'s' if s.layers > 1 else ''}: "
        f"{s.local_runs} plain and {s.distributed_runs} DTensor op runs, measured "
        f"{s.measured_s * 1e3:.2f} ms, predicted {s.predicted_s * 1e3:.2f} ms"
        for s in samples)
    sources = {**data["sources"], key: (
        f"Measured {date} by shardplan calibrate{' --quick' if quick else ''}: the "
        f"executor (executor.parallelize, gloo ranks) training a GPT probe "
        f"(executor.module.probe.Probe) at two depths under a data-parallel and a "
        f"tensor-parallel plan of this profile, lower quartile of the step times after "
        f"two warm-up steps. "
        f"{runs}.")}
    per_op = {
        "local": _cited(fit.local_s, key, "growth of the data-parallel probe's (measured - "
                        "predicted) step between its depths over the op runs added; "
                        "forward and backward taken alike"),
        "distributed": _cited(fit.distributed_s, key, "the same under the tensor-parallel "
                              "plan, less its added plain op runs, over the DTensor op runs "
                              "added (DTensor's dispatch and the executor's moves per op)"),
    }
    device = {**data["device"], "host_op_s": {
        f"{phase}_{kind}": per_op[kind] for phase in ("forward", "backward")
        for kind in ("local", "distributed")},
        "host_step_s": _cited(fit.step_s, key, "the shallow data-parallel probe's "
                              "(measured - predicted) step beyond its op runs' host time: "
                              "the loss, the optimizer's Python and the step's bookkeeping")}
    return {**data, "sources": sources, "device": device}
