"""GPT decoder whose every ``moe_every``-th MLP is a GShard-style Mixture-of-Experts.

Each sequence is one GShard group: its tokens are routed top-k to ``experts`` experts, each
with a fixed ``capacity`` of slots per sequence (overflowing tokens are dropped, as in
GShard). Dispatch and combine are dense [B, S, E, C] tensors built with OneHot/CumSum and
applied with batched MatMuls, so the graph is static-shaped once batch and seq are bound,
and expert weights are stacked [E, ...] so an expert-parallel plan can shard them on axis 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from planner.graph import DEFAULT_CAPACITY_FACTOR
from planner.zoo import gpt
from planner.zoo._builder import (
    GraphBuilder,
    check_optional_positive,
    check_positive,
    check_positive_number,
    require,
)


@dataclass(frozen=True)
class MoEConfig(gpt.GPTConfig):
    """GPT sizes plus routing; ``capacity=None`` is top_k * max_positions *
    capacity_factor / experts slots per expert per sequence."""

    experts: int = 8
    top_k: int = 2
    moe_every: int = 2
    capacity: int | None = None
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "experts", "top_k", "moe_every")
        check_optional_positive(self, "capacity")
        require(self.top_k <= self.experts, "top_k",
                f"must be at most experts={self.experts}, got {self.top_k}")
        check_positive_number(self, "capacity_factor")

    @property
    def capacity_per_expert(self) -> int:
        if self.capacity is not None:
            return self.capacity
        slots = self.top_k * self.max_positions * self.capacity_factor / self.experts
        return max(1, math.ceil(slots))

    def is_moe_layer(self, i: int) -> bool:
        return i % self.moe_every == self.moe_every - 1


PRESETS: dict[str, MoEConfig] = {
    "moe-tiny": MoEConfig(layers=2, hidden=32, heads=4, vocab=128, max_positions=16,
                          experts=4),
    "moe-small": MoEConfig(),
    "moe-medium": MoEConfig(layers=24, hidden=1024, heads=16, experts=16),
}


def parameter_count(config: MoEConfig) -> int:
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.layers))
    extra = (config.experts - 1) * gpt.block_mlp_params(config) + config.hidden * config.experts
    return gpt.parameter_count(config) + moe_layers * extra


def _routing(b: GraphBuilder, config: MoEConfig, n: str, gate_w: str, x: str) -> tuple[str, str]:
    """Dispatch (0/1) and combine (gate weight) tensors [B, S, E, C] in the model dtype.

    Routing runs in float32 whatever the model dtype (Switch Transformer's selective
    precision; TopK and OneHot also lack bfloat16 before opset 24/28).
    """
    e, k, c = config.experts, config.top_k, config.capacity_per_expert
    if b.elem != TensorProto.FLOAT:
        x = b.op("Cast", f"{n}.router.input_cast", x, to=TensorProto.FLOAT)
        gate_w = b.op("Cast", f"{n}.router.weight_cast", gate_w, to=TensorProto.FLOAT)
    logits = b.op("MatMul", f"{n}.router.matmul", x, gate_w)
    probs = b.op("Softmax", f"{n}.router.softmax", logits, axis=-1)
    top, idx = b.op_n("TopK", f"{n}.router.topk", 2, probs, b.ints([k], "top_k"), axis=-1)
    norm = b.reduce("ReduceSum", top, f"{n}.router.topk_sum", [-1])
    gates = b.op("Div", f"{n}.router.normalize", top, norm)  # [B, S, k]
    # Expert choice per (token, rank), ordered rank-major so all first choices get slots
    # before any second choice (GShard's priority).
    onehot = b.op("OneHot", f"{n}.router.expert_onehot", idx, b.ints(e, "experts"),
                  b.ints([0, 1], "off_on"), axis=-1)  # int64 [B, S, k, E]
    chosen = b.op("Transpose", f"{n}.router.rank_major", onehot, perm=[0, 2, 1, 3])
    chosen = b.reshape(chosen, f"{n}.router.flatten_ranks", [0, -1, e])  # [B, kS, E]
    slot = b.op("CumSum", f"{n}.router.slot", chosen, b.ints(1, "one"), exclusive=1)
    off_on = b.f32([0.0, 1.0], "off_on_float")
    slots = b.op("OneHot", f"{n}.router.slot_onehot", slot, b.ints(c, "capacity"), off_on,
                 axis=-1)  # [B, kS, E, C]; slots >= C are all zero: the token is dropped
    keep = b.op("Cast", f"{n}.router.chosen_cast", chosen, to=TensorProto.FLOAT)
    dispatch = b.op("Mul", f"{n}.router.dispatch_k", slots,
                    b.unsqueeze(keep, f"{n}.router.chosen_unsqueeze", [3]))
    g = b.op("Transpose", f"{n}.router.gates_rank_major", gates, perm=[0, 2, 1])
    g = b.reshape(g, f"{n}.router.gates_flatten", [0, -1, 1, 1])  # [B, kS, 1, 1]
    combine = b.op("Mul", f"{n}.router.combine_k", dispatch, g)
    out = []
    for name, t in (("dispatch", dispatch), ("combine", combine)):
        t = b.reshape(t, f"{n}.router.{name}_split_ranks", [0, k, -1, e, c])
        t = b.reduce("ReduceSum", t, f"{n}.router.{name}", [1], keepdims=False)
        if b.elem != TensorProto.FLOAT:
            t = b.op("Cast", f"{n}.router.{name}_cast", t, to=b.elem)
        out.append(t)
    return out[0], out[1]


def _dispatch(b: GraphBuilder, config: MoEConfig, n: str, dispatch: str, x: str) -> str:
    """Gather each expert's slots: [B, S, E, C] x [B, S, H] -> [E, B*C, H] via MatMul."""
    e, c, h = config.experts, config.capacity_per_expert, config.hidden
    d = b.reshape(dispatch, f"{n}.dispatch.flatten", [0, 0, e * c])
    d = b.op("Transpose", f"{n}.dispatch.transpose", d, perm=[0, 2, 1])  # [B, EC, S]
    y = b.op("MatMul", f"{n}.dispatch.matmul", d, x)  # [B, EC, H]
    y = b.reshape(y, f"{n}.dispatch.split_experts", [0, e, c, h])
    y = b.op("Transpose", f"{n}.dispatch.expert_major", y, perm=[1, 0, 2, 3])  # [E, B, C, H]
    return b.reshape(y, f"{n}.dispatch.merge_slots", [0, -1, h])


def _combine(b: GraphBuilder, config: MoEConfig, n: str, combine: str, y: str) -> str:
    """Scatter expert outputs back, gate-weighted: [E, B*C, H] -> [B, S, H] via MatMul."""
    e, c, h = config.experts, config.capacity_per_expert, config.hidden
    y = b.reshape(y, f"{n}.combine.split_slots", [0, -1, c, h])  # [E, B, C, H]
    y = b.op("Transpose", f"{n}.combine.batch_major", y, perm=[1, 0, 2, 3])  # [B, E, C, H]
    y = b.reshape(y, f"{n}.combine.merge_experts", [0, e * c, h])
    w = b.reshape(combine, f"{n}.combine.flatten", [0, 0, e * c])  # [B, S, EC]
    return b.op("MatMul", f"{n}.combine.matmul", w, y)


def _experts(b: GraphBuilder, config: MoEConfig, p: str, n: str, x: str) -> str:
    """Batched expert MLPs on [E, B*C, H] with weights stacked [E, in, out]."""
    e, h, f = config.experts, config.hidden, config.ffn_dim
    for name, n_in, n_out in (("c_fc", h, f), ("c_proj", f, h)):
        w = b.param(f"{p}.experts.{name}.weight", [e, n_in, n_out])
        bias = b.param(f"{p}.experts.{name}.bias", [e, n_out], init="zeros")
        x = b.op("MatMul", f"{n}.experts.{name}.matmul", x, w)
        bias = b.unsqueeze(bias, f"{n}.experts.{name}.bias_unsqueeze", [1])
        x = b.op("Add", f"{n}.experts.{name}.bias_add", x, bias)
        if name == "c_fc":
            x = b.gelu(x, f"{n}.experts.gelu", approximate=True)
    return x


def moe_mlp(config: MoEConfig) -> gpt.MlpFn:
    """Per-layer MLP callback: MoE on every moe_every-th layer, dense GPT MLP elsewhere."""
    dense = gpt.dense_mlp(config)

    def mlp(b: GraphBuilder, i: int, x: str) -> str:
        if not config.is_moe_layer(i):
            return dense(b, i, x)
        p, n = f"transformer.h.{i}.mlp", f"h.{i}.mlp"
        gate_w = b.param(f"{p}.gate.weight", [config.hidden, config.experts])
        dispatch, combine = _routing(b, config, n, gate_w, x)
        ye = _experts(b, config, p, n, _dispatch(b, config, n, dispatch, x))
        return _combine(b, config, n, combine, ye)

    return mlp


def build(config: MoEConfig, *, with_weights: bool, seed: int) -> onnx.ModelProto:
    b = GraphBuilder("moe", dtype=config.dtype, opset=config.opset,
                     with_weights=with_weights, seed=seed)
    gpt.build_decoder(b, config, moe_mlp(config))
    return b.model("moe", config)

