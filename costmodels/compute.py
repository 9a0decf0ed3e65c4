"""Compute time of one op on one device: a roofline with a per-kernel floor.

time = max(FLOPs / (peak[dtype] * efficiency), bytes / (memory bandwidth * efficiency),
           kernel launch latency). Matrix ops run at the profile's matmul efficiency; all
other ops are memory bound in practice and use only the bandwidth term.
"""

from __future__ import annotations

from costmodels.profile import HardwareProfile

#: Ops whose FLOPs run on the matrix units (tensor cores, cube units).
MATRIX_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul"})

#: Map a tensor element type to the profile's peak-FLOP/s key.
DTYPE_TO_PEAK = {"float32": "fp32", "float64": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def op_time(
    profile: HardwareProfile, op_type: str, flops: float, nbytes: float, dtype: str
) -> float:
    """Seconds for one op that does `flops` and moves `nbytes` on one device."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    bandwidth = profile.memory_bandwidth_Bps.value * profile.memory_efficiency.value
    memory_time = nbytes / bandwidth
    if op_type in MATRIX_OPS:
        peak = profile.peak(DTYPE_TO_PEAK.get(dtype, "fp32"))
        compute_time = flops / (peak * profile.matmul_efficiency.value)
    else:
        compute_time = 0.0  # vector units keep pace with memory for elementwise work
    return max(compute_time, memory_time, float(profile.kernel_launch_s.value))
