"""Pipeline schedules: step time from per-stage times, bubble, and micro-batches in flight.

One place for the schedule formulas the search, the plan and the tests use:

- GPipe (Huang et al. 2019) runs every micro-batch's forward, then every backward; 1F1B
  (PipeDream-Flush, Narayanan et al. 2021) alternates them after a warm-up. Both take
  ``T = Σ_s t_s + (m − 1) · max_s t_s`` for m micro-batches through stages of time t_s
  (forward + backward of one micro-batch), the formula Alpa's inter-op pass minimises
  (Zheng et al. 2022, eq. 2). With p equal stages the idle share is (p − 1)/(m + p − 1).
- Interleaved 1F1B (Narayanan et al. 2021, §2.2) gives each device v model chunks: the
  fill and drain pass chunks of t/v, so ``T = m · max_d t_d + (Σ_d t_d − max_d t_d)/v``
  and the idle share of p equal stages is (p − 1)/(v·m + p − 1).

Memory differs: GPipe keeps all m micro-batches' activations; 1F1B keeps p − s on stage
s (at most m); interleaved keeps Megatron-LM's warm-up count plus one chunk, each chunk
holding 1/v of the device's activations (megatron/core/pipeline_parallel/schedules.py,
``get_pipeline_model_parallel_warmup_microbatches``).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.kinds import Schedule

SCHEDULES = tuple(str(schedule) for schedule in Schedule)


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of "
                         f"{', '.join(SCHEDULES)}")


def pipeline_time(stage_times: Sequence[float], micro_batches: int, schedule: str = "1f1b",
                  virtual_stages: int = 1) -> float:
    """Seconds to push `micro_batches` through stages taking `stage_times` each (per device:
    the sum over its chunks when interleaved)."""
    check_schedule(schedule)
    if not stage_times:
        return 0.0
    slowest, total = max(stage_times), sum(stage_times)
    if schedule == Schedule.INTERLEAVED:
        v = max(1, virtual_stages)
        return micro_batches * slowest + (total - slowest) / v
    return total + (micro_batches - 1) * slowest


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
