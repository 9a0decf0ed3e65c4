"""Count the collectives DTensor issues, by kind, mesh axes and phase, in the keys the
plan's counts use ("all_gather|tp|forward"), so a run can be compared with its plan.

DTensor issues its collectives as torch's functional collectives (`_c10d_functional`),
each naming the process group it runs on; a dispatch mode sees every one (as torch's own
`CommDebugMode` does), those a DTensor op's sharding rule issues inside the op included,
and maps the group back to the mesh axis it belongs to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from planner.kinds import CollectiveKind

_FUNCTIONAL = torch.ops._c10d_functional
_KINDS = {
    _FUNCTIONAL.all_reduce: CollectiveKind.ALL_REDUCE,
    _FUNCTIONAL.all_gather_into_tensor: CollectiveKind.ALL_GATHER,
    _FUNCTIONAL.reduce_scatter_tensor: CollectiveKind.REDUCE_SCATTER,
    _FUNCTIONAL.all_to_all_single: CollectiveKind.ALL_TO_ALL,
}


def group_axes(mesh: TorchMesh) -> dict[str, tuple[str, ...]]:
    """Process group name -> the mesh axis it spans (DTensor uses one group per axis)."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {mesh.get_group(i).group_name: (names[i],) for i in range(mesh.ndim)}


_RECOMPUTING: ContextVar[bool] = ContextVar("recomputing", default=False)


@contextmanager
def recomputing(active: bool = True) -> Iterator[None]:
    """While a checkpointed segment is recomputed in the backward pass, the forward
    collectives it issues again count as phase "recompute" (the plan lists each once)."""
    token = _RECOMPUTING.set(active)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


class CollectiveCount(TorchDispatchMode):
    """Inside `with CollectiveCount(counts, axes, phase):` every functional collective adds
    one to `counts["kind|axes|phase"]` ("recompute" as the phase inside `recomputing`)."""

    def __init__(self, counts: Counter, axes: dict[str, tuple[str, ...]], phase: str) -> None:
        super().__init__()
        self.counts, self.axes, self.phase = counts, axes, phase

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run the op first: the collectives it issues inside (a
            # redistribution its sharding rule asks for) then reach this mode as the
            # plain functional collectives they are. (A mode runs before subclasses, and
            # is off while its own handler calls the op: a collective issued under
            # `func(...)` here would go uncounted. torch's CommDebugMode does the same.)
            return NotImplemented
        kind = _KINDS.get(func._overloadpacket)
        if kind is not None:
            group = args[-1] if args else (kwargs or {}).get("group_name")
            axes = self.axes.get(str(group), (str(group),))
            phase = "recompute" if _RECOMPUTING.get() else self.phase
            self.counts[f"{kind}|{','.join(axes)}|{phase}"] += 1
        return func(*args, **(kwargs or {}))
