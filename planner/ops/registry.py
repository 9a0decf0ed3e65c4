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
from planner.ops import saving as s
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
    - `saves`: what autograd keeps of it for the backward pass (`planner.ops.saving`).
    """

    op_type: str
    domain: str = DEFAULT_DOMAIN
    labels: Labeller | None = None
    work: Work = w.FLOOR
    matrix: bool = False
    linearity: Linearity = NOT_LINEAR
    rewrite: LocalRewrite | None = None
    saves: s.Saves = s.UNKNOWN

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
                 labels: Labeller = ELEMENTWISE, saves: s.Saves = s.NOTHING) -> OpRecord:
    return OpRecord(op_type, labels=labels, work=work, linearity=linearity, saves=saves)


#: FLOPs per output element, and what autograd keeps (comparisons and rounding carry no
#: gradient: their outputs are not float or have a zero derivative).
_ELEMENTWISE: dict[str, tuple[float, s.Saves]] = {
    "Pow": (4, s.POWER), "Max": (1, s.OPERANDS), "Min": (1, s.OPERANDS),
    "Equal": (1, s.NOTHING), "Less": (1, s.NOTHING), "Greater": (1, s.NOTHING),
    "LessOrEqual": (1, s.NOTHING), "GreaterOrEqual": (1, s.NOTHING), "And": (1, s.NOTHING),
    "Or": (1, s.NOTHING), "Xor": (1, s.NOTHING), "PRelu": (2, s.OPERANDS),
    "BitShift": (1, s.NOTHING), "Mod": (2, s.NOTHING), "Abs": (1, s.INPUT),
    "Relu": (1, s.OUTPUT), "LeakyRelu": (2, s.INPUT), "Sigmoid": (5, s.OUTPUT),
    "Tanh": (6, s.OUTPUT), "Erf": (6, s.ERROR_FUNCTION), "Exp": (4, s.OUTPUT), "Log": (4, s.INPUT),
    "Sqrt": (4, s.SQUARE_ROOT), "Reciprocal": (1, s.RECIPROCAL), "Sin": (4, s.SINE),
    "Cos": (4, s.COSINE), "Gelu": (10, s.INPUT), "Softplus": (6, s.INPUT),
    "Elu": (5, s.INPUT), "Selu": (5, s.INPUT), "Celu": (5, s.INPUT),
    "HardSigmoid": (3, s.INPUT), "HardSwish": (4, s.INPUT), "Mish": (12, s.INPUT),
    "Sign": (1, s.NOTHING), "Floor": (1, s.NOTHING), "Ceil": (1, s.NOTHING),
    "Round": (1, s.NOTHING), "Not": (1, s.NOTHING), "IsNaN": (1, s.NOTHING),
    "IsInf": (1, s.NOTHING),
}

_RECORDS: list[OpRecord] = [
    # Elementwise, linear ones first.
    _elementwise("Add", w.per_output(1), JOINTLY, saves=s.SUM),
    _elementwise("Sub", w.per_output(1), JOINTLY, saves=s.DIFFERENCE),
    _elementwise("Sum", w.per_output(1), JOINTLY, saves=s.SUM),
    _elementwise("Mean", w.per_output(1), JOINTLY),
    _elementwise("Mul", w.per_output(1), in_any_one(0, 1), saves=s.OPERANDS),
    _elementwise("Div", w.per_output(1), in_any_one(0), saves=s.QUOTIENT),  # the numerator
    _elementwise("Neg", w.per_output(1), IN_DATA),
    _elementwise("Where", w.DATA_MOVEMENT, jointly(1, 2), saves=s.CONDITION),  # the branches
    _elementwise("Identity", w.VIEW, IN_DATA, saves=s.IDENTITY),
    _elementwise("Cast", w.DATA_MOVEMENT),
    _elementwise("CastLike", w.DATA_MOVEMENT, labels=CAST_LIKE),
    _elementwise("Clip", w.per_output(2), labels=CLIP, saves=s.INPUT),
    *[_elementwise(op, w.per_output(flops), saves=saves)
      for op, (flops, saves) in _ELEMENTWISE.items()],
    OpRecord("Dropout", labels=DROPOUT, work=w.per_output(2), saves=s.MASK),
    OpRecord("Expand", labels=EXPAND, work=w.DATA_MOVEMENT, linearity=IN_DATA,
             rewrite=rewrites.EXPAND_TARGET, saves=s.NOTHING),
    # Contractions: each operand kept for the other's gradient.
    OpRecord("MatMul", labels=MATMUL, work=w.MATMUL, matrix=True,
             linearity=in_any_one(0, 1), saves=s.OPERANDS),
    OpRecord("Gemm", labels=contraction.gemm, work=w.GEMM, matrix=True,
             linearity=in_any_one(0, 1, with_=(2,)), rewrite=rewrites.GEMM_BIAS_ONCE,
             saves=s.BIASED_OPERANDS),
    OpRecord("Einsum", labels=contraction.einsum, work=w.EINSUM, matrix=True,
             linearity=IN_EACH, saves=s.OPERANDS),
    OpRecord("Conv", labels=contraction.conv, work=w.CONV, matrix=True,
             linearity=in_any_one(0, 1, with_=(2,)), rewrite=rewrites.CONV_BIAS_ONCE,
             saves=s.BIASED_OPERANDS),
    OpRecord("ConvTranspose", work=w.CONV_TRANSPOSE, matrix=True,
             linearity=in_any_one(0, 1, with_=(2,)), saves=s.BIASED_OPERANDS),
    OpRecord("MatMulInteger", work=w.MATMUL, matrix=True, saves=s.OPERANDS),
    OpRecord("FusedMatMul", domain="com.microsoft", work=w.MATMUL, matrix=True,
             saves=s.OPERANDS),
    # Opset 23's fused attention: q, k, v and its output (the kernel plan adds the
    # softmax statistics a flash kernel keeps).
    OpRecord("Attention", work=w.ATTENTION, matrix=True,
             saves=s.Saves(inputs=(0, 1, 2), outputs=(0,))),
    # Layout and data movement: nothing to keep but shapes and indices.
    OpRecord("Transpose", labels=movement.transpose, work=w.DATA_MOVEMENT, linearity=IN_DATA,
             saves=s.NOTHING),
    OpRecord("Reshape", labels=movement.reshape, work=w.VIEW, linearity=IN_DATA,
             rewrite=rewrites.RESHAPE_TARGET, saves=s.NOTHING),
    *[OpRecord(op, labels=movement.reshape, work=w.VIEW, linearity=IN_DATA, saves=s.NOTHING)
      for op in ("Flatten", "Squeeze", "Unsqueeze")],
    OpRecord("Concat", labels=movement.concat, work=w.DATA_MOVEMENT, linearity=JOINTLY,
             saves=s.CONCATENATION),
    OpRecord("Split", labels=movement.split, work=w.DATA_MOVEMENT, linearity=IN_DATA,
             saves=s.NOTHING),
    OpRecord("Slice", labels=movement.slice_, work=w.DATA_MOVEMENT, linearity=IN_DATA,
             saves=s.NOTHING),
    OpRecord("Tile", labels=movement.tile, work=w.DATA_MOVEMENT, linearity=IN_DATA,
             saves=s.NOTHING),
    OpRecord("Gather", labels=indexing.gather, work=w.LOOKUP, linearity=IN_DATA,
             rewrite=rewrites.VOCAB_SPLIT_GATHER, saves=s.Saves(inputs=(1,))),
    OpRecord("GatherElements", labels=indexing.gather_elements, work=w.DATA_MOVEMENT,
             linearity=IN_DATA, saves=s.Saves(inputs=(1,))),
    OpRecord("GatherND", labels=indexing.gather_nd, work=w.DATA_MOVEMENT, linearity=IN_DATA,
             saves=s.Saves(inputs=(1,))),
    OpRecord("OneHot", labels=indexing.one_hot, work=w.DATA_MOVEMENT, saves=s.NOTHING),
    OpRecord("Trilu", labels=axes.trilu, work=w.DATA_MOVEMENT, linearity=IN_DATA,
             saves=s.NOTHING),
    OpRecord("TopK", labels=axes.topk, work=w.DATA_MOVEMENT, saves=s.Saves(outputs=(1,))),
    *[OpRecord(op, work=w.DATA_MOVEMENT, saves=s.NOTHING) for op in (
        "ScatterND", "ConstantOfShape", "Range", "Resize", "Shape", "Size",
        "Constant")],
    # index_add as exported; a router's token selection (sized by planner.importer.routing)
    OpRecord("ScatterElements", labels=indexing.scatter_elements, work=w.DATA_MOVEMENT,
             saves=s.Saves(inputs=(1,))),
    OpRecord("Pad", labels=axes.pad, work=w.DATA_MOVEMENT, saves=s.NOTHING),
    OpRecord("NonZero", labels=indexing.all_whole, work=w.DATA_MOVEMENT, saves=s.NOTHING),
    *[OpRecord(op, work=w.DATA_MOVEMENT, linearity=IN_DATA, saves=s.NOTHING)
      for op in ("DepthToSpace", "SpaceToDepth")],
    # Recurrences: the batch splits; each step's GEMMs on the matrix units. Autograd keeps
    # the input and the output (and the kernels their gates' workspace, not counted); the
    # backward pass reads W, R and B (torch's RNN kernels keep the parameters).
    *[OpRecord(op, labels=axes.recurrent, work=w.RECURRENT, matrix=True,
               saves=s.Saves(inputs=(0,), outputs=(0,), reads=(1, 2, 3)))
      for op in ("RNN", "GRU", "LSTM")],
    # Softmax and normalisations: FLOPs per input element.
    OpRecord("Softmax", labels=axes.softmax, work=w.per_input(5), saves=s.OUTPUT),
    OpRecord("LogSoftmax", labels=axes.softmax, work=w.per_input(6), saves=s.OUTPUT),
    OpRecord("Hardmax", labels=axes.softmax, saves=s.NOTHING),
    OpRecord("LayerNormalization", labels=axes.layer_norm, work=w.per_input(8),
             saves=s.norm(2, reads=(1, 2))),
    OpRecord("SimplifiedLayerNormalization", labels=axes.layer_norm, work=w.per_input(6),
             saves=s.norm(1)),
    OpRecord("RMSNormalization", labels=axes.layer_norm, work=w.per_input(6),
             saves=s.norm(1)),
    OpRecord("BatchNormalization", labels=axes.batch_norm, work=w.per_input(6),
             rewrite=rewrites.SYNCED_BATCH_NORM, saves=s.SCALED_INPUT),
    OpRecord("InstanceNormalization", labels=axes.instance_norm, work=w.per_input(8),
             saves=s.SCALED_INPUT),
    OpRecord("GroupNormalization", labels=axes.instance_norm, work=w.per_input(8),
             saves=s.SCALED_INPUT),
    # Reductions.
    OpRecord("ReduceSum", labels=axes.reduce, work=w.per_input(1), linearity=IN_DATA,
             saves=s.NOTHING),
    OpRecord("ReduceMean", labels=axes.reduce, work=w.per_input(1), linearity=IN_DATA,
             rewrite=rewrites.MEAN_OF_SHARDS, saves=s.NOTHING),
    *[OpRecord(op, labels=axes.reduce, work=w.per_input(flops), saves=saves)
      for op, flops, saves in (
          ("ReduceMax", 1, s.INPUT_AND_OUTPUT), ("ReduceMin", 1, s.INPUT_AND_OUTPUT),
          ("ReduceProd", 1, s.INPUT_AND_OUTPUT), ("ReduceL1", 2, s.INPUT),
          ("ReduceL2", 2, s.INPUT_AND_OUTPUT), ("ReduceSumSquare", 2, s.INPUT),
          ("ReduceLogSumExp", 5, s.INPUT_AND_OUTPUT))],
    *[OpRecord(op, labels=axes.reduce, work=w.DATA_MOVEMENT, saves=s.NOTHING)
      for op in ("ArgMax", "ArgMin")],
    OpRecord("CumSum", labels=axes.cumsum, work=w.per_input(1), linearity=IN_DATA,
             saves=s.NOTHING),
    # Pools.
    OpRecord("MaxPool", labels=axes.pool, work=w.POOL, rewrite=rewrites.GLOBAL_POOL_INDICES,
             saves=s.INPUT_AND_OUTPUT),
    OpRecord("AveragePool", labels=axes.pool, work=w.POOL, linearity=IN_DATA,
             saves=s.NOTHING),
    OpRecord("LpPool", labels=axes.pool, work=w.POOL, saves=s.INPUT_AND_OUTPUT),
    OpRecord("GlobalAveragePool", labels=axes.pool, work=w.per_input(1), linearity=IN_DATA,
             saves=s.NOTHING),
    OpRecord("GlobalMaxPool", labels=axes.pool, work=w.per_input(1),
             saves=s.INPUT_AND_OUTPUT),
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


def saves_of(node: OpNode) -> s.Saves:
    """What autograd keeps of `node` (its record's rule; every float output of an op
    shardplan has no record of)."""
    record = record_for(node.op_type, node.domain)
    return s.UNKNOWN if record is None else record.saves


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
