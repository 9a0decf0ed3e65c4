"""Seconds of one GEMM from its shape: tiles, waves, split-K, the epilogue, the roofline.

A GEMM kernel cuts the m x n output into tiles of the profile's `gemm_tile` (tm x tn, the
K loop in steps of tk), runs one tile per compute unit (SM, AI core) at a time, and writes
each finished tile out (NVIDIA, "Matrix Multiplication Background User's Guide", sections
"Tile Quantization" and "Wave Quantization"; docs/cost-model.md "GEMM shape"):

    tm' = min(tm, ceil16(m)), tn' = min(tn, ceil16(n)), tk' = min(tk, ceil16(k))
    T   = ceil(m / tm') * ceil(n / tn') * batch          output tiles (tile quantisation)
    S   = min(U // T, ceil(k / tk')) if T < U else 1     split-K slices for too few tiles
    W   = ceil(T * S / U)                                 waves (wave quantisation)
    main     = W * U * 2 tm' tn' tk' ceil(ceil(k / tk') / S) / (P * E_main)
    epilogue = T tm' tn' s / (W_mem * e)
    t = max(main + epilogue + R,  (m k + k n + m n) * batch * s / (W_mem * e),  L)

U `compute_units`, s the dtype's bytes, 16 the MMA granule (a smaller problem gets a
smaller tile: cuBLAS has tiles down to 8 x 8, and NVIDIA's mma.sync m16n8k16 and Ascend's
16x16x16 cube fractal work in 16s). The epilogue is the output written after the K loop,
not overlapped with it (the H800 K sweep of tilelang shows a fixed ~45 us on 8192 x 8192,
the time to write C). Split-K's fp32 partial sums (at most U tiles at a time) are taken to
stay in L2 and cost nothing here: an assumption, optimistic for large split GEMMs.

E_main is the mainloop efficiency. `matmul_efficiency` E is the whole-kernel rate of a
large GEMM at the best shape of a sweep (or 8192^3), where the waves come out whole: E
holds that shape's epilogue but no wave loss. So E_main = E / (1 - epilogue share at
REFERENCE, 8192^3): the flat model's time F / (P * E) + R comes back at any large shape
whose tiles fill whole waves, and the shape terms move only what differs from it (8192^3
on 132 SMs is 15.5 waves of 128 x 256 tiles, so it runs 3% below the flat model). A
profile without `compute_units` and `gemm_tile` prices F / (P * E) + R as before
(`has_shape_terms`).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodels.profile import HardwareProfile
from costmodels.rates import (
    large_gemm_rate,
    launch_floor_s,
    matmul_ramp_s,
    memory_seconds,
    peak_flops,
)
from planner.graph import dtype_itemsize

#: Rows, columns and depth of the smallest tile worth pricing: NVIDIA mma.sync.m16n8k16
#: (PTX ISA) and the Ascend cube unit's 16 x 16 x 16 fractal.
MMA_GRANULE = 16


@dataclass(frozen=True)
class GemmShape:
    """One GEMM's local problem: C[batch, m, n] = A[batch, m, k] @ B[batch, k, n]."""

    m: int
    n: int
    k: int
    batch: int = 1

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GemmShape.{name} must be a positive integer, got {value!r}")

    @property
    def flops(self) -> float:
        """2 m n k per batch: one multiply-add is 2 FLOPs."""
        return 2.0 * self.m * self.n * self.k * self.batch

    def nbytes(self, itemsize: int) -> float:
        """Bytes read and written once: A, B and C."""
        return float((self.m * self.k + self.k * self.n + self.m * self.n)
                     * self.batch * itemsize)


#: The shape whose whole-kernel rate `matmul_efficiency` stands for (its sources measured
#: 8192^3 or the best of a sweep of large squares: docs/hardware-profiles.md).
REFERENCE = GemmShape(8192, 8192, 8192)


@dataclass(frozen=True)
class Tiling:
    """How the kernel covers one shape: tile, tiles, split-K slices and waves."""

    tile_m: int
    tile_n: int
    tile_k: int
    tiles: int  # output tiles, over the batch too
    split_k: int  # K slices per output tile (1: no split)
    steps: int  # K steps of tile_k each slice runs
    waves: int
    units: int  # compute units, one tile slice each per wave

    @property
    def padded_flops(self) -> float:
        """FLOPs the machine spends, idle compute units of the last wave included."""
        return (2.0 * self.tile_m * self.tile_n * self.tile_k * self.steps
                * self.waves * self.units)

    def epilogue_bytes(self, itemsize: int) -> float:
        """Bytes of the output tiles written after the K loop (padding included)."""
        return float(self.tiles * self.tile_m * self.tile_n * itemsize)


def itemsize_of(dtype: str) -> int:
    """Bytes per element; float8 types (which numpy lacks) are 1."""
    if dtype == "tfloat32":  # fp32 storage, tensor-core GEMMs (--precision tf32)
        return 4
    return 1 if dtype.startswith("float8") else dtype_itemsize(dtype)


def has_shape_terms(profile: HardwareProfile) -> bool:
    """Whether the profile gives what shape pricing needs: compute units and a tile."""
    return profile.compute_units is not None and profile.gemm_tile is not None


def tiling(profile: HardwareProfile, shape: GemmShape) -> Tiling:
    """The tiles, split-K and waves of `shape` on the profile's compute units."""
    assert profile.compute_units is not None and profile.gemm_tile is not None
    units = int(profile.compute_units.value)
    tm, tn, tk = (min(t, _ceil_to(d, MMA_GRANULE))
                  for t, d in zip(profile.gemm_tile.value, (shape.m, shape.n, shape.k),
                                  strict=True))
    tiles = _ceil_div(shape.m, tm) * _ceil_div(shape.n, tn) * shape.batch
    k_steps = _ceil_div(shape.k, tk)
    split = 1 if tiles >= units else max(1, min(units // tiles, k_steps))
    steps = _ceil_div(k_steps, split)
    waves = _ceil_div(tiles * split, units)
    return Tiling(tm, tn, tk, tiles, split, steps, waves, units)


def mainloop_efficiency(profile: HardwareProfile, dtype: str) -> float:
    """E_main = E / (1 - epilogue share of REFERENCE), at most 1 (module docstring)."""
    flat = REFERENCE.flops / large_gemm_rate(profile, dtype)
    epilogue = memory_seconds(profile, tiling(profile, REFERENCE).epilogue_bytes(
        itemsize_of(dtype)))
    if epilogue >= flat:
        return 1.0
    return min(1.0, REFERENCE.flops / (peak_flops(profile, dtype) * (flat - epilogue)))


def gemm_seconds(profile: HardwareProfile, shape: GemmShape, dtype: str, *,
                 ramp_s: float | None = None) -> float:
    """Seconds of one GEMM kernel of `shape` in `dtype` (module docstring).

    `ramp_s` overrides the profile's ramp R. Without shape terms in the profile this is
    the flat model, max(F / (P * E) + R, bytes / (W * e), L).
    """
    itemsize = itemsize_of(dtype)
    ramp = matmul_ramp_s(profile, dtype) if ramp_s is None else ramp_s
    if has_shape_terms(profile):
        plan = tiling(profile, shape)
        rate = peak_flops(profile, dtype) * mainloop_efficiency(profile, dtype)
        compute = (plan.padded_flops / rate
                   + memory_seconds(profile, plan.epilogue_bytes(itemsize)) + ramp)
    else:
        compute = shape.flops / large_gemm_rate(profile, dtype) + ramp
    roofline = memory_seconds(profile, shape.nbytes(itemsize))
    return max(compute, roofline, launch_floor_s(profile))


def least_gemm_seconds(profile: HardwareProfile, dtype: str) -> float:
    """The least time any GEMM kernel launch in `dtype` takes, whatever its shape or
    split: the ramp R beside one wave of the smallest tiles the profile's kernels take
    (each at least the MMA granule where the profile's tile is larger) and that tile's
    epilogue, and no less than the launch floor L. A floor for bounds: `gemm_seconds` of
    any shape is at least this."""
    ramp = matmul_ramp_s(profile, dtype)
    compute = ramp
    if has_shape_terms(profile):
        assert profile.compute_units is not None and profile.gemm_tile is not None
        tm, tn, tk = (min(t, MMA_GRANULE) for t in profile.gemm_tile.value)
        rate = peak_flops(profile, dtype) * mainloop_efficiency(profile, dtype)
        compute += (2.0 * tm * tn * tk * int(profile.compute_units.value) / rate
                    + memory_seconds(profile, tm * tn * itemsize_of(dtype)))
    return max(compute, launch_floor_s(profile))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _ceil_to(a: int, b: int) -> int:
    return _ceil_div(a, b) * b
