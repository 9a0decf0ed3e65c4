"""How the console script ends: after a verb that built a large graph, without freeing it.

A 200,000-op plan is millions of objects. Unwinding frees them one by one, and the cyclic
collector, once resumed, walks them all; the OS reclaims a process's memory at once. So
the console script (`console`) runs `main` and, where the verb kept what it built
(`keep`) and left the collector paused (`pause_collector_until_exit`), runs the exit handlers,
flushes the standard streams and ends the process (`os._exit`) instead of unwinding.
`main` called in a process that goes on (tests, embedding) keeps nothing and resumes the
collector as before.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from collections.abc import Callable
from typing import NoReturn

_kept: list[object] = []
_process_ends = False


def pause_collector_until_exit() -> bool:
    """Where the process ends when the verb returns (the console script), pause the cyclic
    collector for good, rather than resume it for a last pass; whether it did."""
    if _process_ends:
        gc.disable()
    return _process_ends


def keep(*objects: object) -> None:
    """Hold `objects` until the process ends, when it ends with the verb; else nothing."""
    if _process_ends:
        _kept.extend(objects)


def console(main: Callable[[], int]) -> NoReturn:
    """Run `main` as the process's last act, then end the process."""
    global _process_ends
    _process_ends = True
    code = main()
    if not _kept:
        sys.exit(code)
    atexit._run_exitfuncs()  # what interpreter shutdown would run; then no unwinding
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
            stream.flush()
    os._exit(code)
