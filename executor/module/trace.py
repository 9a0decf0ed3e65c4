"""The traced graph a plan of a module is made from, and the module's own export of it.

The dynamo ONNX exporter captures the module with `torch.export`, decomposes it to the ops
ONNX implements and names every ONNX node after the graph node it translates
(`node_<name>`, its output value `<name>`; the helper nodes one translation needs are named
`node_<OpType>_<n>`). One call therefore gives both what the planner reads (the ONNX
model) and what the executor runs (the decomposed `ExportedProgram`), with names that
match by construction; tracing the same module on the same example again gives the same
names, which is how a rank finds the plan's ops in its own trace.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from planner.errors import ShardplanError
from planner.importer.declared import MODULE_BUFFERS_KEY, MODULE_FROZEN_KEY, MODULE_SCALARS_KEY


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter prints progress and warns about optional packages; keep the run's
    output to what the user asked for."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def check_example(example: object) -> None:
    """The builder's batch is a dict of tensors by the forward's argument names."""
    if not isinstance(example, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in example.items()):
        raise ShardplanError(f"the builder's batch is a {type(example).__name__}, not a dict "
                             "of tensors by the forward's argument names; make_batch(step, "
                             "rows) must return one")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: the exporter's summary of the error it wraps: "<class 'RuntimeError'>: Found ..."
_SUMMARY = re.compile(r"^<class '([\w.]+)'>: (.+)$", re.MULTILINE)


def export_failure(exc: BaseException) -> str:
    """Why the export failed, in one line: the exporter wraps torch.export's error in
    paragraphs of next steps ("Failed to export the model with torch.export. This is step
    1/3 ... Next steps:"), its cause in an "Exception summary" below them; and for an
    output torch.export cannot flatten (a transformers model's `DynamicCache`), what to
    return instead."""
    text = _ANSI.sub("", str(exc))
    found = _SUMMARY.search(text)
    if found:
        why = f"{found.group(1).rsplit('.', 1)[-1]}: {found.group(2).strip()}"
    else:
        lines = text.strip().splitlines()
        why = lines[0] if lines else type(exc).__name__
    if "in output, which is not a known type" in why:
        why = why.split(" If this type holds tensors")[0].rstrip(".") + (
            "; return tensors (or tuples, lists and dicts of them) from forward, e.g. "
            "with use_cache=False in a transformers model's config")
    return why


def export_program(module: nn.Module, example: Mapping[str, torch.Tensor]
                   ) -> torch.onnx.ONNXProgram:
    """Export `module` called with keyword inputs `example` (one global batch), in the
    mode it is in (`module.train()` for a training plan), with torch's default exporter.

    `optimize=False` keeps every parameter's name and every op the module runs: the
    exporter's optimiser renames weights (`val_NNN`) and merges equal ones, which would
    leave plan tensors the module does not have. Dim 0 of every input is the symbolic
    `batch`, so the planner can bind the global batch and try micro-batch sizes."""
    check_example(example)
    batch = {"batch": torch.export.Dim("batch", min=1)}
    shapes = {name: ({0: batch["batch"]} if value.dim() > 0 else {})
              for name, value in example.items()}
    sizes = {int(v.shape[0]) for v in example.values() if v.dim() > 0}
    if len(sizes) > 1:
        raise ShardplanError(f"the example's inputs disagree on their batch (dim 0): "
                             f"{sorted(sizes)}")
    if sizes and min(sizes) < 2:
        raise ShardplanError("the example batch must hold at least 2 rows: torch.export "
                             "makes a size-1 dim static")
    try:
        with _quiet(), torch.random.fork_rng():
            program = torch.onnx.export(module, (), kwargs=dict(example), dynamo=True,
                                        optimize=False, external_data=False, verbose=False,
                                        dynamic_shapes=shapes)
    except Exception as exc:  # the exporter raises many types; name the cause in one line
        raise ShardplanError(f"torch.onnx.export of {type(module).__name__} failed: "
                             f"{export_failure(exc)}") from exc
    if program is None or program.exported_program is None:
        raise ShardplanError(f"torch.onnx.export of {type(module).__name__} gave no "
                             "exported program")
    # The module's buffers are initializers like its parameters: name them, so that the
    # planner neither trains nor syncs them (`planner.importer.build`)
    signature = program.exported_program.graph_signature
    buffers = sorted(signature.inputs_to_buffers.values())
    if buffers:
        program.model.metadata_props[MODULE_BUFFERS_KEY] = json.dumps(buffers)
    # and its frozen weights: no gradient is summed for them, no optimizer state kept
    params = dict(module.named_parameters(remove_duplicate=False))
    frozen = sorted(name for name in signature.inputs_to_parameters.values()
                    if name in params and not params[name].requires_grad)
    if frozen:
        program.model.metadata_props[MODULE_FROZEN_KEY] = json.dumps(frozen)
    # and its trained scalars (a temperature, a Linear(n, 1)'s bias), which the planner
    # would take for constants
    scalars = sorted(name for name in signature.inputs_to_parameters.values()
                     if name in params and params[name].requires_grad
                     and params[name].numel() <= 1)
    if scalars:
        program.model.metadata_props[MODULE_SCALARS_KEY] = json.dumps(scalars)
    return program


def save_model(program: torch.onnx.ONNXProgram, path: str | Path) -> Path:
    """Write the ONNX model the planner reads (weights inside the file)."""
    target = Path(path)
    with _quiet():
        program.save(str(target), external_data=False)
    return target


#: A module whose parameters and buffers exceed this is exported on each rank rather than
#: written once for all of them: its saved trace would be as large as its weights (and
#: the ONNX file beside it cannot exceed protobuf's 2 GB).
MAX_SHARED_TRACE_BYTES = 1 << 30


@dataclass(frozen=True)
class SavedTrace:
    """A module's export written once for every process that runs the module: a process
    loads it in about a quarter of the time an export takes (torch 2.13 on CPU, the
    examples' LLaMA: 3 s against 11 s), and a run of n ranks exports once, not n times.
    `program` is `torch.export.save`'s file of the decomposed program the executor runs,
    `model` the ONNX model the planner reads; the names in both are the export's own, so
    a rank that loads them finds the plan's ops as if it had exported itself."""

    program: Path
    model: Path

    @classmethod
    def at(cls, folder: str | Path) -> SavedTrace:
        """The trace a folder holds (or will hold once written)."""
        return cls(Path(folder) / "program.pt2", Path(folder) / "model.onnx")

    @classmethod
    def write(cls, program: torch.onnx.ONNXProgram, folder: str | Path) -> SavedTrace:
        exported = program.exported_program
        assert exported is not None  # export_program checked it
        saved = cls.at(folder)
        with _quiet():
            torch.export.save(exported, str(saved.program))
        save_model(program, saved.model)
        return saved

    def load(self) -> torch.export.ExportedProgram:
        with _quiet():
            return torch.export.load(str(self.program))


def state_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers (each shared tensor once)."""
    seen: dict[int, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def broadcast_in_dim(value: torch.Tensor, shape: Sequence[int],
                     kept: Sequence[int]) -> torch.Tensor:
    """`prims.broadcast_in_dim` in aten ops: `value`'s dims become the dims `kept` of
    `shape`, a dim of 1 inserted at each other, then expanded to `shape`."""
    for dim in range(len(shape)):
        if dim not in kept:
            value = torch.ops.aten.unsqueeze.default(value, dim)
    return torch.ops.aten.expand.default(value, list(shape))


#: prims ops the exporter's decompositions leave in the graph that autograd cannot run
#: ("backwards not supported on prim"), and what computes each in aten ops: (the
#: target, its arguments and keywords from the prim's). `torch.var` and `torch.std` with
#: `keepdim` decompose to `prims.var` and `prims.broadcast_in_dim`.
_Arguments = Callable[[tuple, dict], tuple[tuple, dict]]
_UNDIFFERENTIABLE_PRIMS: dict[object, tuple[object, _Arguments]] = {
    torch.ops.prims.var.default: (
        torch.ops.aten.var.correction,
        lambda args, kwargs: ((args[0], args[1]), {
            "correction": args[2] if len(args) > 2 else kwargs.get("correction", 1)})),
    torch.ops.prims.broadcast_in_dim.default: (
        broadcast_in_dim, lambda args, kwargs: (args, kwargs)),
}


def differentiable(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`graph` with each prim autograd cannot run replaced, in place, by the aten op
    computing it (`_UNDIFFERENTIABLE_PRIMS`), the node keeping its name (the plan's ops
    are found by it); an output dtype other than the input's is left as it is."""
    changed = False
    for node in graph.graph.nodes:
        found = _UNDIFFERENTIABLE_PRIMS.get(node.target) if node.op == "call_function" \
            else None
        if found is None or node.kwargs.get("output_dtype") is not None:
            continue
        target, arguments = found
        node.target = target
        node.args, node.kwargs = arguments(tuple(node.args), dict(node.kwargs))
        changed = True
    if changed:
        graph.recompile()
    return graph
