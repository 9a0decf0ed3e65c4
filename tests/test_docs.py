"""Every shell command and Python snippet of the user guide (and of README.md) runs as written.

For each file, its fenced ```bash and ```python blocks run in document order in one fresh
temporary directory, so a later command can use what an earlier one wrote:

- a ```bash block is split into command lines (a line ending in `\\` continues on the
  next; `#` comment lines are skipped); each runs with `bash -c` and must exit 0, or with
  the code its trailing comment names: `shardplan plan ...   # exit code 3`;
- a ```python block is written to a file and run with this interpreter; it must exit 0.

`shardplan`, `python`, `python3` and `torchrun` resolve to this environment, and
PYTHONPATH puts this checkout first. Commands that install software or run the test
suite (`pip install`, `python -m venv`, `. .venv/bin/activate`, `python -m pytest`,
`python -m ipykernel install`) are not run: this test runs inside the environment they
make. Other fences (```text, ```json, ```console) are output and are not run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide"
FILES = [*sorted(GUIDE.glob("*.md")), ROOT / "README.md"]
PAGES = ("README.md", "install.md", "concepts.md", "cli.md", "api.md", "strategy-json.md",
         "profiles.md", "executor.md")
COMMAND_TIMEOUT_S = 600

FENCE = re.compile(r"^```\s*([\w+-]*)")
EXIT_CODE = re.compile(r"#\s*exit code (\d+)")
NOT_RUN = re.compile(r"^(pip3? install|python3? -m (pip|venv|pytest|ipykernel install)"
                     r"|source |\. \S*activate)")

#: README.md commands whose exit code is known to differ from 0, with the reason. README.md
#: is not the guide's to change; remove an entry when the README is fixed (the test then
#: fails until it is removed, so the list cannot go stale).
README_KNOWN: dict[str, tuple[int, str]] = {}


@dataclass(frozen=True)
class Step:
    kind: str  # "bash" or "python"
    text: str
    line: int  # 1-based line of the step in its file
    expect: int = 0
    note: str = ""


def blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every top-level fenced block of `path`."""
    found: list[tuple[str, int, list[str]]] = []
    language, start, body = "", 0, []
    inside = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if not inside and match:
            language, start, body, inside = match.group(1).lower(), number + 1, [], True
        elif inside and line.strip() == "```":
            found.append((language, start, body))
            inside = False
        elif inside:
            body.append(line)
    assert not inside, f"{path.name}: the block opened at line {start - 1} is never closed"
    return found


def steps(path: Path) -> list[Step]:
    """The runnable steps of `path`, in order."""
    result: list[Step] = []
    for language, start, body in blocks(path):
        if language == "python":
            result.append(Step("python", "\n".join(body), start))
        elif language in ("bash", "sh", "shell"):
            result.extend(_commands(path, start, body))
    return result


def _commands(path: Path, start: int, body: list[str]) -> list[Step]:
    commands: list[Step] = []
    pending, first = "", 0
    for offset, raw in enumerate(body):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if "<<" in line:
            raise AssertionError(f"{path.name}:{start + offset}: no here-documents in bash "
                                 "blocks; write the file in a ```python block")
        if not pending:
            first = start + offset
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command = pending + line
        pending = ""
        commands.extend(_step(path, command, first))
    assert not pending, f"{path.name}:{first}: a command ends with a line continuation"
    return commands


def _step(path: Path, command: str, line: int) -> list[Step]:
    """One command line; installs are dropped, `a && b` keeps the parts that are not."""
    parts = [part.strip() for part in command.split(" && ")]
    kept = [part for part in parts if not NOT_RUN.match(part)]
    if not kept:
        return []
    text = " && ".join(kept)
    match = EXIT_CODE.search(text)
    expect = int(match.group(1)) if match else 0
    note = ""
    bare = text.split(" #")[0].strip()
    if path.name == "README.md" and path.parent == ROOT and bare in README_KNOWN:
        expect, note = README_KNOWN[bare]
    return [Step("bash", text, line, expect, note)]


def _environment(scratch: Path) -> dict[str, str]:
    """PATH and PYTHONPATH that make the documented commands mean this environment."""
    shims = scratch / "bin"
    shims.mkdir()
    here = Path(sys.executable).parent
    script = here / "shardplan"
    # Wrappers, not symlinks: a virtual environment's python finds its site-packages from
    # the path it was started by.
    targets = {"python": f'"{sys.executable}"', "python3": f'"{sys.executable}"',
               "shardplan": f'"{script}"' if script.exists()
               else f'"{sys.executable}" -m planner.cli'}
    for name, target in targets.items():
        wrapper = shims / name
        wrapper.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        wrapper.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(shims), str(here), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["MPLBACKEND"] = "Agg"
    env.pop("SHARDPLAN_FAULT", None)
    return env


def _run(step: Step, workdir: Path, env: dict[str, str], index: int) -> subprocess.CompletedProcess:
    if step.kind == "python":
        snippet = workdir / f"snippet_{index:02d}_line{step.line}.py"
        snippet.write_text(step.text + "\n")
        argv = [sys.executable, snippet.name]
    else:
        argv = [shutil.which("bash") or "/bin/bash", "-c", step.text]
    return subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def test_every_page_is_there_and_has_commands() -> None:
    names = {path.name for path in GUIDE.glob("*.md")}
    assert set(PAGES) <= names, f"missing guide pages: {sorted(set(PAGES) - names)}"
    for name in PAGES:
        assert steps(GUIDE / name), f"docs/guide/{name} has no command or snippet to test"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of a Markdown file."""
    found: set[str] = set()
    inside = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            anchor, count = slug, 1
            while anchor in found:
                anchor, count = f"{slug}-{count}", count + 1
            found.add(anchor)
    return found


def test_relative_links_resolve() -> None:
    link = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")
    for path in [*GUIDE.glob("*.md"), ROOT / "README.md"]:
        for target, anchor in link.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file = (path.parent / target) if target else path
            assert file.exists(), f"{path.name}: broken link {target}"
            if anchor and file.suffix == ".md":
                assert anchor in _anchors(file), f"{path.name}: no heading #{anchor} in {target}"


def test_readme_known_failures_are_still_in_the_readme() -> None:
    commands = {step.text.split(" #")[0].strip() for step in steps(ROOT / "README.md")}
    assert set(README_KNOWN) <= commands, "README.md changed: update README_KNOWN"


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=[
    "README" if p.parent == ROOT else f"guide-{p.stem}" for p in FILES])
def test_commands_run_as_documented(path: Path, tmp_path: Path) -> None:
    env = _environment(tmp_path)
    workdir = tmp_path / "work"
    workdir.mkdir()
    timings: list[str] = []
    for index, step in enumerate(steps(path)):
        started = time.perf_counter()
        done = _run(step, workdir, env, index)
        seconds = time.perf_counter() - started
        timings.append(f"{seconds:6.1f} s  {path.name}:{step.line}  "
                       f"{step.text.splitlines()[0][:90]}")
        if done.returncode != step.expect:
            why = f" ({step.note})" if step.note else ""
            pytest.fail(
                f"{path.name}:{step.line}: exit code {done.returncode}, expected "
                f"{step.expect}{why}\n--- {step.kind}\n{step.text}\n--- stdout\n"
                f"{_tail(done.stdout)}\n--- stderr\n{_tail(done.stderr)}", pytrace=False)
    print("\n".join(timings))
