"""Apply a plan to the user's own `nn.Module` with torch's distributed tensors.

`parallelize(module, plan, example)` traces the module the way the default ONNX exporter
does (`trace`), reads the plan's layouts onto the traced graph's nodes (`layouts`), makes
every parameter a DTensor on a DeviceMesh with the plan's axes, and replaces the module's
forward by a run of the traced graph that moves each op's inputs to the layouts the plan
gives them (`run`), so DTensor's own propagation cannot choose other collectives than the
plan priced. The plan's weight collectives (gradient sums, ZeRO 1-3) are issued bucket by
bucket (`weights`), and `ParallelModule.train_step` runs the plan's micro-batches.
`LocalSGD` and `LocalAdamW` are torch's SGD and AdamW updating each rank's blocks of the
DTensor parameters without DTensor's dispatch (`localstep`).
"""

from executor.module.localstep import LocalAdamW, LocalSGD
from executor.module.parallelize import ParallelModule, parallelize

__all__ = ["LocalAdamW", "LocalSGD", "ParallelModule", "parallelize"]
