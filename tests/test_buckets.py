"""Weight collectives as frameworks issue them: buckets, the algorithm per size, overlap."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from costmodels.communication import CommGroup, behind_compute, best_algorithm
from costmodels.profile import load_profile
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.cost.buckets import (
    DEFAULT_BUCKET_MB,
    MIB,
    Issue,
    assign_buckets,
    backward_prefetch_exposed,
    bucket_bytes,
    bucketed_seconds,
    prefetch_exposed,
    schedule_overlap,
)
from planner.cost.pricing import collective_seconds
from planner.kinds import CollectiveKind, Phase
from planner.plans.model import Plan
from planner.sharding.mesh import DeviceMesh

A100 = load_profile("a100-80g")
#: 64 GPUs on 8 nodes: the data-parallel group crosses the NICs.
MULTI_NODE = DeviceMesh.build({"dp": 64}, 8)


def test_a_share_is_linear_in_bytes_and_a_full_bucket_costs_one_call() -> None:
    cap = bucket_bytes(DEFAULT_BUCKET_MB)
    assert cap == 25 * MIB

    def share(n: float) -> float:
        return bucketed_seconds(A100, CollectiveKind.ALL_REDUCE, n, ("dp",), MULTI_NODE, cap)

    def alone(n: float) -> float:
        return collective_seconds(A100, CollectiveKind.ALL_REDUCE, n, ("dp",), MULTI_NODE)

    small, other = 24_576.0, 3 * MIB  # a LayerNorm weight in bf16, a 1.5 M-element matrix
    assert share(small) + share(other) == pytest.approx(share(small + other), rel=1e-12)
    assert 4 * share(cap / 4) == pytest.approx(alone(cap), rel=1e-12)  # one call per bucket
    assert share(small) < alone(small) / 10  # the latency of 2(p−1) ring steps is shared
    for large in (cap, 4 * cap):  # a weight as large as a bucket pays its own call
        assert share(large) == alone(large)
    assert bucketed_seconds(A100, CollectiveKind.ALL_REDUCE, small, ("dp",), MULTI_NODE,
                            0.0) == alone(small)  # --bucket-mb 0: one call per tensor


def test_small_all_reduces_take_the_tree_and_large_ones_the_ring() -> None:
    """NCCL's tuner picks the algorithm per size; so does the planner (the cheapest of the
    algorithms the back ends run, at the message's size)."""
    two_nodes = DeviceMesh.build({"dp": 16}, 8)  # 16 GPUs, 8 per node
    size, per_node, extent, _ = two_nodes.placement(("dp",))
    group = CommGroup(size, per_node, extent)

    def by(algorithm: str, nbytes: float) -> float:
        return best_algorithm(A100, CollectiveKind.ALL_REDUCE, nbytes, group, algorithm)[1]

    for nbytes, winner in ((64 * 1024, "tree"), (25 * MIB, "tree"), (4 << 30, "ring")):
        ring, tree = by("ring", nbytes), by("tree", nbytes)
        assert (tree < ring) == (winner == "tree"), nbytes
        assert collective_seconds(A100, CollectiveKind.ALL_REDUCE, nbytes, ("dp",),
                                  two_nodes) == pytest.approx(min(ring, tree), rel=1e-12)
    # The crossover moves up with the group: 2(p−1) ring steps against 2⌈log₂p⌉ tree
    # steps, for a byte factor 2(p−1)/p against 2 (docs/cost-model.md, buckets).
    size, per_node, extent, _ = MULTI_NODE.placement(("dp",))
    wide = CommGroup(size, per_node, extent)
    assert best_algorithm(A100, CollectiveKind.ALL_REDUCE, 4 << 30, wide, "tree")[1] < \
        best_algorithm(A100, CollectiveKind.ALL_REDUCE, 4 << 30, wide, "ring")[1]
    # Within a node the ring wins from small sizes on.
    one_node = DeviceMesh.build({"dp": 8}, 8)
    size, per_node, extent, node_extent = one_node.placement(("dp",))
    node = CommGroup(size, per_node, extent, node_extent)
    assert best_algorithm(A100, CollectiveKind.ALL_REDUCE, 25 * MIB, node, "ring")[1] < \
        best_algorithm(A100, CollectiveKind.ALL_REDUCE, 25 * MIB, node, "tree")[1]


def test_buckets_fill_in_issue_order_per_group() -> None:
    a, b = ("s0", "all_reduce", ("dp",)), ("s0", "all_reduce", ("dp", "tp"))
    issues = [Issue(a, 4), Issue(a, 4), Issue(b, 4), Issue(a, 4), Issue(a, 12), Issue(a, 1)]
    assert assign_buckets(issues, 10.0) == [0, 0, 1, 2, 3, 4]
    assert assign_buckets(issues, 0.0) == [None] * len(issues)


def test_the_schedule_hides_all_but_the_last_bucket() -> None:
    # 10 s of reduction, the last bucket 2 s, 5 s of backward compute to hide behind.
    assert schedule_overlap(10.0, 2.0, 5.0, 0.0) == (5.0, 5.0)
    assert schedule_overlap(10.0, 2.0, 100.0, 0.0) == (2.0, 8.0)  # the last bucket waits
    assert schedule_overlap(10.0, 2.0, 5.0, 0.9) == pytest.approx((1.0, 9.0))  # --overlap
    assert schedule_overlap(0.0, 0.0, 5.0, 0.5) == (0.0, 0.0)
    # After the backward pass (Megatron-LM without --overlap-grad-reduce): only the floor.
    assert schedule_overlap(10.0, 2.0, 100.0, 0.0, scheduled=False) == (10.0, 0.0)
    assert schedule_overlap(10.0, 2.0, 100.0, 0.25, scheduled=False) == (7.5, 2.5)
    # ZeRO-3 gathers one unit ahead: the first waits, the rest hide behind the previous
    # unit's compute as far as it lasts.
    gathers, compute = np.array([1.0, 1.0, 3.0]), np.array([2.0, 2.0, 2.0])
    assert prefetch_exposed(gathers, compute) == 1.0 + 0.0 + 1.0
    # Backward: unit k's gather behind unit k+1's backward, its reduce-scatter behind
    # unit k−1's; the last unit's gather and the first unit's reduce-scatter wait.
    reduces = np.array([0.5, 1.0, 1.0])
    assert backward_prefetch_exposed(gathers, reduces, compute) == pytest.approx(
        3.0 + 0.5 + max(0, 1.0 - 2) + max(0, 1.0 + 1.0 - 2) + max(0, 1.0 - 2))


def test_a_device_that_cannot_overlap_hides_only_its_share() -> None:
    """`device.compute_overlap` (share): a collective beside compute shows what exceeds
    the compute plus (1 − share) of the time they overlap (`behind_compute`)."""
    assert behind_compute(3.0, 2.0, 1.0) == 1.0 and behind_compute(3.0, 2.0, 0.0) == 3.0
    assert behind_compute(1.0, 2.0, 0.25) == pytest.approx(0.75)
    assert schedule_overlap(10.0, 2.0, 5.0, 0.0, share=0.0) == (10.0, 0.0)
    assert schedule_overlap(10.0, 2.0, 5.0, 0.0, share=0.5) == (7.5, 2.5)
    gathers, compute = np.array([1.0, 1.0, 3.0]), np.array([2.0, 2.0, 2.0])
    assert prefetch_exposed(gathers, compute, share=0.0) == gathers.sum()
    reduces = np.array([0.5, 1.0, 1.0])
    assert backward_prefetch_exposed(gathers, reduces, compute, share=0.0) == pytest.approx(
        gathers.sum() + reduces.sum())


@pytest.mark.parametrize("pp", [1, 2])
def test_a_cpu_profile_exposes_the_gradient_sync(gpt8: Path, tmp_path: Path, pp: int) -> None:
    """The bundled cpu profile measured that gloo's collectives do not run behind compute
    (compute_overlap 0.08): a data-parallel plan (one stage or a pipeline's) hides 8% of
    what the schedule would, and the same profile with the share left out (1) hides it."""
    cpu = json.loads((Path(load_profile("cpu").path)).read_text())
    assert cpu["device"]["compute_overlap"]["value"] == 0.08
    del cpu["device"]["compute_overlap"]
    full = tmp_path / "overlapping.json"
    full.write_text(json.dumps(cpu))

    def planned(profile: str) -> Plan:
        return plan(gpt8, devices=2 * pp, batch=8, dims={"seq": 16}, profile=profile,
                    parallel={"dp": 2, "tp": 1, "pp": pp, "zero": 0, "micro_batches": 2})

    measured, assumed = planned("cpu"), planned(str(full))
    hidden = assumed.predicted.breakdown.hidden_communication_s
    assert hidden > 0
    assert measured.predicted.breakdown.hidden_communication_s == pytest.approx(0.08 * hidden)
    if pp == 1:
        assert measured.predicted.step_time_s == pytest.approx(
            assumed.predicted.step_time_s + 0.92 * hidden)
    else:  # the step's tail is the slowest stage's synchronisation
        assert measured.predicted.step_time_s > assumed.predicted.step_time_s


@pytest.fixture(scope="module")
def gpt8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("buckets") / "gpt8.onnx"
    onnx.save(zoo.build("gpt-tiny", layers=8, hidden=64, heads=4), path)
    return path


def _zero3(path: Path, bucket_mb: float) -> Plan:
    return plan(path, devices=32, batch=32, dims={"seq": 16}, profile="a100-80g",
                parallel={"dp": 32, "tp": 1, "pp": 1, "zero": 3}, bucket_mb=bucket_mb)


def test_a_zero3_plan_records_buckets_and_prices_them(gpt8: Path, tmp_path: Path) -> None:
    bucketed, alone = _zero3(gpt8, DEFAULT_BUCKET_MB), _zero3(gpt8, 0.0)
    cap = bucket_bytes(DEFAULT_BUCKET_MB)
    weights = [c for c in bucketed.collectives if c.op == "optimizer"
               and "pp" not in c.axes]
    assert weights and all(c.bucket is not None for c in weights)
    assert all(c.bucket is None for c in alone.collectives)
    members: dict[int, list] = {}
    for c in weights:
        members.setdefault(c.bucket, []).append(c)
    assert len(members) < len(weights)  # tiny weights share buckets
    for group in members.values():
        assert len({(c.kind, c.phase, c.axes) for c in group}) == 1
        assert sum(c.bytes for c in group) <= cap
        call = collective_seconds(A100, group[0].kind, cap, group[0].axes, bucketed.mesh)
        assert sum(c.time_s for c in group) <= call * (1 + 1e-9)
    # Three collectives per weight per micro-batch (ZeRO-3), each far cheaper in a bucket;
    # the gather before the backward pass only of what that pass reads (not the biases an
    # Add applies, nor the position table: 33 of GPT-2's 100 weights at 8 layers)
    names = {c.tensor for c in weights}
    gathers = [c for c in weights if c.phase == Phase.FORWARD]
    again = [c.tensor for c in weights
             if c.phase == Phase.BACKWARD and c.kind == CollectiveKind.ALL_GATHER]
    assert len(gathers) == len(names) and len(again) == len(set(again)) < len(names)
    assert all(name.endswith(".bias") or name == "transformer.wpe.weight"
               for name in names - set(again))
    assert bucketed.predicted.breakdown.zero_s < alone.predicted.breakdown.zero_s / 5
    assert bucketed.predicted.step_time_s < alone.predicted.step_time_s
    # The schedule hides part of them: what the stage reports is the exposed rest.
    m = bucketed.micro_batches
    issued = sum(c.time_s for c in weights)
    assert bucketed.predicted.breakdown.zero_s < m * issued
    # The bucket travels in the plan file (older files read None).
    saved = json.loads(bucketed.dumps())
    again = Plan.from_json(saved)
    assert [c.bucket for c in again.collectives] == [c.bucket for c in bucketed.collectives]
    for entry in saved["collectives"]:
        entry.pop("bucket")
    assert all(c.bucket is None for c in Plan.from_json(saved).collectives)


def test_bad_bucket_sizes_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("-1", "nan", "many"):
        assert main(["plan", "--bucket-mb", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--bucket-mb" in err


@pytest.mark.parametrize("pp", [1, 2])
def test_a_reduction_after_the_backward_pass_exposes_all_of_it(gpt8: Path, pp: int) -> None:
    """`overlap_grad_reduce=False`: the data-parallel all-reduce waits for the backward pass
    (nothing hidden), the plan records it, and only the exposed time grows."""
    def planned(overlap: bool) -> Plan:
        return plan(gpt8, devices=32, batch=32, dims={"seq": 16}, profile="a100-80g",
                    parallel={"dp": 32 // pp, "tp": 1, "pp": pp, "zero": 0},
                    overlap_grad_reduce=overlap)

    behind, after = planned(True), planned(False)
    assert behind.predicted.breakdown.hidden_communication_s > 0
    assert after.predicted.breakdown.hidden_communication_s == 0
    assert after.step.overlap_grad_reduce is False and behind.step.overlap_grad_reduce
    gradient = [c for c in after.collectives if c.phase == Phase.GRADIENT]
    assert sum(c.time_s for c in gradient) == pytest.approx(
        sum(c.time_s for c in behind.collectives if c.phase == Phase.GRADIENT))
    assert after.predicted.step_time_s > behind.predicted.step_time_s
    assert Plan.from_json(json.loads(after.dumps())).step.overlap_grad_reduce is False


def test_the_cli_flag_reaches_the_plan_and_the_summary(gpt8: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    out = tmp_path / "after.json"
    assert main(["plan", str(gpt8), "--devices", "4", "--batch", "8", "--dim", "seq=16",
                 "--parallel", "dp=4", "--no-overlap-grad-reduce", "-o", str(out)]) == 0
    assert "after the backward pass" in capsys.readouterr().out
    assert json.loads(out.read_text())["step"]["overlap_grad_reduce"] is False
