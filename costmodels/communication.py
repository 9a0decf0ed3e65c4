"""Alpha-beta time of collectives over a group of devices.

Ring algorithms on p devices, message n bytes, bus bandwidth B, per-hop latency alpha:
  AllReduce          2(p-1)/p * n/B + 2(p-1) alpha
  AllGather, ReduceScatter, AllToAll   (p-1)/p * n/B + (p-1) alpha
  Broadcast, point-to-point            n/B + alpha
`n` is always the size of the whole (unsharded) tensor the collective produces or consumes.
The link is the outermost topology level the group spans (see DeviceMesh.group_extent).
"""

from __future__ import annotations

from costmodels.profile import HardwareProfile

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "send_recv")


def collective_time(
    profile: HardwareProfile, kind: str, nbytes: float, group_size: int, extent: int
) -> float:
    """Seconds for one collective of `kind` on `group_size` devices spanning `extent` ids."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    level = profile.level_for_group(extent)
    bandwidth = level.bus_bandwidth_Bps
    alpha = float(level.latency_s.value)
    p = group_size
    if kind == "all_reduce":
        return 2 * (p - 1) / p * nbytes / bandwidth + 2 * (p - 1) * alpha
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p * nbytes / bandwidth + (p - 1) * alpha
    if kind in ("broadcast", "send_recv"):
        return nbytes / bandwidth + alpha
    raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
