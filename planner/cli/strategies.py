"""Reading `plan --strategies FILE`: user input, so every flaw is a one-line ShardplanError."""

from __future__ import annotations

import json
from pathlib import Path

from planner.errors import ShardplanError


def load_strategies(path: str) -> dict[str, list[list[int]]]:
    """`{"op name or glob": [[1, 1], [1, 2]], ...}` from JSON, or YAML when PyYAML is there."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ShardplanError(f"{file}: cannot read the strategies file ({exc.strerror})") from None
    if file.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ShardplanError(f"{file}: reading YAML needs PyYAML (pip install pyyaml); "
                                 "or write the strategies as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ShardplanError(f"{file}: not valid YAML ({where}{problem})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ShardplanError(f"{file}: not valid JSON (line {exc.lineno}, column "
                                 f"{exc.colno}: {exc.msg})") from None
    if isinstance(data, dict) and "strategies" in data and isinstance(data["strategies"], dict):
        data = data["strategies"]
    if not isinstance(data, dict) or not data:
        raise ShardplanError(f"{file}: expected an object mapping op names to strategy tuples")
    for name, tuples in data.items():
        # one list per data input, one factor per dim: a scalar input's list is empty
        # (plan files write `[[2, 1, 1, 1], []]` for an op with a scalar input)
        if not (isinstance(tuples, list) and tuples and all(isinstance(t, list) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in t)
                for t in tuples)):
            raise ShardplanError(f"{file}: strategy of {name!r} must be a list of lists of "
                                 f"positive integers (an empty list for a scalar input), "
                                 f"like [[1, 1], [1, 2]]; got {tuples!r}")
    return data
