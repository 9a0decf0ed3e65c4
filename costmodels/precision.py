"""What each training precision stores and computes in: bytes per parameter by category,
the dtype activations are kept in, and the peak the GEMMs run at.

| precision | activations | GEMMs at | weights | gradients | fp32 master | moments | Adam B/param |
| --- | --- | --- | --- | --- | --- | --- | --- |
| fp32 | fp32 | fp32 peak (CUDA cores on NVIDIA) | 4 | 4 | 0 | 4 | 16 |
| tf32 | fp32 | tf32 peak (tensor cores) | 4 | 4 | 0 | 4 | 16 |
| bf16, fp16 | 16-bit | 16-bit peak | 2 | 2 | 0 | 2 | 8 |
| bf16-mixed | 16-bit | 16-bit peak | 2 | 4 | 4 | 4 | 18 |
| fp16-mixed | 16-bit | 16-bit peak | 2 | 2 (+ 4 fp32 at the step) | 4 | 4 | 20 |
| fp8 | bf16 | fp8 peak | 2 | 4 | 4 | 4 | 18 |

Sources. Pure 16-bit (`model.to(torch.bfloat16)` with torch.optim.AdamW): the moments are
`torch.zeros_like(param)`, in the parameter's dtype, and there is no master copy.
`-mixed` follows Megatron-LM: 16-bit weights for compute, fp32 main parameters and fp32
Adam moments, and the optimizer reads fp32 main gradients. Under bf16 the gradients are
accumulated and all-reduced in fp32 (`accumulate_allreduce_grads_in_fp32`, which
Megatron-LM sets for bf16): "bf16 param, fp32 grads: 18 bytes per parameter". Under fp16
they are not (the flag is off by default): the 16-bit gradients are accumulated and
all-reduced as they are, and cast into fp32 main gradients at the optimizer step
(`_copy_model_grads_to_main_grads`, `main_param.grad = model_param.main_grad.float()`):
"fp16 param, fp16 grads: 20 bytes per parameter" (Megatron-LM,
docs/source/distrib_optimizer.md, the table of theoretical bytes per parameter; fp32
params and grads: 16; megatron/arguments.py and megatron/optimizer/optimizer.py at
de7dc40, the commit of the SC'21 runs, and still the default of `grad_reduce_in_fp32`).
The main gradients live from the step to the next step's `zero_grad`, while no
activations are held (`costmodels.memory`). fp8 follows Transformer Engine's recipe
inside Megatron: GEMM inputs are cast to fp8 per kernel (transient), everything else is
bf16-mixed.

A precision not given is the graph's own: an fp32 graph trains in fp32, a 16-bit graph in
its `-mixed` form (what frameworks do when training a 16-bit model: fp32 master weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.kinds import Precision


@dataclass(frozen=True)
class PrecisionPolicy:
    """One precision's storage and compute."""

    precision: Precision
    storage_dtype: str  # float activations and compute weights
    matmul_dtype: str  # the dtype whose peak the GEMMs run at (`costmodels.compute`)
    weight_bytes: int  # per parameter, the copy the kernels read
    gradient_bytes: int
    master_bytes: int  # fp32 copy the optimizer updates (0: it updates the weights)
    moment_bytes: int  # per optimizer moment
    main_gradient_bytes: int = 0  # the gradient the optimizer reads (0: the kept one)

    @property
    def mixed(self) -> bool:
        return self.master_bytes > 0

    @property
    def step_gradient_bytes(self) -> int:
        """Bytes of the gradient element the optimizer step reads: the fp32 main
        gradient the kept 16-bit one is cast into, or the kept one itself."""
        return self.main_gradient_bytes or self.gradient_bytes

    @property
    def cast_at_step(self) -> bool:
        """Whether the step casts the kept gradients into main gradients of their own."""
        return self.step_gradient_bytes != self.gradient_bytes


_POLICIES = {
    Precision.FP32: PrecisionPolicy(Precision.FP32, "float32", "float32", 4, 4, 0, 4),
    Precision.TF32: PrecisionPolicy(Precision.TF32, "float32", "tfloat32", 4, 4, 0, 4),
    Precision.BF16: PrecisionPolicy(Precision.BF16, "bfloat16", "bfloat16", 2, 2, 0, 2),
    Precision.FP16: PrecisionPolicy(Precision.FP16, "float16", "float16", 2, 2, 0, 2),
    Precision.BF16_MIXED: PrecisionPolicy(Precision.BF16_MIXED, "bfloat16", "bfloat16",
                                          2, 4, 4, 4),
    Precision.FP16_MIXED: PrecisionPolicy(Precision.FP16_MIXED, "float16", "float16",
                                          2, 2, 4, 4, main_gradient_bytes=4),
    Precision.FP8: PrecisionPolicy(Precision.FP8, "bfloat16", "float8e4m3fn", 2, 4, 4, 4),
}

#: Moments each optimizer keeps per parameter.
OPTIMIZER_MOMENTS = {"adam": 2, "adamw": 2, "momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class OptimizerTraffic:
    """Memory accesses of one optimizer update, per element of the copy it updates, per
    element of the gradient, and per byte of its state. Fused (one kernel, as apex/
    Megatron's FusedAdam or torch's `fused=True`): the updated copy read and written, the
    gradient read, each state byte read and written once. Unfused (torch.optim's default
    single-tensor and `foreach` forms, which run the same elementwise kernels, one after
    another): counted from torch/optim/adam.py `_single_tensor_adam` (the same kernels as
    `_multi_tensor_adam`): `param.mul_(1 - lr·wd)` (AdamW only) r+w p; `exp_avg.lerp_(grad)`
    r m, r g, w m; `exp_avg_sq.mul_(b2).addcmul_(grad, grad)` 2 + 3 on v, g; `denom =
    (exp_avg_sq.sqrt() / c).add_(eps)` three passes through a temporary, 6 state-sized
    accesses; `param.addcdiv_(exp_avg, denom)` r p, r m, r d, w p. Per state byte (two
    moments): (3 + 5 + 6) / 2 = 7; p 2 (Adam) or 4 (AdamW) accesses, g 2. SGD with
    momentum (torch/optim/sgd.py `_single_tensor_sgd`): `buf.mul_(m).add_(g)` then
    `param.add_(buf)`: p r+w, g r, buf 5 accesses."""

    updated_fused: float
    gradient_fused: float
    state_fused: float
    updated_unfused: float
    gradient_unfused: float
    state_unfused: float

    def accesses(self, fused: bool) -> tuple[float, float, float]:
        """(per updated element, per gradient element, per state byte) of one update."""
        if fused:
            return self.updated_fused, self.gradient_fused, self.state_fused
        return self.updated_unfused, self.gradient_unfused, self.state_unfused


OPTIMIZER_TRAFFIC = {
    "adam": OptimizerTraffic(2.0, 1.0, 2.0, 2.0, 2.0, 7.0),
    "adamw": OptimizerTraffic(2.0, 1.0, 2.0, 4.0, 2.0, 7.0),
    "momentum": OptimizerTraffic(2.0, 1.0, 2.0, 2.0, 1.0, 5.0),
    "sgd": OptimizerTraffic(2.0, 1.0, 0.0, 2.0, 1.0, 0.0),
}


def optimizer_step_bytes(chosen: PrecisionPolicy, optimizer: str, fused: bool) -> float:
    """Bytes one parameter element's optimizer step reads and writes under `chosen`: where
    the kept gradient is 16-bit and the optimizer reads fp32, its cast into the main
    gradient (Megatron-LM's `_copy_model_grads_to_main_grads`: r 2, w 4); under fp16, the
    loss scaler's unscale and inf/NaN check of every gradient the optimizer reads (torch's
    `_amp_foreach_non_finite_check_and_unscale_`, as in Megatron-LM's `_unscale_main_
    grads_and_check_for_nan` and torch.amp's GradScaler: r + w); the update
    (`OptimizerTraffic`) of the copy it updates (the fp32 master under `-mixed`) from
    that gradient; under `-mixed`, the 16-bit weights written back from the master
    (Megatron-LM's `_copy_main_params_to_model_params`: r 4, w 2). Gradient-norm
    clipping is not counted: it is a choice of the training script, not of the
    precision, and the executor does not clip."""
    updated, gradient, state = OPTIMIZER_TRAFFIC[optimizer].accesses(fused)
    read = chosen.step_gradient_bytes
    moved = (updated * (chosen.master_bytes or chosen.weight_bytes)
             + gradient * read
             + state * OPTIMIZER_MOMENTS[optimizer] * chosen.moment_bytes)
    if chosen.cast_at_step:
        moved += chosen.gradient_bytes + read
    if chosen.mixed:
        moved += chosen.master_bytes + chosen.weight_bytes
    if chosen.storage_dtype == "float16":
        moved += 2 * read
    return moved


_DEFAULT_FOR_DTYPE = {"float32": Precision.FP32, "float64": Precision.FP32,
                      "bfloat16": Precision.BF16_MIXED, "float16": Precision.FP16_MIXED}


def policy(precision: Precision | str) -> PrecisionPolicy:
    """The policy of a precision name; a one-line ValueError names the choices."""
    try:
        return _POLICIES[Precision(precision)]
    except ValueError:
        raise ValueError(f"unknown precision {precision!r}; choose one of "
                         f"{', '.join(p.value for p in Precision)}") from None


def default_precision(float_dtype: str) -> Precision:
    """The precision a graph of `float_dtype` trains in when none is asked for."""
    return _DEFAULT_FOR_DTYPE.get(float_dtype, Precision.FP32)


def resolve(precision: Precision | None, weight_itemsize: int) -> PrecisionPolicy:
    """`precision`, or the default of weights of `weight_itemsize` bytes (16-bit weights:
    their `-mixed` form; the two 16-bit formats store the same bytes)."""
    if precision is not None:
        return policy(precision)
    return policy(Precision.FP32 if weight_itemsize >= 4 else Precision.BF16_MIXED)


@dataclass(frozen=True)
class ParameterBytes:
    """Bytes one parameter element costs, by memory category."""

    weights: float
    gradients: float
    master: float
    moments: float
    main_gradients: float = 0.0  # fp32 copies made at the step, while no activations live

    @property
    def optimizer(self) -> float:
        """What the optimizer holds: its moments and the fp32 master copy."""
        return self.master + self.moments

    @property
    def total(self) -> float:
        """Bytes at the optimizer step, the main gradients included (Megatron-LM's
        table of theoretical bytes per parameter counts them)."""
        return self.weights + self.gradients + self.optimizer + self.main_gradients


def parameter_bytes(precision: Precision | None, weight_itemsize: int,
                    optimizer: str) -> ParameterBytes:
    """Bytes per parameter element under `precision` (None: the weights' default) and
    `optimizer`."""
    try:
        moments = OPTIMIZER_MOMENTS[optimizer]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of "
                         f"{sorted(OPTIMIZER_MOMENTS)}") from None
    chosen = resolve(precision, weight_itemsize)
    return ParameterBytes(chosen.weight_bytes, chosen.gradient_bytes, chosen.master_bytes,
                          moments * chosen.moment_bytes,
                          chosen.step_gradient_bytes if chosen.cast_at_step else 0)


def accumulation_bytes(chosen: PrecisionPolicy, micro_batches: int) -> float:
    """Bytes per gradient element that one step's gradient accumulation moves where it runs
    as kernels of its own (`GradAccumulation.SEPARATE`): each micro-batch's gradient comes
    out of its GEMM in the compute dtype (`weight_bytes`) and joins the kept gradient
    (`gradient_bytes`). The first is kept as it is where the two dtypes agree (torch
    autograd's `AccumulateGrad` takes the tensor) and cast into the kept gradient where
    they do not (r new, w kept: Megatron-LM's `_copy_model_grads_to_main_grads`, the fp32
    main gradient a 16-bit model's optimizer reads); each later one is added (r kept,
    r new, w kept: `param.grad += new`, or Megatron-LM's `main_grad.add_(grad)` hook,
    `megatron/model/distributed.py`). Fused into the GEMM, none of it is a pass."""
    new, kept = chosen.weight_bytes, chosen.gradient_bytes
    first = 0.0 if new == kept else float(new + kept)
    return first + max(0, micro_batches - 1) * float(new + 2 * kept)
