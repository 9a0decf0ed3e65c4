"""Run fuzz cases (tests/fuzz_cases.py) through the real entry points and judge them.

`run_corpus` runs the cases in a forked worker process: each under an alarm, the worker
under a hard deadline (a hang inside C code ignores the alarm) and an address-space
limit, so a hang, a dead interpreter or a runaway allocation is recorded and the run goes
on. Each case calls `planner.cli.main(argv)` in-process, and for plan cases also what
`shardplan run` does before any rank starts (load the plan, match it to the model).

Outcomes. Acceptable: `ok` (exit 0), `rejected` (exit 2 with one `shardplan: error:`
line naming the file or field), `no-fit` (exit 3). Failures: `traceback` (an exception
escaped the entry point), `hang`, `crash` (the worker died), `bad-exit` (another exit
code), `bad-message` (exit 2 without a one-line message naming the input) and `wrong` (a
certainly-bad input accepted, a valid one refused, or a plan the executor side cannot
read back).
"""

from __future__ import annotations

import contextlib
import io
import math
import multiprocessing
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fuzz_cases import CLASSES, Case, generate

ACCEPTABLE = frozenset({"ok", "rejected", "no-fit"})
OUTCOMES = ("ok", "rejected", "no-fit", "traceback", "hang", "crash", "bad-exit",
            "bad-message", "wrong")
#: Address space of the worker: a mutation asking for a 2**40-element array must fail
#: with MemoryError (a traceback outcome), not push a shared machine into swap.
WORKER_MEMORY_BYTES = 3 << 30
ERROR_PREFIX = "shardplan: error:"
#: An error line: shardplan's own, or argparse's, which names the verb (`shardplan plan:`).
ERROR_LINE = re.compile(r"^shardplan(?: [a-z]+)?: error:")

EntryPoint = Callable[[list[str]], int]


@dataclass
class Result:
    index: int
    cls: str
    outcome: str
    code: int | None
    detail: str
    seconds: float
    note: str = ""


class CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so library `except Exception` can't eat it."""


def materialize(case: Case, folder: Path) -> None:
    """Write the case's files and symlinks; `{out}` is a sibling folder outside the case."""
    outside = folder.parent / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "secret.bin").write_bytes(b"secret" * 8)
    for name, data in case.files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for name, target in case.links.items():
        (folder / name).symlink_to(target.replace("{out}", str(outside)))


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"no answer after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call(entry: EntryPoint, argv: list[str]) -> tuple[int, str]:
    """Run one command in-process; return its exit code and what it wrote to stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = entry(argv)
    return code, err.getvalue()


def check_plan_against_model(plan_path: str, model_path: str) -> int:
    """What `shardplan run` does before any rank starts: load the plan, import the model
    with the plan's dims, and refuse a mismatch or a plan `validate` rejects
    (executor.train.graph_for, check_plan_matches, refuse_invalid). Returns the exit code
    the CLI would give."""
    from executor.train import graph_for
    from planner.errors import ShardplanError
    from planner.plans.model import Plan
    from planner.validate import check_plan_matches, refuse_invalid

    try:
        plan = Plan.load(plan_path)
        graph = graph_for(model_path, plan)
        check_plan_matches(plan, graph)
        refuse_invalid(plan, graph, f" against {model_path}")
    except ShardplanError as exc:
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def _judge(case: Case, code: int, stderr: str, folder: Path) -> tuple[str, str]:
    """Outcome of one finished command from its exit code, stderr and output file."""
    errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    detail = errors[0] if errors else stderr.strip()[-300:]
    if "Traceback (most recent call last)" in stderr:
        return "traceback", stderr.strip()[-600:]
    if code not in (0, 2, 3):
        return "bad-exit", f"exit {code}: {detail}"
    if code == 2:
        if len(errors) != 1:
            return "bad-message", f"{len(errors)} error lines: {stderr.strip()[-300:]}"
        if not any(name in errors[0] for name in case.names):
            return "bad-message", f"does not name {' or '.join(case.names)}: {errors[0]}"
        return "rejected", detail
    if code == 3:
        return "no-fit", detail
    problem = _check_output(folder / "out.json")
    return ("wrong", problem) if problem else ("ok", "")


def _check_output(path: Path) -> str:
    """A plan the planner wrote must load on the executor side and hold finite figures."""
    if not path.exists():
        return ""
    from planner.errors import ShardplanError
    from planner.plans.model import Plan

    try:
        plan = Plan.load(path)
    except ShardplanError as exc:
        return f"the planner's own plan does not load: {exc}"
    figures = [plan.predicted.step_time_s, plan.predicted.compute_s,
               plan.predicted.communication_s, *plan.predicted.memory.values()]
    if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in figures):
        return f"predicted figures not finite and >= 0: {figures}"
    return ""


def _worst(outcomes: list[tuple[str, str]]) -> tuple[str, str]:
    bad = [o for o in outcomes if o[0] not in ACCEPTABLE]
    if bad:
        return bad[0]
    return max(outcomes, key=lambda o: ("ok", "no-fit", "rejected").index(o[0]))


def _expectation(case: Case, outcome: tuple[str, str]) -> tuple[str, str]:
    name, detail = outcome
    if name not in ACCEPTABLE:
        return outcome
    if case.expect == "reject" and name == "ok":
        return "wrong", f"accepted a bad input ({case.note})"
    if case.expect == "accept" and name != "ok":
        return "wrong", f"refused a valid input ({case.note}): {detail}"
    return outcome


def execute(case: Case, folder: Path, timeout_s: float, entry: EntryPoint) -> Result:
    """Run one case in this process, under an alarm; never raises."""
    started = time.perf_counter()
    materialize(case, folder)
    argv = [a.replace("{dir}", str(folder)) for a in case.argv]
    code: int | None = None
    try:
        with _alarm(timeout_s):
            code, stderr = _call(entry, argv)
            outcomes = [_judge(case, code, stderr, folder)]
            if case.check_plan:
                check = _call(lambda _: check_plan_against_model(
                    str(folder / "plan.json"), str(folder / "model.onnx")), [])
                outcomes.append(_judge(case, *check, folder))
                # explain reads the plan alone: any plan that loads must explain
                explained = _call(entry, ["explain", str(folder / "plan.json")])
                outcomes.append(_judge(case, *explained, folder))
        outcome = _expectation(case, _worst(outcomes))
    except CaseTimeout:
        outcome = ("hang", _last_frames())
    except BaseException:  # a traceback (SystemExit and MemoryError included)
        outcome = ("traceback", _last_frames())
    return Result(case.index, case.cls, outcome[0], code, outcome[1],
                  time.perf_counter() - started, case.note)


def _last_frames() -> str:
    lines = traceback.format_exc().strip().splitlines()
    return "\n".join(lines[-7:])


# --------------------------------------------------------------------------- worker


def _serve(conn: Connection, seed: int, timeout_s: float, entry: EntryPoint | None,
           make: Callable[[int, int], Case]) -> None:
    """Worker loop: receive case indices, send back Results, until None arrives."""
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    if entry is None:
        from planner.cli import main as entry
    root = Path(tempfile.mkdtemp(prefix="shardplan-fuzz-"))
    try:
        while (index := conn.recv()) is not None:
            folder = root / f"case{index}"
            (folder / "case").mkdir(parents=True)
            try:
                case = make(seed, index)
            except Exception:
                conn.send(Result(index, "?", "traceback", None,
                                 "generating the case failed:\n" + _last_frames(), 0.0))
                continue
            conn.send(execute(case, folder / "case", timeout_s, entry))
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _Worker:
    """A forked worker; replaced after it hangs past the hard deadline or dies."""

    def __init__(self, seed: int, timeout_s: float, entry: EntryPoint | None,
                 make: Callable[[int, int], Case]) -> None:
        context = multiprocessing.get_context("fork")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, daemon=True,
                                       args=(child, seed, timeout_s, entry, make))
        self.process.start()
        child.close()

    def run(self, index: int, deadline_s: float) -> Result | str:
        """The case's Result, or "hang"/"crash" when the worker gave none."""
        started = time.perf_counter()
        self.conn.send(index)
        if not self.conn.poll(deadline_s):
            self.stop()
            return "hang"
        try:
            return self.conn.recv()
        except EOFError:
            self.process.join(5)
            code = self.process.exitcode
            return f"crash (worker exit {code}) after {time.perf_counter() - started:.1f} s"

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(None)
        self.process.join(10)
        self.stop()


def run_corpus(seed: int, indices: range | list[int], *, timeout_s: float = 20.0,
               entry: EntryPoint | None = None, make: Callable[[int, int], Case] = generate,
               progress: Callable[[Result], None] | None = None,
               grace_s: float = 15.0) -> list[Result]:
    """Run cases `indices` of `seed` in a worker process.

    A case gets `timeout_s` under an alarm; a worker silent for `grace_s` more (a hang in
    C code ignores the alarm) is killed and replaced. `entry` replaces `planner.cli.main`
    and `make` replaces `generate` (the harness's self-tests).
    """
    results: list[Result] = []
    worker: _Worker | None = None
    try:
        for index in indices:
            worker = worker or _Worker(seed, timeout_s, entry, make)
            answer = worker.run(index, timeout_s + grace_s)
            if isinstance(answer, str):
                worker.stop()
                worker = None
                outcome = "hang" if answer == "hang" else "crash"
                answer = Result(index, _class_of(index), outcome, None, answer, timeout_s)
            results.append(answer)
            if progress:
                progress(answer)
    finally:
        if worker:
            worker.close()
    return results


def _class_of(index: int) -> str:
    names = list(CLASSES)
    return names[index % len(names)]


def summarize(results: list[Result]) -> dict[str, dict[str, int]]:
    """Counts per class and outcome."""
    table: dict[str, dict[str, int]] = {}
    for result in results:
        row = table.setdefault(result.cls, dict.fromkeys(OUTCOMES, 0))
        row[result.outcome] = row.get(result.outcome, 0) + 1
    return dict(sorted(table.items()))


def format_table(results: list[Result]) -> str:
    """The counts as a fixed-width table, with a total row."""
    table = summarize(results)
    width = max([len(c) for c in table] + [5])
    lines = [f"{'class':<{width}} " + " ".join(f"{o:>11}" for o in OUTCOMES)]
    totals = dict.fromkeys(OUTCOMES, 0)
    for cls, row in table.items():
        lines.append(f"{cls:<{width}} " + " ".join(f"{row[o]:>11}" for o in OUTCOMES))
        for outcome in OUTCOMES:
            totals[outcome] += row[outcome]
    lines.append(f"{'total':<{width}} " + " ".join(f"{totals[o]:>11}" for o in OUTCOMES))
    return "\n".join(lines)


#: Failures found in modules outside this harness owner's remit, reported to their owner
#: (docs/robustness.md, "Open findings"): name -> (substrings the failure detail must all
#: contain, what is wrong). They still count as failures in bench/fuzz.py; the CI corpus
#: lists them and fails only on failures not listed here. tests/test_robustness.py holds
#: a strict xfail reproduction of each, which fails once the bug is fixed (drop it here).
KNOWN_ISSUES: dict[str, tuple[tuple[str, ...], str]] = {}


def failures(results: list[Result]) -> list[Result]:
    return [r for r in results if r.outcome not in ACCEPTABLE]


def known_issue(result: Result) -> str:
    """The KNOWN_ISSUES name this failure matches, or ""."""
    for name, (needles, _) in KNOWN_ISSUES.items():
        if all(needle in result.detail for needle in needles):
            return name
    return ""


def new_failures(results: list[Result]) -> list[Result]:
    return [r for r in failures(results) if not known_issue(r)]


def describe(result: Result, seed: int) -> str:
    """One failure, with the command that replays it."""
    known = known_issue(result)
    label = f" (known issue {known})" if known else ""
    return (f"case {result.index} [{result.cls}] {result.outcome}{label}: {result.note}\n"
            f"  replay: python bench/fuzz.py --seed {seed} --only {result.index}\n  "
            + result.detail.replace("\n", "\n  "))


if __name__ == "__main__":  # python tests/fuzz_runner.py SEED INDEX: run one case
    one = run_corpus(int(sys.argv[1]), [int(sys.argv[2])])[0]
    print(describe(one, int(sys.argv[1])))
