"""What the user asks the search for: mode, solver, limits, pinned choices and strategies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from costmodels.schedule import SCHEDULES
from planner.errors import ShardplanError
from planner.kinds import RECOMPUTE_MODES, ContextKind, Recompute, Runnable, Schedule

PARALLEL_KEYS = ("dp", "tp", "pp", "micro_batches", "zero", "recompute", "schedule", "vpp",
                 "layout", "sp", "cp", "cp_kind", "ep", "dp_shares", "stage_mesh")
#: Pins whose values are words, not integers.
TEXT_PINS = ("recompute", "schedule", "layout", "cp_kind", "dp_shares", "stage_mesh")
#: Schedules of several stages only (one stage has no bubble to fill).
PIPELINED_ONLY = (Schedule.INTERLEAVED, Schedule.ZB_H1, Schedule.ZBV)
JOINT_KEYS = ("pp", "micro_batches", "zero", "recompute", "schedule", "vpp",
              "layout", "sp", "cp_kind", "stage_mesh")  # joint only (and cp above 1)
#: `layout=megatron`: the tp axis splits as Megatron-LM does (`planner.search.megatron`)
#: instead of the fastest layout the op-level search finds.
LAYOUTS = ("megatron",)
#: `dp_shares`: how a mixed cluster's data-parallel replicas share the batch: "even" rows
#: each (what the executor runs), or "speed": in proportion to each one's speed
#: (`planner.search.stages.speed_rows`); unpinned, the search keeps the faster.
DP_SHARES = ("even", "speed")
#: `stage_mesh=shared`: every pipeline stage on the same (dp, tp) shape over as many
#: devices (what the executor runs); unpinned, the search also tries a shape and device
#: count per stage (`planner.search.stagemeshes.shaped_decision`) and keeps the faster.
STAGE_MESHES = ("shared",)


@dataclass(frozen=True)
class SearchOptions:
    mode: str = "auto"  # auto | semi
    solver: str = "auto"
    time_limit: float = 60.0
    max_mesh_axes: int = 2
    mesh: tuple[int, ...] | None = None
    parallel: Mapping[str, int | str] = field(default_factory=dict)
    #: what the executor the plan is for runs (`Pins.runnable`)
    runnable: Runnable = field(default_factory=lambda: Runnable())
    strategies: Mapping[str, Sequence[Sequence[int]]] = field(default_factory=dict)
    tie_layers: bool = True
    top_k: int = 3
    workers: int = 2


@dataclass(frozen=True)
class Pins:
    """The choices the user fixed with `--parallel` (None: searched)."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batches: int | None = None
    zero: int | None = None
    recompute: Recompute | None = None
    schedule: Schedule | None = None
    vpp: int | None = None  # interleaved model chunks per device
    layout: str | None = None  # "megatron": Megatron-LM's tensor-parallel split (LAYOUTS)
    sp: int | None = None  # 1: Megatron's sequence parallelism (implies layout=megatron)
    cp: int | None = None  # context parallel degree (an axis "cp" between dp and tp)
    #: how attention runs over cp (ring or ulysses); None: the faster, per configuration
    cp_kind: ContextKind | None = None
    ep: int | None = None  # expert parallel degree (an axis "ep" inside dp)
    dp_shares: str | None = None  # "even" or "speed" on a mixed cluster (DP_SHARES)
    stage_mesh: str | None = None  # "shared": one (dp, tp) shape for every stage
    #: what the executor the plan is for runs (`plan(runnable=...)`): an unpinned
    #: choice is made among those; not a user's pin
    runnable: Runnable = field(default_factory=lambda: Runnable())

    @property
    def shares(self) -> str | None:
        """`dp_shares` as the search takes it: the pin, else even where the executor the
        plan is for runs only even shares (None: the faster)."""
        return self.dp_shares or (None if self.runnable.uneven_shares else "even")

    def given(self) -> dict[str, int | str]:
        """The pins as the user gave them (for messages and the solver's record)."""
        return {f.name: (str(v) if isinstance(v, str) else v) for f in fields(self)
                if f.name != "runnable" and (v := getattr(self, f.name)) is not None}

    def spelled(self) -> str:
        """The pins as `--parallel` takes them: `dp=2,micro_batches=2`."""
        return ",".join(f"{name}={value}" for name, value in self.given().items())

    @property
    def joint_only(self) -> tuple[str, ...]:
        """The pinned choices only the joint search makes (pipeline, micro-batches, ZeRO,
        recompute, schedule)."""
        found = tuple(key for key in JOINT_KEYS if getattr(self, key) is not None)
        found += ("cp",) if self.cp not in (None, 1) else ()
        return (*found, "ep") if self.ep not in (None, 1) else found

    @property
    def admits_op_level(self) -> bool:
        """Whether an op-level plan (one stage, one micro-batch, no ZeRO, no recompute, the
        searched layout) can satisfy the pins: then the op-level search runs under them
        too, so a pin the optimum already has never costs the optimum."""
        return (self.pp in (None, 1) and self.micro_batches in (None, 1)
                and self.zero in (None, 0) and self.recompute in (None, Recompute.NONE)
                and self.schedule in (None, Schedule.ONE_F_ONE_B) and self.vpp is None
                and self.layout is None and self.sp in (None, 0) and self.cp in (None, 1)
                and self.cp_kind is None and self.ep in (None, 1)
                and self.dp_shares in (None, "even") and self.stage_mesh in (None, "shared"))

    def admit(self, dp: int, tp: int, layout: str | None = None) -> bool:
        """Whether an op-level plan of these degrees (with Megatron's layout when `layout`
        is "megatron") satisfies every pin."""
        return (replace(self, layout=None).admits_op_level
                and self.layout in (None, layout) and self.dp in (None, dp)
                and self.tp in (None, tp))

    def sequence_parallel_choices(self, tp: int) -> tuple[bool, ...]:
        """Whether a configuration of tensor-parallel degree `tp` runs Megatron's sequence
        parallelism: as pinned; both, for the search to price, under Megatron's layout
        with tp > 1 (it trades each all-reduce for a reduce-scatter and an all-gather of
        the same traffic and splits the activations between blocks by tp, so it wins
        when memory is short and is close either way); else off (a searched layout
        splits the sequence only if the op-level solve finds that faster)."""
        if self.sp is not None:
            return (self.sp == 1,)
        return (False, True) if self.layout == "megatron" and tp > 1 else (False,)

    @property
    def mesh_axes(self) -> bool:
        """Whether dp or tp is pinned: op-level meshes are then (dp, tp)."""
        return self.dp is not None or self.tp is not None


def check_pins(parallel: Mapping[str, int | str]) -> Pins:
    """The --parallel pins, checked: known keys, values in range."""
    unknown = [k for k in parallel if k not in PARALLEL_KEYS]
    if unknown:
        raise ShardplanError(f"--parallel {unknown[0]}: known keys are {', '.join(PARALLEL_KEYS)}")
    pins: dict[str, int | str] = {}
    for key, value in parallel.items():
        if key in TEXT_PINS:
            allowed = {"recompute": [str(m) for m in RECOMPUTE_MODES], "schedule": SCHEDULES,
                       "layout": list(LAYOUTS), "cp_kind": [str(k) for k in ContextKind],
                       "dp_shares": list(DP_SHARES), "stage_mesh": list(STAGE_MESHES)}[key]
            if value not in allowed:
                raise ShardplanError(f"--parallel {key}={value}: choose one of "
                                     f"{', '.join(allowed)}")
            pins[key] = str(value)
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShardplanError(f"--parallel {key}={value}: must be an integer")
        if key == "sp" and value not in (0, 1):
            raise ShardplanError(f"--parallel sp={value}: 1 turns Megatron's sequence "
                                 "parallelism on (with layout=megatron), 0 off")
        if key == "vpp" and value < 2:
            raise ShardplanError(f"--parallel vpp={value}: interleaving needs at least 2 "
                                 "model chunks per device")
        low = 0 if key in ("zero", "sp") else 1
        if value < low or (key == "zero" and value > 3):
            raise ShardplanError(f"--parallel {key}={value}: must be "
                                 f"{'0, 1, 2 or 3' if key == 'zero' else 'positive'}")
        pins[key] = value
    typed: dict[str, object] = dict(pins)
    if "recompute" in pins:
        typed["recompute"] = Recompute(str(pins["recompute"]))
    if "schedule" in pins:
        typed["schedule"] = Schedule(str(pins["schedule"]))
    if "cp_kind" in pins:
        typed["cp_kind"] = ContextKind(str(pins["cp_kind"]))
        if pins.get("cp") == 1:
            raise ShardplanError(f"--parallel cp_kind={pins['cp_kind']}: a kind of context "
                                 "parallelism needs cp of 2 or more, not cp=1")
    if pins.get("dp_shares") == "speed":
        against = [f"{key}={pins[key]}" for key in ("pp", "ep") if pins.get(key, 1) != 1]
        if against or pins.get("dp") == 1:
            raise ShardplanError(
                f"--parallel dp_shares=speed with {', '.join(against) or 'dp=1'}: replicas "
                "share the batch by speed in a plan of one pipeline stage (pp=1), no expert "
                "axis and dp of 2 or more; pin one or the other")
    if pins.get("sp") == 1:
        typed.setdefault("layout", "megatron")
    if pins.get("pp") == 1 and typed.get("schedule") in PIPELINED_ONLY:
        raise ShardplanError(f"--parallel schedule={pins['schedule']} pipelines: it needs "
                             "pp of 2 or more, not pp=1")
    if "vpp" in pins and typed.setdefault("schedule",
                                          Schedule.INTERLEAVED) != Schedule.INTERLEAVED:
        raise ShardplanError(f"--parallel vpp={pins['vpp']}: model chunks per device "
                             f"need schedule=interleaved, not {pins['schedule']}")
    return Pins(**typed)  # type: ignore[arg-type]
