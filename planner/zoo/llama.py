"""LLaMA decoder: RMSNorm, rotary positions, bias-free q/k/v/o (optional GQA), SwiGLU MLP.

Parameter names follow Hugging Face ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj``),
with Linear weights stored [in, out]. Positions are computed in-graph from ``input_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
class LlamaConfig:
    """Sizes of a LLaMA model; ``kv_heads=None`` is plain multi-head attention and
    ``ffn=None`` is LLaMA's 8/3 * hidden rounded up to ``ffn_multiple_of``."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int | None = None
    vocab: int = 32000
    max_positions: int = 2048
    ffn: int | None = None
    ffn_multiple_of: int = 256
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    tied_head: bool = False
    dtype: str = "float32"
    opset: int = 17

    def __post_init__(self) -> None:
        check_positive(self, "layers", "hidden", "heads", "vocab", "max_positions",
                       "ffn_multiple_of")
        check_optional_positive(self, "ffn", "kv_heads")
        check_divisible(self, "hidden", "heads")
        require(self.heads % self.kv_head_count == 0, "kv_heads",
                f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        require(self.head_dim % 2 == 0, "heads",
                f"rotary embeddings need an even head dim, got hidden/heads={self.head_dim}")
        check_positive_number(self, "rms_eps", "rope_theta")
        require(isinstance(self.tied_head, bool), "tied_head", "must be a bool")
        check_common(self)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_head_count(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn is not None:
            return self.ffn
        m = self.ffn_multiple_of
        return -(-int(8 * self.hidden / 3) // m) * m


PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, vocab=128,
                              max_positions=16, ffn=64),
    "llama-7b": LlamaConfig(),
    "llama-13b": LlamaConfig(layers=40, hidden=5120, heads=40),
    "llama2-70b": LlamaConfig(layers=80, hidden=8192, heads=64, kv_heads=8,
                              max_positions=4096, ffn=28672),
}


def parameter_count(config: LlamaConfig) -> int:
    h, v, f = config.hidden, config.vocab, config.ffn_dim
    q_out, kv_out = config.heads * config.head_dim, config.kv_head_count * config.head_dim
    layer = h * q_out + 2 * h * kv_out + q_out * h + 3 * h * f + 2 * h
    head = 0 if config.tied_head else v * h
    return v * h + config.layers * layer + h + head


def _rotary_tables(b: GraphBuilder, config: LlamaConfig, pos: str) -> tuple[str, str]:
    """cos and sin [B, S, 1, head_dim], computed in float32 then cast to the model dtype."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    p = b.op("Cast", "rotary.positions_cast", pos, to=TensorProto.FLOAT)
    p = b.unsqueeze(p, "rotary.positions_unsqueeze", [2])
    freqs = b.op("Mul", "rotary.freqs", p, b.f32(inv_freq, "rotary_inv_freq"))
    emb = b.op("Concat", "rotary.concat", freqs, freqs, axis=-1)
    tables = []
    for fn in ("Cos", "Sin"):
        t = b.op(fn, f"rotary.{fn.lower()}", emb)
        if b.elem != TensorProto.FLOAT:
            t = b.op("Cast", f"rotary.{fn.lower()}_cast", t, to=b.elem)
        tables.append(b.unsqueeze(t, f"rotary.{fn.lower()}_unsqueeze", [2]))
    return tables[0], tables[1]


def _apply_rotary(b: GraphBuilder, x: str, node: str, cos: str, sin: str, hd: int) -> str:
    """x * cos + rotate_half(x) * sin on [B, S, heads, hd]."""
    axes = b.ints([-1], "axes")
    lo = b.op("Slice", f"{node}.slice_lo", x, b.ints([0], "zero_1d"),
              b.ints([hd // 2], "half_head_dim"), axes)
    hi = b.op("Slice", f"{node}.slice_hi", x, b.ints([hd // 2], "half_head_dim"),
              b.ints([hd], "head_dim"), axes)
    rotated = b.op("Concat", f"{node}.rotate_half", b.op("Neg", f"{node}.neg", hi), lo, axis=-1)
    return b.op("Add", f"{node}.add", b.op("Mul", f"{node}.mul_cos", x, cos),
                b.op("Mul", f"{node}.mul_sin", rotated, sin))


def _repeat_kv(b: GraphBuilder, x: str, node: str, config: LlamaConfig) -> str:
    """[B, S, kv_heads, hd] -> [B, S, heads, hd] by tiling each kv head (GQA)."""
    groups, hd = config.heads // config.kv_head_count, config.head_dim
    if groups == 1:
        return x
    x = b.reshape(x, f"{node}.group_unsqueeze", [0, 0, config.kv_head_count, 1, hd])
    x = b.op("Tile", f"{node}.group_tile", x, b.ints([1, 1, 1, groups, 1], "repeat_kv"))
    return b.reshape(x, f"{node}.group_merge", [0, 0, config.heads, hd])


def _attention(b: GraphBuilder, config: LlamaConfig, i: int, x: str, rope: tuple[str, str],
               mask: str) -> str:
    p, n = f"model.layers.{i}.self_attn", f"layers.{i}.self_attn"
    h, hd, kvh = config.hidden, config.head_dim, config.kv_head_count
    q = b.linear(x, f"{p}.q_proj", f"{n}.q_proj", h, config.heads * hd, bias=False)
    k = b.linear(x, f"{p}.k_proj", f"{n}.k_proj", h, kvh * hd, bias=False)
    v = b.linear(x, f"{p}.v_proj", f"{n}.v_proj", h, kvh * hd, bias=False)
    q = _apply_rotary(b, b.heads(q, f"{n}.q", config.heads, hd, perm=None), f"{n}.q_rope",
                      *rope, hd)
    k = _apply_rotary(b, b.heads(k, f"{n}.k", kvh, hd, perm=None), f"{n}.k_rope", *rope, hd)
    k = _repeat_kv(b, k, f"{n}.k", config)
    v = _repeat_kv(b, b.heads(v, f"{n}.v", kvh, hd, perm=None), f"{n}.v", config)
    q = b.op("Transpose", f"{n}.q.transpose", q, perm=[0, 2, 1, 3])
    k = b.op("Transpose", f"{n}.k.transpose", k, perm=[0, 2, 3, 1])
    v = b.op("Transpose", f"{n}.v.transpose", v, perm=[0, 2, 1, 3])
    ctx = b.attention(q, k, v, f"{n}.core", hd, causal=mask)
    return b.linear(ctx, f"{p}.o_proj", f"{n}.o_proj", config.heads * hd, h, bias=False)


def _mlp(b: GraphBuilder, config: LlamaConfig, i: int, x: str) -> str:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    p, n, h, f = f"model.layers.{i}.mlp", f"layers.{i}.mlp", config.hidden, config.ffn_dim
    gate = b.linear(x, f"{p}.gate_proj", f"{n}.gate_proj", h, f, bias=False)
    up = b.linear(x, f"{p}.up_proj", f"{n}.up_proj", h, f, bias=False)
    y = b.op("Mul", f"{n}.gate_mul", b.silu(gate, f"{n}.silu"), up)
    return b.linear(y, f"{p}.down_proj", f"{n}.down_proj", f, h, bias=False)


def build(config: LlamaConfig, *, with_weights: bool, seed: int) -> onnx.ModelProto:
    b = GraphBuilder("llama", dtype=config.dtype, opset=config.opset,
                     with_weights=with_weights, seed=seed)
    h, eps = config.hidden, config.rms_eps
    ids = b.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    _, pos = b.positions(ids, "positions")
    mask = b.causal_mask(pos, "causal_mask")
    rope = _rotary_tables(b, config, pos)
    embed = b.param("model.embed_tokens.weight", [config.vocab, h])
    x = b.op("Gather", "embed_tokens.gather", embed, ids)
    for i in range(config.layers):
        t, n = f"model.layers.{i}", f"layers.{i}"
        xn = b.rms_norm(x, f"{t}.input_layernorm", f"{n}.input_layernorm", h, eps)
        x = b.op("Add", f"{n}.attn_residual", x, _attention(b, config, i, xn, rope, mask))
        xn = b.rms_norm(x, f"{t}.post_attention_layernorm", f"{n}.post_attention_layernorm",
                        h, eps)
        x = b.op("Add", f"{n}.mlp_residual", x, _mlp(b, config, i, xn))
    x = b.rms_norm(x, "model.norm", "norm", h, eps)
    if config.tied_head:
        w = b.op("Transpose", "lm_head.tied_transpose", embed, perm=[1, 0])
    else:
        w = b.param("lm_head.weight", [h, config.vocab])
    b.op("MatMul", "lm_head.matmul", x, w, out="logits")
    b.output("logits", b.elem, ["batch", "seq", config.vocab])
    return b.model("llama", config)
