"""The search progress display of `shardplan plan`, kept apart so it can be tested alone."""

from __future__ import annotations

import threading
import time
from typing import TextIO


class Progress:
    """Search progress on stderr, but only for a plan that takes more than a second.

    Messages of the first second are held back (a quick plan prints none); after that they
    are printed as they come, with the elapsed time. On a terminal a spinner line shows the
    time and the last message while the search is silent; it is erased at the end.
    """

    DELAY_S = 1.0
    FRAMES = "|/-\\"

    def __init__(self, stream: TextIO, delay_s: float = DELAY_S) -> None:
        self.stream, self.delay_s = stream, delay_s
        self.started = time.perf_counter()
        self.held: list[tuple[float, str]] = []
        self.last = "planning"
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.spinning = False
        self.thread: threading.Thread | None = None
        if _is_tty(stream):
            self.thread = threading.Thread(target=self._spin, daemon=True)
            self.thread.start()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.started
        with self.lock:
            self.last = message
            if elapsed < self.delay_s:
                self.held.append((elapsed, message))
                return
            self._flush()
            self._line(elapsed, message)

    def _flush(self) -> None:
        for elapsed, message in self.held:
            self._line(elapsed, message)
        self.held.clear()

    def _line(self, elapsed: float, message: str) -> None:
        prefix = "\r\033[K" if self.spinning else ""
        self.stream.write(f"{prefix}  [{elapsed:6.1f} s] {message}\n")
        self.stream.flush()

    def _spin(self) -> None:
        if self.done.wait(self.delay_s):
            return
        frame = 0
        while not self.done.is_set():
            with self.lock:
                self._flush()
                self.spinning = True
                elapsed = time.perf_counter() - self.started
                text = f"{self.FRAMES[frame % len(self.FRAMES)]} {elapsed:6.1f} s  {self.last}"
                self.stream.write("\r\033[K" + text[:100])
                self.stream.flush()
            frame += 1
            self.done.wait(0.2)

    def close(self) -> None:
        """Stop the spinner and erase its line; held messages of a quick plan are dropped."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        with self.lock:
            if self.spinning:
                self.stream.write("\r\033[K")
                self.stream.flush()
            self.held.clear()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
