"""Memory traffic of torch's kernels, counted op by op: what the cost model's byte counts
are checked against (tests/test_precision.py, tests/test_backward_traffic.py)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class Traffic(TorchDispatchMode):
    """Bytes each aten op reads (its distinct tensor inputs, but the tensor `copy_`
    overwrites) and writes (its outputs, and the arguments its schema lets it write whose
    values it changed: a fused optimizer's update), over tensors of at least `least`
    elements (a step counter is not memory traffic)."""

    def __init__(self, least: int) -> None:
        super().__init__()
        self.least, self.bytes = least, 0

    def _large(self, value: object) -> list[torch.Tensor]:
        return [v for v in pytree.tree_leaves(value)
                if isinstance(v, torch.Tensor) and v.numel() >= self.least]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        writable = [v for a, value in zip(func._schema.arguments, args, strict=False)
                    if a.alias_info is not None and a.alias_info.is_write
                    for v in self._large(value)]
        before = [v.clone() for v in writable]
        out = func(*args, **(kwargs or {}))
        read = args[1:] if func is torch.ops.aten.copy_.default else args
        seen = {id(v): v.nbytes for v in self._large((read, kwargs or {}))}
        written = {id(v): v.nbytes for v in self._large(out)}
        written.update({id(v): v.nbytes for v, old in zip(writable, before, strict=True)
                        if not torch.equal(v, old)})
        self.bytes += sum(seen.values()) + sum(written.values())
        return out


class NoViews(Traffic):
    """`Traffic` but for views (`detach`, `expand`): they move no bytes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and not any(
                a.alias_info is not None and a.alias_info.is_write
                for a in func._schema.arguments):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)
