"""Sharded checkpoints with torch.distributed.checkpoint, written atomically.

Every rank saves its own weight shards and optimizer state under rank-qualified keys (a
shard is not a replica, so no key may be shared). The files go to `<dir>.partial`, and
rank 0 renames that to `<dir>` after every rank has finished: a crash mid-save leaves the
previous checkpoint, never a half-written one. Resuming needs the same plan and ranks.
The optimizer's tensors are named by `targets` (under ZeRO they are chunks of weights).
`write` and `read` are the atomic save and the load for any state (the module path's
checkpoints, which reshard, use them with DTensors).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from planner.errors import ShardplanError


def _state(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, rank: int,
           step: int, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {f"rank{rank}/step": torch.tensor(step)}
    names = {id(p): n for n, p in targets.items()}
    for name, param in params.items():
        state[f"rank{rank}/param/{name}"] = param.detach()
    for param, values in optimizer.state.items():
        for key, value in values.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            state[f"rank{rank}/optim/{names[id(param)]}/{key}"] = tensor
    return state


def check_target(directory: str | Path) -> None:
    """Refuse to save over a folder that is not a checkpoint: saving replaces the folder."""
    path = Path(directory)
    if path.exists() and not (path.is_dir() and (path / ".metadata").exists()):
        raise ShardplanError(f"{path}: exists and is not a shardplan checkpoint; saving would "
                             "replace it: choose a new --checkpoint folder")


def save(directory: str | Path, params: dict[str, torch.Tensor],
         optimizer: torch.optim.Optimizer, step: int,
         targets: dict[str, torch.Tensor] | None = None) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    write(directory, _state(params, optimizer, rank, step, targets or params))


def write(directory: str | Path, state: dict[str, torch.Tensor]) -> None:
    """`dcp.save` of `state` into `directory`, atomically (module docstring): every rank
    calls it with its own tensors (DTensors are saved by their global coordinates)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = Path(directory)
    partial = final.with_name(final.name + ".partial")
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)
    _barrier()
    import torch.distributed.checkpoint as dcp  # a second per rank to import: only here

    dcp.save(state, checkpoint_id=str(partial), no_dist=not dist.is_initialized())
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    _barrier()


def read(directory: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Fill `state`'s tensors in place from the checkpoint in `directory` (DTensors from
    whatever split they were saved in)."""
    path = existing(directory)
    import torch.distributed.checkpoint as dcp  # a second per rank to import: only here

    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as exc:  # DCP raises several types for a key or shape it lacks
        text = str(exc).strip().splitlines()
        raise ShardplanError(f"{path}: cannot resume from it ("
                             f"{text[-1] if text else type(exc).__name__}); it was saved "
                             "from another model or with another optimizer") from exc


def existing(directory: str | Path) -> Path:
    """The checkpoint folder `directory`, or one error saying why it is not one."""
    path = Path(directory)
    if not path.is_dir():
        raise ShardplanError(f"{path}: no checkpoint there (a .partial one was never finished)"
                             if path.with_name(path.name + ".partial").exists()
                             else f"{path}: no such checkpoint directory")
    return path


def load(directory: str | Path, params: dict[str, torch.Tensor],
         optimizer: torch.optim.Optimizer,
         targets: dict[str, torch.Tensor] | None = None) -> int:
    """Fill weights and optimizer state in place; return the step the checkpoint was at."""
    targets = targets if targets is not None else params
    path = existing(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    materialise_state(optimizer, targets.values())
    state = _state(params, optimizer, rank, 0, targets)
    import torch.distributed.checkpoint as dcp  # a second per rank to import: only here

    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        for name, param in params.items():
            param.copy_(state[f"rank{rank}/param/{name}"])
    names = {id(p): n for n, p in targets.items()}
    for param, values in optimizer.state.items():
        for key, value in list(values.items()):
            loaded = state[f"rank{rank}/optim/{names[id(param)]}/{key}"]
            if torch.is_tensor(value):
                value.copy_(loaded)
            else:
                values[key] = type(value)(loaded.item())
    return int(state[f"rank{rank}/step"].item())


def materialise_state(optimizer: torch.optim.Optimizer,
                      params: Iterable[torch.Tensor]) -> None:
    """Give every parameter its optimizer state (a step at learning rate 0 on zero
    gradients), so that the state's tensors exist to be loaded into."""
    touched = False
    for param in params:
        if param.requires_grad and param not in optimizer.state:
            param.grad = torch.zeros_like(param)
            touched = True
    if not touched:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
