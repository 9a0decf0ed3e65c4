"""In which inputs an op is linear: what a pending partial sum may pass through.

A tensor that is a pending partial sum over some mesh axes (x = x1 + x2 + ..., one
summand per device) can be fed to an op without first being reduced exactly when the op
is linear in it: op(x1) + op(x2) = op(x1 + x2). `Linearity` lists the ways an op is:
each *group* is a set of data inputs that may all be pending sums at once (split into
summands together), the op's other inputs held whole. Add is linear in its inputs jointly
(one group of all of them): a + b = (a1 + b1) + (a2 + b2), but not in one alone (a1 + b
plus a2 + b counts b twice). Mul and MatMul are linear in either operand alone (two
groups of one); Gemm in A or in B, each together with the bias C.

Linearity is over the reals: float arithmetic up to rounding. Integer ops that truncate
(an integer mean) are not linear, whatever the record says about their float form.
`tests/test_op_registry.py` proves every claim with ONNX's reference evaluator, so only
what can be proven there is claimed: an op without a claim (NOT_LINEAR) is treated as not
linear even where it is (FusedMatMul, which the evaluator cannot run). The search does not
use this field yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Linearity:
    """Groups of input indices, each one way the op is linear. For variadic ops the
    groups depend on the node: `every_input` is one group of all its inputs (Sum, Concat),
    `each_input` one group per input alone (Einsum)."""

    groups: tuple[frozenset[int], ...] = ()
    every_input: bool = False
    each_input: bool = False

    @property
    def is_linear(self) -> bool:
        return self.every_input or self.each_input or bool(self.groups)

    def groups_for(self, inputs: tuple[str, ...]) -> list[tuple[int, ...]]:
        """The groups for one node's inputs, omitted ("") and missing inputs left out."""
        present = {i for i, name in enumerate(inputs) if name}
        groups = list(self.groups)
        if self.every_input:
            groups.append(frozenset(present))
        if self.each_input:
            groups += [frozenset({i}) for i in sorted(present)]
        found = []
        for group in groups:
            kept = tuple(sorted(group & present))
            if kept and kept not in found:
                found.append(kept)
        return found


NOT_LINEAR = Linearity()
#: Linear in all inputs jointly (Add, Sum, Concat, ...).
JOINTLY = Linearity(every_input=True)
#: Linear in any one input alone, the others whole (Einsum).
IN_EACH = Linearity(each_input=True)


def jointly(*inputs: int) -> Linearity:
    """Linear in these inputs split together (Sub's two, Where's two branches)."""
    return Linearity((frozenset(inputs),))


def in_any_one(*inputs: int, with_: tuple[int, ...] = ()) -> Linearity:
    """Linear in any one of `inputs` alone (with the inputs `with_` split alongside it)."""
    return Linearity(tuple(frozenset({i, *with_}) for i in inputs))


#: Linear in the data, input 0 (every other input whole): Neg, Reshape, Transpose, ...
IN_DATA = jointly(0)
