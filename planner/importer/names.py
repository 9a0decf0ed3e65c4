"""The module's own names for weights an exporter renamed.

torch's dynamo exporter optimises by default: it folds `Transpose(q_proj.weight)` into a
new initializer `val_41` and can merge initializers of equal contents, so the plan would
speak of tensors the user's module does not have. It also records what it traced: the
graph's `pkg.torch.export.ExportedProgram.graph_signature` maps each placeholder
(`p_model_layers_0_self_attn_q_proj_weight`) to its parameter
(`model.layers.0.self_attn.q_proj.weight`), and each node's `pkg.torch.onnx.fx_node` names
the placeholders the torch op read. An initializer no parameter is named after, read by
nodes whose torch op read exactly one parameter that no other input of the node carries,
is that parameter — transposed when the op was `aten.linear` (weight [out, in]) and ONNX
multiplies by it ([in, out]).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import onnx

from planner.graph import SourceName

SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"
FX_NODE_KEY = "pkg.torch.onnx.fx_node"
_PLACEHOLDER = re.compile(r"^(\w+): PARAMETER target='([^']+)'", re.MULTILINE)
_TORCH_OP = re.compile(r"target=torch\.ops\.aten\.(\w+)")
_ARGUMENT = re.compile(r"%(\w+)")


@dataclass(frozen=True)
class Recovered:
    names: Mapping[str, SourceName]  # initializer -> the parameter it holds
    merged: Mapping[str, tuple[str, ...]]  # initializer -> the parameters it stands for


def recover_names(model: onnx.ModelProto) -> Recovered:
    """What the exporter's metadata says each renamed initializer is (nothing for files
    without it: TorchScript exports keep their names, or name them `onnx::MatMul_921`)."""
    signature = next((p.value for p in model.graph.metadata_props if p.key == SIGNATURE_KEY),
                     "")
    targets = dict(_PLACEHOLDER.findall(signature))
    if not targets:
        return Recovered({}, {})
    initializers = {init.name for init in model.graph.initializer}
    named = set(targets.values())
    found: dict[str, set[tuple[str, bool]]] = {}
    for node in model.graph.node:
        renamed = [(slot, t) for slot, t in enumerate(node.input)
                   if t in initializers and t not in named]
        if not renamed:
            continue
        fx = next((p.value for p in node.metadata_props if p.key == FX_NODE_KEY), "")
        read = [targets[a] for a in _ARGUMENT.findall(fx) if a in targets]
        unmatched = [t for t in dict.fromkeys(read) if t not in node.input]
        if len(renamed) != 1 or len(unmatched) != 1:
            continue
        (slot, tensor), (parameter,) = renamed[0], unmatched
        if parameter in initializers:  # a second copy of a stored weight: not a rename
            continue
        op = _TORCH_OP.search(fx)
        transposed = (op is not None and op.group(1) == "linear" and node.op_type == "MatMul"
                      and slot == 1)
        found.setdefault(tensor, set()).add((parameter, transposed))
    names: dict[str, SourceName] = {}
    merged: dict[str, tuple[str, ...]] = {}
    for tensor, sources in found.items():
        parameters = sorted({p for p, _ in sources})
        if len(parameters) > 1:
            merged[tensor] = tuple(parameters)
        elif len(sources) == 1:
            (parameter, transposed), = sources
            names[tensor] = SourceName(parameter, transposed)
    return Recovered(names, merged)
