"""The logical device mesh and where its axes fall on the physical topology.

Devices are numbered row-major over the mesh shape, so the last axis holds consecutive
device ids. A group of devices along some axes therefore occupies an aligned block of
`extent` consecutive ids, and the block decides the link it talks over: inside one HCCS
ring, inside one node, or across nodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from planner.errors import StrategyError

#: axes a mesh has at most (the plan format's `mesh.shape` holds up to three)
MAX_MESH_AXES = 3


@dataclass(frozen=True)
class DeviceMesh:
    """A named logical device matrix, e.g. shape (4, 8) with axes ("dp", "tp")."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    devices_per_node: int

    def __post_init__(self) -> None:
        # Plain strings (an AxisRole member is one, but prints as the enum in messages).
        object.__setattr__(self, "axis_names", tuple(str(a) for a in self.axis_names))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if len(self.shape) != len(self.axis_names):
            raise StrategyError(
                f"mesh shape {self.shape} and axis names {self.axis_names} differ in length"
            )
        if not 1 <= len(self.shape) <= MAX_MESH_AXES:
            raise StrategyError(f"a mesh has 1 to {MAX_MESH_AXES} axes, got {len(self.shape)}")
        if any(size < 1 for size in self.shape):
            raise StrategyError(f"mesh axis sizes must be positive, got {self.shape}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise StrategyError(f"mesh axis names must be distinct, got {self.axis_names}")
        if self.devices_per_node < 1:
            raise StrategyError("devices_per_node must be positive")

    @classmethod
    def build(cls, axes: Mapping[str, int], devices_per_node: int) -> DeviceMesh:
        return cls(tuple(axes.values()), tuple(axes), devices_per_node)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @cached_property
    def _sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape, strict=True))

    def axis_size(self, axis: str) -> int:
        size = self._sizes.get(axis)
        return size if size is not None else self.shape[self._index(axis)]

    def axis_stride(self, axis: str) -> int:
        """Distance in device ids between neighbours along `axis`."""
        return math.prod(self.shape[self._index(axis) + 1:])

    def group_size(self, axes: Iterable[str]) -> int:
        size = 1
        for axis in axes:
            size *= self.axis_size(axis)
        return size

    @cached_property
    def _factors(self) -> dict[tuple[tuple[str, ...], ...], tuple[int, ...]]:
        return {}

    def split_factors(self, dims: tuple[tuple[str, ...], ...]) -> tuple[int, ...]:
        """Into how many parts each dim split over `dims[d]`'s axes is cut. Memoised:
        derivation and pricing ask it for every read of every tensor."""
        found = self._factors.get(dims)
        if found is None:
            found = self._factors[dims] = tuple(self.group_size(axes) for axes in dims)
        return found

    def group_extent(self, axes: Iterable[str]) -> int:
        """Size of the aligned block of consecutive device ids one group spans."""
        axes = list(axes)
        if not axes:
            return 1
        return max(self.axis_stride(a) * self.axis_size(a) for a in axes)

    @cached_property
    def _placements(self) -> dict[tuple[str, ...], tuple[int, int, int, int]]:
        return {}

    def placement(self, axes: Iterable[str]) -> tuple[int, int, int, int]:
        """(size, members per node, extent, extent of the members in one node) of a group.

        Groups along `axes` are translates of the one holding device 0, so counting that
        one's device ids per node describes them all. Memoised: pricing asks millions of
        times about a handful of groups.
        """
        wanted = set(axes)
        key = tuple(a for a in self.axis_names if a in wanted)
        found = self._placements.get(key)
        if found is None:
            found = self._placements[key] = self._place(list(key))
        return found

    def _place(self, axes: list[str]) -> tuple[int, int, int, int]:
        size = self.group_size(axes)
        if not axes:
            return 1, 1, 1, 1
        ids = np.zeros(1, dtype=np.int64)
        for axis in axes:
            steps = np.arange(self.axis_size(axis), dtype=np.int64) * self.axis_stride(axis)
            ids = (ids[:, None] + steps[None, :]).reshape(-1)
        in_first_node = ids[ids < self.devices_per_node]
        per_node = max(1, int(in_first_node.size))
        if size % per_node:
            per_node = 1  # uneven spread over nodes: price it as one member per node
        node_extent = int(in_first_node.max()) + 1 if in_first_node.size else 1
        return size, per_node, self.group_extent(axes), min(node_extent, self.group_extent(axes))

    def intra_node(self, axis: str) -> bool:
        """Whether every group along `axis` stays inside one node."""
        return self.group_extent([axis]) <= self.devices_per_node

    def _index(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise StrategyError(
                f"mesh axis {axis!r} is not one of {list(self.axis_names)}"
            ) from None

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "axes": list(self.axis_names),
            "intra_node": [self.intra_node(a) for a in self.axis_names],
            "devices_per_node": self.devices_per_node,
        }

    @classmethod
    def from_json(cls, data: dict) -> DeviceMesh:
        return cls(tuple(int(s) for s in data["shape"]), tuple(str(a) for a in data["axes"]),
                   int(data["devices_per_node"]))


def factorizations(devices: int, max_axes: int = 3) -> list[tuple[int, ...]]:
    """Every ordered way to write `devices` as a product of 1..max_axes factors > 1."""
    results: list[tuple[int, ...]] = [(devices,)]

    def extend(prefix: Sequence[int], remaining: int, slots: int) -> None:
        if slots == 1:
            if remaining > 1:
                results.append((*prefix, remaining))
            return
        for factor in range(2, remaining):
            if remaining % factor == 0:
                extend((*prefix, factor), remaining // factor, slots - 1)

    for axes in range(2, max_axes + 1):
        extend((), devices, axes)
    return sorted(set(results), key=lambda f: (len(f), f))
