"""Mixed clusters: groups of devices of different kinds, and the link between the groups.

A cluster file (`--cluster FILE`, docs/hardware-profiles.md "Mixed clusters") names each
group's hardware profile and device count, and optionally the link between groups as a
profile level with cited figures. Without one, groups talk over the slowest of their own
inter-node fabrics: two kinds of machines in one data centre usually share one network,
and a transfer runs at the slower end's NICs.

A plan places the groups one after the other on the ranks (the search picks their order),
so a pipeline stage runs on one kind, or on several where a stage is larger than a group.
Validation is the profile reader's: one line naming the file and the field.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import permutations
from pathlib import Path
from typing import Any

from costmodels.profile import MAX_DEVICES, HardwareProfile, LinkLevel, _Reader, load_profile
from planner.errors import ProfileError
from planner.userfiles import read_json

SCHEMA = "shardplan.cluster/1"
CLUSTER_HINT = "see docs/hardware-profiles.md \"Mixed clusters\" for the format"
#: Device groups a cluster may have: the search tries every order of them on the ranks.
MAX_GROUPS = 4
_TOP_FIELDS = ("schema", "name", "groups")
_TOP_OPTIONAL = ("description", "sources", "link")
_GROUP_FIELDS = ("name", "profile", "devices")


@dataclass(frozen=True)
class DeviceGroup:
    """Devices of one kind: `devices` of them, laid out as `profile` describes (whole
    nodes, or a part of one node the profile allows)."""

    name: str
    profile: HardwareProfile
    devices: int

    @property
    def memory_bytes(self) -> int:
        return int(self.profile.memory_bytes.value)


@dataclass(frozen=True)
class Cluster:
    """Device groups in the order the file lists them, and the link between groups."""

    name: str
    groups: tuple[DeviceGroup, ...]
    link: LinkLevel
    path: str = ""

    @property
    def devices(self) -> int:
        return sum(g.devices for g in self.groups)

    @property
    def mixed(self) -> bool:
        """More than one group: a cluster of one group is its profile's plain cluster."""
        return len(self.groups) > 1

    @property
    def lead(self) -> DeviceGroup:
        """The group with the most devices (the first of equals): the plan's layout is
        solved on its hardware, and its profile names the plan's cluster."""
        return max(self.groups, key=lambda g: g.devices)

    def orders(self) -> list[tuple[int, ...]]:
        """Every order of the groups on the ranks, groups of one profile and size kept in
        file order (swapping them places nothing differently)."""
        seen: dict[tuple[tuple[str, int], ...], tuple[int, ...]] = {}
        for order in permutations(range(len(self.groups))):
            key = tuple((self.groups[g].profile.name, self.groups[g].devices) for g in order)
            seen.setdefault(key, order)
        return list(seen.values())

    def describe(self) -> str:
        return " + ".join(f"{g.devices} × {g.profile.name}" for g in self.groups)


@dataclass(frozen=True)
class Placement:
    """The groups laid on ranks 0.. in `order`: which groups each device stage's ranks
    are on, and whether the sends into a stage cross the link between groups."""

    cluster: Cluster
    order: tuple[int, ...]
    stage_size: int

    def group_of_rank(self, rank: int) -> int:
        first = 0
        for g in self.order:
            first += self.cluster.groups[g].devices
            if rank < first:
                return g
        raise ValueError(f"rank {rank} is past the cluster's {self.cluster.devices} devices")

    def first_rank(self, group: int) -> int:
        first = 0
        for g in self.order:
            if g == group:
                return first
            first += self.cluster.groups[g].devices
        raise ValueError(f"group {group} is not placed")

    def stage_groups(self, stage: int) -> tuple[int, ...]:
        """The groups stage `stage`'s ranks are on, in rank order."""
        ranks = range(stage * self.stage_size, (stage + 1) * self.stage_size)
        return tuple(dict.fromkeys(self.group_of_rank(r) for r in ranks))

    def crosses_into(self, stage: int) -> bool:
        """Whether a rank of the stage before `stage` sends to its peer in `stage` (the
        same offset) over the link between groups; stage 0's is the last stage, from
        which the interleaved and V schedules' later chunks come round."""
        stages = self.cluster.devices // self.stage_size
        before = (stage - 1) % stages
        return any(self.group_of_rank(before * self.stage_size + offset)
                   != self.group_of_rank(stage * self.stage_size + offset)
                   for offset in range(self.stage_size))

    def slowest(self, groups: Sequence[int], work: Sequence[float]) -> int:
        """Of `groups`, the one whose hardware takes longest for `work` (seconds per
        group index): a stage spanning kinds runs at its slowest one's pace."""
        return max(groups, key=lambda g: (work[g], -groups.index(g)))

    def memory_bytes(self, groups: Sequence[int]) -> int:
        return min(self.cluster.groups[g].memory_bytes for g in groups)

    def replica_kinds(self, stage: int, replicas: int, work: Sequence[float]
                      ) -> tuple[int, ...]:
        """The group each of `replicas` data-parallel replicas of stage `stage` runs at
        the pace of: the slowest its ranks are on (`slowest`, by `work`). A replica's
        ranks are one block of the stage's (its model-parallel group, the mesh's inner
        axes), replica d the d-th block."""
        size = self.stage_size // replicas
        first = stage * self.stage_size
        return tuple(self.slowest(tuple(dict.fromkeys(
            self.group_of_rank(first + d * size + k) for k in range(size))), work)
            for d in range(replicas))


def balanced_rows(total: int, seconds_per_row: Sequence[float]) -> tuple[int, ...]:
    """`total` rows shared among replicas taking `seconds_per_row[i]` per row, each at
    least one, so that the slowest to finish is as early as it can be: shares in
    proportion to speed, rounded the way that costs least. Rows go one at a time to the
    replica that would finish first with it (the first of equals), which is optimal for
    identical jobs on machines of different speeds; it starts from the proportional
    shares rounded down, which an optimum never undercuts."""
    count = len(seconds_per_row)
    if count == 0 or total < count:
        raise ValueError(f"{total} rows cannot give each of {count} replicas one")
    if any(not math.isfinite(t) or t <= 0.0 for t in seconds_per_row):
        raise ValueError("each replica's seconds per row must be finite and positive")
    speed = [1.0 / t for t in seconds_per_row]
    whole = sum(speed)
    rows = [max(1, int(total * s / whole)) for s in speed]
    if sum(rows) > total:
        rows = [1] * count
    heap = [((rows[i] + 1) * seconds_per_row[i], i) for i in range(count)]
    heapq.heapify(heap)
    for _ in range(total - sum(rows)):
        _, i = heapq.heappop(heap)
        rows[i] += 1
        heapq.heappush(heap, ((rows[i] + 1) * seconds_per_row[i], i))
    return tuple(rows)


class _ClusterReader(_Reader):
    hint = CLUSTER_HINT

    def cluster(self, data: Any, folder: Path) -> Cluster:
        if isinstance(data, dict) and "schema" in data and data["schema"] != SCHEMA:
            self.fail("schema", f"must be {SCHEMA!r}, got {data['schema']!r}: this version "
                      "of shardplan reads only that schema")
        top = self.obj(data, "", _TOP_FIELDS, _TOP_OPTIONAL)
        name = self.text(top["name"], "name")
        if "sources" in top:
            self.sources = self.read_sources(top["sources"])
        groups_data = top["groups"]
        if not isinstance(groups_data, list) or not 1 <= len(groups_data) <= MAX_GROUPS:
            self.fail("groups", f"must be a list of 1 to {MAX_GROUPS} device groups")
        groups = tuple(self.group(g, f"groups[{i}]", folder)
                       for i, g in enumerate(groups_data))
        total = sum(g.devices for g in groups)
        if total > MAX_DEVICES:
            self.fail("groups", f"hold {total} devices, more than any cluster shardplan plans "
                      f"for (at most {MAX_DEVICES})")
        names = [g.name for g in groups]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            self.fail("groups", f"name {twice[0]!r} is given to two groups; name each once")
        if "link" in top:
            if not self.sources:
                self.fail("sources", "is missing; the link's figures cite their sources there")
            link = self.level(top["link"], "link")
            if link.group_size is not None:
                self.fail("link.group_size", "must be null: the link joins whole groups")
        else:
            link = min((g.profile.inter_node_level for g in groups),
                       key=lambda level: (level.bus_bandwidth_Bps,
                                          -float(level.latency_s.value)))
        return Cluster(name, groups, link, self.path)

    def group(self, value: Any, field: str, folder: Path) -> DeviceGroup:
        body = self.obj(value, field, _GROUP_FIELDS)
        name = self.text(body["name"], f"{field}.name")
        profile_name = self.text(body["profile"], f"{field}.profile")
        looks_like_path = profile_name.endswith(".json") or "/" in profile_name
        try:
            profile = load_profile(folder / profile_name if looks_like_path
                                   and not os.path.isabs(profile_name) else profile_name)
        except ProfileError as exc:
            self.fail(f"{field}.profile", f"cannot be loaded ({exc})")
        devices = self.count(body["devices"], f"{field}.devices")
        try:
            profile.check_device_count(devices)
        except ProfileError as exc:
            self.fail(f"{field}.devices", f"is not a cluster of its profile ({exc})")
        return DeviceGroup(name, profile, devices)


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """A cluster file, checked field by field (ProfileError naming the file and field)."""
    file = Path(path)
    data = read_json(file, "cluster", ProfileError,
                     missing="give the path of a cluster JSON file (docs/hardware-profiles.md)")
    return _ClusterReader(str(file)).cluster(data, file.parent)
