"""Weak scaling: environment steps per second (SPS) against the number of ranks, with the time split per iteration.

    python -m benchmark.scaling --scripts vpg_mpi.py ppo_continuous_mpi.py --ranks 1 2 --out benchmark/results/scaling

Each script runs once per rank count N under torchrun with a fixed batch per rank (`--local-steps` env steps per
iteration; the global batch grows with N) for `--iterations` iterations. From its TensorBoard events:

- SPS: global steps per second from the end of iteration 1 to the end of the last (the event wall times; this
  leaves out start-up and the first iteration's warm-up); the script's own `charts/SPS` (whole run) beside it;
- speedup = SPS(N) / SPS(1), parallel efficiency = speedup / N;
- seconds per iteration in rollout, update and gradient sync: medians over iterations 2.. of `perf/rollout_time`,
  `perf/update_time` and `perf/sync_time` (what sync covers differs per script, see the notes in the output).

Arguments after `--` go to every run (e.g. `-- --torch-threads 1`). Each rank gets the scripts' default torch
threads (usable cores / ranks on the node) unless they say otherwise. Timing on a loaded machine is distorted:
the output records the load average before and after the runs.
"""

import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

from benchmark.common import (
    SCRIPTS,
    check_load,
    last_lines,
    markdown_table,
    output_paths,
    read_scalar_events,
    results_header,
    run_streaming,
    split_script_args,
    torchrun_command,
)

# per script: (default env id, default env steps per rank per iteration, what perf/sync_time covers)
SCRIPT_DEFAULTS = {
    "vpg_mpi.py": (
        "HalfCheetah-v5",
        4000,
        "the flat gradient allreduces of the update (1 policy step + 80 value steps per epoch)",
    ),
    "ppo_continuous_mpi.py": (
        "HalfCheetah-v5",
        2048,
        "the flat gradient allreduce after every minibatch plus one advantage-statistics collective per epoch",
    ),
    "ppo_atari_multigpu.py": (
        "BreakoutNoFrameskip-v4",
        1024,
        "the backward passes (DDP overlaps its allreduce with backward, so they cannot be timed apart) plus the "
        "explicit collectives; compare with the 1-rank row for the communication share",
    ),
}
ATARI_ENVS_PER_RANK = 8
DEFAULT_BATCH_TEXT = "each script's default"

# mpi_util's published throughput (Walker2d, 6-core Xeon X5680 + GTX 1070, rollouts gathered to rank 0), as quoted
# in the project's reference list: steps/s by number of processes
MPI_UTIL_SPS = {1: 546, 2: 1040, 3: 1712, 4: 2014, 6: 2100, 8: 2400, 9: 2484, 12: 2169}


@dataclass
class Args:
    scripts: tuple[str, ...] = ("vpg_mpi.py", "ppo_continuous_mpi.py", "ppo_atari_multigpu.py")
    """the scripts to measure"""
    ranks: tuple[int, ...] = (1, 2)
    """the numbers of ranks to run (the first is the baseline of speedup and efficiency; put 1 first)"""
    iterations: int = 6
    """iterations (epochs) per run; at least 2 (the first one is left out of SPS and the time split)"""
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
    """One (script, ranks) run reduced to the table's numbers."""

    script: str
    ranks: int
    global_batch: int
    iterations: int
    sps: float
    script_sps: float
    rollout: float
    update: float
    sync: float


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


def median_after_first(events: list[tuple[float, int, float]]) -> float:
    """Median of a per-iteration series, leaving out the first iteration when there are others."""
    values = [value for _, _, value in events]
    return statistics.median(values[1:] if len(values) > 1 else values)


def measure(run_dir: Path, script: str, ranks: int) -> Measurement:
    """Reduce one run's event files to a Measurement."""
    scalars = read_scalar_events(run_dir)
    sps_events = scalars.get("charts/SPS", [])
    if len(sps_events) < 2:
        raise SystemExit(f"benchmark.scaling: error: {run_dir} logged {len(sps_events)} iterations; need at least 2")
    (first_wall, first_step, _), (last_wall, last_step, script_sps) = sps_events[0], sps_events[-1]
    return Measurement(
        script=script,
        ranks=ranks,
        global_batch=(last_step - first_step) // (len(sps_events) - 1),
        iterations=len(sps_events),
        sps=(last_step - first_step) / max(last_wall - first_wall, 1e-9),
        script_sps=script_sps,
        rollout=median_after_first(scalars["perf/rollout_time"]),
        update=median_after_first(scalars["perf/update_time"]),
        sync=median_after_first(scalars["perf/sync_time"]),
    )


def scaling_table(measurements: list[Measurement]) -> str:
    """One script's rows: ranks, batch, SPS, speedup and efficiency against the first row, seconds per iteration."""
    base = measurements[0]
    rows = []
    for m in measurements:
        speedup = m.sps / base.sps * base.ranks
        rows.append(
            [
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
    headers = [
        "ranks",
        "global batch / iteration",
        "SPS (iterations 2..)",
        "charts/SPS (whole run)",
        "speedup",
        "efficiency",
        "rollout s / it",
        "update s / it",
        "of which sync s / it",
    ]
    return markdown_table(headers, rows)


def reference_table() -> str:
    """mpi_util's published SPS with its speedup and efficiency."""
    base = MPI_UTIL_SPS[1]
    rows = [[n, f"{sps:,}", f"{sps / base:.2f}", f"{sps / base / n:.0%}"] for n, sps in MPI_UTIL_SPS.items()]
    return markdown_table(["processes", "steps/s", "speedup", "efficiency"], rows)


def plot(results: dict[str, list[Measurement]], path: Path) -> None:
    """Left: SPS against ranks per script with ideal linear scaling dashed. Right: seconds per iteration, split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels, rollout, update, sync = [], [], [], []
    for color, (script, measurements) in enumerate(results.items()):
        ranks = [m.ranks for m in measurements]
        left.plot(ranks, [m.sps for m in measurements], "o-", color=f"C{color}", label=script)
        base = measurements[0]
        left.plot(ranks, [base.sps * n / base.ranks for n in ranks], "--", color=f"C{color}", alpha=0.5)
        for m in measurements:
            labels.append(f"{Path(script).stem.rsplit('_', 1)[0]}\n{m.ranks} rank{'s' * (m.ranks > 1)}")
            rollout.append(m.rollout)
            update.append(m.update - m.sync)
            sync.append(m.sync)
    left.set_xticks(sorted({m.ranks for measurements in results.values() for m in measurements}))
    left.set_xlabel("ranks")
    left.set_ylabel("env steps per second")
    left.set_title("weak scaling (dashed: linear)")
    left.legend(fontsize="small")
    left.grid(alpha=0.3)
    positions = range(len(labels))
    right.bar(positions, rollout, label="rollout")
    right.bar(positions, update, bottom=rollout, label="update (without sync)")
    right.bar(positions, sync, bottom=[a + b for a, b in zip(rollout, update, strict=True)], label="sync")
    right.set_xticks(list(positions), labels, fontsize="x-small")
    right.set_ylabel("seconds per iteration (median)")
    right.set_title("time per iteration")
    right.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    """Run every (script, ranks), write OUT.md and OUT.png; returns their paths."""
    argv = sys.argv[1:] if argv is None else argv
    own, extra = split_script_args(argv)
    args = tyro.cli(Args, args=own, description=__doc__)
    unknown = [script for script in args.scripts if script not in SCRIPTS]
    if unknown or not args.ranks or min(args.ranks) < 1 or args.iterations < 2:
        raise SystemExit(f"benchmark.scaling: error: scripts must be in {SCRIPTS}, ranks >= 1, iterations >= 2")
    work_dir = args.out_dir.resolve() if args.out_dir else Path(tempfile.mkdtemp(prefix="ddrl_scaling_"))
    load_before, warning = check_load(args.max_load)
    results: dict[str, list[Measurement]] = {}
    try:
        for script in args.scripts:
            default_env, default_steps, _ = SCRIPT_DEFAULTS[script]
            local_steps = args.local_steps or default_steps
            for ranks in args.ranks:
                name = f"scaling__{Path(script).stem}__{ranks}ranks"
                shutil.rmtree(work_dir / "runs" / name, ignore_errors=True)
                script_args = [
                    *("--env-id", args.env_id or default_env, "--run-name", name),
                    *budget_args(script, ranks, local_steps, args.iterations),
                    *extra,
                ]
                command = torchrun_command(script, ranks, script_args)
                print(f"{script} on {ranks} rank(s): {shlex.join(command)}", flush=True)
                log_path = work_dir / "logs" / f"{name}.log"
                if run_streaming(command, work_dir, log_path):
                    raise SystemExit(f"benchmark.scaling: error: {name} failed; {log_path}:\n{last_lines(log_path)}")
                measurement = measure(work_dir / "runs" / name, script, ranks)
                print(f"  SPS {measurement.sps:,.0f} (charts/SPS {measurement.script_sps:,.0f})", flush=True)
                results.setdefault(script, []).append(measurement)
    finally:
        if args.out_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)

    table_path, png_path = output_paths(args.out)
    plot(results, png_path)
    facts = [
        f"weak scaling: {args.iterations} iterations per run, a fixed batch per rank "
        f"({args.local_steps or DEFAULT_BATCH_TEXT} env steps per rank per iteration)",
        f"load average (1, 5, 15 min) before the runs: {load_before}",
    ]
    text = results_header("Scaling: SPS against ranks", "benchmark.scaling", argv, facts, args.notes, warning)
    text += f"\n![scaling]({png_path.name})\n"
    for script, measurements in results.items():
        env_id = args.env_id or SCRIPT_DEFAULTS[script][0]
        text += f"\n## {script} on {env_id}\n\n{scaling_table(measurements)}"
        text += f"\nsync here means {SCRIPT_DEFAULTS[script][2]}.\n"
    text += (
        "\n## Reference: mpi_util\n\nmpi_util's published throughput (Walker2d, 6-core Xeon X5680 + GTX 1070, rollouts "
        "gathered to rank 0), as listed in the project's references; 1 -> 2 processes: 546 -> 1040 steps/s.\n\n"
    )
    text += reference_table()
    table_path.write_text(text)
    print(f"wrote {table_path} and {png_path}")
    return table_path, png_path


if __name__ == "__main__":
    main()
