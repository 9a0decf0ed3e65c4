"""Planning real torch exports against the zoo graph of the same shape, in one run.

Run: python bench/real_exports.py [--models gpt2,llama,...] [--layers 4,32] [--devices 8,64]
                                  [--hidden 512] [--exporters torchscript,dynamo]
     python bench/real_exports.py --llama-7b   (LLaMA-7B's shape, 32 layers, 64 devices)

Each model (transformers classes from configs) is exported in eval mode by each exporter at
its defaults (dynamo optimises) without weight memory (`tests/exported_models.py`,
`export_shapes_only`: the file carries dims and dtypes, as planning needs), then planned by
`planner.api.plan` on a100-80g at 8 sequences of 1024 tokens per device. "plan s" is the
whole call (every mesh, the joint search, the baselines, the build); "zoo s" plans the zoo
model of the same shape (GPT-2, BERT, LLaMA) in the same run, so the ratio is free of the
host's load. "step" is the chosen plan's predicted step, "dp step" the data-parallel
baseline's; each "vs ts" compares it with the TorchScript export's (the baselines price
masks and position biases as the ops that make them, so the two exports agree there too).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import exported_models as em

from planner import zoo
from planner.api import load_graph, plan
from planner.humanize import human_seconds
from planner.layers import find_repeats
from planner.zoo.bert import BERTConfig
from planner.zoo.gpt import GPTConfig
from planner.zoo.llama import LlamaConfig

TOKEN_MODELS = ("gpt2", "bert", "llama", "mistral", "qwen2", "gpt_neox", "opt")
SEQ = 1024
PER_DEVICE = 8


def _zoo_twin(model: str, layers: int, size: em.Size, out: Path) -> Path | None:
    """The zoo graph of `model`'s shape, where the zoo has the family."""
    h, n, v, p = size.hidden, size.heads, size.vocab, size.positions
    config: object
    if model == "gpt2":
        family, config = "gpt", GPTConfig(layers, h, n, v, p)
    elif model == "bert":
        family, config = "bert", BERTConfig(layers, h, n, v, p)
    elif model == "llama":
        family, config = "llama", LlamaConfig(layers, h, n, vocab=v, max_positions=p,
                                              ffn=size.ffn)
    else:
        return None
    return zoo.save(zoo.build(family, config), out)


def _timed_plan(path: Path, devices: int):
    graph = load_graph(path, batch=PER_DEVICE * devices, dims={"seq": SEQ})
    started = time.perf_counter()
    result = plan(graph, devices=devices)
    return time.perf_counter() - started, graph, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(TOKEN_MODELS))
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument("--layers", default="4,32")
    parser.add_argument("--devices", default="8,64")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--llama-7b", action="store_true",
                        help="LLaMA-7B's shape (hidden 4096, 32 layers), dynamo, 64 devices")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.llama_7b:
        args.models, args.exporters, args.layers, args.devices = "llama", "dynamo", "32", "64"
        size = em.Size(hidden=4096, heads=32, ffn=11008, vocab=32000, positions=4096)
    else:
        size = em.Size.of_hidden(args.hidden)
    print(f"real exports (eval, exporters' defaults) vs the zoo twin, a100-80g, "
          f"{PER_DEVICE} x {SEQ} tokens per device, hidden {size.hidden}")
    header = (f"{'model':<10}{'exporter':<13}{'layers':>7}{'devices':>8}{'ops':>6}"
              f"{'found':>7}{'plan s':>8}{'zoo s':>8}{'ratio':>7}{'step':>12}{'vs ts':>7}"
              f"{'dp step':>12}{'vs ts':>7}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            for layers in (int(n) for n in args.layers.split(",")):
                files = {exporter: em.export_shapes_only(
                    model, exporter, Path(scratch) / f"{model}-{exporter}-{layers}.onnx",
                    layers=layers, size=size) for exporter in args.exporters.split(",")}
                twin = _zoo_twin(model, layers, size, Path(scratch) / f"zoo-{model}.onnx")
                for devices in (int(n) for n in args.devices.split(",")):
                    zoo_s = _timed_plan(twin, devices)[0] if twin else None
                    steps: dict[str, float] = {}
                    dp_steps: dict[str, float] = {}
                    for exporter, path in files.items():
                        seconds, graph, result = _timed_plan(path, devices)
                        repeats = find_repeats(graph)
                        steps[exporter] = result.predicted.step_time_s
                        baseline = result.baselines.get("data-parallel")
                        dp_steps[exporter] = baseline.step_time_s if baseline else 0.0
                        versus = _versus(steps, exporter)
                        print(f"{model:<10}{exporter:<13}{layers:>7}{devices:>8}"
                              f"{len(graph.ops):>6}{repeats.count if repeats else 0:>7}"
                              f"{seconds:>8.1f}"
                              + (f"{zoo_s:>8.1f}{seconds / zoo_s:>7.2f}" if zoo_s
                                 else f"{'':>8}{'':>7}")
                              + f"{human_seconds(result.predicted.step_time_s):>12}{versus}"
                              + f"{human_seconds(dp_steps[exporter]):>12}"
                              + _versus(dp_steps, exporter), flush=True)


def _versus(steps: dict[str, float], exporter: str) -> str:
    """`exporter`'s step against the TorchScript export's, where both were priced."""
    if not steps.get("torchscript") or not steps.get(exporter):
        return f"{'':>7}"
    return f"{steps[exporter] / steps['torchscript']:>7.3f}"


if __name__ == "__main__":
    main()
