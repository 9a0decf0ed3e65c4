"""Reading `plan --strategies FILE`: user input, so every flaw is a one-line ShardplanError."""

from __future__ import annotations

from pathlib import Path

from planner.errors import ShardplanError
from planner.userfiles import decode_utf8, parse_json, read_bytes, read_yaml, short_repr


def load_strategies(path: str) -> dict[str, list[list[int]]]:
    """`{"op name or glob": [[1, 1], [1, 2]], ...}` from JSON, or YAML when PyYAML is there,
    read with the bounded readers of `planner.userfiles`."""
    file = Path(path)
    text = decode_utf8(read_bytes(file, "strategies", ShardplanError), file, "strategies file",
                       ShardplanError)
    if file.suffix.lower() in (".yaml", ".yml"):
        data = read_yaml(file, text, ShardplanError)
    else:
        data = parse_json(text, file, ShardplanError)
    if isinstance(data, dict) and "strategies" in data and isinstance(data["strategies"], dict):
        data = data["strategies"]
    if not isinstance(data, dict) or not data:
        raise ShardplanError(f"{file}: expected an object mapping op names to strategy tuples")
    for name, tuples in data.items():
        if not isinstance(name, str) or not name:
            raise ShardplanError(f"{file}: op name {short_repr(name)} must be a non-empty "
                                 "string (an op name or a glob pattern); quote it")
        # one list per data input, one factor per dim: a scalar input's list is empty
        # (plan files write `[[2, 1, 1, 1], []]` for an op with a scalar input)
        if not (isinstance(tuples, list) and tuples and all(isinstance(t, list) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in t)
                for t in tuples)):
            raise ShardplanError(f"{file}: strategy of {short_repr(name)} must be a list of "
                                 "lists of positive integers (an empty list for a scalar "
                                 f"input), like [[1, 1], [1, 2]]; got {short_repr(tuples)}")
    return data
