"""--sync gather: rank 0 runs the script's own update on the union of every rank's batch, then sends
the weights to every rank; the same update, the same minibatches, so it ends with the weights --sync
allreduce gives."""

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
# the world's size: a process group of rank 0 alone, made once by every rank together
LEARNER_GROUPS = {}


def update_on_rank0(
    update_union: Callable,
    batch: Batch,
    orders: torch.Tensor | None = None,
    sizes: torch.Tensor | None = None,
) -> tuple[dict[str, float], float]:
    """--sync gather's update: what the script's update does on each rank's batch under --sync
    allreduce, done by rank 0 alone on the union of them all. One gather gives rank 0 the union of
    every rank's `batch` and, where given, of its `orders` and `sizes`, made the union's (the
    world's minibatch k is the ranks' minibatches k). Rank 0 alone calls
    `update_union(union, union_orders, union_sizes, group)`, or `update_union(union, group)` where
    no orders are given (the union of each thing given, in order, then `group`, a process group of
    rank 0 alone), which returns what the script's update returns: (losses, seconds). Then one
    broadcast gives every rank rank 0's parameters of every module and optimizer `update_union`
    holds (a second module beside the Agent too; buffers stay each rank's, for the sync check to
    compare) and whether rank 0 met a non-finite loss, raised as NonFiniteError on every rank.
    Returns the losses (rank 0's; {} on the other ranks, which log none) and the seconds of the
    gather and the broadcast."""
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
    """The parameters of every module and optimizer `update_union` holds, each once, in the order
    it holds them (the same on every rank)."""
    found = {}
    for value in held_by(update_union):
        if isinstance(value, nn.Module):
            found |= {id(p): p for p in value.parameters()}
        if isinstance(value, torch.optim.Optimizer):
            found |= {id(p): p for group in value.param_groups for p in group["params"]}
    return list(found.values())


def held_by(update_union: Callable) -> list:
    """What the update main hands update_on_rank0 holds: a lambda's (or a nested function's)
    variables of main (its Agent, optimizer, args, ...), a partial's arguments."""
    if isinstance(update_union, functools.partial):
        return [*held_by(update_union.func), *update_union.args, *update_union.keywords.values()]
    if inspect.isfunction(update_union):
        return list(inspect.getclosurevars(update_union).nonlocals.values())
    return []


def learner_group() -> dist.ProcessGroup | None:
    """A process group of rank 0 alone (made by every rank together, the first time); None in a
    world of one."""
    world_size = collectives.group_size()
    if world_size == 1:
        return None
    if world_size not in LEARNER_GROUPS:
        LEARNER_GROUPS[world_size] = dist.new_group([0])
    return LEARNER_GROUPS[world_size]


def gather_union(batch: Batch, orders: torch.Tensor | None, sizes: torch.Tensor | None):
    """Rank 0's union of all batches in rank order (one gather), with the orders and sizes that make
    the world's minibatches (None where none are given); None on the other ranks."""
    counts = (
        [len(batch["returns"])] * collectives.group_size()
        if sizes is None
        else sizes.sum(1).tolist()
    )
    padding = max(counts) - len(batch["returns"])  # rows, so that every rank sends as many
    extra = [] if orders is None else [orders.T]  # the orders go as [samples, epochs]
    full = [torch.cat([t, t.new_zeros(padding, *t.shape[1:])]) for t in [*batch.values(), *extra]]
    # [ranks, packed]
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
    """[epochs, all samples]: each rank's orders ([epochs, its samples], into its own batch) as
    orders into the union of the batches in rank order, piece k of each rank (`sizes[rank, k]` long)
    together as the world's minibatch k."""
    offsets = np.cumsum([0, *(len(order[0]) for order in rank_orders)])[:-1].tolist()
    pieces = [
        (order + offset).split(rank_sizes.tolist(), 1)
        for order, offset, rank_sizes in zip(rank_orders, offsets, sizes, strict=True)
    ]
    return torch.cat([rank[k] for k in range(sizes.shape[1]) for rank in pieces], 1)
