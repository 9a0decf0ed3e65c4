"""GPT-2 / GPT-3 decoder: learned positions, pre-LN blocks, fused QKV, tanh-GELU MLP.

Parameter names follow Hugging Face ``GPT2LMHeadModel`` (``transformer.h.0.attn.c_attn``);
its Conv1D weights are already stored [in, out], as MatMul wants them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from planner.zoo._builder import (
    GraphBuilder,
    check_common,
    check_divisible,
    check_optional_positive,
    check_positive,
    check_positive_number,
    require,
)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT-2/3 style model; ``ffn=None`` means 4 * hidden."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    vocab: int = 50257
    max_positions: int = 1024
    ffn: int | None = None
    tied_head: bool = True
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0  # attention-probability and residual dropout (Megatron trains at 0.1)
    #: One [h, 3h] QKV projection split into q, k and v (GPT-2's c_attn), or three [h, h]
    #: projections: the same FLOPs and parameters, and a layout Megatron's head split fits.
    fused_qkv: bool = True
    dtype: str = "float32"
    opset: int = 17

    def __post_init__(self) -> None:
        check_positive(self, "layers", "hidden", "heads", "vocab", "max_positions")
        check_optional_positive(self, "ffn")
        check_divisible(self, "hidden", "heads")
        require(isinstance(self.tied_head, bool), "tied_head", "must be a bool")
        require(isinstance(self.fused_qkv, bool), "fused_qkv", "must be a bool")
        check_positive_number(self, "layer_norm_eps")
        require(isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1, "dropout",
                "must be a probability in [0, 1)")
        check_common(self)

    @property
    def ffn_dim(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(layers=2, hidden=32, heads=4, vocab=128, max_positions=16),
    "gpt2-small": GPTConfig(),
    "gpt2-medium": GPTConfig(layers=24, hidden=1024, heads=16),
    "gpt2-large": GPTConfig(layers=36, hidden=1280, heads=20),
    "gpt2-xl": GPTConfig(layers=48, hidden=1600, heads=25),
    # GPT-3 sizes (Brown et al. 2020, Table 2.1); 13B uses hidden 5120 (the table's 5140
    # does not divide into 40 heads; Megatron-LM and others train it at 5120).
    "gpt3-1.3b": GPTConfig(layers=24, hidden=2048, heads=16, max_positions=2048),
    "gpt3-6.7b": GPTConfig(layers=32, hidden=4096, heads=32, max_positions=2048),
    "gpt3-13b": GPTConfig(layers=40, hidden=5120, heads=40, max_positions=2048),
    "gpt3-175b": GPTConfig(layers=96, hidden=12288, heads=96, max_positions=2048),
    # The 1T model of Narayanan et al. 2021 (Megatron-LM, Table 1: 128 layers, hidden
    # 25600, 160 heads), trained on 3072 A100s.
    "gpt-1t": GPTConfig(layers=128, hidden=25600, heads=160, max_positions=2048),
}

MlpFn = Callable[[GraphBuilder, int, str], str]


def block_mlp_params(config: GPTConfig) -> int:
    """Parameters of one dense GPT MLP (c_fc + c_proj with biases)."""
    h, f = config.hidden, config.ffn_dim
    return h * f + f + f * h + h


def parameter_count(config: GPTConfig) -> int:
    h, v = config.hidden, config.vocab
    attn = h * 3 * h + 3 * h + h * h + h
    block = 2 * h + attn + 2 * h + block_mlp_params(config)
    head = 0 if config.tied_head else h * v
    return v * h + config.max_positions * h + config.layers * block + 2 * h + head


def dense_mlp(config: GPTConfig) -> MlpFn:
    """The standard c_fc -> GELU(tanh) -> c_proj MLP, as a per-layer callback."""

    def mlp(b: GraphBuilder, i: int, x: str) -> str:
        p, n = f"transformer.h.{i}.mlp", f"h.{i}.mlp"
        y = b.linear(x, f"{p}.c_fc", f"{n}.c_fc", config.hidden, config.ffn_dim)
        y = b.gelu(y, f"{n}.gelu", approximate=True)
        y = b.linear(y, f"{p}.c_proj", f"{n}.c_proj", config.ffn_dim, config.hidden)
        return b.dropout(y, f"{n}.dropout", config.dropout)

    return mlp


def _attention(b: GraphBuilder, config: GPTConfig, i: int, x: str, mask: str) -> str:
    p, n, h = f"transformer.h.{i}.attn", f"h.{i}.attn", config.hidden
    if config.fused_qkv:
        qkv = b.linear(x, f"{p}.c_attn", f"{n}.c_attn", h, 3 * h)
        q, k, v = b.op_n("Split", f"{n}.split_qkv", 3, qkv, b.ints([h, h, h], "qkv_split"),
                         axis=-1)
    else:
        q, k, v = (b.linear(x, f"{p}.{name}_proj", f"{n}.{name}_proj", h, h)
                   for name in ("q", "k", "v"))
    hd = config.head_dim
    q = b.heads(q, f"{n}.q", config.heads, hd)
    k = b.heads(k, f"{n}.k", config.heads, hd, perm=(0, 2, 3, 1))
    v = b.heads(v, f"{n}.v", config.heads, hd)
    ctx = b.attention(q, k, v, f"{n}.core", hd, causal=mask, dropout=config.dropout)
    out = b.linear(ctx, f"{p}.c_proj", f"{n}.c_proj", h, h)
    return b.dropout(out, f"{n}.dropout", config.dropout)


def build_decoder(b: GraphBuilder, config: GPTConfig, mlp: MlpFn) -> None:
    """Embeddings, pre-LN blocks (MLP supplied per layer), final LN and LM head."""
    h = config.hidden
    ids = b.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    _, pos = b.positions(ids, "positions")
    mask = b.causal_mask(pos, "causal_mask")
    wte = b.param("transformer.wte.weight", [config.vocab, h])
    wpe = b.param("transformer.wpe.weight", [config.max_positions, h])
    x = b.op("Add", "embed.add",
             b.op("Gather", "wte.gather", wte, ids), b.op("Gather", "wpe.gather", wpe, pos))
    eps = config.layer_norm_eps
    for i in range(config.layers):
        t, n = f"transformer.h.{i}", f"h.{i}"
        a = _attention(b, config, i, b.layer_norm(x, f"{t}.ln_1", f"{n}.ln_1", h, eps), mask)
        x = b.op("Add", f"{n}.attn_residual", x, a)
        m = mlp(b, i, b.layer_norm(x, f"{t}.ln_2", f"{n}.ln_2", h, eps))
        x = b.op("Add", f"{n}.mlp_residual", x, m)
    x = b.layer_norm(x, "transformer.ln_f", "ln_f", h, eps)
    if config.tied_head:
        w = b.op("Transpose", "lm_head.tied_transpose", wte, perm=[1, 0])
    else:
        w = b.param("lm_head.weight", [h, config.vocab])
    b.op("MatMul", "lm_head.matmul", x, w, out="logits")
    b.output("logits", b.elem, ["batch", "seq", config.vocab])


def build(config: GPTConfig, *, with_weights: bool, seed: int) -> onnx.ModelProto:
    b = GraphBuilder("gpt", dtype=config.dtype, opset=config.opset,
                     with_weights=with_weights, seed=seed)
    build_decoder(b, config, dense_mlp(config))
    return b.model("gpt", config)
