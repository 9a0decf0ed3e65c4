"""The kernels a graph runs as, not its ONNX nodes: fused attention and fused elementwise.

An ONNX export spells an attention core as MatMul → scale → mask → softmax → dropout →
MatMul and a GELU or a norm as a dozen elementwise nodes; what trains is a few kernels.
`kernel_plan` maps each op to its share of the kernel it runs in (FLOPs, HBM bytes, kernel
launches, the backward pass's multiple of the forward) and says which activations
autograd keeps for the backward pass:

- **attention cores** (`attention_cores`) under `AttentionKernel.FLASH` run as one
  kernel: the FLOPs of both GEMMs, HBM traffic of q, k, v and the output only (no s²
  tensor), the softmax statistics (fp32 per row) kept instead of the probabilities, and the
  backward pass recomputing q kᵀ (5 GEMMs to the forward's 2: Dao 2023, FlashAttention-2,
  §3.1). Under `EAGER` every op of the core is a kernel of its own.
- **elementwise regions** under `Fusion.ELEMENTWISE` (and `MEGATRON`, where a norm is a
  kernel of its own): connected elementwise,
  normalisation and reduction ops with no GEMM between them run as one kernel that reads
  its inputs and writes what leaves it once (one launch). Autograd keeps what leaves the
  region and dropout masks; a tensor used only inside it is recomputed from the region's
  inputs in the backward pass (what torch.compile's partitioner and Megatron's fused
  bias-GELU and bias-dropout-add kernels do), so the region keeps those inputs instead.
  A softmax ends its region (Megatron's fused scale-mask-softmax writes the
  probabilities; the attention dropout is its own kernel).

- **backward passes**: a GEMM's is twice its forward (dX and dW); a memory-bound
  kernel's the bytes it moves over those its forward moves (`_memory_bound_backward`).

Saved tensors start from each op's rule in the registry (`planner.ops.saving`).
`KernelPlan.dropped_by_selective` lists the activations selective recompute drops: those
of the attention cores (Korthikanti et al. 2022, §4.2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from costmodels.profile import HardwareProfile
from planner.graph import OpNode, PlanningGraph
from planner.kinds import AttentionKernel, Fusion, GradAccumulation
from planner.ops import record_for, saves_of
from planner.ops.attention import AttentionCore
from planner.ops.saving import (
    SavedTensors,
    Saves,
    backward_kernels,
    buffer_of,
    kept_by,
    saved_tensors,
)
from planner.ops.work import WorkKind
from planner.sharding.analysis import GraphAnalysis

#: Ops an elementwise kernel can absorb besides per-element and per-row work.
_FUSABLE_MOVES = frozenset({"Cast", "CastLike", "Where", "Expand", "Identity"})
_FUSABLE_WORK = frozenset({WorkKind.PER_OUTPUT, WorkKind.PER_INPUT, WorkKind.VIEW})
#: Ops whose output always leaves their kernel: a fused softmax (Megatron-LM's
#: FusedScaleMaskSoftmax, Apex's scaled_masked_softmax) takes the scale and the mask in and
#: writes the probabilities; the attention dropout after it is a kernel of its own.
_ENDS_REGION = frozenset({"Softmax", "LogSoftmax"})

FLASH_BACKWARD_QK = 3.0  # the q kᵀ GEMM's backward: dq, dk and the recomputed scores
BACKWARD_RATIO = 2.0  # an op's backward: the gradients of its inputs and of its weights


@dataclass(frozen=True)
class KernelPolicy:
    attention: AttentionKernel
    fusion: Fusion


def policy_for(profile: HardwareProfile, attention: AttentionKernel | None = None,
               fusion: Fusion | None = None) -> KernelPolicy:
    """The kernels asked for, the profile's (`device.kernels`) where not: eager and
    unfused on a profile that names none."""
    return KernelPolicy(attention or profile.default_attention, fusion or profile.default_fusion)


def accumulation_for(profile: HardwareProfile, fusion: Fusion | None = None,
                     accumulation: GradAccumulation | None = None) -> GradAccumulation:
    """The gradient accumulation asked for; where not, the one of the kernels' stack: a
    stack that fuses kernels (`fusion` elementwise or megatron: Megatron-LM, NeMo,
    Transformer Engine) accumulates in the weight-gradient GEMM, eager torch (`fusion`
    none) with autograd's own add."""
    if accumulation is not None:
        return accumulation
    fused = policy_for(profile, fusion=fusion).fusion.fuses
    return GradAccumulation.FUSED if fused else GradAccumulation.SEPARATE


class OpKernel(NamedTuple):
    """One op's share of the kernel it runs in, for the whole (unsharded) op. A named
    tuple: a large graph's kernel plan makes a few per op, and a frozen dataclass's
    construction took a tenth of it."""

    flops: float
    bytes: float
    launches: int  # 1: it starts a kernel (pays the launch floor and a GEMM's ramp)
    #: backward seconds over forward seconds: a GEMM's and a flash core's (a memory-bound
    #: kernel's backward is `backward_bytes` instead)
    backward_ratio: float
    matrix: bool
    #: of the backward, the weights' gradients' seconds over forward seconds
    #: (`weight_gradient_ratio`); the rest of the backward is the inputs' gradients
    weight_ratio: float = 0.0
    #: whether its GEMM's local shape prices it (`costmodels.gemm`: tiles, waves and an
    #: epilogue writing the m × n output): False for a flash core, whose q kᵀ scores
    #: stay in on-chip tiles, so it is priced by its FLOPs at the GEMM rate and the HBM
    #: bytes of q, k, v and the output (`_flash`)
    shaped: bool = True
    #: a memory-bound kernel's backward, priced as a kernel of its own rather than a
    #: multiple of the forward (`_memory_bound_backward`): the bytes it moves (for the
    #: whole op; None: `backward_ratio` prices it) and the kernels it launches
    backward_bytes: float | None = None
    backward_launches: int = 0

    def with_backward(self, moved: float, launches: int) -> OpKernel:
        """This kernel with its backward priced as a kernel of its own (`moved` bytes,
        `launches` kernels)."""
        return OpKernel(self.flops, self.bytes, self.launches, self.backward_ratio,
                        self.matrix, self.weight_ratio, self.shaped, moved, launches)


@dataclass(frozen=True)
class KernelPlan:
    policy: KernelPolicy
    ops: Mapping[str, OpKernel]
    saved: Mapping[str, float]  # tensor -> multiple of its bytes kept for the backward pass
    cores: tuple[AttentionCore, ...]
    regions: tuple[tuple[str, ...], ...]  # fused elementwise kernels, ops in order

    @cached_property  # asked once per op of every choice priced
    def dropped_by_selective(self) -> frozenset[str]:
        """Saved tensors selective recompute does not keep: the attention cores' own."""
        internal = frozenset().union(*(core.internal for core in self.cores))
        return frozenset(name for name in self.saved if name in internal)

    @cached_property  # asked once per op of every choice priced
    def unmaterialised(self) -> frozenset[str]:
        """Tensors no kernel writes to memory: a flash core's s² scores and probabilities
        (they live in on-chip tiles), so they take no workspace."""
        if self.policy.attention is not AttentionKernel.FLASH:
            return frozenset()
        return frozenset().union(*(core.internal for core in self.cores))

    def written_bytes(self, name: str, nbytes: float) -> float:
        """`nbytes` of tensor `name` as the kernels write it: 0 where none does."""
        return 0.0 if name in self.unmaterialised else nbytes

    @cached_property  # asked once per op of every choice priced
    def core_ops(self) -> frozenset[str]:
        """Ops selective recompute re-runs in the backward pass."""
        return frozenset(op for core in self.cores
                         for op in (core.first, *core.between, core.last))


def kernel_plan(analysis: GraphAnalysis, policy: KernelPolicy) -> KernelPlan:
    """The kernels of `analysis.graph` under `policy`, computed once per graph and policy."""
    key = ("kernels", policy)
    found = analysis.memo.get(key)
    if found is None:
        found = analysis.memo[key] = _kernel_plan(analysis, policy)
    return found


def _kernel_plan(analysis: GraphAnalysis, policy: KernelPolicy) -> KernelPlan:
    graph = analysis.graph
    rules = {node.name: saves_of(node) for node in graph.ops}
    differentiated = analysis.differentiated
    saved = saved_tensors(graph, analysis.needs_grad, rules, differentiated)
    kernels = {node.name: _own_kernel(node, analysis.weight_roots) for node in graph.ops}
    cores = analysis.attention_cores()
    absorbed: set[str] = set()
    for node in graph.ops:
        if node.op_type == "Attention":
            kernels[node.name] = _fused_attention_op(node, graph, saved)
    if policy.attention is AttentionKernel.FLASH:
        for core in cores:
            absorbed |= _flash(core, graph, kernels, saved)
    regions: tuple[tuple[str, ...], ...] = ()
    if policy.fusion.fuses:
        regions = _regions(graph, absorbed, alone_norms=policy.fusion is Fusion.MEGATRON)
    outputs = frozenset(graph.outputs)
    bounds = [_region_bounds(region, graph, outputs) for region in regions]
    for region, bound in zip(regions, bounds, strict=True):
        _fuse(region, bound, graph, kernels, saved, analysis.needs_grad)
    _memory_bound_backward(graph, kernels, rules, analysis.needs_grad, differentiated, regions,
                           bounds, absorbed | {n.name for n in graph.ops
                                               if n.op_type == "Attention"})
    shares = {name: saved.share(name) for name in saved.whole | set(saved.extra)}
    return KernelPlan(policy, kernels, shares, cores, regions)


def _own_kernel(node: OpNode, weights: Mapping[str, frozenset[str]]) -> OpKernel:
    record = record_for(node.op_type, node.domain)
    matrix = record is not None and record.matrix
    launches = 0 if node.is_view else 1
    return OpKernel(node.flops, node.bytes_read + node.bytes_written, launches,
                    BACKWARD_RATIO, matrix, weight_gradient_ratio(node, matrix, weights))


def weight_gradient_ratio(node: OpNode, matrix: bool,
                          weights: Mapping[str, frozenset[str]]) -> float:
    """The weights' gradients' share of an op's backward, in forward passes: what the
    zero-bubble schedules run apart as W (Qi et al. 2023 §2). A matrix op (MatMul, Gemm,
    Conv) with a weight operand (a parameter, or a tensor computed from parameters alone:
    `GraphAnalysis.weight_roots`) computes dW = Xᵀ·dY, a GEMM of its forward's FLOPs, beside
    dX = dY·Wᵀ, another; so each weight among its two matrix operands is one forward, the
    whole backward at most. Any other op has no W: an elementwise op's weight gradient (a
    bias, a norm's scale) is a reduction priced with its input gradient's pass."""
    if not matrix:
        return 0.0
    count = sum(1 for name in node.inputs[:2] if name and name in weights)
    return min(float(count), BACKWARD_RATIO)


# --------------------------------------------------------------------------- backward


def _memory_bound_backward(graph: PlanningGraph, kernels: dict[str, OpKernel],
                           rules: Mapping[str, Saves], needs_grad: Mapping[str, bool],
                           differentiated: frozenset[str],
                           regions: tuple[tuple[str, ...], ...], bounds: list[RegionBounds],
                           fixed: set[str]) -> None:
    """The backward of every kernel that is not a GEMM, as the bytes its backward kernels
    move and the kernels it launches (both are memory-bound). Unfused, each
    op's by its rule (`planner.ops.saving.backward_kernels`: a GELU reads its input and the
    output's gradient and writes the input's, 1.5x its forward; a residual addition hands
    the gradient on, no kernel); a fused region's as one kernel (the gradients of what
    leaves it read, of its inputs written, what it keeps read). Where a tensor's gradient
    comes from several other kernels, autograd adds them up (r 2, w 1 per extra term),
    priced with its producer's backward (a region combines its own use in its kernel);
    a GEMM producer's sum is not priced (its backward is priced by FLOPs). `fixed` ops
    keep theirs (flash cores, opset-23 Attention); `bounds` are the regions'
    (`_region_bounds`); `differentiated` the ops a gradient flows back through."""
    tensors = graph.tensors
    region_of = {op: k for k, region in enumerate(regions) for op in region}
    sums: dict[str, tuple[float, int]] = {}  # op (a region's first) -> a gradient sum's
    # bytes and kernels
    for name, info in tensors.items():
        if info.producer is None or not info.is_float or not needs_grad.get(name, False):
            continue
        senders = {region_of.get(c, c) for c in info.consumers if c in differentiated}
        producer = tensors[buffer_of(graph, name)].producer or info.producer
        senders.discard(region_of.get(producer, producer))  # its own region reads it fused
        if len(senders) > 1 and producer not in fixed and not kernels[producer].matrix:
            payer = regions[region_of[producer]][0] if producer in region_of else producer
            moved, launches = sums.get(payer, (0.0, 0))
            sums[payer] = (moved + 3.0 * (len(senders) - 1) * info.nbytes,
                           launches + len(senders) - 1)
    for node in graph.ops:
        kernel = kernels[node.name]
        if node.name in fixed or node.name in region_of or kernel.matrix or node.is_view:
            continue
        moved, launches = backward_kernels(node, rules[node.name], tensors, needs_grad)
        extra, added = sums.get(node.name, (0.0, 0))
        kernels[node.name] = kernel.with_backward(moved + extra, launches + added)
    for region, bound in zip(regions, bounds, strict=True):
        moved = _region_backward_bytes(region, bound, graph, rules, needs_grad, differentiated)
        extra, added = sums.get(region[0], (0.0, 0))
        ratio = _ratio(moved + extra, sum(kernels[op].bytes for op in region))
        for k, op in enumerate(region):  # each member its share; the first launches
            kernel = kernels[op]
            kernels[op] = kernel.with_backward(
                kernel.bytes * ratio, (int(moved > 0) + added) if k == 0 else 0)


def _hands_on(node: OpNode, slot: int, shape: tuple[int, ...], rules: Mapping[str, Saves],
              leaving: set[str], inside: set[str], graph: PlanningGraph) -> bool:
    """Whether input `slot` of region member `node` gets the gradient of a tensor leaving
    the region unchanged: a gradient view (an addition's term, same shape) whose output
    only leaves (nothing inside reads it)."""
    if not rules[node.name].views_gradient(slot) or not node.outputs:
        return False
    out = node.outputs[0]
    return (out in leaving and graph.tensors[out].shape == shape
            and not any(c in inside for c in graph.tensors[out].consumers))


def _ratio(backward: float, forward: float) -> float:
    return backward / forward if forward > 0 else 0.0


def _region_backward_bytes(region: tuple[str, ...], bound: RegionBounds, graph: PlanningGraph,
                           rules: Mapping[str, Saves], needs_grad: Mapping[str, bool],
                           differentiated: frozenset[str]) -> float:
    """Bytes a fused region's backward kernel moves: the gradients of the float tensors
    leaving it read, of its float inputs written (but an input the region only adds on,
    whose gradient is the output's), and each tensor it keeps read once (a float tensor
    only the region reads is recomputed from the region's inputs, which it keeps instead:
    `_fuse`)."""
    tensors = graph.tensors
    inside, produced, leaving = bound
    if not any(needs_grad.get(t, False) for t in leaving):
        return 0.0
    read = sum(tensors[t].nbytes for t in leaving
               if tensors[t].is_float and needs_grad.get(t, False))
    written = 0.0
    for name in {i for op in region for i in graph.op(op).inputs if i} - produced:
        info = tensors[name]
        if not info.is_float or not needs_grad.get(name, False):
            continue
        uses = [(graph.op(c), slot) for c in info.consumers if c in inside
                for slot, i in enumerate(graph.op(c).inputs) if i == name]
        if all(_hands_on(node, slot, info.shape, rules, leaving, inside, graph)
               for node, slot in uses):
            continue
        written += info.nbytes
    whole: set[str] = set()
    recomputed: list[str] = []
    extra = 0.0
    for op in region:
        for item in kept_by(graph.op(op), rules[op], tensors, needs_grad, op in differentiated):
            if item.extra:
                extra += tensors[item.tensor].nbytes * item.extra
            elif (item.tensor in produced and item.tensor not in leaving
                  and tensors[item.tensor].is_float):
                recomputed.append(item.tensor)
            else:
                whole.add(item.tensor)
    if recomputed:  # one walk back for all of them
        whole |= _region_inputs(recomputed, graph, inside)
    return read + written + extra + sum(tensors[name].nbytes for name in whole)


# --------------------------------------------------------------------------- attention


def _flash(core: AttentionCore, graph: PlanningGraph, kernels: dict[str, OpKernel],
           saved: SavedTensors) -> set[str]:
    """Price `core` as one flash kernel and keep what it keeps; returns the ops it
    absorbs (no elementwise region may take them)."""
    tensors = graph.tensors
    first, last = graph.op(core.first), graph.op(core.last)
    q, k = first.inputs[0], first.inputs[1]
    v = last.inputs[1]
    out = last.outputs[0]
    absorbed = {*core.between}
    if core.output_transpose is not None:
        absorbed.add(core.output_transpose)
        out = graph.op(core.output_transpose).outputs[0]
    rows = tensors[last.outputs[0]].numel / max(tensors[last.outputs[0]].shape[-1], 1)
    statistics = 4.0 * rows  # the fp32 log-sum-exp per query row
    moved = tensors[q].nbytes + tensors[k].nbytes + tensors[v].nbytes + tensors[out].nbytes
    kernels[first.name] = OpKernel(first.flops, moved + statistics, 1, FLASH_BACKWARD_QK, True,
                                   shaped=False)
    kernels[last.name] = OpKernel(last.flops, 0.0, 0, BACKWARD_RATIO, True, shaped=False)
    for op in absorbed:
        kernels[op] = OpKernel(0.0, 0.0, 0, 0.0, False)
    for name in core.internal:  # no s² tensor; dropout replays its random state
        saved.whole.discard(name)
        saved.extra.pop(name, None)
    for name in (q, k, v, out):
        base = buffer_of(graph, name)
        if tensors[base].producer is not None:
            saved.whole.add(base)
    saved.extra[out] = saved.extra.get(out, 0.0) + statistics / tensors[out].nbytes
    return absorbed | {first.name, last.name}


def _fused_attention_op(node: OpNode, graph: PlanningGraph,
                        saved: SavedTensors) -> OpKernel:
    """Opset 23 Attention runs fused whatever the policy: it keeps its softmax
    statistics beside its output, and its backward recomputes the scores."""
    out = node.outputs[0]
    info = graph.tensors[out]
    rows = info.numel / max(info.shape[-1], 1)
    if out in saved.whole:
        saved.extra[out] = saved.extra.get(out, 0.0) + 4.0 * rows / info.nbytes
    return OpKernel(node.flops, node.bytes_read + node.bytes_written, 1,
                    (FLASH_BACKWARD_QK + BACKWARD_RATIO) / 2, True, shaped=False)


# --------------------------------------------------------------------------- elementwise


def _fusable(node: OpNode) -> bool:
    record = record_for(node.op_type, node.domain)
    if record is None or record.matrix:
        return False
    return record.work.kind in _FUSABLE_WORK or node.op_type in _FUSABLE_MOVES


def _regions(graph: PlanningGraph, absorbed: set[str],
             alone_norms: bool = False) -> tuple[tuple[str, ...], ...]:
    """Connected fusable ops at the same kernel depth (the count of unfused kernels on
    the longest path to them): no unfused op can sit between two members, so every
    region can run as one kernel. `alone_norms`: a normalisation (an op keeping per-row
    statistics) is a kernel of its own, as Megatron-LM runs apex's FusedLayerNorm."""
    tensors = graph.tensors
    fusable = {n.name for n in graph.ops if n.name not in absorbed and _fusable(n)
               and not (alone_norms and saves_of(n).row_statistics)}
    depth: dict[str, int] = {}
    parent: dict[str, str] = {}

    def root(op: str) -> str:
        while parent[op] != op:
            parent[op] = parent[parent[op]]
            op = parent[op]
        return op

    for node in graph.ops:
        level = 0
        for name in node.inputs:
            producer = tensors[name].producer if name else None
            if producer is not None:
                joins = producer in fusable and graph.op(producer).op_type not in _ENDS_REGION
                level = max(level, depth[producer] + (0 if joins else 1))
        depth[node.name] = level
        if node.name not in fusable:
            continue
        parent[node.name] = node.name
        for name in node.inputs:
            producer = tensors[name].producer if name else None
            if (producer in fusable and depth[producer] == level
                    and graph.op(producer).op_type not in _ENDS_REGION):
                parent[root(producer)] = root(node.name)
    members: dict[str, list[str]] = {}
    for node in graph.ops:
        if node.name in fusable:
            members.setdefault(root(node.name), []).append(node.name)
    return tuple(tuple(ops) for ops in members.values()
                 if any(not graph.op(op).is_view for op in ops))


class RegionBounds(NamedTuple):
    """A fused region's ops, the tensors they produce, and of those the ones that leave
    it (a graph output, or read by an op outside): found once per region, read by its
    forward (`_fuse`) and its backward (`_region_backward_bytes`)."""

    inside: set[str]
    produced: set[str]
    leaving: set[str]


def _region_bounds(region: tuple[str, ...], graph: PlanningGraph,
                   outputs: frozenset[str]) -> RegionBounds:
    """`outputs`: the graph's, as a set (made once, not once per region: a graph of
    20,000 outputs has as many regions)."""
    tensors = graph.tensors
    inside = set(region)
    produced = {o for op in region for o in graph.op(op).outputs if o}
    leaving = {t for t in produced
               if t in outputs or any(c not in inside for c in tensors[t].consumers)}
    return RegionBounds(inside, produced, leaving)


def _fuse(region: tuple[str, ...], bound: RegionBounds, graph: PlanningGraph,
          kernels: dict[str, OpKernel], saved: SavedTensors,
          needs_grad: Mapping[str, bool]) -> None:
    """One kernel for `region`: it reads each outside input once, writes what leaves it
    and the masks and statistics it keeps, and keeps its inputs in place of the float
    tensors only it reads."""
    tensors = graph.tensors
    inside, produced, leaving = bound
    # a mask is written and kept as it is; a float tensor only the region reads is not
    recomputed = [t for t in produced if t in saved.whole and t not in leaving
                  and tensors[t].is_float]
    saved.whole.difference_update(recomputed)
    # one walk back for all of them (one each was quadratic in a region of 100,000 ops)
    for source in _region_inputs(recomputed, graph, inside) if recomputed else ():
        if tensors[source].producer is not None and needs_grad.get(source, False):
            saved.whole.add(buffer_of(graph, source))
    read: set[str] = set()
    first = True
    for op in region:
        node = graph.op(op)
        moved = 0.0
        for name in node.inputs:
            if name and name not in produced and name not in read:
                read.add(name)
                moved += tensors[name].nbytes
        for name in node.outputs:
            if name and not node.is_view:
                written = 1.0 if name in leaving or name in saved.whole else 0.0
                moved += tensors[name].nbytes * (written + saved.extra.get(name, 0.0))
        launches = 0
        if first and not node.is_view:
            launches, first = 1, False
        kernels[op] = OpKernel(node.flops, moved, launches, BACKWARD_RATIO, False)


def _region_inputs(names: str | list[str], graph: PlanningGraph,
                   inside: set[str]) -> set[str]:
    """The tensors from outside the region that `names` are computed from."""
    found: set[str] = set()
    stack = [names] if isinstance(names, str) else list(names)
    seen: set[str] = set()
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        producer = graph.tensors[tensor].producer
        if producer is None or producer not in inside:
            found.add(tensor)
            continue
        stack.extend(i for i in graph.op(producer).inputs if i)
    return found
