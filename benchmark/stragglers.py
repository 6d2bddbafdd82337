"""Stragglers: SPS of 2 ranks, one of them slow, waiting for it (no preemption) against DD-PPO's preemption.

    python -m benchmark.stragglers --out benchmark/results/stragglers

Two ranks under torchrun, pinned one to a core as in benchmark.scaling; rank 1 is the straggler. Each case runs twice
on the same `--total-timesteps` (`--iterations` full world batches): waiting (`--preempt-fraction 0`, the scripts'
default) and `--preempt-fraction F`, with which the other ranks stop their rollout once F of the ranks finished
theirs (after `--min-rollout-fraction` of it), so a preempted run takes more, smaller iterations. Cases (CASES says
what each stands for): rollout-dominated, ppo_continuous_mpi.py on `benchmark.stragglers:StragglerHalfCheetah-v0`,
HalfCheetah-v5 whose steps busy-wait (CPU time, as a simulator spends it) to DDRL_STEP_MS milliseconds each (from
`--step-ms`), DDRL_SLOW_FACTOR times that on rank 1 (torchrun's RANK; from `--slow-factor`), both read in the rank's
process when the env is built; halfcheetah and breakout, the MLP and Atari scripts at their defaults with a CPU hog
(a busy loop pinned to rank 1's core for the run) leaving rank 1 about half its core. The table gives SPS and rank
0's time split as benchmark.scaling does, the speedup SPS(preempt) / SPS(wait) and the share of the full batch
collected. Arguments after `--` go to every run. The defaults take about 10 minutes on 2 cores; `--side-by-side`
runs a case's two runs at once, for learning checks at equal env steps in about half the time.
"""

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import gymnasium as gym

from benchmark import common, scaling

STEP_MS_VAR, SLOW_FACTOR_VAR = "DDRL_STEP_MS", "DDRL_SLOW_FACTOR"
DEFAULT_STEP_MS, DEFAULT_SLOW_FACTOR = 1.0, 3.0
STRAGGLER_RANK = 1
ENV_ID = "benchmark.stragglers:StragglerHalfCheetah-v0"
"""the slow env, in gymnasium's `module:EnvId` form (gym.make imports this module, which registers it)"""
CONTINUOUS = "ppo_continuous_mpi.py"


# --- the rollout-dominated case's env --------------------------------------------------------------------------


def step_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds every env step takes on this process's rank: DDRL_STEP_MS, times DDRL_SLOW_FACTOR on rank 1."""
    seconds = float(environ.get(STEP_MS_VAR, DEFAULT_STEP_MS)) / 1000
    if int(environ.get("RANK", "0")) == STRAGGLER_RANK:
        seconds *= float(environ.get(SLOW_FACTOR_VAR, DEFAULT_SLOW_FACTOR))
    return seconds


class BusyStep(gym.Wrapper):
    """Every step takes `seconds`: the env's own step, then spinning for the rest (a CPU-bound simulator's cost; a
    sleep would leave the core free), so the two ranks' steps cost 1 : DDRL_SLOW_FACTOR."""

    def __init__(self, env: gym.Env, seconds: float):
        super().__init__(env)
        self.seconds = seconds

    def step(self, action):
        end = time.perf_counter() + self.seconds
        result = self.env.step(action)
        while time.perf_counter() < end:
            pass
        return result


def make_straggler_half_cheetah(**kwargs) -> gym.Env:
    """HalfCheetah-v5 (its time limit included) whose steps take `step_seconds()` each."""
    return BusyStep(gym.make("HalfCheetah-v5", **kwargs), step_seconds())


gym.register(ENV_ID.split(":")[1], entry_point=make_straggler_half_cheetah)


# --- the other cases' straggler: a CPU hog on rank 1's core ---------------------------------------------------

# spins until killed, or until its parent (this benchmark) is gone, so that not even a killed benchmark leaves it
HOG_PROGRAM = (
    "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100_000):\n        pass"
)


@contextlib.contextmanager
def cpu_hog(core: int) -> Iterator[subprocess.Popen]:
    """A busy-looping process pinned to `core` for the with-block; killed when the block ends, however it ends."""
    hog = subprocess.Popen([sys.executable, "-c", HOG_PROGRAM])
    try:
        os.sched_setaffinity(hog.pid, {core})
        yield hog
    finally:
        hog.kill()
        hog.wait()


# --- the benchmark -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    script: str
    env_id: str
    """empty: the script's default"""
    cpu_hog: bool
    """True: rank 1 shares its core with a CPU hog; False: rank 1's env steps cost DDRL_SLOW_FACTOR times more"""
    models: str
    """what the case stands for (a note in the output)"""


CASES = {
    "rollout-dominated": Case(
        CONTINUOUS,
        ENV_ID,
        cpu_hog=False,
        models="a simulator that dominates the iteration and runs slower on one rank (a slower node, harder scenes): "
        "HalfCheetah whose every step takes a fixed CPU time, DDRL_SLOW_FACTOR times as long on rank 1. Both ranks "
        "keep a core each, so only rank 1's rollout is slow; its update is as fast as rank 0's",
    ),
    "halfcheetah": Case(
        CONTINUOUS,
        "",
        cpu_hog=True,
        models="a node shared with another job at the scripts' own costs: rank 1 gets about half its core, so its "
        "rollout runs at half speed, and with --sync allreduce its share of the update too (every minibatch's gradient "
        "allreduce waits for it; preemption shortens only the rollout); with --sync gather rank 0, on its own core, "
        "learns alone",
    ),
    "breakout": Case(
        common.ATARI,
        "",
        cpu_hog=True,
        models="the same shared node for the Atari script, whose iteration is mostly update (the Nature CNN's backward "
        "passes, synced by DDP, which waits for rank 1 in every minibatch), so a shorter rollout saves a smaller share",
    ),
}
CaseName = Literal["rollout-dominated", "halfcheetah", "breakout"]
TABLE_HEADERS = (
    "case | mode | iterations | SPS (iterations 2..) | speedup | s / iteration | rollout s / it | update s / it | "
    "of which sync s / it | collected / full batch"
)
COLUMNS_MEAN = (
    "SPS: world env steps per second from the end of iteration 1 to the end of the last (TensorBoard event wall "
    "times); speedup: SPS over the waiting run's of the same case; s / iteration: the wall time per iteration (2..). "
    "Rollout, update and sync are rank 0's medians over iterations 2.. (`perf/*_time`). Rank 0 is the fast rank, so "
    "its rollout is whole in both modes; it waits for rank 1's rollout in the first collective after its own, which no "
    "column covers where that is the preempting runs' all_gather of sample counts or ppo_continuous's normalisation "
    "statistics, and update and sync cover in the waiting Atari runs (the update's first collective); s / iteration "
    "always includes it. Collected: the mean share of the full world batch (2 x the per-rank batch) the world "
    "collected per iteration (2..)."
)


@dataclass(kw_only=True)
class Args(scaling.PinnedArgs):
    cases: tuple[CaseName, ...] = ("rollout-dominated", "halfcheetah", "breakout")
    """the cases to measure, each waiting and with preemption"""
    iterations: int = 10
    step_ms: float = DEFAULT_STEP_MS
    """rollout-dominated: milliseconds every env step spins on rank 0 (DDRL_STEP_MS)"""
    slow_factor: float = DEFAULT_SLOW_FACTOR
    """rollout-dominated: rank 1's env steps spin this many times as long as rank 0's (DDRL_SLOW_FACTOR)"""
    preempt_fraction: float = 0.5
    """the scripts' --preempt-fraction in the preempting runs (the waiting runs pass 0)"""
    sync: Literal["allreduce", "gather"] = "gather"
    """ppo_continuous_mpi.py's --sync (gather: the mode README's quick start runs at 2 ranks); Atari syncs by DDP"""
    side_by_side: bool = False
    """run a case's waiting and preempting runs at the same time, rank 0 of each on C0 and rank 1 of each on C1: for
    learning checks (returns at equal env steps) in about half the wall time; their SPS then measure two runs
    sharing the cores, not the modes"""
    out: Path = Path("benchmark_results/stragglers")


class Result(NamedTuple):
    """One run: its case, mode and measurement, and the mean share of the full world batch it collected per
    iteration (2..)."""

    case: str
    mode: str
    measurement: common.Measurement
    collected: float


def mode_label(preempt_fraction: float) -> str:
    return f"preempt {preempt_fraction:g}" if preempt_fraction else "wait"


def run_case(name: str, args: Args, extra: list[str], cores: list[int], work_dir: Path) -> list[Result]:
    """Launch the case's pinned 2-rank runs, waiting and preempting, one after the other or (--side-by-side) at once,
    under a CPU hog on rank 1's core if the case has one (else the slow env's costs in front); their Results."""
    case = CASES[name]
    mode = scaling.script_modes(case.script, (args.sync,))[0]
    slow_env = ["env", f"{STEP_MS_VAR}={args.step_ms:g}", f"{SLOW_FACTOR_VAR}={args.slow_factor:g}"]
    commands = {}
    for fraction in (0.0, args.preempt_fraction):
        run_name = f"stragglers__{name}__{mode_label(fraction).split()[0]}"
        run_args = ["--env-id", case.env_id or common.defaults(case.script).env_id, "--run-name", run_name]
        run_args += scaling.script_args(case.script, mode, 2, args.local_steps, args.iterations)
        run_args += ["--preempt-fraction", f"{fraction:g}", *extra]
        command = common.script_command(common.ROOT / case.script, run_args, 2, "torchrun", cores)
        commands[run_name] = command if case.cpu_hog else [*slow_env, *command]
        hog = f" (CPU hog on core {cores[1]})" if case.cpu_hog else ""
        print(f"{name}, {mode_label(fraction)}{hog}: {shlex.join(commands[run_name])}", flush=True)
    with cpu_hog(cores[1]) if case.cpu_hog else contextlib.nullcontext():
        run_dirs = common.run_logged(commands, work_dir, at_once=args.side_by_side)
    results = []
    for fraction, run_dir in zip((0.0, args.preempt_fraction), run_dirs, strict=True):
        measurement = common.measure(run_dir, case.script, mode_label(fraction), 2)
        full_batch = int(common.read_hyperparameters(run_dir)["batch_size"])
        results.append(Result(name, mode_label(fraction), measurement, measurement.global_batch / full_batch))
        print(
            f"  {mode_label(fraction)}: SPS {measurement.sps:,.0f}, collected {results[-1].collected:.2f}", flush=True
        )
    return results


def stragglers_table(results: list[Result]) -> str:
    """A row per run; speedup against the waiting run of the same case."""
    waiting = {r.case: r.measurement.sps for r in results if r.mode == "wait"}
    rows = []
    for case, mode, m, collected in results:
        speed = [f"{m.sps:,.0f}", f"{m.sps / waiting[case]:.2f}", f"{m.global_batch / m.sps:.3f}"]
        rows.append([case, mode, m.iterations, *speed, *(f"{s:.3f}" for s in (m.rollout, m.update, m.sync))])
        rows[-1].append(f"{collected:.2f}")
    return common.markdown_table(TABLE_HEADERS, rows)


def plot(results: list[Result], path: Path) -> None:
    """SPS per case, a bar per mode, the speedup written over each preempting bar."""
    cases = list(dict.fromkeys(r.case for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    waiting = {r.case: r.measurement.sps for r in results if r.mode == "wait"}
    width = 0.8 / len(modes)
    with common.figure(path) as [axes]:
        for index, mode in enumerate(modes):
            rows = {r.case: r.measurement.sps for r in results if r.mode == mode}
            positions = [cases.index(case) + (index - (len(modes) - 1) / 2) * width for case in rows]
            bars = axes.bar(positions, list(rows.values()), width, label=mode, color=f"C{index}")
            if mode != "wait":
                axes.bar_label(bars, [f"{sps / waiting[case]:.2f}x" for case, sps in rows.items()], fontsize="small")
        axes.set_xticks(range(len(cases)), cases)
        axes.set(ylabel="env steps per second (iterations 2..)")
        axes.set_title("2 ranks on 2 cores, rank 1 a straggler: waiting for it or preempting it")
        axes.legend(fontsize="small")
        axes.grid(axis="y", alpha=0.3)


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    """Run every case waiting and preempting, write OUT.md and OUT.png; returns their paths."""
    args, argv, extra = common.cli(Args, argv, script_args=True)
    if args.iterations < 2 or not 0 < args.preempt_fraction <= 1 or args.step_ms < 0 or args.slow_factor <= 0:
        raise SystemExit(
            "benchmark.stragglers: error: --iterations must be >= 2, --preempt-fraction in (0, 1], --step-ms >= 0 and "
            "--slow-factor > 0"
        )
    cores = common.usable_cores()
    if len(cores) < 2:
        raise SystemExit(
            f"benchmark.stragglers: error: 2 ranks on 2 cores need 2 usable cores; this process has {cores}"
        )
    load = common.check_load(args.max_load)
    cases = list(dict.fromkeys(args.cases))
    with common.work_folder(args.out_dir, "ddrl_stragglers_") as work_dir:
        results = [result for name in cases for result in run_case(name, args, extra, cores, work_dir)]
    png_path, image = common.draw(args, lambda path: plot(results, path), "stragglers")

    facts = [
        *scaling.pinned_facts(args, cores),
        f"2 ranks, on cores {cores[0]} and {cores[1]}; rank 1 is the straggler; the same budget in both modes, so a "
        "preempting run, collecting less per iteration, runs more iterations",
        f"modes: wait = --preempt-fraction 0; {mode_label(args.preempt_fraction)} = --preempt-fraction "
        f"{args.preempt_fraction:g}, each rollout at least --min-rollout-fraction of --num-steps (0.25 unless set "
        "after --)",
    ]
    if any(not CASES[name].cpu_hog for name in cases):
        facts.append(
            f"rollout-dominated env: every env step takes {args.step_ms:g} ms on rank 0, {args.slow_factor:g}x that "
            f"on rank 1 ({STEP_MS_VAR}={args.step_ms:g} {SLOW_FACTOR_VAR}={args.slow_factor:g})"
        )
    if hogged := [name for name in cases if CASES[name].cpu_hog]:
        facts.append(
            f"CPU hog on core {cores[1]} (rank 1's) during every run of {' and '.join(hogged)}: it raises the load"
        )
    if args.side_by_side:
        facts.append(
            "side by side: each case's waiting and preempting runs ran at the same time on the same two cores; their "
            "SPS measure two runs sharing the cores, not the modes (a learning check)"
        )
    body = f"{image}\n{stragglers_table(results)}\n{COLUMNS_MEAN}\n\n"
    for name in cases:
        env_id = CASES[name].env_id or common.defaults(CASES[name].script).env_id
        body += f"- {name} ({CASES[name].script} on {env_id}): {CASES[name].models}.\n"
    title = "Stragglers: waiting for the slowest rank or preempting it (2 ranks on 2 cores)"
    return common.write_results(args, argv, title, facts, body, *load), png_path


if __name__ == "__main__":
    main()
