"""Pipeline, micro-batch, ZeRO and recompute plans on 4 gloo ranks give one process's losses.

Every run trains a small GPT for 5 steps with AdamW (lr 0.01, so every weight moves and a
wrong gradient, e.g. a tied weight's missing cross-stage sum, shows above 1e-4), compares
the losses with the unsplit model trained on the whole global batch, the collectives with
the plan's, and checks from the ranks' records that the feature really ran: point-to-point
messages, schedule order, optimizer state sizes, recomputed segments.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from executor.schedule import Action, Chunk, Stages, Transfer, build_stages, check_schedule
from executor.train import RunLog, planned_counts, train, train_reference
from planner import zoo
from planner.api import load_graph, plan
from planner.errors import ShardplanError
from planner.kinds import Schedule
from planner.plans.model import Plan
from planner.sharding.analysis import needs_grad_map

STEPS = 5
LR = 0.01


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """gpt-tiny (2 layers), a 4-layer one, and a wider one on which the cpu profile finds
    tensor parallelism worth its collectives (on gpt-tiny it replicates every op)."""
    folder = tmp_path_factory.mktemp("models")
    return {name: zoo.save(zoo.build("gpt-tiny", **overrides), folder / f"{name}.onnx")
            for name, overrides in (("gpt", {}), ("gpt4", {"layers": 4}),
                                    ("wide", {"hidden": 128, "vocab": 512}))}


def _plan(path: Path, **parallel: int | str) -> Plan:
    """A plan the executor runs: a pipeline's schedule is 1F1B unless pinned (the search
    may pick a zero-bubble schedule, which the executor refuses: see
    test_zero_bubble_plans_are_refused_before_any_rank_starts)."""
    if parallel.get("pp", 1) != 1 and "schedule" not in parallel and "vpp" not in parallel:
        parallel["schedule"] = "1f1b"
    return plan(path, devices=4, batch=8, dims={"seq": 16}, profile="cpu", parallel=parallel)


def _check(path: Path, chosen: Plan) -> RunLog:
    """Equal losses, a model that trains, and exactly the planned collectives."""
    reference = train_reference(path, chosen, steps=STEPS, optimizer="adamw", lr=LR)
    run = train(path, chosen, steps=STEPS, optimizer="adamw", lr=LR)
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)
    assert reference.losses[-1] < reference.losses[0] - 0.05
    issued = {k: v for k, v in run.collectives["issued"].items() if not k.endswith("|loss")}
    assert issued == planned_counts(chosen, STEPS)
    assert [r["rank"] for r in run.ranks] == [0, 1, 2, 3]
    return run


def _stage(run: RunLog, stage: int) -> list[dict]:
    return [r for r in run.ranks if r["stage"] == stage]


def _messages(chosen: Plan, grad: bool) -> int:
    """Point-to-point messages one receiving rank of a 2-stage pipeline gets in the run."""
    sends = chosen.pipeline.sends
    return sum(1 for s in sends if s.grad or not grad) * chosen.parallel.micro_batches * STEPS


def _chunked(record: dict, groups: int) -> bool:
    """The rank's optimizer holds 1/groups of its weights (plus at most one padding
    element per weight and rank), and AdamW's two moments of that size."""
    elements, tensors = record["parameter_elements"], len(record["parameters"])
    held = record["optimizer_tensor_elements"]
    return (elements / groups <= held <= elements / groups + tensors
            and record["optimizer_state_elements"] == 2 * held)


def _stages(chunks: list[tuple[int, int, int]], pp: int, micro: int, schedule: str,
            transfers: list[tuple[int, int]]) -> Stages:
    return Stages(pp, micro, schedule,
                  tuple(Chunk(k, a, b, d, sum(1 for c in chunks[:k] if c[2] == d))
                        for k, (a, b, d) in enumerate(chunks)),
                  tuple(Transfer(i, f"t{i}", s, t, True, chunks[s][2] != chunks[t][2])
                        for i, (s, t) in enumerate(transfers)),
                  (), len(chunks) - 1)


def test_schedules_are_the_published_orders_and_cannot_deadlock() -> None:
    chain = _stages([(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 4, 3)], 4, 4, "1f1b",
                    [(0, 1), (1, 2), (2, 3)])
    orders = {d: " ".join(f"{a.kind}{a.micro}" for a in actions)
              for d, actions in check_schedule(chain).items()}
    assert orders[0] == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert orders[2] == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert orders[3] == "F0 B0 F1 B1 F2 B2 F3 B3"
    interleaved = _stages([(0, 1, 0), (1, 2, 1), (2, 3, 0), (3, 4, 1)], 2, 4, "interleaved",
                          [(0, 1), (1, 2), (2, 3)])
    device0 = check_schedule(interleaved)[0]
    assert device0[:4] == [Action("F", 0, 0), Action("F", 1, 0), Action("F", 0, 2),
                           Action("F", 1, 2)]
    assert sum(a.kind == "B" for a in device0) == 8  # 4 micro-batches × 2 chunks
    cycle = _stages([(0, 1, 0), (1, 2, 1)], 2, 2, "gpipe", [(0, 1), (1, 0)])
    with pytest.raises(ShardplanError, match="would deadlock"):  # each waits for the other
        check_schedule(cycle)


def test_transfers_between_stages_are_the_plans_sends(models: dict[str, Path]) -> None:
    for path, parallel in ((models["gpt"], {"pp": 2, "dp": 2, "micro_batches": 2}),
                           (models["gpt4"], {"pp": 4, "micro_batches": 4, "zero": 0}),
                           (models["gpt4"], {"pp": 2, "dp": 2, "micro_batches": 4,
                                             "schedule": "interleaved", "zero": 0})):
        chosen = _plan(path, **parallel)
        graph = load_graph(path, batch=chosen.model.batch, dims=chosen.model.bound_dims)
        stages = build_stages(graph, chosen.pipeline, chosen.mesh, graph.outputs[0],
                              needs_grad_map(graph))
        ours = {(t.tensor, stages.chunks[t.src].device, stages.chunks[t.dst].device, t.grad)
                for t in stages.transfers if t.p2p}
        assert ours == {(s.tensor, s.from_stage, s.to_stage, s.grad)
                        for s in chosen.pipeline.sends}


def test_one_f_one_b_pipeline_with_data_parallel(models: dict[str, Path]) -> None:
    """Two stages of two data-parallel ranks; the tied embedding/head weight lives on both
    stages and its gradients are summed between them."""
    chosen = _plan(models["gpt"], pp=2, dp=2, micro_batches=2, zero=0)
    assert chosen.pipeline.schedule == "1f1b" and chosen.mesh.axis_names == ("pp", "dp")
    run = _check(models["gpt"], chosen)
    first, last = _stage(run, 0), _stage(run, 1)
    assert [r["rank"] for r in first] == [0, 1] and [r["rank"] for r in last] == [2, 3]
    for record in last:
        assert record["received"] == {"forward": _messages(chosen, grad=False)}
        assert record["actions"] == ["F0@1", "B0@1", "F1@1", "B1@1"]
    for record in first:
        assert record["received"] == {"backward": _messages(chosen, grad=True)}
        assert record["actions"] == ["F0@0", "F1@0", "B0@0", "B1@0"]
    wte, ln_f = "transformer.wte.weight", "transformer.ln_f.weight"
    assert wte in first[0]["parameters"] and wte in last[0]["parameters"]
    assert ln_f in last[0]["parameters"] and ln_f not in first[0]["parameters"]
    assert run.collectives["issued"]["all_reduce|pp|gradient"] == 2 * STEPS  # the tied sum


def test_gpipe_pipeline_with_zero1(models: dict[str, Path]) -> None:
    chosen = _plan(models["gpt"], pp=2, dp=2, micro_batches=4, schedule="gpipe", zero=1)
    assert chosen.pipeline.schedule == "gpipe" and chosen.parallel.zero == 1
    run = _check(models["gpt"], chosen)
    assert _stage(run, 0)[0]["actions"] == [f"F{m}@0" for m in range(4)] + [
        f"B{m}@0" for m in range(4)]
    assert _stage(run, 1)[0]["received"]["forward"] == _messages(chosen, grad=False)
    assert all(_chunked(record, 2) for record in run.ranks)


def test_zero1_with_gradient_accumulation(models: dict[str, Path]) -> None:
    """pp=1: four data-parallel ranks, two micro-batches each, optimizer state in quarters."""
    chosen = _plan(models["gpt"], dp=4, zero=1, micro_batches=2)
    assert chosen.mesh.axis_names == ("dp",) and chosen.pipeline.micro_batches == 2
    run = _check(models["gpt"], chosen)
    assert all(_chunked(record, 4) for record in run.ranks)
    assert run.ranks[0]["actions"] == ["F0@0", "B0@0", "F1@0", "B1@0"]
    assert run.collectives["issued"]["reduce_scatter|dp|gradient"] == \
        len(run.ranks[0]["parameters"]) * STEPS


def _recomputed(chosen: Plan, path: Path) -> tuple[int, int]:
    """(segments that keep tensors for the backward pass, forward collectives in them)."""
    graph = load_graph(path, batch=chosen.model.batch, dims=chosen.model.bound_dims)
    grads = needs_grad_map(graph)
    segments = [s for stage in chosen.pipeline.stages for s in stage.recompute_segments]
    names = {op.name: k for k, op in enumerate(chosen.ops)}
    kept = sum(1 for a, b in segments if any(grads.get(o, False) for node in graph.ops[a:b]
                                             for o in node.outputs))
    collectives = sum(1 for c in chosen.collectives if c.phase == "forward" and any(
        a <= names.get(c.op, -1) < b for a, b in segments))
    return kept, collectives


def test_full_recompute_with_tensor_parallel(models: dict[str, Path]) -> None:
    """Every layer checkpointed: the backward pass re-runs it, its tensor-parallel
    collectives included."""
    chosen = _plan(models["wide"], dp=2, tp=2, recompute="full", zero=0)
    assert chosen.parallel.recompute == "full"
    assert any("tp" in c.axes for c in chosen.collectives)
    run = _check(models["wide"], chosen)
    segments, collectives = _recomputed(chosen, models["wide"])
    assert segments >= 4 and collectives > 0
    for record in run.ranks:
        assert record["recompute_calls"] == segments * STEPS
        again = sum(n for k, n in record["issued"].items() if k.endswith("|recompute"))
        assert again == collectives * STEPS


def test_selective_recompute_in_a_tensor_parallel_pipeline(models: dict[str, Path]) -> None:
    """pp=2 × tp=2, the weight-free runs of every layer checkpointed."""
    chosen = _plan(models["wide"], pp=2, tp=2, micro_batches=2, recompute="selective",
                   zero=0)
    assert chosen.mesh.axis_names == ("pp", "tp")
    assert any("tp" in c.axes for c in chosen.collectives)
    run = _check(models["wide"], chosen)
    for stage in (0, 1):
        segments = len(chosen.pipeline.stages[stage].recompute_segments)
        for record in _stage(run, stage):
            assert 0 < record["recompute_calls"] <= segments * 2 * STEPS


@pytest.mark.slow
def test_interleaved_pipeline_with_zero2(models: dict[str, Path]) -> None:
    """Two op ranges per device (Megatron's interleaved 1F1B); ZeRO 2 reduce-scatters the
    gradient after every micro-batch and keeps only this rank's chunk."""
    chosen = _plan(models["gpt4"], pp=2, dp=2, micro_batches=4, schedule="interleaved",
                   zero=2)
    assert [len(s.ops) for s in chosen.pipeline.stages] == [2, 2]
    run = _check(models["gpt4"], chosen)
    actions = _stage(run, 0)[0]["actions"]
    assert actions[:5] == ["F0@0", "F1@0", "F0@2", "F1@2", "F2@0"]
    assert all(_chunked(record, 2) for record in run.ranks)
    weights = len(_stage(run, 0)[0]["parameters"]) + len(_stage(run, 1)[0]["parameters"])
    assert run.collectives["issued"]["reduce_scatter|dp|backward"] == weights * 4 * STEPS


@pytest.mark.slow
def test_four_stages_sum_the_tied_weight_between_first_and_last(
        models: dict[str, Path]) -> None:
    chosen = _plan(models["gpt4"], pp=4, micro_batches=4, zero=0)
    run = _check(models["gpt4"], chosen)
    holders = [r["stage"] for r in run.ranks if "transformer.wte.weight" in r["parameters"]]
    assert holders == [0, 3]
    assert run.collectives["issued"]["all_reduce|pp|gradient"] == 2 * STEPS


@pytest.mark.slow
def test_resume_of_a_pipeline_with_zero1_continues_the_trajectory(
        models: dict[str, Path], tmp_path: Path) -> None:
    """Weights and AdamW's state chunks saved per rank, then loaded into a new run."""
    chosen = _plan(models["gpt"], pp=2, dp=2, micro_batches=2, zero=1)
    whole = train(models["gpt"], chosen, steps=4, optimizer="adamw", lr=LR)
    saved = tmp_path / "ckpt"
    first = train(models["gpt"], chosen, steps=2, optimizer="adamw", lr=LR,
                  checkpoint=str(saved))
    rest = train(models["gpt"], chosen, steps=2, optimizer="adamw", lr=LR, resume=str(saved))
    assert first.losses + rest.losses == pytest.approx(whole.losses, rel=1e-6)


def test_what_the_executor_cannot_run_is_refused_before_ranks_start(
        models: dict[str, Path]) -> None:
    path = models["gpt"]
    with pytest.raises(ShardplanError, match="ZeRO stages 0-2"):
        train(path, _plan(path, dp=4, zero=3), steps=1)
    interleaved = _plan(models["gpt4"], pp=2, dp=2, micro_batches=2, schedule="interleaved")
    assert interleaved.pipeline is not None
    interleaved = dataclasses.replace(interleaved, pipeline=dataclasses.replace(
        interleaved.pipeline, schedule=Schedule.ONE_F_ONE_B))
    with pytest.raises(ShardplanError, match=r"schedule 1f1b runs 1 chunk\(s\) per device"):
        train(models["gpt4"], interleaved, steps=1)  # validate's re-derivation refuses it


@pytest.mark.slow
def test_cli_runs_a_pipeline_plan(models: dict[str, Path], tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    import json

    from planner.cli import main

    path, plan_file = models["gpt"], tmp_path / "plan.json"
    assert main(["plan", str(path), "--devices", "4", "--batch", "8", "--dim", "seq=16",
                 "--profile", "cpu", "--parallel", "pp=2,dp=2,micro_batches=2,schedule=1f1b",
                 "-o", str(plan_file)]) == 0
    logs = {}
    for nproc in ("4", "1"):
        log = tmp_path / f"log{nproc}.json"
        assert main(["run", str(path), "--plan", str(plan_file), "--nproc", nproc, "--steps",
                     "3", "--optimizer", "adamw", "--lr", str(LR), "--log-json",
                     str(log)]) == 0
        logs[nproc] = json.loads(log.read_text())
    assert "collectives: as planned" in capsys.readouterr().out
    assert logs["4"]["losses"] == pytest.approx(logs["1"]["losses"], rel=1e-4)
    assert math.isfinite(logs["4"]["losses"][-1])


def test_scattered_sends_carry_a_slice_and_are_gathered_where_they_arrive(
        tmp_path: Path) -> None:
    """Megatron's scatter/gather of pipeline sends: with the stages on different nodes
    (a profile of 2 GPUs per node) and tp inside each, an activation replicated over tp
    is sent as one half per rank and all-gathered over tp on arrival (its gradient
    likewise), because that is cheaper than every rank sending all of it; the plan lists
    both, validates, and a 4-rank run issues exactly them with one process's losses."""
    import json

    from planner.kinds import CollectiveKind
    from planner.sharding.sends import SEND_OP
    from planner.validate import validate
    from planner.zoo.gpt import GPTConfig

    data = json.loads((Path(__file__).parent.parent / "hardware_profiles" /
                       "a100-80g.json").read_text())
    data["topology"]["devices_per_node"]["value"] = 2
    data["topology"]["levels"][0]["group_size"] = 2
    profile = tmp_path / "a100-2-per-node.json"
    profile.write_text(json.dumps(data))
    config = GPTConfig(layers=4, hidden=256, heads=4, vocab=128, max_positions=256,
                       fused_qkv=False)
    path = zoo.save(zoo.build("gpt", config), tmp_path / "gpt.onnx")
    dims = {"seq": 256}
    chosen = plan(path, profile=str(profile), devices=4, batch=4, dims=dims,
                  parallel={"dp": 1, "tp": 2, "pp": 2, "zero": 0, "layout": "megatron",
                            "sp": 0, "micro_batches": 2, "schedule": "1f1b"})
    scattered = [s for s in chosen.pipeline.sends if s.scatter_axes]
    assert scattered and all(s.scatter_axes == ("tp",) for s in scattered)
    for send in scattered:
        sent = [c for c in chosen.collectives if c.tensor == send.tensor
                and c.kind == CollectiveKind.SEND_RECV]
        gathered = [c for c in chosen.collectives if c.tensor == send.tensor
                    and c.op == SEND_OP]
        assert {c.bytes for c in sent} == {send.bytes // 2}
        assert {(c.kind, c.bytes) for c in gathered} == {(CollectiveKind.ALL_GATHER,
                                                          send.bytes)}
        assert len(gathered) == len(sent)  # the gradient comes back the same way
    graph = load_graph(path, batch=chosen.model.batch, dims=dims)
    assert validate(chosen, graph).ok
    edited = Plan.from_json({**json.loads(chosen.dumps())})
    pipe = dataclasses.replace(edited.pipeline, sends=tuple(
        dataclasses.replace(s, scatter_dim=(s.scatter_dim + 1) % 3) if s.scatter_axes else s
        for s in edited.pipeline.sends))
    assert not validate(dataclasses.replace(edited, pipeline=pipe), graph).ok
    reference = train_reference(path, chosen, steps=3, optimizer="adamw", lr=LR)
    run = train(path, chosen, steps=3, optimizer="adamw", lr=LR)
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)
    issued = {k: v for k, v in run.collectives["issued"].items() if not k.endswith("|loss")}
    assert issued == planned_counts(chosen, 3)
