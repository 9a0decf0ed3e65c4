"""Time of one collective over a group of devices: ring, tree and two-level algorithms.

Symbols: p devices in the group, k = `per_node` of them in each node, m = p / k nodes;
n bytes = the per-device buffer in its larger form (the gathered output of an all-gather,
the unreduced input of a reduce-scatter or all-reduce, the whole buffer of a broadcast or
all-to-all, the message of a send); B a per-device bus bandwidth and a the per-step latency
of the link (`LinkLevel.bus_bandwidth_Bps` = line rate x efficiency, and `latency_s`).

    ring all_reduce                     2(p-1)/p * n/B + 2(p-1) a
    ring all_gather, reduce_scatter      (p-1)/p * n/B +  (p-1) a
    ring broadcast (pipelined chain)               n/B +  (p-1) a
    tree all_reduce (double binary tree)         2 n/B + 2 ceil(log2 p) a
    tree broadcast                                 n/B +   ceil(log2 p) a
    pairwise all_to_all                  (p-1)/p * n/B +  (p-1) a
    direct send_recv                               n/B +        a
    hierarchical (two levels: k members per inner block, m blocks):
        all_reduce     = RS_in(n) + AR_out(n/k, m) + AG_in(n)
        all_gather     = AG_out(n/k, m) + AG_in(n)
        reduce_scatter = RS_in(n) + RS_out(n/k, m)
        broadcast      = BC_out(n, m) + BC_in(n)
      The inner phases are priced by this module on the in-block group (best algorithm);
      the outer phase by the ring or tree formula, the cheaper, on the outer link, where
      each of the k members runs its own m-member collective on its own link in parallel.

The link. A group inside one node talks over `profile.level_for_group(extent)`. On a level
whose fabric is "full_mesh" (a `fabric` field on the level; Ascend HCCS) each device has
one dedicated link to each of the g - 1 other devices of the level's block, so q members
of the group in that block drive only (q - 1) / (g - 1) of the per-device bandwidth.
A group that spans nodes is bound by the NICs (the last level): its k members in each node
use k NICs in parallel (NCCL's rail rings), so a flat ring or tree across nodes gets
B = min(B_node, k * B_nic / c) and the inter-node latency; c = `concurrent_groups_per_nic`
counts the different groups that use the same NICs at the same moment. For all_to_all
across nodes the (p-k)/p * n off-node bytes cross the device's own NIC while the
(k-1)/p * n on-node bytes use the node link: t = max of the two + (p-1) a_net. Intra-node
levels get no such multi-link credit: the ring spans them at one device's bandwidth.
A level may carry per-collective bandwidth factors (`collective_factors`, measured by
calibration): B for that collective is multiplied by its factor (Calculon's per-op network
multipliers play the same role).

Both level fields are optional in a profile: `fabric` defaults to "switch" and
`collective_factors` to none (factor 1); docs/hardware-profiles.md describes them.

"auto" picks the cheapest algorithm that applies (`ALGORITHMS`). NVLink SHARP (NVLS) and
NCCL's LL/LL128 low-latency protocols are not modelled: large single-node all-reduces on
H100/H200 are predicted at ring speed (~370 GB/s busBW against NVLS's ~480).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from costmodels.profile import COLLECTIVES, HardwareProfile, LinkLevel

#: Algorithms each collective may use; "auto" tries all that apply to the group.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "hierarchical"),
    "all_gather": ("ring", "hierarchical"),
    "reduce_scatter": ("ring", "hierarchical"),
    "broadcast": ("ring", "tree", "hierarchical"),
    "all_to_all": ("pairwise",),
    "send_recv": ("direct",),
}

#: nccl-tests' bus-bandwidth factor: busBW = (n / t) * factor(p) (docs/PERFORMANCE.md there).
_BUS_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "send_recv": lambda p: 1.0,
}


@dataclass(frozen=True)
class CommGroup:
    """Devices taking part in one collective, as placed on the topology.

    `size` devices, `per_node` of them in each node they touch, spanning an aligned block of
    `extent` consecutive device ids (devices are numbered row-major, so a group inside one
    node has per_node == size). `node_extent` is the aligned block the in-node members span
    inside a node; 0 means unknown, which prices the in-node phase on the node's outermost
    intra-node link (exact for whole-node groups, conservative otherwise).
    """

    size: int
    per_node: int
    extent: int
    node_extent: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or self.per_node < 1 or self.per_node > self.size:
            raise ValueError(f"CommGroup needs 1 <= per_node <= size, got {self}")
        if self.size % self.per_node:
            raise ValueError(f"CommGroup size {self.size} is not a multiple of per_node "
                             f"{self.per_node}")
        if self.extent < self.size:
            raise ValueError(f"CommGroup extent {self.extent} is smaller than its size "
                             f"{self.size}")
        if self.node_extent and not self.per_node <= self.node_extent <= self.extent:
            raise ValueError(f"CommGroup node_extent {self.node_extent} must lie between "
                             f"per_node {self.per_node} and extent {self.extent}")

    @property
    def crosses_nodes(self) -> bool:
        return self.per_node < self.size

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @classmethod
    def from_extent(cls, profile: HardwareProfile, size: int, extent: int) -> CommGroup:
        """Best guess from the old (group_size, extent) call: members spread evenly.

        Exact for groups along one mesh axis and for whole-node groups; a group mixing an
        across-node axis with a strided in-node axis may get per_node too small.
        """
        per_node_max = int(profile.devices_per_node.value)
        if extent <= per_node_max:
            return cls(size, size, extent)
        nodes = max(1, extent // per_node_max)
        per_node = size // nodes if size % nodes == 0 and size >= nodes else 1
        return cls(size, max(per_node, 1), extent)


def bus_bandwidth_Bps(kind: str, nbytes: float, size: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of a collective that took `seconds` (n is the larger form)."""
    if kind not in _BUS_FACTOR:
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    return nbytes / seconds * _BUS_FACTOR[kind](size)


def collective_time(profile: HardwareProfile, kind: str, nbytes: float,
                    group: CommGroup | int, algorithm: str | int = "auto", *,
                    concurrent_groups_per_nic: int = 1) -> float:
    """Seconds for one collective of `kind` on `group`, by `algorithm` ("auto": cheapest).

    The old form `collective_time(profile, kind, nbytes, group_size, extent)` still works:
    an int group with an int fifth argument is converted by CommGroup.from_extent.
    """
    if not isinstance(group, CommGroup):
        if isinstance(algorithm, str):
            raise TypeError("collective_time(profile, kind, nbytes, group_size, extent): "
                            "the old form needs the extent as the fifth argument")
        group = CommGroup.from_extent(profile, int(group), int(algorithm))
        algorithm = "auto"
    elif not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, got {algorithm!r}")
    return best_algorithm(profile, kind, nbytes, group, algorithm,
                          concurrent_groups_per_nic=concurrent_groups_per_nic)[1]


def best_algorithm(profile: HardwareProfile, kind: str, nbytes: float, group: CommGroup,
                   algorithm: str = "auto", *,
                   concurrent_groups_per_nic: int = 1) -> tuple[str, float]:
    """(algorithm, seconds): the one asked for, or the cheapest that applies to the group."""
    if kind not in ALGORITHMS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    if concurrent_groups_per_nic < 1:
        raise ValueError(f"concurrent_groups_per_nic must be at least 1, got "
                         f"{concurrent_groups_per_nic}")
    allowed = ALGORITHMS[kind]
    if algorithm != "auto" and algorithm not in allowed:
        raise ValueError(f"{kind} has no {algorithm!r} algorithm; use auto or one of "
                         f"{', '.join(allowed)}")
    if group.size <= 1 or nbytes <= 0:
        return (allowed[0] if algorithm == "auto" else algorithm), 0.0
    model = _Model(profile, group, concurrent_groups_per_nic)
    names = allowed if algorithm == "auto" else (algorithm,)
    applicable: list[tuple[str, float]] = []
    for name in names:
        seconds = model.time(kind, name, float(nbytes))
        if seconds is not None:
            applicable.append((name, seconds))
    if not applicable:
        raise ValueError(f"the {algorithm} algorithm does not apply to {group} on "
                         f"{profile.name}: it needs a group spanning two link levels")
    return min(applicable, key=lambda item: item[1])


def level_send_seconds(level: LinkLevel, nbytes: float) -> float:
    """One direct send of `nbytes` over `level` (the link between a mixed cluster's
    groups): n/B + a, the `direct` send_recv formula."""
    if nbytes <= 0:
        return 0.0
    return _ring("send_recv", float(nbytes), 2, _level_link(level, 2, "send_recv"))


def ring_terms(kind: str, p: int) -> tuple[float, float]:
    """(latency steps, byte factor) of the ring formula: t = steps * a + factor * n / B."""
    if kind == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return p - 1, (p - 1) / p
    if kind == "broadcast":
        return p - 1, 1.0
    if kind == "send_recv":
        return 1, 1.0
    raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")


def tree_terms(kind: str, p: int) -> tuple[float, float] | None:
    """(latency steps, byte factor) of the double-binary-tree formula; None if no tree."""
    steps = math.ceil(math.log2(p))
    if kind == "all_reduce":
        return 2 * steps, 2.0
    if kind == "broadcast":
        return steps, 1.0
    return None


def collective_factor(level: LinkLevel, kind: str) -> float:
    """Bandwidth multiplier of `kind` on `level` (`collective_factors`; 1 when absent).

    Calibration measures it where a library's collectives differ from the ring model: gloo's
    all_gather and reduce_scatter run far below its all_reduce (docs/cost-model.md).
    """
    return level.collective_factor(kind)


@dataclass(frozen=True)
class _Link:
    bandwidth: float  # per-device bus bandwidth, B/s
    latency: float  # per-step latency, s


def _level_link(level: LinkLevel, members: int, kind: str) -> _Link:
    """Bandwidth and latency of `members` group devices inside one block of `level`."""
    bandwidth = level.bus_bandwidth_Bps * collective_factor(level, kind)
    block = level.group_size
    if level.fabric_kind == "full_mesh" and block and block > 1:
        bandwidth *= max(members - 1, 1) / (block - 1)
    return _Link(bandwidth, float(level.latency_s.value))


def _ring(kind: str, n: float, p: int, link: _Link) -> float:
    steps, factor = ring_terms(kind, p)
    return factor * n / link.bandwidth + steps * link.latency


def _tree(kind: str, n: float, p: int, link: _Link) -> float | None:
    terms = tree_terms(kind, p)
    if terms is None:
        return None
    steps, factor = terms
    return factor * n / link.bandwidth + steps * link.latency


class _Model:
    """Prices one group on one profile; a helper so the link choice is written once."""

    def __init__(self, profile: HardwareProfile, group: CommGroup, sharing: int) -> None:
        self.profile = profile
        self.group = group
        self.sharing = sharing
        per_node_max = int(profile.devices_per_node.value)
        if group.crosses_nodes != (group.extent > per_node_max):
            raise ValueError(f"{group} on {profile.name} ({per_node_max} devices per node): "
                             f"per_node < size exactly when the extent exceeds a node")

    def nic(self, kind: str) -> _Link:
        link = _level_link(self.profile.inter_node_level, 2, kind)
        return _Link(link.bandwidth / self.sharing, link.latency)

    def node_block(self) -> int:
        """Aligned block of ids the in-node members of the group span."""
        group = self.group
        if not group.crosses_nodes:
            return group.extent
        if group.node_extent:
            return group.node_extent
        return group.per_node if group.per_node == 1 else int(
            self.profile.devices_per_node.value)

    def node_link(self, kind: str) -> _Link:
        level = self.profile.level_for_group(self.node_block())
        return _level_link(level, self.group.per_node, kind)

    def flat_link(self, kind: str) -> _Link:
        """The one link a flat ring or tree over the whole group is bound by."""
        group = self.group
        if not group.crosses_nodes:
            return _level_link(self.profile.level_for_group(group.extent), group.size, kind)
        nic = self.nic(kind)
        if group.per_node == 1:
            return nic
        node = self.node_link(kind)
        return _Link(min(node.bandwidth, group.per_node * nic.bandwidth), nic.latency)

    def time(self, kind: str, algorithm: str, n: float) -> float | None:
        p = self.group.size
        if algorithm == "ring":
            return _ring(kind, n, p, self.flat_link(kind))
        if algorithm == "tree":
            return _tree(kind, n, p, self.flat_link(kind))
        if algorithm == "pairwise":
            return self._all_to_all(n)
        if algorithm == "direct":
            crosses = self.group.crosses_nodes
            return _ring(kind, n, 2, self.nic(kind) if crosses else self.flat_link(kind))
        return self._hierarchical(kind, n)

    def _all_to_all(self, n: float) -> float:
        group, kind = self.group, "all_to_all"
        if not group.crosses_nodes:
            return _ring(kind, n, group.size, self.flat_link(kind))
        p, k = group.size, group.per_node
        nic = self.nic(kind)
        off_node = (p - k) / p * n / nic.bandwidth
        on_node = (k - 1) / p * n / self.node_link(kind).bandwidth if k > 1 else 0.0
        return max(off_node, on_node) + (p - 1) * nic.latency

    def _split(self, kind: str) -> tuple[CommGroup, int, _Link] | None:
        """(inner group, outer member count, outer link) of a two-level schedule."""
        group = self.group
        if group.crosses_nodes:
            if group.per_node == 1:
                return None
            inner = CommGroup(group.per_node, group.per_node, self.node_block())
            return inner, group.nodes, self.nic(kind)
        # Inside a node: split at the next-inner level when the group fills its blocks.
        levels = [lv for lv in self.profile.levels[:-1]
                  if lv.group_size is not None and lv.group_size < group.extent]
        if not levels or group.size != group.extent:
            return None
        block = levels[-1].group_size
        assert block is not None
        outer = group.size // block
        outer_level = self.profile.level_for_group(group.extent)
        return CommGroup(block, block, block), outer, _level_link(outer_level, outer, kind)

    def _hierarchical(self, kind: str, n: float) -> float | None:
        split = self._split(kind)
        if split is None or kind not in ("all_reduce", "all_gather", "reduce_scatter",
                                         "broadcast"):
            return None
        inner, m, link = split
        k = inner.size

        def within(sub_kind: str, nbytes: float) -> float:
            return best_algorithm(self.profile, sub_kind, nbytes, inner)[1]

        def across(sub_kind: str, nbytes: float) -> float:
            tree = _tree(sub_kind, nbytes, m, link)
            ring = _ring(sub_kind, nbytes, m, link)
            return ring if tree is None else min(ring, tree)

        if kind == "all_reduce":
            return (within("reduce_scatter", n) + across("all_reduce", n / k)
                    + within("all_gather", n))
        if kind == "all_gather":
            return across("all_gather", n / k) + within("all_gather", n)
        if kind == "reduce_scatter":
            return within("reduce_scatter", n) + across("reduce_scatter", n / k)
        return across("broadcast", n) + within("broadcast", n)


def behind_compute(transfer: Any, compute: Any, share: float) -> Any:
    """Exposed seconds of a transfer issued to run beside `compute` seconds of compute:
    what exceeds the compute, plus the part of the overlapped time the two cannot share
    (`share`: the profile's `device.compute_overlap`; 1 hides all of it, 0 none, as on a
    CPU host whose collectives run on the cores the compute needs). Numbers or arrays."""
    return np.maximum(0.0, transfer - compute) + (1.0 - share) * np.minimum(transfer, compute)


def ring_overlap_exposed_s(transfer_s: float, compute_s: float, steps: int,
                           share: float = 1.0) -> float:
    """The exposed part of a ring pass overlapped with compute (ring attention, Liu et al.
    2023): `steps` + 1 ranks each hold one block; in each of `steps` steps a rank sends its
    current block on and computes with the one it holds, so each step's transfer
    (`transfer_s` / steps) hides behind one block's compute (`compute_s` / (steps + 1):
    the local block's compute is one of them) and shows only by what it exceeds it."""
    if steps < 1:
        return 0.0
    return steps * float(behind_compute(transfer_s / steps, compute_s / (steps + 1), share))
