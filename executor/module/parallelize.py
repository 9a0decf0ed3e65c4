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
- issues the plan's gradient collectives, bucket by bucket, as soon as every gradient of a
  bucket is accumulated (behind the rest of the backward pass, as DDP does).

The module keeps its identity and its parameters' names: build the optimizer on
`module.parameters()` after the call. What a plan needs that this path does not run yet
(pipeline stages, ZeRO, micro-batches, recompute) is refused with one line naming it; the
ONNX-graph runner (`shardplan run MODEL.onnx`) runs those plans.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from executor.module.layouts import GradientBucket, ModuleLayouts, check_parameters, read_layouts
from executor.module.run import placements, replicated, run_planned, run_unsplit
from executor.module.trace import export_program
from executor.runtime import Counters, MeshComm
from planner.errors import ShardplanError
from planner.kinds import CollectiveKind, Recompute
from planner.plans.model import Plan


@dataclass
class ParallelModule:
    """What `parallelize` attached to the module (`module.shardplan`): the plan, the mesh,
    the layouts read off the plan, and what the run issued."""

    plan: Plan
    mesh: TorchMesh
    layouts: ModuleLayouts
    comm: MeshComm
    #: DTensor results whose layout was not the plan's, and were moved to it: "node:
    #: from -> to" -> times (empty when the run is exactly the plan).
    unplanned: Counter = field(default_factory=Counter)
    seed: int = 0
    forwards: int = 0  # the forward passes run: each draws its own dropout masks

    def loss(self, loss_fn: Callable[..., torch.Tensor], output: Any, *batch: Any
             ) -> torch.Tensor:
        """`loss_fn(output, *batch)` on the parallelized output: the batch's plain tensors
        count as replicated (each rank reads its own rows of them), so the loss is the
        global batch's, as one device computes it. Call `.backward()` on it; its value is
        `float(loss.full_tensor())` (or `float(loss)` when it is a plain tensor)."""
        return loss_fn(output, *pytree.tree_map(lambda v: replicated(v, self.mesh),
                                                list(batch)))

    @property
    def gradient_calls(self) -> Counter:
        """Gradient collectives issued so far, by "kind|axes"."""
        return Counter({f"{k}|{','.join(a)}": n
                        for (k, a, phase), n in self.comm.counters.issued.items()
                        if phase == "gradient" and n})


def state_of(module: nn.Module) -> ParallelModule:
    """What `parallelize` attached to `module`."""
    state = getattr(module, "shardplan", None)
    if not isinstance(state, ParallelModule):
        raise ShardplanError(f"{type(module).__name__} was not made by "
                             "executor.parallelize")
    return state


def refuse_unsupported(plan: Plan) -> None:
    """One error naming every part of `plan` this path does not run yet."""
    reasons = []
    if plan.parallel.pp > 1 or plan.pipeline is not None:
        reasons.append(f"pipeline stages (pp={plan.parallel.pp})")
    if plan.parallel.zero:
        reasons.append(f"ZeRO stage {plan.parallel.zero}")
    if plan.micro_batches > 1:
        reasons.append(f"{plan.micro_batches} micro-batches")
    if plan.parallel.recompute != Recompute.NONE:
        reasons.append(f"recompute={plan.parallel.recompute}")
    if reasons:
        raise ShardplanError(
            f"executor.parallelize does not run {', '.join(reasons)} yet; plan with "
            "--parallel pp=1,zero=0,micro_batches=1,recompute=none, or run the plan on the "
            "ONNX graph (shardplan run MODEL.onnx --plan ...)")


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
                           mesh: TorchMesh) -> dict[str, nn.Parameter]:
    """Each parameter as a DTensor in its plan layout, under every name it has (tied
    weights stay tied); every rank keeps its own shard of the values it already has (no
    broadcast: the ranks built the same module)."""
    placed: dict[str, nn.Parameter] = {}
    for names in parameter_names(module):
        planned = next(n for n in names if n in layouts.parameters)
        param = module.get_parameter(planned)
        where = placements(layouts.parameters[planned], plan.mesh, f"parameter {planned}")
        with torch.no_grad():
            value = distribute_tensor(param.detach().to(mesh.device_type), mesh, where,
                                      src_data_rank=None)
        new = nn.Parameter(value, requires_grad=param.requires_grad)
        for name in names:
            _assign(module, name, new)
            placed[name] = new
    return placed


class _GradientBuckets:
    """The plan's gradient collectives, one call per bucket, issued when the bucket's last
    gradient is accumulated (a post-accumulate-grad hook on each of its parameters)."""

    def __init__(self, state: ParallelModule, params: Mapping[str, nn.Parameter]) -> None:
        self.state, self.params = state, params
        self.ready: dict[int, set[str]] = {}
        for index, bucket in enumerate(state.layouts.gradients):
            if bucket.kind != CollectiveKind.ALL_REDUCE:
                raise ShardplanError(f"gradient {bucket.kind} of {bucket.tensors[0]}: "
                                     "executor.parallelize runs all-reduce buckets only")
            self.ready[index] = set()
            for name in bucket.tensors:
                if name not in params:
                    raise ShardplanError(f"the plan reduces the gradient of {name}, which "
                                         "is not a parameter of the module")
                params[name].register_post_accumulate_grad_hook(
                    self._hook(index, name))

    def _hook(self, index: int, name: str) -> Callable[[torch.Tensor], None]:
        def done(param: torch.Tensor) -> None:
            ready = self.ready[index]
            ready.add(name)
            bucket = self.state.layouts.gradients[index]
            if len(ready) == len(bucket.tensors):
                ready.clear()
                self._reduce(bucket)
        return done

    def _reduce(self, bucket: GradientBucket) -> None:
        grads = []
        for name in bucket.tensors:
            grad = self.params[name].grad
            assert isinstance(grad, DTensor)
            partial = {axis for axis, p in zip(self.state.plan.mesh.axis_names,
                                               grad.placements, strict=True)
                       if isinstance(p, Partial)}
            if not set(bucket.axes) <= partial:
                raise ShardplanError(
                    f"the gradient of {name} is {grad.placements}, not a pending sum over "
                    f"{list(bucket.axes)} as the plan's gradient all-reduce expects")
            grads.append(grad)
        flat = torch.cat([g.to_local().reshape(-1) for g in grads])
        summed = self.state.comm.all_reduce(flat, bucket.axes, "gradient")
        offset = 0
        for name, grad in zip(bucket.tensors, grads, strict=True):
            param = self.params[name]
            assert isinstance(param, DTensor)
            local = grad.to_local()
            piece = summed[offset:offset + local.numel()].view_as(local)
            offset += local.numel()
            done = [p if not (isinstance(p, Partial) and axis in bucket.axes) else q
                    for axis, p, q in zip(self.state.plan.mesh.axis_names, grad.placements,
                                          param.placements, strict=True)]
            param.grad = DTensor.from_local(piece, self.state.mesh, done,
                                            shape=param.shape, stride=param.stride())


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

    def share_parameters(self, params: Mapping[str, nn.Parameter]) -> None:
        """The trace reads the module's own parameters (not copies)."""
        for node in self.graph.graph.nodes:
            if node.op == "get_attr" and node.target in params:
                _assign(self.graph, str(node.target), params[str(node.target)])


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
                seed: int = 0) -> nn.Module:
    """`module`, trained from now on as `plan` says (module docstring). `example` is one
    global batch as the keyword inputs of `module`'s forward; `seed` the dropout draws'
    (the same on every rank, and in `unsplit`)."""
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
    traced = {n.name for n in graph.graph.nodes if n.op == "call_function"}
    values = {n.name for n in graph.graph.nodes}
    layouts = read_layouts(plan, traced, values)
    missing = [n for n in user_inputs if n not in layouts.inputs]
    if missing:
        raise ShardplanError(f"the plan has no input named {', '.join(missing)}: it was "
                             "made from another export of the module")
    mesh = init_device_mesh(_device_type(), plan.mesh.shape,
                            mesh_dim_names=plan.mesh.axis_names)
    params = _distribute_parameters(module, layouts, plan, mesh)
    trace.share_parameters(params)
    state = ParallelModule(plan, mesh, layouts,
                           MeshComm(plan.mesh, dist.get_rank(), Counters()), seed=seed)
    _GradientBuckets(state, params)
    where = {name: placements(layouts.inputs[name], plan.mesh, f"input {name}")
             for name in user_inputs}

    def forward(self: nn.Module, *args: Any, **kwargs: torch.Tensor) -> Any:
        given = trace.inputs(args, kwargs)
        rows = {int(v.shape[0]) for v in given if v.dim() > 0}
        if plan.model.batch is not None and rows != {plan.model.batch}:
            raise ShardplanError(f"a batch of {sorted(rows)} rows: the plan is for a global "
                                 f"batch of {plan.model.batch}")
        flat = []
        for name, value in zip(user_inputs, given, strict=True):
            flat.append(distribute_tensor(value.to(mesh.device_type), mesh, where[name],
                                          src_data_rank=None))
        state.forwards += 1
        with implicit_replication():
            outputs = run_planned(graph, layouts, plan.mesh, mesh, flat, state.unplanned,
                                  state.seed, state.forwards)
        return trace.outputs(outputs)

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    module.shardplan = state  # type: ignore[assignment]
    return module
