"""Run one script over several env ids and seeds, each run as N ranks, all logging to one folder.

    python -m benchmark.run --script ppo_continuous_mpi.py --env-ids HalfCheetah-v5 Hopper-v5 \\
        --nprocs 2 --out-dir runs/bench -- --num-steps 1024 --total-timesteps 1000000
    python -m benchmark.plot runs/bench/runs --out benchmark/results/ppo_continuous

A run is `python SCRIPT --nprocs N ...` plus the arguments after `--` (mpirun where mpi4py and mpirun are installed,
else torchrun; `-- --collectives torch` keeps it to torchrun), logging to OUT_DIR/runs/NAME and OUT_DIR/logs/NAME.log.
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from annotated_types import Ge

from benchmark import common

PROGRESS_EVERY = 10.0
"""seconds between two progress lines of the same run (its last line is always shown)"""


@dataclass
class Args:
    script: common.Script = "ppo_continuous_mpi.py"
    """the script to run"""
    env_ids: tuple[str, ...] = ("HalfCheetah-v5", "Hopper-v5")
    """the env ids to run"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """the seeds to run for each env id"""
    nprocs: Annotated[int, Ge(1)] = 2
    """ranks per run (the scripts' --nprocs)"""
    parallel: Annotated[int, Ge(1)] = 1
    """runs at a time, each rank with `usable cores // (nprocs * parallel)` torch threads unless told after --"""
    out_dir: Path = Path("benchmark_runs")
    """runs/ (TensorBoard) and logs/ are written under this folder"""


def plan(args: Args, script_args: list[str]) -> dict[str, list[str]]:
    """{run name `{script stem}__{env id, / as -}__{seed}`: command} for every env id and seed, in that order."""
    extra = list(script_args)
    if args.parallel > 1 and not any(arg.startswith("--torch-threads") for arg in extra):
        extra += ["--torch-threads", str(max(1, len(common.usable_cores()) // (args.nprocs * args.parallel)))]
    runs = {}
    for env_id in args.env_ids:
        for seed in args.seeds:
            name = f"{Path(args.script).stem}__{env_id.replace('/', '-')}__{seed}"
            run_args = ["--env-id", env_id, "--seed", str(seed), "--run-name", name, *extra]
            runs[name] = common.script_command(common.ROOT / args.script, run_args, args.nprocs)
    return runs


def launch(index: int, name: str, command: list[str], args: Args, total: int, printed: dict) -> int:
    """Run one command to its end in --out-dir, printing `[index/total] name: ...` when it starts, a progress line
    every PROGRESS_EVERY seconds (and its last), and when it ends; its exit code."""

    def show(message: str) -> None:
        print(f"[{index}/{total}] {name}: {message}", flush=True)
        printed[name] = time.monotonic()

    def line(process, seconds: float, text: str) -> None:
        if match := common.PROGRESS_LINE.match(text):
            done = int(match.group(1))
            if done == int(match.group(2)) or time.monotonic() - printed.get(name, 0.0) >= PROGRESS_EVERY:
                show(f"{100 * done // int(match.group(2)):3d}% {text}")

    show("started")
    log = args.out_dir.resolve() / "logs" / f"{name}.log"
    code, seconds = common.follow(command, args.out_dir.resolve(), log, line)
    failed = f"FAILED (exit {code}) after {seconds:.0f} s; {log}:\n{common.last_lines(log)}" if code else None
    show(failed or f"done in {seconds:.0f} s")
    return code


def main(argv: list[str] | None = None) -> int:
    """Plan the runs and run them; returns the number of failed runs."""
    args, _, script_args = common.cli(Args, argv, script_args=True)
    runs = plan(args, script_args)
    out_dir = args.out_dir.resolve()
    if existing := [str(out_dir / "runs" / name) for name in runs if (out_dir / "runs" / name).exists()]:
        raise SystemExit(f"benchmark.run: error: {', '.join(existing)} exist(s): choose another --out-dir")
    printed = {}  # run name: when its last line was printed
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        started = [pool.submit(launch, i, *run, args, len(runs), printed) for i, run in enumerate(runs.items(), 1)]
        codes = {name: future.result() for name, future in zip(runs, started, strict=True)}
    failed = [name for name, code in codes.items() if code]
    print(f"{len(runs) - len(failed)}/{len(runs)} runs finished; TensorBoard: tensorboard --logdir {out_dir / 'runs'}")
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out_dir / 'logs'})", file=sys.stderr)
    return len(failed)


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
