"""`LocalSGD` and `LocalAdamW`: torch's own update on each rank's blocks where a gradient
(and state) has its parameter's placements, through DTensor elsewhere; the same numbers
as `torch.optim.SGD` and `torch.optim.AdamW`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from executor.module.launch import plan_fuses_optimizer
from executor.module.localstep import LocalAdamW, LocalSGD
from executor.train import free_port
from planner import api, zoo
from planner.zoo.gpt import GPTConfig


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _parameters(mesh: DeviceMesh, grad_placements: list[list]) -> list[torch.nn.Parameter]:
    """Parameters Replicate, Shard(0) and plain, with gradients placed as given (None:
    a plain parameter with a plain gradient)."""
    generator = torch.Generator().manual_seed(0)
    params = []
    for k, placements in enumerate(grad_placements):
        value = torch.randn(6, 4, generator=generator)
        grad = torch.randn(6, 4, generator=generator)
        if placements is None:
            param = torch.nn.Parameter(value)
            param.grad = grad
        else:
            own = [Shard(0)] if k % 2 else [Replicate()]
            param = torch.nn.Parameter(distribute_tensor(value, mesh, own))
            param.grad = DTensor.from_local(grad, mesh, placements or own, run_check=False)
        params.append(param)
    return params


def _values(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for p in params]


@pytest.mark.parametrize("settings", [{}, {"weight_decay": 0.1}, {"maximize": True},
                                      {"momentum": 0.9}])
@pytest.mark.parametrize("layout", [[[], [], [Partial()]], [None, None]],
                         ids=["dtensors", "plain"])
def test_the_step_is_sgds(mesh: DeviceMesh, settings: dict, layout: list) -> None:
    """Gradients placed as their parameters, a partial sum, or plain tensors: every
    parameter ends where torch's SGD puts it (bitwise), over two steps."""
    ours, theirs = _parameters(mesh, layout), _parameters(mesh, layout)
    mine = LocalSGD(ours, lr=0.1, foreach=True, **settings)
    reference = torch.optim.SGD(theirs, lr=0.1, foreach=True, **settings)
    for _ in range(2):
        mine.step()
        reference.step()
    for a, b in zip(_values(ours), _values(theirs), strict=True):
        assert torch.equal(a, b)
    assert mine.state_dict()["param_groups"] == reference.state_dict()["param_groups"]


class _Seen(TorchDispatchMode):
    """Whether any op ran with a DTensor among its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.dtensor_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_blocks_placed_alike_skip_dtensors_dispatch(mesh: DeviceMesh) -> None:
    """Where every gradient has its parameter's placements the update runs on plain
    blocks, no op on a DTensor; a partial gradient still goes through DTensor (which
    reduces it as it would have)."""
    alike = LocalSGD(_parameters(mesh, [[], []]), lr=0.1, foreach=True)
    partial = LocalSGD(_parameters(mesh, [[], [Partial()]]), lr=0.1, foreach=True)
    with _Seen() as seen:
        alike.step()
    assert seen.dtensor_ops == []
    with _Seen() as seen:
        partial.step()
    assert any("_foreach_add_" in op for op in seen.dtensor_ops)


@pytest.mark.parametrize("settings", [{"fused": True}, {"foreach": True},
                                      {"fused": True, "amsgrad": True, "weight_decay": 0.1},
                                      {"foreach": True, "maximize": True}])
@pytest.mark.parametrize("layout", [[[], [], [Partial()]], [None, None]],
                         ids=["dtensors", "plain"])
def test_the_adamw_step_is_adamws(mesh: DeviceMesh, settings: dict, layout: list) -> None:
    """Three steps of AdamW: every parameter and moment ends where torch's AdamW (same
    kernel choice) puts it, bitwise, and the state dicts hold the same keys."""
    ours, theirs = _parameters(mesh, layout), _parameters(mesh, layout)
    mine = LocalAdamW(ours, lr=0.01, **settings)
    reference = torch.optim.AdamW(theirs, lr=0.01, **settings)
    for _ in range(3):
        mine.step()
        reference.step()
    for a, b in zip(_values(ours), _values(theirs), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(ours, theirs, strict=True):
        assert mine.state[p].keys() == reference.state[q].keys()
        for key, value in mine.state[p].items():
            other = reference.state[q][key]
            assert type(value) is type(other)
            assert torch.equal(*(v.full_tensor() if isinstance(v, DTensor) else v
                                 for v in (value, other)))


def test_adamw_blocks_placed_alike_skip_dtensors_dispatch(mesh: DeviceMesh) -> None:
    """After the first step (whose state init is torch's own, on DTensors), an AdamW step
    over parameters placed alike runs no op on a DTensor."""
    optimizer = LocalAdamW(_parameters(mesh, [[], []]), lr=0.01, fused=True)
    optimizer.step()
    with _Seen() as seen:
        optimizer.step()
    assert seen.dtensor_ops == []


def test_the_runner_steps_adamw_in_the_kernels_the_plan_priced(tmp_path: Path) -> None:
    """A plan priced with fused kernels (an A100's default, or `--fusion elementwise`)
    gets the fused AdamW; one priced unfused (the CPU profile names no kernels, or
    `--fusion none`) torch.optim's multi-tensor passes, as `optimizer_seconds` prices."""
    config = GPTConfig(layers=1, hidden=32, heads=2, vocab=64, max_positions=16)
    path = zoo.save(zoo.build("gpt", config), tmp_path / "gpt.onnx")

    def fuses(**options: object) -> bool:
        return plan_fuses_optimizer(api.plan(str(path), batch=2, devices=2, mode="data",
                                             dims={"seq": 16}, **options))  # type: ignore[arg-type]

    assert fuses(profile="a100-80g")
    assert not fuses(profile="cpu")
    assert not fuses(profile="a100-80g", fusion="none")
    assert fuses(profile="cpu", fusion="elementwise")
