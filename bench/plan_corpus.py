"""Plan a fixed corpus of models and write every plan file, to compare two versions.

A refactor that must not change behaviour is checked by planning the same corpus with the
old and the new code and comparing the files (`bench/plan_diff.py`). The corpus covers
the zoo presets, the seed tutorial's network, and GPT-2, BERT and LLaMA exported with both
torch exporters; op-level plans (auto, semi, data, pinned meshes, inference, overlap, every
solver) and pipeline plans (1F1B, GPipe, interleaved, ZeRO 0-3, recompute).

    python bench/plan_corpus.py --out /tmp/new                   # this checkout
    python bench/plan_corpus.py --tree ../old --out /tmp/old     # another checkout
    python bench/plan_diff.py /tmp/old /tmp/new

Models are built once into --models (zoo graphs with this checkout's `shardplan zoo`,
exports with tests/exported_models.py) and shared by both runs, so both plan the same
bytes. The code that plans is the tree given with --tree (imported first on sys.path).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

#: (name, model file, CLI arguments after the model)
ZOO_MODELS = {
    "seed": ["seed"],
    "gpt-tiny": ["gpt-tiny"],
    "gpt2-small": ["gpt2-small"],
    "gpt3-1.3b": ["gpt3-1.3b", "--dtype", "bfloat16"],
    "gpt3-13b": ["gpt3-13b", "--dtype", "bfloat16"],
    "gpt3-175b": ["gpt3-175b", "--dtype", "bfloat16"],
    "bert-tiny": ["bert-tiny"],
    "bert-base": ["bert-base"],
    "llama-tiny": ["llama-tiny"],
    "llama-7b": ["llama-7b", "--dtype", "bfloat16"],
    "resnet-tiny": ["resnet-tiny"],
    "resnet50": ["resnet50"],
    "moe-tiny": ["moe-tiny"],
    "moe-small": ["moe-small"],
}

EXPORTS = [(model, exporter, training) for model in ("gpt2", "bert", "llama")
           for exporter in ("torchscript", "dynamo") for training in (False, True)]

CASES: list[tuple[str, str, list[str]]] = [
    # The seed tutorial's network.
    ("seed-auto-2", "seed", ["--devices", "2", "--batch", "32"]),
    ("seed-auto-8", "seed", ["--devices", "8", "--batch", "64"]),
    ("seed-auto-64", "seed", ["--devices", "64", "--batch", "32"]),
    ("seed-data-8", "seed", ["--devices", "8", "--batch", "64", "--mode", "data"]),
    ("seed-semi-2", "seed", ["--devices", "2", "--batch", "32", "--mode", "semi",
                             "--strategies", "@seed-strategies"]),
    ("seed-inference-8", "seed", ["--devices", "8", "--batch", "64", "--inference"]),
    ("seed-highs-8", "seed", ["--devices", "8", "--batch", "64", "--solver", "highs"]),
    ("seed-cpsat-8", "seed", ["--devices", "8", "--batch", "64", "--solver", "cpsat"]),
    ("seed-propagation-8", "seed", ["--devices", "8", "--batch", "64",
                                    "--solver", "propagation"]),
    ("seed-mesh-2x4", "seed", ["--devices", "8", "--batch", "64", "--mesh", "2x4"]),
    ("seed-axes3-8", "seed", ["--devices", "8", "--batch", "64", "--max-mesh-axes", "3"]),
    ("seed-910a-8", "seed", ["--devices", "8", "--batch", "64", "--profile", "ascend-910a"]),
    # Small zoo graphs, op-level and pinned.
    ("gpt-tiny-auto-4", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16"]),
    ("gpt-tiny-dp2tp2", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                     "--parallel", "dp=2,tp=2"]),
    ("gpt-tiny-notie", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                    "--no-tie-layers"]),
    ("gpt-tiny-overlap", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                      "--overlap", "0.5"]),
    ("gpt-tiny-sgd", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                  "--optimizer", "sgd"]),
    ("gpt-tiny-pp2", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                  "--parallel", "pp=2,micro_batches=4"]),
    ("gpt-tiny-gpipe", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                    "--parallel", "pp=2,micro_batches=4,schedule=gpipe"]),
    ("gpt-tiny-interleaved", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                          "--parallel", "pp=2,micro_batches=4,"
                                          "schedule=interleaved"]),
    ("gpt-tiny-zero1", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                    "--parallel", "zero=1"]),
    ("gpt-tiny-zero2", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                    "--parallel", "zero=2,micro_batches=2"]),
    ("gpt-tiny-zero3", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                    "--parallel", "zero=3"]),
    ("gpt-tiny-full", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                   "--parallel", "pp=2,recompute=full"]),
    ("gpt-tiny-selective", "gpt-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16",
                                        "--parallel", "pp=2,tp=2,recompute=selective"]),
    ("gpt2-small-demo", "gpt2-small", ["--devices", "8", "--batch", "32", "--dim",
                                       "seq=1024"]),
    ("bert-tiny-auto-4", "bert-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16"]),
    ("bert-base-16", "bert-base", ["--devices", "16", "--batch", "32", "--dim", "seq=512"]),
    ("llama-tiny-auto-4", "llama-tiny", ["--devices", "4", "--batch", "8", "--dim",
                                         "seq=16"]),
    ("llama-7b-64-h100", "llama-7b", ["--devices", "64", "--batch", "256", "--dim",
                                      "seq=2048", "--profile", "h100-sxm"]),
    ("resnet-tiny-4", "resnet-tiny", ["--devices", "4", "--batch", "16"]),
    ("resnet50-8", "resnet50", ["--devices", "8", "--batch", "256"]),
    ("moe-tiny-4", "moe-tiny", ["--devices", "4", "--batch", "8", "--dim", "seq=16"]),
    ("moe-small-8", "moe-small", ["--devices", "8", "--batch", "32", "--dim", "seq=512"]),
    # Large models: the joint search.
    ("gpt3-1.3b-8", "gpt3-1.3b", ["--devices", "8", "--batch", "32", "--dim", "seq=2048"]),
    ("gpt3-13b-8", "gpt3-13b", ["--devices", "8", "--batch", "32", "--dim", "seq=2048"]),
    ("gpt3-13b-8-910b", "gpt3-13b", ["--devices", "8", "--batch", "32", "--dim", "seq=2048",
                                     "--profile", "ascend-910b"]),
    ("gpt3-175b-1024", "gpt3-175b", ["--devices", "1024", "--batch", "1536", "--dim",
                                     "seq=2048"]),
    ("gpt3-175b-pinned", "gpt3-175b", ["--devices", "1024", "--batch", "1536", "--dim",
                                       "seq=2048", "--parallel", "pp=8,tp=8,zero=1"]),
    ("gpt3-175b-zero3", "gpt3-175b", ["--devices", "1024", "--batch", "1536", "--dim",
                                      "seq=2048", "--parallel", "pp=8,tp=8,zero=3,"
                                      "micro_batches=64"]),
]

EXPORT_CASES = [
    ("{stem}-auto-4", ["--devices", "4", "--batch", "4", "--dim", "seq=16"]),
    ("{stem}-pp2", ["--devices", "4", "--batch", "4", "--dim", "seq=16", "--parallel",
                    "pp=2,micro_batches=2"]),
]

SEED_STRATEGIES = {"matmul1": [[1, 1], [1, 2]], "matmul2": [[1, 2], [2, 1]]}


def build_models(folder: Path) -> dict[str, Path]:
    """Every corpus model, built once into `folder` (this checkout's zoo and exporters)."""
    sys.path.insert(0, str(HERE))
    from planner.cli import main

    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, argv in ZOO_MODELS.items():
        target = folder / f"{name}.onnx"
        if not target.exists():
            with contextlib.redirect_stdout(io.StringIO()):
                if main(["zoo", *argv, "-o", str(target)]) != 0:
                    raise SystemExit(f"could not build {name}")
        paths[name] = target
    (folder / "seed-strategies.json").write_text(json.dumps(SEED_STRATEGIES))
    try:
        from tests.exported_models import export
    except ImportError as exc:  # torch or transformers missing: zoo models only
        print(f"(exports skipped: {exc})", file=sys.stderr)
        return paths
    for model, exporter, training in EXPORTS:
        opset = 18 if exporter == "dynamo" else 17
        path = export(model, exporter, training=training, opset=opset, out_dir=folder)
        stem = f"{model}-{exporter}-{'train' if training else 'eval'}"
        paths[stem] = Path(path)
    return paths


def cases(models: dict[str, Path]) -> list[tuple[str, Path, list[str]]]:
    result = [(name, models[model], args) for name, model, args in CASES]
    for stem, path in models.items():
        if "-torchscript-" in stem or "-dynamo-" in stem:
            result += [(name.format(stem=stem), path, args) for name, args in EXPORT_CASES]
    return result


def run(tree: Path, models: Path, out: Path, only: str = "") -> None:
    paths = build_models(models)
    # The planning code under test comes first: modules already imported from this
    # checkout (by build_models) are dropped so the other tree's are loaded.
    for name in list(sys.modules):
        if name.split(".")[0] in ("planner", "costmodels", "executor", "hardware_profiles"):
            del sys.modules[name]
    sys.path.insert(0, str(tree.resolve()))
    from planner.cli import main

    out.mkdir(parents=True, exist_ok=True)
    strategies = str(models / "seed-strategies.json")
    for name, path, args in cases(paths):
        if only and only not in name:
            continue
        argv = ["plan", str(path), *[strategies if a == "@seed-strategies" else a
                                     for a in args], "-o", str(out / f"{name}.json")]
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(argv)
        seconds = time.perf_counter() - started
        status = "ok" if code == 0 else f"exit {code}: {err.getvalue().strip()[-200:]}"
        print(f"{name:<42} {seconds:7.2f} s  {status}", flush=True)


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=HERE, help="checkout whose code plans")
    parser.add_argument("--models", type=Path, default=Path("/tmp/shardplan-corpus-models"))
    parser.add_argument("--out", type=Path, required=True, help="folder for the plan files")
    parser.add_argument("--only", default="", help="cases whose name contains this")
    args = parser.parse_args()
    run(args.tree, args.models, args.out, args.only)


if __name__ == "__main__":
    main_()
