"""The planning graph: an ONNX forward pass reduced to tensor ops with static shapes.

It holds what planning needs and nothing that needs weight data: shapes, dtypes, which
tensors are trainable parameters, and per-op FLOPs and bytes. Shape arithmetic of the
exported graph has already been folded away by the importer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, Protocol

import numpy as np


class RetainedModel(Protocol):
    """What a planning graph keeps of its model so that other dims can be bound without
    the file (`planner.importer.source.ModelSource` is the one kind there is). Read-only:
    the source is a frozen dataclass."""

    @property
    def path(self) -> str: ...

    @property
    def sha256(self) -> str: ...

    @property
    def opset(self) -> int: ...

TensorKind = Literal["input", "parameter", "buffer", "constant", "activation"]


@cache  # asked for every tensor of every choice priced; numpy's lookup is slow
def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name as the importer records it (numpy's names, plus
    bfloat16, which numpy lacks)."""
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


#: Tokens an expert may take as a multiple of its even share: Switch Transformer's
#: training default (Fedus et al. 2022, sec. 2.2 and table 1: 1.0 and 1.25 compared).
DEFAULT_CAPACITY_FACTOR = 1.25


@dataclass(frozen=True)
class RoutedSelection:
    """A data-dependent token selection of a mixture-of-experts router, planned at a
    static count (`planner.importer.routing`): the `NonZero` `node` picks the tokens the
    `TopK` `router` sent to one expert (or the experts that got any), and the plan sizes
    its result at `count` entries, `capacity_factor` times the tokens an expert gets
    when the router balances them evenly (top_k of `experts` for each of `tokens`)."""

    node: str
    router: str
    experts: int
    top_k: int
    tokens: int
    count: int
    per_expert: bool  # True: tokens of one expert; False: which experts got tokens

    @property
    def balanced(self) -> float:
        """Tokens one expert gets when the router spreads them evenly."""
        return self.tokens * self.top_k / self.experts

    def to_json(self) -> dict[str, object]:
        return {"op": self.node, "router": self.router, "experts": self.experts,
                "top_k": self.top_k, "tokens": self.tokens, "count": self.count,
                "per_expert": self.per_expert}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoutedSelection:
        return cls(str(data["op"]), str(data["router"]), int(data["experts"]),
                   int(data["top_k"]), int(data["tokens"]), int(data["count"]),
                   bool(data["per_expert"]))


@dataclass(frozen=True)
class SourceName:
    """The module parameter an initializer holds, where an exporter renamed it
    (`planner.importer.names`); `transposed`: stored as its 2-D transpose, so the
    initializer's dim 0 is the parameter's dim 1."""

    name: str
    transposed: bool = False

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "transposed": self.transposed}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> SourceName:
        return cls(str(data["name"]), bool(data.get("transposed", False)))


@dataclass
class TensorInfo:
    """One value of the graph: its static shape, element type and role."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32", "int64"
    kind: TensorKind
    producer: str | None = None  # name of the op that writes it; None for inputs/initializers
    consumers: list[str] = field(default_factory=list)
    value: np.ndarray | None = None  # known value of small constants (folded shapes, scalars)
    source: SourceName | None = None  # the module's name for a renamed parameter

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # exact, where an int64 product would wrap around

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


@dataclass
class OpNode:
    """One compute op with its cost figures for the whole (unsharded) op."""

    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]  # "" marks an omitted optional input
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    is_view: bool = False  # reshapes and friends move no data

    @property
    def qualified_type(self) -> str:
        return self.op_type if self.domain in ("", "ai.onnx") else f"{self.domain}::{self.op_type}"


@dataclass
class PlanningGraph:
    """Ops in topological order plus every tensor they touch."""

    path: str
    sha256: str
    opset: int
    bound_dims: dict[str, int]
    batch: int | None  # the bound batch size (None when the model has no batch axis)
    batch_inputs: dict[str, int]  # graph input -> index of its batch dim
    ops: list[OpNode]
    tensors: dict[str, TensorInfo]
    inputs: list[str]
    outputs: list[str]
    warnings: list[str] = field(default_factory=list)
    batch_symbol: str | None = None  # the symbolic name of the batch dim, if it has one
    #: The prepared model it was imported from, to bind other dims without the file
    #: (`planner.importer.rebind`); None for graphs not made by the importer.
    source: RetainedModel | None = field(default=None, compare=False, repr=False)
    #: The float dtype its float tensors were re-typed to for a training precision
    #: (`planner.importer.retyped`); None: as the file stores them. Rebinding keeps it.
    float_dtype: str | None = None
    #: The routers' token selections planned at a static capacity, by NonZero node.
    routed: dict[str, RoutedSelection] = field(default_factory=dict)
    #: Tokens each expert may take, as a multiple of an even share: what sizes `routed`.
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR
    #: graph input -> index of its sequence dim (`planner.importer.bind.sequence_dims`):
    #: what context parallelism splits; empty when no input has one
    sequence_inputs: dict[str, int] = field(default_factory=dict)
    #: op -> the exported program's node it was decomposed from, where the exporter names
    #: it (torch's dynamo exporter: `nn.Linear`'s one `aten.linear` becomes Transpose,
    #: MatMul and Add): a pipeline stage takes such a node whole (`planner.layers`)
    source_ops: dict[str, str] = field(default_factory=dict)

    @property
    def sequence(self) -> int | None:
        """The bound sequence length the sequence inputs share; None without one."""
        lengths = {self.tensors[name].shape[dim] for name, dim in self.sequence_inputs.items()}
        return lengths.pop() if len(lengths) == 1 else None

    @property
    def stored_float_dtype(self) -> str:
        """The float dtype its weights (else its float tensors) have: what a precision
        left unset defaults from."""
        floats = [t for t in self.parameters if t.is_float] or [
            t for t in self.tensors.values() if t.is_float]
        return floats[0].dtype if floats else "float32"

    def op(self, name: str) -> OpNode:
        return self._ops_by_name()[name]

    def has_op(self, name: str) -> bool:
        return name in self._ops_by_name()

    def _ops_by_name(self) -> dict[str, OpNode]:
        """The ops by name, built once (again only if the op list changed length)."""
        index = self.__dict__.get("_op_index")
        if index is None or len(index) != len(self.ops):
            index = {node.name: node for node in self.ops}
            self.__dict__["_op_index"] = index
        return index

    @property
    def parameters(self) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.kind == "parameter"]

    @property
    def parameter_count(self) -> int:
        return sum(t.numel for t in self.parameters)

    @property
    def parameter_bytes(self) -> int:
        return sum(t.nbytes for t in self.parameters)

    @property
    def total_flops(self) -> float:
        return float(sum(node.flops for node in self.ops))

    def op_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.ops:
            counts[node.qualified_type] = counts.get(node.qualified_type, 0) + 1
        return dict(sorted(counts.items()))

    def to_networkx(self):
        """A DiGraph of ops (edges carry the tensor name) for graph algorithms."""
        import networkx as nx

        dag = nx.DiGraph()
        for node in self.ops:
            dag.add_node(node.name, op_type=node.op_type)
        for node in self.ops:
            for tensor in node.inputs:
                producer = self.tensors[tensor].producer if tensor else None
                if producer is not None:
                    dag.add_edge(producer, node.name, tensor=tensor)
        return dag
