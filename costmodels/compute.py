"""Compute time of one op on one device: a roofline with a GEMM ramp and a launch floor.

    matrix ops:  t = max(F / (P * E) + R,  M / (W * e),  L)
    other ops:   t = max(F / P_vec,        M / (W * e),  L)

Matrix ops are those whose op record says their FLOPs run on matrix units (tensor cores,
cube units, CPU GEMM kernels: `planner.ops.is_matrix_op`, e.g. MatMul, Gemm, Conv, Einsum).
F FLOPs and M bytes moved by the op on this device; P the dense peak FLOP/s of the op's
dtype (`peak_flops`); E `matmul_efficiency`, the large-GEMM asymptote; W
`memory_bandwidth_Bps` and e `memory_efficiency`; L `kernel_launch_s`, the least time any op
takes. R is the GEMM ramp, the fixed fill/drain and tail-wave cost of one matrix kernel
(`device.matmul_overhead_s`, per dtype, when the profile has it, else MATMUL_RAMP_S).
Written as an efficiency, the ramp gives the size curve

    E(F) = E * F / (F + F_half),   F_half = R * P * E,

rising monotonically with the work: a GEMM of F_half FLOPs runs at half the asymptote.
Unlike a step table (Calculon's), the time it gives never falls when the work grows, so
splitting an op can't look cheaper than it is.

P_vec is the fp32 peak (the vector/CUDA-core rate) for non-matrix ops, which are memory
bound on every bundled accelerator; it matters only on CPUs, where a GELU is compute bound.
A profile without an fp32 peak (910A) prices non-matrix ops by memory alone; the 910B's
fp32 peak is a cube (matmul) rate, an optimistic P_vec that binds only above ~74 FLOP/byte.

Dtypes: float32/float64 -> fp32 (float64 is not modelled: optimistic), float16 -> fp16,
bfloat16 -> bf16, float8 -> fp8. A profile without an fp32 peak (Ascend: the cube units
compute fp16) runs fp32 matrix ops at the fp16 peak, as MindSpore does by default on the
910A (CANN precision_mode force_fp16). The 910B profile has an fp32 peak (from a measured
fp32 matmul rate; MindSpore's default there keeps fp32), so the fallback does not apply
to it. Any other missing dtype raises the profile's ProfileError. Sources and numbers:
docs/cost-model.md.
"""

from __future__ import annotations

from costmodels.profile import HardwareProfile
from planner.ops import is_matrix_op

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
    return profile.peak(_peak_key(profile, dtype))  # ProfileError names the dtypes it has


def _peak_key(profile: HardwareProfile, dtype: str) -> str:
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
    ramp = profile.matmul_overhead(_peak_key(profile, dtype))
    return MATMUL_RAMP_S if ramp is None else ramp


def matmul_efficiency(profile: HardwareProfile, flops: float, dtype: str,
                      ramp_s: float | None = None) -> float:
    """Achieved fraction of peak for one GEMM of `flops` FLOPs: E * F / (F + F_half)."""
    if flops <= 0:
        return 0.0
    asymptote = float(profile.matmul_efficiency.value)
    ramp = matmul_ramp_s(profile, dtype) if ramp_s is None else ramp_s
    work_time = flops / (peak_flops(profile, dtype) * asymptote)
    return asymptote * work_time / (work_time + ramp)


def op_time(profile: HardwareProfile, op_type: str, flops: float, nbytes: float, dtype: str,
            *, ramp_s: float | None = None, launches: int = 1) -> float:
    """Seconds for one op that does `flops` and moves `nbytes` on one device.

    `ramp_s` overrides the profile's GEMM ramp (calibration and benchmarks use it); the
    planner leaves it None. `launches` is 0 for the work of an op inside a kernel another
    op starts (`planner.cost.kernels`): it pays neither the launch floor nor the ramp.
    """
    if flops <= 0 and nbytes <= 0:
        return 0.0
    memory_time = nbytes / (float(profile.memory_bandwidth_Bps.value)
                            * float(profile.memory_efficiency.value))
    if is_matrix_op(op_type) and flops > 0:
        ramp = matmul_ramp_s(profile, dtype) if ramp_s is None else ramp_s
        rate = peak_flops(profile, dtype) * float(profile.matmul_efficiency.value)
        compute_time = flops / rate + ramp * launches
    elif flops > 0 and "fp32" in profile.peak_flops:
        compute_time = flops / float(profile.peak_flops["fp32"].value)
    else:
        compute_time = 0.0
    return max(compute_time, memory_time, float(profile.kernel_launch_s.value) * launches)
