"""Pins each rank of a launch to its own core as its interpreter starts (Python imports `sitecustomize` from its path):

    taskset -c 0,1 env PYTHONPATH=benchmark/pin_rank DDRL_PIN_CORES=0,1 python SCRIPT --nprocs 2 ARGS

Neither torchrun nor the scripts pin a rank. Local rank r (LOCAL_RANK or OMPI_COMM_WORLD_LOCAL_RANK) takes core Cr and
says so; a process without one (the re-launching script, torchrun's agent) keeps the taskset's cores."""

import os


def pin() -> None:
    local_rank = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"))
    if local_rank is None or "DDRL_PIN_CORES" not in os.environ:
        return
    cores = os.environ.pop("DDRL_PIN_CORES")  # the rank's children must not pin (or print) again
    cores, local_rank = [int(core) for core in cores.split(",")], int(local_rank)
    if local_rank >= len(cores):  # exit with a message: an exception here would be a fatal start-up error
        os.write(2, f"pin_rank: error: local rank {local_rank} but only cores {cores} are given\n".encode())
        os._exit(1)
    os.sched_setaffinity(0, {cores[local_rank]})
    # one write, newline included: the ranks share one log, and print's separate newline can land after another line
    os.write(1, f"pin_rank: local rank {local_rank} on core {cores[local_rank]}\n".encode())


pin()
