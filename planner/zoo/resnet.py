"""ResNet v1.5 (stride on the 3x3 conv) with Basic or Bottleneck blocks.

Parameter names follow torchvision (``layer1.0.conv1.weight``, ``layer1.0.bn1.running_mean``,
``fc.weight`` kept [out, in] for Gemm transB). BatchNorm running statistics are initializers
too (ONNX needs them as inputs); their names end in ``running_mean``/``running_var`` so the
planner can tell them from trainable parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import onnx

from planner.zoo._builder import (
    GraphBuilder,
    check_common,
    check_positive,
    check_positive_number,
    require,
)

BLOCKS = {"basic": 1, "bottleneck": 4}  # block type -> channel expansion


@dataclass(frozen=True)
class ResNetConfig:
    """Sizes of a ResNet; ``layers`` is blocks per stage, ``width`` the stem channels."""

    block: str = "bottleneck"
    layers: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    num_classes: int = 1000
    image_size: int = 224
    in_channels: int = 3
    bn_eps: float = 1e-5
    dtype: str = "float32"
    opset: int = 17

    def __post_init__(self) -> None:
        require(self.block in BLOCKS, "block",
                f"must be one of {sorted(BLOCKS)}, got {self.block!r}")
        ok = isinstance(self.layers, tuple | list) and len(self.layers) > 0 and all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.layers)
        require(ok, "layers", f"must be a non-empty tuple of positive block counts, got "
                f"{self.layers!r}")
        object.__setattr__(self, "layers", tuple(self.layers))  # keep the config hashable
        check_positive(self, "width", "num_classes", "image_size", "in_channels")
        min_size = 2 ** (len(self.layers) + 1)
        require(self.image_size >= min_size, "image_size",
                f"must be at least {min_size} for {len(self.layers)} stages, got "
                f"{self.image_size}")
        check_positive_number(self, "bn_eps")
        check_common(self)
        require(self.dtype != "bfloat16" or self.opset >= 22, "opset",
                f"bfloat16 Conv/MaxPool/GlobalAveragePool need opset >= 22, got {self.opset}")

    @property
    def expansion(self) -> int:
        return BLOCKS[self.block]


PRESETS: dict[str, ResNetConfig] = {
    "resnet-tiny": ResNetConfig(block="basic", layers=(1, 1, 1, 1), width=8, num_classes=10,
                                image_size=32),
    "resnet18": ResNetConfig(block="basic", layers=(2, 2, 2, 2)),
    "resnet34": ResNetConfig(block="basic", layers=(3, 4, 6, 3)),
    "resnet50": ResNetConfig(),
    "resnet101": ResNetConfig(layers=(3, 4, 23, 3)),
    "resnet152": ResNetConfig(layers=(3, 8, 36, 3)),
}


def _stages(config: ResNetConfig) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield (stage index, block index, in channels, mid channels, stride) per block."""
    channels = config.width
    for s, blocks in enumerate(config.layers):
        mid = config.width * 2**s
        for j in range(blocks):
            stride = 2 if s > 0 and j == 0 else 1
            yield s, j, channels, mid, stride
            channels = mid * config.expansion


def parameter_count(config: ResNetConfig) -> int:
    """Trainable parameters only (running statistics are buffers, as in torch)."""
    w, e = config.width, config.expansion
    total = config.in_channels * w * 49 + 2 * w
    for _, _, cin, mid, stride in _stages(config):
        out = mid * e
        if config.block == "basic":
            total += cin * mid * 9 + 2 * mid + mid * mid * 9 + 2 * mid
        else:
            total += cin * mid + 2 * mid + mid * mid * 9 + 2 * mid + mid * out + 2 * out
        if stride != 1 or cin != out:
            total += cin * out + 2 * out
    final = config.width * 2 ** (len(config.layers) - 1) * e
    return total + final * config.num_classes + config.num_classes


def _conv_bn(b: GraphBuilder, x: str, conv: str, bn: str, cin: int, cout: int, *,
             kernel: int, stride: int, eps: float) -> str:
    """Bias-free Conv then BatchNormalization (scale/bias trainable, running stats buffers)."""
    std = math.sqrt(2.0 / (cin * kernel * kernel))  # He init keeps random activations sane
    w = b.param(f"{conv}.weight", [cout, cin, kernel, kernel], std=std)
    pad = kernel // 2
    y = b.op("Conv", conv, x, w, kernel_shape=[kernel, kernel], strides=[stride, stride],
             pads=[pad] * 4)
    scale = b.param(f"{bn}.weight", [cout], init="ones")
    bias = b.param(f"{bn}.bias", [cout], init="zeros")
    mean = b.param(f"{bn}.running_mean", [cout], init="zeros")
    var = b.param(f"{bn}.running_var", [cout], init="ones")
    return b.op("BatchNormalization", bn, y, scale, bias, mean, var, epsilon=eps, momentum=0.9)


def _block(b: GraphBuilder, config: ResNetConfig, x: str, s: int, j: int, cin: int, mid: int,
           stride: int) -> str:
    p, eps, out = f"layer{s + 1}.{j}", config.bn_eps, mid * config.expansion
    if config.block == "basic":
        y = _conv_bn(b, x, f"{p}.conv1", f"{p}.bn1", cin, mid, kernel=3, stride=stride, eps=eps)
        y = b.op("Relu", f"{p}.relu1", y)
        y = _conv_bn(b, y, f"{p}.conv2", f"{p}.bn2", mid, out, kernel=3, stride=1, eps=eps)
    else:
        y = _conv_bn(b, x, f"{p}.conv1", f"{p}.bn1", cin, mid, kernel=1, stride=1, eps=eps)
        y = b.op("Relu", f"{p}.relu1", y)
        y = _conv_bn(b, y, f"{p}.conv2", f"{p}.bn2", mid, mid, kernel=3, stride=stride, eps=eps)
        y = b.op("Relu", f"{p}.relu2", y)
        y = _conv_bn(b, y, f"{p}.conv3", f"{p}.bn3", mid, out, kernel=1, stride=1, eps=eps)
    if stride != 1 or cin != out:
        x = _conv_bn(b, x, f"{p}.downsample.0", f"{p}.downsample.1", cin, out, kernel=1,
                     stride=stride, eps=eps)
    return b.op("Relu", f"{p}.relu_out", b.op("Add", f"{p}.residual", y, x))


def build(config: ResNetConfig, *, with_weights: bool, seed: int) -> onnx.ModelProto:
    b = GraphBuilder("resnet", dtype=config.dtype, opset=config.opset,
                     with_weights=with_weights, seed=seed)
    size = config.image_size
    x = b.input("pixel_values", b.elem, ["batch", config.in_channels, size, size])
    x = _conv_bn(b, x, "conv1", "bn1", config.in_channels, config.width, kernel=7, stride=2,
                 eps=config.bn_eps)
    x = b.op("Relu", "relu", x)
    x = b.op("MaxPool", "maxpool", x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    for s, j, cin, mid, stride in _stages(config):
        x = _block(b, config, x, s, j, cin, mid, stride)
    x = b.op("Flatten", "flatten", b.op("GlobalAveragePool", "avgpool", x), axis=1)
    features = config.width * 2 ** (len(config.layers) - 1) * config.expansion
    w = b.param("fc.weight", [config.num_classes, features])
    bias = b.param("fc.bias", [config.num_classes], init="zeros")
    b.op("Gemm", "fc", x, w, bias, transB=1, out="logits")
    b.output("logits", b.elem, ["batch", config.num_classes])
    return b.model("resnet", config)

