"""`shardplan run`: train a few steps with a plan on local gloo ranks (torch, imported late)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from executor.timeouts import DEFAULT_TIMEOUT_S, MOST_TIMEOUT_S
from planner.cli.args import Verbs, check_output, positive_int, positive_number, seed
from planner.errors import ShardplanError
from planner.humanize import first_listed, human_bytes

if TYPE_CHECKING:
    from executor.train import RunLog
    from planner.plans.model import Plan


def add_parser(verbs: Verbs) -> None:
    run = verbs.add_parser("run", help="train with a plan on local ranks (needs torch)")
    run.add_argument("model", nargs="?", help="the .onnx file the plan was made for")
    run.add_argument("--module", metavar="FILE.py:FN",
                     help="train a torch module instead (the one `shardplan plan --module` "
                          "planned): FN() returns (module, make_batch, loss_fn)")
    run.add_argument("--plan", required=True, help="a strategy JSON from `shardplan plan -o`")
    run.add_argument("--nproc", type=positive_int, required=True,
                     help="ranks: the plan's device count, or 1 for the unsplit reference")
    run.add_argument("--steps", type=positive_int, default=5)
    run.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    run.add_argument("--seed", type=seed, default=0)
    run.add_argument("--lr", type=positive_number("--lr", most=1e3), default=0.1)
    run.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    run.add_argument("--log-json", metavar="FILE", help="write losses, times and collectives")
    run.add_argument("--checkpoint", metavar="DIR", default="",
                     help="save the sharded weights and optimizer state here at the end")
    run.add_argument("--checkpoint-every", metavar="N", type=positive_int, default=None,
                     help="also save the checkpoint every N steps (atomically): a run killed "
                          "midway resumes from the last one with --resume")
    run.add_argument("--resume", metavar="DIR", default="",
                     help="start from a checkpoint saved by the same plan (with --module: "
                          "by any plan of the module, on any device count)")
    run.add_argument("--loss", default="auto", choices=["auto", "graph", "ce", "mse"],
                     help="auto: the model's own scalar loss output if it has one, else "
                          "cross-entropy on the first output")
    run.add_argument("--timeout", metavar="SECONDS", default=DEFAULT_TIMEOUT_S,
                     type=positive_number("--timeout", most=MOST_TIMEOUT_S),
                     help="a rank that dies or stops answering ends the run within this "
                          f"long, every rank stopped (default {DEFAULT_TIMEOUT_S:g})")
    run.add_argument("--count-steps", metavar="N", type=positive_int, default=None,
                     help="with --module: count the collectives of the first N steps only "
                          "(default: every step). Counting sees every op, a few microseconds "
                          "of host time each; later steps then run at full speed")
    run.add_argument("--data", metavar="DIR", default="",
                     help="<input>.npy arrays (and targets.npy) of the global batch; each "
                          "data-parallel rank reads its shard (default: synthetic)")


def _refuse_log_inside(log_json: str | None, folders: list[tuple[str, str | None]]) -> None:
    """`--log-json` may not land in the run's data folder (its files are the run's inputs:
    `targets.npy` would be overwritten) or in, or on, a checkpoint folder (the save
    replaces it, and the log is lost)."""
    if not log_json:
        return
    target = Path(log_json).resolve()
    for flag, folder in folders:
        if not folder:
            continue
        base = Path(folder).resolve()
        for place in (base, base.with_name(base.name + ".partial")):
            if target == place or place in target.parents:
                raise ShardplanError(f"--log-json {log_json}: inside {flag} {folder}, whose "
                                     "files the run reads or replaces; write the log "
                                     "elsewhere")


def run(args: argparse.Namespace) -> int:
    """Check the request before any rank starts, train, then print losses and collectives."""
    from planner.plans.model import Plan

    check_output(args.log_json, "--log-json", [args.model, args.plan, args.module and
                                               args.module.rpartition(":")[0]])
    _refuse_log_inside(args.log_json, [("--data", args.data),
                                       ("--checkpoint", args.checkpoint),
                                       ("--resume", args.resume)])
    loaded = Plan.load(args.plan)
    if args.checkpoint_every and not args.checkpoint:
        raise ShardplanError("--checkpoint-every needs --checkpoint DIR: where to save")
    runs_plan = args.nproc > 1 or bool(args.module and loaded.cluster.devices == 1)
    if not runs_plan and (args.checkpoint or args.resume):
        raise ShardplanError("--checkpoint/--resume apply to runs of the plan (--nproc > 1)")
    if not args.module:
        _check_graph_run(args, loaded)
    _need_torch()
    if args.module:
        return _run_module(args, loaded)
    from executor.train import planned_counts, train, train_reference

    if args.nproc > 1:
        log = train(args.model, loaded, steps=args.steps, lr=args.lr, seed=args.seed,
                    optimizer=args.optimizer, resume=args.resume, checkpoint=args.checkpoint,
                    loss=args.loss, data=args.data, checkpoint_every=args.checkpoint_every or 0,
                    timeout_s=args.timeout)
    else:
        log = train_reference(args.model, loaded, steps=args.steps, lr=args.lr,
                              seed=args.seed, optimizer=args.optimizer, loss=args.loss,
                              data=args.data,
                              predicted_step_time_s=_one_device_step(args.model, loaded))
    issued = {k: v for k, v in log.collectives.get("issued", {}).items()
              if not k.endswith("|loss")}
    planned = planned_counts(loaded, args.steps) if args.nproc > 1 else {}
    log.collectives = {"planned": planned, "issued": issued}
    _report(log, loaded, args.log_json, compared=args.nproc > 1)
    return 0


def _check_graph_run(args: argparse.Namespace, loaded: Plan) -> None:
    """What an ONNX-graph run is refused for that needs neither torch nor the model: a
    fraction of a second rather than the seconds torch takes to import."""
    if args.model is None:
        raise ShardplanError("give the .onnx file the plan was made for, or --module "
                             "FILE.py:FN")
    if args.backend == "nccl":
        raise ShardplanError("--backend nccl: the ONNX-graph runner runs gloo ranks on CPU "
                             "only; train a torch module with --module")
    if args.count_steps is not None:
        raise ShardplanError("--count-steps: with --module only (the ONNX-graph runner "
                             "issues every collective itself and counts them at no cost)")
    if args.nproc not in (1, loaded.cluster.devices):
        raise ShardplanError(f"--nproc {args.nproc}: the plan is for {loaded.cluster.devices} "
                             "devices; use that many ranks, or 1 for the unsplit reference")


def _need_torch() -> None:
    """torch is installed (found, not imported), or the one-line answer of how to get it."""
    if importlib.util.find_spec("torch") is None:
        raise ShardplanError("shardplan run needs torch: pip install 'shardplan[executor]'")


def _report(log: RunLog, loaded: Plan, log_json: str | None, compared: bool) -> None:
    """Each step's loss and time, the predicted step, whether the collectives were the
    plan's (`compared`: a split run), and the log file."""
    if log.weights:
        print(log.weights, file=sys.stderr)
    for step, (loss, seconds) in enumerate(zip(log.losses, log.step_time_s, strict=True)):
        print(f"step {step + 1}: loss {loss:.6f}  {seconds * 1e3:.1f} ms")
    cluster = loaded.cluster
    print(f"predicted step time {log.predicted_step_time_s * 1e3:.3f} ms on "
          f"{cluster.describe() if cluster.groups else cluster.profile}")
    if log.peak_memory_bytes:  # measured on GPUs only
        print(f"peak memory {human_bytes(log.peak_memory_bytes)} allocated on rank 0; "
              f"predicted {human_bytes(loaded.predicted.memory.peak)} per device")
    if compared:
        print(log.verdict)
    if log_json:
        Path(log_json).write_text(json.dumps(log.to_json(), indent=1) + "\n")


def _run_module(args: argparse.Namespace, loaded: Plan) -> int:
    """`run --module`: the user's module parallelized on local ranks (executor.module)."""
    from executor.module.launch import Checkpoints, train_module, train_module_reference

    if args.model is not None:
        raise ShardplanError(f"give a model file or --module, not both ({args.model}, "
                             f"{args.module})")
    unsupported = ["--data"] if args.data else []
    if args.loss != "auto":
        unsupported.append("--loss")
    if unsupported:
        raise ShardplanError(f"{', '.join(unsupported)}: not with --module (the builder's "
                             "make_batch and loss_fn give the data and the loss)")
    if args.nproc not in (1, loaded.cluster.devices):
        raise ShardplanError(f"--nproc {args.nproc}: the plan is for {loaded.cluster.devices} "
                             "devices; use that many ranks, or 1 for the module as it is")
    if args.nproc == 1 and loaded.cluster.devices > 1:  # the module as it is, for comparison
        batch = loaded.global_batch
        if batch is None:
            raise ShardplanError(f"{args.plan} names no global batch")
        losses = train_module_reference(args.module, steps=args.steps, lr=args.lr,
                                        batch_size=batch, optimizer=args.optimizer)
        for step, loss in enumerate(losses):
            print(f"step {step + 1}: loss {loss:.6f}")
        if args.log_json:
            Path(args.log_json).write_text(json.dumps({"losses": losses}, indent=1) + "\n")
        return 0
    if args.resume:
        _say_unfrozen(args.resume, loaded)
    log = train_module(args.module, loaded, steps=args.steps, lr=args.lr,
                       backend=args.backend, optimizer=args.optimizer,
                       checkpoints=Checkpoints(args.resume, args.checkpoint,
                                               args.checkpoint_every or 0), timeout_s=args.timeout,
                       count_steps=args.count_steps)
    _report(log, loaded, args.log_json, compared=True)
    return 0


def _say_unfrozen(resume: str, plan: Plan) -> None:
    """Name the weights the checkpoint kept frozen that the plan trains: resumed, their
    optimizer state starts fresh (`executor.module.state.newly_trained`)."""
    from executor.checkpoint import saved_keys
    from executor.module.state import newly_trained

    trained = {n for n, e in plan.tensors.items() if e.kind == "parameter"}
    unfrozen = sorted(newly_trained(saved_keys(resume)) & trained)
    if unfrozen:
        shown = first_listed(unfrozen, 4)
        print(f"{resume}: {shown} frozen when saved, trained now: their optimizer state "
              "starts fresh", file=sys.stderr)


def _one_device_step(model: str, plan: Plan) -> float:
    """The predicted step of the unsplit model on one device of the plan's hardware (the
    `cpu` profile when that one is not bundled), at the step's whole batch."""
    from executor.train import graph_for, whole_batch_graph
    from planner.api import plan as make_plan

    graph = whole_batch_graph(plan, graph_for(model, plan))
    try:
        return make_plan(graph, devices=1, mode="data",
                         profile=plan.cluster.profile).predicted.step_time_s
    except ShardplanError:
        return make_plan(graph, devices=1, mode="data", profile="cpu").predicted.step_time_s
