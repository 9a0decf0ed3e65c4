"""Pipeline schedules: step time from per-stage times, bubble, and micro-batches in flight.

One place for the schedule formulas the search, the plan and the tests use. Every
schedule's order is `costmodels.orders`'s; this module times it.

- GPipe (Huang et al. 2019) runs every micro-batch's forward, then every backward; 1F1B
  (PipeDream-Flush, Narayanan et al. 2021) alternates them after a warm-up. Both take
  ``T = Σ_s t_s + (m − 1) · max_s t_s`` for m micro-batches through stages of time t_s
  (forward + backward of one micro-batch), the formula Alpa's inter-op pass minimises
  (Zheng et al. 2022, eq. 2). With p equal stages the idle share is (p − 1)/(m + p − 1).
- Interleaved 1F1B (Narayanan et al. 2021, §2.2) gives each device v model chunks: the
  fill and drain pass chunks of t/v, so ``T = m · max_d t_d + (Σ_d t_d − max_d t_d)/v``
  and the idle share of p equal stages is (p − 1)/(v·m + p − 1). That closed form holds
  when every chunk of a device takes the same time (any forward:backward ratio, m a
  multiple of p). With chunks of unequal time (uneven layer counts, Megatron-LM's
  ``--decoder-first/last-pipeline-num-layers``, or the embedding and head on the first
  and last chunks) no closed form is exact.
- The zero-bubble schedules (Qi et al. 2023) split each backward into B (the inputs'
  gradients, which the previous stage waits for) and W (the weights' gradients, which
  nobody waits for). ZB-H1 defers Ws into 1F1B's cool-down: with equal stages its bubble
  is about (p − 1)(T_F + T_B − T_W) against 1F1B's (p − 1)(T_F + T_B + T_W). ZB-V puts
  two chunks per device in a V and leaves almost no bubble when T_F ≈ T_B ≈ T_W.

Where no closed form is exact (unequal interleaved chunks, both zero-bubble schedules)
the step is the longest path through the schedule's passes (`simulate`): every device
runs its order, and a pass starts when its device is free and its inputs are done — a
forward after the previous chunk's forward of the micro-batch, a backward (B) after its
own forward and the next chunk's backward, a W after its own B. O(passes); it equals the
closed forms where they hold (tests/test_schedules.py).

Memory differs: GPipe keeps all m micro-batches' activations; 1F1B keeps p − s on stage
s (at most m); interleaved keeps Megatron-LM's warm-up count plus one chunk, each chunk
holding 1/v of the device's activations (megatron/core/pipeline_parallel/schedules.py,
``get_pipeline_model_parallel_warmup_microbatches``). `in_flight` counts them off the
order itself: a chunk's activations from its forward until its last backward pass — for
the zero-bubble schedules its W, since the input backward keeps the autograd graph for
the W (torch's `stage_backward_input` retains it, as the executor would).
"""

from __future__ import annotations

import array
import functools
from collections.abc import Sequence
from typing import NamedTuple

from costmodels.orders import (
    SPLIT_BACKWARD,
    Pass,
    chunk_device,
    chunks_per_device,
    device_chunks,
    schedule_order,
)
from planner.kinds import Schedule

SCHEDULES = tuple(str(schedule) for schedule in Schedule)


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of "
                         f"{', '.join(SCHEDULES)}")


#: [device][slot]: (forward, backward) or (forward, input backward, weight backward)
#: seconds of one micro-batch; a pair's backward is all of it (no weight part known).
ChunkTimes = Sequence[Sequence[tuple[float, ...]]]
Triples = tuple[tuple[tuple[float, float, float], ...], ...]

#: A device's time split F : B : W when only its total is known (the joint search's
#: bound): a GEMM's forward, its input gradient and its weight gradient cost alike, the
#: largest weight share any op has (elementwise ops have none), so the zero-bubble
#: schedules are never priced slower here than with the real split.
DEFAULT_SPLIT = (1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0)


def pipeline_time(stage_times: Sequence[float], micro_batches: int, schedule: str = "1f1b",
                  virtual_stages: int = 1, chunks: ChunkTimes | None = None) -> float:
    """Seconds to push `micro_batches` through stages taking `stage_times` each (per device:
    the sum over its chunks). `chunks` gives each device's chunks as (forward, backward)
    or (forward, input backward, weight backward) seconds. The closed forms where they are
    exact (1F1B, GPipe, interleaved with equal chunks), else the schedule's longest path
    (`simulate`); without `chunks` each device's time is split evenly over its chunks and
    F : B : W as `DEFAULT_SPLIT`."""
    check_schedule(schedule)
    if not stage_times:
        return 0.0
    slowest, total = max(stage_times), sum(stage_times)
    if schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        return total + (micro_batches - 1) * slowest
    if schedule == Schedule.INTERLEAVED and (chunks is None or _equal_chunks(chunks)):
        v = max(1, virtual_stages)
        return micro_batches * slowest + (total - slowest) / v
    if chunks is None:
        if slowest - min(stage_times) <= 1e-12 * slowest:  # the joint search's bound
            return slowest * _equal_stages_time(str(schedule), len(stage_times),
                                                micro_batches, virtual_stages)
        v = chunks_per_device(schedule, virtual_stages)
        chunks = [[tuple(t / v * share for share in DEFAULT_SPLIT)] * v for t in stage_times]
    return simulate(schedule, chunks, micro_batches)


@functools.lru_cache(maxsize=4096)
def _equal_stages_time(schedule: str, stages: int, micro_batches: int,
                       virtual_stages: int) -> float:
    """The step of `stages` equal stages of one second each, split as `DEFAULT_SPLIT`: a
    longest path scales with its passes' times, so stages of t seconds take t times this
    (the joint search bounds thousands of configurations this way).

    Once a zero-bubble pipeline is full every further micro-batch adds one stage time
    and the bubble is what the warm-up and cool-down leave: from 2p micro-batches on the
    step is m + (p − 1)(F + B − W) with F, B, W one chunk's passes (Qi et al. 2023 §3.1's
    ZB-H1 bubble; ZB-V's chunks are half a stage, so its bubble is half ZB-H1's).
    `tests/test_schedules.py` checks this against the longest path pass by pass; below
    2p micro-batches (and for any other schedule) the longest path is taken."""
    v = chunks_per_device(schedule, virtual_stages)
    forward, backward, weight = (share / v for share in DEFAULT_SPLIT)
    if schedule in (Schedule.ZB_H1, Schedule.ZBV) and micro_batches >= 2 * stages:
        return micro_batches + (stages - 1) * (forward + backward - weight)
    return simulate(schedule, [[(forward, backward, weight)] * v] * stages, micro_batches)


def _equal_chunks(chunks: ChunkTimes) -> bool:
    sums = [sum(times) for device in chunks for times in device]
    return bool(sums) and max(sums) - min(sums) <= 1e-12 * max(sums)


def _triples(chunks: ChunkTimes) -> Triples:
    return tuple(tuple((float(t[0]), float(t[1]), float(t[2]) if len(t) > 2 else 0.0)
                       for t in device) for device in chunks)


def simulate(schedule: str, chunks: ChunkTimes, micro_batches: int) -> float:
    """The step's length: the longest path through `schedule`'s passes (`timeline`)."""
    return _simulate(str(schedule), _triples(chunks), micro_batches)


@functools.lru_cache(maxsize=4096)
def _simulate(schedule: str, chunks: Triples, micro_batches: int) -> float:
    """Memoised on the chunk times: the stage search prices the same partitions often."""
    if not chunks or not chunks[0]:
        return 0.0
    return max(_finish(_passes(schedule, len(chunks), len(chunks[0]), micro_batches),
                       chunks, schedule in SPLIT_BACKWARD)[:-1])


def timeline(schedule: str, chunks: ChunkTimes,
             micro_batches: int) -> list[tuple[int, tuple[str, int, int], float, float]]:
    """Every pass as (device, (kind, micro-batch, chunk), start, end): each device runs
    `costmodels.orders.schedule_order`; chunk `device_chunks(...)[slot]` of device d takes
    `chunks[d][slot]` = (forward, input backward, weight backward) seconds, a backward
    that is not split taking both. A pass starts when its device is free and its inputs
    are done (the module doc). Devices must hold the same number of chunks; the
    interleaved schedule needs m a multiple of p (as Megatron-LM does)."""
    times = _triples(chunks)
    if not times or not times[0]:
        return []
    split = schedule in SPLIT_BACKWARD
    graph = _passes(str(schedule), len(times), len(times[0]), micro_batches)
    finish = _finish(graph, times, split)
    lengths = _lengths(times, split)
    orders = [schedule_order(schedule, len(times), micro_batches, d, len(times[0]))
              for d in range(len(times))]
    return [(device, tuple(orders[device][at]), finish[i] - lengths[length], finish[i])
            for i, (device, at, length) in enumerate(zip(graph.devices, graph.at,
                                                         graph.length, strict=True))]


class _Passes(NamedTuple):
    """A schedule's passes in an order where every pass comes after what it waits for,
    as flat int arrays (a step of 768 micro-batches through 32 stages has 70,000 passes,
    and the stage search keeps a few hundred such steps): pass i ran on device
    `devices[i]` as `order[devices[i]][at[i]]`; its length is `_lengths(...)[length[i]]`;
    it waits for the passes at `first[i]`, `second[i]`, `third[i]` (its device's
    previous pass and its inputs; `len(at)` where there is none)."""

    devices: array.array
    at: array.array
    length: array.array
    first: array.array
    second: array.array
    third: array.array


_KIND_INDEX = {"F": 0, "B": 1, "W": 2}


@functools.lru_cache(maxsize=256)
def _passes(schedule: str, p: int, v: int, micro_batches: int) -> _Passes:
    """The dependency graph of one schedule's step, sorted once (Kahn's algorithm) so
    that each pricing is one pass over it: the stage search prices thousands of chunk
    times on the same few schedules."""
    if v != chunks_per_device(schedule, v):
        raise ValueError(f"pipeline schedule {schedule} runs "
                         f"{chunks_per_device(schedule, v)} chunks per device, not {v}")
    if schedule == Schedule.INTERLEAVED and micro_batches % p:
        raise ValueError(f"interleaved schedule: {micro_batches} micro-batches is not a "
                         f"multiple of {p} stages")
    last = p * v - 1
    slot_of = {c: k for d in range(p) for k, c in enumerate(device_chunks(schedule, p, v, d))}
    listed: list[tuple[int, Pass]] = [
        (d, step) for d in range(p) for step in schedule_order(schedule, p, micro_batches, d, v)]
    position: dict[tuple[str, int, int], int] = {step: i for i, (_, step) in enumerate(listed)}
    waits: list[list[int]] = []
    for i, (d, (kind, micro, chunk)) in enumerate(listed):
        inputs = ([("F", micro, chunk - 1)] if chunk else []) if kind == "F" else \
            [("B", micro, chunk)] if kind == "W" else \
            [("F", micro, chunk)] + ([("B", micro, chunk + 1)] if chunk < last else [])
        before = [i - 1] if i and listed[i - 1][0] == d else []
        found = [position.get(step, -1) for step in inputs]
        if -1 in found:  # the orders never miss an input; a guard against misuse
            raise ValueError(f"pipeline schedule {schedule} cannot proceed")
        waits.append(before + found)
    waiting = [len(w) for w in waits]
    after: list[list[int]] = [[] for _ in listed]
    for i, w in enumerate(waits):
        for j in w:
            after[j].append(i)
    ready = [i for i, count in enumerate(waiting) if not count]
    order: list[int] = []
    while ready:
        i = ready.pop()
        order.append(i)
        for j in after[i]:
            waiting[j] -= 1
            if not waiting[j]:
                ready.append(j)
    if len(order) != len(listed):  # a cycle: the orders never deadlock; a guard
        raise ValueError(f"pipeline schedule {schedule} cannot proceed")
    sorted_at = {i: k for k, i in enumerate(order)}
    none = len(order)
    starts = [0] * p  # each device's first index in `listed`
    for i in range(len(listed) - 1, -1, -1):
        starts[listed[i][0]] = i
    columns: list[list[int]] = [[], [], [], [], [], []]
    for i in order:
        d, (kind, _, chunk) = listed[i]
        waited = [sorted_at[j] for j in waits[i]] + [none] * (3 - len(waits[i]))
        for column, value in zip(columns, (d, i - starts[d], (d * v + slot_of[chunk]) * 3
                                           + _KIND_INDEX[kind], *waited), strict=True):
            column.append(value)
    return _Passes(*(array.array("i", column) for column in columns))


def _lengths(times: Triples, split: bool) -> list[float]:
    """Each (device, slot)'s forward, backward and weight pass seconds, flat: a backward
    that is not split runs its weight part too."""
    flat: list[float] = []
    for device in times:
        for f, b, w in device:
            flat += (f, b if split else b + w, w)
    return flat


def _finish(graph: _Passes, times: Triples, split: bool) -> list[float]:
    """When each pass of `graph` ends (and a trailing 0: the "no pass" slot), every pass
    starting when its device is free and its inputs are done."""
    if any(len(device) != len(times[0]) for device in times):
        raise ValueError("pipeline schedule: every device needs the same number of chunks")
    lengths = _lengths(times, split)
    finish = [0.0] * (len(graph.at) + 1)
    for i, (length, a, b, c) in enumerate(zip(graph.length, graph.first, graph.second,
                                              graph.third, strict=True)):
        finish[i] = lengths[length] + max(finish[a], finish[b], finish[c])
    return finish


def bubble_fraction(stages: int, micro_batches: int, schedule: str = "1f1b",
                    virtual_stages: int = 1,
                    split: tuple[float, float, float] | None = None) -> float:
    """Idle share of a pipeline of equal stages: 1 − (useful time / step time). The
    zero-bubble schedules' depends on a stage's (forward, input backward, weight backward)
    `split` (default `DEFAULT_SPLIT`); the others' does not."""
    busy = micro_batches * 1.0
    chunks = None
    if schedule in SPLIT_BACKWARD:
        v = chunks_per_device(schedule, virtual_stages)
        total = sum(split) if split else 0.0
        shares = tuple(t / total for t in split) if split and total > 0 else DEFAULT_SPLIT
        chunks = [[tuple(share / v for share in shares)] * v] * stages
    step = pipeline_time([1.0] * stages, micro_batches, schedule, virtual_stages, chunks)
    return 1.0 - busy / step if step > 0 else 0.0


def in_flight(stage: int, stages: int, micro_batches: int, schedule: str = "1f1b",
              virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of the
    stage's whole activation set for one micro-batch (a chunk counts 1/v): counted off
    the stage's order, each chunk's from its forward to its last backward pass (W when
    the backward is split)."""
    check_schedule(schedule)
    v = chunks_per_device(schedule, virtual_stages)
    return _in_flight(str(schedule), stages, micro_batches, stage, v)


@functools.lru_cache(maxsize=4096)
def _in_flight(schedule: str, stages: int, micro_batches: int, stage: int, v: int) -> float:
    last_pass = "W" if schedule in SPLIT_BACKWARD else "B"
    held = peak = 0
    for kind, _, _ in schedule_order(schedule, stages, micro_batches, stage, v):
        held += 1 if kind == "F" else -1 if kind == last_pass else 0
        peak = max(peak, held)
    return peak / v


__all__ = ["SCHEDULES", "ChunkTimes", "bubble_fraction", "check_schedule", "chunk_device",
           "in_flight", "pipeline_time", "simulate", "timeline"]
