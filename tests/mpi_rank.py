"""One rank of a test worker that mpirun started (helpers.run_ranks with `mpi_script`): join a gloo group as the
scripts do, route the script's CPU collectives through MPI as `--collectives mpi` does, run the worker and save its
result. torch.distributed's collectives are switched off, so one that bypasses MPI fails loudly."""

import importlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    job = torch.load(sys.argv[1], weights_only=False)
    rank, world_size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from mpi4py import MPI

    importlib.import_module(job["script"])
    from ddrl import collectives

    collectives.carry_with(collectives.MPICommWorld(MPI))

    def bypassed(*args, **kwargs):
        raise AssertionError("a collective went through torch.distributed instead of MPI")

    dist.all_reduce = dist.all_gather = dist.broadcast = dist.gather = bypassed
    worker = getattr(importlib.import_module(job["worker"][0]), job["worker"][1])
    torch.save(worker(rank, world_size, *job["args"]), Path(sys.argv[2]) / f"result{rank}.pt")
    MPI.COMM_WORLD.Barrier()
    dist.destroy_process_group()
