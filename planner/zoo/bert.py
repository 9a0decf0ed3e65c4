"""BERT encoder: word + position + token-type embeddings, post-LN blocks, Erf-GELU.

Parameter names follow Hugging Face ``BertForMaskedLM`` / ``BertForSequenceClassification``
(``bert.encoder.layer.0.attention.self.query``), with Linear weights stored [in, out].
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from planner.zoo._builder import (
    MASK_VALUE,
    GraphBuilder,
    check_common,
    check_divisible,
    check_optional_positive,
    check_positive,
    check_positive_number,
    require,
)

HEADS = ("mlm", "classifier")


@dataclass(frozen=True)
class BERTConfig:
    """Sizes of a BERT encoder; ``head`` picks the MLM head or pooler + classifier."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    ffn: int | None = None
    head: str = "mlm"
    num_labels: int = 2
    token_type_input: bool = False
    attention_mask_input: bool = False
    layer_norm_eps: float = 1e-12
    dtype: str = "float32"
    opset: int = 17

    def __post_init__(self) -> None:
        check_positive(self, "layers", "hidden", "heads", "vocab", "max_positions",
                       "type_vocab", "num_labels")
        check_optional_positive(self, "ffn")
        check_divisible(self, "hidden", "heads")
        require(self.head in HEADS, "head", f"must be one of {HEADS}, got {self.head!r}")
        for flag in ("token_type_input", "attention_mask_input"):
            require(isinstance(getattr(self, flag), bool), flag, "must be a bool")
        check_positive_number(self, "layer_norm_eps")
        check_common(self)

    @property
    def ffn_dim(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS: dict[str, BERTConfig] = {
    "bert-tiny": BERTConfig(layers=2, hidden=32, heads=4, vocab=128, max_positions=16),
    "bert-base": BERTConfig(),
    "bert-large": BERTConfig(layers=24, hidden=1024, heads=16),
}


def parameter_count(config: BERTConfig) -> int:
    h, f, v = config.hidden, config.ffn_dim, config.vocab
    embed = (v + config.max_positions + config.type_vocab) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * f + f) + (f * h + h) + 2 * h
    if config.head == "mlm":
        head = h * h + h + 2 * h + v  # transform dense + LN + decoder bias (tied weight)
    else:
        head = h * h + h + h * config.num_labels + config.num_labels
    return embed + config.layers * layer + head


def _embeddings(b: GraphBuilder, config: BERTConfig) -> tuple[str, str | None]:
    """Summed, normalised embeddings [B, S, H] and the additive attention mask, if any."""
    h, e = config.hidden, "bert.embeddings"
    ids = b.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    types = None
    if config.token_type_input:
        types = b.input("token_type_ids", TensorProto.INT64, ["batch", "seq"])
    mask = None
    if config.attention_mask_input:
        mask = b.input("attention_mask", TensorProto.INT64, ["batch", "seq"])
    zeros, pos = b.positions(ids, "positions")
    words = b.param(f"{e}.word_embeddings.weight", [config.vocab, h])
    x = b.op("Gather", "embeddings.word_gather", words, ids)
    table = b.param(f"{e}.position_embeddings.weight", [config.max_positions, h])
    x = b.op("Add", "embeddings.add_position", x,
             b.op("Gather", "embeddings.position_gather", table, pos))
    table = b.param(f"{e}.token_type_embeddings.weight", [config.type_vocab, h])
    x = b.op("Add", "embeddings.add_token_type", x,
             b.op("Gather", "embeddings.token_type_gather", table, types or zeros))
    x = b.layer_norm(x, f"{e}.LayerNorm", "embeddings.LayerNorm", h, config.layer_norm_eps)
    if mask is not None:
        m = b.op("Cast", "attention_mask.cast", mask, to=b.elem)
        m = b.op("Sub", "attention_mask.invert", b.scalar(1.0, "one"), m)
        m = b.op("Mul", "attention_mask.fill", m, b.scalar(MASK_VALUE[b.dtype], "mask_fill"))
        mask = b.unsqueeze(m, "attention_mask.unsqueeze", [1, 2])
    return x, mask


def _layer(b: GraphBuilder, config: BERTConfig, i: int, x: str, mask: str | None) -> str:
    p, n = f"bert.encoder.layer.{i}", f"layer.{i}"
    h, hd, eps = config.hidden, config.head_dim, config.layer_norm_eps
    qkv = {}
    for name, perm in (("query", (0, 2, 1, 3)), ("key", (0, 2, 3, 1)), ("value", (0, 2, 1, 3))):
        y = b.linear(x, f"{p}.attention.self.{name}", f"{n}.attention.{name}", h, h)
        qkv[name] = b.heads(y, f"{n}.attention.{name}", config.heads, hd, perm=perm)
    ctx = b.attention(qkv["query"], qkv["key"], qkv["value"], f"{n}.attention.core", hd,
                      additive=mask)
    a = b.linear(ctx, f"{p}.attention.output.dense", f"{n}.attention.output.dense", h, h)
    x = b.op("Add", f"{n}.attention.residual", x, a)
    x = b.layer_norm(x, f"{p}.attention.output.LayerNorm", f"{n}.attention.LayerNorm", h, eps)
    y = b.linear(x, f"{p}.intermediate.dense", f"{n}.intermediate.dense", h, config.ffn_dim)
    y = b.gelu(y, f"{n}.intermediate.gelu", approximate=False)
    y = b.linear(y, f"{p}.output.dense", f"{n}.output.dense", config.ffn_dim, h)
    x = b.op("Add", f"{n}.output.residual", x, y)
    return b.layer_norm(x, f"{p}.output.LayerNorm", f"{n}.output.LayerNorm", h, eps)


def _mlm_head(b: GraphBuilder, config: BERTConfig, x: str) -> None:
    """transform (dense, GELU, LN) then the decoder tied to the word embeddings."""
    h, t = config.hidden, "cls.predictions.transform"
    x = b.linear(x, f"{t}.dense", "cls.transform.dense", h, h)
    x = b.gelu(x, "cls.transform.gelu", approximate=False)
    x = b.layer_norm(x, f"{t}.LayerNorm", "cls.transform.LayerNorm", h, config.layer_norm_eps)
    w = b.op("Transpose", "cls.decoder.tied_transpose",
             "bert.embeddings.word_embeddings.weight", perm=[1, 0])
    x = b.op("MatMul", "cls.decoder.matmul", x, w)
    bias = b.param("cls.predictions.bias", [config.vocab], init="zeros")
    b.op("Add", "cls.decoder.bias_add", x, bias, out="logits")
    b.output("logits", b.elem, ["batch", "seq", config.vocab])


def _classifier_head(b: GraphBuilder, config: BERTConfig, x: str) -> None:
    """Pooler (first token, dense, tanh) then a linear classifier."""
    h = config.hidden
    first = b.op("Gather", "pooler.first_token", x, b.ints(0, "zero"), axis=1)
    pooled = b.linear(first, "bert.pooler.dense", "pooler.dense", h, h)
    pooled = b.op("Tanh", "pooler.tanh", pooled)
    y = b.op("MatMul", "classifier.matmul", pooled,
             b.param("classifier.weight", [h, config.num_labels]))
    bias = b.param("classifier.bias", [config.num_labels], init="zeros")
    b.op("Add", "classifier.bias_add", y, bias, out="logits")
    b.output("logits", b.elem, ["batch", config.num_labels])


def build(config: BERTConfig, *, with_weights: bool, seed: int) -> onnx.ModelProto:
    b = GraphBuilder("bert", dtype=config.dtype, opset=config.opset,
                     with_weights=with_weights, seed=seed)
    x, mask = _embeddings(b, config)
    for i in range(config.layers):
        x = _layer(b, config, i, x, mask)
    if config.head == "mlm":
        _mlm_head(b, config, x)
    else:
        _classifier_head(b, config, x)
    return b.model("bert", config)
