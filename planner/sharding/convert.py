"""Conversions between shardplan's Layout/OpStrategy and MindSpore's and DTensor's forms.

shardplan keeps one form of a sharding: per tensor dim the mesh axes that split it (major
first) plus the axes of a pending partial sum. The frameworks that run a plan speak other
forms, and this module is the one place that translates:

- MindSpore tensor layout: a device matrix and a tensor map whose entries index the device
  matrix counted from the RIGHT (-1 = not split; a tuple when several axes split one dim).
- MindSpore strategy tuples (`MatMul().shard(((1, 1), (1, 2)))`): per data input, into how
  many parts each dim is cut. They do not say which mesh axes cut it, so reading them back
  chooses axes by a fixed, documented rule (`strategy_from_tuples`).
- (whole plans are exported by `planner.exports`: MindSpore's strategy checkpoint, DTensor).
- PyTorch DTensor placements, one per mesh axis, as strings (`Shard(d)`, `Replicate()`,
  `Partial()`); torch is not imported here so the planner stays free of it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.errors import StrategyError
from planner.graph import OpNode, TensorInfo
from planner.ops import DimLabels
from planner.sharding.layout import Layout
from planner.sharding.mesh import DeviceMesh, factorizations
from planner.sharding.strategy import (
    REPLICATED,
    OpStrategy,
    check_strategy,
    input_layouts,
)

AXIS_PREFIX = "a"  # derived meshes name their axes a0 (major, slowest), a1, a2 (minor)
NOT_SPLIT = -1  # MindSpore's tensor_map entry for a dim no device axis splits

TensorMapEntry = int | tuple[int, ...]


def default_axis_names(count: int) -> tuple[str, ...]:
    """Names of a mesh shardplan derived itself: a0 is the major (slowest) axis.

    Neutral names, because one mesh axis may carry the batch in one op and a weight split
    in the next; the index says where the axis sits, which is what decides its links.
    """
    return tuple(f"{AXIS_PREFIX}{i}" for i in range(count))


def _where(node: OpNode) -> str:
    return f"op {node.name} ({node.op_type})"


# --------------------------------------------------------------------------- tensor layout


@dataclass(frozen=True)
class MindSporeLayout:
    """MindSpore's tensor layout: `Layout(dev_matrix, alias)(*dims)` reduced to numbers.

    `tensor_map[d]` indexes `dev_matrix` from the right: 0 is the last (minor) device axis,
    len(dev_matrix) - 1 the first; -1 means dim d is not split; a tuple lists several device
    axes splitting dim d, major first.
    """

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[TensorMapEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"dev_matrix": list(self.dev_matrix),
                "tensor_map": [list(e) if isinstance(e, tuple) else e for e in self.tensor_map]}


def _mesh_index(mesh: DeviceMesh, axis: str) -> int:
    """Position of `axis` in the mesh (raises StrategyError naming an unknown axis)."""
    mesh.axis_size(axis)
    return mesh.axis_names.index(axis)


def _check_axes_once(layout: Layout, mesh: DeviceMesh, what: str) -> None:
    seen: set[str] = set()
    for axis in layout.used_axes:
        _mesh_index(mesh, axis)
        if axis in seen:
            raise StrategyError(f"{what}: mesh axis {axis!r} is used twice in one layout")
        seen.add(axis)


def to_mindspore_layout(layout: Layout, mesh: DeviceMesh, what: str = "tensor") -> MindSporeLayout:
    """The MindSpore form of `layout`: dev_matrix = mesh shape, tensor_map from the right.

    A pending partial sum has no place in a MindSpore tensor layout (MindSpore inserts the
    reduction inside the op), so a partial layout is refused rather than silently dropped.
    """
    if layout.partial:
        raise StrategyError(
            f"{what}: layout is a pending partial sum over mesh axes {list(layout.partial)}; "
            "a MindSpore tensor layout cannot express partial sums: reduce it first"
        )
    _check_axes_once(layout, mesh, what)
    last = len(mesh.shape) - 1
    entries: list[TensorMapEntry] = []
    for axes in layout.dims:
        indices = tuple(last - _mesh_index(mesh, a) for a in axes)
        entries.append(NOT_SPLIT if not indices else indices[0] if len(indices) == 1 else indices)
    return MindSporeLayout(tuple(mesh.shape), tuple(entries))


def from_mindspore_layout(
    ms_layout: MindSporeLayout,
    axis_names: Sequence[str] | None = None,
    devices_per_node: int = 1,
) -> tuple[Layout, DeviceMesh]:
    """shardplan's Layout and the mesh of a MindSpore layout (axis names default a0, a1, ...).

    `devices_per_node` only decides which axes stay inside a node; pass the cluster's.
    """
    dev_matrix = tuple(int(s) for s in ms_layout.dev_matrix)
    names = tuple(axis_names) if axis_names is not None else default_axis_names(len(dev_matrix))
    mesh = DeviceMesh(dev_matrix, names, devices_per_node)
    last = len(dev_matrix) - 1
    seen: set[int] = set()
    dims: list[tuple[str, ...]] = []
    for dim, entry in enumerate(ms_layout.tensor_map):
        raw = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
        axes: list[str] = []
        for index in raw:
            index = int(index)
            if index == NOT_SPLIT:
                continue  # MindSpore accepts "None" inside a tuple: it splits nothing
            if not 0 <= index <= last:
                raise StrategyError(
                    f"MindSpore tensor_map {list(ms_layout.tensor_map)}: entry {index} of dim "
                    f"{dim} is outside the device matrix {list(dev_matrix)} (valid: -1..{last})"
                )
            if index in seen:
                raise StrategyError(
                    f"MindSpore tensor_map {list(ms_layout.tensor_map)}: device axis {index} "
                    "splits more than one dim"
                )
            seen.add(index)
            axes.append(names[last - index])
        dims.append(tuple(axes))
    return Layout(tuple(dims)), mesh


def flat_form(layout: Layout, mesh: DeviceMesh) -> tuple[list[int], list[int]] | None:
    """(dev_matrix, flat tensor_map) when every dim has at most one device-matrix axis.

    A dim split by mesh axes that are neighbours in mesh order (major first) is the same as
    one merged device axis of their product; other multi-axis splits have no flat form.
    """
    groups: list[list[int]] = [[i] for i in range(len(mesh.shape))]
    for axes in layout.dims:
        if len(axes) < 2:
            continue
        indices = [mesh.axis_names.index(a) for a in axes]
        if indices != list(range(indices[0], indices[0] + len(indices))):
            return None
        start = next(g for g in groups if g[0] == indices[0])
        for index in indices[1:]:
            group = next(g for g in groups if g[0] == index)
            start.extend(group)
            groups.remove(group)
    dev_matrix = [int(np.prod([mesh.shape[i] for i in g])) for g in groups]
    last = len(groups) - 1
    tensor_map = []
    for axes in layout.dims:
        if not axes:
            tensor_map.append(NOT_SPLIT)
            continue
        first = mesh.axis_names.index(axes[0])
        tensor_map.append(last - next(n for n, g in enumerate(groups) if g[0] == first))
    return dev_matrix, tensor_map


# --------------------------------------------------------------------------- strategy tuples


def _data_inputs(node: OpNode, labels: DimLabels | None) -> list[tuple[int, str]]:
    """(index, tensor) of the inputs a MindSpore strategy gives a tuple to.

    Inputs the op's rule labels None (a Reshape's target shape, Slice bounds) are not data
    and omitted optional inputs are absent: neither takes a tuple. For an op without a rule
    every present input counts.
    """
    result = []
    for index, name in enumerate(node.inputs):
        if not name:
            continue
        if labels is not None and (index >= len(labels.inputs) or labels.inputs[index] is None):
            continue
        result.append((index, name))
    return result


def _per_data_input(node: OpNode, data: list[tuple[int, str]],
                    tuples: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
    """The data inputs' tuples of `tuples`, which may also be in the plan file's form: one
    tuple per input of the op (a non-data input's tuple all ones, an absent one's empty),
    so a plan's own strategies feed back as they are written."""
    if len(tuples) == len(data) or len(tuples) != len(node.inputs):
        return tuples
    kept = {index for index, _ in data}
    for index, factors in enumerate(tuples):
        if index not in kept and isinstance(factors, Sequence) and any(
                f != 1 for f in factors):
            raise StrategyError(
                f"{_where(node)}: input {index} ({node.inputs[index] or 'absent'}) is not "
                f"data (a shape, bound or omitted input) and cannot be split, but its "
                f"strategy tuple is {tuple(factors)}")
    return [factors for index, factors in enumerate(tuples) if index in kept]


def _check_tuple_shapes(node: OpNode, data: list[tuple[int, str]],
                        tensors: Mapping[str, TensorInfo],
                        tuples: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    where = _where(node)
    tuples = _per_data_input(node, data, tuples)
    if len(tuples) != len(data):
        described = ", ".join(f"input {i} ({name})" for i, name in data) or "none"
        raise StrategyError(
            f"{where}: got {len(tuples)} strategy tuple(s) but the op has {len(data)} data "
            f"input(s): {described}; inputs that are not data (shapes, bounds, omitted "
            "optional inputs) take no tuple"
        )
    result = []
    for (index, name), factors in zip(data, tuples, strict=True):
        shape = tensors[name].shape
        if not isinstance(factors, Sequence) or isinstance(factors, str):
            raise StrategyError(f"{where}: strategy of input {index} ({name}) must be a tuple "
                                f"of ints, got {factors!r}")
        if len(factors) != len(shape):
            raise StrategyError(
                f"{where}: input {index} ({name}) has shape {list(shape)} ({len(shape)} dims) "
                f"but its strategy tuple {tuple(factors)} has {len(factors)} entries"
            )
        for dim, factor in enumerate(factors):
            if isinstance(factor, bool) or not isinstance(factor, (int, np.integer)) \
                    or factor < 1:
                raise StrategyError(
                    f"{where}: input {index} ({name}) dim {dim}: split factor {factor!r} must "
                    "be a positive integer"
                )
            if shape[dim] % factor:
                raise StrategyError(
                    f"{where}: input {index} ({name}) dim {dim} of size {shape[dim]} cannot "
                    f"be split into {factor} equal parts (strategy tuple {tuple(factors)})"
                )
        result.append(tuple(int(f) for f in factors))
    return result


def label_factors(node: OpNode, labels: DimLabels | None, tensors: Mapping[str, TensorInfo],
                  tuples: Sequence[Sequence[int]]) -> dict[str, int]:
    """Split factor of each label, in order of first appearance (input 0's dims first).

    Checks what needs no mesh: tuple count and lengths, factors dividing the dims, dims that
    share a label (MatMul's k) cut the same way, dims that must stay whole left whole.
    """
    where = _where(node)
    data = _data_inputs(node, labels)
    checked = _check_tuple_shapes(node, data, tensors, tuples)
    if labels is None:
        if any(f > 1 for factors in checked for f in factors):
            raise StrategyError(f"{where} has no sharding rule and runs replicated: every "
                                f"split factor must be 1, got {[list(t) for t in checked]}")
        return {}
    found: dict[str, int] = {}
    first_seen: dict[str, tuple[int, str, int]] = {}
    for (index, name), factors in zip(data, checked, strict=True):
        names = labels.inputs[index] or ()
        for dim, (label, factor) in enumerate(zip(names, factors, strict=True)):
            if factor > 1 and label in labels.whole_labels:
                raise StrategyError(
                    f"{where}: input {index} ({name}) dim {dim} must stay whole (e.g. a "
                    f"softmax or convolution-window axis) but is split {factor} ways"
                )
            if label in found and found[label] != factor:
                p_index, p_name, p_dim = first_seen[label]
                raise StrategyError(
                    f"{where}: input {p_index} ({p_name}) dim {p_dim} is split {found[label]} "
                    f"ways but input {index} ({name}) dim {dim} is split {factor} ways; they "
                    f"are one dim of the op ({label}) and must be split the same: "
                    f"strategy {tuple(tuple(t) for t in checked)}"
                )
            found.setdefault(label, factor)
            first_seen.setdefault(label, (index, name, dim))
    sizes = labels.sizes(node, tensors)
    for label, factor in found.items():
        for size in sorted(sizes.get(label, ())):
            if size % factor:
                raise StrategyError(
                    f"{where}: dim {label} is split {factor} ways by the strategy but one of "
                    f"its tensors has size {size} there (an output), which {factor} does not "
                    "divide"
                )
    return found


def _subsets_innermost_first(free: Sequence[int], mesh: DeviceMesh,
                             factor: int) -> list[tuple[int, ...]]:
    """Sets of free mesh axes whose sizes multiply to `factor`, innermost first.

    Sets compare by their axis indices taken from the innermost down, so a set holding
    the innermost axis comes first; inside a set axes stay in mesh order (major first).
    """
    found = []
    for count in range(1, len(free) + 1):
        for combo in itertools.combinations(sorted(free), count):
            if int(np.prod([mesh.shape[i] for i in combo])) == factor:
                found.append(combo)
    return sorted(found, key=lambda c: sorted(c, reverse=True), reverse=True)


def _assign_axes(factors: Mapping[str, int], mesh: DeviceMesh) -> dict[str, tuple[str, ...]] | None:
    """Mesh axes for each split label; None when the mesh cannot realise the factors.

    Rule: labels are served from the LAST one to appear in the strategy tuples backwards,
    each taking the innermost free axes that give its factor (backtracking when a later
    choice fails). For MatMul (m, k) x (k, n) the weight's n or k lands on the inner,
    intra-node axes and the batch m on the outer ones, as tensor parallelism wants.
    """
    wanted = [(label, f) for label, f in factors.items() if f > 1]
    order = list(reversed(wanted))
    chosen: dict[str, tuple[int, ...]] = {}

    def place(position: int, free: frozenset[int]) -> bool:
        if position == len(order):
            return True
        label, factor = order[position]
        for combo in _subsets_innermost_first(sorted(free), mesh, factor):
            chosen[label] = combo
            if place(position + 1, free - set(combo)):
                return True
            del chosen[label]
        return False

    usable = frozenset(i for i, size in enumerate(mesh.shape) if size > 1)
    if not place(0, usable):
        return None
    return {label: tuple(mesh.axis_names[i] for i in chosen[label]) for label, _ in wanted}


def strategy_from_tuples(node: OpNode, labels: DimLabels | None,
                         tensors: Mapping[str, TensorInfo], mesh: DeviceMesh,
                         tuples: Sequence[Sequence[int]]) -> OpStrategy:
    """The OpStrategy whose data-input layouts have exactly these MindSpore split factors.

    Each label's factor must be the product of the sizes of its own set of mesh axes; axes
    no label takes replicate the op (MindSpore's "repeated calculation"). Among several
    realisations the one of `_assign_axes`'s rule is returned, so the result is
    deterministic.
    """
    where = _where(node)
    factors = label_factors(node, labels, tensors, tuples)
    if labels is None:
        return REPLICATED
    mapping = _assign_axes(factors, mesh)
    if mapping is None:
        split = {label: f for label, f in factors.items() if f > 1}
        total = int(np.prod(list(split.values()) or [1]))
        extra = (f"; together they need {total} devices but the mesh has {mesh.size}"
                 if total > mesh.size else "")
        raise StrategyError(
            f"{where}: split factors {split} of strategy {tuple(tuple(t) for t in tuples)} "
            f"cannot be realised on mesh {list(mesh.shape)} (axes {list(mesh.axis_names)}): "
            f"each split dim needs its own mesh axes whose sizes multiply to its factor{extra}"
        )
    strategy = OpStrategy.of(mapping)
    check_strategy(node, labels, strategy, tensors, mesh)
    return strategy


def tuples_from_strategy(node: OpNode, labels: DimLabels | None, strategy: OpStrategy,
                         tensors: Mapping[str, TensorInfo],
                         mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """MindSpore strategy tuples of `strategy`: split factors of each data input."""
    data = _data_inputs(node, labels)
    if labels is None:
        return tuple(tuple(1 for _ in tensors[name].shape) for _, name in data)
    ranks = [len(tensors[name].shape) if name else -1 for name in node.inputs]
    padded = DimLabels(tuple(labels.inputs) + (None,) * (len(ranks) - len(labels.inputs)),
                       labels.outputs, labels.sum_labels, labels.sync_labels,
                       labels.whole_labels)
    layouts = input_layouts(padded, strategy, ranks)
    result = []
    for index, _ in data:
        layout = layouts[index]
        assert layout is not None  # a data input is present
        result.append(layout.split_factors(mesh))
    return tuple(result)


def _is_one_strategy(tuples_list: Sequence[Any]) -> bool:
    return all(isinstance(t, Sequence) and all(isinstance(f, (int, np.integer)) for f in t)
               for t in tuples_list)


def _realisable(factors: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether distinct axes of `shape` can give every factor (> 1) its own set."""
    wanted = sorted((f for f in factors if f > 1), reverse=True)

    def place(position: int, free: tuple[int, ...]) -> bool:
        if position == len(wanted):
            return True
        for count in range(1, len(free) + 1):
            for combo in itertools.combinations(free, count):
                if int(np.prod([shape[i] for i in combo])) == wanted[position]:
                    rest = tuple(i for i in free if i not in combo)
                    if place(position + 1, rest):
                        return True
        return False

    return place(0, tuple(range(len(shape))))


def mesh_for_tuples(tuples_list: Sequence[Any], devices: int,
                    devices_per_node: int) -> DeviceMesh:
    """A 1-3 axis mesh of `devices` devices on which every given strategy tuple fits.

    `tuples_list` is one op's strategy (`((2, 1), (1, 4))`) or a list of them. Without the
    ops' labels a factor in two tuples of one op may be one dim (MatMul's k) or two, so each
    tuple is checked on its own; `strategy_from_tuples` then checks each op as a whole.
    Preference: fewest axes; then most factors equal to one axis size; then axes in the
    order their factors first appear in the tuples (as MindSpore builds its device matrix
    from a strategy: `((2, 1), (1, 4))` gives (2, 4)). Axes are named a0, a1, a2.
    """
    if devices < 1:
        raise StrategyError(f"device count must be positive, got {devices}")
    strategies = [tuples_list] if _is_one_strategy(tuples_list) else list(tuples_list)
    tuples = [tuple(int(f) for f in t) for strategy in strategies for t in strategy]
    for factors in tuples:
        if any(f < 1 for f in factors):
            raise StrategyError(f"strategy tuple {factors}: split factors must be positive")
        total = int(np.prod(factors or (1,)))
        if devices % total:
            raise StrategyError(
                f"strategy tuple {factors} splits a tensor into {total} parts, which does not "
                f"divide the {devices} devices"
            )
    appearance: list[int] = []
    for factors in tuples:
        appearance += [f for f in factors if f > 1 and f not in appearance]

    def preference(shape: tuple[int, ...]) -> tuple[Any, ...]:
        exact = sum(1 for factors in tuples for f in factors if f > 1 and f in shape)
        order = tuple(appearance.index(s) if s in appearance else len(appearance)
                      for s in shape)
        return (len(shape), -exact, order, shape)

    candidates = [s for s in factorizations(devices, 3)
                  if all(_realisable(t, s) for t in tuples)]
    if not candidates:
        failing = [t for t in tuples
                   if not any(_realisable(t, s) for s in factorizations(devices, 3))]
        shown = failing or tuples
        raise StrategyError(
            f"no mesh of {devices} devices with 1-3 axes realises strategy tuple(s) "
            f"{shown}: every factor above 1 needs its own mesh axes whose sizes multiply to it"
        )
    shape = min(candidates, key=preference)
    return DeviceMesh(shape, default_axis_names(len(shape)), devices_per_node)


# --------------------------------------------------------------------------- checkpoint


# --------------------------------------------------------------------------- DTensor

_SHARD = re.compile(r"^(?:Shard|S)\((?:dim=)?(-?\d+)\)$")
_REPLICATE = re.compile(r"^(?:Replicate\(\)|R)$")
_PARTIAL = re.compile(r"^(?:Partial|P)\((?:(?:reduce_op=)?'?(\w+)'?)?\)$")


def to_placements(layout: Layout, mesh: DeviceMesh, what: str = "tensor") -> tuple[str, ...]:
    """DTensor placements, one per mesh axis: "Shard(d)", "Replicate()" or "Partial()".

    DTensor shards a dim split by several mesh axes in mesh-axis order (left to right, the
    left axis major), which is shardplan's order when the axes are listed in mesh order.
    Any other order needs `_StridedShard`, which is private to torch: it is refused here.
    """
    _check_axes_once(layout, mesh, what)
    placements = ["Replicate()"] * len(mesh.shape)
    for dim, axes in enumerate(layout.dims):
        indices = [_mesh_index(mesh, a) for a in axes]
        if indices != sorted(indices):
            raise StrategyError(
                f"{what}: dim {dim} is split by mesh axes {list(axes)} (major first), which is "
                f"not mesh order {list(mesh.axis_names)}; plain DTensor Shard placements "
                "apply mesh axes left to right and cannot express it"
            )
        for index in indices:
            placements[index] = f"Shard({dim})"
    for axis in layout.partial:
        placements[_mesh_index(mesh, axis)] = "Partial()"
    return tuple(placements)


def from_placements(placements: Sequence[str], rank: int, mesh: DeviceMesh) -> Layout:
    """Layout of a tensor of `rank` dims with these DTensor placements (strings).

    Accepts "Shard(d)", "Shard(dim=d)", "S(d)", "Replicate()", "R", "Partial()",
    "Partial(sum)", "P(sum)". A dim sharded on several mesh axes gets them in mesh order;
    partial axes come out in mesh order too (a partial sum's axis order does not matter).
    """
    if len(placements) != len(mesh.shape):
        raise StrategyError(
            f"{len(placements)} placement(s) {list(placements)} for a mesh of "
            f"{len(mesh.shape)} axes {list(mesh.axis_names)}: DTensor needs one per mesh axis"
        )
    dims: list[list[str]] = [[] for _ in range(rank)]
    partial: list[str] = []
    for axis, text in zip(mesh.axis_names, placements, strict=True):
        text = str(text).replace(" ", "")
        if _REPLICATE.match(text):
            continue
        shard = _SHARD.match(text)
        if shard:
            dim = int(shard.group(1))
            dim = dim + rank if dim < 0 else dim
            if not 0 <= dim < rank:
                raise StrategyError(f"placement {text} on mesh axis {axis!r}: a tensor of "
                                    f"{rank} dims has no dim {shard.group(1)}")
            dims[dim].append(axis)
            continue
        part = _PARTIAL.match(text)
        if part:
            if part.group(1) not in (None, "sum"):
                raise StrategyError(
                    f"placement {text} on mesh axis {axis!r}: shardplan's partial layouts are "
                    "pending sums; only Partial() / Partial(sum) can be read"
                )
            partial.append(axis)
            continue
        raise StrategyError(f"placement {text!r} on mesh axis {axis!r} is not Shard(d), "
                            "Replicate() or Partial()")
    return Layout(tuple(tuple(d) for d in dims), tuple(partial))
