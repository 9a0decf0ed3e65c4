"""Fault drills: whatever happens to `shardplan run`'s launcher or to one of its ranks,
no process the run started outlives it, and the exit code says what happened.

Each drill starts `shardplan run` in a session of its own, so every process it starts
(ranks, fork server, resource tracker) can be found by session id even after it is
re-parented to init, then signals the launcher or a rank and waits, with a bound, for
the session to empty.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner import zoo
from planner.api import plan

pytest.importorskip("torch")

# The CLI as a user's shell starts it: SIGINT raises KeyboardInterrupt (a test runner's
# background process may have inherited SIGINT ignored).
LAUNCH = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "from planner.cli import main; sys.exit(main(sys.argv[1:]))")
STEPS = "1000000"  # longer than any drill: the run ends only by the fault


def _session(sid: int) -> dict[int, tuple[str, str]]:
    """pid -> (state, command) of every live (not zombie) process in session `sid`."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found[int(stat.parent.name)] = (fields[0], command)
    return found


def _ranks(sid: int, launcher: int) -> list[int]:
    """The rank processes of the run: children of its fork server."""
    session = _session(sid)
    servers = {pid for pid, (_, cmd) in session.items() if "forkserver import main" in cmd}
    ranks = []
    for pid in session:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue
        if parent in servers:
            ranks.append(pid)
    return sorted(ranks)


def _wait_gone(sid: int, bound_s: float) -> float:
    started = time.monotonic()
    while _session(sid):
        if time.monotonic() - started > bound_s:
            left = "; ".join(f"{pid} {state} {cmd[:80]}" for pid, (state, cmd)
                             in _session(sid).items())
            for pid in _session(sid):  # leave the machine clean for the other tests
                _kill(pid)
            pytest.fail(f"processes outlived the run by {bound_s} s: {left}")
        time.sleep(0.1)
    return time.monotonic() - started


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("drills")
    model = folder / "gpt.onnx"
    zoo.save(zoo.build("gpt-tiny"), model)
    chosen = plan(model, devices=2, batch=4, dims={"seq": 8}, mode="data", profile="cpu")
    plan_path = folder / "dp.json"
    chosen.save(plan_path)
    return model, plan_path


def _start(model: Path, plan_path: Path, tmp_path: Path, *flags: str
           ) -> tuple[subprocess.Popen, Path]:
    """`shardplan run` in a new session, once both ranks are up (or a failed test)."""
    err = tmp_path / "stderr.txt"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "run", str(model), "--plan", str(plan_path),
         "--nproc", "2", "--steps", STEPS, *flags],
        stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True)
    deadline = time.monotonic() + 120
    while len(_ranks(launcher.pid, launcher.pid)) < 2:
        if launcher.poll() is not None or time.monotonic() > deadline:
            _kill(launcher.pid)
            _wait_gone(launcher.pid, 30)
            pytest.fail(f"the run did not start its ranks: {err.read_text()[-500:]}")
        time.sleep(0.1)
    time.sleep(2)  # into the steps: the ranks have joined their process group
    return launcher, err


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code", "said"), [
    (signal.SIGKILL, -9, ""),
    (signal.SIGTERM, 143, "shardplan: stopped by SIGTERM"),
    (signal.SIGINT, 130, "shardplan: interrupted"),
])
def test_a_signalled_launcher_leaves_no_process_behind(
        data_parallel: tuple[Path, Path], tmp_path: Path, signum: int, code: int,
        said: str) -> None:
    """SIGKILL cannot be handled: the ranks follow the launcher's pidfd and end
    themselves, and the fork server and resource tracker follow the ranks. SIGTERM and
    SIGINT are handled: the launcher stops its ranks, then exits 128 + the signal."""
    launcher, err = _start(*data_parallel, tmp_path)
    launcher.send_signal(signum)
    assert launcher.wait(timeout=30) == code
    assert _wait_gone(launcher.pid, 15) < 15
    if said:
        assert err.read_text().strip().splitlines()[-1] == said


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_timeout(
        data_parallel: tuple[Path, Path], tmp_path: Path) -> None:
    """A rank under SIGSTOP holds its peers in a collective that gloo does not time out:
    the launcher sees it stopped for longer than --timeout, kills every rank (SIGKILL,
    the one signal a stopped process obeys) and exits 4 naming it."""
    launcher, err = _start(*data_parallel, tmp_path, "--timeout", "3")
    victim = _ranks(launcher.pid, launcher.pid)[1]
    stopped = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    assert launcher.wait(timeout=60) == 4
    assert time.monotonic() - stopped < 30
    assert _wait_gone(launcher.pid, 15) < 15
    line = err.read_text().strip().splitlines()[-1]
    assert "was stopped (SIGSTOP) and did not answer within the 3 s collective timeout" \
        in line, line


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_naming_it(
        data_parallel: tuple[Path, Path], tmp_path: Path) -> None:
    launcher, err = _start(*data_parallel, tmp_path)
    ranks = _ranks(launcher.pid, launcher.pid)
    _kill(ranks[0])
    assert launcher.wait(timeout=60) == 4
    assert _wait_gone(launcher.pid, 15) < 15
    line = err.read_text().strip().splitlines()[-1]
    assert line.startswith("shardplan: error: rank ") and "died (signal SIGKILL)" in line, line
