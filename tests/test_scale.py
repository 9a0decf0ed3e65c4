"""Planning stays near-linear in graph size: repeat detection by runs, not by shifts."""

from __future__ import annotations

import numpy as np

from planner.layers import Repeats, _best_run


def _shifts(codes: np.ndarray, offset: int) -> Repeats | None:
    """The definition, quadratic: for each period the longest stretch where codes repeat
    at that shift (first on ties), the period covering most ops (smallest on ties)."""
    best: Repeats | None = None
    for period in range(2, len(codes) // 2 + 1):
        equal = np.concatenate(([0], (codes[:-period] == codes[period:]).astype(np.int8), [0]))
        changes = np.flatnonzero(np.diff(equal))
        if not len(changes):
            continue
        lengths = changes[1::2] - changes[::2]
        longest = int(np.argmax(lengths))
        count = (int(lengths[longest]) + period) // period
        candidate = Repeats(offset + int(changes[::2][longest]), period, count)
        if count >= 2 and (best is None or candidate.covered > best.covered):
            best = candidate
    return best


def test_repeat_detection_by_runs_matches_the_definition() -> None:
    rng = np.random.default_rng(7)
    for trial in range(1000):
        n = int(rng.integers(0, 70))
        if trial % 2:
            base = rng.integers(0, 4, int(rng.integers(1, 8)))
            codes = np.tile(base, n // len(base) + 1)[:n].copy()
            for _ in range(int(rng.integers(0, 3))):
                if n:
                    codes[rng.integers(0, n)] = rng.integers(0, 5)
        else:
            codes = rng.integers(0, int(rng.integers(1, 4)), n)
        codes = codes.astype(np.int64)
        assert _best_run(codes, 3) == _shifts(codes, 3), codes.tolist()
