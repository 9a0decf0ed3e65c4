"""What a module run with a plan must show against one process (the module tests')."""

from __future__ import annotations

import pytest

from executor.module.launch import ModuleRunLog, train_module, train_module_reference
from planner.plans.model import Plan


def trains_as_one_process(spec: str, chosen: Plan, *, steps: int, batch_size: int,
                          rel: float = 1e-4) -> ModuleRunLog:
    """`chosen` trains `spec` to one process's losses with exactly the plan's collectives;
    the run, for what else a test asks of it (`unplanned`: the moves the plan does not
    make)."""
    run = train_module(spec, chosen, steps=steps, batch_size=batch_size)
    reference = train_module_reference(spec, steps=steps, batch_size=batch_size)
    assert run.losses == pytest.approx(reference, rel=rel)
    assert run.differences == []
    return run
