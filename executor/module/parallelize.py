"""`parallelize(module, plan, example)`: the user's module, ready to train with the plan.

Inside an initialised process group (torchrun, or `executor.train`'s launcher) every rank
calls it with the same module (same initial weights, e.g. one seed) and one global batch
as the example. It then

- builds a DeviceMesh with the plan's axes (`init_device_mesh`, rank order as the plan's
  mesh: row-major);
- checks that the module's parameters and the plan's are the same names;
- makes each parameter a DTensor placed as the plan's layout says (`Shard(d)` per mesh axis
  that splits dim d, `Replicate()` elsewhere), each rank keeping only its shard;
- replaces `module.forward` by a run of the module's traced graph (`executor.module.run`)
  that takes the global batch, keeps each rank's shard of it in the plan's input layouts,
  and moves every op's inputs to the plan's layouts;
- issues the plan's weight collectives bucket by bucket (`executor.module.weights`): the
  gradient all-reduce as soon as a bucket's gradients are accumulated (behind the rest of
  the backward pass, as DDP does), or ZeRO 1-3's reduce-scatters and all-gathers, the
  module's parameters then being each rank's chunks of the weights;
- runs the plan's recompute segments under activation checkpointing.

The module keeps its identity and its parameters' names: build the optimizer on
`module.parameters()` after the call. `module.shardplan.train_step(loss_fn, batch)` runs
one step's forward and backward passes over the plan's micro-batches; with one
micro-batch, `loss_fn(module(**batch), batch).backward()` (through `module.shardplan.loss`)
is the same. Pipeline stages are refused with one line; the ONNX-graph runner
(`shardplan run MODEL.onnx`) runs those plans.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx import GraphModule
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils import _pytree as pytree

from executor.module.layouts import ModuleLayouts, check_parameters, read_layouts
from executor.module.run import (
    ModulePlan,
    RunRecord,
    placements,
    replicated,
    run_planned,
    run_unsplit,
)
from executor.module.trace import export_program
from executor.module.weights import WeightSync
from executor.runtime import Counters, MeshComm
from planner.errors import ShardplanError
from planner.plans.model import Plan

Phases = Callable[[str], AbstractContextManager[Any]]


@dataclass
class ParallelModule:
    """What `parallelize` attached to the module (`module.shardplan`): the plan, the mesh,
    the plan as the trace reads it, and what the run issued."""

    plan: Plan
    mesh: TorchMesh
    run: ModulePlan
    comm: MeshComm
    trace: _Trace
    inputs: Mapping[str, tuple[Any, ...]]  # input name -> its placements
    record: RunRecord = field(default_factory=RunRecord)
    seed: int = 0
    draws: int = 0  # forwards and training steps run: each draws its own dropout masks
    hook: Any = None  # ZeRO 1/2: the optimizer-step hook that rebuilds the whole weights

    @property
    def layouts(self) -> ModuleLayouts:
        return self.run.layouts

    @property
    def weights(self) -> WeightSync:
        return self.run.weights

    def loss(self, loss_fn: Callable[..., torch.Tensor], output: Any, *batch: Any
             ) -> torch.Tensor:
        """`loss_fn(output, *batch)` on the parallelized output: the batch's plain tensors
        count as replicated (each rank reads its own rows of them), so the loss is the
        global batch's, as one device computes it. Call `.backward()` on it; its value is
        `float(loss.full_tensor())` (or `float(loss)` when it is a plain tensor)."""
        return loss_fn(output, *pytree.tree_map(lambda v: replicated(v, self.mesh),
                                                list(batch)))

    def forward(self, given: Sequence[torch.Tensor], micro: int = 0,
                step: int | None = None) -> Any:
        """The traced graph on one batch (or micro-batch `micro` of training step
        `step`), each input split as the plan's input layout says."""
        rows = {int(v.shape[0]) for v in given if v.dim() > 0}
        wanted = self.plan.model.batch if step is not None else self.plan.global_batch
        if wanted is not None and rows != {wanted}:
            whole = f"a global batch of {self.plan.global_batch}"
            raise ShardplanError(
                f"a batch of {sorted(rows)} rows: the plan is for {whole}"
                + (f", {self.plan.micro_batches} micro-batches of {wanted}"
                   if step is not None and self.plan.micro_batches > 1 else ""))
        flat = [distribute_tensor(value.to(self.mesh.device_type), self.mesh,
                                  self.inputs[name], src_data_rank=None)
                for name, value in zip(self.trace.user_inputs, given, strict=True)]
        if step is None:
            self.draws += 1
            step = self.draws
        with implicit_replication():
            outputs = run_planned(self.trace.graph, self.run, self.mesh, flat,
                                  self.record, self.seed, step, micro)
        return self.trace.outputs(outputs)

    def train_step(self, loss_fn: Callable[..., torch.Tensor],
                   batch: Mapping[str, torch.Tensor], phases: Phases | None = None
                   ) -> torch.Tensor:
        """One training step's forward and backward passes on the global `batch`: the
        plan's micro-batches in turn (rows split evenly along dim 0), each loss divided by
        their number so the gradients are the whole batch's (`loss_fn` averages over its
        rows, as gradient accumulation assumes), the plan's weight collectives issued as
        the plan says. Returns the step's loss (detached); call `optimizer.step()` next.
        `phases(name)`, when given, is entered around each "forward", "loss" and
        "backward" part (to count collectives by phase)."""
        count = self.plan.micro_batches
        given = self.trace.inputs((), batch)
        for name, value in zip(self.trace.user_inputs, given, strict=True):
            if value.dim() == 0 or value.shape[0] % count:
                raise ShardplanError(f"input {name}: {tuple(value.shape)} does not split "
                                     f"into {count} micro-batches along dim 0")
        part = phases or (lambda _: contextlib.nullcontext())
        self.draws += 1
        total: torch.Tensor | None = None
        for micro in range(count):
            rows = [v.chunk(count)[micro] for v in given]
            micro_batch = dict(zip(self.trace.user_inputs, rows, strict=True))
            self.weights.micro_batch_last = micro == count - 1
            try:
                with part("forward"):
                    output = self.forward(rows, micro, self.draws)
                with part("loss"):
                    loss = self.loss(loss_fn, output, micro_batch)
                with part("backward"):
                    (loss / count).backward()
            finally:
                self.weights.micro_batch_last = True
            value = loss.detach()
            value = value.full_tensor() if isinstance(value, DTensor) else value
            total = value if total is None else total + value
        assert total is not None
        return total / count

    @property
    def weight_calls(self) -> Counter:
        """Weight collectives issued so far (gradient sums, ZeRO's gathers and scatters),
        by "kind|axes|phase"."""
        return Counter({f"{k}|{','.join(a)}|{phase}": n
                        for (k, a, phase), n in self.comm.counters.issued.items() if n})


def state_of(module: nn.Module) -> ParallelModule:
    """What `parallelize` attached to `module`."""
    state = getattr(module, "shardplan", None)
    if not isinstance(state, ParallelModule):
        raise ShardplanError(f"{type(module).__name__} was not made by "
                             "executor.parallelize")
    return state


def refuse_unsupported(plan: Plan) -> None:
    """One error naming what of `plan` this path does not run yet: pipeline stages."""
    stages = len(plan.pipeline.stages) if plan.pipeline is not None else 1
    if plan.parallel.pp > 1 or stages > 1:
        raise ShardplanError(
            f"executor.parallelize does not run pipeline stages (pp={plan.parallel.pp}) "
            "yet; plan with --parallel pp=1, or run the plan on the ONNX graph (shardplan "
            "run MODEL.onnx --plan ...)")


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _assign(root: nn.Module, dotted: str, value: nn.Parameter) -> None:
    owner, _, leaf = dotted.rpartition(".")
    target = root.get_submodule(owner) if owner else root
    target.register_parameter(leaf, value)


def parameter_names(module: nn.Module) -> list[tuple[str, ...]]:
    """Every parameter's names, in module order: a tied weight (GPT-2's embedding and
    head) is one parameter with several names, and an export names it by one of them."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(n) for n in names.values()]


def _distribute_parameters(module: nn.Module, layouts: ModuleLayouts, plan: Plan,
                           mesh: TorchMesh) -> tuple[dict[str, nn.Parameter],
                                                     dict[str, tuple[str, ...]]]:
    """Each parameter as a DTensor in its plan layout, by its plan name, and every name it
    has in the module (a tied weight has several); every rank keeps its own shard of the
    values it already has (no broadcast: the ranks built the same module)."""
    placed: dict[str, nn.Parameter] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    for names in parameter_names(module):
        planned = next(n for n in names if n in layouts.parameters)
        param = module.get_parameter(planned)
        where = placements(layouts.parameters[planned], plan.mesh, f"parameter {planned}")
        with torch.no_grad():
            value = distribute_tensor(param.detach().to(mesh.device_type), mesh, where,
                                      src_data_rank=None)
        placed[planned] = nn.Parameter(value, requires_grad=param.requires_grad)
        aliases[planned] = names
    return placed, aliases


@dataclass
class _Trace:
    """The module's trace and how its forward is called: inputs by keyword, in order."""

    graph: GraphModule
    user_inputs: list[str]
    out_spec: Any

    @classmethod
    def of(cls, module: nn.Module, example: Mapping[str, torch.Tensor]) -> _Trace:
        program = export_program(module, example).exported_program
        assert program is not None  # export_program checked it
        return cls(program.module(), list(program.graph_signature.user_inputs),
                   program.call_spec.out_spec)

    def inputs(self, args: tuple, kwargs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        if args:
            raise ShardplanError("a traced module takes its inputs by keyword "
                                 f"({', '.join(self.user_inputs)})")
        absent = [n for n in self.user_inputs if n not in kwargs]
        if absent:
            raise ShardplanError(f"missing input {', '.join(absent)}")
        return [kwargs[n] for n in self.user_inputs]

    def outputs(self, flat: Any) -> Any:
        leaves = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        return pytree.tree_unflatten(leaves, self.out_spec) if self.out_spec else flat

    def share_parameters(self, params: Mapping[str, torch.Tensor]) -> None:
        """The trace holds the given tensors (the module's own parameters, or the whole
        copies ZeRO keeps) in place of the copies the export made."""
        for node in self.graph.graph.nodes:
            if node.op != "get_attr" or node.target not in params:
                continue
            value = params[str(node.target)]
            if isinstance(value, nn.Parameter):
                _assign(self.graph, str(node.target), value)
                continue
            owner, _, leaf = str(node.target).rpartition(".")
            holder = self.graph.get_submodule(owner) if owner else self.graph
            holder._parameters.pop(leaf, None)
            setattr(holder, leaf, value)


def unsplit(module: nn.Module, example: Mapping[str, torch.Tensor], seed: int = 0
            ) -> nn.Module:
    """`module` running its trace on one device, dropout drawn as a split run draws it:
    the reference a parallelized run must equal (plain torch draws other masks)."""
    trace = _Trace.of(module, example)
    trace.share_parameters(dict(module.named_parameters(remove_duplicate=False)))
    steps = [0]

    def forward(self: nn.Module, *args: Any, **kwargs: torch.Tensor) -> Any:
        steps[0] += 1
        return trace.outputs(run_unsplit(trace.graph, trace.inputs(args, kwargs), seed,
                                         steps[0]))

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    return module


def parallelize(module: nn.Module, plan: Plan, example: Mapping[str, torch.Tensor],
                seed: int = 0, local: bool = True) -> nn.Module:
    """`module`, trained from now on as `plan` says (module docstring). `example` is one
    global batch as the keyword inputs of `module`'s forward; `seed` the dropout draws'
    (the same on every rank, and in `unsplit`). `local=False` runs every op on DTensors,
    also those the plan leaves as data parallelism would (`executor.module.local`)."""
    if not dist.is_initialized():
        raise ShardplanError("executor.parallelize needs an initialised process group "
                             "(torchrun, or torch.distributed.init_process_group)")
    if dist.get_world_size() != plan.mesh.size:
        raise ShardplanError(f"the plan is for {plan.mesh.size} devices; this process "
                             f"group has {dist.get_world_size()}")
    refuse_unsupported(plan)
    check_parameters(plan, parameter_names(module))
    trace = _Trace.of(module, example)
    graph, user_inputs = trace.graph, trace.user_inputs
    traced = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    values = {n.name for n in graph.graph.nodes}
    layouts = read_layouts(plan, traced, values)
    missing = [n for n in user_inputs if n not in layouts.inputs]
    if missing:
        raise ShardplanError(f"the plan has no input named {', '.join(missing)}: it was "
                             "made from another export of the module")
    mesh = init_device_mesh(_device_type(), plan.mesh.shape,
                            mesh_dim_names=plan.mesh.axis_names)
    placed, aliases = _distribute_parameters(module, layouts, plan, mesh)
    comm = MeshComm(plan.mesh, dist.get_rank(), Counters())
    weights = WeightSync(plan.parallel.zero, layouts.weights, comm, placed)
    reads = {alias: name for name, names in aliases.items() for alias in names}
    for name, param in weights.parameters().items():
        for alias in aliases[name]:
            _assign(module, alias, param)
    # the trace holds the whole copies (ZeRO 3: without storage), not the module's own
    trace.share_parameters({alias: weights.whole[name] for alias, name in reads.items()})
    state = ParallelModule(
        plan, mesh, ModulePlan.of(graph, layouts, plan.mesh, weights, reads, dist.get_rank(),
                      local), comm, trace,
        {name: placements(layouts.inputs[name], plan.mesh, f"input {name}")
         for name in user_inputs}, seed=seed)
    if plan.parallel.zero in (1, 2):
        state.hook = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: weights.after_optimizer_step()
            if weights.updates(optimizer) else None)

    def forward(self: nn.Module, *args: Any, **kwargs: torch.Tensor) -> Any:
        return state.forward(trace.inputs(args, kwargs))

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    module.shardplan = state  # type: ignore[assignment]
    return module
