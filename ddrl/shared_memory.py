"""The shared-memory segment (anonymous memory: nothing stays behind) that carries the world's CPU
collectives where every rank is on one x86-64 node; per rank a header and two slots."""

import mmap
import os
import platform
import secrets
import select
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ddrl import collectives

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


@dataclass
class Segment:
    """This rank's view of the segment, and what it knows of its peers."""

    headers: np.ndarray  # [ranks, HEADER_WORDS] int64, a view that keeps the segment mapped
    slots: np.ndarray  # [ranks, 2, slot bytes]: collective c's inputs in slots c % 2
    rank: int
    spin: bool  # whether to yield the core a while before sleeping: a core per rank
    timeout: float  # seconds a rank waits for its peers (--dist-timeout)
    pidfds: dict[int, int]  # each other rank's pidfd -> its rank
    exits: select.poll  # of the pidfds: one is readable once its rank exited
    carried: int = 0  # the collectives this segment carried: the next one's number - 1

    def carries(self, tensor: torch.Tensor) -> bool:
        """Whether the segment carries a world collective of `tensor` (alike on every rank)."""
        return (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and tensor.dtype in SHARED_DTYPES
            and tensor.numel() * tensor.element_size() <= self.slots.shape[2]
        )

    def reduce_to_all(self, tensor: torch.Tensor, op: str) -> None:
        inputs = exchange(self, tensor)
        result = tensor.detach().numpy().reshape(-1)
        # in rank order: the same bits everywhere; an inf or a NaN is the caller's to find
        with np.errstate(all="ignore"):
            COMBINE[op](inputs[0], inputs[1], out=result)
            for row in inputs[2:]:
                COMBINE[op](result, row, out=result)

    def gather_to_rank0(self, tensor: torch.Tensor, gathered: torch.Tensor | None) -> None:
        inputs = exchange(self, tensor)  # every rank reads every input: the same as to all
        if gathered is not None:
            np.copyto(gathered.numpy().reshape(len(gathered), -1), inputs)

    gather_to_all = gather_to_rank0

    def broadcast_from_rank0(self, tensor: torch.Tensor) -> None:
        inputs = exchange(self, tensor, write=self.rank == 0)
        if self.rank != 0:
            np.copyto(tensor.detach().numpy().reshape(-1), inputs[0])


def join(rank: int, world_size: int, wanted: bool, timeout: float) -> tuple[Segment | None, str]:
    """Rank 0 makes a segment, the others map it: this rank's Segment and "", else None and why."""
    size = world_size * (HEADER_WORDS * 8 + 2 * slot_bytes(world_size))
    problem = "" if wanted else "was not asked for on every rank"
    if wanted and platform.machine() != "x86_64":
        problem = f"needs x86-64's store order, where this machine is {platform.machine()}"
    memory = None
    made = torch.zeros(3, dtype=torch.int64)  # rank 0's pid, descriptor and name; 0s: none made
    try:
        if rank == 0 and not problem:
            made[2] = secrets.randbits(62)
            memory, descriptor = make_segment(size, int(made[2]))
            made[:2] = torch.tensor([os.getpid(), descriptor])
    except OSError as error:
        problem = f"could not map its segment ({error})"
    collectives.TorchDistributed().broadcast_from_rank0(made)
    try:
        if rank != 0 and made[0] and not problem:
            memory = open_segment(*made.tolist(), size)
        if memory is not None:  # who this rank is: its pid, and when its process started
            headers = np.frombuffer(memory, np.int64, world_size * HEADER_WORDS)
            headers = headers.reshape(world_size, HEADER_WORDS)
            headers[rank, START_TIME] = start_time(os.getpid())
            headers[rank, PID] = os.getpid()
    except OSError as error:
        problem = f"could not map its segment ({error})"
        memory = None
    mapped = everyone_agrees(memory is not None)
    if rank == 0 and made[0]:
        os.close(descriptor)  # every rank has mapped it, or given up: the mapping is all it needs
    if not mapped:
        return None, problem or "could not map its segment on every rank"
    pidfds = {}
    try:
        pidfds = open_peers(headers, rank)
    except OSError as error:
        problem = f"cannot see every rank's process ({error}; another pid namespace?)"
    if not everyone_agrees(not problem):
        close(pidfds)
        return None, problem or "cannot see every rank's process from every rank"
    slots = np.frombuffer(memory, np.uint8, offset=headers.nbytes)
    slots = slots.reshape(world_size, 2, slot_bytes(world_size))
    exits = select.poll()
    for pidfd in pidfds:
        exits.register(pidfd, select.POLLIN)
    spin = world_size <= cores_of_the_ranks()
    segment = Segment(headers, slots, rank, spin, timeout, pidfds, exits)
    weakref.finalize(segment, close, list(pidfds))  # the pidfds close when the segment goes
    return segment, ""


def slot_bytes(world_size: int) -> int:
    """A rank's slot: SLOT_BYTES, or less where the ranks are many (whole pages, at least one)."""
    share = min(SLOT_BYTES, SEGMENT_SLOTS_BYTES // (2 * world_size))
    return max(mmap.PAGESIZE, share // mmap.PAGESIZE * mmap.PAGESIZE)


def make_segment(size: int, token: int) -> tuple[mmap.mmap, int]:
    """A new memfd segment named ddrl-TOKEN, mapped, and its descriptor; its pages reserved now, so
    a machine out of memory fails here rather than as SIGBUS mid-run."""
    descriptor = os.memfd_create(f"ddrl-{token:016x}", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(descriptor, 0, size)
        return mmap.mmap(descriptor, size), descriptor
    except OSError:
        os.close(descriptor)
        raise


def open_segment(pid: int, descriptor: int, token: int, size: int) -> mmap.mmap:
    """Rank 0's segment, opened through /proc/PID/fd and checked to be ddrl-TOKEN, mapped."""
    opened = os.open(f"/proc/{pid}/fd/{descriptor}", os.O_RDWR | os.O_CLOEXEC)
    try:
        name = os.readlink(f"/proc/self/fd/{opened}")
        if name != f"/memfd:ddrl-{token:016x} (deleted)":
            raise OSError(f"descriptor {descriptor} of pid {pid} is {name!r}, not rank 0's segment")
        if os.fstat(opened).st_size != size:
            raise OSError(f"rank 0's segment holds {os.fstat(opened).st_size} bytes, not {size}")
        return mmap.mmap(opened, size)
    finally:
        os.close(opened)


def open_peers(headers: np.ndarray, rank: int) -> dict[int, int]:
    """Each other rank's pidfd -> rank, from its header's pid and start time (else OSError)."""
    pidfds = {}
    try:
        for peer in range(len(headers)):
            if peer != rank:
                pid = int(headers[peer, PID])
                pidfds[os.pidfd_open(pid)] = peer
                if start_time(pid) != headers[peer, START_TIME]:
                    raise ProcessLookupError(f"pid {pid} of rank {peer} is another process here")
    except OSError:
        close(pidfds)
        raise
    return pidfds


def close(descriptors: list[int]) -> None:
    """Close each of `descriptors` (a list, or a dict's keys)."""
    for descriptor in descriptors:
        os.close(descriptor)


def cores_of_the_ranks() -> int:
    """The cores that any rank may run on: their affinities' union, in one gloo allreduce."""
    cores = torch.zeros(os.cpu_count() or 1, dtype=torch.uint8)  # the same length on every rank
    cores[[min(core, len(cores) - 1) for core in os.sched_getaffinity(0)]] = 1
    collectives.TorchDistributed().reduce_to_all(cores, "max")
    return int(cores.sum())


def start_time(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat's 22nd field)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rsplit(b")", 1)[1].split()[19])


def everyone_agrees(yes: bool) -> bool:
    """Whether `yes` holds on every rank, through gloo (one allreduce)."""
    flag = torch.tensor([int(yes)])
    collectives.TorchDistributed().reduce_to_all(flag, "min")
    return bool(flag.item())


def exchange(segment: Segment, tensor: torch.Tensor, write: bool = True) -> np.ndarray:
    """One collective: this rank's `tensor` into its slot, the collective's number published; then
    every rank's input as [ranks, numel], views that hold until this rank's next collective."""
    segment.carried += 1
    number = segment.carried
    mine = tensor.detach().numpy().reshape(-1)
    inputs = segment.slots[:, number % 2, : mine.nbytes].view(mine.dtype)
    if write:
        inputs[segment.rank] = mine
    segment.headers[segment.rank, PUBLISHED] = number  # after the input: x86-64 keeps the order
    wait_for_peers(segment, number)
    return inputs


def wait_for_peers(segment: Segment, number: int) -> None:
    """Until every rank has published collective `number`, yielding then sleeping; a peer that
    exited, or one late past --dist-timeout, raises DistNetworkError."""
    published = segment.headers[:, PUBLISHED]
    started = time.monotonic()
    pause = FIRST_PAUSE
    while published.min() < number:
        waited = time.monotonic() - started
        if segment.spin and waited < SPIN_SECONDS:
            os.sched_yield()
            continue
        if exited := segment.exits.poll(0):
            rank = segment.pidfds[exited[0][0]]
            raise dist.DistNetworkError(f"rank {rank} exited during a shared-memory collective")
        if waited > segment.timeout:
            late = int(np.argmax(published < number))
            raise dist.DistNetworkError(
                f"timed out after {segment.timeout:g} s waiting for rank {late} in a shared-memory "
                "collective"
            )
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE)
