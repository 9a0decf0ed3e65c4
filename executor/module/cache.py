"""Saved traces kept across processes: `shardplan plan --module`, then `shardplan run
--module`, its reference run and torchrun's ranks export the module once between them.

An export takes seconds for a small model and minutes for a large one, and every process
that runs the module needs the same one (`executor.module.trace.SavedTrace`). A trace is
kept in the user's cache folder under a digest of everything its graph can depend on:
torch's and Python's versions, this project's export code, the builder's file, the source
files of every module class the module holds, the module's structure, every parameter
and buffer (shape, dtype and values: the trace keeps copies) and the example batch's shapes. Any
change there gives another digest, so a stale trace is never read; the last
`KEPT_TRACES` stay, and so does any used in the last `IN_USE_S` seconds: a run reads its
trace once its ranks start, after the launcher found it, and another run keeping a new
trace meanwhile must not remove it.

The folder is `$SHARDPLAN_CACHE_DIR`, else `$XDG_CACHE_HOME/shardplan`, else
`~/.cache/shardplan`; `SHARDPLAN_CACHE_DIR=` (empty) keeps traces in the process only.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from executor.module import trace as trace_code
from executor.module.trace import SavedTrace, check_example

KEPT_TRACES = 8  # the most recently used traces kept; older ones are removed
IN_USE_S = 600.0  # a trace used this recently is kept whatever the count (ranks starting)


def cache_folder() -> Path | None:
    """Where traces are kept, or None when the user turned the cache off."""
    chosen = os.environ.get("SHARDPLAN_CACHE_DIR")
    if chosen is not None:
        return Path(chosen).expanduser() / "traces" if chosen else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardplan" / "traces"


def trace_digest(builder_file: Path | None, spec: str, module: nn.Module,
                 example: Mapping[str, torch.Tensor]) -> str:
    """The digest of what the module's trace at `example` depends on (module docstring)."""
    check_example(example)
    digest = hashlib.blake2b(digest_size=16)

    def add(*parts: object) -> None:
        for part in parts:
            digest.update(part if isinstance(part, bytes) else repr(part).encode())
            digest.update(b"\0")

    add(torch.__version__, sys.version, spec, Path(trace_code.__file__).read_bytes())
    if builder_file is not None and builder_file.is_file():
        add(builder_file.read_bytes())
    sources = {_source_file(type(m)) for m in module.modules()}
    for source in sorted(s for s in sources if s is not None):
        add(source, Path(source).read_bytes())
    add(repr(module), [m.training for m in module.modules()])
    for name, submodule in module.named_modules():  # settings the forward may branch on
        add(name, _settings(submodule))
    for name, tensor in [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]:
        add(name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
        digest.update(_raw(tensor))
    for name, value in sorted(example.items()):  # its shapes are traced, not its values
        add(name, tuple(value.shape), value.dtype)
    return digest.hexdigest()


_PLAIN = (str, int, float, bool, type(None))


def _settings(module: nn.Module) -> list[tuple[str, object]]:
    """A module's own settings, which its forward may branch on (`self.act == "tanh"`, read
    from a config file by the builder) though its structure, source and weights stay the
    same: its public attributes of plain values (and tuples or lists of them), and a
    configuration object's `to_dict()` (transformers' `PretrainedConfig`)."""
    found: list[tuple[str, object]] = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_"):
            continue
        if isinstance(value, _PLAIN) or (isinstance(value, tuple | list)
                                         and all(isinstance(v, _PLAIN) for v in value)):
            found.append((key, value))
        elif callable(getattr(value, "to_dict", None)) and not isinstance(value, nn.Module):
            try:
                found.append((key, sorted(value.to_dict().items(), key=lambda kv: kv[0])))
            except Exception:  # a to_dict that needs arguments, or fails: not a setting
                continue
    return found


def kept_trace(digest: str) -> SavedTrace | None:
    """The kept trace of `digest`, if there is one."""
    folder = cache_folder()
    if folder is None:
        return None
    saved = SavedTrace.at(folder / digest)  # an entry appears whole (a renamed folder)
    if not (saved.program.is_file() and saved.model.is_file()):
        return None
    with contextlib.suppress(OSError):
        os.utime(folder / digest)  # recently used: kept longer
    return saved


def keep_trace(digest: str, program: torch.onnx.ONNXProgram) -> SavedTrace:
    """`program` written as the trace of `digest`: in the cache folder when it can be
    written there (atomically: a folder renamed into place once whole), else in a
    temporary folder this process removes at exit."""
    folder = cache_folder()
    if folder is not None:
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=folder))
            try:
                SavedTrace.write(program, partial)
                partial.rename(folder / digest)
            except OSError:  # another process kept the same trace first: read that one
                shutil.rmtree(partial, ignore_errors=True)
            _evict(folder)
            found = kept_trace(digest)
            if found is not None:
                return found
    import atexit

    scratch = Path(tempfile.mkdtemp(prefix="shardplan-trace-"))
    atexit.register(shutil.rmtree, scratch, True)
    return SavedTrace.write(program, scratch)


def _evict(folder: Path) -> None:
    """Remove all but the `KEPT_TRACES` most recently used entries, keeping any used in
    the last `IN_USE_S` seconds (another run's ranks may be about to read it)."""
    used: list[tuple[float, Path]] = []
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            with contextlib.suppress(OSError):  # (another process removed it)
                used.append((entry.stat().st_mtime, entry))
    used.sort(reverse=True)
    recent = time.time() - IN_USE_S
    for when, stale in used[KEPT_TRACES:]:
        if when < recent:
            shutil.rmtree(stale, ignore_errors=True)


def _source_file(cls: type) -> str | None:
    try:
        found = inspect.getsourcefile(cls)
    except TypeError:  # a built-in class
        return None
    return found if found and Path(found).is_file() else None


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes (no copy when it is contiguous on the CPU)."""
    data = tensor.detach().contiguous().cpu().reshape(-1)
    return data.view(torch.uint8).numpy().data if data.numel() else memoryview(b"")
