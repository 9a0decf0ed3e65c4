"""How an activation can cross from one pipeline stage to the next: scattered over the
axes it is replicated on, then gathered again.

Megatron-LM's scatter/gather of pipeline sends (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §4.1): an
activation replicated over the tensor-parallel group is the same on its t ranks, so each
rank sends only its 1/t slice to its peer on the next stage (over its own NIC: a DGX A100
has one per GPU) and the receiving ranks all-gather the slices over the node's fast links.
The gradient returns the same way. `send_split` says whether a tensor's layout allows it
and along which dim; the cost layer (`planner.cost.pipeline.Prices.send`) decides whether
it pays, and the plan records the decision on each send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.kinds import AxisRole
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh

#: The `op` of the all-gather that reassembles a scattered send where it arrives (the
#: send itself is named after the first op reading the tensor).
SEND_OP = "pipeline send"


@dataclass(frozen=True)
class SendSplit:
    """Send 1/g of the tensor per rank, g the size of `axes`, sliced along `dim` (of the
    local tensor), and all-gather it over `axes` on arrival."""

    axes: tuple[str, ...]
    dim: int


def send_split(layout: Layout, shape: Sequence[int], mesh: DeviceMesh) -> SendSplit | None:
    """The split a send of a tensor stored in `layout` can use: over every axis (but the
    pipeline's) the tensor is replicated on whose groups stay inside a node, along the
    first dim of the local tensor they divide; None when there is no such axis or dim."""
    used = set(layout.used_axes)
    axes = tuple(a for a in mesh.axis_names
                 if a != AxisRole.PIPELINE and a not in used and mesh.axis_size(a) > 1
                 and mesh.intra_node(a))
    if not axes:
        return None
    group = mesh.group_size(axes)
    for dim, size in enumerate(layout.local_shape(shape, mesh)):
        if size >= group and size % group == 0:
            return SendSplit(axes, dim)
    return None
