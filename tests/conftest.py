"""Shared pytest setup: the `slow` marker and cached ONNX exports of tiny real models."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # exported_models imports torch; keep conftest cheap for other tests
    from exported_models import ExportModel


def pytest_configure(config: pytest.Config) -> None:
    """Register markers so `-m "not slow"` gives a quick run and typos in markers fail."""
    config.addinivalue_line("markers", "slow: test takes more than 5 s (e.g. a dynamo export)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first (stable otherwise): pytest-xdist hands tests out in this order, so
    the minute-long ones (the guide's pages, the notebooks) start early instead of leaving
    one worker busy while the other has nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _session_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The session's temporary folder that all its xdist workers share (each worker's
    base temp is a folder inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def shardplan_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The module executor's kept traces (`executor.module.cache`) go to this session's
    folder, shared by its xdist workers and the commands the tests start: a session
    neither reads the user's cache nor one left by an earlier session."""
    path = _session_folder(tmp_path_factory) / "shardplan-cache"
    path.mkdir(exist_ok=True)
    os.environ["SHARDPLAN_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Directory holding exported models for this session, shared by its xdist workers.

    `SHARDPLAN_EXPORT_CACHE` keeps exports across sessions; a per-torch-version
    subdirectory stops a torch upgrade from serving stale graphs.
    """
    env = os.environ.get("SHARDPLAN_EXPORT_CACHE")
    if not env:
        # Exports appear atomically, and a lock per file stops two workers exporting the
        # same model twice.
        path = _session_folder(tmp_path_factory) / "onnx-exports"
        path.mkdir(exist_ok=True)
        return path
    import torch

    path = pathlib.Path(env).expanduser() / f"torch-{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def export_model(export_cache: pathlib.Path) -> ExportModel:
    """Factory: `export_model("gpt2", "dynamo", training=True)` -> path of a cached .onnx file."""
    from exported_models import export

    def factory(model: str, exporter: str = "torchscript", *, training: bool = False,
                opset: int = 17, dynamic: bool = True, batch: int = 2,
                seq: int = 16, layers: int = 2) -> pathlib.Path:
        return export(model, exporter, training=training, opset=opset, out_dir=export_cache,
                      dynamic=dynamic, batch=batch, seq=seq, layers=layers)

    return factory


@pytest.fixture
def exported(request: pytest.FixtureRequest, export_model: ExportModel) -> pathlib.Path:
    """Indirect-parametrised export: `request.param` is a model name or a dict of options.

    Example: `@pytest.mark.parametrize("exported", [{"model": "bert", "exporter": "dynamo"}],
    indirect=True)`.
    """
    param: Any = getattr(request, "param", None)
    if param is None:
        raise pytest.UsageError("`exported` needs indirect parametrisation with a model spec")
    options: dict[str, Any] = {"model": param} if isinstance(param, str) else dict(param)
    make: Callable[..., pathlib.Path] = export_model
    return make(**options)


@pytest.fixture(scope="session")
def wide_head_llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The per-stage mesh tests' LLaMA with a 256k-vocabulary head (`wide_head`)."""
    from wide_head import save_wide_head

    return save_wide_head(tmp_path_factory.mktemp("wide_head"))
