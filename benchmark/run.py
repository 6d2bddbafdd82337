"""Run one script over several env ids and seeds, each run as N ranks under torchrun, all logging to one folder.

    python -m benchmark.run --script ppo_continuous_mpi.py --env-ids HalfCheetah-v5 Hopper-v5 \\
        --nprocs 2 --out-dir runs/bench -- --num-steps 1024 --total-timesteps 1000000
    python -m benchmark.plot runs/bench/runs --out benchmark/results/ppo_continuous

Arguments after `--` go to every run of the script. Run `{script}__{env}__{seed}` writes TensorBoard to
OUT_DIR/runs/{run_name} (the scripts write to runs/ under their working directory, which is OUT_DIR) and its
output to OUT_DIR/logs/{run_name}.log; a progress line per run shows how far it got. `--parallel P` runs P at a
time and gives each rank `usable cores // (nprocs * P)` torch threads. `--dry-run` prints the commands.
"""

import os
import shlex
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tyro

from benchmark.common import PROGRESS_LINE, SCRIPTS, last_lines, run_streaming, split_script_args, torchrun_command


@dataclass
class Args:
    script: str = "ppo_continuous_mpi.py"
    """the script to run (one of vpg_mpi.py, ppo_continuous_mpi.py, ppo_atari_multigpu.py)"""
    env_ids: tuple[str, ...] = ("HalfCheetah-v5", "Hopper-v5")
    """the env ids to run"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """the seeds to run for each env id"""
    nprocs: int = 2
    """ranks per run (torchrun --nproc_per_node)"""
    parallel: int = 1
    """runs at a time"""
    out_dir: Path = Path("benchmark_runs")
    """runs/ (TensorBoard) and logs/ are written under this folder"""
    overwrite: bool = False
    """if toggled, delete run folders that already exist instead of refusing to start"""
    dry_run: bool = False
    """if toggled, print the commands (and the folder they run in) and exit"""
    progress_every: float = 10.0
    """seconds between two progress lines of the same run (its last line is always shown)"""


def run_name(script: str, env_id: str, seed: int) -> str:
    """The run folder of one (script, env, seed): `{script stem}__{env id, / as -}__{seed}`."""
    return f"{Path(script).stem}__{env_id.replace('/', '-')}__{seed}"


def plan(args: Args, script_args: list[str]) -> list[tuple[str, list[str]]]:
    """(run name, torchrun command) for every env id and seed, in that order; `script_args` go to every run."""
    if args.script not in SCRIPTS:
        raise SystemExit(f"benchmark.run: error: --script must be one of {', '.join(SCRIPTS)}")
    if args.nprocs < 1 or args.parallel < 1:
        raise SystemExit("benchmark.run: error: --nprocs and --parallel must be at least 1")
    extra = list(script_args)
    if args.parallel > 1 and not any(arg.startswith("--torch-threads") for arg in extra):
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        extra += ["--torch-threads", str(max(1, usable // (args.nprocs * args.parallel)))]
    runs = []
    for env_id in args.env_ids:
        for seed in args.seeds:
            name = run_name(args.script, env_id, seed)
            script_args = ["--env-id", env_id, "--seed", str(seed), "--run-name", name, *extra]
            runs.append((name, torchrun_command(args.script, args.nprocs, script_args)))
    return runs


class Progress:
    """Prints one line per run now and then: `[k/n] run_name: iteration i/I step s SPS x return r`."""

    def __init__(self, total: int, every: float):
        self.total, self.every = total, every
        self.lock = threading.Lock()
        self.last_print: dict[str, float] = {}

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


def launch_one(index: int, name: str, command: list[str], out_dir: Path, progress: Progress) -> tuple[str, int, float]:
    """Run one command to completion, reporting progress; (run name, exit code, seconds)."""
    start = time.monotonic()
    progress.show(index, name, "started")
    log_path = out_dir / "logs" / f"{name}.log"
    code = run_streaming(command, out_dir, log_path, lambda text: progress.line(index, name, text))
    seconds = time.monotonic() - start
    if code:
        progress.show(index, name, f"FAILED (exit {code}) after {seconds:.0f} s; {log_path}:\n{last_lines(log_path)}")
    else:
        progress.show(index, name, f"done in {seconds:.0f} s")
    return name, code, seconds


def main(argv: list[str] | None = None) -> int:
    """Plan the runs, then print them (--dry-run) or run them; returns the number of failed runs."""
    own, script_args = split_script_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, description=__doc__)
    runs = plan(args, script_args)
    out_dir = args.out_dir.resolve()
    if args.dry_run:
        for _, command in runs:
            print(f"(cd {shlex.quote(str(out_dir))} && {shlex.join(command)})")
        return 0
    existing = [out_dir / "runs" / name for name, _ in runs if (out_dir / "runs" / name).exists()]
    if existing and not args.overwrite:
        names = ", ".join(path.name for path in existing)
        raise SystemExit(f"benchmark.run: error: run folders exist in {out_dir / 'runs'} ({names}); pass --overwrite")
    for path in existing:
        shutil.rmtree(path)

    progress = Progress(len(runs), args.progress_every)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [
            pool.submit(launch_one, index, name, command, out_dir, progress)
            for index, (name, command) in enumerate(runs, start=1)
        ]
        results = [future.result() for future in futures]
    failed = [name for name, code, _ in results if code]
    print(f"{len(runs) - len(failed)}/{len(runs)} runs finished; TensorBoard: tensorboard --logdir {out_dir / 'runs'}")
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out_dir / 'logs'})", file=sys.stderr)
    return len(failed)


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
