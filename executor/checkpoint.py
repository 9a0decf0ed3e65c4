"""Sharded checkpoints with torch.distributed.checkpoint, written atomically, and only into
folders shardplan wrote.

Every rank saves its own weight shards and optimizer state under rank-qualified keys (a
shard is not a replica, so no key may be shared). The files go to `<dir>.partial`, and
rank 0 renames that to `<dir>` after every rank has finished: a crash mid-save leaves the
previous checkpoint, never a half-written one. The optimizer's tensors are named by
`targets` (under ZeRO they are chunks of weights). `write` and `read` are the atomic save
and the load for any state (the module path's checkpoints, which reshard, use them with
DTensors).

Pointing `--checkpoint`/`--resume` anywhere is safe: rank 0 writes a marker
(`shardplan-checkpoint.json`: the runner, optimizer, model digest and the plan's weight
layouts) into `<dir>.partial` before any tensor, so a folder without it — a user's own
`ck/` or `ck.partial/` — is never taken as a checkpoint, replaced or deleted
(`check_target`, `existing`). A resume whose optimizer, runner or (for the ONNX-graph
runner, which does not reshard) plan differs from the marker's is refused naming both
(`check_resume`). The launcher holds `<dir>.lock` (flock) for the run (`locked`), so two
runs cannot write one folder. All of these run before any rank starts. DCP's `.metadata`
is a pickle, which runs whatever it names when loaded: it is read with an unpickler that
admits DCP's metadata classes only (`metadata`), so a folder someone else wrote, marker
and all, cannot run code on `--resume`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from executor.ranks import last_line
from planner.errors import ShardplanError
from planner.plans.model import Plan

MARKER = "shardplan-checkpoint.json"
FORMAT = "shardplan-checkpoint"
VERSION = 1
RUNNERS = {"graph": "the ONNX-graph runner (MODEL.onnx)", "module": "the module path (--module)"}
_LOCK_TAG = "shardplan checkpoint lock, pid "


def marker_for(plan: Plan, runner: str, optimizer: str) -> dict[str, Any]:
    """What a checkpoint of `plan` says about itself: what a resume must match."""
    weights = {name: entry.layout.to_json() for name, entry in sorted(plan.tensors.items())
               if entry.kind == "parameter"}
    stages = plan.pipeline.to_json()["stages"] if plan.pipeline is not None else []
    layout = json.dumps({"mesh": plan.mesh.to_json(), "zero": plan.parallel.zero,
                         "weights": weights, "stages": stages}, sort_keys=True)
    return {"format": FORMAT, "version": VERSION, "runner": runner, "optimizer": optimizer,
            "model_sha256": plan.model.sha256, "parallel": _degrees(plan),
            "layout": hashlib.sha256(layout.encode()).hexdigest()[:16]}


def _degrees(plan: Plan) -> str:
    p = plan.parallel
    mesh = "x".join(str(n) for n in plan.mesh.shape)
    return f"dp={p.dp} tp={p.tp} pp={p.pp} zero={p.zero}, mesh {mesh}"


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of the folder `path`, or None when it has none (not one shardplan
    wrote); a marker that is not ours is refused."""
    file = path / MARKER
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardplanError(f"{file}: not a shardplan checkpoint marker ({exc}); the folder "
                             "was not written by shardplan or is damaged") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT \
            or not isinstance(data.get("version"), int):
        raise ShardplanError(f"{file}: not a shardplan checkpoint marker; the folder was not "
                             "written by shardplan")
    if data["version"] > VERSION:
        raise ShardplanError(f"{path}: written by a newer shardplan (checkpoint format "
                             f"{data['version']}, this one reads {VERSION}); upgrade shardplan")
    return data


def _ours(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and read_marker(path) is not None


def check_target(directory: str | Path) -> None:
    """Refuse, before any rank starts, a `--checkpoint` folder that saving could not create
    or would destroy: saving replaces `<dir>` and `<dir>.partial`, so each must be absent
    or a folder shardplan wrote, and the folder must be creatable."""
    path = Path(directory)
    for folder in (path, path.with_name(path.name + ".partial"),
                   path.with_name(path.name + ".lock")):
        try:
            os.lstat(folder)
        except OSError as exc:  # a name longer than the file system takes; else below
            if exc.errno == errno.ENAMETOOLONG:
                raise ShardplanError(f"--checkpoint {path}: {folder.name[:40]}...: "
                                     f"{exc.strerror}; choose a shorter name") from None
    for folder in (path, path.with_name(path.name + ".partial")):
        if folder.is_symlink():
            raise ShardplanError(f"--checkpoint {path}: {folder} is a symbolic link, which "
                                 "saving would replace; give the folder it points to")
        if folder.exists() and not _ours(folder):
            raise ShardplanError(f"--checkpoint {path}: {folder} exists and is not a shardplan "
                                 f"checkpoint (no {MARKER}); saving would replace it: choose "
                                 "another folder, or move it away")
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ShardplanError(f"--checkpoint {path}: {ancestor} is a file, not a folder; give a "
                             "folder path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ShardplanError(f"--checkpoint {path}: cannot create it in {ancestor} (no write "
                             "permission); choose a folder you can write")


def check_resume(directory: str | Path, expected: dict[str, Any]) -> None:
    """Refuse a resume the checkpoint cannot serve, naming the difference: another runner
    or optimizer, and for the ONNX-graph runner (its shards are the saving plan's) another
    model or plan. The module path's checkpoints reshard into any plan of the module."""
    path = existing(directory)
    saved = read_marker(path) or {}
    if saved.get("runner") != expected["runner"]:
        writer = RUNNERS.get(str(saved.get("runner")), "an unknown runner")
        raise ShardplanError(f"{path}: written by {writer}, "
                             f"this run is {RUNNERS[expected['runner']]}; resume it with the "
                             "same kind of run")
    if saved.get("optimizer") != expected["optimizer"]:
        raise ShardplanError(f"{path}: saved with --optimizer {saved.get('optimizer')}, this run "
                             f"uses --optimizer {expected['optimizer']}; resume with --optimizer "
                             f"{saved.get('optimizer')} (optimizer state does not convert)")
    if expected["runner"] != "graph":
        return
    if saved.get("model_sha256") != expected["model_sha256"]:
        raise ShardplanError(f"{path}: saved from another model (sha256 "
                             f"{str(saved.get('model_sha256'))[:12]}…, this plan's model is "
                             f"{expected['model_sha256'][:12]}…); resume with that model's plan")
    if saved.get("layout") != expected["layout"]:
        how = saved.get("parallel") if saved.get("parallel") != expected["parallel"] else \
            f"{saved.get('parallel')} with other weight layouts"
        raise ShardplanError(f"{path}: saved under another plan ({how}; this plan: "
                             f"{expected['parallel']}); the ONNX-graph runner resumes only "
                             "under the plan that saved it (--module runs reshard)")


@contextlib.contextmanager
def locked(directory: str | Path) -> Iterator[None]:
    """Hold `<dir>.lock` (an exclusive flock) while a run may write `directory`; a second
    run is refused naming the holder. The lock goes when the holder exits, however."""
    path = Path(directory)
    lock = path.with_name(path.name + ".lock")
    try:
        path.absolute().parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShardplanError(f"--checkpoint {path}: cannot create its folder {path.parent} "
                             f"({exc.strerror}); choose a folder you can write") from None
    handle = _acquire(path, lock)
    try:
        os.ftruncate(handle, 0)
        os.pwrite(handle, f"{_LOCK_TAG}{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # while still held: a waiting run then locks a fresh file
        os.close(handle)


@contextlib.contextmanager
def writing(directory: str | Path) -> Iterator[None]:
    """While a run may save into `directory` ("" : it saves nowhere): hold its lock, and
    check the target again now that no other run can change it (the caller checked it
    before its expensive work)."""
    if not directory:
        yield
        return
    with locked(directory):
        check_target(directory)
        yield


def _acquire(path: Path, lock: Path) -> int:
    while True:
        try:
            handle = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise ShardplanError(f"--checkpoint {path}: cannot create its lock {lock} "
                                 f"({exc.strerror}); choose a folder you can write") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            text = os.pread(handle, 200, 0).decode(errors="replace").strip()
            os.close(handle)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ShardplanError(f"--checkpoint {path}: cannot lock {lock} "
                                     f"({exc.strerror})") from None
            holder = text.removeprefix(_LOCK_TAG) if text.startswith(_LOCK_TAG) else "?"
            raise ShardplanError(f"--checkpoint {path}: another run (pid {holder}) is writing "
                                 f"it ({lock} is held); wait for it to end or choose another "
                                 "folder") from None
        text = os.pread(handle, 200, 0).decode(errors="replace")
        if text and not text.startswith(_LOCK_TAG):
            os.close(handle)
            raise ShardplanError(f"--checkpoint {path}: {lock} exists and is not a shardplan "
                                 "lock; move it away")
        try:
            same = os.fstat(handle).st_ino == os.stat(lock, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        os.close(handle)  # its holder removed it as we opened it: lock the new one


def _state(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, rank: int,
           step: int, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {f"rank{rank}/step": torch.tensor(step)}
    names = {id(p): n for n, p in targets.items()}
    for name, param in params.items():
        state[f"rank{rank}/param/{name}"] = param.detach()
    for param, values in optimizer.state.items():
        for key, value in values.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            state[f"rank{rank}/optim/{names[id(param)]}/{key}"] = tensor
    return state


def save(directory: str | Path, params: dict[str, torch.Tensor],
         optimizer: torch.optim.Optimizer, step: int, marker: dict[str, Any],
         targets: dict[str, torch.Tensor] | None = None) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    write(directory, _state(params, optimizer, rank, step, targets or params), marker)


def write(directory: str | Path, state: dict[str, torch.Tensor], marker: dict[str, Any]
          ) -> None:
    """`dcp.save` of `state` into `directory`, atomically (module docstring): every rank
    calls it with its own tensors (DTensors are saved by their global coordinates). Rank 0
    writes `marker` first, and replaces only folders that hold one."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = Path(directory)
    partial = final.with_name(final.name + ".partial")

    def cannot_save(why: str) -> str:
        return f"--checkpoint {final}: cannot save ({why}); check the folder's space and " \
            "permissions"

    if rank == 0:
        _guarded(lambda: _start_partial(final, partial, marker), cannot_save)
    _barrier()
    import torch.distributed.checkpoint as dcp  # a second per rank to import: only here

    _guarded(lambda: dcp.save(state, checkpoint_id=str(partial),
                              no_dist=not dist.is_initialized()), cannot_save)
    _barrier()
    if rank == 0:
        _guarded(lambda: _replace(final, partial), cannot_save)
    _barrier()


def _start_partial(final: Path, partial: Path, marker: dict[str, Any]) -> None:
    check_target(final)  # again, at saving: the folders may have changed since the start
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def _replace(final: Path, partial: Path) -> None:
    if final.exists():
        if not _ours(final):
            raise ShardplanError(f"--checkpoint {final}: it appeared during the run and is not "
                                 f"a shardplan checkpoint; the new one is left in {partial}")
        shutil.rmtree(final)
    partial.rename(final)


def _guarded(action: Callable[[], object], refusal: Callable[[str], str]) -> None:
    """Run a save or load step; its failure (an OSError, or DCP's CheckpointException,
    which is a BaseException) becomes one line, `refusal` of the error's last line."""
    try:
        action()
    except ShardplanError:
        raise
    except BaseException as exc:  # DCP raises CheckpointException, a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise ShardplanError(refusal(last_line(str(exc), type(exc).__name__))) from None


def read(directory: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Fill `state`'s tensors in place from the checkpoint in `directory` (DTensors from
    whatever split they were saved in)."""
    path = existing(directory)
    import torch.distributed.checkpoint as dcp  # a second per rank to import: only here

    reader = _checked_reader(path, metadata(path))
    _guarded(lambda: dcp.load(state, storage_reader=reader, checkpoint_id=str(path),
                              no_dist=not dist.is_initialized()),
             lambda why: f"{path}: cannot resume from it ({why}); it was saved from another "
             "model")


def saved_keys(directory: str | Path) -> frozenset[str]:
    """The names of everything the checkpoint in `directory` holds (DCP's metadata)."""
    return frozenset(metadata(existing(directory)).state_dict_metadata)


#: what DCP's `.metadata` pickle names: its metadata classes, torch's sizes, dtypes and
#: layouts, the storage's records and paths (found by unpickling what `write` saves)
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else. DCP reads it with `pickle.load`, and a
    pickle calls whatever it names: a folder someone else could write (the marker proves
    nothing) ran their code on `--resume`. A name outside DCP's metadata is refused
    before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        found = getattr(importlib.import_module(module), name, None) \
            if module in (_METADATA_MODULE, "torch") else None
        if (module, name) in _METADATA_GLOBALS or (
                module == _METADATA_MODULE and isinstance(found, type)) or (
                module == "torch" and isinstance(found, torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata "
                                     "never holds")


def metadata(path: Path) -> Any:
    """DCP's metadata of the checkpoint folder `path`, unpickled with its own classes only
    (`_MetadataUnpickler`); one line naming the file where it is not that."""
    file = path / ".metadata"
    try:
        with file.open("rb") as stream:
            found = _MetadataUnpickler(stream).load()
    except OSError as exc:
        raise ShardplanError(f"{file}: cannot be read ({exc.strerror or exc}); the "
                             "checkpoint is damaged") from None
    except Exception as exc:  # (unpickling raises many types: each is one refusal)
        raise ShardplanError(f"{file}: not a checkpoint's metadata "
                             f"({last_line(str(exc), type(exc).__name__)}); resume only "
                             "from folders shardplan wrote") from None
    if not hasattr(found, "state_dict_metadata"):
        raise ShardplanError(f"{file}: not a checkpoint's metadata (a "
                             f"{type(found).__name__}); resume only from folders shardplan "
                             "wrote")
    return found


def _checked_reader(path: Path, checked: Any) -> Any:
    """DCP's file reader of `path`, its metadata the one `metadata` read, not unpickled
    again by DCP."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(checked, "storage_meta", None) is None:
                checked.storage_meta = StorageMeta()
            checked.storage_meta.load_id = self.load_id
            return checked

    return CheckedReader(str(path))


def existing(directory: str | Path) -> Path:
    """The checkpoint folder `directory`, or one error saying why it is not one: only a
    folder holding shardplan's marker is read (and its `.metadata` only as DCP's metadata:
    `metadata`)."""
    path = Path(directory)
    if not path.is_dir():
        raise ShardplanError(f"{path}: no checkpoint there (a .partial one was never finished)"
                             if path.with_name(path.name + ".partial").exists()
                             else f"{path}: no such checkpoint directory")
    if read_marker(path) is None:
        raise ShardplanError(f"{path}: not a shardplan checkpoint (no {MARKER}); resume only "
                             "from a folder a shardplan run saved")
    return path


def load(directory: str | Path, params: dict[str, torch.Tensor],
         optimizer: torch.optim.Optimizer,
         targets: dict[str, torch.Tensor] | None = None) -> int:
    """Fill weights and optimizer state in place; return the step the checkpoint was at."""
    targets = targets if targets is not None else params
    rank = dist.get_rank() if dist.is_initialized() else 0
    materialise_state(optimizer, targets.values())
    state = _state(params, optimizer, rank, 0, targets)
    read(directory, state)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[f"rank{rank}/param/{name}"])
    names = {id(p): n for n, p in targets.items()}
    for param, values in optimizer.state.items():
        for key, value in list(values.items()):
            loaded = state[f"rank{rank}/optim/{names[id(param)]}/{key}"]
            if torch.is_tensor(value):
                value.copy_(loaded)
            else:
                values[key] = type(value)(loaded.item())
    return int(state[f"rank{rank}/step"].item())


def materialise_state(optimizer: torch.optim.Optimizer,
                      params: Iterable[torch.Tensor]) -> None:
    """Give every parameter its optimizer state (a step at learning rate 0 on zero
    gradients), so that the state's tensors exist to be loaded into."""
    touched = False
    for param in params:
        if param.requires_grad and param not in optimizer.state:
            param.grad = torch.zeros_like(param)
            touched = True
    if not touched:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
