"""What a module's export declares about its initializers, in the model's metadata.

An ONNX file says which initializers exist, not what they are to training. The module
executor's export (`executor.module.trace`) names, each as a JSON list: the module's
buffers (state no optimizer updates), its frozen parameters (`requires_grad=False`), and
its trained parameters of at most one element (a learnable temperature, the bias of a
`Linear(n, 1)`), which a file's scalar initializers would otherwise be taken for: a
constant the folder may read and nothing trains.
"""

from __future__ import annotations

import json

import onnx

MODULE_BUFFERS_KEY = "shardplan.buffers"
MODULE_FROZEN_KEY = "shardplan.frozen"
MODULE_SCALARS_KEY = "shardplan.scalar_parameters"


def _declared(model: onnx.ModelProto, *keys: str) -> list[str]:
    """The names listed under `keys`; [] where none is, or not as a list of names."""
    found: list[str] = []
    for entry in model.metadata_props:
        if entry.key in keys:
            try:
                names = json.loads(entry.value)
            except ValueError:
                continue
            if isinstance(names, list):
                found += [n for n in names if isinstance(n, str)]
    return found


def declared_state(model: onnx.ModelProto) -> list[str]:
    """The initializers the metadata names as buffers or frozen parameters: state the
    module keeps (`register_buffer`, a weight it does not train), which no optimizer
    updates and no gradient reaches."""
    return _declared(model, MODULE_BUFFERS_KEY, MODULE_FROZEN_KEY)


def declared_scalar_parameters(model: onnx.ModelProto) -> frozenset[str]:
    """The trained parameters of at most one element the metadata names."""
    return frozenset(_declared(model, MODULE_SCALARS_KEY))
