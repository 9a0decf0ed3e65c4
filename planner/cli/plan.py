"""`shardplan plan`: search a strategy for an ONNX model (or the bundled demo) and report it."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

from planner.cli.args import (
    Verbs,
    check_output,
    dim,
    mesh,
    parallel,
    positive_int,
    positive_number,
    unique_dims,
)
from planner.errors import NoPlanFits, ShardplanError
from planner.kinds import (
    AttentionKernel,
    Fusion,
    GradAccumulation,
    LossReads,
    Precision,
    Runnable,
)

DEMO_PRESET = "gpt2-small"
DEMO_DIMS = {"seq": 1024}
DEMO_BATCH = 32


def add_parser(verbs: Verbs) -> None:
    plan = verbs.add_parser("plan", help="plan a training step of an ONNX model")
    plan.add_argument("model", nargs="?", help="the .onnx file (default: a bundled GPT-2 demo)")
    plan.add_argument("--module", metavar="FILE.py:FN",
                      help="plan a torch module instead: FN() returns (module, make_batch, "
                           "loss_fn); it is exported with torch's default exporter at the "
                           "global batch --batch (needs torch)")
    plan.add_argument("--profile",
                      help="hardware profile name or JSON file (see `shardplan profiles`; "
                           "default a100-80g)")
    plan.add_argument("--devices", type=positive_int, help="number of devices (default 8)")
    plan.add_argument("--cluster", metavar="FILE",
                      help="a mixed cluster instead of --profile and --devices: groups of "
                           "devices of different kinds and the link between them "
                           "(docs/hardware-profiles.md \"Mixed clusters\")")
    plan.add_argument("--batch", type=positive_int,
                      help="global batch size: binds the dim whose symbol names the batch "
                           "(one holding 'batch', wherever it stands), else dim 0")
    plan.add_argument("--dim", type=dim, action="append", default=[], metavar="NAME=N",
                      help="bind a symbolic input dim, e.g. --dim seq=2048 (repeatable)")
    plan.add_argument("--capacity-factor", type=positive_number("--capacity-factor"),
                      metavar="F",
                      help="tokens each expert of a mixture-of-experts router may take, as a "
                           "multiple of its even share (default 1.25)")
    plan.add_argument("--mode", default="auto", choices=["data", "semi", "auto"],
                      help="data: data-parallel baseline; semi: ops in --strategies keep their "
                           "strategies, the rest is searched; auto: everything searched")
    plan.add_argument("--strategies", metavar="FILE",
                      help="JSON (or YAML) mapping op names or glob patterns to MindSpore-style "
                           "strategy tuples, e.g. {\"fc1\": [[1, 1], [1, 2]]}")
    plan.add_argument("--solver", default="auto",
                      choices=["auto", "cpsat", "highs", "dp", "propagation"],
                      help="auto: elimination DP when exact, else CP-SAT; cpsat/highs: exact ILP; "
                           "dp: graph elimination; propagation: heuristic")
    plan.add_argument("--time-limit", type=positive_number("--time-limit"), default=60.0,
                      metavar="SECONDS",
                      help="per mesh shape; the best plan found so far is returned with its gap")
    plan.add_argument("--parallel", type=parallel, default={}, metavar="dp=4,tp=8",
                      help="pin global choices and search the rest: dp, tp, pp, "
                           "micro_batches, zero (0-3), recompute (none|selective|full), "
                           "schedule (1f1b|gpipe|interleaved), vpp (interleaved model "
                           "chunks per device, >= 2), cp (context parallelism: the "
                           "sequence split), cp_kind (ring|ulysses), ep (expert "
                           "parallelism: the stacked experts split, tokens moved by "
                           "all-to-all), dp_shares (even|speed: how a mixed cluster's "
                           "data-parallel replicas share the batch)")
    plan.add_argument("--mesh", type=mesh, metavar="AxB", help="pin the mesh shape, e.g. 2x4")
    plan.add_argument("--max-mesh-axes", type=int, choices=[1, 2, 3],
                      help="largest number of mesh axes searched (default 2)")
    plan.add_argument("--no-tie-layers", action="store_true",
                      help="let every repeated layer choose on its own (slower, rarely better)")
    plan.add_argument("--optimizer", choices=["adam", "adamw", "momentum", "sgd"],
                      help="the optimizer whose states and step the plan prices (default adam)")
    plan.add_argument("--memory-limit", type=positive_number("--memory-limit"), metavar="GIB",
                      help="device memory limit in GiB (default: the profile's capacity)")
    plan.add_argument("--inference", action="store_true",
                      help="plan a forward pass only (no gradients, optimizer, saved activations)")
    plan.add_argument("--overlap", type=float, default=0.0, metavar="SHARE",
                      help="least share (0..1) of the end-of-step gradient synchronisation "
                           "hidden behind backward (the schedule may hide more)")
    plan.add_argument("--precision", choices=[p.value for p in Precision],
                      help="training precision (default: the graph's dtype; a 16-bit graph "
                           "trains -mixed, with fp32 master weights and main gradients)")
    plan.add_argument("--attention", choices=[a.value for a in AttentionKernel],
                      help="attention cores as one flash kernel or one kernel per op "
                           "(default: the profile's)")
    plan.add_argument("--fusion", choices=[f.value for f in Fusion],
                      help="elementwise chains as one kernel, as Megatron-LM's kernels (a "
                           "norm a kernel of its own) or one per op (default: the profile's)")
    plan.add_argument("--grad-accumulation", choices=[g.value for g in GradAccumulation],
                      help="each micro-batch's weight gradients accumulated inside the "
                           "weight-gradient GEMMs or by kernels of their own (default: "
                           "fused where kernels are fused, else separate)")
    plan.add_argument("--loss-reads", choices=[r.value for r in LossReads], default="rows",
                      help="how the loss outside the graph reads its outputs: whole rows "
                           "(default; each output gathered along every dim but its rows, "
                           "priced with the forward pass) or as the plan leaves them (a "
                           "vocabulary-parallel cross-entropy: nothing priced)")
    plan.add_argument("--bucket-mb", type=bucket_mb, metavar="MIB",
                      help="bucket size gradient reductions and ZeRO gathers are issued in "
                           "(default 25, PyTorch DDP's bucket_cap_mb; DeepSpeed's 5e8 "
                           "elements are 954 in bf16; 0: one collective per tensor)")
    plan.add_argument("--no-overlap-grad-reduce", action="store_true",
                      help="reduce gradients after the backward pass, as Megatron-LM does "
                           "without --overlap-grad-reduce (default: behind it, as torch "
                           "DDP and FSDP do)")
    plan.add_argument("-o", "--output", help="write the strategy JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON, not a summary")


def run(args: argparse.Namespace) -> int:
    """Print the plan (summary or JSON); exit 3 through NoPlanFits when it does not fit.
    The cyclic collector stays paused from the search to the last line written
    (`collector_paused`): resumed in between, its first pass would walk every object of
    the plan just built; run by the console script, it stays paused until the process
    ends (`planner.cli.ending`)."""
    from planner.api import collector_paused
    from planner.cli.ending import pause_collector_until_exit

    if pause_collector_until_exit():  # the console script: the process ends with the verb
        return _run(args)
    with collector_paused():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from planner.api import plan
    from planner.cli.ending import keep
    from planner.cli.progress import Progress
    from planner.cli.strategies import load_strategies
    from planner.report import memory_shortfall, summary

    dims = unique_dims(args.dim)
    check_output(args.output, "-o", [args.model, args.strategies, args.cluster])
    if args.cluster and (args.profile or args.devices):
        raise ShardplanError(f"--cluster {args.cluster} names the devices: give it without "
                             "--profile and --devices")
    if args.mesh is not None and args.max_mesh_axes is not None \
            and len(args.mesh) > args.max_mesh_axes:
        raise ShardplanError(f"--mesh {'x'.join(map(str, args.mesh))} has {len(args.mesh)} "
                             f"axes, more than --max-mesh-axes {args.max_mesh_axes}: give one "
                             "of them")
    if args.inference and args.optimizer is not None:
        raise ShardplanError(f"--optimizer {args.optimizer} with --inference: a forward pass "
                             "runs no optimizer; drop one of them")
    # Not given: the API's default (planner.cost.buckets.DEFAULT_BUCKET_MB).
    buckets = {"bucket_mb": args.bucket_mb} if args.bucket_mb is not None else {}
    with tempfile.TemporaryDirectory(prefix="shardplan-demo-") as scratch:
        model = args.model
        batch = args.batch
        if args.module:
            model = _export_module(args.module, args.model, batch, Path(scratch))
        elif model is None:
            model = _write_demo_model(Path(scratch))
            dims = {**DEMO_DIMS, **dims}
            batch = batch or DEMO_BATCH
            print(f"(no model given: planning the bundled {DEMO_PRESET} at batch {batch}, "
                  f"seq {dims['seq']})", file=sys.stderr)
        strategies = load_strategies(args.strategies) if args.strategies else None
        progress = Progress(sys.stderr) if not args.json else None
        try:
            result = plan(model, profile=args.profile or "a100-80g",
                          devices=args.devices or 8, cluster=args.cluster, batch=batch,
                          dims=dims, mode=args.mode, strategies=strategies, solver=args.solver,
                          time_limit=args.time_limit, parallel=args.parallel, mesh=args.mesh,
                          max_mesh_axes=args.max_mesh_axes or 2,
                          tie_layers=not args.no_tie_layers,
                          optimizer=args.optimizer or "adam", memory_limit_gib=args.memory_limit,
                          inference=args.inference, overlap=args.overlap,
                          precision=args.precision, attention=args.attention,
                          fusion=args.fusion, grad_accumulation=args.grad_accumulation,
                          progress=progress,
                          capacity_factor=args.capacity_factor,
                          overlap_grad_reduce=not args.no_overlap_grad_reduce,
                          loss_reads=args.loss_reads,
                          runnable=_module_executor_runs(args), **buckets)
        finally:
            if progress is not None:
                progress.close()
    keep(result)  # freed with the process (`planner.cli.ending`)
    if args.output:
        result.save(args.output)
    print(result.dumps() if args.json else summary(result))
    if not result.predicted.fits:
        raise NoPlanFits(memory_shortfall(result))
    return 0


def bucket_mb(text: str) -> float:
    """`--bucket-mb 25`: a bucket size in MiB, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MiB") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text}: a bucket size in MiB, 0 or more "
                                         "(0: one collective per tensor)")
    return value


def _module_executor_runs(args: argparse.Namespace) -> Runnable | None:
    """What a plan for the module executor (`--module`) may choose: what it runs (the
    search picked the zero-bubble V for a 4-layer LLaMA at pp=2, which the run then
    refused); a pin stays the user's. None: a plan of a model file, for any runtime."""
    if not args.module:
        return None
    from executor.support import MODULE_RUNNABLE
    return MODULE_RUNNABLE


def _export_module(spec: str, model: str | None, batch: int | None, folder: Path) -> Path:
    """The builder's module exported for planning (`executor.module.launch`)."""
    if model is not None:
        raise ShardplanError(f"give a model file or --module, not both ({model}, {spec})")
    if batch is None:
        raise ShardplanError("--module needs --batch N: the global batch it is exported "
                             "and planned at")
    try:
        from executor.module.launch import export_builder
    except ImportError:
        raise ShardplanError("--module needs torch: pip install 'shardplan[executor]'"
                             ) from None
    return export_builder(spec, batch, folder / "module.onnx")


def _write_demo_model(folder: Path) -> Path:
    from planner import zoo

    family, config = zoo.preset(DEMO_PRESET)
    return zoo.save(zoo.build(family, config), folder / f"{DEMO_PRESET}.onnx")
