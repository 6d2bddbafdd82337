"""Run one rank of a ddrl script, then save that rank's trained parameters to ./rank{RANK}.pt.

Usage (under torchrun or mpirun): rank_entry.py SCRIPT.py [script flags...]. Tests use it to check that every
rank ends training with the same weights. With DDRL_TEST_KILL=RANK:ITERATION in the environment, that
rank of the launch's first attempt kills itself (SIGKILL) once the checkpoint of that iteration is
written: a worker that dies at a moment a test can count on (its peers meet the death in their next
collective). With DDRL_TEST_JOIN_SIGNAL=RANK:SIGNAL (a name, SIGKILL), that rank sends itself that signal once it
has mapped the shared-memory segment, in the join, having written to ./maps{RANK}.txt the lines of its memory map
that name the segment.
"""

import importlib
import os
import signal
import sys
from pathlib import Path

import torch
import tyro


def die_at(rank: int, iteration: int) -> None:
    """Make this process SIGKILL itself once the checkpoint of `iteration` is written, if it is `rank` of the
    launch's first attempt."""
    import ddrl.run

    this_rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))  # torchrun's, or mpirun's
    if this_rank != rank or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    checkpoint = ddrl.run.Run.checkpoint

    def checkpoint_then_die(run, written: int, *arguments, **states) -> None:
        checkpoint(run, written, *arguments, **states)
        if written == iteration:
            os.kill(os.getpid(), signal.SIGKILL)

    ddrl.run.Run.checkpoint = checkpoint_then_die


def signal_in_join(rank: int, name: str) -> None:
    """Make this process send itself signal `name` once it has mapped the shared-memory segment (rank 0 made it,
    another rank opened it), if it is `rank`, after writing the lines of /proc/self/maps that name the segment."""
    from ddrl import shared_memory

    if int(os.environ["RANK"]) != rank:
        return
    mapping = shared_memory.make_segment if rank == 0 else shared_memory.open_segment

    def map_then_signal(*arguments):
        mapped = mapping(*arguments)
        with open(f"maps{rank}.txt", "w") as maps:
            maps.writelines(line for line in open("/proc/self/maps") if "ddrl-" in line)
        os.kill(os.getpid(), getattr(signal, name))
        return mapped

    setattr(shared_memory, mapping.__name__, map_then_signal)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if "DDRL_TEST_KILL" in os.environ:
        die_at(*(int(part) for part in os.environ["DDRL_TEST_KILL"].split(":")))
    if "DDRL_TEST_JOIN_SIGNAL" in os.environ:
        rank, name = os.environ["DDRL_TEST_JOIN_SIGNAL"].split(":")
        signal_in_join(int(rank), name)
    module = importlib.import_module(Path(sys.argv[1]).stem)
    agent = module.main(tyro.cli(module.Args, args=sys.argv[2:]))
    torch.save(agent.state_dict(), f"rank{os.environ['RANK']}.pt")
