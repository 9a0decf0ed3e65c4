"""Compare two folders of plan files (from `bench/plan_corpus.py`), field by field.

For every plan in both folders it says whether the files are byte-identical, and otherwise
which JSON paths differ, in classes: `rounding` (numbers within 1e-12 relative: summation
order), `value` (numbers or strings that differ), `added`/`removed` (keys only one side
has). Paths are shown with list indices replaced by `[]`, counted over the corpus, so a
refactor's differences read as a short list of causes.

    python bench/plan_diff.py OLD_FOLDER NEW_FOLDER [--show 5]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROUNDING = 1e-12


def walk(old: Any, new: Any, path: str, found: list[tuple[str, str, str]]) -> None:
    """Append (class, path, detail) for every difference between two JSON values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            where = f"{path}.{key}" if path else str(key)
            if key not in new:
                found.append(("removed", where, _short(old[key])))
            elif key not in old:
                found.append(("added", where, _short(new[key])))
            else:
                walk(old[key], new[key], where, found)
        return
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            found.append(("value", f"{path}[]", f"length {len(old)} -> {len(new)}"))
        for index, (a, b) in enumerate(zip(old, new, strict=False)):
            walk(a, b, f"{path}[{index}]", found)
        return
    if _number(old) and _number(new):
        if old == new:
            return
        scale = max(abs(old), abs(new))
        close = math.isfinite(scale) and abs(old - new) <= ROUNDING * scale
        found.append(("rounding" if close else "value", path, f"{old!r} -> {new!r}"))
        return
    if old != new:
        found.append(("value", path, f"{_short(old)} -> {_short(new)}"))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def pattern(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


def compare(old_dir: Path, new_dir: Path, show: int) -> int:
    old_files = {p.name: p for p in old_dir.glob("*.json")}
    new_files = {p.name: p for p in new_dir.glob("*.json")}
    identical, differing = [], []
    by_pattern: dict[tuple[str, str], list[str]] = defaultdict(list)
    examples: dict[tuple[str, str], str] = {}
    for name in sorted(set(old_files) & set(new_files)):
        a, b = old_files[name].read_bytes(), new_files[name].read_bytes()
        if a == b:
            identical.append(name)
            continue
        found: list[tuple[str, str, str]] = []
        walk(json.loads(a), json.loads(b), "", found)
        differing.append((name, found))
        for kind, path, detail in found:
            key = (kind, pattern(path))
            if name not in by_pattern[key]:
                by_pattern[key].append(name)
            examples.setdefault(key, f"{name}: {path}: {detail}")
    only_old = sorted(set(old_files) - set(new_files))
    only_new = sorted(set(new_files) - set(old_files))
    total = len(set(old_files) & set(new_files))
    print(f"{len(identical)} of {total} plan files byte-identical")
    for name, found in differing:
        kinds = Counter(kind for kind, _, _ in found)
        print(f"  differs: {name} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})")
    if by_pattern:
        print("\ndifferences by JSON path (files affected; one example):")
        for (kind, path), names in sorted(by_pattern.items(), key=lambda i: (i[0][0], i[0][1])):
            print(f"  {kind:<8} {path}  [{len(names)} file(s)]")
            print(f"           e.g. {examples[(kind, path)]}")
            if show and len(names) > 1:
                print(f"           in: {', '.join(names[:show])}"
                      + (" ..." if len(names) > show else ""))
    for name in only_old:
        print(f"only in {old_dir}: {name}")
    for name in only_new:
        print(f"only in {new_dir}: {name}")
    return 0 if not differing and not only_old and not only_new else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--show", type=int, default=5, help="file names listed per path")
    args = parser.parse_args()
    raise SystemExit(compare(args.old, args.new, args.show))


if __name__ == "__main__":
    main()
