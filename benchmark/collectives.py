"""Latency of one allreduce (a sum of float32) on ranks of one node, through each path the scripts' CPU collectives
take: shared memory (ranks started by torchrun, `--collectives auto`), gloo (torchrun, `--collectives torch`) and MPI
(mpi4py under `mpirun --bind-to core`, `--collectives mpi`).

    python -m benchmark.collectives --out benchmark/results/collectives

Every rank joins the world as a script's run.start does (launching.join_process_group, whose answer is the batch
table's collectives row) and times `collectives.reduce_to_all` on its own tensor, back to back, as the MLP scripts'
gradient allreduce runs once per minibatch; rank r is pinned to the r-th usable core under every launcher. Each call
counts on the slowest rank; every result is checked against the sum of the ranks' tensors.
"""

import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import torch.distributed as dist
from annotated_types import Ge

from benchmark import common
from ddrl import collectives, failures, launching, machine

CollectivesPath = Literal["shared memory", "gloo", "MPI"]
FLAG_OF = {"shared memory": "auto", "gloo": "torch", "MPI": "mpi"}
"""each path's --collectives, under its launcher"""


@dataclass(kw_only=True)
class Args(common.TimingArgs):
    nprocs: Annotated[int, Ge(2)] = 2
    """ranks, each pinned to its own usable core"""
    sizes: tuple[Annotated[int, Ge(1)], ...] = (1_000, 11_091, 100_000)
    """float32 per allreduce (11,091: continuous PPO's gradients and logged numbers)"""
    paths: tuple[CollectivesPath, ...] = ("shared memory", "gloo", "MPI")
    """which paths to time"""
    calls: Annotated[int, Ge(1)] = 2000
    """timed allreduces per size and path"""
    warmup: Annotated[int, Ge(0)] = 100
    """untimed allreduces before them"""
    out: Path = Path("benchmark_results/collectives")


def worker(args_dict: dict, path: str, result_path: str) -> None:
    """One rank, started by torchrun or mpirun: join the world with `path`'s --collectives, time every size, and on
    rank 0 write the rows as JSON."""
    args = Args(**args_dict)
    failures.script = "benchmark.collectives"
    world = launching.read_launcher_environment()
    rank = world.rank
    world_size = world.world_size
    flags = dict(backend="", cuda=False, dist_timeout=300.0, torch_threads=1, collectives=FLAG_OF[path])
    carried = launching.join_process_group(types.SimpleNamespace(**flags), world)
    rows = []
    for size in args.sizes:
        mine = torch.randn(size, generator=torch.Generator().manual_seed(rank))
        expected = torch.zeros(size)
        for other in range(world_size):  # every rank's tensor, remade here, summed in rank order
            expected += torch.randn(size, generator=torch.Generator().manual_seed(other))
        tensor = mine.clone()
        times = []
        for _ in range(args.warmup + args.calls):
            tensor.copy_(mine)  # the input again (as a new gradient), outside the time
            start = time.perf_counter()
            collectives.reduce_to_all(tensor)
            times.append(time.perf_counter() - start)
        checked = torch.tensor([int(torch.allclose(tensor, expected, rtol=1e-5, atol=1e-5))])
        dist.all_reduce(checked, op=dist.ReduceOp.MIN)
        slowest = torch.tensor(times[args.warmup :], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        p10, median, p90 = np.percentile(1e6 * slowest.numpy(), [10, 50, 90])
        mean = 1e6 * slowest.mean().item()
        row = {"path": path, "carried": carried, "size": size, "median_us": median, "mean_us": mean}
        rows.append({**row, "p10_us": p10, "p90_us": p90, "checked": bool(checked.item())})
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()  # as the scripts do: gloo's threads left to interpreter shutdown can abort the rank


def launch_command(path: str, nprocs: int, cores: list[int], code: str) -> list[str]:
    """`python -c CODE` as `nprocs` ranks under `path`'s launcher, rank r pinned to core cores[r]: mpirun binds them
    itself, torchrun's ranks pin themselves as they start (benchmark/pin_rank)."""
    python = [sys.executable, "-c", code]
    if path == "MPI":
        as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        mpi_cores = ["--cpu-set", ",".join(map(str, cores)), "--bind-to", "core"]
        return ["mpirun", *as_root, *mpi_cores, "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-np", str(nprocs), *python]
    pin = os.pathsep.join(filter(None, [str(common.ROOT / "benchmark" / "pin_rank"), os.environ.get("PYTHONPATH")]))
    pinned = ["env", f"PYTHONPATH={pin}", f"DDRL_PIN_CORES={','.join(map(str, cores))}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]
    return [*pinned, *torchrun, "--no-python", *python]


def free_port() -> int:
    """A TCP port that nothing listens on right now: the store's, for the ranks of one launch."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def format_table(rows: list[dict]) -> str:
    """The results table: one row per size and path, the sizes in order."""
    table = [
        [
            f"{row['size']:,}",
            machine.size(4 * row["size"]),
            row["path"],
            row["carried"],
            f"{row['median_us']:.1f}",
            f"{row['mean_us']:.1f}",
            f"{row['p10_us']:.1f}-{row['p90_us']:.1f}",
            "yes" if row["checked"] else "NO",
        ]
        for row in sorted(rows, key=lambda row: row["size"])
    ]
    headers = "float32 | bytes | path | batch table's row | median (us) | mean (us) | p10-p90 (us) | result checked"
    return common.markdown_table(headers, table)


def main(argv: list[str] | None = None) -> Path:
    """Launch each path's ranks in turn, time them, write OUT.md; returns its path."""
    args, argv, _ = common.cli(Args, argv)
    cores = common.usable_cores()
    if args.nprocs > len(cores):
        raise SystemExit(f"benchmark.collectives: error: --nprocs {args.nprocs} asks for more than {len(cores)} cores")
    load = common.check_load(args.max_load)
    plain_args = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(args).items()}
    rows = []
    since = common.cpu_clock()
    with tempfile.TemporaryDirectory(prefix="ddrl_collectives_") as tmp:
        for path in args.paths:
            result_path = Path(tmp) / "rows.json"
            worker_args = (plain_args, path, str(result_path))
            code = f"from benchmark.collectives import worker; worker(*{worker_args!r})"  # no script: worker()
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            command = launch_command(path, args.nprocs, cores[: args.nprocs], code)
            subprocess.run(command, cwd=common.ROOT, env=env, check=True)
            rows += json.loads(result_path.read_text())
    others = common.other_cores(since)
    if not all(row["checked"] for row in rows):
        print("benchmark.collectives: warning: an allreduce's result was not the ranks' sum", file=sys.stderr)
    facts = [
        f"{args.nprocs} ranks on one node, rank r pinned to usable core r (torchrun's by benchmark/pin_rank, mpirun's "
        "by --bind-to core), 1 torch thread each",
        f"{args.calls} timed allreduces per size and path after {args.warmup} untimed ones, back to back, each counted "
        "on the slowest rank; us = microseconds",
        f"other processes kept {others:.2f} cores busy on average while the paths ran (their launches included)",
    ]
    return common.write_results(args, argv, "Collectives: allreduce latency", facts, "\n" + format_table(rows), load)


if __name__ == "__main__":
    main()
