"""Per-core weak scaling: N ranks on N cores against 1 rank on 1 core, each script and each sync mode.

    python -m benchmark.scaling --out benchmark/results/scaling

The baseline is one rank pinned to one core with one torch thread, `taskset -c C0 python SCRIPT --torch-threads 1`;
N ranks run on N cores, `taskset -c C0,..,C(N-1) python -m torch.distributed.run --standalone --nproc_per_node N
benchmark/pin_rank.py SCRIPT --torch-threads 1`, where pin_rank.py pins local rank r to core Cr (C0, C1, .. are the
usable cores, sorted). The Atari script also gets `--env-threads 1`. Each rank keeps the same batch (`--local-steps`
env steps per iteration; the global batch grows with N) for `--iterations` iterations. Scripts with `--sync` run
once per mode in `--sync-modes`; the Atari script syncs by DDP only. From rank 0's TensorBoard events:

- SPS: global steps per second from the end of iteration 1 to the end of the last (the event wall times; this
  leaves out start-up and the first iteration's warm-up); the script's own `charts/SPS` (whole run) beside it;
- speedup = SPS(N) / SPS(1 rank, same script and mode), parallel efficiency = speedup / N;
- seconds per iteration in rollout, update and sync: medians over iterations 2.. of `perf/rollout_time`,
  `perf/update_time` and `perf/sync_time` (what sync covers differs per script and mode, see the notes in the output);
- the ceiling (`--independent`): N copies of the 1-rank run at once, copy i alone on core Ci, no process group between
  them; their summed SPS over the 1-rank run is what the machine allows N ranks before any sync (shared caches and
  memory bandwidth, the hypervisor), so a mode's speedup below it is what its sync costs.

Arguments after `--` go to every run, after the benchmark's own (so `-- --torch-threads 2` overrides the one thread).
Timing on a loaded machine is distorted: the output records the load average before and after the runs.
`python -m benchmark.scaling_model` extrapolates the result to more ranks.
"""

import os
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import tyro

from benchmark.common import (
    ROOT,
    SCRIPTS,
    check_load,
    last_lines,
    markdown_table,
    mpirun_launcher,
    output_paths,
    read_scalar_events,
    results_header,
    run_at_once,
    split_script_args,
    torchrun_launcher,
)

PIN_RANK = ROOT / "benchmark" / "pin_rank.py"
ATARI = "ppo_atari_multigpu.py"
ATARI_ENVS_PER_RANK = 8
DDP = "DDP"
"""the mode of the script without `--sync`"""
INDEPENDENT = "independent"
"""the rows of N independent 1-rank copies at once, one per core (the machine's ceiling)"""
INDEPENDENT_MEANS = (
    "N copies of the first mode's 1-rank run at the same time, copy i alone on core Ci, with no process group between "
    "them: SPS summed, seconds those of copy 0. Its speedup is what this machine gives N ranks before any sync "
    "(shared caches and memory bandwidth, the hypervisor's scheduling); a mode's speedup below it is its sync's cost"
)

# per script: (default env id, default env steps per rank per iteration)
SCRIPT_DEFAULTS = {
    "vpg_mpi.py": ("HalfCheetah-v5", 4000),
    "ppo_continuous_mpi.py": ("HalfCheetah-v5", 2048),
    ATARI: ("BreakoutNoFrameskip-v4", 1024),
}
GATHER_SYNC = (
    "the gather of every rank's rollout to rank 0 (which also waits for the slowest rank's rollout) and the broadcast "
    "of the weights; the rest of update is rank 0 learning alone on the world's batch"
)
# per (script, mode): what perf/sync_time covers; a script's modes are its keys here
SYNC_MEANS = {
    ("vpg_mpi.py", "allreduce"): (
        "the flat gradient allreduces of the update (1 policy step + 80 value steps per epoch)"
    ),
    ("vpg_mpi.py", "gather"): GATHER_SYNC,
    ("ppo_continuous_mpi.py", "allreduce"): (
        "the flat gradient allreduce after every minibatch plus one advantage-statistics collective per epoch"
    ),
    ("ppo_continuous_mpi.py", "gather"): GATHER_SYNC,
    (ATARI, DDP): (
        "the backward passes (DDP overlaps its allreduce with backward, so they cannot be timed apart) plus the "
        "explicit collectives; compare with the 1-rank row for the communication share"
    ),
}

# mpi_util's published throughput (Walker2d, 6-core Xeon X5680 + GTX 1070, rollouts gathered to rank 0), as quoted
# in the project's reference list: steps/s by number of processes
MPI_UTIL_SPS = {1: 546, 2: 1040, 3: 1712, 4: 2014, 6: 2100, 8: 2400, 9: 2484, 12: 2169}


TABLE_HEADERS = (
    "mode",
    "ranks (= cores)",
    "global batch / iteration",
    "SPS (iterations 2..)",
    "charts/SPS (whole run)",
    "speedup",
    "efficiency",
    "rollout s / it",
    "update s / it",
    "of which sync s / it",
)
"""the columns of a script's table (benchmark.scaling_model reads them back)"""


@dataclass
class Args:
    scripts: tuple[str, ...] = ("vpg_mpi.py", "ppo_continuous_mpi.py", ATARI)
    """the scripts to measure"""
    sync_modes: tuple[Literal["allreduce", "gather"], ...] = ("allreduce", "gather")
    """the `--sync` modes to run, for the scripts that have the flag (the Atari script always runs its DDP)"""
    launchers: tuple[Literal["torchrun", "mpirun"], ...] = ("torchrun",)
    """what starts N ranks: torchrun (collectives through gloo), mpirun (the MLP scripts' CPU collectives through
    MPI, --collectives mpi); rows of a launcher after the first read `MODE mpirun`, beside the same 1-rank baseline"""
    ranks: tuple[int, ...] = ()
    """the numbers of ranks (each on its own core) besides the 1-rank baseline, which always runs; default: 2, 4, 8,
    .. up to the usable cores, and the usable cores"""
    iterations: int = 6
    """iterations (epochs) per run; at least 2 (the first one is left out of SPS and the time split)"""
    rounds: int = 1
    """runs of every (script, mode, ranks), interleaved round by round (a VM's speed can drift between runs minutes
    apart); a row shows the run with the median SPS (the lower middle one for an even count), and each round's
    speedup, N ranks over the 1 rank of the same round, follows the table"""
    independent: bool = True
    """also run, per script and N, N independent 1-rank copies at once, one per core: the speedup the machine allows
    with no sync at all"""
    local_steps: int = 0
    """env steps per rank per iteration; 0 = the script's own default batch (VPG 4000, PPO 2048, Atari 8x128)"""
    env_id: str = ""
    """the env id for every script; empty = each script's default (HalfCheetah-v5, Breakout for Atari)"""
    out: Path = Path("benchmark_results/scaling")
    """output stem: writes OUT.md and OUT.png"""
    out_dir: Path | None = None
    """where the runs are launched (runs/ and logs/ land there, and are kept); default: a temporary folder"""
    notes: tuple[str, ...] = ()
    """paragraphs of prose under the header of the markdown file (what was run, how and why); the command shown there
    leaves them out"""
    max_load: float = 1.0
    """above this 1-minute load average at the start, the results file opens with a MEASURED UNDER LOAD warning"""


@dataclass
class Measurement:
    """One (script, mode, ranks) run reduced to the table's numbers."""

    script: str
    mode: str
    ranks: int
    global_batch: int
    iterations: int
    sps: float
    script_sps: float
    rollout: float
    update: float
    sync: float


def usable_cores() -> list[int]:
    """The cores this process may run on, sorted (rank r of a run is pinned to the r-th)."""
    return sorted(os.sched_getaffinity(0))


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


def budget_args(script: str, ranks: int, local_steps: int, iterations: int) -> list[str]:
    """Arguments giving `script` a batch of `local_steps` env steps per rank per iteration for `iterations`."""
    total = ["--total-timesteps", str(iterations * ranks * local_steps)]
    if script == "vpg_mpi.py":  # SpinningUp's global steps per epoch
        return ["--steps-per-epoch", str(ranks * local_steps), *total]
    if script == "ppo_continuous_mpi.py":
        return ["--num-steps", str(local_steps), *total]
    if local_steps % ATARI_ENVS_PER_RANK:
        raise SystemExit(
            f"benchmark.scaling: error: --local-steps must be a multiple of {ATARI_ENVS_PER_RANK} for Atari"
        )
    return [
        "--local-num-envs",
        str(ATARI_ENVS_PER_RANK),
        "--num-steps",
        str(local_steps // ATARI_ENVS_PER_RANK),
        *total,
    ]


def script_args(script: str, mode: str, ranks: int, local_steps: int, iterations: int) -> list[str]:
    """One torch thread per rank (and one env thread for Atari), the sync mode, and the batch for `iterations`."""
    args = ["--torch-threads", "1"]
    args += ["--env-threads", "1"] if script == ATARI else []
    args += [] if mode == DDP else ["--sync", mode]
    return [*args, *budget_args(script, ranks, local_steps, iterations)]


def launch_command(script: str, ranks: int, cores: list[int], args: list[str], launcher: str = "torchrun") -> list[str]:
    """1 rank: `taskset -c C0 python SCRIPT ARGS`. N ranks: `taskset -c C0,..,C(N-1)` around torchrun (or mpirun),
    which launches benchmark/pin_rank.py to pin local rank r to core Cr before it becomes `python SCRIPT ARGS`."""
    if ranks > len(cores):
        raise ValueError(f"{ranks} ranks but only {len(cores)} usable cores")
    pinned = ["taskset", "-c", ",".join(str(core) for core in cores[:ranks])]
    if ranks == 1:
        return [*pinned, sys.executable, str(ROOT / script), *args]
    if launcher == "mpirun":
        return [*pinned, *mpirun_launcher(ranks), str(PIN_RANK), str(ROOT / script), *args, "--collectives", "mpi"]
    return [*pinned, *torchrun_launcher(ranks), str(PIN_RANK), str(ROOT / script), *args]


def base_mode(mode: str) -> str:
    """The sync mode of a row's mode (`allreduce mpirun` -> `allreduce`): its 1-rank baseline and its meaning."""
    return mode.split()[0]


def median_after_first(events: list[tuple[float, int, float]]) -> float:
    """Median of a per-iteration series, leaving out the first iteration when there are others."""
    values = [value for _, _, value in events]
    return statistics.median(values[1:] if len(values) > 1 else values)


def measure(run_dir: Path, script: str, mode: str, ranks: int) -> Measurement:
    """Reduce one run's event files to a Measurement."""
    scalars = read_scalar_events(run_dir)
    sps_events = scalars.get("charts/SPS", [])
    if len(sps_events) < 2:
        raise SystemExit(f"benchmark.scaling: error: {run_dir} logged {len(sps_events)} iterations; need at least 2")
    (first_wall, first_step, _), (last_wall, last_step, script_sps) = sps_events[0], sps_events[-1]
    return Measurement(
        script=script,
        mode=mode,
        ranks=ranks,
        global_batch=(last_step - first_step) // (len(sps_events) - 1),
        iterations=len(sps_events),
        sps=(last_step - first_step) / max(last_wall - first_wall, 1e-9),
        script_sps=script_sps,
        rollout=median_after_first(scalars["perf/rollout_time"]),
        update=median_after_first(scalars["perf/update_time"]),
        sync=median_after_first(scalars["perf/sync_time"]),
    )


def combine_copies(copies: list[Measurement]) -> Measurement:
    """N independent copies as one row: batches and SPS summed, seconds per iteration those of copy 0 (core C0)."""
    first = copies[0]
    return Measurement(
        script=first.script,
        mode=INDEPENDENT,
        ranks=len(copies),
        global_batch=sum(m.global_batch for m in copies),
        iterations=first.iterations,
        sps=sum(m.sps for m in copies),
        script_sps=sum(m.script_sps for m in copies),
        rollout=first.rollout,
        update=first.update,
        sync=first.sync,
    )


def scaling_table(measurements: list[Measurement]) -> str:
    """One script's rows, mode by mode: SPS, speedup and efficiency against the mode's 1-rank row, seconds per
    iteration."""
    baselines = {m.mode: m for m in measurements if m.ranks == 1}
    rows = []
    for m in measurements:
        speedup = m.sps / baselines.get(base_mode(m.mode), measurements[0]).sps  # the ceiling's: the first mode's
        rows.append(
            [
                m.mode,
                m.ranks,
                f"{m.global_batch:,}",
                f"{m.sps:,.0f}",
                f"{m.script_sps:,.0f}",
                f"{speedup:.2f}",
                f"{speedup / m.ranks:.0%}",
                f"{m.rollout:.3f}",
                f"{m.update:.3f}",
                f"{m.sync:.3f}",
            ]
        )
    return markdown_table(TABLE_HEADERS, rows)


def round_speedups(rounds: dict[tuple[str, str, int], list[Measurement]]) -> str:
    """One line per (mode, N ranks): each round's SPS(N ranks) / SPS(1 rank), both of that round, and their median."""
    lines = []
    first_mode = next(iter(rounds))[1]
    for (_, mode, ranks), measurements in rounds.items():
        if ranks > 1:
            baselines = rounds[measurements[0].script, first_mode if mode == INDEPENDENT else base_mode(mode), 1]
            speedups = [m.sps / base.sps for m, base in zip(measurements, baselines, strict=True)]
            each = ", ".join(f"{speedup:.2f}" for speedup in speedups)
            lines.append(f"- {mode}, {ranks} ranks: speedup per round {each}; median {statistics.median(speedups):.2f}")
    return "\n".join(lines) + "\n"


def reference_table() -> str:
    """mpi_util's published SPS with its speedup and efficiency."""
    base = MPI_UTIL_SPS[1]
    rows = [[n, f"{sps:,}", f"{sps / base:.2f}", f"{sps / base / n:.0%}"] for n, sps in MPI_UTIL_SPS.items()]
    return markdown_table(["processes", "steps/s", "speedup", "efficiency"], rows)


def plot(results: dict[tuple[str, str], list[Measurement]], path: Path) -> None:
    """Left: SPS against ranks per script and mode, ideal linear scaling dashed. Right: seconds per iteration, split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5.5))
    labels, rollout, update, sync = [], [], [], []
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
    left.set_xlabel("ranks, one core each")
    left.set_ylabel("env steps per second")
    left.set_title("weak scaling (dashed: linear from 1 rank on 1 core)")
    left.legend(fontsize="small")
    left.grid(alpha=0.3)
    positions = range(len(labels))
    right.bar(positions, rollout, label="rollout")
    right.bar(positions, update, bottom=rollout, label="update (without sync)")
    right.bar(positions, sync, bottom=[a + b for a, b in zip(rollout, update, strict=True)], label="sync")
    right.set_xticks(list(positions), labels, fontsize="x-small", rotation=40, ha="right")
    right.set_ylabel("seconds per iteration (median)")
    right.set_title("time per iteration (rank 0)")
    right.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    """Run every (script, mode, ranks), write OUT.md and OUT.png; returns their paths."""
    argv = sys.argv[1:] if argv is None else argv
    own, extra = split_script_args(argv)
    args = tyro.cli(Args, args=own, description=__doc__)
    unknown = [script for script in args.scripts if script not in SCRIPTS]
    if unknown or args.iterations < 2 or args.rounds < 1:
        raise SystemExit(f"benchmark.scaling: error: scripts must be in {SCRIPTS}, iterations >= 2, rounds >= 1")
    cores = usable_cores()
    ranks_to_run = rank_counts(args.ranks, len(cores))
    work_dir = args.out_dir.resolve() if args.out_dir else Path(tempfile.mkdtemp(prefix="ddrl_scaling_"))
    load_before, warning = check_load(args.max_load)
    rounds: dict[tuple[str, str, int], list[Measurement]] = {}  # (script, mode, ranks): one per round
    try:
        for round_index, script in ((r, script) for r in range(args.rounds) for script in args.scripts):
            default_env, default_steps = SCRIPT_DEFAULTS[script]
            modes = script_modes(script, args.sync_modes)
            jobs = [(mode, ranks, args.launchers[0]) for mode in modes for ranks in ranks_to_run]
            jobs += [  # the other launchers' N ranks, beside the same 1-rank baseline (mpirun: the MLP scripts only)
                (f"{mode} {launcher}", ranks, launcher)
                for launcher in args.launchers[1:]
                if script != ATARI
                for mode in modes
                for ranks in ranks_to_run
                if ranks > 1
            ]
            jobs += [(INDEPENDENT, ranks, "") for ranks in ranks_to_run if ranks > 1 and args.independent]
            for mode, ranks, launcher in jobs:
                name = f"scaling__{Path(script).stem}__{mode.replace(' ', '_')}__{ranks}ranks"
                name += f"__round{round_index + 1}" if args.rounds > 1 else ""
                # the ceiling: `ranks` copies of the first mode's 1-rank run, copy i pinned to core Ci
                independent = mode == INDEPENDENT
                names = [f"{name}__copy{i}" for i in range(ranks)] if independent else [name]
                run_mode, run_ranks = (modes[0], 1) if independent else (base_mode(mode), ranks)
                commands = []
                for i, run_name in enumerate(names):
                    shutil.rmtree(work_dir / "runs" / run_name, ignore_errors=True)
                    run_args = [
                        *("--env-id", args.env_id or default_env, "--run-name", run_name),
                        *script_args(script, run_mode, run_ranks, args.local_steps or default_steps, args.iterations),
                        *extra,
                    ]
                    commands.append(launch_command(script, run_ranks, cores[i:], run_args, launcher))
                print(f"{script} {mode} on {ranks} core(s): {' & '.join(map(shlex.join, commands))}", flush=True)
                log_paths = [work_dir / "logs" / f"{run_name}.log" for run_name in names]
                codes = run_at_once(commands, work_dir, log_paths)
                for run_name, log_path, code in zip(names, log_paths, codes, strict=True):
                    if code:
                        raise SystemExit(
                            f"benchmark.scaling: error: {run_name} failed; {log_path}:\n{last_lines(log_path)}"
                        )
                copies = [measure(work_dir / "runs" / run_name, script, mode, 1) for run_name in names]
                measurement = combine_copies(copies) if independent else replace(copies[0], ranks=ranks)
                print(f"  SPS {measurement.sps:,.0f} (charts/SPS {measurement.script_sps:,.0f})", flush=True)
                rounds.setdefault((script, mode, ranks), []).append(measurement)
    finally:
        if args.out_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    results: dict[tuple[str, str], list[Measurement]] = {}
    for (script, mode, _), measurements in rounds.items():
        results.setdefault((script, mode), []).append(sorted(measurements, key=lambda m: m.sps)[(args.rounds - 1) // 2])

    table_path, png_path = output_paths(args.out)
    plot(results, png_path)
    batch = f"{args.local_steps:,}" if args.local_steps else "each script's default"
    facts = [
        f"weak scaling: {args.iterations} iterations per run, a fixed batch per rank ({batch} env steps per rank per "
        "iteration)",
        f"pinning: the usable cores C0, C1, .. are {', '.join(map(str, cores))}; 1 rank runs as `taskset -c C0 python "
        "SCRIPT --torch-threads 1`, N ranks as `taskset -c C0,..,C(N-1) python -m torch.distributed.run --standalone "
        "--nproc_per_node N benchmark/pin_rank.py SCRIPT --torch-threads 1`, pin_rank.py pinning local rank r to core "
        "Cr; the Atari script also gets --env-threads 1",
        f"load average (1, 5, 15 min) before the runs: {load_before}",
    ]
    text = results_header("Scaling: N ranks on N cores", "benchmark.scaling", argv, facts, args.notes, warning)
    text += f"\n![scaling]({png_path.name})\n"
    for script in args.scripts:
        measurements = [m for (name, _), rows in results.items() if name == script for m in rows]
        env_id = args.env_id or SCRIPT_DEFAULTS[script][0]
        text += f"\n## {script} on {env_id}\n\n{scaling_table(measurements)}\n"
        if args.rounds > 1:
            text += round_speedups({key: value for key, value in rounds.items() if key[0] == script}) + "\n"
        for mode in dict.fromkeys(m.mode for m in measurements if m.mode != INDEPENDENT):
            text += f"sync with {mode} means {SYNC_MEANS[script, base_mode(mode)]}.\n\n"
        if args.independent and len(ranks_to_run) > 1:
            text += f"{INDEPENDENT} means {INDEPENDENT_MEANS}.\n\n"
    text += (
        "## Reference: mpi_util\n\nmpi_util's published throughput (Walker2d, 6-core Xeon X5680 + GTX 1070, rollouts "
        "gathered to rank 0), as listed in the project's references; 1 -> 2 processes: 546 -> 1040 steps/s.\n\n"
    )
    text += reference_table()
    table_path.write_text(text)
    print(f"wrote {table_path} and {png_path}")
    return table_path, png_path


if __name__ == "__main__":
    main()
