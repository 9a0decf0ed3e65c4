"""Fidelity: does the cost model rank and price plans as the executor measures them?

1. Calibrate this machine (`shardplan calibrate --nproc 2`): a profile of its matmul and
   memory rates, its gloo collectives and the executor's host time per op run.
2. Plan one model for 2 ranks under several strategies with that profile: data parallel,
   tensor parallel, the automatic plan, a 2-stage pipeline (1F1B and GPipe), ZeRO-1, and
   full and selective recompute.
3. Run each plan with the executor (`executor.train.train`) and take the median step time
   after a warm-up step; `--rounds` times, every plan once per round, keeping each plan's
   fastest round. This shared 2-core host only ever slows a run down (another process,
   a busy moment), and two plans the model prices alike were measured up to 14 % apart
   in one pass: the rank correlation read that noise as the model's.
4. Print predicted and measured step time per plan, their ratio, the Spearman rank
   correlation of the two orders and the median relative error.

    python bench/fidelity.py [--steps 6] [--rounds 2] [--profile local.json]
                             [--layers 2 --hidden 256]
    python bench/fidelity.py --module [--steps 6] [--rounds 2] [--profile local.json]

`--module` measures the user-module path instead (`executor.parallelize` on a transformers
LLaMA of hidden 256, `examples.hf_models:llama_medium`, through `train_module`), under the
nine plans of it that path runs (no pipeline stages): data and tensor parallel, the
automatic plan at pp=1, ZeRO 1, 2 and 3, full and selective recompute, 4 micro-batches.

On a CPU the host runs every op itself: the calibration times the module executor's own
host work per op run (plain, or through DTensor) and per step (`planner.cli.host`), and
the plans are priced with it. The ONNX executor (without `--module`) runs its local
programs on plain tensors, never DTensor, so its tensor-parallel rows are priced above
what it pays there. The ratio column shows what is left unpriced, and the rank
correlation whether the order of plans survives it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx
from scipy.stats import spearmanr

from costmodels.calibrate import calibrate
from executor.train import train
from planner import zoo
from planner.api import plan
from planner.cli.host import calibrate_host
from planner.humanize import human_seconds

STRATEGIES: list[tuple[str, dict]] = [
    ("data parallel", {"mode": "data"}),
    ("tensor parallel", {"parallel": {"tp": 2}}),
    ("automatic", {}),
    ("pipeline 1F1B, 4 micro-batches", {"parallel": {"pp": 2, "micro_batches": 4,
                                                     "schedule": "1f1b"}}),
    ("pipeline GPipe, 2 micro-batches", {"parallel": {"pp": 2, "micro_batches": 2,
                                                      "schedule": "gpipe"}}),
    ("data parallel, ZeRO-1", {"parallel": {"dp": 2, "zero": 1, "micro_batches": 1}}),
    ("data parallel, full recompute", {"parallel": {"dp": 2, "recompute": "full",
                                                    "micro_batches": 1}}),
    ("tensor parallel, selective recompute", {"parallel": {"tp": 2, "recompute": "selective",
                                                           "micro_batches": 1}}),
    ("data parallel, 4 micro-batches", {"parallel": {"dp": 2, "micro_batches": 4}}),
]


MODULE = "examples.hf_models:llama_medium"
MODULE_STRATEGIES: list[tuple[str, dict]] = [
    ("data parallel", {"mode": "data", "parallel": {"zero": 0}}),
    ("tensor parallel (Megatron pins)", {"mode": "semi", "mesh": (2,)}),
    ("automatic, pp=1", {"parallel": {"pp": 1}}),
    ("data parallel, ZeRO-1", {"parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 1}}),
    ("data parallel, ZeRO-2", {"parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 2}}),
    ("data parallel, ZeRO-3", {"parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 3}}),
    ("data parallel, full recompute", {"parallel": {"dp": 2, "tp": 1, "pp": 1,
                                                    "recompute": "full"}}),
    ("data parallel, selective recompute", {"parallel": {"dp": 2, "tp": 1, "pp": 1,
                                                         "recompute": "selective"}}),
    ("data parallel, 4 micro-batches", {"parallel": {"dp": 2, "tp": 1, "pp": 1,
                                                     "micro_batches": 4}}),
]


def measure(model: Path, chosen, steps: int) -> float:
    log = train(model, chosen, steps=steps, optimizer="adamw", lr=0.001)
    return statistics.median(log.step_time_s[1:])


def measure_module(chosen, steps: int, batch: int) -> float:
    from executor.module.launch import train_module

    log = train_module(MODULE, chosen, steps=steps, optimizer="adamw", lr=0.001,
                       batch_size=batch, count_steps=1)  # the untimed first step
    return statistics.median(log.step_time_s[1:])


def module_rows(profile: Path, steps: int, batch: int, scratch: Path
                ) -> list[tuple[str, dict]]:
    """The module path's plans of `MODULE` (exported at `batch` into `scratch`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/
    from examples.hf_models import megatron_strategies
    from executor.module.launch import export_builder
    from planner.api import load_graph

    model = export_builder(MODULE, batch, scratch / "llama.onnx")
    pins = megatron_strategies(load_graph(model, batch=batch))
    print(f"model: {MODULE} (transformers LLaMA, 2 layers, hidden 256, vocab 2048); batch "
          f"{batch} × 64 tokens; 2 gloo ranks; median of {steps - 1} steps after one "
          "warm-up")
    plans = []
    for name, settings in MODULE_STRATEGIES:
        extra = {"strategies": pins} if settings.get("mode") == "semi" else {}
        plans.append((name, plan(model, profile=str(profile), devices=2, batch=batch,
                                 **settings, **extra)))
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2,
                        help="measure every plan this many times, keeping its fastest")
    parser.add_argument("--profile", help="a calibrated profile (default: calibrate now)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--module", action="store_true",
                        help="measure executor.parallelize on a transformers LLaMA")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        profile = Path(args.profile) if args.profile else scratch / "local.json"
        if not args.profile:
            calibrate(nproc=2, output=profile)
            calibrate_host(profile, 2)  # the executor's host time per op, as the CLI does
            print(f"calibrated this machine in {time.perf_counter() - started:.0f} s")
        if args.module:
            plans = module_rows(profile, args.steps, args.batch, scratch)
        else:
            model = scratch / "gpt.onnx"
            onnx.save(zoo.build("gpt", layers=args.layers, hidden=args.hidden, heads=8,
                                vocab=2048, max_positions=args.seq, with_weights=True),
                      model)
            print(f"model: zoo GPT, {args.layers} layers, hidden {args.hidden}, vocab "
                  f"2048; batch {args.batch} × {args.seq} tokens; 2 gloo ranks; median of "
                  f"{args.steps - 1} steps after one warm-up")
            plans = [(name, plan(model, profile=str(profile), devices=2, batch=args.batch,
                                 dims={"seq": args.seq}, **settings))
                     for name, settings in STRATEGIES]
        print(f"each plan measured in {max(1, args.rounds)} round(s), its fastest kept")
        rounds: list[list[float]] = [[] for _ in plans]
        for round_ in range(max(1, args.rounds)):
            for k, (name, chosen) in enumerate(plans):
                rounds[k].append(measure_module(chosen, args.steps, args.batch)
                                 if args.module else measure(model, chosen, args.steps))
                print(f"  round {round_ + 1}: measured {name}", flush=True)
        rows = []
        for (name, chosen), times in zip(plans, rounds, strict=True):
            par = chosen.parallel
            config = (f"dp={par.dp} tp={par.tp} pp={par.pp} mb={par.micro_batches} "
                      f"zero={par.zero} rc={par.recompute}")
            rows.append((name, config, chosen.predicted.step_time_s, min(times),
                         max(times) / min(times)))
    print()
    print(f"{'plan':<38}{'configuration':<44}{'predicted':>11}{'measured':>11}"
          f"{'meas/pred':>10}{'rounds':>8}")
    print("-" * 122)
    for name, config, predicted, measured, spread in rows:
        print(f"{name:<38}{config:<44}{human_seconds(predicted):>11}"
              f"{human_seconds(measured):>11}{measured / predicted:>10.2f}{spread:>8.2f}")
    print("(rounds: the slowest round's median over the fastest's)")
    predicted = [r[2] for r in rows]
    measured = [r[3] for r in rows]
    rho = spearmanr(predicted, measured).statistic
    errors = [abs(m - p) / m for p, m in zip(predicted, measured, strict=True)]
    ratios = [m / p for p, m in zip(predicted, measured, strict=True)]
    print()
    print(f"Spearman rank correlation (predicted vs measured order): {rho:.2f}")
    print(f"median relative error |measured − predicted| / measured: "
          f"{100 * statistics.median(errors):.0f} %")
    print(f"measured/predicted: median {statistics.median(ratios):.2f}, "
          f"range {min(ratios):.2f}–{max(ratios):.2f}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
