"""What the user asks the search for: mode, solver, limits, pinned choices and strategies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from costmodels.schedule import SCHEDULES
from planner.errors import ShardplanError
from planner.kinds import RECOMPUTE_MODES

PARALLEL_KEYS = ("dp", "tp", "pp", "micro_batches", "zero", "recompute", "schedule")
JOINT_KEYS = ("pp", "micro_batches", "zero", "recompute", "schedule")  # only the joint search


@dataclass(frozen=True)
class SearchOptions:
    mode: str = "auto"  # auto | semi
    solver: str = "auto"
    time_limit: float = 60.0
    max_mesh_axes: int = 2
    mesh: tuple[int, ...] | None = None
    parallel: Mapping[str, int | str] = field(default_factory=dict)
    strategies: Mapping[str, Sequence[Sequence[int]]] = field(default_factory=dict)
    tie_layers: bool = True
    top_k: int = 3
    workers: int = 2


def check_pins(parallel: Mapping[str, int | str]) -> dict[str, int | str]:
    """The --parallel pins, checked: known keys, values in range."""
    unknown = [k for k in parallel if k not in PARALLEL_KEYS]
    if unknown:
        raise ShardplanError(f"--parallel {unknown[0]}: known keys are {', '.join(PARALLEL_KEYS)}")
    pins: dict[str, int | str] = {}
    for key, value in parallel.items():
        if key in ("recompute", "schedule"):
            allowed = [str(m) for m in RECOMPUTE_MODES] if key == "recompute" else SCHEDULES
            if value not in allowed:
                raise ShardplanError(f"--parallel {key}={value}: choose one of "
                                     f"{', '.join(allowed)}")
            pins[key] = str(value)
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShardplanError(f"--parallel {key}={value}: must be an integer")
        low = 0 if key == "zero" else 1
        if value < low or (key == "zero" and value > 3):
            raise ShardplanError(f"--parallel {key}={value}: must be "
                                 f"{'0, 1, 2 or 3' if key == 'zero' else 'positive'}")
        pins[key] = value
    return pins
