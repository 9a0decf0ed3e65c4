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

from costmodels.gemm import GemmShape, gemm_seconds, has_shape_terms
from costmodels.profile import HardwareProfile
from costmodels.rates import (
    DTYPE_TO_PEAK,
    MATMUL_RAMP_S,
    PEAK_FALLBACK,
    large_gemm_rate,
    launch_floor_s,
    matmul_ramp_s,
    memory_seconds,
    peak_flops,
)
from planner.ops import is_matrix_op

__all__ = ["DTYPE_TO_PEAK", "MATMUL_RAMP_S", "PEAK_FALLBACK", "matmul_efficiency",
           "matmul_ramp_s", "op_time", "peak_flops"]


def matmul_efficiency(profile: HardwareProfile, flops: float, dtype: str,
                      ramp_s: float | None = None) -> float:
    """Achieved fraction of peak for one GEMM of `flops` FLOPs: E * F / (F + F_half)."""
    if flops <= 0:
        return 0.0
    asymptote = float(profile.matmul_efficiency.value)
    ramp = matmul_ramp_s(profile, dtype) if ramp_s is None else ramp_s
    work_time = flops / large_gemm_rate(profile, dtype)
    return asymptote * work_time / (work_time + ramp)


def op_time(profile: HardwareProfile, op_type: str, flops: float, nbytes: float, dtype: str,
            *, ramp_s: float | None = None, shape: GemmShape | None = None,
            launches: int = 1) -> float:
    """Seconds for one op that does `flops` and moves `nbytes` on one device.

    `ramp_s` overrides the profile's GEMM ramp (calibration and benchmarks use it); the
    planner leaves it None. `shape` (a matrix op's local m, n, k, batch) prices the compute
    term by tiles and waves (`costmodels.gemm.gemm_seconds`); without it, or on a profile
    without `compute_units` and `gemm_tile`, the compute term is F / (P * E) + R.
    `launches` is 0 for the work of an op inside a kernel another op starts
    (`planner.cost.kernels`): it pays no launch floor and no ramp, at the large-GEMM rate.
    """
    if flops <= 0 and nbytes <= 0:
        return 0.0
    memory_time = memory_seconds(profile, nbytes)
    if is_matrix_op(op_type) and flops > 0:
        if shape is not None and launches and has_shape_terms(profile):
            compute_time = gemm_seconds(profile, shape, dtype, ramp_s=ramp_s)
        else:
            ramp = matmul_ramp_s(profile, dtype) if ramp_s is None else ramp_s
            compute_time = flops / large_gemm_rate(profile, dtype) + ramp * launches
    elif flops > 0 and "fp32" in profile.peak_flops:
        compute_time = flops / float(profile.peak_flops["fp32"].value)
    else:
        compute_time = 0.0
    return max(compute_time, memory_time, launch_floor_s(profile) * launches)
