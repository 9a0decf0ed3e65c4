"""Runs of local ops compiled into one call (`executor.module.regions`)."""

from __future__ import annotations

import torch
from torch.fx import symbolic_trace

from executor.module.regions import regions_of


def _program(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.mul(x, 2.0)
    b = torch.add(a, y)
    c = torch.relu(b)
    d = torch.sub(c, a)
    e = torch.tanh(d)
    return e, b


def test_a_region_computes_what_its_nodes_compute_and_hands_on_what_is_read_later() -> None:
    graph = symbolic_trace(_program)
    nodes = [n for n in graph.graph.nodes if n.op != "placeholder"]
    ops = [n for n in nodes if n.op == "call_function"]
    local = {n.name for n in ops}
    found = regions_of(nodes, local)
    assert list(found) == [0] and found[0].nodes == tuple(ops)  # one region: all five ops
    region = found[0]
    assert [n.name for n in region.inputs] == ["x", "y"]
    assert [n.name for n in region.outputs] == ["add", "tanh"]  # read by the output node
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    e, b = _program(x, y)
    got = region.call(x, y)
    assert torch.equal(got[0], b) and torch.equal(got[1], e)


def test_regions_stop_at_cuts_and_at_ops_that_are_not_local() -> None:
    graph = symbolic_trace(_program)
    nodes = [n for n in graph.graph.nodes if n.op != "placeholder"]
    names = [n.name for n in nodes]
    local = set(names) - {"relu"}  # relu runs on DTensors: the interpreter runs it
    found = regions_of(nodes, local, cuts={names.index("tanh")})
    spans = {k: [n.name for n in r.nodes] for k, r in found.items()}
    assert spans == {0: ["mul", "add"]}  # sub alone is too short; tanh starts at a cut
    assert [n.name for n in found[0].outputs] == ["mul", "add"]  # read by sub and relu
