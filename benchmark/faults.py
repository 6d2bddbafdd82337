"""Faults: runs that lose ranks and go on, each beside an unkilled run of the same command and seed.

    python -m benchmark.faults --out benchmark/results/faults

Every run is ppo_continuous_mpi.py on a small MuJoCo config (SCRIPT_ARGS, a few minutes on 2 cores; arguments after
`--` follow them) under torchrun. Rank 0 holds itself right after each progress line (benchmark/hold_at_line) until the
line is read, so that a fault lands at the iteration whose line called for it, however fast the run or slow the
machine. kills: `--max-restarts KILLS`, and KILLS times, at the first line past a random share of the steps, SIGKILL to
a random rank; torchrun restarts the group, which resumes from its last checkpoint (the one before that line's
iteration). resize: SIGTERM to every rank at the first line past 1/N, 2/N, ... of the steps (N launches); the ranks
stop after the next iteration with a checkpoint, and the run goes on with --resume at the next of --world-sizes. A row
per scenario: a fault survived is one the run resumed from and went past the step it had reached; env steps redone,
those logged past the checkpoint it resumed from; seconds lost, wall time beyond the unkilled run's.
"""

import contextlib
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from annotated_types import Ge

from benchmark import common

SCRIPT = "ppo_continuous_mpi.py"
MIN_ITERATIONS = 2
"""iterations every attempt trains before a fault may end it"""
SCRIPT_ARGS = ["--env-id", "Hopper-v5", "--num-steps", "512", "--num-minibatches", "8", "--update-epochs", "4"]
SCRIPT_ARGS += ["--total-timesteps", "61440", "--checkpoint-every", "2"]  # 60 iterations of 1,024 steps at 2 ranks
RESUMED = re.compile(r"^resuming from \S*iter_(\d+)\.safetensors")
HOLD_AT_LINE = common.ROOT / "benchmark" / "hold_at_line"
"""on PYTHONPATH, with DDRL_HOLD_AFTER the progress line's pattern, rank 0 stops itself after each progress line"""
HOLD = ["env", f"DDRL_HOLD_AFTER={common.PROGRESS_LINE.pattern}"]
HOLD_SECONDS = 600
"""how long rank 0 may take to hold itself after a progress line (a few bytecodes, on a machine however busy)"""


@dataclass(kw_only=True)
class Args(common.ResultsArgs):
    seed: int = 1
    """the runs' --seed, and the seed of the kills' times and ranks"""
    ranks: Annotated[int, Ge(1)] = 2
    """ranks of the unkilled run and of the kills scenario"""
    kills: Annotated[int, Ge(0)] = 3
    """SIGKILLs in the kills scenario, under torchrun --max-restarts KILLS"""
    world_sizes: tuple[Annotated[int, Ge(1)], ...] = (2, 1, 2)
    """the resize scenario's launches, each one's ranks: SIGTERM to all of them between two"""
    side_by_side: bool = False
    """run the unkilled run and the scenarios at the same time: a check that they go on in less time, not a speed one"""
    out_dir: Path | None = None
    """where the runs are launched (runs/ and logs/ are kept there); default: a temporary folder"""
    out: Path = Path("benchmark_results/faults")

    def __post_init__(self):
        if len(self.world_sizes) < 2:
            raise SystemExit("benchmark.faults: error: --world-sizes needs two launches or more")


@dataclass
class Scenario:
    """What a scenario's launches printed, in seconds since the first began: rank 0's progress lines (seconds,
    iteration, step, return), the faults, the resumptions (seconds, the checkpoint's iteration), and the launches."""

    name: str
    lines: list[tuple[float, int, int, str]] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)
    resumed: list[tuple[float, int]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    seconds: float = 0.0


def rank_pids(launcher_pid: int) -> list[int]:
    """The pids of the workers a torchrun process runs now (its children with a RANK variable), in rank order."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else 0
            variables = (entry / "environ").read_bytes().split(b"\0") if parent == launcher_pid else []
        except (OSError, IndexError, ValueError):
            continue
        found |= {int(variable[5:]): int(entry.name) for variable in variables if variable.startswith(b"RANK=")}
    return [found[rank] for rank in sorted(found)]


def state(pid: int) -> str:
    """Process `pid`'s state as /proc names it (S sleeping, T stopped, Z a zombie, ...); '' once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def held(pid: int, line: str) -> bool:
    """Wait until the rank `pid` has stopped itself after printing `line` (benchmark/hold_at_line); False if it died."""
    deadline = time.monotonic() + HOLD_SECONDS
    while state(pid) not in ("", "Z", "X", "T", "t"):
        if time.monotonic() > deadline:
            raise SystemExit(
                f"benchmark.faults: error: rank 0 (pid {pid}) did not hold within {HOLD_SECONDS} s after: {line}"
            )
        time.sleep(0.01)
    return state(pid) in ("T", "t")


def launch(scenario: Scenario, args: Args, ranks: int, more: list[str], work_dir: Path, began: float, fault) -> None:
    """One torchrun launch of `ranks` ranks (`more`: its script arguments after the config), recording what it prints;
    at each progress line, rank 0 held there, `fault(pids of the ranks, lines of this attempt, step)` says whether it
    ended the attempt."""
    restarts = [f"--max-restarts={args.kills}"] * (scenario.name == "kills")
    hold_path = os.pathsep.join(filter(None, [str(HOLD_AT_LINE), os.environ.get("PYTHONPATH")]))
    hold = [*HOLD, f"PYTHONPATH={hold_path}"]
    command = [*hold, sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    command += restarts
    command += [str(common.ROOT / SCRIPT), "--seed", str(args.seed), *SCRIPT_ARGS, *more]
    attempt = {"lines": 0, "reached": 0}  # lines of this attempt; after a fault, the iteration the run had logged

    def note(process, _: float, line: str) -> None:
        now = time.perf_counter() - began
        if resumed := RESUMED.match(line):
            scenario.resumed.append((now, int(resumed.group(1))))
            attempt.update(lines=0, reached=0)
        elif progress := common.PROGRESS_LINE.match(line):
            iteration = int(progress.group(1))
            step = int(progress.group(3))
            scenario.lines.append((now, iteration, step, progress.group(5)))
            if attempt["reached"] and iteration <= attempt["reached"]:  # restarted without a checkpoint
                attempt.update(lines=0, reached=0)
            pids = rank_pids(process.pid)  # rank 0 first: it printed the line and holds itself after it
            if pids and held(pids[0], line) and not attempt["reached"]:  # a dying group's lines count for no attempt
                attempt["lines"] += 1
                if fault(pids, attempt["lines"], step):
                    scenario.faults.append(now)
                    attempt["reached"] = iteration
            with contextlib.suppress(ProcessLookupError, IndexError):
                os.kill(pids[0], signal.SIGCONT)

    scenario.commands.append(f"(cd {shlex.quote(str(work_dir))} && {shlex.join(command)})")
    log = work_dir / "logs" / f"{scenario.name}_{len(scenario.commands)}.log"
    code, _ = common.follow(command, work_dir, log, note)
    if code:
        raise common.failed(scenario.name, code, log)
    scenario.seconds = time.perf_counter() - began


def run_scenario(name: str, args: Args, total: int, extra: list[str], work_dir: Path) -> Scenario:
    """The scenario NAME (unkilled, kills or resize) of the run `faults__NAME`, its faults where it says."""
    scenario = Scenario(name)
    rng = random.Random(args.seed)
    shares = sorted(rng.uniform(0.1, 0.8) for _ in range(args.kills))  # of the steps, where the kills come
    more = [*extra, "--run-name", f"faults__{name}"]
    shutil.rmtree(work_dir / "runs" / f"faults__{name}", ignore_errors=True)
    began = time.perf_counter()

    def kill(pids: list[int], lines: int, step: int) -> bool:
        if name == "unkilled" or not shares or lines < MIN_ITERATIONS or step < shares[0] * total or not pids:
            return False
        os.kill(rng.choice(pids), signal.SIGKILL)
        shares.pop(0)
        return True

    if name != "resize":
        launch(scenario, args, args.ranks, more, work_dir, began, kill)
    for index, ranks in enumerate(args.world_sizes if name == "resize" else []):
        share = (index + 1) / len(args.world_sizes)  # 1 for the last launch: it runs to the end

        def stop(pids: list[int], lines: int, step: int, share: float = share) -> bool:
            if share == 1 or lines < MIN_ITERATIONS or step < share * total:
                return False
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            return True

        launch(scenario, args, ranks, more + ["--resume"] * (index > 0), work_dir, began, stop)
    return scenario


def fault_costs(scenario: Scenario) -> list[tuple[int, float, bool]]:
    """Per fault: the env steps redone (logged before the resumption past the checkpoint it resumed from; all of them
    without one), the seconds to the resumption, and whether the run then went past the step it had reached."""
    costs = []
    for when in scenario.faults:
        resume = next(((at, iteration) for at, iteration in scenario.resumed if at > when), None)
        back = resume[0] if resume else next((at for at, *_ in scenario.lines if at > when), scenario.seconds)
        reached = max(step for at, _, step, _ in scenario.lines if at < back)
        saved = [step for at, iteration, step, _ in scenario.lines if at < back and resume and iteration == resume[1]]
        onward = any(at > back and step > reached for at, _, step, _ in scenario.lines)
        costs.append((reached - (saved[-1] if saved else 0), back - when, onward))
    return costs


def final_return(scenario: Scenario) -> str:
    """The mean of the last 10 iterations' returns, each iteration's as its latest line logged it."""
    latest = {iteration: value for _, iteration, _, value in scenario.lines}
    values = [float(value) for _, value in sorted(latest.items()) if value != "n/a"][-10:]
    return f"{statistics.mean(values):.1f}" if values else "n/a"


def each(values: list[float], form: str) -> str:
    """A cell: the mean of `values`, then each of them."""
    return f"{statistics.mean(values):{form}} ({', '.join(f'{value:{form}}' for value in values)})" if values else ""


def main(argv: list[str] | None = None) -> Path:
    """Run the unkilled run, then each scenario; write OUT.md; returns its path."""
    args, argv, extra = common.cli(Args, argv, script_args=True)
    flags = [*SCRIPT_ARGS, *extra]
    total = int(flags[max(i for i, flag in enumerate(flags) if flag == "--total-timesteps") + 1])  # the last given
    rows = []
    names = ("unkilled", "kills", "resize")
    with common.work_folder(args.out_dir, "ddrl_faults_") as work_dir:
        with ThreadPoolExecutor(len(names) if args.side_by_side else 1) as pool:  # one: one scenario after the other
            scenarios = list(pool.map(lambda name: run_scenario(name, args, total, extra, work_dir), names))
    unkilled = scenarios[0]
    for scenario in scenarios[1:]:
        costs = fault_costs(scenario)
        lost = scenario.seconds - unkilled.seconds
        ranks = " -> ".join(map(str, args.world_sizes)) if scenario.name == "resize" else args.ranks
        survived = sum(onward for *_, onward in costs)
        row = [scenario.name, ranks, len(costs), survived, each([c[0] for c in costs], ",.0f")]
        row += [each([c[1] for c in costs], ".1f"), f"{scenario.seconds:.1f}", f"{lost:.1f}"]
        rows.append([*row, f"{lost / max(len(costs), 1):.1f}", final_return(scenario), final_return(unkilled)])
    headers = (
        "scenario | ranks | faults | survived | env steps redone per fault (each) | s from fault to resumption (each) "
        "| wall s | s lost (beyond unkilled) | s lost per fault | final return | unkilled run's final return"
    )
    facts = [
        f"every run: `{shlex.join([SCRIPT, '--seed', str(args.seed), *SCRIPT_ARGS, *extra])}` under "
        f"torchrun --standalone; the unkilled run: {args.ranks} rank(s), {unkilled.seconds:.1f} s",
        f"kills: SIGKILL to a random rank at the first progress line past random shares (10-80%) of {total:,} steps; "
        f"resize: SIGTERM to every rank at the first past 1/{len(args.world_sizes)}, 2/{len(args.world_sizes)}, ... "
        f"of them; rank 0 holds itself after each line until the fault is sent (benchmark/hold_at_line); every "
        f"attempt trains {MIN_ITERATIONS} iterations first",
    ]
    if args.side_by_side:
        facts.append("side by side: the unkilled run and the scenarios ran at the same time: their seconds say little")
    launches = "".join(f"- {scenario.name}: `{command}`\n" for scenario in scenarios for command in scenario.commands)
    body = "\n" + common.markdown_table(headers, rows) + "\nThe launches:\n\n" + launches
    return common.write_results(args, argv, "Faults: killed and resized runs beside an unkilled one", facts, body)


if __name__ == "__main__":
    main()
