"""--sync gather: rank 0 runs the script's own update on the union of every rank's batch, then sends
the weights to every rank, which end where --sync allreduce would."""

import functools
import inspect
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from ddrl import collectives
from ddrl.failures import NonFiniteError

Batch = dict[str, torch.Tensor]
LEARNER_GROUPS = {}  # the world's size: a process group of rank 0 alone


def update_on_rank0(
    update_union: Callable,
    batch: Batch,
    orders: torch.Tensor | None = None,
    sizes: torch.Tensor | None = None,
) -> tuple[dict[str, float], float]:
    """Rank 0 alone calls `update_union(union, [union_orders, union_sizes,] group)` on the union of
    every rank's `batch`, then one broadcast gives every rank the parameters it updated; returns
    rank 0's losses ({} elsewhere) and the seconds of the gather and the broadcast."""
    start = time.perf_counter()
    union = gather_union(batch, orders, sizes)
    losses = {}
    nonfinite = torch.zeros(1, dtype=torch.float64, device=batch["returns"].device)
    learner_start = time.perf_counter()
    group = learner_group()
    if union is not None:
        union_batch, union_orders, union_sizes = union
        given = [union_batch] if orders is None else [union_batch, union_orders, union_sizes]
        try:
            losses, _ = update_union(*given, group)
        except NonFiniteError:
            nonfinite[0] = 1.0
    learner_time = time.perf_counter() - learner_start
    collectives.broadcast_tensors([*trained_parameters(update_union), nonfinite])
    if nonfinite[0] > 0:
        raise NonFiniteError("a non-finite loss or gradient")
    return losses, time.perf_counter() - start - learner_time


def trained_parameters(update_union: Callable) -> list[torch.Tensor]:
    """The parameters of every module and optimizer `update_union` holds, each once, in order."""
    found = {}
    for value in held_by(update_union):
        if isinstance(value, nn.Module):
            found |= {id(p): p for p in value.parameters()}
        if isinstance(value, torch.optim.Optimizer):
            found |= {id(p): p for group in value.param_groups for p in group["params"]}
    return list(found.values())


def held_by(update_union: Callable) -> list:
    """What the update main hands update_on_rank0 holds: its variables, a partial's arguments."""
    if isinstance(update_union, functools.partial):
        return [*held_by(update_union.func), *update_union.args, *update_union.keywords.values()]
    if inspect.isfunction(update_union):
        return list(inspect.getclosurevars(update_union).nonlocals.values())
    return []


def learner_group() -> dist.ProcessGroup | None:
    """A process group of rank 0 alone (made by every rank, once); None in a world of one."""
    world_size = collectives.group_size()
    if world_size == 1:
        return None
    if world_size not in LEARNER_GROUPS:
        LEARNER_GROUPS[world_size] = dist.new_group([0])
    return LEARNER_GROUPS[world_size]


def gather_union(batch: Batch, orders: torch.Tensor | None, sizes: torch.Tensor | None):
    """Rank 0's union of all batches in rank order (one gather), with the world's orders and sizes;
    None on the other ranks."""
    counts = (
        [len(batch["returns"])] * collectives.group_size()
        if sizes is None
        else sizes.sum(1).tolist()
    )
    padding = max(counts) - len(batch["returns"])  # rows, so that every rank sends as many
    extra = [] if orders is None else [orders.T]  # the orders go as [samples, epochs]
    full = [torch.cat([t, t.new_zeros(padding, *t.shape[1:])]) for t in [*batch.values(), *extra]]
    gathered = collectives.gather_to_rank0(torch.cat([t.reshape(-1).double() for t in full]))
    if gathered is None:
        return None
    numels = [t.numel() for t in full]
    ranks = [
        [part.view_as(t) for part, t in zip(row.split(numels), full, strict=True)]
        for row in gathered
    ]
    union = {
        key: torch.cat([rank[i][:n] for rank, n in zip(ranks, counts, strict=True)]).to(value.dtype)
        for i, (key, value) in enumerate(batch.items())
    }
    if orders is None:
        return union, None, None
    rank_orders = [rank[-1][:n].T.long() for rank, n in zip(ranks, counts, strict=True)]
    return union, union_orders(rank_orders, sizes).to(orders.device), sizes.sum(0)[None]


def union_orders(rank_orders: list[torch.Tensor], sizes: torch.Tensor) -> torch.Tensor:
    """[epochs, all samples]: each rank's orders as orders into the union, piece k of each rank
    together as the world's minibatch k."""
    offsets = np.cumsum([0, *(len(order[0]) for order in rank_orders)])[:-1].tolist()
    pieces = [
        (order + offset).split(rank_sizes.tolist(), 1)
        for order, offset, rank_sizes in zip(rank_orders, offsets, sizes, strict=True)
    ]
    return torch.cat([rank[k] for k in range(sizes.shape[1]) for rank in pieces], 1)
