"""Calibration: the fits on synthetic data, the profile it writes, and one real quick run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodels.calibrate import (
    HostSample,
    build_profile,
    calibrate,
    collective_fits,
    fit_host,
    fit_ramp,
    fit_ring,
    matmul_fits,
    measurement_plan,
    overlap_share,
    with_host_times,
)
from costmodels.communication import CommGroup, collective_time, ring_terms
from costmodels.compute import op_time
from costmodels.measure import Plan, Results, lower_quartile, run_ranks
from costmodels.profile import load_profile
from planner.cli.calibrate import main
from planner.errors import ShardplanError

ALPHA, BANDWIDTH = 80e-6, 1.5e9  # a gloo-like link: 80 us per step, 1.5 GB/s
PEAK, RAMP = 100e9, 2e-6


def _ring_seconds(kind: str, p: int, nbytes: float) -> float:
    steps, factor = ring_terms(kind, p)
    return steps * ALPHA + factor * nbytes / BANDWIDTH


def _synthetic_results(nproc: int = 2) -> list[Results]:
    """What two ranks would report on a machine that follows the models exactly."""
    results = []
    for rank in range(nproc):
        result = Results(rank=rank)
        for n in (32, 64, 128, 256, 512):
            result.matmul.append({"dtype": "float32", "n": n,
                                  "seconds": 2.0 * n**3 / PEAK + RAMP})
            result.matmul.append({"dtype": "bfloat16", "n": n,
                                  "seconds": 2.0 * n**3 / (4 * PEAK) + 6 * RAMP})
        result.copy = {"bytes": 64.0 * 2**20, "seconds": 2 * 64 * 2**20 / 20e9}
        result.dispatch_s = 1e-6
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            for p in range(2, nproc + 1):
                for nbytes in (8, 2**14, 2**18, 2**22, 2**25):
                    seconds = _ring_seconds(kind, p, nbytes)
                    if kind == "reduce_scatter":
                        seconds = (p - 1) * ALPHA + (p - 1) / p * nbytes / (BANDWIDTH / 3)
                    result.collectives.append({"kind": kind, "p": p, "nbytes": nbytes,
                                               "seconds": seconds})
        results.append(result)
    return results


def test_fit_ring_recovers_alpha_and_bandwidth() -> None:
    points = [(p, n, _ring_seconds("all_reduce", p, n))
              for p in (2, 3, 4) for n in (4, 1e4, 1e6, 1e8)]
    fit = fit_ring("all_reduce", points)
    assert fit.latency_s == pytest.approx(ALPHA, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(BANDWIDTH, rel=1e-6)
    assert fit.dropped == 0 and fit.worst_error < 1e-9


def test_fit_ring_drops_one_burst_of_load() -> None:
    points = [(2, n, _ring_seconds("all_gather", 2, n)) for n in (8, 1e4, 1e5, 1e6, 1e7, 1e8)]
    points[2] = (2, 1e5, 10 * points[2][2])  # one point hit by another process
    fit = fit_ring("all_gather", points)
    assert fit.dropped == 1 and fit.points == 5
    assert fit.latency_s == pytest.approx(ALPHA, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(BANDWIDTH, rel=1e-6)


def test_fit_ring_without_latency_keeps_it_positive() -> None:
    """Sizes that show no latency (noise on the small messages drives it negative) still
    give a positive one, as every profile's is (a calibration wrote 0 and its own profile
    loader refused it), no more than the smallest message's time, and the bandwidth."""
    points = [(2, n, n / BANDWIDTH * 0.5) for n in (1e6, 1e7, 1e8)]
    points[0] = (2, 1e6, points[0][2] * 0.9)  # would drive alpha negative
    fit = fit_ring("all_gather", points)
    assert 0.0 < fit.latency_s <= points[0][2]
    assert fit.bandwidth_Bps == pytest.approx(BANDWIDTH, rel=0.1)
    # a quick calibration's all_reduce on a loaded host (8 B slower than 256 KB)
    noisy = fit_ring("all_reduce", [(2, 8, 3881e-6), (2, 262144, 2144e-6),
                                    (2, 4194304, 7157e-6)])
    assert noisy.latency_s > 0 and noisy.bandwidth_Bps > 0


def test_fit_ring_stays_conservative_when_time_does_not_grow() -> None:
    """Load noise can make big messages look no slower: the fit must not invent speed."""
    fit = fit_ring("all_reduce", [(2, 1e3, 1e-3), (2, 1e6, 5e-4), (2, 1e8, 1e-4)])
    assert fit.latency_s > 0 and fit.bandwidth_Bps > 0
    largest = 1e8 / 1e-4  # what the largest message alone would claim
    assert fit.bandwidth_Bps <= largest
    assert fit.worst_error > 0.5  # and the profile records how poor the fit is
    with pytest.raises(ShardplanError, match="at least 2"):
        fit_ring("all_reduce", [(2, 1e3, 1e-3)])


def test_fit_ramp_recovers_the_gemm_overhead() -> None:
    points = [(2.0 * n**3, 2.0 * n**3 / PEAK + RAMP) for n in (16, 64, 256, 1024)]
    assert fit_ramp(points, PEAK) == pytest.approx(RAMP, rel=1e-6)
    assert fit_ramp([(1e9, 1e9 / PEAK * 0.9)], PEAK) == 0.0  # never negative


def test_lower_quartile_ignores_the_slow_tail() -> None:
    assert lower_quartile([5.0, 1.0, 1.1, 1.2, 9.0]) == 1.1
    assert lower_quartile([2.0]) == 2.0


def test_fits_from_rank_results() -> None:
    results = _synthetic_results()
    fits = matmul_fits(results)
    assert fits["float32"].peak_flops == pytest.approx(2.0 * 512**3 / (2.0 * 512**3 / PEAK
                                                                        + RAMP))
    assert fits["float32"].ramp_s == pytest.approx(RAMP, rel=0.05)
    assert fits["bfloat16"].ramp_s == pytest.approx(6 * RAMP, rel=0.05)
    rings = collective_fits(results)
    assert rings["all_reduce"].bandwidth_Bps == pytest.approx(BANDWIDTH, rel=1e-6)
    assert rings["reduce_scatter"].bandwidth_Bps == pytest.approx(BANDWIDTH / 3, rel=1e-6)


def test_built_profile_loads_and_reproduces_the_machine(tmp_path: Path) -> None:
    results = _synthetic_results(nproc=3)
    data = build_profile(results, measurement_plan(3, quick=True), 3, "gloo", quick=True)
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    profile = load_profile(path)
    key = next(k for k in profile.sources if k.startswith("measured-"))
    assert "torch" in profile.sources[key] and "groups of 2 to 3 ranks" in profile.sources[key]
    assert profile.peak_flops["fp32"].source == key
    assert profile.memory_bandwidth_Bps.value == pytest.approx(20e9, rel=1e-3)
    assert profile.kernel_launch_s.value == pytest.approx(1e-6)
    assert int(profile.devices_per_node.value) == 3
    assert "ramp R = 2.0 us" in profile.matmul_efficiency.note
    level = profile.levels[0]
    assert level.group_size == 3
    assert level.latency_s.value == pytest.approx(ALPHA, rel=1e-3)
    assert level.bus_bandwidth_Bps == pytest.approx(BANDWIDTH, rel=1e-3)
    # the calibrated profile predicts the synthetic machine's all_reduce
    group = CommGroup(3, 3, 3)
    for nbytes in (2**14, 2**25):
        assert collective_time(profile, "all_reduce", nbytes, group, "ring") == pytest.approx(
            _ring_seconds("all_reduce", 3, nbytes), rel=1e-3)
    large = 2.0 * 512**3
    assert op_time(profile, "MatMul", large, 0.0, "float32", ramp_s=RAMP) == pytest.approx(
        large / PEAK + RAMP, rel=0.01)


def test_built_profile_carries_the_ramps_and_collective_factors(tmp_path: Path) -> None:
    """matmul_overhead_s and collective_factors are written, load, and price the machine."""
    data = build_profile(_synthetic_results(), measurement_plan(2, quick=True), 2, "gloo",
                         quick=True)
    assert set(data["device"]["matmul_overhead_s"]) == {"fp32", "bf16"}
    assert set(data["topology"]["levels"][0]["collective_factors"]) == {"all_gather",
                                                                        "reduce_scatter"}
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    profile = load_profile(path)
    key = next(k for k in profile.sources if k.startswith("measured-"))
    ramps = profile.matmul_overhead_s
    assert isinstance(ramps, dict) and {c.source for c in ramps.values()} == {key}
    assert profile.matmul_overhead("fp32") == pytest.approx(RAMP, rel=0.05)
    assert profile.matmul_overhead("bf16") == pytest.approx(6 * RAMP, rel=0.05)
    level = profile.levels[0]
    assert level.fabric is None and level.fabric_kind == "switch"
    assert level.collective_factor("reduce_scatter") == pytest.approx(1 / 3, rel=1e-3)
    assert level.collective_factor("all_gather") == pytest.approx(1.0, rel=1e-3)
    assert level.collective_factors["all_gather"].source == key
    assert profile.levels[1].collective_factors == {}  # the nominal NIC is not measured
    # with the written fields, the profile predicts the synthetic machine without overrides
    small = 2.0 * 64**3
    assert op_time(profile, "MatMul", small, 0.0, "float32") == pytest.approx(
        small / float(profile.peak_flops["fp32"].value) + RAMP, rel=0.02)
    group = CommGroup(2, 2, 2)
    rs_seconds = ALPHA + 1 / 2 * 2**25 / (BANDWIDTH / 3)
    assert collective_time(profile, "reduce_scatter", 2**25, group, "ring") == pytest.approx(
        rs_seconds, rel=1e-3)


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--nproc", "1", "-o", str(tmp_path / "p.json")], "at least 2 processes"),
        (["--nproc", "2"], "required: -o/--output"),
        (["--backend", "mpi", "-o", "x.json"], "invalid choice"),
        (["-o", str(tmp_path / "missing" / "p.json")], "does not exist"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_nccl_needs_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs")
    assert main(["--backend", "nccl", "-o", str(tmp_path / "p.json")]) == 2
    assert "CUDA devices" in capsys.readouterr().err


def test_a_failing_rank_is_reported_not_waited_for() -> None:
    plan = Plan(elementwise=(("no-such-op", 16),))
    with pytest.raises(ShardplanError, match="unknown elementwise op"):
        run_ranks(plan, nproc=2, timeout_s=60)


def test_a_hung_measurement_is_killed_at_the_deadline() -> None:
    plan = Plan(matmul=(("float32", 4096),), target_s=600)
    with pytest.raises(ShardplanError, match="timed out"):
        run_ranks(plan, nproc=2, timeout_s=3)


def test_quick_calibration_writes_a_plausible_profile(tmp_path: Path) -> None:
    lines: list[str] = []
    path = tmp_path / "profile.json"
    data = calibrate(nproc=2, output=path, progress=lines.append, quick=True)
    profile = load_profile(path)
    assert data["name"] == profile.name == "calibrated-gloo"
    assert any("matmul float32" in line for line in lines)
    assert any("all_reduce p=2" in line for line in lines)
    assert lines[-1].startswith(f"wrote {path}")
    # plausible for any CPU core of the last decade, one thread
    assert 1e9 < float(profile.peak_flops["fp32"].value) < 1e13
    assert "bf16" in profile.peak_flops
    assert 1e9 < float(profile.memory_bandwidth_Bps.value) < 1e12
    assert 1e-8 < float(profile.kernel_launch_s.value) < 1e-3
    level = profile.levels[0]
    assert 1e7 < level.bus_bandwidth_Bps < 1e11
    assert 0 <= float(level.latency_s.value) < 1e-2
    assert int(profile.devices_per_node.value) == 2 and level.group_size == 2
    ramps = profile.matmul_overhead_s
    assert isinstance(ramps, dict) and set(ramps) == set(profile.peak_flops)
    assert all(0 <= float(c.value) < 1e-2 for c in ramps.values())
    assert set(level.collective_factors) == {"all_gather", "reduce_scatter"}
    assert all(0 < float(c.value) < 100 for c in level.collective_factors.values())
    sources = {c.source for c in (profile.memory_bandwidth_Bps, profile.kernel_launch_s,
                                  level.bandwidth_Bps, level.latency_s,
                                  *profile.peak_flops.values(), *ramps.values(),
                                  *level.collective_factors.values())}
    assert len(sources) == 1 and sources.pop().startswith("measured-")
    assert profile.compute_overlap is not None and 0 <= profile.overlap_share <= 1
    assert level.measured_seconds("all_reduce", 2, 2**18) is not None
    assert "after 2 ms of fp32" in data["sources"][level.latency_s.source]


def test_collectives_are_timed_after_a_burst_of_compute_left_out() -> None:
    """With `step_burst_s`, each timed collective follows a burst of matmuls, as a step's
    do, and only the call is timed: no point holds the burst's time, so a 20 ms burst
    leaves a 256 KiB all_reduce (about a millisecond here) under it."""
    lines: list[str] = []
    plan = Plan(collectives=("all_reduce",), collective_bytes=(1 << 18,), group_sizes=(2,),
                target_s=0.1, min_reps=3, max_reps=20, overlap_matmul=128,
                step_burst_s=0.02)
    for result in run_ranks(plan, nproc=2, timeout_s=120, progress=lines.append):
        (point,) = result.collectives
        assert 0 < point["seconds"] < 0.02
    assert any("with the burst" in line for line in lines)


def test_calibrated_profile_plans(tmp_path: Path) -> None:
    """`shardplan calibrate` output is a profile the planner accepts, through the CLI."""
    from planner import zoo
    from planner.cli import main

    profile = tmp_path / "local.json"
    calibrate(nproc=2, output=profile, quick=True)
    family, config = zoo.preset("gpt-tiny")
    model = zoo.save(zoo.build(family, config), tmp_path / "gpt.onnx")
    out = tmp_path / "plan.json"
    assert main(["plan", str(model), "--profile", str(profile), "--devices", "2", "--batch",
                 "4", "--dim", "seq=8", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["cluster"]["profile"] == "calibrated-gloo"


def test_overlap_share_is_the_part_of_the_shorter_time_that_hides() -> None:
    assert overlap_share(10e-3, 10e-3, 20e-3) == 0.0  # together: the sum
    assert overlap_share(10e-3, 10e-3, 10e-3) == 1.0  # together: the longer
    assert overlap_share(10e-3, 5e-3, 12.5e-3) == pytest.approx(0.5)
    assert overlap_share(10e-3, 5e-3, 30e-3) == 0.0  # slower than both in turn: none
    assert overlap_share(10e-3, 5e-3, 8e-3) == 1.0  # faster than the longer: all


def test_built_profile_carries_the_measured_compute_overlap(tmp_path: Path) -> None:
    """Ranks that timed the transfer, the compute and both together give
    device.compute_overlap, cited as measured; ranks that did not leave it out (1)."""
    results = _synthetic_results()
    plan = measurement_plan(2, quick=True)
    assert "compute_overlap" not in build_profile(results, plan, 2, "gloo", True)["device"]
    for result, both in zip(results, (19e-3, 21e-3), strict=True):
        result.overlap = {"transfer": 10e-3, "compute": 10e-3, "both": both}
    data = build_profile(results, plan, 2, "gloo", quick=True)
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    profile = load_profile(path)
    assert profile.overlap_share == pytest.approx(0.0)
    assert profile.compute_overlap is not None
    assert profile.compute_overlap.source.startswith("measured-")
    assert "issued together 20.00 ms" in profile.compute_overlap.note


def test_built_profile_prices_the_measured_points(tmp_path: Path) -> None:
    """The measured points go into the level's collective_times, cited as measured, and
    price a collective at its measured sizes as measured, where the ring fit would not
    (a point off the fit's line: gloo switching algorithm, say)."""
    results = _synthetic_results()
    for result in results:
        for point in result.collectives:
            if point["kind"] == "all_reduce" and point["nbytes"] == 2**22:
                point["seconds"] *= 1.6
    data = build_profile(results, measurement_plan(2, quick=True), 2, "gloo", quick=True)
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    profile = load_profile(path)
    level = profile.levels[0]
    assert set(level.collective_times) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert level.collective_times["all_reduce"].source.startswith("measured-")
    measured = 1.6 * _ring_seconds("all_reduce", 2, 2**22)
    assert level.measured_seconds("all_reduce", 2, 2**22) == pytest.approx(measured, rel=1e-3)
    assert collective_time(profile, "all_reduce", 2**22, CommGroup(2, 2, 2), "ring") < \
        0.9 * measured  # the fit's line, which the point lies off


# ------------------------------------------------------------------ the executor's host time

LOCAL_S, DISTRIBUTED_S, STEP_S = 12e-6, 150e-6, 2e-3


def _host_samples() -> list[HostSample]:
    """Probe runs of a host that takes LOCAL_S per plain op run, DISTRIBUTED_S per DTensor
    op run and STEP_S per step beside the predicted device time."""
    runs = {("data", 1): (88, 0), ("tensor", 1): (36, 52), ("data", 6): (488, 0),
            ("tensor", 6): (196, 292)}
    samples = []
    for (kind, layers), (local, distributed) in runs.items():
        predicted = 1e-4 * layers
        measured = predicted + STEP_S + local * LOCAL_S + distributed * DISTRIBUTED_S
        samples.append(HostSample(kind, layers, local, distributed, predicted, measured))
    return samples


def test_host_fit_recovers_the_times_per_op_run_and_per_step() -> None:
    fit = fit_host(_host_samples())
    assert fit.local_s == pytest.approx(LOCAL_S)
    assert fit.distributed_s == pytest.approx(DISTRIBUTED_S)
    assert fit.step_s == pytest.approx(STEP_S)


def test_host_fit_needs_two_depths_and_never_goes_below_zero() -> None:
    samples = _host_samples()
    with pytest.raises(ShardplanError, match="two depths"):
        fit_host([s for s in samples if s.layers == 1])
    faster = [HostSample(s.plan, s.layers, s.local_runs, s.distributed_runs, s.predicted_s,
                         s.predicted_s) for s in samples]  # measured as predicted
    fit = fit_host(faster)
    assert (fit.local_s, fit.distributed_s, fit.step_s) == (0.0, 0.0, 0.0)


def test_profile_with_host_times_loads_and_prices_them(tmp_path: Path) -> None:
    data = build_profile(_synthetic_results(), measurement_plan(2, quick=True), 2, "gloo",
                         quick=True)
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(with_host_times(data, _host_samples())), encoding="utf-8")
    profile = load_profile(path)
    assert profile.host_seconds(False, True) == pytest.approx(LOCAL_S, rel=1e-3)
    assert profile.host_seconds(True, True) == pytest.approx(LOCAL_S, rel=1e-3)
    assert profile.host_seconds(False, False) == pytest.approx(DISTRIBUTED_S, rel=1e-3)
    assert profile.step_host_seconds == pytest.approx(STEP_S, rel=1e-3)
    assert profile.host_op_s is not None
    source = profile.sources[profile.host_op_s.forward_local.source]
    assert "tensor parallel, 6 layers: 196 plain and 292 DTensor op runs" in source


@pytest.mark.slow
def test_calibrate_times_the_executors_host_work(tmp_path: Path) -> None:
    """`shardplan calibrate` on gloo also runs the executor on its probe, data and tensor
    parallel at two depths (the op runs of each counted as the pricing counts them), and
    writes what the host adds per op run and per step. (That a DTensor op run costs more
    than a plain one is the fit's on a quiet machine, 140-240 against 5-20 us here; a
    quick run beside other tests can measure them alike, so only the order the fit keeps
    is asserted.)"""
    path = tmp_path / "local.json"
    assert main(["--quick", "-o", str(path)]) == 0
    profile = load_profile(path)
    assert profile.host_op_s is not None and profile.host_step_s is not None
    assert profile.host_seconds(False, False) >= profile.host_seconds(False, True)
    assert profile.host_seconds(False, False) > 0
    runs = profile.sources[profile.host_op_s.forward_local.source]
    # (each layer's K transpose is one op: planner.importer.views)
    for counted in ("data parallel, 1 layer: 84 plain and 0 DTensor op runs",
                    "tensor parallel, 1 layer: 28 plain and 56 DTensor op runs",
                    "data parallel, 6 layers: 464 plain and 0 DTensor op runs",
                    "tensor parallel, 6 layers: 148 plain and 316 DTensor op runs"):
        assert counted in runs


def test_calibrate_without_the_executor_writes_no_host_times(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--no-executor`: the device's figures only, as before host times were measured."""
    path = tmp_path / "local.json"
    assert main(["--quick", "--no-executor", "-o", str(path)]) == 0
    profile = load_profile(path)
    assert profile.host_op_s is None and profile.host_step_s is None
    assert "executor" not in capsys.readouterr().err
