"""Planning stays near-linear in graph size: repeat detection by runs, not by shifts."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_robustness import _save, chain_model

from planner import api
from planner.api import plan
from planner.errors import ModelError, ShardplanError
from planner.layers import Repeats, _best_run
from planner.search.stages import MAX_PIPELINE_UNITS

REPO = Path(__file__).resolve().parents[1]


def _shifts(codes: np.ndarray, offset: int) -> Repeats | None:
    """The definition, quadratic: for each period the longest stretch where codes repeat
    at that shift (first on ties), the period covering most ops (smallest on ties)."""
    best: Repeats | None = None
    for period in range(2, len(codes) // 2 + 1):
        equal = np.concatenate(([0], (codes[:-period] == codes[period:]).astype(np.int8), [0]))
        changes = np.flatnonzero(np.diff(equal))
        if not len(changes):
            continue
        lengths = changes[1::2] - changes[::2]
        longest = int(np.argmax(lengths))
        count = (int(lengths[longest]) + period) // period
        candidate = Repeats(offset + int(changes[::2][longest]), period, count)
        if count >= 2 and (best is None or candidate.covered > best.covered):
            best = candidate
    return best


def test_repeat_detection_by_runs_matches_the_definition() -> None:
    rng = np.random.default_rng(7)
    for trial in range(1000):
        n = int(rng.integers(0, 70))
        if trial % 2:
            base = rng.integers(0, 4, int(rng.integers(1, 8)))
            codes = np.tile(base, n // len(base) + 1)[:n].copy()
            for _ in range(int(rng.integers(0, 3))):
                if n:
                    codes[rng.integers(0, n)] = rng.integers(0, 5)
        else:
            codes = rng.integers(0, int(rng.integers(1, 4)), n)
        codes = codes.astype(np.int64)
        assert _best_run(codes, 3) == _shifts(codes, 3), codes.tolist()


PLAN_AND_MEASURE = """
import contextlib, io, json, resource, sys, time
from planner.cli import main
started = time.perf_counter()
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    code = main(["plan", sys.argv[1], "--devices", "8", "--batch", "8", "-o", sys.argv[2]])
print(json.dumps({"seconds": time.perf_counter() - started, "code": code,
                  "stderr": err.getvalue(),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


VALIDATE = """
import contextlib, io, json, sys
from planner.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["validate", sys.argv[1], sys.argv[2]])
print(json.dumps({"code": code, "stdout": out.getvalue()}))
"""


#: The chain the slow test below plans: 50,000 ops in CI (about 100 s and 1.1 GiB to plan,
#: 46 s to validate, on a 2-core machine); `SHARDPLAN_CHAIN_OPS=200000` plans the issue's
#: 200,000 (142.6 s and 3.9 GB on 2026-12-05; 211.3 s on a slower machine on 2026-12-06:
#: docs/robustness.md "Planning large graphs"), too long for CI. `bench/scale.py` prints the
#: same figures by phase, against another commit.
CHAIN_OPS = int(os.environ.get("SHARDPLAN_CHAIN_OPS", "50000"))


@pytest.mark.slow
def test_a_long_chain_plans_in_bounded_time_and_memory(tmp_path: Path) -> None:
    """A chain of `CHAIN_OPS` ops is planned (no pipeline past MAX_PIPELINE_UNITS units)
    within 6 GiB, and `validate` accepts the plan against the model. The time is printed;
    the bound is generous (the issue's target, 200,000 ops in a minute, is not met)."""
    path = _save(chain_model(CHAIN_OPS, width=16), tmp_path / "chain.onnx")
    plan_file = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-c", PLAN_AND_MEASURE, str(path), str(plan_file)],
                          cwd=REPO, capture_output=True, text=True, timeout=1500, check=True,
                          preexec_fn=_limit_memory)
    figures = json.loads(done.stdout)
    print(f"\n{CHAIN_OPS:,}-node chain: exit {figures['code']} in {figures['seconds']:.1f} s, peak "
          f"RSS {figures['peak_rss_bytes'] / 2**20:.0f} MiB")
    assert figures["code"] == 0, figures["stderr"][-2000:]
    assert figures["seconds"] < 1200
    assert figures["peak_rss_bytes"] < 6 << 30
    checked = subprocess.run([sys.executable, "-c", VALIDATE, str(plan_file), str(path)],
                             cwd=REPO, capture_output=True, text=True, timeout=900, check=True,
                             preexec_fn=_limit_memory)
    verdict = json.loads(checked.stdout)
    assert verdict["code"] == 0, verdict["stdout"][-2000:]
    assert f"{CHAIN_OPS} ops" in verdict["stdout"]


def test_a_graph_past_the_planned_ops_is_refused_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_PLANNED_OPS a graph is refused after its import, in one line, rather than
    run out of memory (a 400-op chain against a limit of 100 stands for a larger one)."""
    monkeypatch.setattr(api, "MAX_PLANNED_OPS", 100)
    path = _save(chain_model(400, width=16), tmp_path / "chain.onnx")
    with pytest.raises(ModelError, match=r"chain.onnx: 400 ops, more than the planner plans "
                                         r"\(100: ") as refused:
        plan(path, devices=8, batch=8)
    assert "\n" not in str(refused.value)


def test_a_pipeline_of_more_units_than_the_stage_search_takes_is_refused(
        tmp_path: Path) -> None:
    """Its tables hold (units + 1)² entries each: pinned pp > 1 is an error, not 6 GiB."""
    layers = MAX_PIPELINE_UNITS + 25
    path = _save(chain_model(4 * layers, width=16), tmp_path / "chain.onnx")
    with pytest.raises(ShardplanError, match=rf"pp=2: the graph has {layers + 1} units "
                                             rf"\(layers\), more than the stage search takes"):
        plan(path, devices=8, batch=8, parallel={"pp": 2})


def test_planning_pauses_the_cyclic_collector_and_restores_it(tmp_path: Path) -> None:
    """The collector is off while `plan` searches (its passes walk every live object of a
    large graph) and as it was afterwards, on or off; `collector_paused` blocks nest."""
    import gc

    path = _save(chain_model(40, width=16), tmp_path / "chain.onnx")
    seen: list[bool] = []
    assert gc.isenabled()
    plan(path, batch=8, devices=2, progress=lambda _: seen.append(gc.isenabled()))
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        plan(path, batch=8, devices=2)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with api.collector_paused():
        with api.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_op_level_finalists_on_equivalent_meshes_are_built_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Data parallelism over every axis of a 2×4 mesh is the plan over a mesh of 8: the
    planner builds it once (a row for each mesh still); the plan file is the one built
    with every mesh derived (`_flat_key` off)."""
    from planner.plans import planning
    from planner.search.decisions import OpLevelDecision

    path = _save(chain_model(400, width=16), tmp_path / "chain.onnx")
    derived: list[tuple[int, ...]] = []
    original = planning.derive

    def counting(context, decision):  # type: ignore[no-untyped-def]
        if isinstance(decision, OpLevelDecision):
            derived.append(tuple(decision.mesh.shape))
        return original(context, decision)

    monkeypatch.setattr(planning, "derive", counting)
    once = plan(path, batch=8, devices=8)
    built_once = list(derived)
    derived.clear()
    monkeypatch.setattr(planning, "_flat_key", lambda decision: None)
    every = plan(path, batch=8, devices=8)
    assert len(built_once) < len(derived)
    assert once.to_json() == every.to_json()


def _saved_graph(nodes: list[onnx.NodeProto], outputs: list[str], path: Path,
                 initializers: Sequence[onnx.TensorProto] = ()) -> Path:
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, path.stem, [value("x", TensorProto.FLOAT, ["batch", 16])],
        [value(name, TensorProto.FLOAT, ["batch", 16]) for name in outputs], initializers)
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                   ir_version=8), path)


def shared_constant_chain(ops: int, path: Path) -> Path:
    """Relu and an Add of one constant, alternating: every op fuses into one region, and
    the constant (a weight) is read by every unit (`bench/scale.py --model shared-constant`)."""
    nodes, current = [], "x"
    for i in range(ops):
        inputs = [current, "c"] if i % 2 else [current]
        nodes.append(helper.make_node("Add" if i % 2 else "Relu", inputs, [f"t{i}"]))
        current = f"t{i}"
    return _saved_graph(nodes, [current], path,
                        [helper.make_tensor("c", TensorProto.FLOAT, [16], [0.5] * 16)])


def many_outputs(ops: int, path: Path) -> Path:
    """`ops` Relus of the input, each a graph output: as many one-op kernel regions as
    outputs (`bench/scale.py --model many-outputs`)."""
    nodes = [helper.make_node("Relu", ["x"], [f"t{i}"]) for i in range(ops)]
    return _saved_graph(nodes, [f"t{i}" for i in range(ops)], path)


def relu_chain(ops: int, path: Path) -> Path:
    """`ops` Relus one after the other on a [batch, 16] input: the plainest long chain
    (`bench/scale.py --model relu`)."""
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"])
             for i in range(ops)]
    return _saved_graph(nodes, [f"t{ops - 1}"], path)


def static_relu_chain(ops: int, path: Path) -> Path:
    """The same chain on an input of static shape [8, 16], as a graph written by hand
    often is: no other batch to bind it at, so no micro-batch sizes to import it again at
    (`bench/scale.py --model static-relu`)."""
    relu_chain(ops, path)
    model = onnx.load(str(path))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 8
    return _save(model, path)


BUILDERS = {"shared-constant": shared_constant_chain, "many-outputs": many_outputs,
            "relu": relu_chain, "static-relu": static_relu_chain}


def _planner_lines(path: Path, **options: Any) -> Counter[str]:
    """Lines of the planner's code run to plan `path` (with `options`), per file: work,
    counted, not timed."""
    root = str(REPO / "planner") + os.sep
    counts: Counter[str] = Counter()

    def calls(frame, event, arg):  # type: ignore[no-untyped-def]
        name = frame.f_code.co_filename
        if not name.startswith(root):
            return None
        relative = name[len(root):]

        def local(frame, event, arg):  # type: ignore[no-untyped-def]
            if event == "line":
                counts[relative] += 1
            return local
        return local

    sys.settrace(calls)  # this thread's lines only: planning runs on the caller's thread
    try:
        plan(path, devices=8, batch=8, **options)
    finally:
        sys.settrace(None)
    return counts


def test_planning_work_stays_linear_where_one_region_or_one_weight_spans_the_graph(
        tmp_path: Path) -> None:
    """A long elementwise chain fuses into one kernel region: each region member's saved
    tensor was traced back through the whole region (`planner.cost.kernels._fuse`),
    quadratic; a 200,000-op such chain did not finish planning in 10 minutes. Doubling the
    ops now less than doubles the planner's work (1.9x; 2.9x before), in every module
    doing much of it. Two more quadratics ran in C, where lines are not counted, and
    `bench/scale.py --model` times them: the constant every layer adds, a weight every
    unit reads, had each unit looked up in its tuple of readers
    (`planner.cost.pipeline.Pricer._overlap`); each of 20,000 outputs' one-op regions made
    a set of the graph's outputs (`planner.cost.kernels._region_bounds`; at a few hundred
    outputs the search tries more configurations at twice the ops, which hides it)."""
    small = _planner_lines(shared_constant_chain(400, tmp_path / "small.onnx"))
    large = _planner_lines(shared_constant_chain(800, tmp_path / "large.onnx"))
    assert large.total() / small.total() < 2.2, (small.total(), large.total())
    grown = {name: round(count / small[name], 2) for name, count in large.items()
             if count >= 50_000 and count / max(1, small[name]) >= 2.2}
    assert not grown, grown


def test_a_strategies_file_naming_every_op_is_resolved_in_linear_work(tmp_path: Path) -> None:
    """Semi-auto planning from a strategies file with an entry for each op (what editing a
    plan's strategies gives): each entry listed the graph's op names again and looked its
    name up in that list, quadratic (50,000 ops: 439.5 s to plan; 15.7 s now). Doubling
    the ops now less than doubles the planner's work."""
    counts = []
    for ops in (400, 800):
        path = shared_constant_chain(ops, tmp_path / f"chain{ops}.onnx")
        named = plan(path, devices=8, batch=8, mode="data")
        strategies = {op.name: [list(t) for t in op.strategy] for op in named.ops}
        counts.append(_planner_lines(path, mode="semi", strategies=strategies))
    small, large = counts
    assert large.total() / small.total() < 2.2, (small.total(), large.total())
    assert large["search/oplevel.py"] / small["search/oplevel.py"] < 2.2


def test_the_joint_finalists_are_built_from_their_exact_derivations_however_large_the_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The joint search prices each finalist exactly when it decides it, and the builder
    builds the same derivation right after. A 200,000-op graph keeps 3 derivations
    (`memo_limit`); the memo was cleared whole whenever it passed 2, so the builder
    derived two of the three finalists again (7.5 s of a static 200,000-op chain's 63).
    Here a small chain under the same limit: no derivation is made twice."""
    from planner.cost import oplevel

    path = tmp_path / "chain.onnx"
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"])
             for i in range(200)]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("t199", TensorProto.FLOAT, [8, 16])])
    _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    monkeypatch.setattr(oplevel, "MEMO_OPS", 1)  # the least kept, as at 200,000 ops
    derived: Counter[tuple] = Counter()
    derive = oplevel.derive

    def counted(analysis, mesh, strategies, **options):  # type: ignore[no-untyped-def]
        derived[(id(analysis), mesh, frozenset(strategies.items()),
                 options.get("foreign"))] += 1
        return derive(analysis, mesh, strategies, **options)

    monkeypatch.setattr(oplevel, "derive", counted)
    chosen = plan(path, devices=8)
    assert chosen.predicted.fits and len(derived) >= 6
    assert max(derived.values()) == 1, list(derived.values())


def test_only_the_chosen_finalist_has_its_entries_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each finalist (the joint search's, each op-level mesh's, the baselines) is priced
    and compared by its brief; only the one chosen becomes the plan, so only its op and
    tensor entries are written (every finalist's were: 5 s of a static 200,000-op Relu
    chain's 56)."""
    from planner.plans import build

    written: list[int] = []
    entries = build._built_op_entries

    def counted(priced):  # type: ignore[no-untyped-def]
        written.append(len(priced.sharded.ops))
        return entries(priced)

    monkeypatch.setattr(build, "_built_op_entries", counted)
    path = _save(chain_model(40, width=16), tmp_path / "chain.onnx")
    chosen = plan(path, devices=8, batch=8)
    assert len(chosen.alternatives) + len(chosen.baselines) >= 4
    assert written == [len(chosen.ops)]


@pytest.mark.parametrize("parallel", [{}, {"pp": 2, "vpp": 2}, {"tp": 2, "sp": 1}],
                         ids=["searched", "interleaved", "sequence-parallel"])
def test_every_finalists_sections_agree_with_the_brief_it_was_compared_by(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallel: dict) -> None:
    """A finalist is compared by its brief and predicted step, found before its sections
    and apart from them (`planner.plans.build.Derived`). Written anyway here, each
    finalist's plan (joint, op-level, baseline) reads back the same figures (`sections`
    asserts it), and the same `parallel.sp` from its own entries as from its derivation."""
    from planner import zoo
    from planner.plans import planning
    from planner.plans.sequence import sequence_parallel
    from planner.zoo.gpt import GPTConfig

    written: list[str] = []
    add = planning.Finalists.add

    def writing(self, derived, record, search, on=None):  # type: ignore[no-untyped-def]
        sections = derived.sections
        assert derived.parallel.sp == sequence_parallel(sections.ops, sections.tensors,
                                                        sections.units)
        written.append(str(search))
        return add(self, derived, record, search, on)

    monkeypatch.setattr(planning.Finalists, "add", writing)
    config = GPTConfig(layers=4, hidden=64, heads=4, vocab=128, max_positions=32,
                       dropout=0.0, fused_qkv=False)
    path = zoo.save(zoo.build("gpt", config), tmp_path / "gpt.onnx")
    chosen = plan(path, devices=8, batch=8, dims={"seq": 32}, parallel=parallel)
    assert written and chosen.parallel.sp == parallel.get("sp", chosen.parallel.sp)
    if "pp" in parallel:
        assert chosen.pipeline is not None and chosen.pipeline.virtual_stages == 2
