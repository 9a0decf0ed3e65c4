"""Hardware profiles: load a JSON file, check every field, and answer topology questions.

A profile describes one device kind inside one node system and the fabric between nodes.
Every number in it is a `Cited` value that names its source, so a plan can always be
traced back to a datasheet, a paper or a measurement (docs/hardware-profiles.md).

Validation is done by hand, with one message per problem that names the file and the
field, because these files are written by people and read by a CLI that must not show a
traceback. This module imports nothing heavy: the planner loads it on every run.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

from hardware_profiles import PROFILE_DIR
from planner.errors import ProfileError
from planner.kinds import AttentionKernel, Fusion
from planner.userfiles import read_json

SCHEMA = "shardplan.hardware-profile/1"
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: Collective kinds a level's `collective_factors` may name (costmodels.communication).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "send_recv")
#: Values of a level's `fabric`: "switch" (the default) or "full_mesh" (one link per peer).
FABRICS = ("switch", "full_mesh")
FORMAT_HINT = "see docs/hardware-profiles.md for the format"
#: Plausible range of every positive figure (seconds, B/s, FLOP/s, fractions, factors).
#: Outside it the cost model's products and quotients underflow to 0 or overflow to inf,
#: so a typo in a unit (5e-324, 1e308) would price every plan at 0 s or inf s.
POSITIVE_RANGE = (1e-12, 1e18)
#: Largest device count (per node, per level group) and device memory a profile may state.
MAX_DEVICES = 1 << 20
MAX_MEMORY_BYTES = 1 << 60

_TOP_FIELDS = ("schema", "name", "description", "sources", "device", "topology")
_DEVICE_FIELDS = ("memory_bytes", "memory_bandwidth_Bps", "peak_flops", "matmul_efficiency",
                  "memory_efficiency", "kernel_launch_s")
_DEVICE_OPTIONAL = ("matmul_overhead_s", "compute_units", "gemm_tile", "kernels",
                    "compute_overlap", "host_op_s", "host_step_s")
#: `device.host_op_s`: the host's seconds per op run, by pass and by how the op runs.
_HOST_OP_FIELDS = ("forward_local", "backward_local", "forward_distributed",
                   "backward_distributed")
#: `device.kernels`: the kernels the device's training stacks run (planner.cost.kernels).
_KERNEL_FIELDS = ("attention", "fusion")
#: Largest GEMM tile edge a profile may state (a CTA tile is at most a few hundred).
MAX_TILE = 4096
_TOPOLOGY_FIELDS = ("devices_per_node", "levels")
_TOPOLOGY_OPTIONAL = ("allowed_devices_within_node",)
_LEVEL_FIELDS = ("name", "group_size", "bandwidth_Bps", "efficiency", "latency_s")
_LEVEL_OPTIONAL = ("fabric", "collective_factors", "collective_times")
#: Most points a level's `collective_times` may list per collective.
MAX_TIME_POINTS = 4096
_CITED_FIELDS = ("value", "source")
_CITED_OPTIONAL = ("note",)

#: The type of a cited value: a number, a tuple of counts or a word.
V = TypeVar("V")


@dataclass(frozen=True)
class HostOpSeconds:
    """The host's own seconds for one op run, where the host runs ops one after another
    with the device's work (a CPU rank): `local` an op on plain tensors, `distributed` one
    through DTensor's dispatch (`planner.sharding.batch.runs_as_data_parallel` says which);
    each in the forward pass and in its backward. Measured on the executor by `shardplan
    calibrate` (`planner.cli.host`)."""

    forward_local: Cited[float]
    backward_local: Cited[float]
    forward_distributed: Cited[float]
    backward_distributed: Cited[float]

    def seconds(self, backward: bool, local: bool) -> float:
        if backward:
            return float((self.backward_local if local else self.backward_distributed).value)
        return float((self.forward_local if local else self.forward_distributed).value)


@dataclass(frozen=True)
class Cited(Generic[V]):
    """A value together with where it comes from (a key into the profile's sources).

    The value is a number, a list of counts (`allowed_devices_within_node`) or a word
    (a level's `fabric`).
    """

    value: V
    source: str
    note: str = ""


@dataclass(frozen=True)
class LinkLevel:
    """One level of the communication hierarchy; group_size None means between nodes.

    `fabric` (optional, default "switch") says how the devices of one block are joined:
    "full_mesh" means one dedicated link to each peer, so a group using q of a block's
    g devices gets (q - 1) / (g - 1) of `bandwidth_Bps` (costmodels.communication).
    `collective_factors` (optional) multiplies the bus bandwidth of one collective kind.
    `collective_times` (optional, written by calibration) lists measured (group size,
    bytes, seconds) points of a collective kind on this level: inside their range a
    collective of a measured group size is priced from them (`measured_seconds`).
    """

    name: str
    group_size: int | None
    bandwidth_Bps: Cited[float]
    efficiency: Cited[float]
    latency_s: Cited[float]
    fabric: Cited[str] | None = None
    collective_factors: dict[str, Cited[float]] = field(default_factory=dict)
    collective_times: dict[str, Cited[tuple[tuple[int, float, float], ...]]] = field(
        default_factory=dict)

    def __hash__(self) -> int:  # collective_factors is a dict; hash what identifies a level
        return hash((self.name, self.group_size, self.bandwidth_Bps, self.efficiency,
                     self.latency_s, self.fabric))

    @property
    def bus_bandwidth_Bps(self) -> float:
        """Achievable per-device bus bandwidth: line rate times measured efficiency."""
        return float(self.bandwidth_Bps.value) * float(self.efficiency.value)

    @property
    def fabric_kind(self) -> str:
        """The level's fabric word: `fabric.value`, or "switch" when `fabric` is left out."""
        return "switch" if self.fabric is None else str(self.fabric.value)

    def collective_factor(self, kind: str) -> float:
        """Bandwidth multiplier of collective `kind` on this level; 1 when not given."""
        cited = self.collective_factors.get(kind)
        return 1.0 if cited is None else float(cited.value)

    def measured_seconds(self, kind: str, size: int, nbytes: float) -> float | None:
        """A collective of `kind` over `size` devices moving `nbytes` (its larger form),
        read off the measured points: linear between the two it lies between, the first's
        time below them (a smaller message is latency-bound). None outside or above the
        measured sizes, and for a group size or kind not measured: the model prices it."""
        cited = self.collective_times.get(kind)
        if cited is None:
            return None
        points = sorted((n, t) for p, n, t in cited.value if p == size)
        if not points or nbytes > points[-1][0]:
            return None
        if nbytes <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in pairwise(points):
            if nbytes <= n1:
                return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)
        return None  # unreachable: nbytes <= the last point's size


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind in one node system, with the topology that joins the devices."""

    name: str
    description: str
    sources: dict[str, str]
    memory_bytes: Cited[int]
    memory_bandwidth_Bps: Cited[float]
    peak_flops: dict[str, Cited[float]]
    matmul_efficiency: Cited[float]
    memory_efficiency: Cited[float]
    kernel_launch_s: Cited[float]
    devices_per_node: Cited[int]
    allowed_devices_within_node: Cited[tuple[int, ...]] | None
    levels: tuple[LinkLevel, ...]
    path: str
    #: GEMM ramp R in seconds (costmodels.compute): one value, or one per peak_flops key.
    matmul_overhead_s: Cited[float] | dict[str, Cited[float]] | None = None
    #: Compute units a GEMM's tiles run on at once (SMs, AI cores): costmodels.gemm.
    compute_units: Cited[int] | None = None
    #: (m, n, k) of the large-GEMM kernel's tile (CTA tile, cube base block): costmodels.gemm.
    gemm_tile: Cited[tuple[int, int, int]] | None = None
    #: `device.kernels`: how attention cores and elementwise chains run by default
    #: (planner.cost.kernels); left out: one kernel per op, as an eager interpreter runs.
    attention_kernel: Cited[str] | None = None
    fusion: Cited[str] | None = None
    #: Share of a collective's time that runs behind the device's compute when both are
    #: in flight (1: on a link with its own engines, as NCCL's kernels beside compute
    #: kernels; 0: on a CPU host, where gloo's threads take the cores the ranks compute
    #: on). Left out: 1, the planner's assumption before calibration measured it.
    compute_overlap: Cited[float] | None = None
    #: The host's seconds per op run (`HostOpSeconds`) and per training step (the loss,
    #: the optimizer's Python, the step's bookkeeping), added to the device's where the
    #: host runs the ops itself; left out on accelerators, whose kernels run behind the
    #: host (there `kernel_launch_s` is the floor of each kernel).
    host_op_s: HostOpSeconds | None = None
    host_step_s: Cited[float] | None = None

    def host_seconds(self, backward: bool, local: bool) -> float:
        """The host's seconds for one op run (0 where the profile states none)."""
        return self.host_op_s.seconds(backward, local) if self.host_op_s else 0.0

    @property
    def step_host_seconds(self) -> float:
        """The host's seconds per training step beside its ops (0 where none is stated)."""
        return float(self.host_step_s.value) if self.host_step_s else 0.0

    @property
    def overlap_share(self) -> float:
        """`compute_overlap`, 1 where the profile states none."""
        return float(self.compute_overlap.value) if self.compute_overlap else 1.0

    @property
    def default_attention(self) -> AttentionKernel:
        return AttentionKernel(self.attention_kernel.value if self.attention_kernel
                               else AttentionKernel.EAGER)

    @property
    def default_fusion(self) -> Fusion:
        return Fusion(self.fusion.value if self.fusion else Fusion.NONE)

    def __getstate__(self) -> dict:
        """Pickle the fields only, not the pricing memo (`planner.cost.pricing`) a run adds."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __hash__(self) -> int:  # dict fields are not hashable; a profile is its file
        return hash((self.name, self.path))

    @property
    def inter_node_level(self) -> LinkLevel:
        """The fabric between nodes (always the last level)."""
        return self.levels[-1]

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype`; refuses dtypes the device has no peak for."""
        cited = self.peak_flops.get(dtype)
        if cited is not None:
            return float(cited.value)
        supported = ", ".join(self.peak_flops)
        if dtype not in DTYPES:
            raise ProfileError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)} "
                               f"({self.name} supports {supported})")
        raise ProfileError(f"{self.name} has no {dtype} peak: it supports {supported}; "
                           f"plan in one of those or choose another profile")

    def check_device_count(self, devices: int) -> int:
        """Number of nodes that `devices` devices occupy; refuses counts the system can't form."""
        per_node = int(self.devices_per_node.value)
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > MAX_DEVICES:
            raise ProfileError(f"{devices} devices: more than any cluster shardplan plans "
                               f"for (at most {MAX_DEVICES})")
        if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
            if devices <= per_node and devices in self._within_node_counts():
                return 1
            if devices > per_node and devices % per_node == 0:
                return devices // per_node
        raise ProfileError(f"{self.name} cannot form {devices} devices: use "
                           f"{self._within_node_text()} devices inside a node, or a multiple "
                           f"of {per_node} (whole nodes)")

    def level_for_group(self, span: int) -> LinkLevel:
        """The innermost level whose groups hold `span` consecutive devices.

        `span` is the extent of a device group (last id - first id + 1). Groups made by a
        device mesh whose axis sizes divide the level sizes are aligned to level
        boundaries, so the extent alone decides which link they use.
        """
        if isinstance(span, bool) or not isinstance(span, int) or span < 1:
            raise ProfileError(f"{self.name}: a device group must span at least 1 device, "
                               f"got {span!r}")
        for level in self.levels:
            if level.group_size is None or level.group_size >= span:
                return level
        return self.inter_node_level  # unreachable: validation ends levels with a null one

    def _within_node_counts(self) -> Sequence[int]:
        if self.allowed_devices_within_node is not None:
            return tuple(self.allowed_devices_within_node.value)
        return range(1, int(self.devices_per_node.value) + 1)  # a range: `in` is O(1)

    def matmul_overhead(self, peak_key: str) -> float | None:
        """The profile's GEMM ramp R for a peak_flops key, or None when it gives none."""
        ramp = self.matmul_overhead_s
        if isinstance(ramp, dict):
            ramp = ramp.get(peak_key)
        return None if ramp is None else float(ramp.value)

    def _within_node_text(self) -> str:
        counts = self._within_node_counts()
        if self.allowed_devices_within_node is None and len(counts) > 2:
            return f"1 to {counts[-1]}"
        words = [str(c) for c in counts]
        return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def list_profiles() -> list[str]:
    """Names of the bundled profiles, sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """Load a bundled profile by name ("a100-80g") or any profile JSON file by path."""
    path = _resolve(name_or_path)
    data = _read_json(path)
    return _Reader(str(path)).profile(data)


def _resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """Map a bundled name to its file; anything that looks like a path stays a path."""
    text = os.fspath(name_or_path)
    looks_like_path = (not isinstance(name_or_path, str) or text.endswith(".json")
                       or os.sep in text or "/" in text)
    if not looks_like_path:
        if text in list_profiles():
            return PROFILE_DIR / f"{text}.json"
        if not Path(text).is_file():
            raise ProfileError(f"unknown hardware profile {text!r}: bundled profiles are "
                               f"{', '.join(list_profiles())}; or give the path of a "
                               f"profile JSON file")
    return Path(text)


def _read_json(path: Path) -> Any:
    """Parse the file with the bounded reader, turning I/O, encoding and syntax problems
    into one-line ProfileErrors."""
    return read_json(path, "profile", ProfileError,
                     missing="check the path, or use one of the bundled profiles: "
                     f"{', '.join(list_profiles())}")


class _Reader:
    """Validates one parsed profile; every failure names the file and the field path."""

    hint = FORMAT_HINT  # where the format is described: the last words of every refusal

    def __init__(self, path: str) -> None:
        self.path = path
        self.sources: dict[str, str] = {}

    def fail(self, field: str, problem: str) -> NoReturn:
        raise ProfileError(f"{self.path}: {field} {problem}; {self.hint}")

    # -- structure -------------------------------------------------------------------

    def obj(self, value: Any, field: str, required: tuple[str, ...],
            optional: tuple[str, ...] = ()) -> dict[str, Any]:
        """An object with all `required` keys and no keys outside required + optional."""
        where = field or "the file's top level"
        if not isinstance(value, dict):
            self.fail(where, f"must be a JSON object, got {_kind(value)}")
        for key in required:
            if key not in value:
                self.fail(_join(field, key), "is missing; add it")
        unknown = sorted(set(value) - set(required) - set(optional))
        if unknown:
            self.fail(_join(field, unknown[0]), f"is not a known field (known: "
                      f"{', '.join(required + optional)}); remove it or fix its spelling")
        return value

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(field, f"must be a non-empty string, got {_show(value)}")
        return value

    # -- numbers ---------------------------------------------------------------------

    def positive(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(field, f"must be a positive number, got {_show(value)}")
        number = _as_float(value)
        if not math.isfinite(number) or number <= 0:
            self.fail(field, f"must be a finite positive number, got {_show(value)}")
        self.in_range(number, value, field, POSITIVE_RANGE[0])
        return value

    def non_negative(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(field, f"must be a number of seconds, got {_show(value)}")
        number = _as_float(value)
        if not math.isfinite(number) or number < 0:
            self.fail(field, f"must be a finite number >= 0, got {_show(value)}")
        self.in_range(number, value, field, 0.0)
        return value

    def in_range(self, number: float, value: Any, field: str, low: float) -> None:
        if not low <= number <= POSITIVE_RANGE[1]:
            self.fail(field, f"must lie between {low:g} and {POSITIVE_RANGE[1]:g}, got "
                      f"{_show(value)}; check its unit")

    def fabric_word(self, value: Any, field: str) -> str:
        return self.word(value, field, FABRICS)

    def kernel_word(self, device: dict[str, Any], key: str,
                    choices: Sequence[str]) -> Cited[str] | None:
        """One entry of `device.kernels` ({attention: cited "flash"|"eager", fusion: cited
        "elementwise"|"none"}, both optional)."""
        if "kernels" not in device:
            return None
        body = self.obj(device["kernels"], "device.kernels", (), _KERNEL_FIELDS)
        if key not in body:
            return None
        return self.cited(body[key], f"device.kernels.{key}",
                          lambda v, f: self.word(v, f, choices))

    def word(self, value: Any, field: str, choices: Sequence[str]) -> str:
        if value not in choices:
            self.fail(field, f"must be one of {', '.join(map(repr, choices))}, "
                      f"got {_show(value)}")
        return value

    def fraction(self, value: Any, field: str) -> float:
        number = self.positive(value, field)
        if number > 1:
            self.fail(field, f"must be a fraction in (0, 1], got {_show(value)}")
        return number

    def share(self, value: Any, field: str) -> float:
        """A fraction in [0, 1], 0 included (`device.compute_overlap`)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= _as_float(value) <= 1:
            self.fail(field, f"must be a number in [0, 1], got {_show(value)}")
        return value

    def count(self, value: Any, field: str, most: int = MAX_DEVICES) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(field, f"must be a positive integer, got {_show(value)}")
        if value > most:
            self.fail(field, f"must be at most {most}, got {_show(value)}")
        return value

    def memory(self, value: Any, field: str) -> int:
        return self.count(value, field, MAX_MEMORY_BYTES)

    def counts(self, value: Any, field: str) -> tuple[int, ...]:
        if not isinstance(value, list) or not value:
            self.fail(field, f"must be a non-empty list of device counts, got {_show(value)}")
        items = tuple(self.count(v, f"{field}[{i}]") for i, v in enumerate(value))
        if any(b <= a for a, b in pairwise(items)):
            self.fail(field, f"must be strictly increasing, got {list(items)}")
        return items

    # -- cited values ----------------------------------------------------------------

    def cited(self, value: Any, field: str, check: Callable[[Any, str], V]) -> Cited[V]:
        """A {value, source, note?} object whose value passes `check` and source resolves."""
        body = self.obj(value, field, _CITED_FIELDS, _CITED_OPTIONAL)
        number = check(body["value"], f"{field}.value")
        source = self.text(body["source"], f"{field}.source")
        if source not in self.sources:
            self.fail(f"{field}.source", f"{source!r} is not a key of sources (keys: "
                      f"{', '.join(self.sources)}); add the citation to sources")
        note = body.get("note", "")
        if not isinstance(note, str):
            self.fail(f"{field}.note", f"must be a string, got {_show(note)}")
        if source == "derived" and not note.strip():
            self.fail(f"{field}.note", "must explain the arithmetic of a derived value")
        return Cited(number, source, note)

    # -- sections --------------------------------------------------------------------

    def profile(self, data: Any) -> HardwareProfile:
        if isinstance(data, dict) and "schema" in data and data["schema"] != SCHEMA:
            self.fail("schema", f"must be {SCHEMA!r}, got {_show(data['schema'])}: this "
                      f"version of shardplan reads only that schema")
        top = self.obj(data, "", _TOP_FIELDS)
        name = self.text(top["name"], "name")
        description = self.text(top["description"], "description")
        self.sources = self.read_sources(top["sources"])
        device = self.obj(top["device"], "device", _DEVICE_FIELDS, _DEVICE_OPTIONAL)
        topology = self.obj(top["topology"], "topology", _TOPOLOGY_FIELDS, _TOPOLOGY_OPTIONAL)
        per_node = self.cited(topology["devices_per_node"], "topology.devices_per_node",
                              self.count)
        return HardwareProfile(
            name=name,
            description=description,
            sources=dict(self.sources),
            memory_bytes=self.cited(device["memory_bytes"], "device.memory_bytes", self.memory),
            memory_bandwidth_Bps=self.cited(device["memory_bandwidth_Bps"],
                                            "device.memory_bandwidth_Bps", self.positive),
            peak_flops=self.peaks(device["peak_flops"]),
            matmul_efficiency=self.cited(device["matmul_efficiency"],
                                         "device.matmul_efficiency", self.fraction),
            memory_efficiency=self.cited(device["memory_efficiency"],
                                         "device.memory_efficiency", self.fraction),
            kernel_launch_s=self.cited(device["kernel_launch_s"], "device.kernel_launch_s",
                                       self.positive),
            devices_per_node=per_node,
            allowed_devices_within_node=self.allowed(topology, int(per_node.value)),
            levels=self.levels(topology["levels"], int(per_node.value)),
            path=self.path,
            matmul_overhead_s=self.overhead(device),  # after peak_flops: it names its keys
            **self.gemm_shape(device),
            attention_kernel=self.kernel_word(device, "attention",
                                              [k.value for k in AttentionKernel]),
            fusion=self.kernel_word(device, "fusion", [k.value for k in Fusion]),
            compute_overlap=self.cited(device["compute_overlap"], "device.compute_overlap",
                                       self.share) if "compute_overlap" in device else None,
            host_op_s=self.host_ops(device),
            host_step_s=self.cited(device["host_step_s"], "device.host_step_s",
                                   self.non_negative) if "host_step_s" in device else None,
        )

    def host_ops(self, device: dict[str, Any]) -> HostOpSeconds | None:
        """`device.host_op_s`: {forward_local, backward_local, forward_distributed,
        backward_distributed}, each a cited time of seconds (0 allowed)."""
        if "host_op_s" not in device:
            return None
        field = "device.host_op_s"
        body = self.obj(device["host_op_s"], field, _HOST_OP_FIELDS)
        return HostOpSeconds(*(self.cited(body[key], f"{field}.{key}", self.non_negative)
                               for key in _HOST_OP_FIELDS))

    def read_sources(self, value: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not value:
            self.fail("sources", f"must be a non-empty object of citations, got {_kind(value)}")
        for key, citation in value.items():
            if not key.strip():
                self.fail("sources", "has an empty key; name every citation")
            self.text(citation, f"sources.{key}")
        return dict(value)

    def peaks(self, value: Any) -> dict[str, Cited[float]]:
        field = "device.peak_flops"
        if not isinstance(value, dict) or not value:
            self.fail(field, f"must be a non-empty object of dtype -> cited FLOP/s, "
                      f"got {_show(value)}")
        self.dtype_keys(field, value)
        return {d: self.cited(v, f"{field}.{d}", self.positive) for d, v in value.items()}

    def dtype_keys(self, field: str, value: dict[str, Any]) -> None:
        for dtype in value:
            if dtype not in DTYPES:
                self.fail(f"{field}.{dtype}", f"is not a known dtype (known: "
                          f"{', '.join(DTYPES)})")

    def overhead(self, device: dict[str, Any]) -> Cited[float] | dict[str, Cited[float]] | None:
        """`device.matmul_overhead_s`: one cited time, or one per peak_flops key."""
        peaks = device["peak_flops"]  # already checked: the argument before this one
        field = "device.matmul_overhead_s"
        if "matmul_overhead_s" not in device:
            return None
        value = device["matmul_overhead_s"]
        if isinstance(value, dict) and ("value" in value or "source" in value):
            return self.cited(value, field, self.non_negative)
        if not isinstance(value, dict) or not value:
            self.fail(field, f"must be a cited time {{value, source, note}} or a non-empty "
                      f"object of dtype -> cited time, got {_show(value)}")
        self.dtype_keys(field, value)
        for dtype in value:
            if dtype not in peaks:
                self.fail(f"{field}.{dtype}", f"has no device.peak_flops.{dtype} to go with "
                          f"it (peaks: {', '.join(peaks)})")
        return {d: self.cited(v, f"{field}.{d}", self.non_negative) for d, v in value.items()}

    def gemm_shape(self, device: dict[str, Any]) -> dict[str, Any]:
        """`device.compute_units` and `device.gemm_tile`: both or neither."""
        given = [key for key in ("compute_units", "gemm_tile") if key in device]
        if len(given) == 1:
            other = "gemm_tile" if given[0] == "compute_units" else "compute_units"
            self.fail(f"device.{other}", f"is missing; GEMM shape pricing needs it together "
                      f"with device.{given[0]}")
        if not given:
            return {}
        return {"compute_units": self.cited(device["compute_units"], "device.compute_units",
                                            self.count),
                "gemm_tile": self.cited(device["gemm_tile"], "device.gemm_tile", self.tile)}

    def tile(self, value: Any, field: str) -> tuple[int, int, int]:
        if not isinstance(value, list) or len(value) != 3:
            self.fail(field, f"must be a list of 3 tile sizes [m, n, k], got {_show(value)}")
        sizes = [self.count(v, f"{field}[{i}]", MAX_TILE) for i, v in enumerate(value)]
        return sizes[0], sizes[1], sizes[2]

    def allowed(self, topology: dict[str, Any], per_node: int) -> Cited[tuple[int, ...]] | None:
        field = "topology.allowed_devices_within_node"
        if "allowed_devices_within_node" not in topology:
            return None
        cited = self.cited(topology["allowed_devices_within_node"], field, self.counts)
        counts = cited.value
        if counts[-1] != per_node:
            self.fail(f"{field}.value", f"must end with devices_per_node ({per_node}) so whole "
                      f"nodes can be used, got {list(counts)}")
        return cited

    def levels(self, value: Any, per_node: int) -> tuple[LinkLevel, ...]:
        field = "topology.levels"
        if not isinstance(value, list) or not value:
            self.fail(field, f"must be a non-empty list of levels, got {_show(value)}")
        levels = tuple(self.level(v, f"{field}[{i}]") for i, v in enumerate(value))
        self.check_order(levels, per_node)
        return levels

    def level(self, value: Any, field: str) -> LinkLevel:
        body = self.obj(value, field, _LEVEL_FIELDS, _LEVEL_OPTIONAL)
        size = body["group_size"]
        return LinkLevel(
            name=self.text(body["name"], f"{field}.name"),
            group_size=None if size is None else self.count(size, f"{field}.group_size"),
            bandwidth_Bps=self.cited(body["bandwidth_Bps"], f"{field}.bandwidth_Bps",
                                     self.positive),
            efficiency=self.cited(body["efficiency"], f"{field}.efficiency", self.fraction),
            latency_s=self.cited(body["latency_s"], f"{field}.latency_s", self.positive),
            fabric=(self.cited(body["fabric"], f"{field}.fabric", self.fabric_word)
                    if "fabric" in body else None),
            collective_factors=self.per_collective(
                body.get("collective_factors", {}), f"{field}.collective_factors",
                "cited factor", self.positive),
            collective_times=self.per_collective(
                body.get("collective_times", {}), f"{field}.collective_times",
                "cited points", self.points),
        )

    def points(self, value: Any, field: str) -> tuple[tuple[int, float, float], ...]:
        """`collective_times` values: [group size, bytes, seconds] points, one per
        (group size, bytes)."""
        if not isinstance(value, list) or not value or len(value) > MAX_TIME_POINTS:
            self.fail(field, f"must be a list of 1 to {MAX_TIME_POINTS} [group size, bytes, "
                      f"seconds] points, got {_show(value)}")
        found: list[tuple[int, float, float]] = []
        for i, point in enumerate(value):
            where = f"{field}[{i}]"
            if not isinstance(point, list) or len(point) != 3:
                self.fail(where, f"must be [group size, bytes, seconds], got {_show(point)}")
            size = self.count(point[0], f"{where}[0]")
            if size < 2:
                self.fail(f"{where}[0]", f"a collective needs a group of 2 or more, got {size}")
            found.append((size, float(self.positive(point[1], f"{where}[1]")),
                          float(self.positive(point[2], f"{where}[2]"))))
        keys = [(p, n) for p, n, _ in found]
        if len(set(keys)) != len(keys):
            self.fail(field, "lists one (group size, bytes) point twice; keep one")
        return tuple(found)

    def per_collective(self, value: Any, field: str, what: str,
                       check: Callable[[Any, str], V]) -> dict[str, Cited[V]]:
        """A level's object of collective kind -> cited value passing `check`:
        `collective_factors` (bandwidth factors > 0) and `collective_times` (points)."""
        if not isinstance(value, dict):
            self.fail(field, f"must be an object of collective kind -> {what}, "
                      f"got {_show(value)}")
        for kind in value:
            if kind not in COLLECTIVES:
                self.fail(f"{field}.{kind}", f"is not a known collective (known: "
                          f"{', '.join(COLLECTIVES)})")
        return {k: self.cited(v, f"{field}.{k}", check) for k, v in value.items()}

    def check_order(self, levels: tuple[LinkLevel, ...], per_node: int) -> None:
        """Innermost first; sizes grow and divide; node level = devices_per_node; null last."""
        field = "topology.levels"
        if levels[-1].group_size is not None:
            self.fail(f"{field}[{len(levels) - 1}].group_size", "must be null: the last level "
                      "is the inter-node fabric")
        names = [level.name for level in levels]
        previous: int | None = None  # the group size of the level before (None for the first)
        for i, level in enumerate(levels[:-1]):
            size = level.group_size
            where = f"{field}[{i}].group_size"
            if size is None:
                self.fail(where, "is null but only the last level may be (inter-node)")
            if size < 2:
                self.fail(where, f"must be at least 2 devices, got {size}")
            if previous is not None and (size <= previous or size % previous):
                self.fail(where, f"must be larger than and a multiple of the level before "
                          f"({previous}), got {size}")
            if names.count(level.name) > 1:
                self.fail(f"{field}[{i}].name", f"{level.name!r} is used by two levels")
            previous = size
        if levels[-1].fabric_kind == "full_mesh":
            self.fail(f"{field}[{len(levels) - 1}].fabric.value", "cannot be 'full_mesh' on "
                      "the inter-node level (group_size null): a mesh needs a block size; "
                      "use 'switch' or leave fabric out")
        inner = levels[-2].group_size if len(levels) > 1 else 1
        if inner != per_node:
            where = f"{field}[{len(levels) - 2}].group_size" if len(levels) > 1 else field
            self.fail(where, f"must equal topology.devices_per_node ({per_node}) for the last "
                      f"intra-node level, got {inner}")


def _as_float(value: int | float) -> float:
    """The value as a float; inf for integers too large for one (10**400 parses as an int)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _show(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
