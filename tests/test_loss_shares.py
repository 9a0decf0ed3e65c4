"""Steps' losses kept as each rank's share and summed together after the steps
(`executor.module.run.loss_share`, `reduced_losses`): the values `step_loss` gives one
step at a time, in the steps' order, whatever mix of pending and plain losses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from executor.module.run import LossShare, loss_share, reduced_losses, settled, step_loss
from executor.ranks import run_ranks
from executor.train import free_port


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def _loss(value: float, mesh: DeviceMesh, placements: list) -> DTensor:
    return DTensor.from_local(torch.tensor(value), mesh, placements, run_check=False)


def test_shares_sum_as_each_step_would(mesh: DeviceMesh) -> None:
    """Steps pending over dp, over both dims, and a plain loss, interleaved: the sums
    taken together are each step's own `step_loss`, in order."""
    steps = [[_loss(1.0, mesh, [Partial(), Replicate()]),
              _loss(3.0, mesh, [Partial(), Replicate()])],
             [torch.tensor(5.0)],
             [_loss(2.0, mesh, [Partial(), Partial()])],
             [_loss(4.0, mesh, [Partial(), Replicate()])]]
    shares = [loss_share(values) for values in steps]
    assert [type(s) for s in shares] == [LossShare, torch.Tensor, LossShare, LossShare]
    assert shares[0].reductions != shares[2].reductions  # type: ignore[union-attr]
    one_at_a_time = [float(settled(step_loss(values))) for values in steps]  # type: ignore[arg-type]
    assert reduced_losses(shares) == pytest.approx(one_at_a_time)
    assert one_at_a_time == pytest.approx([2.0, 5.0, 2.0, 4.0])


def _two_ranks(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        shares = [loss_share([_loss(float(step + 10 * rank), mesh, [Partial()])])
                  for step in range(3)]
        Path(out, f"{rank}.json").write_text(json.dumps(reduced_losses(shares)))
    finally:
        dist.destroy_process_group()


def test_two_ranks_get_the_sums_of_their_shares(tmp_path: Path) -> None:
    """On 2 ranks every step's value is the sum of both ranks' shares, on both ranks."""
    run_ranks(_two_ranks, (free_port(), str(tmp_path)), 2, timeout_s=120)
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == [10.0, 12.0, 14.0]
