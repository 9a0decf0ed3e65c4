"""The profile's rates, looked up once for every compute formula: peaks, ramp, memory.

`costmodels.compute` (the roofline of one op) and `costmodels.gemm` (the shape of one
GEMM) both price work with these, so each lookup and its fallbacks live here only.
"""

from __future__ import annotations

from costmodels.profile import HardwareProfile

#: Map a tensor element type to the profile's peak-FLOP/s key.
DTYPE_TO_PEAK = {"float32": "fp32", "float64": "fp32", "float16": "fp16", "bfloat16": "bf16",
                 "float8e4m3fn": "fp8", "float8e5m2": "fp8",
                 "tfloat32": "tf32"}  # fp32 storage, GEMMs on tensor cores (--precision tf32)

#: Peak key used when a profile lacks the op's key (the 910A has no fp32 peak; see above).
PEAK_FALLBACK = {"fp32": "fp16"}

#: Default GEMM ramp R in seconds, for profiles without `matmul_overhead_s`. Least-squares
#: fit (relative error) of t = F / P_large + R to the cublasLt TF32 square-GEMM sweep of
#: AD2605/gemm-zoo benchmarks.md (128^3 .. 8192^3): R = 6.9 us, within 12% of every point up
#: to 1024^3. Calculon's A100 step table (systems/a100_80g.json: 0.6 of peak from 1 GFLOP,
#: 0.9 from 16, 0.95 from 128) implies R between 2 us (bin lower edges) and 31 us (upper).
MATMUL_RAMP_S = 7e-6


def peak_flops(profile: HardwareProfile, dtype: str) -> float:
    """Dense peak FLOP/s for a tensor dtype, with the documented fp32 -> fp16 fallback."""
    return profile.peak(peak_key(profile, dtype))  # ProfileError names the dtypes it has


def peak_key(profile: HardwareProfile, dtype: str) -> str:
    """The peak_flops key a tensor dtype runs at on this profile (after the fallback)."""
    key = DTYPE_TO_PEAK.get(dtype, "fp32")
    if key not in profile.peak_flops and PEAK_FALLBACK.get(key) in profile.peak_flops:
        return PEAK_FALLBACK[key]
    return key


def matmul_ramp_s(profile: HardwareProfile, dtype: str = "float32") -> float:
    """The profile's GEMM ramp R for `dtype`, else MATMUL_RAMP_S.

    Reads the optional field `device.matmul_overhead_s`: one cited value, or one per peak
    key like `peak_flops` (a CPU's bf16 GEMM pays ~12 us of oneDNN setup where its fp32
    GEMM pays ~2 us; docs/cost-model.md). A per-dtype object without the key the dtype
    runs at (after the fp32 -> fp16 fallback) gives the default.
    """
    ramp = profile.matmul_overhead(peak_key(profile, dtype))
    return MATMUL_RAMP_S if ramp is None else ramp


def large_gemm_rate(profile: HardwareProfile, dtype: str) -> float:
    """FLOP/s of a large GEMM: the dtype's peak times `matmul_efficiency` (P * E)."""
    return peak_flops(profile, dtype) * float(profile.matmul_efficiency.value)


def memory_seconds(profile: HardwareProfile, nbytes: float) -> float:
    """Seconds to stream `nbytes` through HBM: M / (W * e)."""
    return nbytes / (float(profile.memory_bandwidth_Bps.value)
                     * float(profile.memory_efficiency.value))


def launch_floor_s(profile: HardwareProfile) -> float:
    """L, the least time any op (kernel) takes: `kernel_launch_s`."""
    return float(profile.kernel_launch_s.value)
