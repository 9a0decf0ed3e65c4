"""Mixed clusters (`--cluster FILE`): groups of devices of different kinds, each pipeline
stage priced on its own kind and fitted to its own memory, the groups' order on the ranks
searched, the plan naming where each stage runs, and the executor running such a plan
with one process's losses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from costmodels.cluster import Cluster, Placement, load_cluster
from costmodels.communication import level_send_seconds
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.errors import ProfileError, ShardplanError
from planner.plans.model import Plan
from tests.clusters import a100_h100_file, cluster_file, eight_layers, group

BATCH, DIMS = 64, {"seq": 512}
PINS: dict[str, int | str] = {"pp": 2, "schedule": "1f1b"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mixed")


@pytest.fixture(scope="module")
def model(folder: Path) -> Path:
    return eight_layers(folder)


@pytest.fixture(scope="module")
def a100_h100(folder: Path) -> Path:
    return a100_h100_file(folder)


@pytest.fixture(scope="module")
def mixed_plan(model: Path, a100_h100: Path) -> Plan:
    return plan(model, cluster=a100_h100, batch=BATCH, dims=DIMS, parallel=PINS)


def layers_of(stage: Any) -> int:
    return sum(b - a for a, b in stage.ops)


@pytest.mark.parametrize(("change", "field"), [
    ({"schema": "shardplan.cluster/9"}, "schema"),
    ({"groups": []}, "groups"),
    ({"groups": [group("a", "a100-80g", 8), group("a", "h100-sxm", 8)]}, "groups"),
    ({"groups": [group("a", "no-such-gpu", 8)]}, "groups[0].profile"),
    ({"groups": [group("a", "a100-80g", 12)]}, "groups[0].devices"),
    ({"groups": [{"name": "a", "profile": "a100-80g"}]}, "groups[0].devices"),
    ({"colour": "red"}, "colour"),
    ({"groups": [group(str(k), "a100-80g", 1 << 19) for k in range(4)]}, "groups"),
    ({"link": {"name": "ib", "group_size": None, "bandwidth_Bps": {"value": 1e10,
                                                                   "source": "x"},
               "efficiency": {"value": 0.9, "source": "x"},
               "latency_s": {"value": 1e-5, "source": "x"}}}, "sources"),
])
def test_a_cluster_file_is_checked_field_by_field(folder: Path, change: dict[str, Any],
                                                  field: str) -> None:
    data: dict[str, Any] = {"schema": "shardplan.cluster/1", "name": "bad",
                            "groups": [group("a", "a100-80g", 8)], **change}
    path = folder / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as caught:
        load_cluster(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {field}") and "\n" not in message


def test_the_link_between_groups_is_cited_or_the_slower_fabric(folder: Path) -> None:
    plain = load_cluster(cluster_file(folder, [group("a", "a100-80g", 8),
                                               group("h", "h100-sxm", 8)]))
    slower = min((g.profile.inter_node_level for g in plain.groups),
                 key=lambda level: level.bus_bandwidth_Bps)
    assert plain.link == slower
    cited = load_cluster(cluster_file(
        folder, [group("a", "a100-80g", 8), group("h", "h100-sxm", 8)],
        sources={"site": "our datacentre's measured 100 Gb/s Ethernet"},
        link={"name": "ethernet", "group_size": None,
              "bandwidth_Bps": {"value": 12.5e9, "source": "site"},
              "efficiency": {"value": 0.8, "source": "site"},
              "latency_s": {"value": 2e-5, "source": "site"}}))
    assert cited.link.name == "ethernet"
    # one direct send: n / (line rate x efficiency) + latency
    assert level_send_seconds(cited.link, 1e9) == pytest.approx(1e9 / 10e9 + 2e-5)


def test_a_placement_puts_each_stage_on_the_groups_under_its_ranks(folder: Path) -> None:
    cluster = load_cluster(cluster_file(folder, [group("a", "a100-80g", 16),
                                                 group("h", "h100-sxm", 8)]))
    assert isinstance(cluster, Cluster) and cluster.mixed and cluster.lead.name == "a"
    stages = Placement(cluster, (1, 0), 8)  # h100s on ranks 0-7, then the a100s
    assert [stages.stage_groups(s) for s in range(3)] == [(1,), (0,), (0,)]
    # into stage 1 from the h100s; into stage 0 from the last stage (interleaved chunks)
    assert [stages.crosses_into(s) for s in range(3)] == [True, True, False]
    whole = Placement(cluster, (0, 1), 24)  # one stage spans both kinds
    assert whole.stage_groups(0) == (0, 1)
    assert whole.memory_bytes((0, 1)) == min(g.memory_bytes for g in cluster.groups)
    assert cluster.orders() == [(0, 1), (1, 0)]


def test_the_faster_kind_takes_more_layers(mixed_plan: Plan) -> None:
    stages = mixed_plan.pipeline.stages
    kinds = {g.name: g.profile for g in mixed_plan.cluster.groups}
    assert all(len(stage.groups) == 1 for stage in stages)
    on = {kinds[stage.groups[0]]: stage for stage in stages}
    assert set(on) == {"a100-80g", "h100-sxm"}
    assert layers_of(on["h100-sxm"]) > layers_of(on["a100-80g"])
    # the stage's ranks are its group's
    for stage in stages:
        ranks = next(g for g in mixed_plan.cluster.groups if g.name == stage.groups[0]).ranks
        assert set(stage.ranks) <= set(ranks)


def test_a_mixed_cluster_lies_between_its_kinds(model: Path, mixed_plan: Plan) -> None:
    """Sixteen devices, half of each kind: slower than sixteen of the fast one, faster
    than sixteen of the slow one (its stages balanced by layers, not split evenly)."""
    alone = {name: plan(model, profile=name, devices=16, batch=BATCH, dims=DIMS,
                        parallel=PINS).predicted.step_time_s
             for name in ("a100-80g", "h100-sxm")}
    assert alone["h100-sxm"] < mixed_plan.predicted.step_time_s < alone["a100-80g"]


def test_the_sends_between_kinds_are_priced_on_the_link(mixed_plan: Plan) -> None:
    pipe = mixed_plan.pipeline
    link = mixed_plan.cluster.link
    assert link is not None and pipe.sends
    for send in pipe.sends:
        priced = [c for c in mixed_plan.collectives if c.kind == "send_recv"
                  and c.tensor == send.tensor]
        assert priced and all(c.time_s == pytest.approx(
            c.bytes / link.bandwidth_Bps + link.latency_s) for c in priced)


def test_each_stage_fits_its_own_kind_memory(folder: Path) -> None:
    """40 GB and 80 GB A100s: 1F1B's first stage keeps the most micro-batches in flight,
    so the 80 GB kind takes it (the order of the groups on the ranks is searched), each
    stage stays within its own kind's memory, and the plan file loads back."""
    model = zoo.save(zoo.build("gpt-tiny", layers=8, hidden=2048, heads=16, vocab=1024),
                     folder / "gpt8-wide.onnx")
    cluster = cluster_file(folder, [group("small", "a100-40g", 8),
                                    group("large", "a100-80g", 8)])
    chosen = plan(model, cluster=cluster, batch=640, dims={"seq": 1024},
                  parallel={"pp": 2, "dp": 8, "schedule": "1f1b", "recompute": "none",
                            "zero": 0, "micro_batches": 2})
    limits = {g.name: g.memory_bytes for g in chosen.cluster.groups}
    assert chosen.predicted.fits
    first, last = chosen.pipeline.stages
    assert first.groups == ("large",) and last.groups == ("small",)
    assert [g.name for g in chosen.cluster.groups] == ["large", "small"]  # rank order
    assert limits["small"] < first.memory.peak <= limits["large"]
    assert last.memory.peak <= limits["small"]
    assert chosen.predicted.memory_limit_bytes in limits.values()
    path = folder / "plan.json"
    chosen.save(path)
    assert Plan.load(path).to_json() == chosen.to_json()


def test_the_cli_plans_on_a_cluster_file_and_refuses_mixed_flags(
        model: Path, a100_h100: Path, folder: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    common = [str(model), "--batch", str(BATCH), "--dim", "seq=512",
              "--parallel", "pp=2,schedule=1f1b"]
    saved = folder / "cli-plan.json"
    assert main(["plan", *common, "--cluster", str(a100_h100), "--json", "-o",
                 str(saved)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["profile"] for g in data["cluster"]["groups"]] and data["cluster"]["link"]
    assert all(stage["groups"] for stage in data["pipeline"]["stages"])
    assert main(["explain", str(saved)]) == 0
    text = capsys.readouterr().out
    assert "8 × h100-sxm + 8 × a100-80g" in text or "8 × a100-80g + 8 × h100-sxm" in text
    stage_lines = text.split("stages (time per micro-batch)")[1].splitlines()[1:4]
    assert stage_lines[0].endswith("  on")
    assert {line.rsplit(" ", 1)[-1] for line in stage_lines[1:]} == {"a100", "h100"}
    for extra in (["--profile", "h100-sxm"], ["--devices", "16"], ["--mode", "data"],
                  ["--inference"]):
        assert main(["plan", *common, "--cluster", str(a100_h100), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "--cluster" in err and "\n" not in err
    missing = folder / "none.json"
    assert main(["plan", *common, "--cluster", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_one_group_is_its_profile_plain_cluster(model: Path, folder: Path) -> None:
    single = cluster_file(folder, [group("only", "h100-sxm", 16)])
    through_file = plan(model, cluster=single, batch=BATCH, dims=DIMS, parallel=PINS)
    direct = plan(model, profile="h100-sxm", devices=16, batch=BATCH, dims=DIMS,
                  parallel=PINS)
    assert not through_file.cluster.groups
    assert through_file.predicted.step_time_s == direct.predicted.step_time_s


@pytest.mark.slow
def test_a_mixed_cluster_plan_runs_with_one_process_losses(folder: Path) -> None:
    """The layout is one on every kind: the executor runs the plan on 4 gloo ranks with
    the losses of one process and exactly the planned collectives."""
    from executor.train import planned_counts, train, train_reference

    path = zoo.save(zoo.build("gpt-tiny", layers=4), folder / "gpt4.onnx")
    cluster = cluster_file(folder, [group("a100", "a100-80g", 2), group("h100", "h100-sxm", 2)])
    chosen = plan(path, cluster=cluster, batch=8, dims={"seq": 16},
                  parallel={"pp": 2, "dp": 2, "schedule": "1f1b"})
    assert {stage.groups for stage in chosen.pipeline.stages} == {("a100",), ("h100",)}
    reference = train_reference(path, chosen, steps=3, optimizer="adamw", lr=0.01)
    run = train(path, chosen, steps=3, optimizer="adamw", lr=0.01)
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)
    issued = {k: v for k, v in run.collectives["issued"].items() if not k.endswith("|loss")}
    assert issued == planned_counts(chosen, 3)


def test_a_mixed_cluster_needs_the_pipeline_search(model: Path, a100_h100: Path) -> None:
    with pytest.raises(ShardplanError, match="--cluster"):
        plan(model, cluster=a100_h100, batch=BATCH, dims=DIMS, mode="auto", inference=True)


@pytest.mark.parametrize(("edit", "where"), [
    (lambda d: d["cluster"]["groups"][1].update(first_rank=3), "cluster.groups[1].first_rank"),
    (lambda d: d["cluster"]["groups"][1].update(devices=4), "cluster.groups hold"),
    (lambda d: d["pipeline"]["stages"][0].update(groups=["tpu"]), "pipeline.stages[0].groups"),
    (lambda d: d["pipeline"]["stages"][0].update(groups=d["pipeline"]["stages"][1]["groups"]),
     "pipeline.stages[0].groups: its ranks are on"),
])
def test_a_plan_file_whose_groups_do_not_tile_its_ranks_is_refused(
        mixed_plan: Plan, folder: Path, edit: Any, where: str) -> None:
    from planner.errors import PlanFileError

    data = mixed_plan.to_json()
    edit(data)
    path = folder / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=re_escape(where)):
        Plan.load(path)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_each_kind_prices_collectives_on_its_own_nodes(folder: Path, model: Path) -> None:
    """A kind with 4-device nodes: its 8-rank stage spans two of them, so its data-parallel
    gradient reduction crosses the network, where an 8-device node keeps it on NVSwitch."""
    data = json.loads((Path(__file__).resolve().parents[1] / "hardware_profiles"
                       / "h100-sxm.json").read_text())
    data["name"] = "h100-4"
    data["topology"]["devices_per_node"]["value"] = 4
    data["topology"]["levels"][0]["group_size"] = 4
    data["topology"].pop("allowed_devices_within_node", None)
    (folder / "h100-4.json").write_text(json.dumps(data))
    sync = {}
    for name in ("h100-sxm", "h100-4.json"):
        cluster = cluster_file(folder, [group("a100", "a100-80g", 8), group("h100", name, 8)])
        chosen = plan(model, cluster=cluster, batch=BATCH, dims=DIMS,
                      parallel={**PINS, "dp": 8, "zero": 0})
        stage = next(s for s in chosen.pipeline.stages if s.groups == ("h100",))
        sync[name] = stage.gradient_sync_s
    assert sync["h100-4.json"] > sync["h100-sxm"]


def test_no_fitting_plan_names_the_mixed_cluster(folder: Path, model: Path) -> None:
    from planner.errors import NoPlanFits

    cluster = cluster_file(folder, [group("a100", "a100-80g", 8), group("h100", "h100-sxm", 8)])
    with pytest.raises(NoPlanFits, match=r"on 8 × a100-80g \+ 8 × h100-sxm: the smallest"):
        plan(model, cluster=cluster, batch=BATCH, dims=DIMS, parallel=PINS,
             memory_limit_gib=0.01)
