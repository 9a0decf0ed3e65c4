"""The op registry: what one ONNX op type is, in one frozen record.

A record carries everything shardplan knows about an op type: its labelling (einsum-style
`DimLabels`: an annotation for the regular ops, a function for the irregular ones, None
when the op has no sharding rule and is planned replicated), its FLOP/byte work class,
whether its FLOPs run on matrix units, in which inputs it is linear, and its local
rewrite (the per-device program when it cannot run unchanged on its shards). The
planner, the cost model, the simulator and the executor all read these records, so what
is priced is what runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planner.graph import OpNode, TensorInfo
from planner.ops import axes, contraction, indexing, movement, rewrites
from planner.ops import work as w
from planner.ops.annotation import Annotation, RankCases
from planner.ops.labels import DimLabels, Labeller, NoRule
from planner.ops.linearity import (
    IN_DATA,
    IN_EACH,
    JOINTLY,
    NOT_LINEAR,
    Linearity,
    in_any_one,
    jointly,
)
from planner.ops.program import LocalRewrite
from planner.ops.work import Work

DEFAULT_DOMAIN = ""


@dataclass(frozen=True)
class OpRecord:
    """One op type.

    - `labels`: the labelling of an instance (an `Annotation`, a `RankCases` or a function;
      it raises `NoRule` to decline an instance); None: no sharding rule, planned
      replicated.
    - `work`: the FLOP/byte work class (`planner.ops.work`).
    - `matrix`: its FLOPs run on matrix units (tensor cores, cube units, GEMM kernels).
    - `linearity`: the inputs in which the op is linear, i.e. which may be pending partial
      sums (`planner.ops.linearity`; proven by tests/test_op_registry.py). The search does
      not use this field yet: it reduces every partial sum before a consumer.
    - `rewrite`: the per-device program when the op is split, and the op types it emits.
    """

    op_type: str
    domain: str = DEFAULT_DOMAIN
    labels: Labeller | None = None
    work: Work = w.FLOOR
    matrix: bool = False
    linearity: Linearity = NOT_LINEAR
    rewrite: LocalRewrite | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.op_type)

    @property
    def qualified_type(self) -> str:
        return self.op_type if self.domain == DEFAULT_DOMAIN else f"{self.domain}::{self.op_type}"


# --------------------------------------------------------------------------- annotations

#: Elementwise ops broadcast every input against the output (numpy rules).
ELEMENTWISE = Annotation.parse("*, ... -> *")
#: Clip's bounds and CastLike's type donor are not data.
CLIP = Annotation.parse("*, ?, ? -> *")
CAST_LIKE = Annotation.parse("*, ? -> *")
#: Output and mask are shaped like the data; ratio and training_mode are scalars.
DROPOUT = Annotation.parse("*, ?, ? -> *, *")
#: The target shape is not data.
EXPAND = Annotation.parse("*, ? -> *")
#: MatMul by operand ranks: a vector operand has no m (or n) and no batch dims.
MATMUL = RankCases.parse({
    "matrix, matrix": "* m k+, * k+ n -> * m n",
    "vector, matrix": "k+, * k+ n -> * n",
    "matrix, vector": "* m k+, k+ -> * m",
    "vector, vector": "k+, k+ -> ",
})


def _elementwise(op_type: str, work: Work, linearity: Linearity = NOT_LINEAR,
                 labels: Labeller = ELEMENTWISE) -> OpRecord:
    return OpRecord(op_type, labels=labels, work=work, linearity=linearity)


_ELEMENTWISE_FLOPS: dict[str, float] = {
    "Pow": 4, "Max": 1, "Min": 1, "Equal": 1, "Less": 1, "Greater": 1, "LessOrEqual": 1,
    "GreaterOrEqual": 1, "And": 1, "Or": 1, "Xor": 1, "PRelu": 2, "BitShift": 1, "Mod": 2,
    "Abs": 1, "Relu": 1, "LeakyRelu": 2, "Sigmoid": 5, "Tanh": 6, "Erf": 6, "Exp": 4,
    "Log": 4, "Sqrt": 4, "Reciprocal": 1, "Sin": 4, "Cos": 4, "Gelu": 10, "Softplus": 6,
    "Elu": 5, "Selu": 5, "Celu": 5, "HardSigmoid": 3, "HardSwish": 4, "Mish": 12, "Sign": 1,
    "Floor": 1, "Ceil": 1, "Round": 1, "Not": 1, "IsNaN": 1, "IsInf": 1,
}

_RECORDS: list[OpRecord] = [
    # Elementwise, linear ones first.
    _elementwise("Add", w.per_output(1), JOINTLY),
    _elementwise("Sub", w.per_output(1), JOINTLY),
    _elementwise("Sum", w.per_output(1), JOINTLY),
    _elementwise("Mean", w.per_output(1), JOINTLY),
    _elementwise("Mul", w.per_output(1), in_any_one(0, 1)),
    _elementwise("Div", w.per_output(1), in_any_one(0)),  # the numerator
    _elementwise("Neg", w.per_output(1), IN_DATA),
    _elementwise("Where", w.DATA_MOVEMENT, jointly(1, 2)),  # the two branches
    _elementwise("Identity", w.VIEW, IN_DATA),
    _elementwise("Cast", w.DATA_MOVEMENT),
    _elementwise("CastLike", w.DATA_MOVEMENT, labels=CAST_LIKE),
    _elementwise("Clip", w.per_output(2), labels=CLIP),
    *[_elementwise(op, w.per_output(flops)) for op, flops in _ELEMENTWISE_FLOPS.items()],
    OpRecord("Dropout", labels=DROPOUT, work=w.per_output(2)),
    OpRecord("Expand", labels=EXPAND, work=w.DATA_MOVEMENT, linearity=IN_DATA,
             rewrite=rewrites.EXPAND_TARGET),
    # Contractions.
    OpRecord("MatMul", labels=MATMUL, work=w.MATMUL, matrix=True,
             linearity=in_any_one(0, 1)),
    OpRecord("Gemm", labels=contraction.gemm, work=w.GEMM, matrix=True,
             linearity=in_any_one(0, 1, with_=(2,)), rewrite=rewrites.GEMM_BIAS_ONCE),
    OpRecord("Einsum", labels=contraction.einsum, work=w.EINSUM, matrix=True,
             linearity=IN_EACH),
    OpRecord("Conv", labels=contraction.conv, work=w.CONV, matrix=True,
             linearity=in_any_one(0, 1, with_=(2,)), rewrite=rewrites.CONV_BIAS_ONCE),
    OpRecord("ConvTranspose", work=w.CONV_TRANSPOSE, matrix=True,
             linearity=in_any_one(0, 1, with_=(2,))),
    OpRecord("MatMulInteger", work=w.MATMUL, matrix=True),
    OpRecord("FusedMatMul", domain="com.microsoft", work=w.MATMUL, matrix=True),
    OpRecord("Attention", matrix=True),
    # Layout and data movement.
    OpRecord("Transpose", labels=movement.transpose, work=w.DATA_MOVEMENT, linearity=IN_DATA),
    OpRecord("Reshape", labels=movement.reshape, work=w.VIEW, linearity=IN_DATA,
             rewrite=rewrites.RESHAPE_TARGET),
    *[OpRecord(op, labels=movement.reshape, work=w.VIEW, linearity=IN_DATA)
      for op in ("Flatten", "Squeeze", "Unsqueeze")],
    OpRecord("Concat", labels=movement.concat, work=w.DATA_MOVEMENT, linearity=JOINTLY),
    OpRecord("Split", labels=movement.split, work=w.DATA_MOVEMENT, linearity=IN_DATA),
    OpRecord("Slice", labels=movement.slice_, work=w.DATA_MOVEMENT, linearity=IN_DATA),
    OpRecord("Tile", labels=movement.tile, work=w.DATA_MOVEMENT, linearity=IN_DATA),
    OpRecord("Gather", labels=indexing.gather, work=w.LOOKUP, linearity=IN_DATA,
             rewrite=rewrites.VOCAB_SPLIT_GATHER),
    OpRecord("GatherElements", labels=indexing.gather_elements, work=w.DATA_MOVEMENT,
             linearity=IN_DATA),
    OpRecord("GatherND", labels=indexing.gather_nd, work=w.DATA_MOVEMENT, linearity=IN_DATA),
    OpRecord("OneHot", labels=indexing.one_hot, work=w.DATA_MOVEMENT),
    OpRecord("Trilu", labels=axes.trilu, work=w.DATA_MOVEMENT, linearity=IN_DATA),
    OpRecord("TopK", labels=axes.topk, work=w.DATA_MOVEMENT),
    *[OpRecord(op, work=w.DATA_MOVEMENT) for op in (
        "Pad", "ScatterND", "ScatterElements", "ConstantOfShape", "Range", "Resize", "Shape",
        "Size", "Constant", "NonZero")],
    *[OpRecord(op, work=w.DATA_MOVEMENT, linearity=IN_DATA)
      for op in ("DepthToSpace", "SpaceToDepth")],
    # Softmax and normalisations: FLOPs per input element.
    OpRecord("Softmax", labels=axes.softmax, work=w.per_input(5)),
    OpRecord("LogSoftmax", labels=axes.softmax, work=w.per_input(6)),
    OpRecord("Hardmax", labels=axes.softmax),
    OpRecord("LayerNormalization", labels=axes.layer_norm, work=w.per_input(8)),
    OpRecord("SimplifiedLayerNormalization", labels=axes.layer_norm, work=w.per_input(6)),
    OpRecord("RMSNormalization", labels=axes.layer_norm, work=w.per_input(6)),
    OpRecord("BatchNormalization", labels=axes.batch_norm, work=w.per_input(6),
             rewrite=rewrites.SYNCED_BATCH_NORM),
    OpRecord("InstanceNormalization", labels=axes.instance_norm, work=w.per_input(8)),
    OpRecord("GroupNormalization", labels=axes.instance_norm, work=w.per_input(8)),
    # Reductions.
    OpRecord("ReduceSum", labels=axes.reduce, work=w.per_input(1), linearity=IN_DATA),
    OpRecord("ReduceMean", labels=axes.reduce, work=w.per_input(1), linearity=IN_DATA,
             rewrite=rewrites.MEAN_OF_SHARDS),
    *[OpRecord(op, labels=axes.reduce, work=w.per_input(flops)) for op, flops in (
        ("ReduceMax", 1), ("ReduceMin", 1), ("ReduceProd", 1), ("ReduceL1", 2),
        ("ReduceL2", 2), ("ReduceSumSquare", 2), ("ReduceLogSumExp", 5))],
    *[OpRecord(op, labels=axes.reduce, work=w.DATA_MOVEMENT) for op in ("ArgMax", "ArgMin")],
    OpRecord("CumSum", labels=axes.cumsum, work=w.per_input(1), linearity=IN_DATA),
    # Pools.
    OpRecord("MaxPool", labels=axes.pool, work=w.POOL, rewrite=rewrites.GLOBAL_POOL_INDICES),
    OpRecord("AveragePool", labels=axes.pool, work=w.POOL, linearity=IN_DATA),
    OpRecord("LpPool", labels=axes.pool, work=w.POOL),
    OpRecord("GlobalAveragePool", labels=axes.pool, work=w.per_input(1), linearity=IN_DATA),
    OpRecord("GlobalMaxPool", labels=axes.pool, work=w.per_input(1)),
]

#: Every record by (domain, op type). Read at every lookup, so tests may patch entries.
RECORDS: dict[tuple[str, str], OpRecord] = {}
for _record in _RECORDS:
    if _record.key in RECORDS:
        raise AssertionError(f"two records for {_record.qualified_type}")
    RECORDS[_record.key] = _record

_MATRIX_OPS = frozenset(record.op_type for record in RECORDS.values() if record.matrix)


def _domain(domain: str) -> str:
    return DEFAULT_DOMAIN if domain == "ai.onnx" else domain


def record_for(op_type: str, domain: str = DEFAULT_DOMAIN) -> OpRecord | None:
    """The record of one op type (domain "" or "ai.onnx" for ONNX's own), or None."""
    return RECORDS.get((_domain(domain), op_type))


def labels_for(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels | None:
    """The op's labelling, or None when shardplan has no rule for it (kept replicated).

    Raises `NoRule` when the rule declines this instance; `safe_labels` returns None then.
    """
    record = record_for(node.op_type, node.domain)
    if record is None or record.labels is None:
        return None
    return record.labels(node, tensors)


def safe_labels(node: OpNode, tensors: Mapping[str, TensorInfo]) -> DimLabels | None:
    """labels_for, but None also when the rule declines this particular instance."""
    try:
        return labels_for(node, tensors)
    except NoRule:
        return None


def replicated_labels(node: OpNode) -> DimLabels:
    """The labelling of an op planned replicated: no input or output dim labelled."""
    return DimLabels(tuple(None for _ in node.inputs), tuple(None for _ in node.outputs))


def is_matrix_op(op_type: str) -> bool:
    """Whether the op's FLOPs run on matrix units (whatever its domain)."""
    return op_type in _MATRIX_OPS


def ruled_op_types() -> frozenset[str]:
    """Qualified op types with a sharding rule (a labelling)."""
    return frozenset(r.qualified_type for r in RECORDS.values() if r.labels is not None)
