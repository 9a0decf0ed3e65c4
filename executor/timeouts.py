"""How long a run waits for a rank that stopped answering (torch-free: the CLI reads it)."""

from __future__ import annotations

from planner.errors import ShardplanError

DEFAULT_TIMEOUT_S = 300.0  # torch's gloo default is 30 min; a CPU step here takes seconds
MOST_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout(seconds: float) -> float:
    """The collective timeout, or one error: a finite number of seconds in [1, a week]."""
    number = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    if not number or not 1.0 <= seconds <= MOST_TIMEOUT_S:
        raise ShardplanError(f"--timeout {seconds!r}: give seconds between 1 and "
                             f"{MOST_TIMEOUT_S:g} (a week)")
    return float(seconds)
