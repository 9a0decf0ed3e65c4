"""Pipeline schedules: step time from per-stage times, bubble, and micro-batches in flight.

One place for the schedule formulas the search, the plan and the tests use:

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
  and last chunks) no closed form is exact: the step is the longest path through the
  schedule's actions, each device running Megatron-LM's order (`interleaved_order`) and
  every pass waiting for its inputs: a forward for the previous chunk's forward of the
  same micro-batch, a backward for its own forward and the next chunk's backward.
  `interleaved_time` computes that path, O(m·v·p); it equals the closed form for equal
  chunks, and it is what `pipeline_time` returns when given unequal chunk times.

Memory differs: GPipe keeps all m micro-batches' activations; 1F1B keeps p − s on stage
s (at most m); interleaved keeps Megatron-LM's warm-up count plus one chunk, each chunk
holding 1/v of the device's activations (megatron/core/pipeline_parallel/schedules.py,
``get_pipeline_model_parallel_warmup_microbatches``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from planner.kinds import Schedule

SCHEDULES = tuple(str(schedule) for schedule in Schedule)


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of "
                         f"{', '.join(SCHEDULES)}")


ChunkTimes = Sequence[Sequence[tuple[float, float]]]  # [device][slot]: (forward, backward)


def pipeline_time(stage_times: Sequence[float], micro_batches: int, schedule: str = "1f1b",
                  virtual_stages: int = 1, chunks: ChunkTimes | None = None) -> float:
    """Seconds to push `micro_batches` through stages taking `stage_times` each (per device:
    the sum over its chunks when interleaved). For the interleaved schedule, `chunks` gives
    each device's chunks as (forward, backward) seconds; when they are not all equal the
    step is the schedule's longest path (`interleaved_time`), else the closed form."""
    check_schedule(schedule)
    if not stage_times:
        return 0.0
    slowest, total = max(stage_times), sum(stage_times)
    if schedule == Schedule.INTERLEAVED:
        if chunks is not None and not _equal_chunks(chunks):
            return interleaved_time(chunks, micro_batches)
        v = max(1, virtual_stages)
        return micro_batches * slowest + (total - slowest) / v
    return total + (micro_batches - 1) * slowest


def _equal_chunks(chunks: ChunkTimes) -> bool:
    sums = [f + b for device in chunks for f, b in device]
    return bool(sums) and max(sums) - min(sums) <= 1e-12 * max(sums)


@functools.lru_cache(maxsize=256)
def _order(stages: int, chunks: int, micro_batches: int,
           device: int) -> tuple[tuple[bool, int, int], ...]:
    """`interleaved_order`, kept: the partition search prices the same schedule often."""
    return tuple(interleaved_order(stages, chunks, micro_batches, device))


def interleaved_order(stages: int, chunks: int, micro_batches: int,
                      device: int) -> list[tuple[bool, int, int]]:
    """Megatron-LM's interleaved 1F1B order on `device` (megatron/core/pipeline_parallel/
    schedules.py): (is forward, micro-batch, slot) for every pass. Micro-batches go in
    groups of p through slot 0, then slot 1, ...; backward passes run the slots in
    reverse; the warm-up runs (p − d − 1)·2 + (v − 1)·p forwards."""
    p, v = stages, chunks
    total = micro_batches * v

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> tuple[bool, int, int]:
        return True, micro(k), (k // p) % v

    def backward(k: int) -> tuple[bool, int, int]:
        return False, micro(k), v - 1 - (k // p) % v

    warmup = min((p - device - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]


def interleaved_time(chunks: ChunkTimes, micro_batches: int) -> float:
    """The interleaved step's length (`_interleaved_time`), memoised on the chunk times:
    the stage search asks for the same partitions' schedule many times."""
    return _interleaved_time(tuple(tuple((float(f), float(b)) for f, b in device)
                                   for device in chunks), micro_batches)


@functools.lru_cache(maxsize=4096)
def _interleaved_time(chunks: tuple[tuple[tuple[float, float], ...], ...],
                      micro_batches: int) -> float:
    """The interleaved step's length: every device runs `interleaved_order`, chunk c·p + d
    of the model on device d taking `chunks[d][c]` = (forward, backward) seconds; a pass
    starts when its device is free and its inputs are done. Chunks of one device may
    differ in time, devices must hold the same number of chunks, and m be a multiple of
    p (as Megatron-LM requires)."""
    p = len(chunks)
    v = len(chunks[0]) if p else 0
    if not p or not v:
        return 0.0
    if any(len(device) != v for device in chunks):
        raise ValueError("interleaved_time: every device needs the same number of chunks")
    if micro_batches % p:
        raise ValueError(f"interleaved_time: {micro_batches} micro-batches is not a multiple "
                         f"of {p} stages")
    last = p * v - 1
    orders = [_order(p, v, micro_batches, d) for d in range(p)]
    # End time of each pass, by micro-batch and global chunk; -1: not run yet.
    forward_end = [[-1.0] * (last + 1) for _ in range(micro_batches)]
    backward_end = [[-1.0] * (last + 1) for _ in range(micro_batches)]
    free = [0.0] * p
    position = [0] * p
    remaining = sum(len(order) for order in orders)
    while remaining:
        moved = False
        for d in range(p):
            order, device_chunks = orders[d], chunks[d]
            at, clock = position[d], free[d]
            while at < len(order):
                is_forward, micro, slot = order[at]
                chunk = slot * p + d
                if is_forward:
                    ready = forward_end[micro][chunk - 1] if chunk else 0.0
                    if ready < 0.0:
                        break
                    clock = max(clock, ready) + device_chunks[slot][0]
                    forward_end[micro][chunk] = clock
                else:
                    ready = forward_end[micro][chunk]
                    after = backward_end[micro][chunk + 1] if chunk < last else 0.0
                    if ready < 0.0 or after < 0.0:
                        break
                    clock = max(clock, ready, after) + device_chunks[slot][1]
                    backward_end[micro][chunk] = clock
                at += 1
            if at != position[d]:
                remaining -= at - position[d]
                position[d], free[d] = at, clock
                moved = True
        if not moved:  # Megatron's order never deadlocks; a guard against misuse
            raise ValueError("interleaved_time: the schedule cannot proceed")
    return max(free)


def bubble_fraction(stages: int, micro_batches: int, schedule: str = "1f1b",
                    virtual_stages: int = 1) -> float:
    """Idle share of a pipeline of equal stages: 1 − (useful time / step time)."""
    busy = micro_batches * 1.0
    step = pipeline_time([1.0] * stages, micro_batches, schedule, virtual_stages)
    return 1.0 - busy / step if step > 0 else 0.0


def in_flight(stage: int, stages: int, micro_batches: int, schedule: str = "1f1b",
              virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of the
    stage's whole activation set for one micro-batch (a chunk counts 1/v)."""
    check_schedule(schedule)
    if schedule == Schedule.GPIPE:
        return float(micro_batches)
    if schedule == Schedule.ONE_F_ONE_B:
        return float(min(micro_batches, stages - stage))
    v = max(1, virtual_stages)
    warmup = (stages - stage - 1) * 2 + (v - 1) * stages
    chunks = min(micro_batches * v, warmup + 1)
    return chunks / v
