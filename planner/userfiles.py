"""Bounded readers for the JSON and YAML files users hand shardplan (plans, hardware
profiles, `--strategies`).

A file is input, not trusted: Python's parsers recurse once per nesting level (a file of
5,000 `[` ends in a RecursionError), refuse integers past 4,300 digits with a bare
ValueError, let the last of two equal keys win silently, and PyYAML shares one object
per alias, so a billion-laughs file is small until something walks or prints it. Every
reader here bounds nesting, integer size and (YAML) aliases and expansion, refuses
duplicate keys, and turns each failure into one line naming the file, and where it is
known the line, column or byte; callers pass the error class their input raises.
"""

from __future__ import annotations

import json
import reprlib
from pathlib import Path
from typing import Any

from planner.errors import ShardplanError

#: Nesting levels a file may have: plans have 8, profiles 5, strategies 3.
MAX_DEPTH = 64
#: Digits an integer may have: 10**400 must still reach a profile's range check, which
#: names the field; Python itself refuses past 4,300 with an unhandled ValueError.
MAX_INT_DIGITS = 1000
#: YAML aliases (`*name`) a file may use, and nodes it may expand to with every alias
#: replaced by what it names (a billion-laughs file is small but expands to 10**9).
MAX_YAML_ALIASES = 100
MAX_YAML_NODES = 1_000_000
#: Characters of a value or parser report shown in a message.
MAX_ECHO = 120

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring = 3, 6, 6, 60
_SHORT.maxother = 60


def short_repr(value: Any) -> str:
    """`repr` cut to MAX_ECHO characters without walking the whole value: a user's value
    may be a list of 10**9 shared elements."""
    text = _SHORT.repr(value)
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO - 3] + "..."


def read_bytes(file: Path, what: str, error: type[ShardplanError],
               missing: str = "check the path") -> bytes:
    """The file's bytes; a missing or unreadable file is one `error` naming it."""
    try:
        return file.read_bytes()
    except FileNotFoundError:
        raise error(f"{file}: no such {what} file; {missing}") from None
    except OSError as exc:
        raise error(f"{file}: cannot read the {what} file ({exc.strerror or exc}); check the "
                    "path and its permissions") from None


def decode_utf8(data: bytes, file: Path, what: str, error: type[ShardplanError]) -> str:
    """The text of a UTF-8 file; otherwise an error naming the first bad byte, its offset,
    line and column (a Latin-1 `é` in a hand-edited file)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = exc.start
        line = data.count(b"\n", 0, start) + 1
        column = start - (data.rfind(b"\n", 0, start) + 1) + 1
        raise error(f"{file}: not UTF-8 text: byte 0x{data[start]:02x} at offset {start} "
                    f"(line {line}, column {column}) cannot be decoded; save the {what} as "
                    "UTF-8") from None


def read_json(file: Path, what: str, error: type[ShardplanError],
              missing: str = "check the path") -> Any:
    """A JSON file's value, bounded (see `parse_json`)."""
    data = read_bytes(file, what, error, missing)
    return parse_json(decode_utf8(data, file, what, error), file, error)


class _Refused(Exception):
    """Raised from inside the JSON parser's hooks; `parse_json` adds the file."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _Refused(f"the key {short_repr(key)} appears twice in one object (keys "
                           f"{short_repr([k for k, _ in pairs])}); keep one")
        result[key] = value
    return result


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits (at most "
                       f"{MAX_INT_DIGITS}); check the number")
    return int(text)


def parse_json(text: str, file: Path, error: type[ShardplanError]) -> Any:
    """JSON with unique keys, integers of at most MAX_INT_DIGITS digits and at most
    MAX_DEPTH levels of nesting; anything else is one `error` naming the file."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise error(f"{file}: not valid JSON (line {exc.lineno}, column {exc.colno}: "
                    f"{exc.msg}); fix the syntax there") from None
    except _Refused as exc:
        raise error(f"{file}: {exc}") from None
    except RecursionError:  # the C scanner's own depth guard, far past MAX_DEPTH
        raise error(f"{file}: JSON nested more than {MAX_DEPTH} levels deep; no shardplan "
                    "file nests that deep") from None
    depth = nesting_depth(value, MAX_DEPTH)
    if depth > MAX_DEPTH:
        raise error(f"{file}: JSON nested more than {MAX_DEPTH} levels deep; no shardplan "
                    "file nests that deep")
    return value


def nesting_depth(value: Any, limit: int) -> int:
    """Levels of lists and dicts in a parsed JSON value (a tree), counted level by level
    without recursion; stops at `limit + 1`."""
    depth, level = 0, [value]
    while True:
        containers = [item for item in level if isinstance(item, list | dict)]
        if not containers:
            return depth
        depth += 1
        if depth > limit:
            return depth
        level = []
        for item in containers:
            level.extend(item.values() if isinstance(item, dict) else item)


def read_yaml(file: Path, text: str, error: type[ShardplanError]) -> Any:
    """YAML by PyYAML's safe loader, bounded: at most MAX_DEPTH levels, MAX_YAML_ALIASES
    aliases, MAX_YAML_NODES nodes with aliases expanded, integers of MAX_INT_DIGITS
    digits, no key twice in one mapping; a failure is one `error` naming the file and
    the line and column where it is known."""
    try:
        import yaml
    except ImportError:
        raise error(f"{file}: reading YAML needs PyYAML (pip install pyyaml); or write the "
                    "file as JSON") from None
    loader = _bounded_loader(yaml)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(yaml, node)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = " ".join(str(exc.problem or exc.context or type(exc).__name__).split())
        raise error(f"{file}: not valid YAML ({where}{problem[:MAX_ECHO]})") from None
    except yaml.YAMLError as exc:
        raise error(f"{file}: not valid YAML ({' '.join(str(exc).split())[:MAX_ECHO]})") \
            from None
    except RecursionError:
        raise error(f"{file}: YAML nested more than {MAX_DEPTH} levels deep; no shardplan "
                    "file nests that deep") from None
    finally:
        loader.dispose()


def _bounded_loader(yaml: Any) -> Any:
    """A SafeLoader subclass that counts depth and aliases while composing, refuses a
    key given twice in one mapping and integers of more than MAX_INT_DIGITS digits."""

    class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc, name-defined]
        depth = 0
        aliases = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_YAML_ALIASES:
                    raise yaml.composer.ComposerError(
                        None, None, f"more than {MAX_YAML_ALIASES} aliases; write the values "
                        "out", self.peek_event().start_mark)
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise yaml.composer.ComposerError(
                        None, None, f"nested more than {MAX_DEPTH} levels deep",
                        self.peek_event().start_mark)
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # unhashable: the base constructor says so
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {short_repr(key)} appears twice in one "
                        "mapping; keep one", key_node.start_mark)
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node: Any) -> Any:
            digits = sum(c.isalnum() for c in str(node.value))
            if digits > MAX_INT_DIGITS:
                raise yaml.constructor.ConstructorError(
                    None, None, f"an integer of {digits} digits (at most {MAX_INT_DIGITS})",
                    node.start_mark)
            return super().construct_yaml_int(node)

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    return BoundedLoader


def _check_expansion(yaml: Any, root: Any) -> None:
    """Refuse a node graph that expands past MAX_YAML_NODES nodes, or that contains itself
    (`&a [*a]`): sizes are summed once per distinct node (an alias is the node it names),
    so the count itself stays cheap."""
    size: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:  # post-order without recursion: children sized before their parent
        node, children_done = stack.pop()
        if children_done:
            total = 1 + sum(size[id(child)] for child in _children(yaml, node))
            if total > MAX_YAML_NODES:
                raise yaml.composer.ComposerError(
                    None, None, f"expands to more than {MAX_YAML_NODES} values through its "
                    "aliases; write the values out", node.start_mark)
            size[id(node)] = total
            continue
        if id(node) in size:
            if size[id(node)] < 0:  # reached again while its own children are open
                raise yaml.composer.ComposerError(
                    None, None, "an alias refers to a node that contains it; write the "
                    "values out", node.start_mark)
            continue
        size[id(node)] = -1
        stack.append((node, True))
        stack.extend((child, False) for child in _children(yaml, node))


def _children(yaml: Any, node: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
