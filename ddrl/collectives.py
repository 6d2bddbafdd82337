"""Moving tensors between ranks, named for which ranks get what (never torch.distributed's names,
whose signatures differ): through MPI where mpirun started the ranks and mpi4py imports, else
through a shared-memory segment where every rank is on one node, else through torch.distributed
(launching.join_process_group decides). Every function does nothing, or the obvious, in a world of
one."""

import inspect
import mmap
import os
import platform
import secrets
import select
import time

import numpy as np
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

SLOT_BYTES = 2**20  # a rank's slot for one collective's input; what does not fit goes through gloo
SEGMENT_SLOTS_BYTES = 2**25  # all slots together at most: past 16 ranks each slot is smaller
HEADER_WORDS = 8  # a rank's header, int64 words: one cache line, written by that rank alone
PID = 0  # header words: the rank's pid, its process's start time, the last collective it published
START_TIME = 1
PUBLISHED = 2
SPIN_SECONDS = 1e-3  # a rank with a core of its own yields it this long before it sleeps
FIRST_PAUSE = 2e-5  # seconds of a waiting rank's first sleep; each next one sleeps twice as long
LONGEST_PAUSE = 1e-3
SHARED_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum}  # reduce_to_all's ops, in numpy


class MPIWorld:
    """mpi4py's MPI module and COMM_WORLD while they carry the CPU collectives (join_process_group
    sets them)."""

    mpi = None
    comm = None


class SharedMemoryWorld:
    """The segment that carries the world's CPU collectives while every rank is on one node
    (join_shared_memory sets it): per rank a header and two slots, which that rank alone writes and
    every rank reads. A rank writes its input, then publishes the collective's number; a reader
    that sees the number sees the input, as x86-64 keeps stores in order (elsewhere gloo carries
    them)."""

    segment: mmap.mmap | None = None
    headers: np.ndarray | None = None  # [ranks, HEADER_WORDS] int64
    slots: np.ndarray | None = None  # [ranks, 2, slot bytes]: collective c's inputs in slots c % 2
    rank: int = 0
    collectives: int = 0  # the collectives made through the segment: the next one's number - 1
    spin: bool = True  # whether to yield the core a while before sleeping: a core per rank
    timeout: float = 1800.0  # seconds a rank waits for its peers (--dist-timeout)
    pidfds: dict[int, int] = {}  # each other rank's pidfd -> its rank
    exits: object = None  # a select.poll of the pidfds, readable once a peer exited


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


def reduce_to_all(tensor: torch.Tensor, op: str = "sum", group: Group = None) -> torch.Tensor:
    """Every rank of `group` (the world by default) gets the sum (or "max", "min") of their
    `tensor`s, in place."""
    if through_mpi(tensor, group):
        MPIWorld.comm.Allreduce(
            MPIWorld.mpi.IN_PLACE, tensor.detach().numpy(), op=getattr(MPIWorld.mpi, op.upper())
        )
        return tensor
    if op in COMBINE and through_shared_memory(tensor, group):
        inputs = exchange(tensor)
        result = tensor.detach().numpy().reshape(-1)
        # every rank combines every input in rank order: the same bits everywhere, run after run;
        # an inf or a NaN is the caller's to find, as torch's ops say nothing of them either
        with np.errstate(all="ignore"):
            COMBINE[op](inputs[0], inputs[1], out=result)
            for row in inputs[2:]:
                COMBINE[op](result, row, out=result)
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


def gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """[ranks, *tensor.shape] on rank 0: each rank's `tensor`; None on the other ranks."""
    gathered = (
        tensor.new_empty((dist.get_world_size(), *tensor.shape)) if dist.get_rank() == 0 else None
    )
    if through_mpi(tensor):
        MPIWorld.comm.Gather(
            tensor.detach().numpy(), None if gathered is None else gathered.numpy(), root=0
        )
    elif through_shared_memory(tensor):
        inputs = exchange(tensor)
        if gathered is not None:
            np.copyto(gathered.numpy().reshape(len(gathered), -1), inputs)
    else:
        dist.gather(tensor, None if gathered is None else list(gathered.unbind(0)), dst=0)
    return gathered


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, in place."""
    if through_mpi(tensor):
        MPIWorld.comm.Bcast(tensor.detach().numpy(), root=0)
    elif through_shared_memory(tensor):
        inputs = exchange(tensor, write=SharedMemoryWorld.rank == 0)
        if SharedMemoryWorld.rank != 0:
            np.copyto(tensor.detach().numpy().reshape(-1), inputs[0])
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


def group_size(group: Group = None) -> int:
    """Ranks in `group` (the world by default); 1 without a process group, so the helpers do
    nothing."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def gather_to_all(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """[ranks in `group`, *tensor.shape] on every rank of `group`: each rank's `tensor`."""
    gathered = tensor.new_empty((dist.get_world_size(group), *tensor.shape))
    if through_mpi(tensor, group):
        MPIWorld.comm.Allgather(tensor.detach().numpy(), gathered.numpy())
    elif through_shared_memory(tensor, group):
        np.copyto(gathered.numpy().reshape(len(gathered), -1), exchange(tensor))
    else:
        dist.all_gather(list(gathered.unbind(0)), tensor, group=group)
    return gathered


def through_mpi(tensor: torch.Tensor, group: Group = None) -> bool:
    return (
        MPIWorld.comm is not None
        and group is None
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
    )


def through_shared_memory(tensor: torch.Tensor, group: Group = None) -> bool:
    """Whether the segment carries this collective: the world's, of a contiguous CPU tensor of a
    dtype numpy sums as gloo does, that fits a slot (the same answer on every rank)."""
    return (
        SharedMemoryWorld.slots is not None
        and group is None
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.dtype in SHARED_DTYPES
        and tensor.numel() * tensor.element_size() <= SharedMemoryWorld.slots.shape[2]
    )


# --- the shared-memory segment --------------------------------------------------------------------


def join_shared_memory(
    store: dist.Store, rank: int, world_size: int, wanted: bool, timeout: float
) -> str:
    """Every rank of a one-node world calls this: rank 0 makes a segment in /dev/shm and names it in
    `store`, every rank that `wanted` it maps it and writes who it is there, and once all have
    mapped it the name is unlinked (nothing stays behind, even after a crash). Returns "" where
    every rank took it and sees every peer's process, else why not: then no rank took it, and gloo
    carries every collective."""
    leave_shared_memory()
    size = world_size * (HEADER_WORDS * 8 + 2 * slot_bytes(world_size))
    problem = "" if wanted else "was not asked for on every rank"
    if wanted and platform.machine() != "x86_64":
        problem = f"needs x86-64's store order, where this machine is {platform.machine()}"
    segment = None
    path = ""
    try:
        started = start_time(os.getpid())  # with the pid, what names this process to its peers
        if rank == 0 and not problem:
            path = f"/dev/shm/ddrl-{secrets.token_hex(8)}"
            segment = make_segment(path, size)
        elif rank != 0:
            path = store.get("shared_memory").decode()  # "": rank 0 made none
            segment = open_segment(path, size) if path and not problem else None
    except OSError as error:
        problem = f"could not map its segment ({error})"
    finally:
        if rank == 0:
            store.set("shared_memory", "" if segment is None else path)
    if segment is not None:
        headers = np.frombuffer(segment, np.int64, world_size * HEADER_WORDS)
        headers = headers.reshape(world_size, HEADER_WORDS)
        headers[rank, PID] = os.getpid()
        headers[rank, START_TIME] = started
    try:
        mapped = everyone_agrees(segment is not None)
    finally:
        if rank == 0 and segment is not None:
            os.unlink(path)
    if not mapped:
        return problem or "could not map its segment on every rank"
    pidfds = {}
    try:
        pidfds = open_peers(headers, rank)
    except OSError as error:
        problem = f"cannot see every rank's process ({error}; another pid namespace?)"
    if not everyone_agrees(not problem):
        for pidfd in pidfds:
            os.close(pidfd)
        return problem or "cannot see every rank's process from every rank"
    world = SharedMemoryWorld
    world.segment = segment
    world.headers = headers
    world.slots = np.frombuffer(segment, np.uint8, offset=headers.nbytes)
    world.slots = world.slots.reshape(world_size, 2, slot_bytes(world_size))
    world.rank = rank
    world.collectives = 0
    # ranks that outnumber their cores sleep while they wait, rather than yield a core a peer needs
    world.spin = world_size <= cores_of_the_ranks()
    world.timeout = timeout
    world.pidfds = pidfds
    world.exits = select.poll()
    for pidfd in pidfds:
        world.exits.register(pidfd, select.POLLIN)
    return ""


def leave_shared_memory() -> None:
    """Let the segment go (it is unmapped once no array views it) and close the peers' pidfds."""
    for pidfd in SharedMemoryWorld.pidfds:
        os.close(pidfd)
    SharedMemoryWorld.segment = None
    SharedMemoryWorld.headers = None
    SharedMemoryWorld.slots = None
    SharedMemoryWorld.pidfds = {}
    SharedMemoryWorld.exits = None


def slot_bytes(world_size: int) -> int:
    """A rank's slot: SLOT_BYTES, or less where the ranks are many (whole pages, at least one)."""
    share = min(SLOT_BYTES, SEGMENT_SLOTS_BYTES // (2 * world_size))
    return max(mmap.PAGESIZE, share // mmap.PAGESIZE * mmap.PAGESIZE)


def make_segment(path: str, size: int) -> mmap.mmap:
    """A new file of `size` bytes at `path`, this user's alone, mapped; its pages are reserved now,
    so a full /dev/shm fails here rather than as SIGBUS mid-run."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, size)
        return mmap.mmap(descriptor, size)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(descriptor)


def open_segment(path: str, size: int) -> mmap.mmap:
    """Rank 0's segment at `path`, mapped: a file of `size` bytes in /dev/shm, no link."""
    if os.path.dirname(path) != "/dev/shm" or not os.path.basename(path).startswith("ddrl-"):
        raise OSError(f"{path!r} is no segment of ddrl's")
    descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        if os.fstat(descriptor).st_size != size:
            raise OSError(f"{path} holds {os.fstat(descriptor).st_size} bytes, not {size}")
        return mmap.mmap(descriptor, size)
    finally:
        os.close(descriptor)


def open_peers(headers: np.ndarray, rank: int) -> dict[int, int]:
    """A pidfd of each other rank's process (pidfd -> rank), from the pid and start time in its
    header: OSError where a pid names no process here, or another one (another pid namespace)."""
    pidfds = {}
    try:
        for peer in range(len(headers)):
            if peer != rank:
                pid = int(headers[peer, PID])
                pidfds[os.pidfd_open(pid)] = peer
                # the pidfd names rank peer's process only if that process started when it says
                if start_time(pid) != headers[peer, START_TIME]:
                    raise ProcessLookupError(f"pid {pid} of rank {peer} is another process here")
    except OSError:
        for pidfd in pidfds:
            os.close(pidfd)
        raise
    return pidfds


def cores_of_the_ranks() -> int:
    """The cores that any rank may run on (their affinities' union, one gloo allreduce): ranks
    pinned one to a core have as many as ranks, where each process alone sees one."""
    cores = torch.zeros(os.cpu_count() or 1, dtype=torch.uint8)  # the same length on every rank
    # a core numbered past the count (some offline) counts as the last: fewer cores, never more
    cores[[min(core, len(cores) - 1) for core in os.sched_getaffinity(0)]] = 1
    dist.all_reduce(cores, op=dist.ReduceOp.MAX)
    return int(cores.sum())


def start_time(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat's 22nd field)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rsplit(b")", 1)[1].split()[19])


def everyone_agrees(yes: bool) -> bool:
    """Whether `yes` holds on every rank, through gloo (one allreduce)."""
    flag = torch.tensor([int(yes)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def exchange(tensor: torch.Tensor, write: bool = True) -> np.ndarray:
    """One collective through the segment: this rank's `tensor` into its slot (unless not `write`),
    the collective's number published; once every rank published it, every rank's input as
    [ranks, numel] of the tensor's dtype, views that hold until this rank's next collective (a
    peer writes that slot again only after this rank published the next number)."""
    world = SharedMemoryWorld
    world.collectives += 1
    number = world.collectives
    mine = tensor.detach().numpy().reshape(-1)
    inputs = world.slots[:, number % 2, : mine.nbytes].view(mine.dtype)
    if write:
        inputs[world.rank] = mine
    world.headers[world.rank, PUBLISHED] = number  # after the input: x86-64 keeps the order
    wait_for_peers(number)
    return inputs


def wait_for_peers(number: int) -> None:
    """Until every rank has published collective `number`: with a core per rank, yield it for
    SPIN_SECONDS, then sleep in pauses that double up to LONGEST_PAUSE. A peer that exited, or one
    that keeps the others waiting past --dist-timeout, raises DistNetworkError, which ends every
    rank in one line (Run.stop_on_error)."""
    world = SharedMemoryWorld
    published = world.headers[:, PUBLISHED]
    started = time.monotonic()
    pause = FIRST_PAUSE
    while published.min() < number:
        waited = time.monotonic() - started
        if world.spin and waited < SPIN_SECONDS:
            os.sched_yield()
            continue
        if exited := world.exits.poll(0):
            rank = world.pidfds[exited[0][0]]
            raise dist.DistNetworkError(f"rank {rank} exited during a shared-memory collective")
        if waited > world.timeout:
            late = int(np.argmax(published < number))
            raise dist.DistNetworkError(
                f"timed out after {world.timeout:g} s waiting for rank {late} in a shared-memory "
                "collective"
            )
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE)
