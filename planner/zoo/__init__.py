"""Model zoo: ONNX graphs of standard architectures at any size, built from a config.

The planner works from graph structure and tensor shapes only, so by default parameters
are declared as external data that is never written: GPT-3 175B builds in seconds and
serialises to a few MB. ``with_weights=True`` stores real random weights inline instead,
for tiny models that onnxruntime can run.

    model = build("gpt", layers=4)           # family default, with overrides
    family, config = preset("llama-7b")
    save(build(family, config), "llama-7b.onnx")
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
from onnx import TensorProto

from planner.errors import ModelError
from planner.zoo import bert, gpt, llama, moe, resnet, seed
from planner.zoo._builder import BUFFER_SUFFIXES, DTYPES, INLINE_LIMIT, numel
from planner.zoo.bert import BERTConfig
from planner.zoo.gpt import GPTConfig
from planner.zoo.llama import LlamaConfig
from planner.zoo.moe import MoEConfig
from planner.zoo.resnet import ResNetConfig
from planner.zoo.seed import SeedConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "BUFFER_SUFFIXES", "DTYPES", "FAMILIES", "PRESETS", "BERTConfig", "GPTConfig", "LlamaConfig",
    "MoEConfig", "ResNetConfig", "SeedConfig", "build", "check", "initializer_parameter_count",
    "parameter_count", "preset", "save",
]

FAMILIES: dict[str, type[DataclassInstance]] = {
    "gpt": GPTConfig,
    "bert": BERTConfig,
    "llama": LlamaConfig,
    "resnet": ResNetConfig,
    "moe": MoEConfig,
    "seed": SeedConfig,
}
_MODULES = {"gpt": gpt, "bert": bert, "llama": llama, "resnet": resnet, "moe": moe,
            "seed": seed}
_BUILDERS: dict[str, Callable[..., onnx.ModelProto]] = {f: m.build for f, m in _MODULES.items()}
_COUNTERS: dict[str, Callable[[Any], int]] = {
    f: m.parameter_count for f, m in _MODULES.items()
}
PRESETS: dict[str, tuple[str, Any]] = {
    name: (family, config)
    for family, module in _MODULES.items()
    for name, config in module.PRESETS.items()
}


def preset(name: str) -> tuple[str, Any]:
    """(family, config) of a named size such as "gpt2-small" or "llama-7b"."""
    if name not in PRESETS:
        raise ModelError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def _resolve(family: str, config: Any, overrides: dict[str, Any]) -> tuple[str, Any]:
    """Family name (or preset name) + optional config + field overrides -> checked config."""
    if family not in FAMILIES:
        if family in PRESETS and config is None:
            family, config = PRESETS[family]
        else:
            raise ModelError(f"unknown model family {family!r}: choose one of "
                             f"{sorted(FAMILIES)} or a preset from {sorted(PRESETS)}")
    cls = FAMILIES[family]
    if config is None:
        config = cls()
    if type(config) is not cls:
        raise ModelError(f"model config for family {family!r} must be a {cls.__name__}, got "
                         f"{type(config).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    for name in overrides:
        if name not in known:
            raise ModelError(f"model config field {name!r} does not exist for family "
                             f"{family!r}: fields are {sorted(known)}")
    return family, dataclasses.replace(config, **overrides) if overrides else config


def build(family: str, config: Any = None, *, with_weights: bool = False, seed: int = 0,
          **overrides: Any) -> onnx.ModelProto:
    """ONNX model of one family (or preset name); weights absent (external, never written)
    unless asked. Overrides replace config fields, e.g. ``build("gpt2-small", layers=2)``."""
    family, config = _resolve(family, config, overrides)
    _check_size(family, config)
    return _BUILDERS[family](config, with_weights=with_weights, seed=seed)


# A graph of this many nodes takes gigabytes to build and far longer to plan than anyone
# waits (the planner takes about a millisecond per op per configuration it prices).
MAX_NODES = 1_000_000


def _check_size(family: str, config: Any) -> None:
    """Refuse, before building it, a model whose graph would pass MAX_NODES nodes or
    protobuf's 2 GiB: its size grows linearly in its layers, so two small builds measure
    it (building it whole would run out of memory first, and protobuf crashes then)."""
    layers = getattr(config, "layers", None)
    step = max(2, int(getattr(config, "moe_every", 1)))
    if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 2 + step:
        return
    sizes = []
    for depth in (2, 2 + step):
        small = _BUILDERS[family](dataclasses.replace(config, layers=depth),
                                  with_weights=False, seed=0)
        sizes.append((len(small.graph.node), small.ByteSize()))
    (nodes, size), (more_nodes, more_size) = sizes
    nodes += (layers - 2) * (more_nodes - nodes) // step
    size += (layers - 2) * (more_size - size) // step
    if nodes > MAX_NODES or size > INLINE_LIMIT:
        raise ModelError(
            f"{family} with {layers} layers: its graph would have about {nodes:,} nodes in "
            f"{size / 2**30:.1f} GiB, more than the zoo builds ({MAX_NODES:,} nodes, "
            f"{INLINE_LIMIT / 2**30:.1f} GiB, protobuf's limit): use fewer layers")


def parameter_count(family: str, config: Any = None) -> int:
    """Trainable parameters from the config's closed-form formula (buffers excluded)."""
    family, config = _resolve(family, config, {})
    return _COUNTERS[family](config)


def initializer_parameter_count(model: onnx.ModelProto) -> int:
    """Trainable parameters as declared in the graph: float initializers minus buffers."""
    floats = set(DTYPES.values()) | {TensorProto.DOUBLE}
    return sum(numel(t.dims) for t in model.graph.initializer
               if t.data_type in floats and not t.name.endswith(BUFFER_SUFFIXES))


def _relocate(model: onnx.ModelProto, location: str) -> onnx.ModelProto:
    """Copy of model whose external tensors point at location (offsets kept)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in out.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
    return out


def save(model: onnx.ModelProto, path: str | Path) -> Path:
    """Write the .onnx file; absent weights stay declared in "<stem>.weights", not written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Serialise directly: onnx.save_model may try to write external data of its own.
    path.write_bytes(_relocate(model, f"{path.stem}.weights").SerializeToString())
    return path


def check(model: onnx.ModelProto) -> None:
    """onnx.checker (full check, shape inference included) for models with absent weights.

    The checker insists that an external data file exists, and ours never does, so the
    model is saved to a temporary folder beside an empty placeholder weights file: only
    the file's existence is faked; locations, offsets and lengths are still checked.
    """
    with tempfile.TemporaryDirectory() as folder:
        path = save(model, Path(folder) / "model.onnx")
        if any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer):
            (Path(folder) / "model.weights").touch()
        onnx.checker.check_model(str(path), full_check=True)
