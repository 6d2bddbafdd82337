"""Run one script over several env ids and seeds, each run as N ranks, all logging to one folder.

    python -m benchmark.run --script ppo_continuous_mpi.py --env-ids HalfCheetah-v5 Hopper-v5 \\
        --nprocs 2 --out-dir runs/bench -- --num-steps 1024 --total-timesteps 1000000
    python -m benchmark.plot runs/bench/runs --out benchmark/results/ppo_continuous

A run is `python SCRIPT --nprocs N ...` plus the arguments after `--` (mpirun where mpi4py and mpirun are installed,
else torchrun; `-- --collectives torch` keeps it to torchrun), logging to OUT_DIR/runs/NAME and OUT_DIR/logs/NAME.log.
"""

import re
import shlex
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmark import common

PROGRESS_LINE = re.compile(r"^(?:iteration|epoch) (\d+)/(\d+) step (\d+) SPS (\d+) return (\S+)")
"""the per-iteration line rank 0 of every script prints: (iteration, iterations, global step, SPS, return)"""


@dataclass
class Args:
    script: common.Script = "ppo_continuous_mpi.py"
    """the script to run"""
    env_ids: tuple[str, ...] = ("HalfCheetah-v5", "Hopper-v5")
    """the env ids to run"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """the seeds to run for each env id"""
    nprocs: int = 2
    """ranks per run (the scripts' --nprocs)"""
    parallel: int = 1
    """runs at a time, each rank with `usable cores // (nprocs * parallel)` torch threads unless told after --"""
    out_dir: Path = Path("benchmark_runs")
    """runs/ (TensorBoard) and logs/ are written under this folder"""
    overwrite: bool = False
    """if toggled, delete run folders that already exist instead of refusing to start"""
    dry_run: bool = False
    """if toggled, print the commands (and the folder they run in) and exit"""
    progress_every: float = 10.0
    """seconds between two progress lines of the same run (its last line is always shown)"""


def plan(args: Args, script_args: list[str]) -> dict[str, list[str]]:
    """{run name `{script stem}__{env id, / as -}__{seed}`: command} for every env id and seed, in that order."""
    if args.nprocs < 1 or args.parallel < 1:
        raise SystemExit("benchmark.run: error: --nprocs and --parallel must be at least 1")
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


class Launcher:
    """Runs commands in `out_dir`, printing a run's progress now and then: `[k/n] run_name: iteration i/I ...`."""

    def __init__(self, out_dir: Path, total: int, every: float):
        self.out_dir, self.total, self.every, self.lock, self.last_print = out_dir, total, every, threading.Lock(), {}

    def show(self, index: int, name: str, message: str) -> None:
        with self.lock:
            print(f"[{index}/{self.total}] {name}: {message}", flush=True)
            self.last_print[name] = time.monotonic()

    def line(self, index: int, name: str, text: str) -> None:
        match = PROGRESS_LINE.match(text)
        if not match:
            return
        done, iterations = int(match.group(1)), int(match.group(2))
        if done == iterations or time.monotonic() - self.last_print.get(name, 0.0) >= self.every:
            self.show(index, name, f"{100 * done // iterations:3d}% {text}")

    def launch(self, index: int, name: str, command: list[str]) -> int:
        """Run one command to completion, reporting progress; its exit code."""
        start = time.monotonic()
        self.show(index, name, "started")
        log = self.out_dir / "logs" / f"{name}.log"
        process, log_file = common.start(command, self.out_dir, log, pipe=True)
        with log_file:
            for text in process.stdout:
                log_file.write(text)
                self.line(index, name, text.rstrip("\n"))
        code, seconds = process.wait(), time.monotonic() - start
        failed = f"FAILED (exit {code}) after {seconds:.0f} s; {log}:\n{common.last_lines(log)}"
        self.show(index, name, failed if code else f"done in {seconds:.0f} s")
        return code


def main(argv: list[str] | None = None) -> int:
    """Plan the runs, then print them (--dry-run) or run them; returns the number of failed runs."""
    args, _, script_args = common.cli(Args, argv, script_args=True)
    runs = plan(args, script_args)
    out_dir = args.out_dir.resolve()
    if args.dry_run:
        for command in runs.values():
            print(f"(cd {shlex.quote(str(out_dir))} && {shlex.join(command)})")
        return 0
    existing = [out_dir / "runs" / name for name in runs if (out_dir / "runs" / name).exists()]
    if existing and not args.overwrite:
        names = ", ".join(path.name for path in existing)
        raise SystemExit(f"benchmark.run: error: run folders exist in {out_dir / 'runs'} ({names}); pass --overwrite")
    for path in existing:
        shutil.rmtree(path)
    launcher = Launcher(out_dir, len(runs), args.progress_every)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        codes = dict(zip(runs, pool.map(launcher.launch, range(1, len(runs) + 1), runs, runs.values()), strict=True))
    failed = [name for name, code in codes.items() if code]
    print(f"{len(runs) - len(failed)}/{len(runs)} runs finished; TensorBoard: tensorboard --logdir {out_dir / 'runs'}")
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out_dir / 'logs'})", file=sys.stderr)
    return len(failed)


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
