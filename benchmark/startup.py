"""The quick start's start-up: seconds from the command to its batch table and to its first progress line, for this
checkout and, with --compare-with, another checkout beside it, the two alternating round by round.

    python -m benchmark.startup --compare-with ../before --rounds 8 --out benchmark/results/startup

The command is README's quick start, `python ppo_continuous_mpi.py --nprocs 2` (--script and --ranks change it), cut
to two iterations of its default batch. The batch table is printed once every check has passed and the ranks have
joined their group; the first progress line after one iteration, the same work in both checkouts. So what one
checkout adds before its first iteration is the difference of their medians.
"""

import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from benchmark import common

ITERATIONS = 2  # a run trains two iterations; its start-up ends with the first one's progress line


@dataclass(kw_only=True)
class Args(common.TimingArgs):
    script: common.Script = "ppo_continuous_mpi.py"
    """the script whose start-up is timed"""
    ranks: int = 2
    """ranks, launched by the script's own --nprocs (1: no launcher)"""
    rounds: int = 8
    """runs of each checkout, alternating; each cell is the median over the rounds"""
    compare_with: Path | None = None
    """another checkout (e.g. `git worktree add ../before HEAD~1`) whose script starts beside this checkout's"""
    out: Path = Path("benchmark_results/startup")

    def __post_init__(self):
        if self.rounds < 1 or self.ranks < 1:
            raise SystemExit("benchmark.startup: error: need --rounds >= 1 and --ranks >= 1")


def time_start(root: Path, args: Args, name: str, work_dir: Path) -> tuple[float, float, float]:
    """Seconds from launching `root`'s script to its batch table, to its first progress line, and to its exit."""
    run_args = ["--run-name", name, *common.budget_args(args.script, args.ranks, 0, ITERATIONS)]
    command = common.script_command(root / args.script, run_args, args.ranks)
    start = time.perf_counter()
    process, log = common.start(command, work_dir, work_dir / "logs" / f"{name}.log", pipe=True)
    table = progress = float("nan")
    with log:
        for line in process.stdout:
            log.write(line)
            seconds = time.perf_counter() - start
            if line.split()[:1] == ["ranks"] and table != table:  # the batch table's first row
                table = seconds
            if line.startswith(("iteration 1/", "epoch 1/")) and progress != progress:  # VPG counts epochs
                progress = seconds
        code = process.wait()
    if code or table != table or progress != progress:
        log_path = work_dir / "logs" / f"{name}.log"
        ended = common.last_lines(log_path)
        raise SystemExit(f"benchmark.startup: error: {name} failed (exit {code}); {log_path}:\n{ended}")
    return table, progress, time.perf_counter() - start


def main(argv: list[str] | None = None) -> Path:
    """Time the start-up of each checkout's script, alternating, write OUT.md; returns its path."""
    args, argv, _ = common.cli(Args, argv)
    checkouts = {"this": common.ROOT}
    if args.compare_with is not None:
        other = args.compare_with.resolve()
        if not (other / args.script).is_file():
            raise SystemExit(f"benchmark.startup: error: {other} has no {args.script}")
        checkouts = {"other": other, "this": common.ROOT}
    labels = {key: common.code_version(root, short=True) for key, root in checkouts.items()}
    labels["this"] += " (this checkout)"
    load = common.check_load(args.max_load)
    times: dict[str, list[tuple[float, float, float]]] = {key: [] for key in checkouts}
    with common.work_folder(None, "ddrl_startup_") as work_dir:
        subprocess.run(common.script_command(common.ROOT / args.script, ["--help"]), capture_output=True)  # warm caches
        for round_index in range(args.rounds):
            order = list(checkouts) if round_index % 2 == 0 else list(reversed(checkouts))
            for key in order:
                times[key].append(time_start(checkouts[key], args, f"startup__{key}__{round_index}", work_dir))
                print(f"  {labels[key]}: first progress line after {times[key][-1][1]:.2f} s", flush=True)
    rows = []
    for key, measured in times.items():
        table, progress, end = (statistics.median(run[part] for run in measured) for part in range(3))
        spread = f"{min(run[1] for run in measured):.2f} - {max(run[1] for run in measured):.2f}"
        rows.append([labels[key], f"{table:.2f}", f"{progress:.2f}", spread, f"{end:.2f}"])
    if len(times) == 2:
        before, after = (statistics.median(run[1] for run in measured) for measured in times.values())
        rows.append(["difference (this - other)", "", f"{after - before:+.2f}", "", ""])
    headers = "checkout | to the batch table, s | to the first progress line, s | its range, s | to the exit, s"
    command = f"python {args.script}" + f" --nprocs {args.ranks}" * (args.ranks > 1)
    budget = " ".join(common.budget_args(args.script, args.ranks, 0, ITERATIONS))
    facts = [
        f"`{command}` with {budget} (two iterations of the default batch), launched in a temporary folder; "
        f"{args.rounds} rounds, the checkouts alternating; medians",
    ]
    body = "\n" + common.markdown_table(headers, rows)
    return common.write_results(args, argv, "Start-up of the quick start", facts, body, *load)


if __name__ == "__main__":
    main()
