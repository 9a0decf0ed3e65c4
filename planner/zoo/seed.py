"""The seed tutorial's semi-auto network: x[batch, in] @ w1 -> ReLU -> @ w2.

MindSpore's semi-auto example (weights [128, 128] and [128, 64], input [32, 128]) with the
op names `matmul1`, `relu`, `matmul2`, so strategies such as `((1, 1), (1, 2))` can name
them. Small enough to check a planner's choices by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from planner.zoo._builder import GraphBuilder, check_common, check_positive


@dataclass(frozen=True)
class SeedConfig:
    in_features: int = 128
    hidden: int = 128
    out_features: int = 64
    dtype: str = "float32"
    opset: int = 17

    def __post_init__(self) -> None:
        check_positive(self, "in_features", "hidden", "out_features")
        check_common(self)


PRESETS: dict[str, SeedConfig] = {"seed-mlp": SeedConfig()}


def parameter_count(config: SeedConfig) -> int:
    return config.in_features * config.hidden + config.hidden * config.out_features


def build(config: SeedConfig, *, with_weights: bool, seed: int) -> onnx.ModelProto:
    b = GraphBuilder("seed", dtype=config.dtype, opset=config.opset, with_weights=with_weights,
                     seed=seed)
    x = b.input("x", b.elem, ["batch", config.in_features])
    w1 = b.param("w1", [config.in_features, config.hidden])
    w2 = b.param("w2", [config.hidden, config.out_features])
    h = b.op("MatMul", "matmul1", x, w1)
    r = b.op("Relu", "relu", h)
    b.op("MatMul", "matmul2", r, w2, out="y")
    b.output("y", b.elem, ["batch", config.out_features])
    return b.model("seed", config)
