"""Moving tensors between ranks, named for which ranks get what, each one call on a transport: the
world's (MPI, shared memory) where it carries the tensor, else torch.distributed."""

import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

Group = dist.ProcessGroup | None  # None: the world
# DDP's keyword that keeps each rank's buffers its own after the start, as torch names it (2.13 on)
KEEP_BUFFERS = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


@dataclass
class TorchDistributed:
    """torch.distributed's collectives in `group`, of any tensor."""

    group: Group = None

    def reduce_to_all(self, tensor: torch.Tensor, op: str) -> None:
        reduce_op = getattr(dist.ReduceOp, op.upper())
        completed(dist.all_reduce(tensor, reduce_op, self.group, async_op=True), self.group)

    def gather_to_all(self, tensor: torch.Tensor, gathered: torch.Tensor) -> None:
        outputs = list(gathered.unbind(0))
        completed(dist.all_gather(outputs, tensor, self.group, async_op=True), self.group)

    def gather_to_rank0(self, tensor: torch.Tensor, gathered: torch.Tensor | None) -> None:
        outputs = None if gathered is None else list(gathered.unbind(0))
        completed(dist.gather(tensor, outputs, dst=0, async_op=True), None)

    def broadcast_from_rank0(self, tensor: torch.Tensor) -> None:
        completed(dist.broadcast(tensor, src=0, async_op=True), None)


@dataclass
class MPICommWorld:
    """MPI's collectives through mpi4py's COMM_WORLD, on numpy views of contiguous CPU tensors."""

    mpi: object  # mpi4py's MPI module

    def carries(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_contiguous()

    def reduce_to_all(self, tensor: torch.Tensor, op: str) -> None:
        reduce_op = getattr(self.mpi, op.upper())
        self.mpi.COMM_WORLD.Allreduce(self.mpi.IN_PLACE, tensor.detach().numpy(), op=reduce_op)

    def gather_to_all(self, tensor: torch.Tensor, gathered: torch.Tensor) -> None:
        self.mpi.COMM_WORLD.Allgather(tensor.detach().numpy(), gathered.numpy())

    def gather_to_rank0(self, tensor: torch.Tensor, gathered: torch.Tensor | None) -> None:
        into = None if gathered is None else gathered.numpy()
        self.mpi.COMM_WORLD.Gather(tensor.detach().numpy(), into, root=0)

    def broadcast_from_rank0(self, tensor: torch.Tensor) -> None:
        self.mpi.COMM_WORLD.Bcast(tensor.detach().numpy(), root=0)


world_transport = None  # what carries the world's collectives it can (None: torch.distributed)


def carry_with(transport) -> None:
    """From now on the world's collectives go through `transport` where it carries the tensor."""
    global world_transport
    world_transport = transport


def rank_in(group: Group = None) -> int:
    """This rank's place in `group` (the world by default); 0 without a process group."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def allreduce_mean(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Average `tensor` over the ranks of `group`, in place, in one allreduce."""
    if group_size(group) > 1:
        reduce_to_all(tensor, group=group)
        tensor /= group_size(group)
    return tensor


def broadcast_parameters(module: nn.Module) -> None:
    """Copy rank 0's parameters and floating-point buffers to every rank in one broadcast."""
    tensors = [*module.parameters(), *module.buffers()]
    broadcast_tensors([tensor for tensor in tensors if tensor.is_floating_point()])


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Copy rank 0's floating-point `tensors` into every rank's, in place, in one broadcast."""
    if group_size() > 1:
        with torch.no_grad():
            flat = torch.cat([t.reshape(-1).double() for t in tensors])
            broadcast_from_rank0(flat)
            for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                tensor.copy_(part.view_as(tensor))


def sum_over_ranks(device: torch.device, **values: float) -> dict[str, float]:
    """The named numbers summed over all ranks, in one reduction."""
    tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    if group_size() > 1:
        reduce_to_all(tensor)
    return dict(zip(values, tensor.tolist(), strict=True))


def moments_over_ranks(
    x: torch.Tensor | list[torch.Tensor], group: Group = None
) -> tuple[torch.Tensor, ...]:
    """Count, mean and M2 of `x` along its last dim (or of each tensor of a list) over every rank's
    elements as if concatenated, in one gather."""
    if isinstance(x, list):
        moments = [(p.new_tensor(len(p)), p.mean(), ((p - p.mean()) ** 2).sum()) for p in x]
        local = torch.stack([torch.stack(column) for column in zip(*moments, strict=True)])
    else:
        local_mean = x.mean(-1)
        local_m2 = ((x - local_mean.unsqueeze(-1)) ** 2).sum(-1)
        local = torch.stack([torch.full_like(local_mean, x.shape[-1]), local_mean, local_m2])
    if group_size(group) == 1:
        return local[0], local[1], local[2]
    count_i, mean_i, m2_i = gather_to_all(local, group).transpose(0, 1)  # each [ranks, rows...]
    count = count_i.sum(0)
    mean = (count_i * mean_i).sum(0) / count
    m2 = (m2_i + count_i * (mean_i - mean) ** 2).sum(0)
    return count, mean, m2


def reduce_to_all(tensor: torch.Tensor, op: str = "sum", group: Group = None) -> torch.Tensor:
    """Every rank of `group` gets the sum (or "max", "min") of their `tensor`s, in place."""
    carrier(tensor, group).reduce_to_all(tensor, op)
    return tensor


def gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """[ranks, *tensor.shape] on rank 0: each rank's `tensor`; None on the other ranks."""
    gathered = (
        tensor.new_empty((dist.get_world_size(), *tensor.shape)) if dist.get_rank() == 0 else None
    )
    carrier(tensor).gather_to_rank0(tensor, gathered)
    return gathered


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, in place."""
    carrier(tensor).broadcast_from_rank0(tensor)
    return tensor


def gather_ints_to_all(values: list[int], device: torch.device) -> torch.Tensor:
    """[ranks, len(values)] on every rank: each rank's `values`."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    if group_size() == 1:
        return tensor.unsqueeze(0).cpu()
    return gather_to_all(tensor).cpu()


def group_size(group: Group = None) -> int:
    """Ranks in `group` (the world by default); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def gather_to_all(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """[ranks in `group`, *tensor.shape] on every rank of `group`: each rank's `tensor`."""
    gathered = tensor.new_empty((dist.get_world_size(group), *tensor.shape))
    carrier(tensor, group).gather_to_all(tensor, gathered)
    return gathered


def carrier(tensor: torch.Tensor, group: Group = None):
    """What carries a collective of `tensor` in `group` (the same answer on every rank)."""
    if group is None and world_transport is not None and world_transport.carries(tensor):
        return world_transport
    return TorchDistributed(group)


def completed(work: dist.Work | None, group: Group) -> None:
    """Wait for `work` (None: not in `group`); a lost peer raises DistNetworkError, gloo's too."""
    if work is None:
        return
    try:
        if dist.get_backend(group) == "gloo":
            # yield, not sleep: a sleeper wakes milliseconds late for a 0.1 ms allreduce
            while not work.is_completed():
                os.sched_yield()
        work.wait()
    except RuntimeError as error:
        raise dist.DistNetworkError(str(error)) from error
