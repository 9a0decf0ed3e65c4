"""Issue 18, items 6 and 7: `--checkpoint`/`--resume` are safe to point anywhere and every
failure is one line. Folders shardplan did not write are never taken, replaced or deleted;
a checkpoint folder is locked for the run; a resume with another optimizer, runner or plan
is refused naming both; `--data` arrays are checked before ranks start; a rank's error
reaches the launcher as one line naming the rank. All but one test fail before any rank
starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from executor import checkpoint as checkpoints
from executor.ranks import _error_line, reported_to_launcher
from planner import zoo
from planner.cli import main
from planner.errors import ShardplanError
from planner.plans.model import Plan


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """seed-mlp with a data-parallel and a tensor-parallel plan on 2 devices."""
    folder = tmp_path_factory.mktemp("m")
    family, config = zoo.preset("seed-mlp")
    model = zoo.save(zoo.build(family, config), folder / "seed.onnx")
    found = {"model": model}
    for name, pins in (("dp", "dp=2"), ("tp", "tp=2")):
        found[name] = folder / f"{name}.json"
        assert main(["plan", str(model), "--devices", "2", "--batch", "32",
                     "--parallel", pins, "--profile", "cpu", "-o", str(found[name])]) == 0
    return found


def _run(models: dict[str, Path], *flags: str, plan: str = "dp") -> list[str]:
    return ["run", str(models["model"]), "--plan", str(models[plan]), "--nproc", "2",
            "--steps", "1", *flags]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *wanted: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for text in wanted:
        assert text in err, err
    return err


def _checkpoint(folder: Path, plan: Path, runner: str = "graph", optimizer: str = "adamw"
                ) -> Path:
    """A folder with the marker a run of `plan` writes (what a resume checks first)."""
    folder.mkdir()
    marker = checkpoints.marker_for(Plan.load(plan), runner, optimizer)
    (folder / checkpoints.MARKER).write_text(json.dumps(marker))
    return folder


def test_checkpoint_paths_that_cannot_be_created_are_refused(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    _refused(capsys, _run(models, "--checkpoint", str(afile / "ck")),
             f"{afile} is a file, not a folder")
    _refused(capsys, _run(models, "--checkpoint", str(afile / "deeper" / "ck")),
             f"{afile} is a file, not a folder")
    _refused(capsys, _run(models, "--log-json", str(afile / "log.json")),
             f"{afile} is a file, not a folder")
    assert afile.read_text() == "mine"


def test_folders_shardplan_did_not_write_are_never_taken_or_deleted(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "ck.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    _refused(capsys, _run(models, "--checkpoint", str(tmp_path / "ck")),
             f"{mine} exists and is not a shardplan checkpoint (no shardplan-checkpoint.json)")
    assert (mine / "notes.txt").read_text() == "keep"
    empty = tmp_path / "looks"
    empty.mkdir()
    (empty / ".metadata").write_bytes(b"")
    _refused(capsys, _run(models, "--resume", str(empty)),
             f"{empty}: not a shardplan checkpoint (no shardplan-checkpoint.json)")
    _refused(capsys, _run(models, "--checkpoint", str(empty)), "saving would replace it")
    assert (empty / ".metadata").exists()
    (empty / checkpoints.MARKER).write_text('{"format": "something else"}')
    _refused(capsys, _run(models, "--resume", str(empty)), "not a shardplan checkpoint marker")
    newer = _checkpoint(tmp_path / "newer", models["dp"])
    marker = json.loads((newer / checkpoints.MARKER).read_text())
    (newer / checkpoints.MARKER).write_text(json.dumps({**marker, "version": 99}))
    _refused(capsys, _run(models, "--resume", str(newer)), "written by a newer shardplan")


def test_a_resume_with_another_optimizer_runner_or_plan_is_refused_naming_both(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    adamw = _checkpoint(tmp_path / "adamw", models["dp"], optimizer="adamw")
    _refused(capsys, _run(models, "--resume", str(adamw)),
             "saved with --optimizer adamw, this run uses --optimizer sgd")
    sgd = _checkpoint(tmp_path / "sgd", models["dp"], optimizer="sgd")
    _refused(capsys, _run(models, "--resume", str(sgd), "--optimizer", "adamw"),
             "saved with --optimizer sgd, this run uses --optimizer adamw")
    _refused(capsys, _run(models, "--resume", str(adamw), "--optimizer", "adamw", plan="tp"),
             "saved under another plan (dp=2 tp=1", "this plan: dp=1 tp=2")
    module = _checkpoint(tmp_path / "module", models["dp"], runner="module")
    _refused(capsys, _run(models, "--resume", str(module), "--optimizer", "adamw"),
             "written by the module path (--module), this run is the ONNX-graph runner")
    from executor.module.launch import Checkpoints, train_module

    with pytest.raises(ShardplanError, match="saved with --optimizer adamw, this run uses "
                                             "--optimizer sgd"):
        train_module("not_loaded.py:build", Plan.load(models["dp"]),
                     checkpoints=Checkpoints(resume=str(_checkpoint(
                         tmp_path / "m2", models["dp"], runner="module"))))


def test_two_runs_cannot_write_one_checkpoint_folder(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "ck"
    lock = tmp_path / "ck.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from executor.checkpoint import locked\n"
         f"with locked({str(target)!r}):\n print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        _refused(capsys, _run(models, "--checkpoint", str(target)),
                 f"another run (pid {holder.pid}) is writing it ({lock} is held)")
        # under torchrun, rank 0 takes the lock before its process group starts
        torchrun = subprocess.run(
            [sys.executable, "-m", "executor", str(models["model"]), "--plan",
             str(models["dp"]), "--checkpoint", str(target)], capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd(), "RANK": "0", "WORLD_SIZE": "2"},
            timeout=120)
        assert torchrun.returncode == 2, torchrun.stderr
        assert f"rank 0: error: --checkpoint {target}: another run (pid {holder.pid})" \
            in torchrun.stderr
    finally:
        holder.kill()
        holder.wait()
    with checkpoints.locked(target):  # a dead holder's lock file is taken over
        assert lock.read_text().strip().endswith(str(os.getpid()))
    assert not lock.exists()
    lock.write_text("a file of mine")
    with pytest.raises(ShardplanError, match="exists and is not a shardplan lock"), \
            checkpoints.locked(target):
        pass
    assert lock.read_text() == "a file of mine"


def test_data_arrays_are_checked_before_the_reference_runs(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    np.save(folder / "x.npy", np.array([[None] * 128] * 32, dtype=object))
    one = ["run", str(models["model"]), "--plan", str(models["dp"]), "--nproc", "1",
           "--data", str(folder)]
    _refused(capsys, one, f"{folder / 'x.npy'}: not a numpy array file")
    np.save(folder / "x.npy", np.zeros((32, 128), np.float32))
    np.save(folder / "targets.npy", np.full(32, 1_000_000))
    _refused(capsys, one, "targets.npy: class targets must be integers in 0..63")
    np.save(folder / "targets.npy", np.zeros(5, np.int64))
    _refused(capsys, one, "targets.npy: shape [5], but the ce loss of")


def test_a_rank_error_is_one_line_naming_the_rank(tmp_path: Path) -> None:
    traceback = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                 "planner.errors.ShardplanError: ck: cannot save (disk full); free space")
    assert _error_line(traceback) == "ck: cannot save (disk full); free space"
    assert _error_line("Traceback\nValueError: Expected input batch_size (16) to match") \
        == "ValueError: Expected input batch_size (16) to match"

    class NotAnException(BaseException):  # as DCP's CheckpointException is
        pass

    with pytest.raises(Exception, match=r"NotAnException: NotADirectoryError: ck\.partial"), \
            reported_to_launcher():
        raise NotAnException("ranks:[0, 1]\nTraceback (RANK 0)\n"
                             "NotADirectoryError: ck.partial")
    with pytest.raises(ShardplanError, match=r"--checkpoint .*x: .*ame too long"):
        checkpoints.write(tmp_path / ("x" * 300), {}, {"format": checkpoints.FORMAT})


def test_a_checkpoint_is_marked_and_resumed_only_under_its_plan(
        models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real ranks: the saved folder holds the marker; the same plan and optimizer resume
    it, another plan is refused before any rank starts."""
    saved = tmp_path / "ck"
    capsys.readouterr()
    assert main(_run(models, "--optimizer", "adamw", "--checkpoint", str(saved))) == 0
    marker = json.loads((saved / checkpoints.MARKER).read_text())
    assert marker["optimizer"] == "adamw" and marker["runner"] == "graph"
    assert not (tmp_path / "ck.partial").exists() and not (tmp_path / "ck.lock").exists()
    _refused(capsys, _run(models, "--resume", str(saved), "--optimizer", "adamw", plan="tp"),
             "saved under another plan")
    assert main(_run(models, "--optimizer", "adamw", "--resume", str(saved),
                     "--checkpoint", str(saved))) == 0
    assert (saved / checkpoints.MARKER).exists()


def test_a_checkpoint_name_too_long_for_the_file_system_is_refused(tmp_path: Path) -> None:
    """`ck` + ".partial" past the file system's 255 bytes: one line, before any rank."""
    from executor.checkpoint import check_target
    from planner.errors import ShardplanError

    with pytest.raises(ShardplanError, match="File name too long; choose a shorter name"):
        check_target(tmp_path / ("c" * 250))


def test_a_checkpoint_given_as_a_symbolic_link_is_refused_as_one(tmp_path: Path) -> None:
    """Saving replaces the folder: a link to a real one is refused saying it is a link (it
    said the link held no marker, though its target did)."""
    from executor.checkpoint import check_target
    from planner.errors import ShardplanError

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ShardplanError, match="link is a symbolic link, which saving would "
                                             "replace; give the folder it points to"):
        check_target(tmp_path / "link")


class _Payload:
    """A pickle that runs a command when loaded: what a `.metadata` written by someone
    else may hold."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.sentinel}",))


def test_a_checkpoint_metadata_naming_anything_else_is_refused_before_it_runs(
        models: dict[str, Path], tmp_path: Path) -> None:
    """DCP unpickles `.metadata` with `pickle.load`: a folder holding the marker (which
    proves nothing) and a pickle naming `os.system` ran it on `--resume`. It is now read
    with DCP's metadata classes only, and refused in one line; a real checkpoint's reads
    (its keys) go through the same reader."""
    import pickle

    sentinel = tmp_path / "ran"
    folder = _checkpoint(tmp_path / "ck", models["dp"])
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(sentinel)))
    for read in (checkpoints.saved_keys, lambda f: checkpoints.read(f, {})):
        with pytest.raises(ShardplanError, match=r"ck/\.metadata: not a checkpoint's "
                                                 r"metadata \(it names posix\.system, "
                                                 r"which DCP's metadata never holds\)"):
            read(folder)
    assert not sentinel.exists()
    (folder / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ShardplanError, match=r"not a checkpoint's metadata \(a dict\)"):
        checkpoints.saved_keys(folder)
    # what `write` saves, read back through the same unpickler
    saved = tmp_path / "real"
    import torch
    checkpoints.write(saved, {"w": torch.ones(2, 3), "step": torch.tensor(4)},
                      checkpoints.marker_for(Plan.load(models["dp"]), "graph", "adamw"))
    assert checkpoints.saved_keys(saved) == {"w", "step"}
    state = {"w": torch.zeros(2, 3), "step": torch.tensor(0)}
    checkpoints.read(saved, state)
    assert state["w"].sum() == 6 and int(state["step"]) == 4
