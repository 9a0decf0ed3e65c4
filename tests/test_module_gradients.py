"""The gradients a parallelized module's parameters hold, through the user's own loop:
what eager torch gives the same module, however the loop clears them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from executor.module.launch import export_builder, load_builder
from executor.module.parallelize import parallelize
from executor.train import free_port
from planner.api import plan

LLAMA = "examples.hf_models:llama"
BATCH = 4


def _gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    found = {}
    for name, param in module.named_parameters():
        grad = param.grad
        assert grad is not None, name
        found[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
    return found


@pytest.mark.parametrize("clearing", ["none", "zeros", "accumulate"])
def test_a_one_device_plan_gives_the_gradients_eager_gives(tmp_path: Path,
                                                            clearing: str) -> None:
    """Two steps of forward, loss and backward, the gradients cleared between them as the
    user's loop does (`zero_grad()`, `zero_grad(set_to_none=False)`, or not at all, so the
    second step's add to the first's): every parameter's gradient equals eager's, and no
    step's gradient leaks into the next (the leaf a local op reads and the parameter share
    their gradient, `WeightSync._bind_gradients`)."""
    chosen = plan(export_builder(LLAMA, BATCH, tmp_path / "llama.onnx"), batch=BATCH,
                  devices=1, profile="cpu", mode="data")
    eager, make_batch, loss_fn = load_builder(LLAMA)()
    eager.train()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        module, _, _ = load_builder(LLAMA)()
        module.train()
        module = parallelize(module, chosen, make_batch(0, BATCH))
        for step in range(3):
            data = make_batch(step, BATCH)
            for model in (eager, module):
                if clearing == "none":
                    model.zero_grad()
                elif clearing == "zeros":
                    model.zero_grad(set_to_none=False)
                loss_fn(model(**data), data).backward()
            ours, theirs = _gradients(module), _gradients(eager)
            assert ours.keys() == theirs.keys()
            for name, grad in theirs.items():
                torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, s=step: f"{n}, step {s}: {m}")
    finally:
        dist.destroy_process_group()
