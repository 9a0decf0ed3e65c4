"""The retained source of a planning graph: its prepared model, kept so that other dims
can be bound without the file.

`import_model` keeps the model as it stands after loading and preparing (opset checked,
local functions inlined, nodes named): everything that comes before binding the dims.
Float initializers whose data no later stage reads (weights: see
`fold.unread_float_initializers`) keep their dims and element type but lose their data, so
a model with large inline weights does not sit in memory twice. The graphs bound from a
source are kept on it, one per binding, so each binding is inferred and folded once; they
are shared, so treat them as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx

from planner.importer.bind import BindingKey
from planner.importer.fold import unread_float_initializers
from planner.importer.tensors import DATA_FIELDS

if TYPE_CHECKING:
    from planner.graph import PlanningGraph


@dataclass(frozen=True, eq=False)
class ModelSource:
    """The prepared model (serialized, weights stripped), the path it was read from (for
    messages), the file's sha256 and the model's default-domain opset."""

    proto: bytes = field(repr=False)
    path: str
    sha256: str
    opset: int
    #: by binding and capacity factor
    graphs: dict[tuple[BindingKey, float], PlanningGraph] = field(default_factory=dict,
                                                                  repr=False)

    @classmethod
    def retain(cls, model: onnx.ModelProto, path: str, sha256: str, opset: int) -> ModelSource:
        """The source of a prepared `model`, whose unread weights are stripped in place
        (binding it gives the same graph as before, and infers shapes faster)."""
        for tensor in unread_float_initializers(model):
            for name in DATA_FIELDS:
                tensor.ClearField(name)
        return cls(model.SerializeToString(), path, sha256, opset)

    def model(self) -> onnx.ModelProto:
        """A fresh copy of the prepared model, to bind."""
        return onnx.ModelProto.FromString(self.proto)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to search workers) without the bound graphs: they hold this source."""
        return {**self.__dict__, "graphs": {}}
