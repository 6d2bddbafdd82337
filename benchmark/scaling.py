"""Per-core weak scaling: N ranks on N cores against 1 rank on 1 core, each script and each sync mode.

    python -m benchmark.scaling --out benchmark/results/scaling

Every rank keeps its batch, runs one torch thread and has a core of its own (pinned_facts), N ranks launched by the
script's own `--nprocs`. A row gives SPS and rank 0's time split (common.measure), the speedup over 1 rank of the same
mode and the efficiency = speedup / N. Arguments after `--` go to every run, after the benchmark's own (so `--
--torch-threads 2` overrides the one thread). benchmark.scaling_model extrapolates the result to more ranks.
"""

import shlex
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from benchmark import common

DDP = "DDP"
"""the mode of the script without `--sync`"""
INDEPENDENT = "independent"
"""the rows of N independent 1-rank copies at once, one per core (the machine's ceiling)"""
INDEPENDENT_MEANS = (
    "N copies of the first mode's 1-rank run at the same time, copy i alone on core Ci, with no process group between "
    "them: SPS summed, seconds those of copy 0. Its speedup is what this machine gives N ranks before any sync "
    "(shared caches and memory bandwidth, the hypervisor's scheduling); a mode's speedup below it is its sync's cost"
)
GATHER_SYNC = (
    "the gather of every rank's rollout to rank 0 (which also waits for the slowest rank's rollout) and the broadcast "
    "of the weights; the rest of update is rank 0 learning alone on the world's batch"
)
VPG_SYNC = "the flat gradient allreduces of the update (1 policy step + {train_v_iters} value steps per epoch)"
PPO_SYNC = "the flat gradient allreduce after every minibatch plus one advantage-statistics collective per epoch"
DDP_SYNC = "backward, which DDP's allreduce overlaps, plus the explicit collectives (at 1 rank: no communication)"
SYNC_MEANS = {
    ("vpg_mpi.py", "allreduce"): VPG_SYNC,
    ("vpg_mpi.py", "gather"): GATHER_SYNC,
    ("ppo_continuous_mpi.py", "allreduce"): PPO_SYNC,
    ("ppo_continuous_mpi.py", "gather"): GATHER_SYNC,
    (common.ATARI, DDP): DDP_SYNC,
}
"""per (script, mode): what perf/sync_time covers; a script's modes are its keys here"""
MPI_UTIL_SPS = {1: 546, 2: 1040, 3: 1712, 4: 2014, 6: 2100, 8: 2400, 9: 2484, 12: 2169}
"""mpi_util's published throughput in steps/s by number of processes (reference_table says where from)"""
TABLE_HEADERS = (
    "mode | ranks (= cores) | global batch / iteration | SPS (iterations 2..) | charts/SPS (whole run) | speedup | "
    "efficiency | rollout s / it | update s / it | of which sync s / it"
)
"""the columns of a script's table (benchmark.scaling_model reads them back)"""


@dataclass(kw_only=True)
class Args(common.RunsArgs):
    scripts: tuple[common.Script, ...] = common.SCRIPTS
    """the scripts to measure"""
    sync_modes: tuple[Literal["allreduce", "gather"], ...] = ("allreduce", "gather")
    """the `--sync` modes to run, for the scripts that have the flag (the Atari script always runs its DDP)"""
    launchers: tuple[Literal["torchrun", "mpirun"], ...] = ("torchrun",)
    """what starts N ranks (mpirun: the MLP scripts only); a later launcher's rows read `MODE mpirun`"""
    ranks: tuple[int, ...] = ()
    """the numbers of ranks (each on its own core) besides the 1-rank baseline; default: 2, 4, 8, .. and all cores"""
    rounds: int = 1
    """rounds of all runs, interleaved (a VM's speed drifts); rows show the median run, each round's speedup follows"""
    independent: bool = True
    """also run, per script and N, N independent 1-rank copies at once, one per core (INDEPENDENT_MEANS)"""
    env_id: str = ""
    """the env id for every script; empty = each script's default"""
    out: Path = Path("benchmark_results/scaling")


def rank_counts(ranks: tuple[int, ...], cores: int) -> list[int]:
    """1 (the baseline) and `ranks`, or by default the powers of two below `cores` and `cores`; sorted, no repeats."""
    if not ranks:
        ranks = (*(2**k for k in range(1, cores.bit_length()) if 2**k < cores), cores)
    if min(ranks) < 1 or max(ranks) > cores:
        raise SystemExit(f"benchmark.scaling: error: --ranks must be between 1 and the {cores} usable cores")
    return sorted({1, *ranks})


def script_modes(script: str, sync_modes: tuple[str, ...]) -> list[str]:
    """The modes to run `script` in: the chosen `--sync` modes it has, or DDP for the script without the flag."""
    modes = [mode for (name, mode) in SYNC_MEANS if name == script]
    return [DDP] if modes == [DDP] else [mode for mode in sync_modes if mode in modes]


def script_args(script: str, mode: str, ranks: int, local_steps: int, iterations: int) -> list[str]:
    """One torch thread per rank (and one env thread for Atari), the sync mode, and the batch for `iterations`."""
    args = ["--torch-threads", "1"]
    args += ["--env-threads", "1"] if script == common.ATARI else []
    args += [] if mode == DDP else ["--sync", mode]
    return [*args, *common.budget_args(script, ranks, local_steps, iterations)]


def pinned_facts(args: common.RunsArgs, cores: list[int]) -> list[str]:
    """What a results file says about the budget and the pinning of pinned runs."""
    batch = f"{args.local_steps:,} env steps" if args.local_steps else "each script's default batch"
    return [
        f"budget: --total-timesteps = {args.iterations} full world batches ({batch} per rank per iteration)",
        f"pinning: usable cores C0, C1, .. = {', '.join(map(str, cores))}; 1 rank runs as `taskset -c C0 python SCRIPT "
        f"--torch-threads 1`, N ranks as {common.PINNED}, then `--torch-threads 1`; Atari also `--env-threads 1`",
    ]


def base_mode(mode: str) -> str:
    """The sync mode of a row's mode (`allreduce mpirun` -> `allreduce`): its 1-rank baseline and its meaning."""
    return mode.split()[0]


def scaling_table(measurements: list[common.Measurement]) -> str:
    """One script's rows: SPS, speedup and efficiency against the mode's 1-rank row, seconds per iteration."""
    baselines = {m.mode: m for m in measurements if m.ranks == 1}
    first_mode = next((m.mode for m in measurements if m.mode != INDEPENDENT), None)  # the ceiling's baseline
    rows = []
    for m in measurements:
        baseline = baselines.get(first_mode if m.mode == INDEPENDENT else base_mode(m.mode))
        speedup = m.sps / baseline.sps if baseline else float("nan")  # nan: its baseline not measured yet
        numbers = [f"{m.global_batch:,}", f"{m.sps:,.0f}", f"{m.script_sps:,.0f}", f"{speedup:.2f}"]
        seconds = [f"{m.rollout:.3f}", f"{m.update:.3f}", f"{m.sync:.3f}"]
        rows.append([m.mode, m.ranks, *numbers, f"{speedup / m.ranks:.0%}", *seconds])
    return common.markdown_table(TABLE_HEADERS, rows)


def round_speedups(rounds: dict[tuple[str, str, int], list[common.Measurement]]) -> str:
    """One line per (mode, N ranks): each round's SPS(N ranks) / SPS(1 rank), both of that round, and their median."""
    lines = []
    first_mode = next((mode for _, mode, _ in rounds if mode != INDEPENDENT), None)
    for (_, mode, ranks), measurements in rounds.items():
        key = (measurements[0].script, first_mode if mode == INDEPENDENT else base_mode(mode), 1)
        if ranks > 1 and key in rounds and len(rounds[key]) == len(measurements):
            baselines = rounds[key]
            speedups = [m.sps / base.sps for m, base in zip(measurements, baselines, strict=True)]
            each = ", ".join(f"{speedup:.2f}" for speedup in speedups)
            lines.append(f"- {mode}, {ranks} ranks: speedup per round {each}; median {statistics.median(speedups):.2f}")
    return "\n".join(lines) + "\n"


def reference_table() -> str:
    """mpi_util's published SPS with its speedup and efficiency, under a line saying where they come from."""
    base = MPI_UTIL_SPS[1]
    rows = [[n, f"{sps:,}", f"{sps / base:.2f}", f"{sps / base / n:.0%}"] for n, sps in MPI_UTIL_SPS.items()]
    source = (
        "mpi_util's published throughput (Walker2d, 6-core Xeon X5680 + GTX 1070, rollouts gathered to rank 0), as "
        f"listed in the project's references; 1 -> 2 processes: {base} -> {MPI_UTIL_SPS[2]} steps/s.\n\n"
    )
    return source + common.markdown_table("processes | steps/s | speedup | efficiency", rows)


def plot(results: dict[tuple[str, str], list[common.Measurement]], path: Path) -> None:
    """Left: SPS against ranks per script and mode, ideal linear scaling dashed. Right: seconds per iteration, split."""
    labels, rollout, update, sync = [], [], [], []
    with common.figure(path, 1, 2, (12, 5.5)) as (left, right):
        for color, ((script, mode), measurements) in enumerate(results.items()):
            name = f"{Path(script).stem.rsplit('_', 1)[0]} {mode}"
            ranks = [m.ranks for m in measurements]
            left.plot(ranks, [m.sps for m in measurements], "o-", color=f"C{color}", label=name)
            left.plot(ranks, [measurements[0].sps * n for n in ranks], "--", color=f"C{color}", alpha=0.5)
            for m in measurements:
                labels.append(f"{name}, {m.ranks} rank{'s' * (m.ranks > 1)}")
                rollout.append(m.rollout)
                update.append(m.update - m.sync)
                sync.append(m.sync)
        left.set_xticks(sorted({m.ranks for measurements in results.values() for m in measurements}))
        left.set(xlabel="ranks, one core each", ylabel="env steps per second")
        left.set_title("weak scaling (dashed: linear from 1 rank on 1 core)")
        left.legend(fontsize="small")
        left.grid(alpha=0.3)
        positions = range(len(labels))
        right.bar(positions, rollout, label="rollout")
        right.bar(positions, update, bottom=rollout, label="update (without sync)")
        right.bar(positions, sync, bottom=[a + b for a, b in zip(rollout, update, strict=True)], label="sync")
        right.set_xticks(list(positions), labels, fontsize="x-small", rotation=40, ha="right")
        right.set(ylabel="seconds per iteration (median)", title="time per iteration (rank 0)")
        right.legend(fontsize="small")


def jobs(args: Args, script: str, ranks_to_run: list[int]) -> list[tuple[str, int, str]]:
    """(row mode, ranks, launcher) of every run of `script` in a round (mpirun: the MLP scripts only)."""
    modes = script_modes(script, args.sync_modes)
    # the machine's ceiling first: the row that says most about the host, should the rest be cut short
    found = [(INDEPENDENT, ranks, "") for ranks in ranks_to_run if ranks > 1 and args.independent]
    found += [(mode, ranks, args.launchers[0]) for mode in modes for ranks in ranks_to_run]
    for launcher in args.launchers[1:] if script != common.ATARI else ():
        found += [(f"{mode} {launcher}", ranks, launcher) for mode in modes for ranks in ranks_to_run if ranks > 1]
    return found


def run_job(args: Args, extra: list[str], script: str, job: tuple[str, int, str], name: str, work_dir: Path):
    """Launch one job pinned (independent: `ranks` 1-rank runs of the first mode at once) as one Measurement."""
    mode, ranks, launcher = job
    cores = common.usable_cores()
    independent = mode == INDEPENDENT
    run_mode, run_ranks = (script_modes(script, args.sync_modes)[0], 1) if independent else (base_mode(mode), ranks)
    commands = {}
    for i, run_name in enumerate([f"{name}__copy{i}" for i in range(ranks)] if independent else [name]):
        run_args = ["--env-id", common.env_id(script, args.env_id), "--run-name", run_name]
        run_args += [*script_args(script, run_mode, run_ranks, args.local_steps, args.iterations), *extra]
        commands[run_name] = common.script_command(common.ROOT / script, run_args, run_ranks, launcher, cores[i:])
    print(f"{script} {mode} on {ranks} core(s): {' & '.join(map(shlex.join, commands.values()))}", flush=True)
    run_dirs = common.run_logged(commands, work_dir, at_once=True)
    copies = [common.measure(run_dir, script, mode, 1) for run_dir in run_dirs]
    total = {key: sum(getattr(m, key) for m in copies) for key in ("global_batch", "sps", "script_sps")}
    measurement = replace(copies[0], ranks=ranks, **(total if independent else {}))
    print(f"  SPS {measurement.sps:,.0f} (charts/SPS {measurement.script_sps:,.0f})", flush=True)
    return measurement


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    """Run every (script, mode, ranks), write OUT.md and OUT.png after each run (so that a run stopped early keeps
    what it measured, marked partial); returns their paths."""
    args, argv, extra = common.cli(Args, argv, script_args=True)
    if args.rounds < 1:
        raise SystemExit("benchmark.scaling: error: --rounds must be at least 1")
    cores = common.usable_cores()
    ranks_to_run = rank_counts(args.ranks, len(cores))
    load, load_warning = common.check_load(args.max_load)
    schedule = [
        (r, script, job)
        for r in range(args.rounds)
        for script in args.scripts
        for job in jobs(args, script, ranks_to_run)
    ]
    rounds: dict[tuple[str, str, int], list[common.Measurement]] = {}  # (script, mode, ranks): one per round
    with common.work_folder(args.out_dir, "ddrl_scaling_") as work_dir:
        for done, (round_index, script, job) in enumerate(schedule, start=1):
            name = f"scaling__{Path(script).stem}__{job[0].replace(' ', '_')}__{job[1]}ranks"
            name += f"__round{round_index + 1}" if args.rounds > 1 else ""
            rounds.setdefault((script, *job[:2]), []).append(run_job(args, extra, script, job, name, work_dir))
            partial = (
                None if done == len(schedule) else f"PARTIAL: {done} of {len(schedule)} runs when this was written"
            )
            paths = write_tables(args, argv, rounds, ranks_to_run, cores, load, partial or load_warning)
    return paths


def write_tables(args: Args, argv, rounds: dict, ranks_to_run: list[int], cores: list[int], load: str, warning):
    """OUT.md and OUT.png of the runs in `rounds` so far (the median run of each (script, mode, ranks))."""
    results: dict[tuple[str, str], list[common.Measurement]] = {}
    in_order = sorted(rounds.items(), key=lambda item: item[0][1] == INDEPENDENT)  # the ceiling's rows last
    for (script, mode, _), measurements in in_order:
        results.setdefault((script, mode), []).append(sorted(measurements, key=lambda m: m.sps)[(args.rounds - 1) // 2])
    png_path, image = common.draw(args, lambda path: plot(results, path), "scaling")
    facts = ["weak scaling: each rank keeps its batch, the world's grows with N", *pinned_facts(args, cores)]
    body = image
    for script in args.scripts:
        measurements = [m for (name, _), rows in results.items() if name == script for m in rows]
        body += f"\n## {script} on {common.env_id(script, args.env_id)}\n\n{scaling_table(measurements)}\n"
        if args.rounds > 1:
            body += round_speedups({key: value for key, value in rounds.items() if key[0] == script}) + "\n"
        for mode in dict.fromkeys(m.mode for m in measurements if m.mode != INDEPENDENT):
            sync_means = SYNC_MEANS[script, base_mode(mode)].format(**vars(common.defaults(script)))
            body += f"sync with {mode} means {sync_means}.\n\n"
        if args.independent and len(ranks_to_run) > 1:
            body += f"{INDEPENDENT} means {INDEPENDENT_MEANS}.\n\n"
    body += "## Reference: mpi_util\n\n" + reference_table()
    return common.write_results(args, argv, "Scaling: N ranks on N cores", facts, body, load, warning), png_path


if __name__ == "__main__":
    main()
