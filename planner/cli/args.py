"""The argparse pieces the verbs share: the one-line-error parser and the argument types.

Every type raises ArgumentTypeError with a message naming the flag, so bad input ends in
one line and exit code 2 like every other bad input.
"""

from __future__ import annotations

import argparse
from typing import TypeAlias


class Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line, like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


#: What `add_subparsers(parser_class=Parser)` returns: each verb module adds its parser to it.
Verbs: TypeAlias = "argparse._SubParsersAction[Parser]"


def dim(text: str) -> tuple[str, int]:
    """`--dim seq=2048`: a symbolic input dim and its positive size."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: expected NAME=VALUE, e.g. seq=2048")
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: {value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: a dim must be positive")
    return name, number


def parallel(text: str) -> dict[str, int | str]:
    """`--parallel dp=4,tp=8,recompute=full`: pinned global choices (zero may be 0)."""
    pins: dict[str, int | str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--parallel {text!r}: expected KEY=VALUE,..., "
                                             "e.g. dp=4,tp=8")
        key = key.strip()
        if key in ("recompute", "schedule", "layout"):
            pins[key] = value.strip()
            continue
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--parallel {key}={value}: not an integer") from None
        if number < 0 or (number == 0 and key != "zero"):
            raise argparse.ArgumentTypeError(f"--parallel {key}={value}: must be positive")
        pins[key] = number
    return pins


def mesh(text: str) -> tuple[int, ...]:
    """`--mesh 2x4`: a mesh shape of 1 to 3 positive sizes."""
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected sizes like 2x4") from None
    if not 1 <= len(shape) <= 3 or any(v < 1 for v in shape):
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: 1 to 3 positive sizes, like 2x4")
    return shape


def positive_int(text: str) -> int:
    """An integer of at least 1 (device, rank, step and top-N counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value
