"""Plans run on real gloo ranks give one process's losses and issue the planned collectives."""

from __future__ import annotations

from pathlib import Path

import pytest
from launched import rank_errors

from costmodels.profile import load_profile
from executor.train import planned_counts, train, train_reference
from planner import zoo
from planner.api import load_graph, plan
from planner.cost.step import TrainingOptions
from planner.errors import PlanFileError
from planner.plans.model import Plan
from planner.plans.planning import plan_baseline

STEPS = 5


def _zoo(tmp_path: Path, preset: str) -> Path:
    family, config = zoo.preset(preset)
    return zoo.save(zoo.build(family, config), tmp_path / f"{preset}.onnx")


def _megatron(path: Path, devices: int, dims: dict[str, int]) -> Plan:
    graph = load_graph(path, batch=4, dims=dims)
    return plan_baseline(graph, load_profile("a100-80g"), devices, "megatron", TrainingOptions())


def _check(path: Path, chosen: Plan, optimizer: str = "sgd") -> None:
    reference = train_reference(path, chosen, steps=STEPS, optimizer=optimizer)
    run = train(path, chosen, steps=STEPS, optimizer=optimizer)
    assert len(run.losses) == STEPS
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)
    assert reference.losses[-1] < reference.losses[0]  # it trains
    issued = {k: v for k, v in run.collectives["issued"].items() if not k.endswith("|loss")}
    assert issued == planned_counts(chosen, STEPS)


def test_data_parallel_gpt_on_two_ranks(tmp_path: Path) -> None:
    path = _zoo(tmp_path, "gpt-tiny")
    _check(path, plan(path, devices=2, batch=4, dims={"seq": 8}, mode="data", profile="cpu"))


def test_tensor_parallel_llama_on_two_ranks(tmp_path: Path) -> None:
    path = _zoo(tmp_path, "llama-tiny")
    chosen = _megatron(path, 2, {"seq": 8})
    assert any("tp" in axes for op in chosen.ops for axes in op.assignment.values())
    _check(path, chosen, optimizer="adamw")


@pytest.mark.parametrize(("recompute", "sp"), [("none", 0), ("full", 0), ("none", 1),
                                              ("selective", 1)])
def test_q_k_v_projections_of_one_norm_share_one_move(tmp_path: Path, recompute: str,
                                                      sp: int) -> None:
    """Separate q, k and v column-parallel GEMMs read one norm output: one move serves the
    three (sequence parallel: one all-gather) and autograd sums their partial input
    gradients before one reduction (an all-reduce; a reduce-scatter under sequence
    parallelism), as DTensor and Megatron-LM do, in the plan and in the run; under
    recompute too (a checkpointed layer re-runs the move its reads share)."""
    from planner.kinds import CollectiveKind, Phase
    from planner.zoo.gpt import GPTConfig

    config = GPTConfig(layers=2, hidden=32, heads=4, vocab=64, max_positions=8,
                       fused_qkv=False)
    path = zoo.save(zoo.build("gpt", config), tmp_path / "gpt-qkv.onnx")
    chosen = plan(path, devices=2, batch=4, dims={"seq": 8},
                  parallel={"dp": 1, "tp": 2, "pp": 1, "zero": 0, "layout": "megatron",
                            "recompute": recompute, "sp": sp})
    norm = [(c.phase, c.kind, c.op) for c in chosen.collectives if c.tensor == "h.0.ln_1"]
    first = "h.0.attn.q_proj.matmul"
    expected = [(Phase.FORWARD, CollectiveKind.ALL_GATHER, first),
                (Phase.BACKWARD, CollectiveKind.REDUCE_SCATTER, first)] if sp else [
        (Phase.BACKWARD, CollectiveKind.ALL_REDUCE, first)]
    assert norm == expected
    _check(path, chosen)


def test_tensor_parallel_resnet_on_two_ranks(tmp_path: Path) -> None:
    """Convolutions with split input channels: partial sums, the bias added once."""
    path = _zoo(tmp_path, "resnet-tiny")
    _check(path, _megatron(path, 2, {}))


@pytest.mark.slow
def test_data_and_tensor_parallel_gpt_on_four_ranks(tmp_path: Path) -> None:
    path = _zoo(tmp_path, "gpt-tiny")
    chosen = plan(path, devices=4, batch=4, dims={"seq": 8}, parallel={"dp": 2, "tp": 2},
                  mode="semi", strategies={"h.*.mlp.c_fc.matmul": [[2, 1, 1], [1, 2]]})
    assert chosen.mesh.shape == (2, 2)
    _check(path, chosen)


def test_semi_auto_seed_strategies_on_two_ranks(tmp_path: Path) -> None:
    path = _zoo(tmp_path, "seed-mlp")
    chosen = plan(path, devices=2, batch=32, mode="semi",
                  strategies={"matmul1": [[1, 1], [1, 2]], "matmul2": [[1, 2], [2, 1]]})
    _check(path, chosen)


def _tied(path: Path, embedding: bool) -> Path:
    """A weight W read whole by one op and, through a Transpose, by a MatMul (as exporters
    write a tied LM head): y = f(W) @ Transpose(W), f a MatMul of the input (`embedding`:
    a Gather of token ids)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rows = 16
    weight = numpy_helper.from_array(
        (np.random.default_rng(0).standard_normal((rows, 16)) * 0.3).astype(np.float32), "W")
    first = helper.make_node("Gather", ["W", "x"], ["a"], name="mm_a", axis=0) if embedding \
        else helper.make_node("MatMul", ["x", "W"], ["a"], name="mm_a")
    nodes = [first, helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Transpose", ["W"], ["Wt"], name="tr", perm=[1, 0]),
             helper.make_node("MatMul", ["r", "Wt"], ["y"], name="mm_b")]
    x = helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", 8]) if embedding \
        else helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", rows])
    y = helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, ["batch", 8, rows] if embedding else ["batch", rows])
    graph = helper.make_graph(nodes, "tied", [x], [y], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize(("embedding", "first"), [(False, None), (True, None),
                                                  (False, [[1, 2], [2, 1]])],
                         ids=["matmul", "embedding", "matmul-row-split"])
def test_a_tied_weight_read_whole_and_split_trains_as_one_process(
        tmp_path: Path, embedding: bool, first: list | None) -> None:
    """The head reads the transposed weight split over the mesh while another op reads the
    weight whole: the zero-padded slices of the head's gradient are summed at the weight,
    and the whole read's gradient, the same on every rank, is counted once."""
    path = _tied(tmp_path / "tied.onnx", embedding)
    pins: dict = {"mm_b": [[1, 1, 1], [1, 2]] if embedding else [[1, 1], [1, 2]]}
    if first is not None:
        pins["mm_a"] = first
    chosen = plan(path, devices=2, batch=4, mode="semi", strategies=pins, profile="cpu")
    assert chosen.collectives, "the pinned split moves something"
    reference = train_reference(path, chosen, steps=STEPS, loss="mse")
    run = train(path, chosen, steps=STEPS, loss="mse")
    assert run.losses == pytest.approx(reference.losses, rel=1e-4)
    issued = {k: v for k, v in run.collectives["issued"].items() if not k.endswith("|loss")}
    assert issued == planned_counts(chosen, STEPS)


def test_an_inference_plan_is_not_trained(tmp_path: Path) -> None:
    """An inference plan sums no gradients between ranks: training on it, each rank stepped
    on its own gradients (exit 0, "collectives: as planned")."""
    from planner.errors import ShardplanError

    path = _zoo(tmp_path, "gpt-tiny")
    chosen = plan(path, devices=2, batch=4, dims={"seq": 8}, mode="data", profile="cpu",
                  inference=True)
    with pytest.raises(ShardplanError, match=r"inference plan .* plan the model without "
                                             r"--inference to train it"):
        train(path, chosen, steps=1)


def test_a_plan_for_another_model_is_refused(tmp_path: Path) -> None:
    gpt = _zoo(tmp_path, "gpt-tiny")
    llama = _zoo(tmp_path, "llama-tiny")
    chosen = plan(gpt, devices=2, batch=4, dims={"seq": 8}, mode="data", profile="cpu")
    with pytest.raises(PlanFileError, match="sha256"):
        train_reference(llama, chosen, steps=1)


def test_cli_run_matches_the_reference_and_logs(tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    import json

    from planner.cli import main

    path = _zoo(tmp_path, "gpt-tiny")
    plan_file = tmp_path / "plan.json"
    assert main(["plan", str(path), "--devices", "2", "--batch", "4", "--dim", "seq=8",
                 "--mode", "data", "-o", str(plan_file)]) == 0
    logs = {}
    for nproc in ("2", "1"):
        log = tmp_path / f"log{nproc}.json"
        assert main(["run", str(path), "--plan", str(plan_file), "--nproc", nproc, "--steps",
                     "2", "--log-json", str(log)]) == 0
        logs[nproc] = json.loads(log.read_text())
    assert "collectives: as planned" in capsys.readouterr().out
    assert logs["2"]["losses"] == pytest.approx(logs["1"]["losses"], rel=1e-4)
    assert logs["2"]["collectives"]["planned"] == logs["2"]["collectives"]["issued"]
    assert set(logs["2"]) >= {"losses", "step_time_s", "predicted_step_time_s", "collectives"}
    assert main(["run", str(path), "--plan", str(plan_file), "--nproc", "3"]) == 2


@pytest.mark.parametrize("preset", ["gpt-tiny", "bert-tiny", "llama-tiny", "resnet-tiny",
                                    "moe-tiny"])
def test_reference_mode_matches_onnxruntime(tmp_path: Path, preset: str) -> None:
    """One process, nothing split, the model's own weights: the planning graph's forward
    (folded shapes, local programs) gives what onnxruntime gives on the original file."""
    import numpy as np
    import onnxruntime

    from executor.runtime import Placement, PlanRunner, onnx_weights
    from executor.train import synthetic_batch
    from planner.sharding.analysis import GraphAnalysis

    family, config = zoo.preset(preset)
    path = str(zoo.save(zoo.build(family, config, with_weights=True), tmp_path / "m.onnx"))
    graph = load_graph(path, batch=2, dims={} if family == "resnet" else {"seq": 8})
    runner = PlanRunner(GraphAnalysis.of(graph), Placement.unsplit(graph), 0, 0,
                        onnx_weights(path))
    feeds, _, output = synthetic_batch(graph, 0)
    values, _ = runner.forward(feeds)
    expected = onnxruntime.InferenceSession(path).run(
        None, {k: v.numpy() for k, v in feeds.items()})[0]
    np.testing.assert_allclose(values[output].detach().numpy(), expected, atol=1e-4)


@pytest.mark.slow
def test_exported_gpt2_tensor_parallel_on_two_ranks(export_model) -> None:
    """transformers' GPT-2 (2 layers), exported by torch, trained with its own weights."""
    path = export_model("gpt2", "torchscript")
    _check(path, _megatron(path, 2, {"seq": 16}))


@pytest.mark.slow
def test_mixed_ilp_plan_on_four_ranks(tmp_path: Path) -> None:
    """Under a tight memory limit the ILP mixes splits over both mesh axes."""
    path = _zoo(tmp_path, "gpt-tiny")
    free = plan(path, devices=4, batch=8, dims={"seq": 16}, mesh=(2, 2))
    limit = free.predicted.memory["peak"] * 0.5 / 2**30
    chosen = plan(path, devices=4, batch=8, dims={"seq": 16}, mesh=(2, 2),
                  memory_limit_gib=limit)
    assert chosen.solver.status == "optimal"
    used = {axis for op in chosen.ops for axes in op.assignment.values() for axis in axes}
    assert used == {"a0", "a1"}
    assert len({str(sorted(op.assignment.items())) for op in chosen.ops}) > 3
    _check(path, chosen)


def test_torchrun_runs_the_same_training(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    path = _zoo(tmp_path, "gpt-tiny")
    chosen = plan(path, devices=2, batch=4, dims={"seq": 8}, mode="data", profile="cpu")
    plan_file = chosen.save(tmp_path / "plan.json")
    log = tmp_path / "log.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "executor", str(path), "--plan", str(plan_file),
                "--steps", "3", "--log-json", str(log)]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, rank_errors(done)
    reference = train_reference(path, chosen, steps=3)
    assert json.loads(log.read_text())["losses"] == pytest.approx(reference.losses, rel=1e-4)


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["plain", "dropout"])
def test_resume_continues_the_same_trajectory(tmp_path: Path, dropout: float) -> None:
    """AdamW state and shards saved with torch.distributed.checkpoint, atomically; with
    dropout, the masks of the steps after the saved one (drawn by the step's number)."""
    from dataclasses import replace

    family, config = zoo.preset("gpt-tiny")
    path = zoo.save(zoo.build(family, replace(config, dropout=dropout)),
                    tmp_path / "gpt.onnx")
    chosen = plan(path, devices=2, batch=4, dims={"seq": 8}, mode="data", profile="cpu")
    whole = train(path, chosen, steps=5, optimizer="adamw", lr=0.01)
    saved = tmp_path / "ckpt"
    first = train(path, chosen, steps=3, optimizer="adamw", lr=0.01, checkpoint=str(saved))
    assert saved.is_dir() and not (tmp_path / "ckpt.partial").exists()
    rest = train(path, chosen, steps=2, optimizer="adamw", lr=0.01, resume=str(saved))
    assert first.losses + rest.losses == pytest.approx(whole.losses, rel=1e-6)


def test_a_run_killed_midway_resumes_on_the_same_trajectory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints every 2 steps; rank 1 dies before step 4; resuming from the last
    complete checkpoint (step 2, never a half-written one) continues the same losses."""
    from planner.errors import ShardplanError

    path = _zoo(tmp_path, "gpt-tiny")
    chosen = plan(path, devices=2, batch=4, dims={"seq": 8}, mode="data", profile="cpu")
    whole = train(path, chosen, steps=6, optimizer="adamw", lr=0.01)
    saved = tmp_path / "ckpt"
    monkeypatch.setenv("SHARDPLAN_FAULT", "1:3")
    with pytest.raises(ShardplanError, match="rank 1 died"):
        train(path, chosen, steps=6, optimizer="adamw", lr=0.01, checkpoint=str(saved),
              checkpoint_every=2)
    monkeypatch.delenv("SHARDPLAN_FAULT")
    assert (saved / ".metadata").exists()
    rest = train(path, chosen, steps=4, optimizer="adamw", lr=0.01, resume=str(saved))
    assert rest.losses == pytest.approx(whole.losses[2:], rel=1e-6)


def _regression_with_loss(path: Path) -> Path:
    """x @ w1 -> relu -> @ w2, loss = ReduceMean((y - labels)^2): the graph's own loss."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    labels = helper.make_tensor_value_info("labels", TensorProto.FLOAT, ["batch", 4])
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    inits = [numpy_helper.from_array((0.3 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in (("w1", (16, 32)), ("w2", (32, 4)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
             helper.make_node("Sub", ["y", "labels"], ["d"], name="diff"),
             helper.make_node("Mul", ["d", "d"], ["sq"], name="square"),
             helper.make_node("ReduceMean", ["sq"], ["loss"], name="mean", keepdims=0)]
    graph = helper.make_graph(nodes, "reg", [x, labels], [loss], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_the_graphs_own_loss_and_npy_data(tmp_path: Path) -> None:
    import numpy as np

    path = _regression_with_loss(tmp_path / "reg.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    np.save(data / "x.npy", rng.standard_normal((8, 16)).astype(np.float32))
    np.save(data / "labels.npy", rng.standard_normal((8, 4)).astype(np.float32))
    chosen = plan(path, devices=2, batch=8, mode="data", profile="cpu")
    assert chosen.ops[-1].outputs[0].layout.partial == ("dp",)  # a partial mean over ranks
    reference = train_reference(path, chosen, steps=4, data=str(data))
    run = train(path, chosen, steps=4, data=str(data))
    assert run.losses == pytest.approx(reference.losses, rel=1e-5)
    assert reference.losses[-1] < reference.losses[0]
    x = np.load(data / "x.npy")
    hidden = np.maximum(x @ _weights(path)["w1"], 0) @ _weights(path)["w2"]
    first = float(((hidden - np.load(data / "labels.npy")) ** 2).mean())
    assert reference.losses[0] == pytest.approx(first, rel=1e-5)  # the model's own weights


def _weights(path: Path) -> dict:
    import onnx
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_mse_loss_on_a_classifier_output(tmp_path: Path) -> None:
    path = _zoo(tmp_path, "seed-mlp")
    chosen = plan(path, devices=2, batch=32, mode="data", profile="cpu")
    reference = train_reference(path, chosen, steps=3, loss="mse", lr=0.01)
    run = train(path, chosen, steps=3, loss="mse", lr=0.01)
    assert run.losses == pytest.approx(reference.losses, rel=1e-5)


def _kind_plan(path: Path, kind: str, devices: int, batch: int, dims: dict[str, int]) -> Plan:
    if kind == "data":
        return plan(path, devices=devices, batch=batch, dims=dims, mode="data", profile="cpu")
    if kind == "tensor":
        graph = load_graph(path, batch=batch, dims=dims)
        return plan_baseline(graph, load_profile("a100-80g"), devices, "megatron",
                             TrainingOptions())
    free = plan(path, devices=devices, batch=batch, dims=dims, mesh=(2, devices // 2))
    return plan(path, devices=devices, batch=batch, dims=dims, mesh=(2, devices // 2),
                memory_limit_gib=free.predicted.memory["peak"] * 0.6 / 2**30)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("kind", ["data", "tensor", "mixed"])
@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny", "resnet-tiny"])
def test_plan_kinds_match_one_process(tmp_path: Path, preset: str, kind: str,
                                      devices: int) -> None:
    path = _zoo(tmp_path, preset)
    dims = {} if preset == "resnet-tiny" else {"seq": 8}
    try:
        chosen = _kind_plan(path, kind, devices, 8, dims)
    except Exception as exc:
        pytest.skip(f"no {kind} plan: {exc}")
    _check(path, chosen)


def test_a_dying_rank_stops_the_others_with_a_clear_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from planner.errors import ShardplanError

    path = _zoo(tmp_path, "gpt-tiny")
    chosen = plan(path, devices=2, batch=4, dims={"seq": 8}, mode="data", profile="cpu")
    monkeypatch.setenv("SHARDPLAN_FAULT", "1:2")  # rank 1 dies before its third step
    started = time.monotonic()
    with pytest.raises(ShardplanError, match="rank 1 died"):
        train(path, chosen, steps=5)
    assert time.monotonic() - started < 60  # no hang: rank 0 is stopped, not left waiting


@pytest.mark.slow
def test_dynamo_llama_export_trains_on_two_ranks(export_model) -> None:
    """torch's default exporter writes the attention mask's lookup as GatherND; the
    executor runs it, so the export a user hands over trains as planned."""
    path = export_model("llama", "dynamo", training=True, batch=4)
    chosen = plan(path, devices=2, batch=4, dims={"seq": 16}, mode="data", profile="cpu")
    _check(path, chosen)


@pytest.mark.slow
def test_default_dynamo_mistral_export_trains_tensor_parallel(export_model) -> None:
    """What `torch.onnx.export(model, dynamo=True)` gives by default for a GQA decoder:
    optimised (renamed, pre-transposed weights), rotary tables computed in the graph.
    Its Megatron-style plan on two ranks trains as one process does."""
    path = export_model("mistral", "dynamo", opset=18, batch=4)
    _check(path, _megatron(path, 2, {"seq": 16}))


@pytest.mark.slow
def test_t5_position_bias_gradient_is_reduced_at_its_table(export_model) -> None:
    """T5's relative position bias is one [buckets, heads] table gathered at indices
    computed from shapes: its gradient is summed once at the table (512 B here), not
    all-reduced as the [1, heads, seq, seq] bias at every layer that reads it, and the
    data-parallel run still trains as one process does. (At seq 512 the bucket indices,
    512 x 512, are too large to fold into a constant: they stay ops of shapes alone.)"""
    path = export_model("t5", "torchscript", opset=18, batch=4)
    chosen = plan(path, devices=2, batch=4, dims={"seq": 512}, mode="data", profile="cpu")
    reduced = {c.tensor for c in chosen.collectives if c.kind.value == "all_reduce"}
    assert any("relative_attention_bias" in t for t in reduced)
    bias = [c for c in chosen.collectives if c.phase.value == "backward"]
    assert bias == [], [(c.op, c.tensor) for c in bias][:3]
    _check(path, chosen)
