"""Local ranks that never outlive their run.

The launcher (`run_ranks`) starts one process per rank and watches them. Whatever ends the
run — a rank's error or exit, a rank stopped (SIGSTOP) for longer than the collective
timeout, SIGINT, SIGTERM or SIGHUP to the launcher — it stops every rank it started before
it returns or raises: SIGTERM, then SIGKILL after a short grace (a stopped process dies
only of SIGKILL), and the error says which rank did what. The launcher cannot clean up
after its own SIGKILL, so each rank also follows its launcher (`follow_launcher`): a
thread waits on a pidfd of the launching process and ends the rank the moment the
launcher is gone. Ranks ignore SIGINT (Ctrl-C reaches the whole process group): the
launcher decides, so one Ctrl-C gives one message, not a traceback per rank.

Ranks are forked from one fork server per launching process (`multiprocessing`'s
"forkserver": a fresh interpreter, not a fork of the launcher, whose thread pools may be
running) that has imported torch and both runners once (`FORK_SERVER_PRELOAD`): a rank
starts in a fraction of a second instead of paying seconds of imports itself, and a
process that launches many runs (a notebook, a test session) pays those imports once.
The server keeps the environment it started with.

Checkpoints are written to a `.partial` folder and renamed when whole
(`executor.checkpoint`), so a rank killed mid-save leaves the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from planner.errors import RunFailed, SignalInterrupt

GRACE_S = 2.0  # between SIGTERM and SIGKILL
POLL_S = 0.25  # how often the launcher looks at its ranks
LAUNCHER_GONE = 75  # a rank's exit code when its launcher died (EX_TEMPFAIL)
#: what the fork server imports before it forks a rank: the ONNX-graph runner, the module
#: runner, and torch._dynamo, which torch's optimizers import on first use (2 s)
FORK_SERVER_PRELOAD = ("executor.train", "executor.module.launch",
                       "executor.module.parallelize", "torch._dynamo")


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, *,
              timeout_s: float) -> None:
    """Run `fn(rank, *args)` on `nprocs` processes forked from the fork server and wait
    for all of them; on any failure or signal, stop every one of them first, then raise
    `RunFailed` (a rank failed, died or was stopped) or `SignalInterrupt`/
    `KeyboardInterrupt`."""
    # Read only when this process starts its server: later runs reuse the running one.
    multiprocessing.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    with _signals_raise():
        context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False,
                                     start_method="forkserver")
        assert context is not None  # join=False returns the context
        stopped_since: dict[int, float] = {}
        try:
            while not context.join(timeout=POLL_S, grace_period=GRACE_S):
                _check_stopped(context.processes, stopped_since, timeout_s)
        except mp.ProcessRaisedException as exc:
            raise RunFailed(_raised(exc, stopped_since, timeout_s)) from None
        except mp.ProcessExitedException as exc:
            raise RunFailed(_exited(exc)) from None
        finally:
            with _signals_ignored():  # a second Ctrl-C must not cut the cleanup short
                stop(context.processes)


def stop(processes: list[Any]) -> None:
    """End every process still alive: SIGTERM, then SIGKILL after the grace period."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        with contextlib.suppress(OSError):
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in alive:
        if process.is_alive():
            with contextlib.suppress(OSError):
                process.kill()
            process.join()


def follow_launcher(launcher: int) -> None:
    """In a rank: end this process when the launcher with pid `launcher` is gone, and
    leave SIGINT to the launcher."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        handle: int | None = os.pidfd_open(launcher)
    except ProcessLookupError:
        os._exit(LAUNCHER_GONE)
    except OSError:  # a kernel before 5.3: poll instead
        handle = None
    threading.Thread(target=_wait_for_launcher, args=(launcher, handle), daemon=True,
                     name="shardplan-follow-launcher").start()


class RankError(Exception):
    """A rank's failure that was not an `Exception` (DCP's CheckpointException is a
    BaseException), re-raised as one so that the launcher hears of it (torch's rank
    wrapper reports only Exceptions; anything else escaped with a traceback and exit 1)."""


@contextlib.contextmanager
def reported_to_launcher() -> Iterator[None]:
    """In a rank: every failure reaches the launcher's one-line message."""
    try:
        yield
    except (Exception, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        raise RankError(f"{type(exc).__name__}: {last_line(str(exc), '')}") from None


def last_line(text: str, default: str) -> str:
    """The last non-blank line of an error's text (a traceback's is the error itself),
    stripped; `default` when there is none."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else default


def _wait_for_launcher(launcher: int, handle: int | None) -> None:
    if handle is not None:
        select.select([handle], [], [])  # a pidfd turns readable when its process exits
    else:
        while _exists(launcher):
            time.sleep(POLL_S)
    os._exit(LAUNCHER_GONE)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` ("R", "S", "T" stopped, ...; "" if gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text.rpartition(")")[2].split()[0]  # the name in (...) may hold spaces


def _check_stopped(processes: list[Any], stopped_since: dict[int, float],
                   timeout_s: float) -> None:
    """Note when each rank was first seen stopped; a rank stopped for longer than the
    collective timeout ends the run (its peers may wait in something gloo cannot time)."""
    now = time.monotonic()
    for index, process in enumerate(processes):
        if process.pid is not None and process_state(process.pid) == "T":
            since = stopped_since.setdefault(index, now)
            if now - since > timeout_s:
                raise RunFailed(_stopped_message(index, timeout_s))
        else:
            stopped_since.pop(index, None)


def _stopped_message(index: int, timeout_s: float) -> str:
    return (f"rank {index} was stopped (SIGSTOP) and did not answer within the "
            f"{timeout_s:g} s collective timeout (--timeout); every rank was stopped")


def _raised(exc: mp.ProcessRaisedException, stopped_since: dict[int, float],
            timeout_s: float) -> str:
    if stopped_since:  # the peers of a stopped rank time out first: name the cause
        return _stopped_message(min(stopped_since), timeout_s)
    return f"rank {exc.error_index} failed ({_error_line(str(exc))}); the other ranks were " \
        "stopped"


def _error_line(traceback: str) -> str:
    """The error of a rank's traceback in one line: a shardplan error's own message (it
    says what to do), any other as "Type: message"."""
    last = last_line(traceback, "no message")
    kind, sep, message = last.partition(": ")
    if sep and kind.startswith(("planner.errors.", "executor.ranks.RankError")):
        return message
    if not sep or " " in kind:  # the last line of a message of several lines
        return last
    return f"{kind.rpartition('.')[2]}: {message}"


def _exited(exc: mp.ProcessExitedException) -> str:
    if exc.exit_code == LAUNCHER_GONE:
        return f"rank {exc.error_index} lost its launcher; the other ranks were stopped"
    how = f"signal {exc.signal_name}" if exc.exit_code < 0 else f"exit code {exc.exit_code}"
    return f"rank {exc.error_index} died ({how}); the other ranks were stopped"


_STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in _STOPPING_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While the ranks run, SIGTERM and SIGHUP raise `SignalInterrupt` in the launcher
    (as SIGINT raises KeyboardInterrupt), so its cleanup runs; handlers are restored
    after. Only the main thread can install handlers: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def interrupt(signum: int, _frame: object) -> None:
        raise SignalInterrupt(signum)

    for signum in previous:
        signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
