"""Bytes, counts, seconds and lists as people read them, for messages and summaries."""

from __future__ import annotations

from collections.abc import Sequence


def human_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def human_count(value: float) -> str:
    """1,234 → "1.2 K", 124,439,808 → "124.4 M": counts of parameters at any scale."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{int(value)}"


def human_seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3f} ms"
    return f"{value * 1e6:.1f} us"


def first_listed(items: Sequence[str], shown: int, separator: str = ", ") -> str:
    """The first `shown` items joined, then how many more there are ("a, b and 3 more";
    "a; b; and 3 more"): a message about 2,000 inputs names a few, not 100 KB of them."""
    head = separator.join(items[:shown])
    rest = len(items) - shown
    if rest <= 0:
        return head
    return f"{head}{' ' if separator == ', ' else separator}and {rest} more"
