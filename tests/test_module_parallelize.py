"""`executor.parallelize` trains the user's own module with a plan on gloo ranks, to the
losses of the module trained as it is in one process (transformers LLaMA with GQA, GPT-2
with dropout): data and tensor parallel, ZeRO 1-3, micro-batches, recompute and pipeline
stages (1F1B with a tied embedding, interleaved with recompute)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from launched import rank_errors
from module_runs import trains_as_one_process

from examples.hf_models import megatron_strategies
from executor.module.launch import (
    Checkpoints,
    export_builder,
    load_builder,
    train_module,
    train_module_reference,
)
from executor.module.layouts import check_parameters
from executor.module.parallelize import parallelize, parameter_names
from planner.api import load_graph, plan
from planner.cli import main
from planner.errors import ShardplanError
from planner.plans.model import Plan

LLAMA = "examples.hf_models:llama"
BATCH = 4
STEPS = 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_builder(LLAMA, BATCH, tmp_path_factory.mktemp("module") / "llama.onnx")


def _megatron_strategies(path: Path) -> dict[str, list[list[int]]]:
    strategies = megatron_strategies(load_graph(path, batch=BATCH))
    assert len(strategies) == 14  # 7 projections in each of 2 layers
    return strategies


def test_tensor_parallel_plan_trains_the_module_as_one_process(llama_onnx: Path) -> None:
    chosen = plan(llama_onnx, devices=2, batch=BATCH, profile="a100-80g", mode="semi",
                  strategies=_megatron_strategies(llama_onnx), mesh=(2,))
    split = [n for n, e in chosen.tensors.items() if e.kind == "parameter" and
             any(e.layout.dims)]
    assert len(split) == 14
    run = train_module(LLAMA, chosen, steps=STEPS, batch_size=BATCH)
    reference = train_module_reference(LLAMA, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(reference, rel=1e-4)
    # column-parallel inputs reduced once for q, k and v in backward, row-parallel outputs
    # all-reduced in forward: the plan's calls, no more, no fewer
    assert run.differences == []
    assert run.collectives["issued"]["all_reduce|a0|forward"] == 4 * STEPS


def test_a_vocabulary_split_head_issues_only_the_planned_collectives(llama_onnx: Path
                                                                     ) -> None:
    """The head split over the vocabulary (its input gathered, logits left split): the
    gather's backward is the plan's reduce-scatter (not an all-reduce and a cut), the
    exporter's slices of keys and values issue nothing in either pass, and the loss reads
    whole rows of the logits, gathered with the forward pass where the plan lists it (two
    all-gathers a micro-batch: the head's input, the logits); one process's losses."""
    graph = load_graph(llama_onnx, batch=BATCH)
    head = [op for op in graph.ops if op.op_type == "MatMul"][-1]
    chosen = plan(llama_onnx, devices=2, batch=BATCH, profile="cpu", mode="semi",
                  strategies={head.name: ((1, 1, 1), (1, 2))}, mesh=(2,))
    logits = next(op for op in chosen.ops if op.name == head.name).outputs[0]
    assert logits.layout.dims[-1]  # split over the vocabulary
    run = train_module(LLAMA, chosen, steps=STEPS, batch_size=BATCH)
    assert run.differences == []
    assert run.collectives["issued"]["reduce_scatter|a0|backward"] > 0
    assert run.collectives["issued"]["all_gather|a0|forward"] == 2 * STEPS
    reference = train_module_reference(LLAMA, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(reference, rel=1e-4)


@pytest.mark.parametrize("layout", ["head", "megatron"])
def test_a_tied_table_issues_only_the_planned_collectives(tmp_path: Path,
                                                          layout: str) -> None:
    """GPT-2's embedding is its head's weight: the head split over the vocabulary with
    the table replicated (the sweep of 2026-12-06 saw an all-gather where the plan lists
    the head input gradient's reduce-scatter), and Megatron's split."""
    gpt2 = "examples.hf_models:gpt2"
    path = export_builder(gpt2, BATCH, tmp_path / "gpt2.onnx")
    if layout == "head":
        head = [op for op in load_graph(path, batch=BATCH).ops if op.op_type == "MatMul"][-1]
        chosen = plan(path, devices=2, batch=BATCH, profile="cpu", mode="semi",
                      strategies={head.name: ((1, 1, 1), (1, 2))}, mesh=(2,))
    else:
        chosen = plan(path, devices=2, batch=BATCH, profile="cpu",
                      parallel={"dp": 1, "tp": 2, "layout": "megatron"})
    assert trains_as_one_process(gpt2, chosen, steps=STEPS, batch_size=BATCH).unplanned == {}


def test_a_plan_of_another_model_names_the_strays(llama_onnx: Path) -> None:
    chosen = plan(llama_onnx, devices=2, batch=BATCH, profile="cpu", mode="data",
                  parallel={"zero": 0})
    module, _, _ = load_builder("examples.hf_models:gpt2")()
    with pytest.raises(ShardplanError, match=r"does not match the module: module "
                       r"parameters the plan does not name: model\.transformer\.h\.0"):
        check_parameters(chosen, parameter_names(module))


def test_plans_it_cannot_run_yet_are_refused_in_one_line(llama_onnx: Path) -> None:
    chosen = plan(llama_onnx, devices=2, batch=BATCH, profile="cpu", mode="data",
                  parallel={"zero": 0})
    staged = plan(llama_onnx, devices=2, batch=BATCH, profile="cpu", mode="auto",
                  parallel={"dp": 1, "tp": 1, "pp": 2, "micro_batches": 2, "zero": 0,
                            "schedule": "1f1b"})
    with pytest.raises(ShardplanError, match="checkpoints of a pipeline plan"):
        train_module(LLAMA, staged, steps=1, checkpoints=Checkpoints(save="unused"))
    module, make_batch, _ = load_builder(LLAMA)()
    assert not dist.is_initialized()
    with pytest.raises(ShardplanError, match="initialised process group"):
        parallelize(module, chosen, make_batch(0, BATCH))


def _pinned(path: Path, **parallel: object) -> Plan:
    """A plan of `path` on 2 devices, data-parallel with the given ZeRO stage,
    micro-batches and recompute."""
    return plan(path, devices=2, batch=BATCH, profile="cpu", mode="auto",
                parallel={"dp": 2, "tp": 1, "pp": 1, **parallel})


def _elements(spec: str) -> int:
    module, _, _ = load_builder(spec)()
    return sum(p.numel() for p in module.parameters())


def test_zero1_shards_the_optimizer_and_trains_as_one_process(llama_onnx: Path) -> None:
    """ZeRO 1 reduce-scatters the gradients once per step (after the last of 2
    micro-batches) and all-gathers the updated chunks after `optimizer.step()` (AdamW,
    whose state is then half the weights), keeping the whole weights for the forward.
    (ZeRO 2, which reduce-scatters after every micro-batch, trains BERT below.)"""
    zero = 1
    chosen = _pinned(llama_onnx, zero=zero, micro_batches=2)
    # AdamW at 0.01: at 0.1 it divides rounding-level gradients by their own size, and
    # the losses of any two summation orders part by 3e-4 within four steps
    run = train_module(LLAMA, chosen, steps=STEPS, batch_size=BATCH, optimizer="adamw",
                       lr=0.01, count_steps=2)
    reference = train_module_reference(LLAMA, steps=STEPS, batch_size=BATCH,
                                       optimizer="adamw", lr=0.01)
    assert run.losses == pytest.approx(reference, rel=1e-4)
    # counted over the first 2 steps (the optimizer's gathers after step() included)
    assert run.differences == []
    assert run.counted_steps == 2
    assert run.verdict.endswith(f"(counted over the first 2 of {STEPS} steps)")
    assert run.collectives["issued"]["reduce_scatter|dp|gradient"] == 2
    assert run.collectives["issued"]["all_gather|dp|gradient"] > 0
    total = _elements(LLAMA)
    assert total / 2 <= run.parameter_elements <= total / 2 + 64
    assert run.resident_weight_elements == total


def test_gpt2_zero3_micro_batches_with_dropout_train_as_one_device(tmp_path: Path) -> None:
    """GPT-2 (dropout 0.1, the embedding tied to the head) under ZeRO 3 in 2
    micro-batches: each micro-batch draws the masks of its rows of the whole batch, and
    the tied weight is gathered once per pass though read at both ends of the model."""
    gpt2 = "examples.hf_models:gpt2"
    chosen = _pinned(export_builder(gpt2, BATCH, tmp_path / "gpt2.onnx"), zero=3,
                     micro_batches=2)
    run = train_module(gpt2, chosen, steps=STEPS, batch_size=BATCH)
    reference = train_module_reference(gpt2, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(reference, rel=1e-4)
    eager = train_module_reference(gpt2, steps=STEPS, batch_size=BATCH, traced=False)
    assert run.losses != pytest.approx(eager, rel=1e-4)
    assert run.differences == []


def test_a_whole_position_embedding_keeps_its_gradient_pending_as_planned(
        tmp_path: Path) -> None:
    """GPT-2 with tp=2 pinned: the search splits the rows over "tp" inside the graph (the
    token gather cuts them; the batch enters whole), while the position embedding is
    computed whole on every rank and added to this rank's rows. Its gradient is this
    rank's share, which the plan sums once per step (an all-reduce of wpe over tp): the
    executor keeps it pending where the whole value meets DTensor ops, instead of
    letting DTensor sum it there (an all-reduce the plan does not list, after which the
    plan's own would sum it again)."""
    gpt2 = "examples.hf_models:gpt2"
    chosen = plan(export_builder(gpt2, BATCH, tmp_path / "gpt2.onnx"), devices=2,
                  batch=BATCH, profile="a100-80g", parallel={"dp": 1, "tp": 2})
    assert any(c.tensor.endswith("wpe.weight") and c.axes == ("tp",)
               for c in chosen.collectives)
    run = train_module(gpt2, chosen, steps=STEPS, batch_size=BATCH)
    reference = train_module_reference(gpt2, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(reference, rel=1e-4)
    assert run.differences == []


def test_a_tied_table_read_whole_and_split_trains_as_one_device(tmp_path: Path) -> None:
    """GPT-2's token table pinned whole on both ranks (the lookup) while the head it is
    tied to is pinned split over the vocabulary: the head's slices leave pending sums,
    which the plan makes at the weight, and the whole lookup's gradient, the same on both
    ranks, hands back half of itself there (the plan's share), so the sum counts it once."""
    gpt2 = "examples.hf_models:gpt2"
    path = export_builder(gpt2, BATCH, tmp_path / "gpt2.onnx")
    graph = load_graph(path, batch=BATCH)
    head = [op for op in graph.ops if op.op_type == "MatMul"][-1]
    lookups = [op for op in graph.ops if op.op_type == "Gather"
               and graph.tensors[op.inputs[0]].kind == "parameter"]
    pins = {head.name: ((1, 1, 1), (1, 2)), **{
        op.name: tuple((1,) * len(graph.tensors[t].shape) for t in op.inputs)
        for op in lookups}}
    chosen = plan(path, devices=2, batch=BATCH, profile="cpu", mode="semi", strategies=pins,
                  mesh=(2,))
    assert [b.share for op in chosen.ops for b in op.inputs if b and b.share != 1] == [0.5]
    run = train_module(gpt2, chosen, steps=STEPS, batch_size=BATCH)
    reference = train_module_reference(gpt2, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(reference, rel=1e-5)


def test_bert_zero2_micro_batches_and_recompute_train_as_one_device(tmp_path: Path) -> None:
    """BERT (dropout 0.1; token types from a buffer, which the plan keeps whole on both
    ranks and cuts to each rank's rows where they meet the batch, the gradient of that cut
    a pending sum the weight's all-reduce completes, as priced) under ZeRO 2 with 2
    micro-batches and full recompute."""
    bert = "examples.hf_models:bert"
    chosen = _pinned(export_builder(bert, BATCH, tmp_path / "bert.onnx"), zero=2,
                     micro_batches=2, recompute="full")
    run = train_module(bert, chosen, steps=STEPS, batch_size=BATCH)
    reference = train_module_reference(bert, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(reference, rel=1e-4)
    assert run.differences == []
    assert run.collectives["issued"]["reduce_scatter|dp|backward"] > 0  # per micro-batch
    assert run.recomputed > 0


def test_zero3_trains_and_its_checkpoint_resumes_under_another_plan(
        llama_onnx: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two AdamW steps under ZeRO 3 with 2 micro-batches and full recompute, saved with
    `--checkpoint`, then two more under the tensor-parallel plan (other layouts, no ZeRO)
    with `--resume`: the four losses are those of one process training four steps.

    Under ZeRO 3 each rank updates half of every weight and holds no whole weight between
    steps; every micro-batch gathers the weights for its forward and again for its
    backward pass and reduce-scatters the gradients, one call per bucket; the layers are
    recomputed in every backward pass."""
    zero3 = _pinned(llama_onnx, zero=3, micro_batches=2, recompute="full")
    segments = sum(len(s.recompute_segments) for s in zero3.pipeline.stages)
    assert segments >= 2
    sharded = zero3.save(tmp_path / "zero3.json")
    split = plan(llama_onnx, devices=2, batch=BATCH, profile="a100-80g", mode="semi",
                 strategies=_megatron_strategies(llama_onnx), mesh=(2,))
    tensor = split.save(tmp_path / "tp.json")
    saved, first, second = tmp_path / "ckpt", tmp_path / "first.json", tmp_path / "second.json"
    common = ["--module", LLAMA, "--nproc", "2", "--steps", "2", "--optimizer", "adamw",
              "--lr", "0.01"]
    assert main(["run", "--plan", str(sharded), *common, "--checkpoint", str(saved),
                 "--log-json", str(first)]) == 0
    assert (saved / ".metadata").exists()
    assert main(["run", "--plan", str(tensor), *common, "--resume", str(saved),
                 "--log-json", str(second)]) == 0
    assert capsys.readouterr().out.count("collectives: as planned") == 2
    written = json.loads(first.read_text())
    issued = written["collectives"]["issued"]
    assert {k for k in issued if "|dp|" in k} == {
        "all_gather|dp|forward", "all_gather|dp|backward", "reduce_scatter|dp|backward"}
    assert issued["all_gather|dp|forward"] % (2 * 2) == 0  # per micro-batch
    assert written["recomputed"] == segments * 2 * 2
    total = _elements(LLAMA)
    assert total / 2 <= written["parameter_elements"] <= total / 2 + 64
    assert written["resident_weight_elements"] == 0
    losses = written["losses"] + json.loads(second.read_text())["losses"]
    reference = train_module_reference(LLAMA, steps=4, batch_size=BATCH, optimizer="adamw",
                                       lr=0.01)
    assert losses == pytest.approx(reference, rel=1e-5)
    assert main(["run", "--plan", str(tensor), *common, "--resume",
                 str(tmp_path / "absent")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_an_export_plans_at_any_batch(tmp_path: Path) -> None:
    """The builder's export keeps the batch dim symbolic, so the plan binds the global
    batch it is asked for and keeps the module's parameter names."""
    path = export_builder(LLAMA, BATCH, tmp_path / "llama.onnx")
    chosen = plan(path, batch=2 * BATCH, devices=2, profile="cpu", mode="data",
                  parallel={"zero": 0})
    assert chosen.model.batch == 2 * BATCH
    names = {n for n, e in chosen.tensors.items() if e.kind == "parameter"}
    module, _, _ = load_builder(LLAMA)()
    assert names == {n for n, _ in module.named_parameters()}


def test_cli_plans_and_runs_a_module(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`plan --module` exports and plans the builder's module; `run --module` trains it on
    2 ranks under the data-parallel plan with the planned collectives (the gradient
    all-reduce one call per bucket per step), and `--nproc 1` as it is, to the same
    losses; the trace trains as the module itself does."""
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--module", LLAMA, "--batch", str(BATCH), "--devices", "2",
                 "--profile", "cpu", "--mode", "data", "--parallel", "zero=0",
                 "-o", str(plan_file)]) == 0
    log = tmp_path / "log.json"
    capsys.readouterr()
    assert main(["run", "--module", LLAMA, "--plan", str(plan_file), "--nproc", "2",
                 "--steps", "2", "--log-json", str(log)]) == 0
    assert "collectives: as planned" in capsys.readouterr().out
    written = json.loads(log.read_text())
    assert set(written) >= {"losses", "step_time_s", "predicted_step_time_s", "collectives"}
    assert set(written["collectives"]) == {"planned", "issued"}
    assert main(["run", "--module", LLAMA, "--plan", str(plan_file), "--nproc", "1",
                 "--steps", "2"]) == 0
    alone = [float(line.split()[3]) for line in capsys.readouterr().out.splitlines()
             if line.startswith("step ")]
    assert written["losses"] == pytest.approx(alone, rel=1e-4)
    chosen = Plan.load(plan_file)
    buckets = {c.bucket for c in chosen.collectives if c.phase == "gradient"}
    assert written["collectives"]["issued"]["all_reduce|dp|gradient"] == len(buckets) * 2
    eager = train_module_reference(LLAMA, steps=2, batch_size=BATCH, traced=False)
    assert alone == pytest.approx(eager, rel=1e-5)  # the trace is the module
    assert alone[-1] < alone[0]


def test_torchrun_trains_a_module(llama_onnx: Path, tmp_path: Path) -> None:
    """`torchrun -m executor --module`: the ranks torchrun starts train the module to the
    one-process losses, with the plan's collectives."""
    import subprocess
    import sys

    chosen = _pinned(llama_onnx, zero=1, micro_batches=2).save(tmp_path / "plan.json")
    log = tmp_path / "log.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "executor", "--module", LLAMA,
                "--plan", str(chosen), "--steps", "2", "--log-json", str(log)]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, rank_errors(done)
    assert "collectives: as planned" in done.stdout
    reference = train_module_reference(LLAMA, steps=2, batch_size=BATCH)
    assert json.loads(log.read_text())["losses"] == pytest.approx(reference, rel=1e-4)


def test_cli_module_mistakes_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--module", LLAMA, "--devices", "2"]) == 2
    assert "--module needs --batch N" in capsys.readouterr().err
    assert main(["plan", "model.onnx", "--module", LLAMA, "--batch", "4"]) == 2
    assert "not both" in capsys.readouterr().err
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--module", LLAMA, "--batch", str(BATCH), "--devices", "2",
                 "--profile", "cpu", "--mode", "data", "--parallel", "zero=0",
                 "-o", str(plan_file)]) == 0
    assert main(["run", "--module", "missing.py:llama", "--plan", str(plan_file),
                 "--nproc", "2"]) == 2
    assert "missing.py is not a file" in capsys.readouterr().err
    assert main(["run", "--module", LLAMA, "--plan", str(plan_file), "--nproc", "2",
                 "--data", "x"]) == 2
    assert "not with --module" in capsys.readouterr().err


def test_gpt2_pipeline_1f1b_zero3_with_a_tied_head_trains_as_one_device(
        tmp_path: Path) -> None:
    """GPT-2 in 2 stages × 2 data-parallel ranks (1F1B, 2 micro-batches, ZeRO 3, dropout
    0.1): each stage gathers its own weights where its chunks read them; the embedding,
    tied to the head, lives on both stages, its reduce-scattered chunks summed between
    them after the step; the activations cross as the plan's sends, and nothing else."""
    gpt2 = "examples.hf_models:gpt2"
    chosen = plan(export_builder(gpt2, BATCH, tmp_path / "gpt2.onnx"), devices=4,
                  batch=BATCH, profile="cpu",
                  parallel={"pp": 2, "dp": 2, "micro_batches": 2, "zero": 3,
                            "schedule": "1f1b"})
    assert chosen.pipeline is not None and len(chosen.pipeline.sends) >= 1
    run = train_module(gpt2, chosen, steps=STEPS, batch_size=BATCH)
    reference = train_module_reference(gpt2, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(reference, rel=1e-4)
    assert run.differences == []
    issued = run.collectives["issued"]
    assert issued["send_recv|pp|forward"] == issued["send_recv|pp|backward"] == \
        2 * STEPS * len(chosen.pipeline.sends)
    assert issued["all_reduce|pp|gradient"] == 2 * STEPS  # the tied weight, on each stage
    assert issued["reduce_scatter|dp|backward"] > 0 and issued["all_gather|dp|forward"] > 0


def test_interleaved_pipeline_with_recompute_trains_as_one_device(tmp_path: Path) -> None:
    """A 4-layer LLaMA in 2 stages × 2 model chunks (interleaved 1F1B) with full
    recompute: a stage hands the rotary tables it received on to its second chunk."""
    deep = "examples.hf_models:llama_deep"
    chosen = plan(export_builder(deep, BATCH, tmp_path / "deep.onnx"), devices=2,
                  batch=BATCH, profile="cpu",
                  parallel={"pp": 2, "vpp": 2, "micro_batches": 2, "zero": 0,
                            "recompute": "full"})
    assert chosen.pipeline is not None and chosen.pipeline.schedule == "interleaved"
    run = train_module(deep, chosen, steps=STEPS, batch_size=BATCH, optimizer="adamw",
                       lr=0.01)
    reference = train_module_reference(deep, steps=STEPS, batch_size=BATCH,
                                       optimizer="adamw", lr=0.01)
    assert run.losses == pytest.approx(reference, rel=1e-4)
    assert run.differences == [] and run.recomputed > 0


def test_a_module_is_exported_once_per_process_until_its_builder_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's export, the reference run and every rank read one saved trace; editing
    the builder's file exports it anew; a module over the size limit is not written."""
    from executor.module import launch

    source = tmp_path / "tiny_builder.py"
    text = ("import torch\n\ndef build():\n    torch.manual_seed(0)\n"
            "    model = torch.nn.Sequential(torch.nn.Linear(4, {width}), torch.nn.ReLU())\n"
            "    batch = lambda step, rows: {{'input': torch.randn(rows, 4)}}\n"
            "    return model, batch, lambda out, batch: out.sum()\n")
    source.write_text(text.format(width=3))
    spec = f"{source}:build"
    first = launch.shared_trace(spec, 2)
    assert first is not None and first.program.is_file() and first.model.is_file()
    assert launch.shared_trace(spec, 2) is first
    assert launch.shared_trace(spec, 3) is not first  # another example batch
    source.write_text(text.format(width=5) + "# edited\n")
    second = launch.shared_trace(spec, 2)
    assert second is not None and second is not first
    weights = [tuple(t.shape) for t in second.load().state_dict.values()]
    assert (5, 4) in weights
    monkeypatch.setattr(launch, "MAX_SHARED_TRACE_BYTES", 0)
    source.write_text(text.format(width=6) + "# over the limit\n")
    assert launch.shared_trace(spec, 2) is None


def test_a_kept_trace_serves_later_processes_until_the_module_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later process (this one with its memo cleared) reads the trace an earlier one
    kept instead of exporting; other weights, another batch shape or the cache turned
    off export anew."""
    from executor.module import cache, launch

    monkeypatch.setenv("SHARDPLAN_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "kept_builder.py"
    seed = tmp_path / "seed.txt"  # the weights change, the builder's file does not
    seed.write_text("0")
    source.write_text("import pathlib, torch\n\ndef build():\n"
                      f"    torch.manual_seed(int(pathlib.Path({str(seed)!r}).read_text()))\n"
                      "    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())\n"
                      "    batch = lambda step, rows: {'input': torch.randn(rows, 4)}\n"
                      "    return model, batch, lambda out, batch: out.sum()\n")
    spec = f"{source}:build"
    exports: list[int] = []
    real_export = launch.export_program

    def counted(*args: object, **kwargs: object) -> object:
        exports.append(1)
        return real_export(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(launch, "export_program", counted)
    monkeypatch.setattr(launch, "_exported", {})
    first = launch.shared_trace(spec, 2)
    assert first is not None and len(exports) == 1
    assert first.program.parent.parent == tmp_path / "cache" / "traces"
    monkeypatch.setattr(launch, "_exported", {})  # a later process
    again = launch.shared_trace(spec, 2)
    assert again == first and len(exports) == 1
    monkeypatch.setattr(launch, "_exported", {})
    launch.shared_trace(spec, 5)  # the example's shape is traced
    assert len(exports) == 2
    monkeypatch.setattr(launch, "_exported", {})
    seed.write_text("1")
    other = launch.shared_trace(spec, 2)
    assert other is not None and other != first and len(exports) == 3
    monkeypatch.setenv("SHARDPLAN_CACHE_DIR", "")
    monkeypatch.setattr(launch, "_exported", {})
    off = launch.shared_trace(spec, 2)
    assert off is not None and len(exports) == 4
    assert not off.program.is_relative_to(tmp_path / "cache")
    monkeypatch.setenv("SHARDPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "KEPT_TRACES", 1)
    monkeypatch.setattr(launch, "_exported", {})
    launch.shared_trace(spec, 3)

    def kept() -> int:
        return len([p for p in (tmp_path / "cache" / "traces").iterdir()
                    if not p.name.startswith(".")])
    assert kept() == 4  # each used within IN_USE_S: another run's ranks may read it
    monkeypatch.setattr(cache, "IN_USE_S", 0.0)
    monkeypatch.setattr(launch, "_exported", {})
    launch.shared_trace(spec, 4)
    assert kept() == 1


def _megatron_baseline(path: Path) -> Plan:
    """The Megatron baseline of an export on 2 ranks, priced on the `cpu` profile."""
    from costmodels.profile import load_profile
    from planner.cost.step import TrainingOptions
    from planner.plans.planning import plan_baseline

    return plan_baseline(load_graph(path, batch=BATCH), load_profile("cpu"), 2, "megatron",
                         TrainingOptions())


def _trains_as_one_process(spec: str, chosen: Plan, rel: float) -> None:
    """... and no move the plan does not make."""
    assert trains_as_one_process(spec, chosen, steps=STEPS, batch_size=BATCH,
                                 rel=rel).unplanned == {}


def test_megatron_baseline_with_a_vocabulary_split_embedding_trains_as_one_process(
        llama_onnx: Path) -> None:
    """Megatron's layout of the export (the projections by column and row, read through
    the exporter's transposes; the token embedding split by vocabulary): the embedding is
    looked up as Megatron does (`executor.module.embedding`: each rank its own rows, the
    result a pending sum the plan all-reduces, the table's gradient each rank's own rows)
    where DTensor's rule leaves a sum it cannot move to the plan's; one process's losses,
    the plan's collectives, no move the plan does not make."""
    chosen = _megatron_baseline(llama_onnx)
    table = next(e for n, e in chosen.tensors.items() if n.endswith("embed_tokens.weight"))
    assert table.layout.dims[0]  # split by vocabulary
    split = [n for n, e in chosen.tensors.items() if e.kind == "parameter" and
             n.endswith("proj.weight") and any(e.layout.dims)]
    assert len(split) == 14  # 7 projections in each of 2 layers
    _trains_as_one_process(LLAMA, chosen, rel=1e-4)


def test_gpt2_megatron_baseline_with_dropout_trains_as_one_process(tmp_path: Path) -> None:
    """GPT-2's Megatron baseline on 2 ranks: its row-split Conv1D GEMMs add their bias to a
    pending sum (the bias read as one, its gradient summed at the bias as the plan lists),
    and the residual adds cut replicated dropout outputs by the hidden dim (each rank's
    gradient block all-gathered in backward, as planned; left a pending sum it reached the
    layer below as if whole). One process's losses, exactly the plan's collectives."""
    spec = "examples.hf_models:gpt2"
    chosen = _megatron_baseline(export_builder(spec, BATCH, tmp_path / "gpt2.onnx"))
    biases = [c for c in chosen.collectives if c.tensor.endswith("mlp.c_proj.bias")]
    assert biases and all(tuple(c.axes) == ("tp",) for c in biases)  # summed at the bias
    assert any(c.kind == "all_gather" and c.phase == "backward" for c in chosen.collectives)
    _trains_as_one_process(spec, chosen, rel=1e-5)


def test_bert_megatron_baseline_trains_as_one_process(tmp_path: Path) -> None:
    """BERT's Megatron baseline on 2 ranks: its token table, split by vocabulary, is looked
    up with a padding index (its row keeps a zero gradient); the eager attention merges
    heads whose gradient arrives permuted (viewed back from a contiguous copy); the
    row-split projections add their bias after the planned all-reduce, as Megatron does
    (one traced `linear` owns the MatMul, the sum and the Add). One process's losses, the
    plan's collectives, no move the plan does not make."""
    spec = "examples.hf_models:bert"
    chosen = _megatron_baseline(export_builder(spec, BATCH, tmp_path / "bert.onnx"))
    # the token table (tied to the head, under the head's name) split by vocabulary
    table = chosen.tensors["model.cls.predictions.decoder.weight"]
    assert table.layout.dims[0]
    _trains_as_one_process(spec, chosen, rel=1e-5)


def test_bert_sequence_parallel_megatron_with_recompute_trains_as_one_process(
        tmp_path: Path) -> None:
    """Megatron's layout with its sequence parallelism and full recompute on BERT: the
    position and token-type ids, tensors the graph makes, are read split along the
    sequence (each rank cuts its block), and their whole tables' gradients are each
    rank's share, summed by the plan (DTensor's own lookup gathered them whole). One
    process's losses. (Its attention's collectives still differ from the plan's: the
    run reports them; docs/guide/executor.md.)"""
    spec = "examples.hf_models:bert"
    path = export_builder(spec, BATCH, tmp_path / "bert.onnx")
    chosen = plan(path, batch=BATCH, devices=2, profile="a100-80g",
                  parallel={"tp": 2, "pp": 1, "layout": "megatron", "sp": 1,
                            "recompute": "full", "micro_batches": 2})
    assert chosen.parallel.sp == 1
    run = train_module(spec, chosen, steps=STEPS, batch_size=BATCH)
    reference = train_module_reference(spec, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(reference, rel=1e-5)


def test_a_kept_trace_is_not_served_for_a_module_whose_settings_changed() -> None:
    """A forward that branches on a setting the builder read from a config file
    (`self.act`): the structure, source and weights are the same, the traced program is
    not, so the digest differs (a later run trained the old activation, exit 0)."""
    import torch
    from torch import nn

    from executor.module.cache import trace_digest

    class Act(nn.Module):
        def __init__(self, act: str) -> None:
            super().__init__()
            self.act = act
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x)) if self.act == "relu" else torch.tanh(self.fc(x))

    example = {"x": torch.ones(2, 4)}

    def digest(act: str) -> str:
        torch.manual_seed(0)
        return trace_digest(None, "m:build", Act(act), example)

    assert digest("relu") == digest("relu")
    assert digest("relu") != digest("tanh")


def test_a_plan_of_a_narrower_module_is_refused(tmp_path: Path) -> None:
    """The plan names the same parameters (fc.weight, fc.bias) at other shapes: refused
    naming the parameter, not run as planned."""
    from planner.errors import RunFailed

    builders = {}
    for width in (8, 16):
        source = tmp_path / f"width{width}.py"
        source.write_text(
            "import torch\n\ndef build():\n    torch.manual_seed(0)\n"
            f"    model = torch.nn.Sequential(torch.nn.Linear(4, {width}), torch.nn.ReLU(),"
            f" torch.nn.Linear({width}, 3))\n"
            "    batch = lambda step, rows: {'input': torch.randn(rows, 4)}\n"
            "    return model, batch, lambda out, batch: out.sum()\n")
        builders[width] = f"{source}:build"
    narrow = plan(export_builder(builders[8], BATCH, tmp_path / "narrow.onnx"), devices=2,
                  batch=BATCH, profile="cpu", mode="data")
    with pytest.raises(RunFailed, match=r"is \[16, 4\] in the module but \[8, 4\] in the plan"):
        train_module(builders[16], narrow, steps=1, batch_size=BATCH)


BUFFER_AND_NORM = """
import torch

def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(rows, 16, generator=g)}

class Scaled(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32))
        self.bn = torch.nn.BatchNorm1d(32) if norm else torch.nn.Identity()

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))) * self.scale)

def buffer():
    torch.manual_seed(0)
    return Scaled(False), batch, lambda out, b: out.square().mean()

def norm():
    torch.manual_seed(0)
    return Scaled(True), batch, lambda out, b: out.square().mean()
"""


def test_a_modules_buffer_is_state_and_a_training_norm_is_refused(tmp_path: Path) -> None:
    """A `register_buffer` table is exported as an initializer like a weight; the export
    names it (`shardplan.buffers`) so the plan neither trains nor syncs it (the run was
    refused: 'plan parameters the module does not have: scale'). Batch norm in training
    mode is refused by name (a rank failed on its in-place statistics)."""
    from planner.errors import RunFailed, ShardplanError

    source = tmp_path / "buffered.py"
    source.write_text(BUFFER_AND_NORM)
    spec = f"{source}:buffer"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "buffer.onnx"), devices=2,
                  batch=BATCH, profile="cpu", mode="data")
    assert chosen.tensors["scale"].kind == "buffer"
    run = train_module(spec, chosen, steps=STEPS, batch_size=BATCH)
    assert run.losses == pytest.approx(train_module_reference(spec, steps=STEPS,
                                                              batch_size=BATCH), rel=1e-5)
    spec = f"{source}:norm"
    chosen = plan(export_builder(spec, BATCH, tmp_path / "norm.onnx"), devices=2,
                  batch=BATCH, profile="cpu", mode="data")
    with pytest.raises(ShardplanError, match="module bn is a BatchNorm1d in training mode"
                       ) as refused:  # before any rank starts (it failed in the ranks, exit 4)
        train_module(spec, chosen, steps=1, batch_size=BATCH)
    assert not isinstance(refused.value, RunFailed)
    with pytest.raises(ShardplanError, match="module bn is a BatchNorm1d in training mode"):
        train_module_reference(spec, steps=1, batch_size=BATCH)


def test_plan_module_chooses_only_schedules_the_module_executor_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The 4-layer LLaMA at pp=2 plans the zero-bubble V fastest, which the run refused
    ("pipeline schedule zbv: the executor cannot run it yet"): `plan --module` plans for
    the module executor, so it chooses among the schedules that runs; a plan of the
    export for any runtime keeps every schedule."""
    deep = "examples.hf_models:llama_deep"
    pins = {"pp": 2, "micro_batches": 2}
    anywhere = plan(export_builder(deep, BATCH, tmp_path / "deep.onnx"), devices=2,
                    batch=BATCH, profile="cpu", parallel=pins)
    assert anywhere.pipeline is not None and anywhere.pipeline.schedule == "zbv"
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--module", deep, "--batch", str(BATCH), "--devices", "2",
                 "--profile", "cpu", "--parallel", "pp=2,micro_batches=2",
                 "-o", str(plan_file)]) == 0
    chosen = Plan.load(plan_file)
    assert chosen.pipeline is not None and chosen.pipeline.schedule in (
        "1f1b", "gpipe", "interleaved")
    capsys.readouterr()
    assert main(["run", "--module", deep, "--plan", str(plan_file), "--nproc", "2",
                 "--steps", "1"]) == 0
    assert "collectives: as planned" in capsys.readouterr().out


BOXED = '''
import torch
from torch import nn


class Box:  # what transformers' DynamicCache is to torch.export: no pytree
    def __init__(self, value):
        self.value = value


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), Box(x)


def build():
    return Net(), lambda step, rows: {"x": torch.randn(rows, 4)}, lambda out, b: out[0].sum()
'''


def test_an_export_failure_names_its_cause_in_one_line(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The exporter's message begins with paragraphs of next steps and names the cause in
    an "Exception summary" below them: the line shown was "Failed to export the model with
    torch.export. [96mThis is step 1/3[0m of exporting the model to ONNX. Next steps:"."""
    builder = tmp_path / "boxed.py"
    builder.write_text(BOXED)
    assert main(["plan", "--module", f"{builder}:build", "--batch", "4", "--devices", "2",
                 "--profile", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "\x1b" not in err and "Next steps" not in err
    assert "Box" in err and "in output, which is not a known type; return tensors" in err


SEQUENCE_FIRST = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)  # batch_first=False
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, ids):  # [seq, batch]
        return self.enc(self.emb(ids))


def batch(step, rows):
    return {"ids": torch.randint(0, 64, (8, rows))}


def build():
    return Net(), batch, lambda out, b: out.pow(2).mean()
'''


def test_a_sequence_first_batch_is_refused_when_planned(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """`[seq, batch]` ids were exported with the sequence as the batch, planned at that
    length, and the run failed in the ranks, exit 4 ("a batch of [8] rows: the plan is for
    a global batch of 4"): `plan --module` refuses it in one line, exit 2."""
    builder = tmp_path / "seqfirst.py"
    builder.write_text(SEQUENCE_FIRST)
    assert main(["plan", "--module", f"{builder}:build", "--batch", "4", "--devices", "2",
                 "--profile", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "gave ids of shape (8, 4): dim 0 of every tensor it returns must be the " \
           "batch's 4 rows" in err and "batch_first=True" in err
