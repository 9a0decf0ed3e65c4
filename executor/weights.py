"""The weights a model stores, read for a run, or the reason they cannot be.

A model's initializers are inline, or external data in files beside it. Planning never
reads them; a run must, and must not quietly train on something else: a weights file
that is truncated, a folder, a FIFO or present for some tensors only is refused naming
the tensor. Only a model whose every external weight is absent (the zoo's planning
graphs, shape-only exports, a weights file deleted whole) runs on weights drawn from the
seed, and the run says so (`StoredWeights.absent`).
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from planner.errors import ModelError


@dataclass(frozen=True)
class StoredWeights:
    """The values the model stores, and the external tensors it declares without data."""

    values: dict[str, np.ndarray] = field(default_factory=dict)
    absent: tuple[str, ...] = ()

    @property
    def note(self) -> str:
        """One line for the run's output when weights are drawn rather than read."""
        if not self.absent:
            return ""
        return (f"weights: {len(self.absent)} of the model's initializers have no data "
                "(their external file is absent), so the run trains on weights drawn from "
                "--seed; give the model its weights file to train on its own")


def read_weights(path: str | os.PathLike, *, load: bool = True) -> StoredWeights:
    """Read every initializer `path` stores (only check the files when not `load`);
    refuse external data that is there but unreadable, or there for some tensors and not
    for others."""
    file = Path(path)
    model = onnx.load(str(file), load_external_data=False)
    values: dict[str, np.ndarray] = {}
    absent: list[str] = []
    present: list[str] = []
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            if load:
                values[init.name] = numpy_helper.to_array(init)
            continue
        if _external_file(init, file) is None:
            absent.append(init.name)
            continue
        present.append(init.name)
        if load:
            external_data_helper.load_external_data_for_tensor(init, str(file.parent))
            values[init.name] = numpy_helper.to_array(init)
    if absent and present:
        raise ModelError(
            f"{file}: initializer {absent[0]} has no data (its external file is absent) "
            f"while {present[0]} has: the weights are incomplete; save the model again with "
            "all its weights")
    return StoredWeights(values, tuple(absent))


def _external_file(init: onnx.TensorProto, model: Path) -> Path | None:
    """The regular file holding `init`'s data, None when it does not exist; an error when
    it is not a regular file or too short for the tensor."""
    entries = {entry.key: entry.value for entry in init.external_data}
    location = model.parent / entries.get("location", "")
    try:
        mode = location.stat().st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        raise ModelError(f"{model}: initializer {init.name} keeps its data in {location}, "
                         "which is not a regular file; put the model's weights file there")
    offset = int(entries.get("offset", 0))
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    length = int(entries.get("length", math.prod(init.dims) * itemsize))
    size = location.stat().st_size
    if offset + length > size:
        raise ModelError(
            f"{model}: initializer {init.name} needs bytes {offset}..{offset + length} of "
            f"{location}, which has {size}: the weights file is truncated; save the model "
            "again")
    return location
