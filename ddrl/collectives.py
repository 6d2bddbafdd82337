"""Moving tensors between ranks, named for which ranks get what (never torch.distributed's names,
whose signatures differ): through MPI where mpirun started the ranks and mpi4py imports
(launching.join_process_group decides), else through torch.distributed. Every function does nothing,
or the obvious, in a world of one."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

Group = dist.ProcessGroup | None  # None: the world


class MPIWorld:
    """mpi4py's MPI module and COMM_WORLD while they carry the CPU collectives (join_process_group
    sets them)."""

    mpi = None
    comm = None


def group_size(group: Group = None) -> int:
    """Ranks in `group` (the world by default); 1 without a process group, so the helpers do
    nothing."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank_in(group: Group = None) -> int:
    """This rank's place in `group` (the world by default); 0 without a process group."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def allreduce_mean(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Average `tensor` over the ranks of `group`, in place, in one allreduce (through MPI under
    mpirun)."""
    if group_size(group) > 1:
        reduce_to_all(tensor, group=group)
        tensor /= group_size(group)
    return tensor


def broadcast_parameters(module: nn.Module, extras: torch.Tensor | None = None) -> None:
    """Copy rank 0's parameters and floating-point buffers, and `extras`, to every rank in one
    broadcast."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    tensors += [] if extras is None else [extras]
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
    """Count, mean and M2 (the sum of squared deviations) of `x` along its last dim (or of each
    tensor of a list) over every rank's elements as if concatenated, in one gather: a mean and a std
    of the world's data."""
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


def through_mpi(tensor: torch.Tensor, group: Group = None) -> bool:
    return (
        MPIWorld.comm is not None
        and group is None
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
    )


def reduce_to_all(tensor: torch.Tensor, op: str = "sum", group: Group = None) -> torch.Tensor:
    """Every rank of `group` (the world by default) gets the sum (or "max") of their `tensor`s, in
    place."""
    if through_mpi(tensor, group):
        MPIWorld.comm.Allreduce(
            MPIWorld.mpi.IN_PLACE, tensor.detach().numpy(), op=getattr(MPIWorld.mpi, op.upper())
        )
        return tensor
    work = dist.all_reduce(
        tensor, op=getattr(dist.ReduceOp, op.upper()), group=group, async_op=True
    )
    if dist.get_backend(group) == "gloo":
        # yield, not sleep: a sleeper wakes milliseconds late for a 0.1 ms allreduce
        while not work.is_completed():
            os.sched_yield()
    work.wait()  # a dead peer still fails the wait
    return tensor


def gather_to_all(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """[ranks in `group`, *tensor.shape] on every rank of `group`: each rank's `tensor`."""
    gathered = tensor.new_empty((dist.get_world_size(group), *tensor.shape))
    if through_mpi(tensor, group):
        MPIWorld.comm.Allgather(tensor.detach().numpy(), gathered.numpy())
    else:
        dist.all_gather(list(gathered.unbind(0)), tensor, group=group)
    return gathered


def gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """[ranks, *tensor.shape] on rank 0: each rank's `tensor`; None on the other ranks."""
    gathered = (
        tensor.new_empty((dist.get_world_size(), *tensor.shape)) if dist.get_rank() == 0 else None
    )
    if through_mpi(tensor):
        MPIWorld.comm.Gather(
            tensor.detach().numpy(), None if gathered is None else gathered.numpy(), root=0
        )
    else:
        dist.gather(tensor, None if gathered is None else list(gathered.unbind(0)), dst=0)
    return gathered


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, in place."""
    if through_mpi(tensor):
        MPIWorld.comm.Bcast(tensor.detach().numpy(), root=0)
    else:
        dist.broadcast(tensor, src=0)
    return tensor


def gather_ints_to_all(values: list[int], device: torch.device) -> torch.Tensor:
    """[ranks, len(values)] on every rank: each rank's `values` (on the device the process group
    serves)."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    if group_size() == 1:
        return tensor.unsqueeze(0).cpu()
    return gather_to_all(tensor).cpu()
