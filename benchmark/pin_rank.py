"""Pin a torchrun (or mpirun) rank to its own core, then become the script: what benchmark.scaling launches.

    taskset -c 0,1 python -m torch.distributed.run --standalone --nproc_per_node 2 benchmark/pin_rank.py SCRIPT ARGS

torchrun has no per-rank pinning flag. Here local rank r takes the r-th of the cores this process may use (the set
taskset gave the launch, sorted), says so on one line, and replaces itself with `python SCRIPT ARGS` (exec keeps the
process id torchrun watches and the pinning).
"""

import os
import sys


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    if local_rank >= len(cores):
        raise SystemExit(f"pin_rank: error: local rank {local_rank} but only cores {cores} are usable")
    os.sched_setaffinity(0, {cores[local_rank]})
    # one write, newline included: the ranks share one log, and print's separate newline can land after another line
    os.write(sys.stdout.fileno(), f"pin_rank: local rank {local_rank} on core {cores[local_rank]}\n".encode())
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


if __name__ == "__main__":
    main()
