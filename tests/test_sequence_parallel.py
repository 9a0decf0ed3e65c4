"""Sequence parallelism as a named, searched choice, and the plan's sp, cp and ep.

Under `layout=megatron` the joint search prices each tensor-parallel configuration with and
without Megatron's sequence parallelism and keeps the faster that fits; the plan's
`parallel.sp` says which it runs (read off its layouts), the plan file carries it, validate
holds it to the layouts, and cp/ep are 1 where nothing splits the sequence or the experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.train import preflight
from planner import zoo
from planner.api import plan
from planner.cli import main
from planner.errors import NoPlanFits, ShardplanError
from planner.plans.model import Plan
from planner.search.joint import enumerate_choices
from planner.search.options import Pins, check_pins
from planner.zoo.gpt import GPTConfig

#: Every degree but sp pinned: the search's only choice is sequence parallelism.
PINS = {"dp": 2, "tp": 2, "pp": 1, "micro_batches": 1, "zero": 0, "recompute": "none",
        "layout": "megatron"}
SHAPE = {"devices": 4, "batch": 8, "dims": {"seq": 128}}


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = GPTConfig(layers=2, hidden=256, heads=8, vocab=1024, max_positions=128,
                       fused_qkv=False, dropout=0.1)
    return zoo.save(zoo.build("gpt", config), tmp_path_factory.mktemp("sp") / "gpt.onnx")


@pytest.fixture(scope="module")
def pinned(gpt: Path) -> dict[int, Plan]:
    """The plan with sequence parallelism pinned off (0) and on (1)."""
    return {sp: plan(gpt, **SHAPE, parallel={**PINS, "sp": sp}) for sp in (0, 1)}


@pytest.fixture(scope="module")
def saved(pinned: dict[int, Plan], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pinned[1].save(tmp_path_factory.mktemp("sp-plan") / "sp.json")


def test_the_pins_set_the_plans_sp(pinned: dict[int, Plan]) -> None:
    """sp=1 splits the activations between blocks along the sequence (less activation
    memory), and the plan says so; sp=0 does not. cp and ep are 1."""
    assert pinned[0].parallel.sp == 0 and pinned[1].parallel.sp == 1
    assert pinned[1].predicted.memory["activations"] < pinned[0].predicted.memory["activations"]
    assert all((p.parallel.cp, p.parallel.ep) == (1, 1) for p in pinned.values())


def test_megatrons_layout_enumerates_both_for_tp_above_one() -> None:
    """Under `layout=megatron` each configuration with tp > 1 comes with and without
    sequence parallelism; tp = 1 and the searched layout without; a pin keeps its own."""
    def sp_of(pins: Pins) -> set[tuple[int, bool]]:
        return {(c.tp, c.sequence_parallel) for c in enumerate_choices(4, 8, 2, 8, pins)}

    assert sp_of(Pins(pp=1, layout="megatron")) == {(1, False), (2, False), (2, True),
                                                    (4, False), (4, True)}
    assert sp_of(Pins(pp=1, tp=2, layout="megatron", sp=0)) == {(2, False)}
    assert sp_of(Pins(pp=1, tp=2, layout="megatron", sp=1)) == {(2, True)}
    assert not any(sp for _, sp in sp_of(Pins(pp=1)))


def test_the_search_keeps_the_faster_of_the_two(gpt: Path, pinned: dict[int, Plan]) -> None:
    """Without an sp pin the search prices both and keeps the faster: the plan is the
    pinned plan of the faster choice, and names it."""
    searched = plan(gpt, **SHAPE, parallel=PINS)
    faster = min(pinned, key=lambda sp: pinned[sp].predicted.step_time_s)
    assert searched.parallel.sp == faster
    assert searched.predicted.step_time_s == pinned[faster].predicted.step_time_s


def test_under_memory_pressure_the_search_picks_sequence_parallelism(
        gpt: Path, pinned: dict[int, Plan]) -> None:
    """A limit between the two plans' peaks: only sequence parallelism fits, the search
    finds it, and the plan pinned to sp=0 has no plan that fits."""
    low, high = (pinned[sp].predicted.memory["peak"] for sp in (1, 0))
    assert low < high
    limit_gib = (low + high) / 2 / 2**30
    with pytest.raises(NoPlanFits):
        plan(gpt, **SHAPE, parallel={**PINS, "sp": 0}, memory_limit_gib=limit_gib)
    tight = plan(gpt, **SHAPE, parallel=PINS, memory_limit_gib=limit_gib)
    assert tight.parallel.sp == 1 and tight.predicted.fits


def test_sp_round_trips_and_old_files_read_it_off_the_layouts(saved: Path,
                                                              tmp_path: Path) -> None:
    data = json.loads(saved.read_text())
    assert (data["parallel"]["sp"], data["parallel"]["cp"], data["parallel"]["ep"]) == (1, 1, 1)
    assert Plan.load(saved).parallel.sp == 1
    for key in ("sp", "cp", "ep"):  # a file written before the keys
        del data["parallel"][key]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    loaded = Plan.load(old)
    assert (loaded.parallel.sp, loaded.parallel.cp, loaded.parallel.ep) == (1, 1, 1)


def _edited(saved: Path, tmp_path: Path, **values: int) -> Path:
    data = json.loads(saved.read_text())
    data["parallel"].update(values)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    return edited


def test_validate_holds_sp_to_the_layouts_and_cp_ep_to_one(
        saved: Path, gpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(saved), str(gpt)]) == 0
    capsys.readouterr()
    assert main(["validate", str(_edited(saved, tmp_path, sp=0))]) != 0
    assert "parallel.sp is 0 but the plan runs sequence parallelism" in capsys.readouterr().err
    assert main(["validate", str(_edited(saved, tmp_path, cp=2, ep=4))]) != 0
    out = capsys.readouterr().err
    assert "parallel.cp is 2" in out and "parallel.ep is 4" in out


def test_the_executor_refuses_cp_before_any_rank_starts(saved: Path, gpt: Path,
                                                         tmp_path: Path) -> None:
    """A cp the mesh has no axis for is refused before any rank starts (a planned cp runs:
    tests/test_context_parallel.py)."""
    edited = Plan.load(_edited(saved, tmp_path, cp=2))
    with pytest.raises(ShardplanError, match=r"parallel\.cp is 2 but the mesh"):
        preflight(gpt, edited)


def test_explain_and_the_exports_read_the_plan(saved: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(saved)]) == 0
    assert "tp=2 pp=1 sp=1 micro_batches=1" in capsys.readouterr().out
    for form in ("dtensor", "mindspore"):
        assert main(["export", str(saved), "--format", form,
                     "-o", str(tmp_path / f"{form}.json")]) == 0


def test_an_ep_pin_needs_experts(gpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dense model has no experts to split (tests/test_expert_parallel.py plans them)."""
    assert check_pins({"ep": 1}).given() == {"ep": 1}  # 1: what a dense plan has
    code = main(["plan", str(gpt), "--devices", "4", "--batch", "8", "--dim", "seq=128",
                 "--parallel", "tp=2,ep=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--parallel ep=2: the model has no experts to split" in err


@pytest.mark.slow
def test_a_searched_sequence_parallel_pipeline_runs_as_one_process(tmp_path: Path) -> None:
    """Megatron's split on two pipeline stages of tp=2, sp left to the search: it keeps
    sequence parallelism, so the activations sent between stages already travel split
    along the sequence over tp (no scatter of their own); 4 gloo ranks with dropout give
    one process's losses."""
    from executor.train import train, train_reference

    config = GPTConfig(layers=4, hidden=64, heads=4, vocab=128, max_positions=32,
                       fused_qkv=False, dropout=0.1)
    path = zoo.save(zoo.build("gpt", config), tmp_path / "gpt4.onnx")
    chosen = plan(path, devices=4, batch=4, dims={"seq": 32},
                  parallel={"dp": 1, "tp": 2, "pp": 2, "zero": 0, "layout": "megatron",
                            "micro_batches": 2, "schedule": "1f1b"})
    assert chosen.parallel.sp == 1
    assert chosen.pipeline is not None
    between = [s for s in chosen.pipeline.sends if s.tensor.endswith("mlp.dropout")]
    assert between and all(chosen.tensors[s.tensor].layout.dims[1] == ("tp",)
                           and not s.scatter_axes for s in between)
    reference = train_reference(path, chosen, steps=3)
    run = train(path, chosen, steps=3)
    assert run.losses == pytest.approx(reference.losses, rel=1e-6)
