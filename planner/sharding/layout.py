"""How one tensor is laid out over a device mesh.

A Layout says, for each tensor dim, which mesh axes split it (major axis first), and over
which mesh axes the tensor is a pending partial sum. It is replicated over every other
axis. MindSpore strategy tuples and DTensor placements are both views of this one form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from planner.errors import StrategyError
from planner.sharding.mesh import DeviceMesh


@dataclass(frozen=True)
class Layout:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    @classmethod
    def replicated(cls, rank: int) -> Layout:
        return cls(tuple(() for _ in range(rank)))

    @classmethod
    def split(cls, rank: int, dim: int, axes: Sequence[str]) -> Layout:
        dims: list[tuple[str, ...]] = [()] * rank
        dims[dim] = tuple(axes)
        return cls(tuple(dims))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def used_axes(self) -> tuple[str, ...]:
        return tuple(a for axes in self.dims for a in axes) + self.partial

    @property
    def is_replicated(self) -> bool:
        return not self.used_axes

    def split_factors(self, mesh: DeviceMesh) -> tuple[int, ...]:
        """MindSpore's strategy tuple: into how many parts each dim is cut."""
        return mesh.split_factors(self.dims)

    def local_shape(self, shape: Sequence[int], mesh: DeviceMesh) -> tuple[int, ...]:
        return tuple(size // factor for size, factor in
                     zip(shape, self.split_factors(mesh), strict=True))

    def check(self, shape: Sequence[int], mesh: DeviceMesh, where: str) -> None:
        """Refuse layouts that do not fit the tensor or the mesh, naming the numbers."""
        if len(shape) != self.rank:
            raise StrategyError(
                f"{where}: layout has {self.rank} dims but the tensor has shape {list(shape)}"
            )
        seen: set[str] = set()
        for axis in self.used_axes:
            mesh.axis_size(axis)  # raises for an unknown axis
            if axis in seen:
                raise StrategyError(f"{where}: mesh axis {axis!r} is used twice in one layout")
            seen.add(axis)
        for dim, (size, factor) in enumerate(zip(shape, self.split_factors(mesh), strict=True)):
            if size % factor:
                raise StrategyError(
                    f"{where}: dim {dim} of size {size} cannot be split into {factor} equal "
                    f"parts over mesh axes {list(self.dims[dim])}"
                )

    def to_json(self) -> dict:
        return {"dims": [list(axes) for axes in self.dims], "partial": list(self.partial)}

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        """The layout a plan file writes as `data`. A plan repeats a few layouts over
        every op and tensor (a 50,000-op plan: 300,000 of them, 3.7 s to build one by
        one), so each distinct one is built once and shared: a Layout is frozen."""
        dims, partial = tuple(map(tuple, data["dims"])), tuple(data.get("partial", ()))
        try:
            found = _READ.get((dims, partial))
        except TypeError:  # an axis that is not a name (unhashable): not kept
            found = None
        if found is None:
            found = cls(tuple(tuple(str(a) for a in axes) for axes in dims),
                        tuple(str(a) for a in partial))
            if len(_READ) >= MAX_READ_LAYOUTS:
                _READ.clear()
            with contextlib.suppress(TypeError):
                _READ[(dims, partial)] = found
        return found


#: layouts read from plan files, by their JSON (`Layout.from_json`); bounded, as a
#: hand-written plan may hold any number of distinct ones
_READ: dict[tuple, Layout] = {}
MAX_READ_LAYOUTS = 4096
