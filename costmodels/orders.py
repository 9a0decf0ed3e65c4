"""The order each device runs its passes in, for every pipeline schedule: one source.

A schedule is, per device, a list of passes `Pass(kind, micro, chunk)`: a forward "F", a
backward "B" and, for the zero-bubble schedules, the backward split in two (Qi et al.
2023, "Zero Bubble Pipeline Parallelism", ICLR 2024, §2): "B" computes the gradients of
the chunk's inputs (what the previous chunk waits for) and "W" its weights' gradients
(what nobody waits for, so it can fill the bubbles). `chunk` is the global chunk (virtual
stage) index, 0 … p·v − 1 in model order; `chunk_device` says which device holds it.

The pricing (`costmodels.schedule`: the step as the longest path through these lists),
the executor (`executor.schedule`) and the plots read these lists; nothing else writes a
schedule's order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from planner.kinds import Schedule

#: Schedules whose backward runs as two passes, B (inputs' gradients) then W (weights').
SPLIT_BACKWARD = frozenset({Schedule.ZB_H1, Schedule.ZBV})


class Pass(NamedTuple):
    kind: str  # "F" forward, "B" backward (its input-gradient part when split), "W"
    micro: int
    chunk: int  # global chunk index, in model order


def chunks_per_device(schedule: str, virtual_stages: int = 1) -> int:
    """Model chunks each device holds: v interleaved, two in ZB-V's V, else one."""
    if schedule == Schedule.INTERLEAVED:
        return max(1, virtual_stages)
    return 2 if schedule == Schedule.ZBV else 1


def chunk_device(schedule: str, stages: int, chunk: int) -> int:
    """The device holding global chunk `chunk`: round robin (Megatron's interleaving,
    chunk c on device c mod p), or ZB-V's V (device d holds chunks d and 2p − 1 − d, so
    the first and last chunks share device 0 and the turn of the V sits on device p − 1)."""
    if schedule == Schedule.ZBV and chunk >= stages:
        return 2 * stages - 1 - chunk
    return chunk % stages


def misplaced(schedule: str, stages: int, devices: Sequence[int]) -> str | None:
    """Where chunks held on `devices` (chunk by chunk, in model order) are not where
    `schedule` runs them, in words naming both placements; None when they are."""
    expected = [chunk_device(schedule, stages, k) for k in range(len(devices))]
    if len(devices) % stages or list(devices) != expected:
        return f"{schedule} places chunks on devices {expected}, the plan on {list(devices)}"
    return None


def device_chunks(schedule: str, stages: int, virtual_stages: int,
                  device: int) -> tuple[int, ...]:
    """The global chunks of `device`, in model order (its slots)."""
    v = chunks_per_device(schedule, virtual_stages)
    return tuple(c for c in range(stages * v) if chunk_device(schedule, stages, c) == device)


def schedule_order(schedule: str, stages: int, micro_batches: int, device: int,
                   virtual_stages: int = 1) -> tuple[Pass, ...]:
    """Every pass `device` runs in one step, in order (memoised: the partition search
    asks for the same orders many times)."""
    return _order(str(schedule), stages, micro_batches, device,
                  chunks_per_device(schedule, virtual_stages))


@functools.lru_cache(maxsize=1024)
def _order(schedule: str, p: int, m: int, d: int, v: int) -> tuple[Pass, ...]:
    if not 0 <= d < p or m < 1:
        raise ValueError(f"schedule_order: device {d} of {p}, {m} micro-batches")
    if schedule == Schedule.GPIPE:
        return _gpipe(p, m, d)
    if schedule == Schedule.ONE_F_ONE_B:
        return _one_f_one_b(p, m, d)
    if schedule == Schedule.INTERLEAVED:
        return _interleaved(p, m, d, v)
    if schedule == Schedule.ZB_H1:
        return _zb_h1(p, m, d)
    if schedule == Schedule.ZBV:
        return _zbv(p, m, d)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _gpipe(p: int, m: int, d: int) -> tuple[Pass, ...]:
    """GPipe (Huang et al. 2019): every micro-batch's forward, then every backward."""
    return (*(Pass("F", i, d) for i in range(m)), *(Pass("B", i, d) for i in range(m)))


def _one_f_one_b(p: int, m: int, d: int) -> tuple[Pass, ...]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): p − d − 1 warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards."""
    warmup = min(p - d - 1, m)
    order = [Pass("F", i, d) for i in range(warmup)]
    for k in range(m - warmup):
        order += [Pass("F", warmup + k, d), Pass("B", k, d)]
    return (*order, *(Pass("B", k, d) for k in range(m - warmup, m)))


def _interleaved(p: int, m: int, d: int, v: int) -> tuple[Pass, ...]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021 §2.2; megatron/core/
    pipeline_parallel/schedules.py): micro-batches in groups of p through slot 0, then
    slot 1, ...; backward passes run the slots in reverse; (p − d − 1)·2 + (v − 1)·p
    warm-up forwards. Device d's slot s is chunk s·p + d."""
    total = m * v

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> Pass:
        return Pass("F", micro(k), ((k // p) % v) * p + d)

    def backward(k: int) -> Pass:
        return Pass("B", micro(k), (v - 1 - (k // p) % v) * p + d)

    warmup = min((p - d - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return (*order, *(backward(k) for k in range(total - warmup, total)))


def _zb_h1(p: int, m: int, d: int) -> tuple[Pass, ...]:
    """ZB-H1 (Qi et al. 2023 §3.1, Figure 3; torch's ScheduleInterleavedZeroBubble with
    one chunk per device): 1F1B's warm-up of p − d − 1 forwards and its F-B steady state,
    but device d holds back its first d weight passes: after each input backward it runs
    the oldest pending W only once d of them wait. The d held-back Ws run at the end, in
    the tail where 1F1B leaves device d idle while the earlier devices finish their
    backwards. Forwards in flight stay 1F1B's (p − d on device d); a micro-batch's
    activations stay until its W, so device d keeps min(m, p) of them."""
    warmup = min(p - d - 1, m)
    order = [Pass("F", i, d) for i in range(warmup)]
    weights = 0
    for k in range(m):
        if warmup + k < m:
            order.append(Pass("F", warmup + k, d))
        order.append(Pass("B", k, d))
        if k >= d:
            order.append(Pass("W", weights, d))
            weights += 1
    return (*order, *(Pass("W", i, d) for i in range(weights, m)))


def _zbv(p: int, m: int, d: int) -> tuple[Pass, ...]:
    """ZB-V (Qi et al. 2023 §6, Figure 8; torch's ScheduleZBVZeroBubble): device d holds
    chunk d (down the V) and chunk 2p − 1 − d (back up). Warm-up: 2(p − d) − 1 forwards
    of the first chunk, then d pairs (second chunk, first chunk), then p − d rounds of
    the second chunk's F, B, W; the steady state runs F, B, W on the first chunk then on
    the second; the cool-down runs d pairs of input backwards (first, second chunk), then
    p − d rounds of the first chunk's B and its oldest W, and the remaining Ws. The order
    is written for max(m, 2p − 1) micro-batches and the passes of the micro-batches past
    m dropped, as torch does."""
    n = max(2 * p - 1, m)
    first, second = d, 2 * p - 1 - d
    order: list[Pass] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - d) - 1):
        order.append(Pass("F", f0, first))
        f0 += 1
    for _ in range(d):
        order += [Pass("F", f1, second), Pass("F", f0, first)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - d):
        order += [Pass("F", f1, second), Pass("B", b1, second), Pass("W", b1, second)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            order.append(Pass("F", f0, first))
            f0 += 1
        order += [Pass("B", b0, first), Pass("W", b0, first),
                  Pass("F", f1, second), Pass("B", b1, second), Pass("W", b1, second)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(d):
        order += [Pass("B", b0, first), Pass("B", b1, second)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - d):
        order += [Pass("B", b0, first), Pass("W", w0, first)]
        b0, w0 = b0 + 1, w0 + 1
    order += [Pass("W", i, second) for i in range(w1, b1)]
    order += [Pass("W", i, first) for i in range(w0, b0)]
    return tuple(step for step in order if step.micro < m)
