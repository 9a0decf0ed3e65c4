"""The ops layer: what each ONNX op type is, in one registry.

One frozen `OpRecord` per op type carries its labelling (einsum-style `DimLabels`, from a
declarative annotation or a function), its FLOP/byte work class, whether it runs on
matrix units, in which inputs it is linear, and its per-device local rewrite.

This layer sits just above the graph types: it imports `planner.errors`, `planner.graph`
and third-party libraries only, never the sharding, cost, or search layers, which build
on it.

| module | job |
| --- | --- |
| `labels.py` | `DimLabels`, the label namer, broadcasting and attribute helpers |
| `annotation.py` | the annotation language, parsed into labelling functions |
| `contraction.py`, `movement.py`, `axes.py`, `indexing.py` | labellings of irregular ops |
| `work.py` | FLOP/byte work classes and their counts |
| `linearity.py` | in which inputs an op is linear |
| `program.py` | `LocalProgram`, the `LocalContext` protocol, `LocalRewrite` |
| `rewrites.py` | the local rewrites |
| `registry.py` | the records and their lookups |
| `counting.py` | `cost_op`: FLOPs and bytes of one op |
"""

from planner.ops.counting import cost_op
from planner.ops.labels import DimLabels, Labels, NoRule
from planner.ops.program import (
    SHARDPLAN_DOMAIN,
    LocalContext,
    LocalProgram,
    LocalRewrite,
    node_proto,
)
from planner.ops.registry import (
    RECORDS,
    OpRecord,
    is_matrix_op,
    labels_for,
    record_for,
    replicated_labels,
    ruled_op_types,
    safe_labels,
    saves_of,
)

__all__ = [
    "RECORDS", "SHARDPLAN_DOMAIN", "DimLabels", "Labels", "LocalContext", "LocalProgram",
    "LocalRewrite", "NoRule", "OpRecord", "cost_op", "is_matrix_op", "labels_for",
    "node_proto", "record_for", "replicated_labels", "ruled_op_types", "safe_labels",
    "saves_of",
]
