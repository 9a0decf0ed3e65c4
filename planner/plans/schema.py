"""Check a plan file's JSON against the strategy schema, naming the first bad JSON path.

Plans are written by `shardplan plan` but read back later by the executor and the
exporters, possibly after a hand edit, a merge or a truncated copy. A wrong type would
otherwise surface as a traceback deep in the executor. So loading a plan checks its JSON
against `planner/plans/strategy.schema.json` (the documented contract, with a small
validator: no extra dependency) before building the typed Plan, and then
(`planner.plans.checks`) that every layout can be laid on the plan's mesh.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from planner.errors import PlanFileError

SCHEMA_FILE = Path(__file__).with_name("strategy.schema.json")
REMEDY = "re-create the plan with `shardplan plan -o`"

_KINDS = {"object": "an object", "array": "an array", "string": "a string",
          "boolean": "true or false", "null": "null", "integer": "an integer",
          "number": "a number"}

Path_ = tuple[str | int, ...]


@cache
def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def check_plan_json(data: Any, source: str) -> None:
    """Refuse JSON that breaks the strategy schema, naming the first offending path."""
    problem = _Validator(_schema()).check(data, _schema(), None)
    if problem is not None:
        at, message = problem
        raise PlanFileError(f"{source}: {_show(_path(at))} {message}; {REMEDY}")


#: where a value lies, as the validator passes it down: None at the root, else (where
#: its parent lies, its key); spelled out as a path only for the value it refuses (a
#: 50,000-op plan holds millions of values)
At = tuple[Any, str | int] | None


def _path(at: At) -> Path_:
    parts: list[str | int] = []
    while at is not None:
        at, key = at
        parts.append(key)
    return tuple(reversed(parts))


def _show(path: Path_) -> str:
    if not path:
        return "the plan"
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _describe(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float | str):
        text = json.dumps(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return "an object" if isinstance(value, dict) else "an array"


#: the Python types `json` reads each JSON Schema kind as (a bool is no integer)
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "null": (type(None),), "integer": (int,), "number": (int, float)}


def _is(value: Any, kind: str) -> bool:
    """Whether `value` is of the JSON Schema `kind` (a bool is no integer or number)."""
    return isinstance(value, _TYPES[kind]) and not (
        isinstance(value, bool) and kind in ("integer", "number"))


class _Keywords(NamedTuple):
    """What a schema's keywords ask of a value, found once per schema."""

    schema: dict[str, Any]  # the reference followed
    types: frozenset[type] | None  # the Python types JSON gives the kinds allowed
    choice: bool  # a const or an enum
    pattern: bool


class _Validator:
    """The JSON Schema keywords the strategy schema uses; returns (where, problem) or None.
    Each schema's applicable checks are found once (`_keywords_of`), not asked of every
    value."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self._keywords: dict[int, _Keywords] = {}

    def _keywords_of(self, schema: dict[str, Any]) -> _Keywords:
        """`schema` with its reference followed, and what its keywords ask of a value."""
        found = self._keywords.get(id(schema))
        if found is None:
            resolved = self._resolve(schema["$ref"]) if "$ref" in schema else schema
            kinds = resolved.get("type")
            kinds = [kinds] if isinstance(kinds, str) else kinds
            found = self._keywords[id(schema)] = _Keywords(
                resolved, frozenset(t for k in kinds for t in _TYPES[k]) if kinds else None,
                "const" in resolved or "enum" in resolved, "pattern" in resolved)
        return found

    def check(self, value: Any, schema: dict[str, Any], at: At) -> tuple[At, str] | None:
        asked = self._keywords_of(schema)
        schema = asked.schema
        if "oneOf" in schema:
            return self._one_of(value, schema["oneOf"], at)
        kind = type(value)
        if asked.types is not None and kind not in asked.types:
            wrong = self._kind(value, schema)  # (a subclass of an allowed type passes)
            if wrong:
                return at, wrong
        problem = (asked.choice and self._choice(value, schema)) or (
            (kind is int or kind is float) and self._number(value, schema)) or (
            asked.pattern and self._string(value, schema))
        if problem:
            return at, problem
        if kind is dict:
            return self._object(value, schema, at)
        if kind is list:
            return self._array(value, schema, at)
        return None

    def _resolve(self, ref: str) -> dict[str, Any]:
        node: Any = self.root
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
        return node

    def _one_of(self, value: Any, options: Sequence[dict[str, Any]],
                at: At) -> tuple[At, str] | None:
        problems = [self.check(value, option, at) for option in options]
        if sum(p is None for p in problems) == 1:
            return None
        deepest = max((p for p in problems if p is not None), key=lambda p: len(_path(p[0])),
                      default=(at, "matches more than one allowed form"))
        return deepest

    @staticmethod
    def _kind(value: Any, schema: dict[str, Any]) -> str:
        kinds = schema.get("type")
        if kinds is None:
            return ""
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if any(_is(value, k) for k in kinds):
            return ""
        wanted = " or ".join(_KINDS[k] for k in kinds)
        return f"must be {wanted}, got {_describe(value)}"

    @staticmethod
    def _choice(value: Any, schema: dict[str, Any]) -> str:
        if "const" in schema and value != schema["const"]:
            return f"must be {json.dumps(schema['const'])}, got {_describe(value)}"
        if "enum" in schema and value not in schema["enum"]:
            allowed = ", ".join(json.dumps(v) for v in schema["enum"])
            return f"must be one of {allowed}, got {_describe(value)}"
        return ""

    @staticmethod
    def _number(value: Any, schema: dict[str, Any]) -> str:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return ""
        if isinstance(value, float) and math.isnan(value):
            return "is NaN"
        if "minimum" in schema and value < schema["minimum"]:
            return f"must be at least {schema['minimum']}, got {_describe(value)}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"must be at most {schema['maximum']}, got {_describe(value)}"
        return ""

    @staticmethod
    def _string(value: Any, schema: dict[str, Any]) -> str:
        if isinstance(value, str) and "pattern" in schema and not re.search(
                schema["pattern"], value):
            return f"must match {schema['pattern']}, got {_describe(value)}"
        return ""

    def _object(self, value: dict[str, Any], schema: dict[str, Any],
                at: At) -> tuple[At, str] | None:
        for key in schema.get("required", ()):
            if key not in value:
                return (at, key), "is missing"
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            problem = self.check(item, sub, (at, key)) if sub is not None else None
            if problem:
                return problem
        return None

    def _array(self, value: list[Any], schema: dict[str, Any],
               at: At) -> tuple[At, str] | None:
        if len(value) < schema.get("minItems", 0):
            return at, f"must have at least {schema['minItems']} items, got {len(value)}"
        if len(value) > schema.get("maxItems", len(value)):
            return at, f"must have at most {schema['maxItems']} items, got {len(value)}"
        items = schema.get("items")
        if items is None:
            return None
        for index, item in enumerate(value):
            problem = self.check(item, items, (at, index))
            if problem:
                return problem
        return None
