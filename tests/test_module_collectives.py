"""What the module runner counts and issues on 2 gloo ranks: collectives a DTensor op
issues inside itself are counted, attention split over heads runs without any, and the
trace's view of its output runs on the blocks, and a split moved between dims is one
all-to-all (DTensor's gloo fallback gathers)."""

from __future__ import annotations

import datetime
import json
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from executor.dropout import DropoutSite
from executor.module import attention
from executor.module.counting import CollectiveCount, group_axes
from executor.module.kernels import attention_math, dropout, run_op
from executor.module.moves import all_to_all_axis, redistribute
from executor.module.run import settled, step_loss
from executor.ranks import run_ranks
from executor.train import free_port

SDPA = torch.ops.aten.scaled_dot_product_attention.default
SLICE = torch.ops.aten.slice.Tensor


def _checks(rank: int, port: int, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    found: dict[str, object] = {}
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        # a step's loss pending a sum over the ranks, 2 micro-batches: reduced once, in
        # flight until settled (after the optimizer step), then nothing left registered
        pending = torch._C._distributed_c10d._get_work_registry_size
        before = pending()
        loss = step_loss([DTensor.from_local(torch.tensor(float(rank + k)), mesh, [Partial()])
                          for k in range(2)])
        found["loss_in_flight"] = pending() - before
        settled(loss)
        found["loss_pending"] = pending() - before
        found["loss"] = float(loss)
        torch.manual_seed(0)
        # slices of a batch-split tensor (the exporter's rotate_half cuts the head dim, and
        # `x[:, ...]` keeps the batch dim whole) run on the blocks in both passes: DTensor's
        # rule for slice_backward gathered the gradient whole
        whole_k = torch.randn(4, 2, 6, 8)
        k = distribute_tensor(whole_k, mesh, [Shard(0)]).requires_grad_()
        counts = Counter()
        with CollectiveCount(counts, group_axes(mesh), "forward"):
            halves = (run_op(SLICE, (k, 3, 0, 4), {}),
                      run_op(SLICE, (k, 3, 4, 2**63 - 1), {}),
                      run_op(SLICE, (k, 0, 0, 2**63 - 1), {}))
            total = (halves[0] * 2 + halves[1] * 3).sum() + (halves[2] ** 2).sum()
            total.backward()
        found["slice_collectives"] = dict(counts)
        found["slice_placements"] = [str(h.placements) for h in halves]
        found["slice_shapes"] = [list(h.shape) for h in halves]
        expected_grad = torch.cat([torch.full((4, 2, 6, 4), 2.0),
                                   torch.full((4, 2, 6, 4), 3.0)], dim=3) + 2 * whole_k
        assert k.grad is not None
        found["slice_grad_error"] = float((k.grad.full_tensor() - expected_grad).abs().max())
        # a head-split matmul with a whole operand: DTensor's rule gathers the split one
        # inside the op, where a dispatch mode that ran the op itself saw nothing
        a = distribute_tensor(torch.randn(2, 4, 8, 8), mesh, [Shard(1)])
        b = distribute_tensor(torch.randn(2, 4, 8, 8), mesh, [Replicate()])
        counts: Counter = Counter()
        reference = CommDebugMode()
        with reference, CollectiveCount(counts, group_axes(mesh), "forward"):
            torch.matmul(a, b)
        found["matmul"] = dict(counts)
        found["matmul_reference"] = reference.get_total_counts()

        # grouped-query attention split over heads (4 query heads, 2 key/value heads),
        # the values whole: on the local blocks, no collective, the whole result's block
        q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
        args = (distribute_tensor(q + 1, mesh, [Shard(1)]),
                distribute_tensor(k + 1, mesh, [Shard(1)]),
                distribute_tensor(v + 1, mesh, [Replicate()]))
        kwargs = {"is_causal": True, "enable_gqa": True}
        split = attention.local_placements(args, kwargs)
        found["split"] = str(split)
        counts = Counter()
        assert split is not None
        with CollectiveCount(counts, group_axes(mesh), "forward"):
            out = attention.run_local(SDPA, args, kwargs, split, DropoutSite(0, 1, 0, ()), 0)
        found["attention_collectives"] = dict(counts)
        whole = F.scaled_dot_product_attention(q + 1, k + 1, v + 1, is_causal=True,
                                               enable_gqa=True)
        found["attention_error"] = float((out.full_tensor() - whole).abs().max())
        found["attention_placements"] = str(out.placements)
        # with attention dropout, each block draws the mask one device draws there, also
        # for the second micro-batch of a step (its rows 2 to 3 of the step's 4)
        site = DropoutSite(7, 3, 11, ())
        drop = {"dropout_p": 0.25, "is_causal": True, "enable_gqa": True}
        step_q, step_k, step_v = (torch.cat([t, t + 1]) for t in (q, k, v))
        expected = attention_math(step_q, step_k, step_v, **drop,
                                  drop=lambda t: dropout(t, 0.25, site)[0])[2:]
        dropped = attention.run_local(SDPA, args, drop, split, site, 1)
        found["dropout_error"] = float((dropped.full_tensor() - expected).abs().max())
        # heads that do not split evenly, a mask, or a split sequence: not local
        odd = (distribute_tensor(torch.randn(2, 3, 8, 16), mesh, [Shard(1)]),) * 3
        found["odd_heads"] = attention.local_placements(odd, {}) is None
        masked = {"attn_mask": torch.ones(8, 8, dtype=torch.bool)}
        found["masked"] = attention.local_placements(args, masked) is None
        rows = tuple(distribute_tensor(t, mesh, [Shard(2)]) for t in (q, q, q))
        found["sequence"] = attention.local_placements(rows, {}) is None

        # the trace views attention's output after a transpose, as the fused kernel's
        # (b, s, h, d) memory order allows; head-split blocks in (b, h, s, d) order (a
        # kernel's that orders them so) need a contiguous copy to be viewed (run_op)
        heads = distribute_tensor(expected, mesh, [Shard(1)]).transpose(1, 2)
        found["view_refused"] = False
        try:
            heads.view(2, 8, 64)
        except RuntimeError:
            found["view_refused"] = True
        viewed = run_op(torch.ops.aten.view.default, (heads, [2, 8, 64]), {})
        found["view_error"] = float((viewed.full_tensor() - expected.transpose(1, 2).reshape(
            2, 8, 64)).abs().max())
        found["view_placements"] = str(viewed.placements)

        # a split moved between tensor dims: one all-to-all each way, counted as one, the
        # values and the gradient those of DTensor's own move
        whole_x = torch.randn(4, 6, 8)
        x = distribute_tensor(whole_x, mesh, [Shard(0)]).requires_grad_()
        counts = Counter()
        with CollectiveCount(counts, group_axes(mesh), "forward"):
            moved = redistribute(x, mesh, [Shard(2)])
        found["moved_kind"] = dict(counts)
        found["moved_error"] = float((moved.full_tensor() - whole_x).abs().max())
        found["moved_local"] = list(moved.to_local().shape)
        weights = distribute_tensor(torch.randn(4, 6, 8), mesh, [Shard(2)])
        counts = Counter()
        with CollectiveCount(counts, group_axes(mesh), "backward"):
            (moved * weights).sum().backward()
        found["moved_backward"] = dict(counts)
        assert x.grad is not None
        found["grad_error"] = float((x.grad.full_tensor() - weights.full_tensor()).abs().max())
        found["grad_placements"] = str(x.grad.placements)
        found["uneven"] = all_to_all_axis(distribute_tensor(torch.randn(4, 3), mesh,
                                                            [Shard(0)]), [Shard(1)]) is None
    finally:
        if rank == 0:
            Path(result_path).write_text(json.dumps(found))
        dist.destroy_process_group()


def test_dtensor_internal_collectives_are_counted_and_head_split_attention_issues_none(
        tmp_path: Path) -> None:
    out = tmp_path / "found.json"
    run_ranks(_checks, (free_port(), str(out)), 2, timeout_s=120)
    found = json.loads(out.read_text())
    assert found["matmul_reference"] > 0
    assert sum(found["matmul"].values()) == found["matmul_reference"]
    assert all(key.endswith("|tp|forward") for key in found["matmul"])
    assert found["split"] == "(Shard(dim=1),)"
    assert found["attention_collectives"] == {}
    assert found["attention_error"] < 1e-5
    assert found["attention_placements"] == "(Shard(dim=1),)"
    assert found["dropout_error"] < 1e-5
    assert found["odd_heads"] and found["masked"] and found["sequence"]
    assert found["view_refused"]  # DTensor alone cannot view the block
    assert found["view_error"] < 1e-5 and found["view_placements"] == "(Shard(dim=2),)"
    assert found["moved_kind"] == {"all_to_all|tp|forward": 1}
    assert found["moved_error"] == 0.0 and found["moved_local"] == [4, 6, 4]
    assert found["moved_backward"] == {"all_to_all|tp|backward": 1}
    assert found["grad_error"] == 0.0 and found["grad_placements"] == "(Shard(dim=0),)"
    assert found["uneven"]  # 3 columns on 2 ranks: DTensor's own move
    assert found["loss"] == 2.0  # the mean of (0 + 1) and (1 + 2)
    assert found["loss_in_flight"] == 1 and found["loss_pending"] == 0
    assert found["slice_collectives"] == {}
    assert found["slice_placements"] == ["(Shard(dim=0),)"] * 3
    assert found["slice_shapes"] == [[4, 2, 6, 4], [4, 2, 6, 4], [4, 2, 6, 8]]
    assert found["slice_grad_error"] < 1e-6
