"""`--data DIR` checked before any rank starts: the arrays a run reads instead of
synthetic data must all be there, with the step's shapes, a dtype of the input's kind,
and token ids inside the vocabulary they index. A folder that does not hold them is
refused naming the file: never silently replaced by synthetic data."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from planner.errors import ShardplanError
from planner.graph import PlanningGraph


def _load(path: Path) -> np.ndarray:
    if not path.is_file():
        raise ShardplanError(f"{path}: missing; --data needs one <input>.npy per model input "
                             "(and targets.npy for the ce and mse losses)")
    try:
        found = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ShardplanError(f"{path}: not a numpy array file ({exc}); write it with "
                             "numpy.save") from None
    if not isinstance(found, np.ndarray):  # numpy.savez's archive, named .npy
        raise ShardplanError(f"{path}: an archive of arrays (numpy.savez), not one array; "
                             "write each array with numpy.save")
    if not found.dtype.isnative:
        raise ShardplanError(f"{path}: stored in the other byte order ({found.dtype.str}); "
                             "write it in this machine's: numpy.save(path, "
                             "array.astype(array.dtype.newbyteorder('=')))")
    if found.dtype.kind == "f" and found.size and not np.isfinite(found).all():
        raise ShardplanError(f"{path}: holds NaN or infinite values; the losses would be "
                             "NaN: clean the data")
    return found


def global_shape(graph: PlanningGraph, name: str, micro_batches: int,
                 batch_dim: int | None) -> tuple[int, ...]:
    """The shape of `name` over the whole step: its batch dim × micro_batches."""
    shape = list(graph.tensors[name].shape)
    if batch_dim is not None and micro_batches > 1:
        shape[batch_dim] *= micro_batches
    return tuple(shape)


def check_data(graph: PlanningGraph, data: str, kind: str, output: str,
               micro_batches: int = 1, rows_dim: int = 0) -> None:
    """`graph` at the plan's micro-batch: the data hold `micro_batches` of them (the
    targets along the output's batch dim, `rows_dim`). A cross-entropy whose classes dim
    (the last) is the batch's has no targets to cut into rows: refused."""
    written = graph.tensors[output].shape
    if kind == "ce" and len(written) > 1 and rows_dim == len(written) - 1:
        raise ShardplanError(f"--loss ce reads the classes along the last dim of {output} "
                             f"{list(written)}, which holds the batch: export the model with "
                             "the classes last, or give --loss mse")
    if not data:
        return
    folder = Path(data)
    if not folder.is_dir():
        raise ShardplanError(f"--data {folder}: not a folder; give the folder holding "
                             "<input>.npy (and targets.npy)")
    for name in graph.inputs:
        info = graph.tensors[name]
        path = folder / f"{name}.npy"
        array = _load(path)
        shape = list(global_shape(graph, name, micro_batches, graph.batch_inputs.get(name)))
        if list(array.shape) != shape:
            raise ShardplanError(f"{path}: shape {list(array.shape)}, but input {name} is "
                                 f"{shape} in the plan's step")
        integer = info.dtype.startswith(("int", "uint"))
        if integer != np.issubdtype(array.dtype, np.integer) or array.dtype.kind not in "iuf":
            raise ShardplanError(f"{path}: dtype {array.dtype}, but input {name} is "
                                 f"{info.dtype}")
        for consumer in info.consumers:
            op = graph.op(consumer)
            if op.op_type == "Gather" and len(op.inputs) > 1 and op.inputs[1] == name \
                    and array.size:
                rows = graph.tensors[op.inputs[0]].shape[0]
                low, high = int(array.min()), int(array.max())
                if low < -rows or high >= rows:
                    raise ShardplanError(f"{path}: ids from {low} to {high}, but {op.name} "
                                         f"looks them up in a table of {rows} rows")
    if kind in ("ce", "mse"):
        targets = _load(folder / "targets.npy")
        wanted = list(global_shape(graph, output, micro_batches, rows_dim))
        expected = wanted[:-1] if kind == "ce" else wanted
        if list(targets.shape) != expected:
            raise ShardplanError(f"{folder / 'targets.npy'}: shape {list(targets.shape)}, but "
                                 f"the {kind} loss of {output} wants {expected}")
        if kind == "ce" and targets.size:
            classes = wanted[-1]
            if not np.issubdtype(targets.dtype, np.integer) or int(targets.min()) < 0 \
                    or int(targets.max()) >= classes:
                raise ShardplanError(f"{folder / 'targets.npy'}: class targets must be "
                                     f"integers in 0..{classes - 1}")
