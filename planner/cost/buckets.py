"""Weight collectives as frameworks issue them: in buckets, overlapped with compute.

**Buckets.** Frameworks do not reduce (or gather) each weight on its own: PyTorch DDP packs
gradients into buckets of `bucket_cap_mb` = 25 MiB and all-reduces each bucket as one call;
DeepSpeed ZeRO reduces `reduce_bucket_size` = 5e8 elements and gathers
`allgather_bucket_size` = 5e8 elements at a time; Megatron-LM's distributed optimizer uses
buckets of max(4e7, 1e6 · dp) parameters; FSDP issues one all-gather and one
reduce-scatter per wrapped module (one per layer). The planner's bucket is a byte size,
`--bucket-mb` (`TrainingOptions.bucket_mb`, MiB; default PyTorch DDP's 25; 0 turns
bucketing off). A weight's share of its bucket's time is linear in its bytes, so the
op-level ILP stays linear:

    share(n) = t(C) · n / C        for n < C   (= β·n + α·n/C when t(n) = α + β·n)
    share(n) = t(n)                for n ≥ C   (a weight larger than a bucket pays its own)

with t = `collective_seconds` (the cheapest of ring and tree at the bucket's size, as
NCCL's tuner picks per message size) and C the bucket's bytes: the bucket's latency
terms are amortised over its bytes. Summed over a full bucket the shares give the
bucket's own time; a partly filled last bucket is priced as if full (its latency is
under-counted by at most one bucket's α per group).

**Overlap.** `schedule_overlap`: gradient reduction of the buckets of later layers runs
behind the backward pass of earlier layers, so all but the last bucket (the first layer's
weights) can hide behind the backward compute of the other layers, where the framework
issues it so (torch DDP and FSDP do; Megatron-LM reduces after the backward pass unless
`--overlap-grad-reduce`, off by default: `TrainingOptions.overlap_grad_reduce`); ZeRO-3 gathers of
layer k + 1 are prefetched behind layer k's compute (`prefetch_exposed`). `--overlap` is a
floor on the hidden share of the end-of-step synchronisation (what users asserted before
the schedule was modelled): the hidden part is the larger of the two.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from costmodels.communication import behind_compute
from planner.cost.pricing import bucketed_seconds

__all__ = ["DEFAULT_BUCKET_MB", "Issue", "assign_buckets", "backward_prefetch_exposed",
           "bucket_bytes", "bucketed_seconds", "prefetch_exposed", "schedule_overlap"]

#: PyTorch DDP's `bucket_cap_mb` (torch.nn.parallel.DistributedDataParallel): the
#: framework the executor runs.
DEFAULT_BUCKET_MB = 25.0
MIB = 1 << 20


def bucket_bytes(bucket_mb: float) -> float:
    """The bucket's bytes for `--bucket-mb` (MiB, as DDP's `bucket_cap_mb`); 0: none."""
    return max(0.0, float(bucket_mb)) * MIB


@dataclass(frozen=True)
class Issue:
    """One weight collective in the order a run issues it, for bucket numbering: tensors
    of one `group` (device stage, kind, phase, axes) share buckets."""

    group: tuple
    nbytes: float


def assign_buckets(issues: Iterable[Issue], bucket: float) -> list[int | None]:
    """The bucket of each issue, in the order given: consecutive issues of one group fill a
    bucket up to `bucket` bytes; an issue as large as a bucket gets its own. Buckets are
    numbered from 0 in order of opening. None for every issue when bucketing is off."""
    items = list(issues)
    if bucket <= 0:
        return [None] * len(items)
    open_: dict[tuple, tuple[int, float]] = {}  # group -> (bucket, bytes in it)
    result: list[int | None] = []
    count = 0
    for item in items:
        current = open_.get(item.group)
        if item.nbytes >= bucket or current is None or current[1] + item.nbytes > bucket:
            current = (count, 0.0)
            count += 1
        index, filled = current
        filled += item.nbytes
        open_[item.group] = (index, filled)
        if item.nbytes >= bucket:
            del open_[item.group]  # nothing joins a bucket-sized tensor
        result.append(index)
    return result


def schedule_overlap(total: float, last: float, hide: float, overlap: float,
                     scheduled: bool = True, share: float = 1.0) -> tuple[float, float]:
    """(exposed, hidden) seconds of an end-of-step gradient synchronisation of `total`
    seconds whose last bucket takes `last` (it is ready only when the backward pass ends),
    the rest running behind `hide` seconds of backward compute; `overlap` is the least
    share hidden (`--overlap`). Not `scheduled` (`--no-overlap-grad-reduce`): the
    reduction starts after the backward pass, and only the `overlap` floor is hidden.
    `share` of the time the reduction runs beside compute is hidden (the profile's
    `compute_overlap`, `costmodels.communication.behind_compute`)."""
    if total <= 0:
        return 0.0, 0.0
    by_schedule = share * min(max(0.0, total - last), max(0.0, hide)) if scheduled else 0.0
    hidden = min(total, max(by_schedule, overlap * total))
    return total - hidden, hidden


def exposed_share(last_bucket: bool, overlap: float, scheduled: bool = True,
                  share: float = 1.0) -> float:
    """The share of one weight's end-of-step reduction left exposed, as the strategy table
    prices it: `schedule_overlap` taken weight by weight, where the backward compute is
    long enough to hide what the schedule allows. A weight of the last bucket (read first
    by the first unit: its gradient is ready only when the backward pass ends) keeps the
    `overlap` floor hidden, any other `share` of itself when the reduction runs behind the
    backward pass (`scheduled`), and at least the floor. Linear in each weight's
    reduction, so the ILP stays linear; where the reductions outlast the backward compute
    the built step exposes more than this (and with `overlap` > 0 the floor applies to the
    whole reduction there, not to each weight)."""
    if last_bucket or not scheduled:
        return 1.0 - overlap
    return 1.0 - max(overlap, share)


def prefetch_exposed(gathers: np.ndarray, compute: np.ndarray, share: float = 1.0) -> float:
    """Exposed seconds of per-unit collectives prefetched one unit ahead: unit k's
    collective runs behind unit k − 1's compute (in the order the units run, `share` of
    the overlap hidden: `behind_compute`); the first unit's waits in full."""
    if not len(gathers):
        return 0.0
    return float(gathers[0] + behind_compute(gathers[1:], compute[:-1], share).sum())


def backward_prefetch_exposed(gathers: np.ndarray, reduces: np.ndarray,
                              compute: np.ndarray, share: float = 1.0) -> float:
    """Exposed seconds of the backward pass's per-unit collectives, units in forward order
    (the backward pass runs them last to first): unit k's gather is prefetched behind the
    backward of unit k + 1, its reduce-scatter runs behind the backward of unit k − 1. The
    first gather (of the last unit) and the last reduce-scatter (of the first) wait in
    full; each unit's backward hides at most its own length."""
    n = len(compute)
    if not n:
        return 0.0
    need = np.zeros(n)
    need[1:] += gathers[:-1]
    need[:-1] += reduces[1:]
    return float(gathers[-1] + reduces[0] + behind_compute(need, compute, share).sum())
