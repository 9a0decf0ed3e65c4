"""Timed torch measurements on this machine, run inside spawned ranks of a process group.

A profile's "device" on a CPU host is one rank with one torch thread, and a real job runs
one rank per core, so every measurement runs in all ranks at once: a number measured by a
lone process would credit a rank with cores it does not get. The same ranks then time the
collectives of their process group, so calibration pays the process start (~1.7 s for two
ranks here) once.

Each point is timed in `rounds` passes over the whole plan, so a burst of load from
another process spoils one pass of a point, not all of it. In each pass the ranks make one
warm-up call, agree on a repeat count from the slowest rank's timing of one more call
(every rank must issue the same calls, and they then run at the same moments) and repeat
the call about `target_s / rounds` long. A point reports the lower quartile of all its
per-call times: on a shared host other processes preempt the ranks now and then, which
only ever adds time, and a gloo collective waits for its slowest member, so the upper tail
is interference while the lower quartile still holds the contention between the job's own
ranks. Rank 0 prints one progress line per point, which the parent relays; the parent
kills every rank still running at the deadline, so a broken process group never hangs the
caller.
"""

from __future__ import annotations

import json
import math
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from planner.errors import ShardplanError

#: Collective kinds the ranks can time (names as in costmodels.communication).
MEASURABLE = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
ELEMENTWISE = ("add", "mul", "gelu", "copy")

_ROOT = Path(__file__).resolve().parent.parent  # the checkout holding costmodels/ and planner/


@dataclass(frozen=True)
class Plan:
    """What the ranks measure. Sizes: matmul n for n x n @ n x n; bytes for the rest."""

    matmul: tuple[tuple[str, int], ...] = ()  # (torch dtype name, n)
    copy_bytes: int = 0  # per tensor; 0 = skip the bandwidth measurement
    dispatch_calls: int = 0  # 0 = skip the per-op dispatch measurement
    elementwise: tuple[tuple[str, int], ...] = ()  # (op in ELEMENTWISE, elements), fp32
    collectives: tuple[str, ...] = ()
    collective_bytes: tuple[int, ...] = ()
    group_sizes: tuple[int, ...] = ()  # each k in 2..nproc: ranks 0..k-1
    target_s: float = 0.2  # per point, over all rounds
    min_reps: int = 3  # per point and round
    max_reps: int = 2000
    rounds: int = 1  # passes over all points; spreads each point's samples over time
    #: all_reduce size of the compute/communication overlap measurement (0: skip it)
    overlap_bytes: int = 0
    overlap_matmul: int = 256  # n of the n x n fp32 matmuls run beside it
    #: each timed collective follows a burst of fp32 matmuls about this long (0: the calls
    #: back to back), run untimed before each call: a collective as a step issues it
    step_burst_s: float = 0.0


@dataclass
class Results:
    """What one rank measured; seconds are lower quartiles of the per-call times."""

    rank: int
    matmul: list[dict[str, Any]] = field(default_factory=list)  # dtype, n, seconds
    copy: dict[str, float] = field(default_factory=dict)  # bytes, seconds
    dispatch_s: float = 0.0
    elementwise: list[dict[str, Any]] = field(default_factory=list)  # op, numel, seconds
    collectives: list[dict[str, Any]] = field(default_factory=list)  # kind, p, nbytes, seconds
    #: "transfer", "compute", "both": seconds of an all_reduce alone, of matmuls alone,
    #: and of the two issued together (`Rank.overlap`)
    overlap: dict[str, float] = field(default_factory=dict)


def run_ranks(plan: Plan, nproc: int = 2, backend: str = "gloo", timeout_s: float = 170.0,
              progress: Callable[[str], None] | None = None) -> list[Results]:
    """Start `nproc` ranks, run `plan` in all of them, return each rank's Results.

    Ranks are fresh interpreters (`python -m costmodels.measure`), not multiprocessing
    children, so callers need no `if __name__ == "__main__"` guard.
    """
    if nproc < 1:
        raise ShardplanError(f"need at least 1 process to measure, got {nproc}")
    if backend not in ("gloo", "nccl"):
        raise ShardplanError(f"unknown backend {backend!r}: use gloo or nccl")
    with tempfile.TemporaryDirectory(prefix="shardplan-measure-") as scratch:
        out = Path(scratch)
        (out / "plan.json").write_text(json.dumps(asdict(plan)), encoding="utf-8")
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        ranks = []
        for rank in range(nproc):
            command = [sys.executable, "-m", "costmodels.measure", str(rank), str(nproc),
                       str(port), backend, scratch, str(timeout_s)]
            with open(out / f"rank{rank}.log", "wb") as log_file:
                ranks.append(subprocess.Popen(
                    command, env=env, stdin=subprocess.DEVNULL, stderr=log_file,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=_pump, args=(ranks[0].stdout, lines), daemon=True)
        reader.start()
        last = "starting ranks"
        deadline = time.monotonic() + timeout_s
        try:
            while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
                if any(r.poll() for r in ranks):  # one rank failed: the rest would wait
                    break
                last = _drain(lines, progress, last, wait=0.05)
        finally:
            stuck = [r for r in ranks if r.poll() is None]
            for process in stuck:
                process.kill()
            for process in ranks:
                process.wait(timeout=10)
            reader.join(timeout=5)
            last = _drain(lines, progress, last, wait=0.0)
        errors = sorted(out.glob("rank*.error"))
        if errors:
            problem = errors[0].read_text(encoding="utf-8").strip().splitlines()[-1]
            raise ShardplanError(f"measurement failed in {errors[0].stem}: {problem}")
        if stuck:
            raise ShardplanError(f"measurement timed out after {timeout_s:.0f} s during "
                                 f"'{last}'; the host may be overloaded or a rank hung")
        failed = [(i, r.returncode) for i, r in enumerate(ranks) if r.returncode != 0]
        if failed:
            log = (out / f"rank{failed[0][0]}.log").read_text(errors="replace").strip()
            tail = log.splitlines()[-1] if log else "no output"
            raise ShardplanError(f"measuring rank {failed[0][0]} exited with code "
                                 f"{failed[0][1]}: {tail}")
        return [Results(**json.loads((out / f"rank{r}.json").read_text(encoding="utf-8")))
                for r in range(nproc)]


def _pump(stream: IO[bytes] | None, lines: queue.Queue[str]) -> None:
    """Copy rank 0's progress lines into a queue (a thread, so the parent can time out)."""
    if stream is None:
        return
    for raw in stream:
        lines.put(raw.decode("utf-8", "replace").rstrip())


def _drain(lines: queue.Queue[str], progress: Callable[[str], None] | None, last: str,
           wait: float) -> str:
    try:
        while True:
            last = lines.get(timeout=wait) if wait else lines.get_nowait()
            if progress is not None:
                progress(last)
            wait = 0.0
    except queue.Empty:
        return last


def _free_port() -> int:
    """A port the OS says is free on 127.0.0.1 (each run gets its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_main(argv: Sequence[str]) -> int:
    """Entry point of one rank: measure, then write rank<r>.json or rank<r>.error."""
    rank, world, port, backend, scratch, timeout_s = argv
    out = Path(scratch)
    try:
        plan = Plan(**{k: _tuples(v) for k, v in
                       json.loads((out / "plan.json").read_text(encoding="utf-8")).items()})
        results = _Rank(int(rank), int(world), int(port), backend, plan,
                        float(timeout_s)).run()
        (out / f"rank{rank}.json").write_text(json.dumps(asdict(results)), encoding="utf-8")
        return 0
    except BaseException as exc:  # report anything, including KeyboardInterrupt
        text = "".join(traceback.format_exception(exc)).rstrip()
        last = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        (out / f"rank{rank}.error").write_text(f"{text}\n{last}\n", encoding="utf-8")
        return 1


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples Plan holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class _Rank:
    """The measurements of one rank; torch is imported here, in the child, only."""

    def __init__(self, rank: int, world: int, port: int, backend: str, plan: Plan,
                 timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.plan = rank, plan
        torch.set_num_threads(1)
        self.device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ \
                and Path("/sys/class/net/lo").exists():
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo on the loopback interface
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        self.samples: dict[tuple[Any, ...], list[float]] = {}
        self.round_ = ""  # progress suffix
        self.burst = 0  # matmuls in the overlap measurement's compute burst
        self.step_burst = 0  # matmuls before each timed collective (`Plan.step_burst_s`)

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def timed(self, call: Callable[[], object],
              before: Callable[[], None] | None = None) -> float:
        """Seconds of one `call`; `before`, when given, runs first, untimed."""
        if before is not None:
            before()
            self.sync()
        t0 = time.perf_counter()
        call()
        self.sync()
        return time.perf_counter() - t0

    def measure(self, key: tuple[Any, ...], call: Callable[[], object], group: Any,
                before: Callable[[], None] | None = None) -> float:
        """Time `call` the agreed number of times, add the samples to `key`; lower quartile.

        One warm-up call, then one timed call whose slowest-member time sets the repeat
        count, so every member issues the same calls and runs them at the same moments.
        `before` runs ahead of every call, outside the timed span.
        """
        if before is not None:
            before()
        call()
        self.sync()
        slowest = self.torch.tensor([self.timed(call, before)], dtype=self.torch.float64,
                                    device=self.device)
        self.dist.all_reduce(slowest, op=self.dist.ReduceOp.MAX, group=group)
        plan = self.plan
        share = plan.target_s / plan.rounds
        reps = max(plan.min_reps, min(plan.max_reps,
                                      math.ceil(share / max(float(slowest.item()), 1e-9))))
        self.dist.barrier(group=group)
        times = [self.timed(call, before) for _ in range(reps)]
        self.samples.setdefault(key, []).extend(times)
        return lower_quartile(times)

    def run(self) -> Results:
        try:
            groups = {size: self.dist.new_group(list(range(size)))
                      for size in self.plan.group_sizes}  # every rank creates every group
            for round_ in range(self.plan.rounds):
                self.round_ = f" (round {round_ + 1}/{self.plan.rounds})" \
                    if self.plan.rounds > 1 else ""
                self.compute()
                self.agree_step_burst()
                for size, group in groups.items():
                    if self.rank < size:
                        self.collectives(size, group)
                    self.dist.barrier()
                if self.plan.overlap_bytes:
                    self.overlap()
            return self.results()
        finally:
            self.dist.destroy_process_group()

    def results(self) -> Results:
        out = Results(rank=self.rank)
        for key, times in self.samples.items():
            seconds = lower_quartile(times)
            section, *rest = key
            if section == "matmul":
                out.matmul.append({"dtype": rest[0], "n": rest[1], "seconds": seconds})
            elif section == "copy":
                out.copy = {"bytes": float(rest[0]), "seconds": seconds}
            elif section == "dispatch":
                out.dispatch_s = seconds / rest[0]
            elif section == "elementwise":
                out.elementwise.append({"op": rest[0], "numel": rest[1], "seconds": seconds})
            elif section == "overlap":
                out.overlap[rest[0]] = seconds
            else:
                out.collectives.append({"kind": rest[0], "p": rest[1], "nbytes": rest[2],
                                        "seconds": seconds})
        return out

    def compute(self) -> None:
        torch, plan, world = self.torch, self.plan, None  # None: the default (whole) group
        for dtype_name, n in plan.matmul:
            dtype = getattr(torch, dtype_name)
            a = torch.randn(n, n, device=self.device).to(dtype)
            b = torch.randn(n, n, device=self.device).to(dtype)

            def matmul(a: Any = a, b: Any = b) -> Any:
                return a @ b

            seconds = self.measure(("matmul", dtype_name, n), matmul, world)
            self.say(f"matmul {dtype_name} {n}^3: {2 * n**3 / seconds / 1e9:.1f} GFLOP/s"
                     f"{self.round_}")
        if plan.copy_bytes:
            numel = plan.copy_bytes // 4
            src = torch.ones(numel, device=self.device)
            dst = torch.empty(numel, device=self.device)
            seconds = self.measure(("copy", plan.copy_bytes), lambda: dst.copy_(src), world)
            self.say(f"copy {plan.copy_bytes >> 20} MiB: {2 * plan.copy_bytes / seconds / 1e9:.1f}"
                     f" GB/s (read + write){self.round_}")
        if plan.dispatch_calls:
            x = torch.ones(1, device=self.device)
            calls = plan.dispatch_calls

            def burst() -> None:
                for _ in range(calls):
                    torch.add(x, x)

            seconds = self.measure(("dispatch", calls), burst, world) / calls
            self.say(f"dispatch: {seconds * 1e6:.2f} us per op{self.round_}")
        for op, numel in plan.elementwise:
            seconds = self.measure(("elementwise", op, numel), self.elementwise(op, numel),
                                   world)
            self.say(f"{op} {numel} elements: {seconds * 1e6:.1f} us{self.round_}")

    def elementwise(self, op: str, numel: int) -> Callable[[], object]:
        torch = self.torch
        a = torch.randn(numel, device=self.device)
        b = torch.randn(numel, device=self.device)
        if op == "add":
            return lambda: a + b
        if op == "mul":
            return lambda: a * b
        if op == "gelu":
            return lambda: torch.nn.functional.gelu(a)
        if op == "copy":
            return lambda: b.copy_(a)
        raise ValueError(f"unknown elementwise op {op!r}; expected one of {ELEMENTWISE}")

    def overlap(self) -> None:
        """How much of a collective runs behind compute: an all_reduce of `overlap_bytes`
        over all ranks alone, a burst of fp32 matmuls about as long alone, and the two
        issued together (the all_reduce asynchronously, the matmuls beside it, then its
        wait), as a framework overlaps a gradient bucket with the backward pass."""
        torch, dist, plan = self.torch, self.dist, self.plan
        whole = torch.zeros(plan.overlap_bytes // 4, device=self.device)
        a = torch.randn(plan.overlap_matmul, plan.overlap_matmul, device=self.device)
        transfer = self.measure(("overlap", "transfer"), lambda: dist.all_reduce(whole), None)
        if not self.burst:  # one burst length for every round: their samples are pooled
            single = self.measure(("overlap", "matmul"), lambda: a @ a, None)
            self.burst = self.agreed_count(transfer, single)
        count = self.burst
        burst = _matmuls(a, count)

        def both() -> None:
            work = dist.all_reduce(whole, async_op=True)
            burst()
            work.wait()

        compute = self.measure(("overlap", "compute"), burst, None)
        together = self.measure(("overlap", "both"), both, None)
        self.say(f"overlap: all_reduce {plan.overlap_bytes >> 20} MiB {transfer * 1e3:.1f} ms, "
                 f"{count} matmuls {compute * 1e3:.1f} ms, together {together * 1e3:.1f} ms"
                 f"{self.round_}")

    def collectives(self, size: int, group: Any) -> None:
        """Each collective of the plan at each size in the group of `size` ranks. With
        `Plan.step_burst_s`, each timed call follows a burst of compute, as a training
        step's collectives follow its kernels; only the call is timed. Back to back, the
        calls of a gloo group keep its threads awake and its caches warm, which a step does
        not (here a 512 KB all_reduce took 0.73 ms back to back and 1.8-2.0 ms after 2 ms
        of matmuls). Timing the call alone, rather than burst and call less the burst's
        own time, keeps the burst's jitter (a loaded host's milliseconds) out of the
        point: subtracted, it once left a 4 MiB all_reduce 20 us and the fit 200 GB/s."""
        burst = self.step_burst_call()
        for kind in self.plan.collectives:
            for nbytes in self.plan.collective_bytes:
                call, moved = self.collective(kind, max(nbytes, 4 * size), size, group)
                seconds = self.measure(("collective", kind, size, moved), call, group, burst)
                self.say(f"{kind} p={size} {moved} B: {seconds * 1e6:.0f} us"
                         f"{'' if burst is None else ' with the burst'}{self.round_}")

    def agreed_count(self, seconds: float, single: float) -> int:
        """How many calls of `single` seconds make about `seconds`, as many on every rank
        (the most any rank needs, agreed over all ranks): every rank runs the same burst."""
        count = self.torch.tensor([max(1, round(seconds / max(single, 1e-9)))],
                                  device=self.device)
        self.dist.all_reduce(count, op=self.dist.ReduceOp.MAX)
        return int(count.item())

    def agree_step_burst(self) -> None:
        """The matmuls of `Plan.step_burst_s`, agreed once over all ranks: every group's
        points then follow the same burst."""
        if not self.plan.step_burst_s or self.step_burst:
            return
        a = self.torch.randn(self.plan.overlap_matmul, self.plan.overlap_matmul,
                             device=self.device)
        single = min(self.timed(lambda: a @ a) for _ in range(3))
        self.step_burst = self.agreed_count(self.plan.step_burst_s, single)

    def step_burst_call(self) -> Callable[[], None] | None:
        """The burst of fp32 matmuls before each timed collective; None when the plan
        times collectives back to back."""
        if not self.step_burst:
            return None
        a = self.torch.randn(self.plan.overlap_matmul, self.plan.overlap_matmul,
                             device=self.device)
        return _matmuls(a, self.step_burst)

    def collective(self, kind: str, nbytes: int, size: int,
                   group: Any) -> tuple[Callable[[], object], int]:
        """The call for one collective and the bytes it moves, in the larger-form convention."""
        torch, dist = self.torch, self.dist
        numel = max(size, nbytes // 4 // size * size)  # fp32, divisible by the group size
        whole = torch.zeros(numel, device=self.device)
        part = torch.zeros(numel // size, device=self.device)
        if kind == "all_reduce":
            return (lambda: dist.all_reduce(whole, group=group)), 4 * numel
        if kind == "all_gather":
            return (lambda: dist.all_gather_into_tensor(whole, part, group=group)), 4 * numel
        if kind == "reduce_scatter":
            return (lambda: dist.reduce_scatter_tensor(part, whole, group=group)), 4 * numel
        if kind == "all_to_all":
            out = torch.zeros_like(whole)
            return (lambda: dist.all_to_all_single(out, whole, group=group)), 4 * numel
        if kind == "broadcast":
            return (lambda: dist.broadcast(whole, src=0, group=group)), 4 * numel
        raise ValueError(f"cannot measure {kind!r}; expected one of {MEASURABLE}")


def _matmuls(a: Any, count: int) -> Callable[[], None]:
    """A burst of compute: `count` products of `a` with itself."""
    def burst() -> None:
        for _ in range(count):
            a @ a
    return burst


def lower_quartile(times: Sequence[float]) -> float:
    """The 25th percentile (nearest rank) of per-call times."""
    ordered = sorted(times)
    return ordered[(len(ordered) - 1) // 4]


def median_over_ranks(results: Sequence[Results], section: str,
                      keys: Sequence[str]) -> dict[tuple[Any, ...], float]:
    """Median across ranks of each point's seconds, keyed by the point's `keys` values."""
    points: dict[tuple[Any, ...], list[float]] = {}
    for result in results:
        for point in getattr(result, section):
            points.setdefault(tuple(point[k] for k in keys), []).append(point["seconds"])
    return {key: statistics.median(values) for key, values in points.items()}


def slowest_over_ranks(results: Sequence[Results]) -> dict[tuple[str, int, int], float]:
    """Collective seconds keyed by (kind, p, nbytes): the slowest member's median."""
    points: dict[tuple[str, int, int], float] = {}
    for result in results:
        for point in result.collectives:
            key = (point["kind"], point["p"], point["nbytes"])
            points[key] = max(points.get(key, 0.0), point["seconds"])
    return points


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
