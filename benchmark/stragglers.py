"""Stragglers: SPS of 2 ranks, one of them slow, waiting for it (no preemption) against DD-PPO's preemption.

    python -m benchmark.stragglers --out benchmark/results/stragglers

Two ranks under torchrun, pinned one to a core as in benchmark.scaling, rank 1 the straggler, ppo_continuous_mpi.py
with --sync gather (the mode README's quick start runs at 2 ranks; Atari syncs by DDP). Each case (CASES) runs waiting
(`--preempt-fraction 0`) and preempting (0.5) on the same budget (table: SPS, rank 0's time split, speedup over
waiting, share of the full batch collected). Arguments after `--` go to every run. Defaults: ~10 minutes on 2 cores.
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
from typing import Annotated, Literal, NamedTuple

import gymnasium as gym
from annotated_types import Ge

from benchmark import common, scaling

STEP_MS_VAR = "DDRL_STEP_MS"
SLOW_FACTOR = 3
"""rollout-dominated: rank 1's env steps spin this many times as long as rank 0's"""
ENV_ID = "benchmark.stragglers:StragglerHalfCheetah-v0"
"""the slow env, in gymnasium's `module:EnvId` form (gym.make imports this module, which registers it)"""
CONTINUOUS = "ppo_continuous_mpi.py"


def step_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds every env step takes on this process's rank: DDRL_STEP_MS, times SLOW_FACTOR on rank 1."""
    seconds = float(environ.get(STEP_MS_VAR, 1.0)) / 1000
    return seconds * SLOW_FACTOR if int(environ.get("RANK", "0")) == 1 else seconds


class BusyStep(gym.Wrapper):
    """HalfCheetah-v5 whose steps take `step_seconds()`, spinning the rest (as a simulator; a sleep frees the core)."""

    def __init__(self, **kwargs):
        super().__init__(gym.make("HalfCheetah-v5", **kwargs))
        self.seconds = step_seconds()  # read in the rank's process, as the env is built

    def step(self, action):
        end = time.perf_counter() + self.seconds
        result = self.env.step(action)
        while time.perf_counter() < end:
            pass
        return result


gym.register(ENV_ID.split(":")[1], entry_point=BusyStep)
# spins until killed, or until its parent (this benchmark) is gone, so that not even a killed benchmark leaves it
HOG_PROGRAM = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100_000): pass"


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


class Case(NamedTuple):
    """A script, its env id, whether rank 1 shares its core with a CPU hog (else its env
    steps cost SLOW_FACTOR times more), and what the case stands for (a note in the output)."""

    script: str
    env_id: str
    cpu_hog: bool
    models: str


CASES = {
    "rollout-dominated": Case(
        CONTINUOUS, ENV_ID, False, "a simulator that dominates the iteration and runs slower on one rank (a slower "
        "node, harder scenes): HalfCheetah whose every step takes a fixed CPU time, three times as long on "
        "rank 1; rank 1's update is as fast as rank 0's",
    ),
    "halfcheetah": Case(
        CONTINUOUS, "HalfCheetah-v5", True, "a node shared with another job: rank 1 gets about half its core, so its "
        "rollout runs at half speed, and with --sync allreduce its share of the update too (preemption shortens only "
        "the rollout); with --sync gather rank 0 learns alone on its own core",
    ),
    "breakout": Case(
        common.ATARI, "BreakoutNoFrameskip-v4", True, "the same shared node for the Atari script, whose iteration is "
        "mostly update (DDP waits for rank 1 in every minibatch), so a shorter rollout saves a smaller share",
    ),
}  # fmt: skip
TABLE_HEADERS = (
    "case | mode | iterations | SPS (iterations 2..) | speedup | s / iteration | rollout s / it | update s / it | "
    "of which sync s / it | collected / full batch"
)
MODES = {"wait": 0.0, "preempt 0.5": 0.5}
"""each case's two runs: the scripts' --preempt-fraction (0: the ranks wait for the straggler)"""
COLUMNS_MEAN = (
    "SPS and rank 0's seconds per part as in benchmark.scaling; speedup: SPS over the waiting run's; s / iteration: "
    "the wall time per iteration (2..), which includes rank 0's wait for rank 1's rollout (in the first collective "
    "after its own; no other column covers it where that is the preempting runs' all_gather of sample counts or "
    "ppo_continuous's normalisation statistics). Collected: the mean share of the full world batch per iteration."
)


@dataclass(kw_only=True)
class Args(common.RunsArgs):
    cases: tuple[Literal["rollout-dominated", "halfcheetah", "breakout"], ...] = tuple(CASES)
    """the cases to measure, each waiting and with preemption"""
    iterations: int = 10
    step_ms: Annotated[float, Ge(0)] = 1.0
    """rollout-dominated: milliseconds every env step spins on rank 0 (DDRL_STEP_MS)"""
    side_by_side: bool = False
    """run a case's two runs at once on the same cores: a learning check in half the time, not a speed one"""
    out: Path = Path("benchmark_results/stragglers")


def run_case(name: str, args: Args, extra: list[str], cores: list[int], work_dir: Path) -> list[tuple]:
    """Run the case's pinned 2-rank runs, waiting and preempting, with its straggler: per run (case, Measurement, the
    mean share of the full world batch collected per iteration)."""
    case = CASES[name]
    mode = scaling.script_modes(case.script, ("gather",))[0]
    slow_env = ["env", f"{STEP_MS_VAR}={args.step_ms:g}"]
    commands = {}
    for label, fraction in MODES.items():
        run_name = f"stragglers__{name}__{label.split()[0]}"
        run_args = ["--env-id", case.env_id, "--run-name", run_name]
        run_args += scaling.script_args(case.script, mode, 2, args.local_steps, args.iterations)
        run_args += ["--preempt-fraction", f"{fraction:g}", *extra]
        command = common.script_command(common.ROOT / case.script, run_args, 2, "torchrun", cores)
        commands[run_name] = command if case.cpu_hog else [*slow_env, *command]
        print(f"{name}, {label}{' (CPU hog)' * case.cpu_hog}: {shlex.join(commands[run_name])}")
    with cpu_hog(cores[1]) if case.cpu_hog else contextlib.nullcontext():
        run_dirs = common.run_logged(commands, work_dir, at_once=args.side_by_side)
    results = []
    for label, run_dir in zip(MODES, run_dirs, strict=True):
        measurement = common.measure(run_dir, case.script, label, 2)
        full_batch = int(common.read_hyperparameters(run_dir)["batch_size"])
        results.append((name, measurement, measurement.global_batch / full_batch))
        print(f"  {measurement.mode}: SPS {measurement.sps:,.0f}, collected {results[-1][2]:.2f}", flush=True)
    return results


def stragglers_table(results: list[tuple]) -> str:
    """A row per run; speedup against the waiting run of the same case."""
    waiting = {case: m.sps for case, m, _ in results if m.mode == "wait"}
    rows = []
    for case, m, collected in results:
        speed = [f"{m.sps:,.0f}", f"{m.sps / waiting[case]:.2f}", f"{m.global_batch / m.sps:.3f}"]
        seconds = [f"{s:.3f}" for s in (m.rollout, m.update, m.sync)]
        rows.append([case, m.mode, m.iterations, *speed, *seconds, f"{collected:.2f}"])
    return common.markdown_table(TABLE_HEADERS, rows)


def plot(results: list[tuple], axes: list) -> None:
    """SPS per case, a bar per mode, the speedup written over each preempting bar."""
    [axis] = axes
    cases = list(dict.fromkeys(case for case, _, _ in results))
    waiting = {case: m.sps for case, m, _ in results if m.mode == "wait"}
    width = 0.8 / len(MODES)
    for index, mode in enumerate(MODES):
        rows = {case: m.sps for case, m, _ in results if m.mode == mode}
        positions = [cases.index(case) + (index - (len(MODES) - 1) / 2) * width for case in rows]
        bars = axis.bar(positions, list(rows.values()), width, label=mode, color=f"C{index}")
        if mode != "wait":
            axis.bar_label(bars, [f"{sps / waiting[case]:.2f}x" for case, sps in rows.items()], fontsize="small")
    axis.set_xticks(range(len(cases)), cases)
    axis.set(ylabel="env steps per second (iterations 2..)")
    axis.set_title("2 ranks on 2 cores, rank 1 a straggler: waiting for it or preempting it")
    axis.legend(fontsize="small")
    axis.grid(axis="y", alpha=0.3)


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    """Run every case waiting and preempting, write OUT.md and OUT.png; returns their paths."""
    args, argv, extra = common.cli(Args, argv, script_args=True)
    cores = common.usable_cores()
    if len(cores) < 2:
        raise SystemExit(f"benchmark.stragglers: error: 2 ranks on 2 cores need 2 usable cores, not {cores}")
    load = common.check_load(args.max_load)
    cases = list(dict.fromkeys(args.cases))
    with common.work_folder(args.out_dir, "ddrl_stragglers_") as work_dir:
        results = [result for name in cases for result in run_case(name, args, extra, cores, work_dir)]
    png_path, image = common.draw(args, lambda axes: plot(results, axes), "stragglers")
    min_fraction = common.defaults(CONTINUOUS).min_rollout_fraction
    facts = [
        *scaling.pinned_facts(args, cores),
        f"rank 1 (core {cores[1]}) is the straggler; modes: wait = --preempt-fraction 0, preempt 0.5 = "
        "--preempt-fraction 0.5 (each rollout at least --min-rollout-fraction of --num-steps, "
        f"{min_fraction:g} unless set after --), on the same budget, so a preempting run, collecting less per "
        "iteration, runs more iterations",
    ]
    if args.side_by_side:
        facts.append(
            "side by side: each case's waiting and preempting runs ran at the same time on the same two cores; their "
            "SPS measure two runs sharing the cores, not the modes (a learning check)"
        )
    body = f"{image}\n{stragglers_table(results)}\n{COLUMNS_MEAN}\n\n"
    hog = f"here a CPU hog ran on core {cores[1]} during every run (it raises the load)"
    slow = f"here env steps took {args.step_ms:g} ms ({STEP_MS_VAR}), {SLOW_FACTOR}x that on rank 1"
    for name, case in ((name, CASES[name]) for name in cases):
        body += f"- {name} ({case.script} on {case.env_id}): {case.models}; {hog if case.cpu_hog else slow}.\n"
    title = "Stragglers: waiting for the slowest rank or preempting it (2 ranks on 2 cores)"
    return common.write_results(args, argv, title, facts, body, load), png_path


if __name__ == "__main__":
    main()
