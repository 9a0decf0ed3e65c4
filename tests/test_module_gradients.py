"""The gradients a parallelized module's parameters hold, through the user's own loop:
what eager torch gives the same module, however the loop clears them."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from executor.module.launch import export_builder, load_builder
from executor.module.parallelize import parallelize
from executor.ranks import run_ranks
from executor.train import free_port
from planner.api import plan
from planner.plans.model import Plan

LLAMA = "examples.hf_models:llama"
BATCH = 4


@contextmanager
def _one_rank_and_plan(tmp_path: Path) -> Iterator[Plan]:
    """A one-device data-parallel plan of the LLaMA, inside a process group of one rank."""
    chosen = plan(export_builder(LLAMA, BATCH, tmp_path / "llama.onnx"), batch=BATCH,
                  devices=1, profile="cpu", mode="data")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield chosen
    finally:
        dist.destroy_process_group()


def _clear(model: torch.nn.Module, clearing: str) -> None:
    """What the user's loop does to the gradients before a step: "none" clears them
    (`zero_grad()`), "zeros" zeroes them in place, "accumulate" leaves them."""
    if clearing == "none":
        model.zero_grad()
    elif clearing == "zeros":
        model.zero_grad(set_to_none=False)


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
    eager, make_batch, loss_fn = load_builder(LLAMA)()
    eager.train()
    with _one_rank_and_plan(tmp_path) as chosen:
        module, _, _ = load_builder(LLAMA)()
        module.train()
        module = parallelize(module, chosen, make_batch(0, BATCH))
        # the token ids only local ops read: given as they are, not made a DTensor
        assert module.shardplan.run.local_inputs == {"input_ids"}
        for step in range(3):
            data = make_batch(step, BATCH)
            for model in (eager, module):
                _clear(model, clearing)
                loss_fn(model(**data), data).backward()
            ours, theirs = _gradients(module), _gradients(eager)
            assert ours.keys() == theirs.keys()
            for name, grad in theirs.items():
                torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, s=step: f"{n}, step {s}: {m}")


def _data_parallel_gradients(rank: int, port: int, plan_file: str, out: str) -> None:
    """Rank `rank` of 2 under a data-parallel plan: for each way of clearing (and each way
    of running the ops), the largest relative difference of any parameter's gradient from
    eager's on the whole batch."""
    from planner.plans.model import Plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        chosen = Plan.load(plan_file)
        found: dict[str, float] = {}
        for clearing, local in itertools.product(("none", "zeros", "accumulate"),
                                                 (True, False)):
            eager, make_batch, loss_fn = load_builder(LLAMA)()
            eager.train()
            module, _, _ = load_builder(LLAMA)()
            module.train()
            # local=False: every op on DTensors, so autograd accumulates on the
            # parameters themselves, not on plain leaves
            module = parallelize(module, chosen, make_batch(0, BATCH), local=local)
            state = module.shardplan
            worst = 0.0
            for step in range(3):
                data = make_batch(step, BATCH)
                for model in (eager, module):
                    _clear(model, clearing)
                loss_fn(eager(**data), data).backward()
                state.loss(loss_fn, module(**data), data).backward()
                ours, theirs = _gradients(module), _gradients(eager)
                worst = max(worst, *(float((ours[n] - g).abs().max() / g.abs().max())
                                     for n, g in theirs.items()))
            found[f"{clearing}, local={local}"] = worst
        if rank == 0:
            Path(out).write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_data_parallel_plan_gives_the_gradients_eager_gives(tmp_path: Path) -> None:
    """The same on 2 ranks of a data-parallel plan (each rank's share summed by the plan's
    all-reduce): a gradient the user does not clear has the next step's sum added to it,
    as eager's and DDP's do, not replaced by it."""
    chosen = plan(export_builder(LLAMA, BATCH, tmp_path / "llama.onnx"), batch=BATCH,
                  devices=2, profile="cpu", mode="data", parallel={"zero": 0})
    plan_file, out = tmp_path / "plan.json", tmp_path / "found.json"
    chosen.save(plan_file)
    run_ranks(_data_parallel_gradients, (free_port(), str(plan_file), str(out)), 2,
              timeout_s=300)
    found = json.loads(out.read_text())
    assert all(worst < 1e-4 for worst in found.values()), found


def test_a_parallelized_module_is_not_kept_alive_by_its_optimizer_hook(
        tmp_path: Path) -> None:
    """The optimizer-step hook `parallelize` registers (torch's are global) holds the
    module weakly: once the module is gone it can be collected, an optimizer step
    anywhere passes its hook by, and the next `parallelize` removes it."""
    import gc
    import weakref

    from torch.optim.optimizer import _global_optimizer_post_hooks

    with _one_rank_and_plan(tmp_path) as chosen:
        gc.collect()  # (modules of earlier tests in this process: gone, their hooks
        # removed by the next parallelize)
        module, make_batch, _ = load_builder(LLAMA)()
        module = parallelize(module, chosen, make_batch(0, BATCH))
        after_one = len(_global_optimizer_post_hooks)
        state = weakref.ref(module.shardplan)
        del module
        gc.collect()
        assert state() is None
        other = torch.nn.Parameter(torch.ones(2))
        other.grad = torch.ones(2)
        torch.optim.SGD([other], lr=0.1).step()
        module, _, _ = load_builder(LLAMA)()
        module = parallelize(module, chosen, make_batch(0, BATCH))
        assert len(_global_optimizer_post_hooks) == after_one  # the first one's removed


def test_a_cleared_gradients_wrapper_is_refilled_only_where_no_one_holds_it(
        tmp_path: Path) -> None:
    """After `zero_grad()` the next backward pass puts a parameter's new gradient in the
    DTensor its last one was in, where nothing else holds that; a gradient the user kept
    keeps its values, and its parameter gets a DTensor of its own."""
    import weakref

    with _one_rank_and_plan(tmp_path) as chosen:
        module, make_batch, loss_fn = load_builder(LLAMA)()
        module.train()
        module = parallelize(module, chosen, make_batch(0, BATCH))
        names = [name for name, _ in module.named_parameters()]
        kept_name = names[0]
        loss_fn(module(**make_batch(0, BATCH)), make_batch(0, BATCH)).backward()
        params = dict(module.named_parameters())
        last = {name: weakref.ref(params[name].grad) for name in names}
        kept = params[kept_name].grad
        snapshot = kept.full_tensor().clone()
        module.zero_grad()
        assert all(param.grad is None for param in params.values())
        data = make_batch(1, BATCH)
        loss_fn(module(**data), data).backward()
        refilled = [name for name in names if last[name]() is params[name].grad]
        assert params[kept_name].grad is not kept
        assert torch.equal(kept.full_tensor(), snapshot)
        assert not torch.equal(params[kept_name].grad.full_tensor(), snapshot)
        assert kept_name not in refilled and len(refilled) == len(names) - 1
