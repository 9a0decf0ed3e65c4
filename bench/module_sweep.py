"""The module executor against one process, over many plans of the example models.

For each model of `examples/hf_models.py` and each plan kind below, plans the model's
export, trains it with `train_module` on 2 or 4 gloo ranks and prints whether the losses
equal those of the module trained unsplit (`train_module_reference`, its trace on one
process, dropout drawn alike), whether the ranks issued exactly the plan's collectives,
and which moves the plan does not make (`unplanned`). A sweep, not a timing: it is how
the wrong gradients of GPT-2's and the crashes of BERT's Megatron runs were found.

    python bench/module_sweep.py                                  # every model, every kind
    python bench/module_sweep.py --models gpt2 bert --kinds megatron2 z3_tp2

Each row takes about 4 s on this 2-core machine (33 rows: 2 min 12 s).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels.profile import load_profile  # noqa: E402
from executor.module.launch import export_builder, train_module, train_module_reference  # noqa: E402
from planner.api import load_graph, plan  # noqa: E402
from planner.cost.step import TrainingOptions  # noqa: E402
from planner.errors import ShardplanError  # noqa: E402
from planner.plans.model import Plan  # noqa: E402
from planner.plans.planning import plan_baseline  # noqa: E402

BATCH = 8
STEPS = 3
MODELS = ("gpt2", "llama", "bert")


def _megatron(devices: int, profile: str) -> Callable[[Path], Plan]:
    return lambda path: plan_baseline(load_graph(path, batch=BATCH), load_profile(profile),
                                      devices, "megatron", TrainingOptions())


def _pinned(devices: int, **parallel: int | str) -> Callable[[Path], Plan]:
    return lambda path: plan(path, batch=BATCH, devices=devices, profile="a100-80g",
                             parallel=parallel or None)


KINDS: dict[str, Callable[[Path], Plan]] = {
    "megatron2": _megatron(2, "cpu"),
    "megatron4": _megatron(4, "a100-80g"),
    "auto2": _pinned(2),
    "auto4": _pinned(4),
    "tp2": _pinned(2, tp=2, pp=1),
    "tp2dp2": _pinned(4, tp=2, dp=2, pp=1),
    "z3_tp2": _pinned(4, tp=2, dp=2, zero=3, pp=1),
    "tp4_mb_selective": _pinned(4, tp=4, pp=1, micro_batches=2, recompute="selective"),
    "megatron_full_recompute": _pinned(2, tp=2, pp=1, layout="megatron", recompute="full",
                                       micro_batches=2),
    "pp2_1f1b": _pinned(2, pp=2, micro_batches=2, schedule="1f1b"),
    "pp2tp2_1f1b": _pinned(4, pp=2, tp=2, micro_batches=2, schedule="1f1b"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            spec = f"examples.hf_models:{model}"
            path = export_builder(spec, BATCH, Path(scratch) / f"{model}.onnx")
            reference = train_module_reference(spec, steps=STEPS, batch_size=BATCH)
            for kind in args.kinds:
                try:
                    chosen = KINDS[kind](path)
                    run = train_module(spec, chosen, steps=STEPS, batch_size=BATCH)
                except ShardplanError as exc:
                    print(f"{model:6s} {kind:24s} refused: {str(exc)[:200]}", flush=True)
                    continue
                par = chosen.parallel
                equal = all(abs(a - b) <= 1e-5 * abs(b)
                            for a, b in zip(run.losses, reference, strict=True))
                print(f"{model:6s} {kind:24s} dp={par.dp} tp={par.tp} pp={par.pp} "
                      f"sp={par.sp} zero={par.zero} "
                      f"losses {'equal' if equal else f'DIFFER {run.losses} vs {reference}'}; "
                      f"collectives {'as planned' if not run.differences else run.differences}"
                      f"{'' if not run.unplanned else f'; unplanned {dict(run.unplanned)}'}",
                      flush=True)


if __name__ == "__main__":
    main()
