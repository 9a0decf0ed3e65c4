"""The argparse pieces the verbs share: the one-line-error parser and the argument types.

Every type raises ArgumentTypeError with a message naming the flag, so bad input ends in
one line and exit code 2 like every other bad input.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from planner.errors import ShardplanError
from planner.search.options import TEXT_PINS


def one_line(message: str) -> str:
    """A message as one line: control characters (a newline in an op name, a YAML
    parser's multi-line report) escaped, so no input can forge a second error line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


class Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line, like every other bad input, and refuses a
    single-valued flag given twice (argparse's own last-one-wins would silently drop
    `--parallel dp=2` from `--parallel dp=2 --parallel tp=2`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class _StoreOnce(argparse._StoreAction):
    """`store`, refusing a second value for the same flag (repeatable flags use append)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        seen: set[str] = namespace.__dict__.setdefault("_given_once", set())
        if option_string is not None and self.dest in seen:
            hint = " (one flag pins several: --parallel dp=2,tp=2)" if self.dest == "parallel" \
                else ""
            raise argparse.ArgumentError(self, f"given twice; give it once{hint}")
        seen.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


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
        if key in pins:
            raise argparse.ArgumentTypeError(f"--parallel {text!r}: {key} is given twice; "
                                             "give each choice once")
        if key in TEXT_PINS:
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


#: Seeds are torch's and numpy's generators': at most 2**63 - 1 (torch.manual_seed takes
#: no more)
MOST_SEED = (1 << 63) - 1


def seed(text: str) -> int:
    """A random seed: an integer from 0 to 2**63 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= MOST_SEED:
        raise argparse.ArgumentTypeError(f"{value} is not in 0..2**63-1")
    return value


def positive_number(flag: str, most: float = math.inf) -> Callable[[str], float]:
    """A finite number above 0 (and at most `most`): NaN, inf and 0 are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a number") from None
        if not math.isfinite(value) or value <= 0 or value > most:
            bound = f" and at most {most:g}" if math.isfinite(most) else ""
            raise argparse.ArgumentTypeError(f"{flag} {text}: a finite number above 0{bound}")
        return value

    return parse


def unique_dims(pairs: Iterable[tuple[str, int]]) -> dict[str, int]:
    """`--dim` bindings, each dim once: a second value for one dim is refused, never
    silently the last one."""
    dims: dict[str, int] = {}
    for name, value in pairs:
        if name in dims and dims[name] != value:
            raise ShardplanError(f"--dim {name} is given twice ({dims[name]} and {value}); "
                                 "bind each dim once")
        dims[name] = value
    return dims


def check_output(path: str | Path | None, flag: str,
                 inputs: Sequence[str | Path | None] = ()) -> None:
    """Before any work: an output file goes into an existing folder, is not a folder, and
    is none of the command's inputs (`plan -o model.onnx` would overwrite the model)."""
    if path is None or str(path) == "":
        return
    try:
        _check_output(Path(path), flag, inputs)
    except OSError as exc:  # a name longer than the file system takes, a loop of links
        raise ShardplanError(f"{flag} {path}: {exc.strerror or exc}; give another path"
                             ) from None


def _check_output(target: Path, flag: str, inputs: Sequence[str | Path | None]) -> None:
    if target.is_dir():
        raise ShardplanError(f"{flag} {target}: is a folder; give a file path")
    if target.parent.exists() and not target.parent.is_dir():
        raise ShardplanError(f"{flag} {target}: {target.parent} is a file, not a folder; "
                             "give a path in a folder")
    if not target.parent.is_dir():
        raise ShardplanError(f"{flag} {target}: the folder {target.parent} does not exist; "
                             "create it first")
    for given in inputs:
        if given and Path(given).exists() and target.resolve() == Path(given).resolve():
            raise ShardplanError(f"{flag} {target}: is an input of this command; write the "
                                 "output elsewhere")
