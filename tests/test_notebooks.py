"""Execute every notebook in notebooks/ and fail on any error.

Each notebook runs with nbclient in a kernel of this interpreter (a kernel spec written for
the test into a private JUPYTER_PATH, so another `python3` kernel on the machine cannot be
picked up instead), with the repository first on the kernel's PYTHONPATH, in a fresh
working directory, with a time limit per cell. Notebooks are committed without outputs:
they must stay small (no file over 1 MB).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported in the tests: collecting this file stays cheap
    from nbclient import NotebookClient
    from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "shardplan-tests"
CELL_TIMEOUT_S = 300  # one cell; the slowest (what_if's grid of 8 plans) takes about 50 s
MAX_BYTES = 1_000_000


def _kernel_path(folder: Path, scratch: Path) -> Path:
    """A JUPYTER_PATH holding one kernel spec that starts this very interpreter, with its
    temporary files (the notebooks write theirs with `tempfile`) under `scratch`."""
    spec = folder / "kernels" / KERNEL
    spec.mkdir(parents=True)
    scratch.mkdir()
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"shardplan tests ({sys.executable})",
        "language": "python",
        "env": {"PYTHONPATH": python_path, "TMPDIR": str(scratch)},
    }))
    return folder


def test_notebooks_are_there_and_small() -> None:
    names = {path.name for path in NOTEBOOKS}
    assert {"quickstart.ipynb", "semi_auto.ipynb", "what_if.ipynb",
            "executor.ipynb"} <= names
    for path in NOTEBOOKS:
        assert path.stat().st_size < MAX_BYTES, f"{path.name}: clear its outputs"


def _client(notebook: NotebookNode, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> NotebookClient:
    """A client that runs `notebook` in this interpreter, in `tmp_path / "work"`."""
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_path(tmp_path / "jupyter", tmp_path / "tmp")))
    workdir = tmp_path / "work"
    workdir.mkdir()
    return NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                          resources={"metadata": {"path": str(workdir)}})


def test_kernel_is_this_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell(
        "import os, sys, tempfile, planner\nprint(sys.executable)\nprint(os.getcwd())\n"
        "print(planner.__file__)\nprint(tempfile.gettempdir())"))
    _client(notebook, tmp_path, monkeypatch).execute()
    printed = notebook.cells[0].outputs[0]["text"].split("\n")
    assert Path(printed[0]) == Path(sys.executable)
    assert Path(printed[1]).resolve() == (tmp_path / "work").resolve()
    assert Path(printed[2]).resolve().is_relative_to(ROOT)
    assert Path(printed[3]).resolve() == (tmp_path / "tmp").resolve()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    notebook = nbformat.read(path, as_version=4)
    client = _client(notebook, tmp_path, monkeypatch)
    started = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as error:
        pytest.fail(f"{path.name}: a cell failed\n{error}", pytrace=False)
    except CellTimeoutError as error:
        pytest.fail(f"{path.name}: a cell ran past {CELL_TIMEOUT_S} s\n{error}", pytrace=False)
    print(f"{path.name}: {time.perf_counter() - started:.1f} s")
    errors = [output for cell in notebook.cells if cell.cell_type == "code"
              for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
