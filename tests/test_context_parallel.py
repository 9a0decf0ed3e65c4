"""Context parallelism: the sequence split over a "cp" axis, priced as ring attention or
Ulysses, searched where sequences are long, written, validated, explained and run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from costmodels.communication import ring_overlap_exposed_s
from costmodels.profile import load_profile
from executor.support import check_degrees
from executor.train import planned_counts, train, train_reference
from planner import zoo
from planner.api import load_graph, plan
from planner.cost.step import TrainingOptions
from planner.errors import ShardplanError
from planner.explain.explanation import explain
from planner.explain.render import render
from planner.kinds import ContextKind
from planner.plans.model import Plan
from planner.plans.sections import ParallelConfig
from planner.search.joint import MIN_CONTEXT_BLOCK, context_degrees, joint_search
from planner.search.options import Pins, check_pins
from planner.sharding.analysis import Analyses, GraphAnalysis
from planner.validate import validate
from planner.zoo.llama import LlamaConfig

SEQ = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64,
                         max_positions=SEQ, ffn=64)
    path = tmp_path_factory.mktemp("cp") / "llama.onnx"
    return zoo.save(zoo.build("llama", config, with_weights=True), path)


@pytest.fixture(scope="module")
def plans(tiny: Path) -> dict[str, Plan]:
    return {kind: plan(tiny, devices=2, batch=2, dims={"seq": SEQ}, profile="cpu",
                       parallel={"cp": 2, "cp_kind": kind})
            for kind in ("ring", "ulysses")}


def _collectives(chosen: Plan) -> Counter:
    """The plan's collectives but the loss's read of the outputs (op `loss`)."""
    return Counter((str(c.kind), tuple(c.axes), str(c.phase)) for c in chosen.collectives
                   if c.op != "loss")


def test_the_sequence_is_traced_from_the_token_ids(tiny: Path) -> None:
    graph = load_graph(tiny, batch=2, dims={"seq": SEQ})
    assert graph.sequence_inputs == {"input_ids": 1} and graph.sequence == SEQ
    analysis = GraphAnalysis.of(graph)
    qk = analysis.labels["layers.0.self_attn.core.qk_matmul"]
    assert qk is not None
    # q kᵀ carries the sequence twice: the queries' positions and the keys'
    assert analysis.sequence_labels["layers.0.self_attn.core.qk_matmul"] == {
        qk.inputs[0][2], qk.inputs[1][3]}
    # the weights carry no sequence; the softmax keeps the queries' positions only
    assert len(analysis.sequence_labels["layers.0.self_attn.core.softmax"]) == 1


def test_ring_gathers_k_and_v_and_ulysses_moves_heads(plans: dict[str, Plan]) -> None:
    ring, ulysses = plans["ring"], plans["ulysses"]
    for chosen, kind in ((ring, ContextKind.RING), (ulysses, ContextKind.ULYSSES)):
        assert chosen.mesh.axis_names == ("cp",)
        assert (chosen.parallel.cp, chosen.parallel.cp_kind) == (2, kind)
        assert chosen.parallel.sp == 0  # a split over cp alone is not Megatron's sp
        assert chosen.to_json()["parallel"]["cp_kind"] == str(kind)
        # weights are whole on each context rank: their gradients sum over cp
        assert ("all_reduce", ("cp",), "gradient") in _collectives(chosen)
    # the ring: K and V gathered before each core (2 layers), their gradients
    # reduce-scattered back; Ulysses: q, k, v to heads and the output back, all-to-all
    assert _collectives(ring)[("all_gather", ("cp",), "forward")] == 4
    assert _collectives(ring)[("reduce_scatter", ("cp",), "backward")] == 4
    assert _collectives(ulysses)[("all_to_all", ("cp",), "forward")] == 8
    assert not any(kind == "all_gather" and phase == "forward"
                   for kind, _, phase in _collectives(ulysses))
    # the loss reads whole rows: the sequence-split logits gathered once after the head
    for chosen in (ring, ulysses):
        assert [(str(c.kind), c.axes) for c in chosen.collectives if c.op == "loss"] == \
            [("all_gather", ("cp",))]
    # the ring's passes hide behind the core, in part at least: the step's forward
    # communication (one micro-batch) is less than the gathers listed
    listed = sum(c.time_s for c in ring.collectives if c.phase == "forward")
    assert ring.predicted.breakdown.forward_communication_s < listed


def test_validate_and_explain_read_cp(tiny: Path, plans: dict[str, Plan]) -> None:
    graph = load_graph(tiny, batch=2, dims={"seq": SEQ})
    ring = plans["ring"]
    assert validate(ring, graph).ok
    assert "cp=2 ring" in render(explain(ring))
    data = ring.to_json()
    data["parallel"]["cp"] = 1
    problems = validate(Plan.from_json(data), graph).problems
    assert any("parallel.cp is 1 but the mesh" in p for p in problems)
    for given, says in (("ulysses", "ulysses"), (None, "absent")):
        data = ring.to_json()
        if given is None:
            del data["parallel"]["cp_kind"]
        else:
            data["parallel"]["cp_kind"] = given
        problems = validate(Plan.from_json(data), graph).problems
        assert f"parallel.cp_kind is {says} but the plan's layouts run attention over cp as " \
               "ring" in problems


@pytest.mark.parametrize("kind", ["ring", pytest.param("ulysses", marks=pytest.mark.slow)])
def test_two_ranks_match_one_process(tiny: Path, plans: dict[str, Plan], kind: str) -> None:
    """The ONNX-graph executor runs a context-parallel plan's collectives as planned, and
    two gloo ranks train as one process does."""
    for chosen in (plans[kind],):
        reference = train_reference(tiny, chosen, steps=3, optimizer="sgd")
        run = train(tiny, chosen, steps=3, optimizer="sgd")
        assert run.losses == pytest.approx(reference.losses, rel=1e-4)
        issued = {k: v for k, v in run.collectives["issued"].items()
                  if not k.endswith("|loss")}
        assert issued == planned_counts(chosen, 3)


def test_the_module_executor_refuses_cp_by_name() -> None:
    check_degrees(ParallelConfig(cp=2, cp_kind=ContextKind.RING))  # the graph executor runs it
    with pytest.raises(ShardplanError, match=r"parallel.cp is 2: .*--parallel cp=1"):
        check_degrees(ParallelConfig(cp=2, cp_kind=ContextKind.RING), graph=False)


def test_pins(tiny: Path) -> None:
    assert check_pins({"cp": 4, "cp_kind": "ulysses"}) == Pins(cp=4,
                                                               cp_kind=ContextKind.ULYSSES)
    assert check_pins({"cp": 4}).joint_only == ("cp",)
    assert check_pins({"cp": 1}).admits_op_level
    with pytest.raises(ShardplanError, match=r"cp_kind=ring: .* not cp=1"):
        check_pins({"cp": 1, "cp_kind": "ring"})
    with pytest.raises(ShardplanError, match=r"cp_kind=zig: choose one of ring, ulysses"):
        check_pins({"cp_kind": "zig"})
    with pytest.raises(ShardplanError, match=r"ep=2 cp=2: expert and context parallelism "
                                             "are not planned together"):
        joint_search(Analyses(GraphAnalysis.of(load_graph(tiny, batch=4, dims={"seq": SEQ}))),
                     load_profile("cpu"), 4, TrainingOptions(), Pins(ep=2, cp=2))


def test_a_cp_pin_the_sequence_cannot_take_is_refused(tiny: Path) -> None:
    with pytest.raises(ShardplanError, match=r"--parallel cp=3: the sequence of 16 tokens "
                                             "does not split into 3 equal blocks"):
        plan(tiny, devices=3, batch=3, dims={"seq": SEQ}, profile="a100-80g",
             parallel={"cp": 3})


def test_context_degrees_searched_only_for_long_sequences() -> None:
    assert context_degrees(4096, Pins()) == [1]
    assert context_degrees(None, Pins()) == [1]
    assert context_degrees(131072, Pins()) == [1, 2, 4, 8, 16]
    assert min(131072 // c for c in context_degrees(131072, Pins())) == MIN_CONTEXT_BLOCK
    assert context_degrees(4096, Pins(cp=2)) == [2]
    assert context_degrees(131072, Pins(cp_kind=ContextKind.RING))[0] == 2


def test_ring_overlap() -> None:
    # each of 3 steps sends a third of the blocks, hidden behind a quarter of the compute
    assert ring_overlap_exposed_s(3.0, 8.0, 3) == 0.0
    assert ring_overlap_exposed_s(3.0, 2.0, 3) == pytest.approx(3 * (1.0 - 0.5))
    assert ring_overlap_exposed_s(3.0, 0.0, 3) == 3.0


def test_long_sequences_search_context_parallelism(tmp_path: Path) -> None:
    """A small LLaMA whose one long sequence cannot be split by dp: the joint search's best
    configuration splits it over cp; the same model at a short sequence has no cp
    configuration at all (the conclusion of the 32-layer 128k-token LLaMA-8B plan on 64
    H100s, in miniature)."""
    config = LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64,
                         max_positions=2 * MIN_CONTEXT_BLOCK, ffn=64)
    path = zoo.save(zoo.build("llama", config), tmp_path / "long.onnx")
    hardware = load_profile("h100-sxm")
    for seq, wanted in ((2 * MIN_CONTEXT_BLOCK, True), (4096, False)):
        graphs = Analyses(GraphAnalysis.of(load_graph(path, batch=1, dims={"seq": seq})))
        result = joint_search(graphs, hardware, 2, TrainingOptions(), Pins(), top_k=1)
        assert (result.ranked[0].choice.cp > 1) == wanted, result.ranked[0].choice
