"""Per-core weak scaling: N ranks on N cores against 1 rank on 1 core, each script and each sync mode; and a paper
model of each mode's efficiency at more ranks, from such a table's 1- and 2-rank rows.

    python -m benchmark.scaling --out benchmark/results/scaling
    python -m benchmark.scaling --model-from benchmark/results/scaling.md --out benchmark/results/scaling_model

Every rank keeps its batch, runs one torch thread and has a core of its own (pinned_facts), N ranks launched by the
script's own `--nprocs`. A row gives SPS and rank 0's time split (common.measure), the speedup over 1 rank of the same
mode and the efficiency = speedup / N. Arguments after `--` go to every run, after the benchmark's own (so `--
--torch-threads 2` overrides the one thread). With --model-from, no runs: the predictions on ASSUMPTIONS.
"""

import bisect
import math
import re
import shlex
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Ge

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
TABLE_HEADERS = (
    "mode | ranks (= cores) | global batch / iteration | SPS (iterations 2..) | charts/SPS (whole run) | speedup | "
    "efficiency | rollout s / it | update s / it | of which sync s / it"
)
"""the columns of a script's table (--model-from reads them back)"""


Variant = Literal["gloo", "NCCL", "shm", "waits", "MPI", "linear", "fitted"]
GATHERED = "gather, broadcast x (N-1)"
VARIANTS: dict[str, dict[Variant, str]] = {
    "allreduce": {"gloo": "gloo ring: latency x (N-1)", "NCCL": "NCCL tree: latency x log2 N"},
    "allreduce shm": {"shm": "shared memory, one node: c x (N-1)", "waits": "shared memory, one node: c x log2 N"},
    "allreduce mpirun": {"MPI": "Open MPI, one node: latency x log2 N"},
    "gather": {"linear": f"update x N; {GATHERED}", "fitted": f"update fitted at 1, 2 ranks; {GATHERED}"},
}
"""per mode (DDP as allreduce, `gather mpirun` as gather): the model's variants, each saying how time grows"""
MAX_RANKS = 2**30
"""where the search for the 50% point gives up"""
INPUT_COLUMNS = (
    "script | mode | T(1) | u (update, 1 rank) | s (sync, 1 rank) | sync, 2 ranks | c (added by rank 2) | "
    "L(2) / L(1) (learner update)"
)
PREDICTION_COLUMNS = "script | mode | model: what grows with N | ranks | SPS relative to 1 rank | efficiency | measured"


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
    rounds: Annotated[int, Ge(1)] = 1
    """rounds of all runs, interleaved (a VM's speed drifts); rows show the median run, each round's speedup follows"""
    independent: bool = True
    """also run, per script and N, N independent 1-rank copies at once, one per core (INDEPENDENT_MEANS)"""
    model_from: Path | None = None
    """no runs: the model's predictions from this results file of benchmark.scaling (its 1- and 2-rank rows)"""
    predict: tuple[Annotated[int, Ge(1)], ...] = (8, 16, 64, 512)
    """with --model-from, the rank counts to predict (2, the measured one, is shown beside its measurement)"""
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


def scaling_table(measurements: list[common.Measurement]) -> str:
    """One script's rows: SPS, speedup and efficiency against the mode's 1-rank row, seconds per iteration."""
    baselines = {m.mode: m for m in measurements if m.ranks == 1}
    first_mode = next((m.mode for m in measurements if m.mode != INDEPENDENT), None)  # the ceiling's baseline
    rows = []
    for m in measurements:
        baseline = baselines.get(first_mode if m.mode == INDEPENDENT else m.mode.split()[0])  # `MODE mpirun`: MODE's
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
        key = (measurements[0].script, first_mode if mode == INDEPENDENT else mode.split()[0], 1)
        if ranks > 1 and key in rounds and len(rounds[key]) == len(measurements):
            baselines = rounds[key]
            speedups = [m.sps / base.sps for m, base in zip(measurements, baselines, strict=True)]
            each = ", ".join(f"{speedup:.2f}" for speedup in speedups)
            lines.append(f"- {mode}, {ranks} ranks: speedup per round {each}; median {statistics.median(speedups):.2f}")
    return "\n".join(lines) + "\n"


def plot(results: dict[tuple[str, str], list[common.Measurement]], axes: list) -> None:
    """Left: SPS against ranks per script and mode, ideal linear scaling dashed. Right: seconds per iteration, split."""
    left, right = axes
    names = {key: f"{Path(key[0]).stem.rsplit('_', 1)[0]} {key[1]}" for key in results}
    rows = [(f"{names[key]}, {m.ranks} rank{'s' * (m.ranks > 1)}", m) for key, found in results.items() for m in found]
    for color, (key, measurements) in enumerate(results.items()):
        ranks = [m.ranks for m in measurements]
        left.plot(ranks, [m.sps for m in measurements], "o-", color=f"C{color}", label=names[key])
        left.plot(ranks, [measurements[0].sps * n for n in ranks], "--", color=f"C{color}", alpha=0.5)
    left.set_xticks(sorted({m.ranks for measurements in results.values() for m in measurements}))
    left.set(xlabel="ranks, one core each", ylabel="env steps per second")
    left.set_title("weak scaling (dashed: linear from 1 rank on 1 core)")
    left.legend(fontsize="small")
    left.grid(alpha=0.3)
    positions = range(len(rows))
    rollout = [m.rollout for _, m in rows]
    update = [m.update - m.sync for _, m in rows]
    right.bar(positions, rollout, label="rollout")
    right.bar(positions, update, bottom=rollout, label="update (without sync)")
    below = [a + b for a, b in zip(rollout, update, strict=True)]
    right.bar(positions, [m.sync for _, m in rows], bottom=below, label="sync")
    right.set_xticks(list(positions), [label for label, _ in rows], fontsize="x-small", rotation=40, ha="right")
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
    run_mode = script_modes(script, args.sync_modes)[0] if independent else mode.split()[0]
    run_ranks = 1 if independent else ranks
    commands = {}
    for i, run_name in enumerate([f"{name}__copy{i}" for i in range(ranks)] if independent else [name]):
        run_args = ["--env-id", common.defaults(script).env_id, "--run-name", run_name]
        run_args += [*script_args(script, run_mode, run_ranks, args.local_steps, args.iterations), *extra]
        commands[run_name] = common.script_command(common.ROOT / script, run_args, run_ranks, launcher, cores[i:])
    print(f"{script} {mode} on {ranks} core(s): {' & '.join(map(shlex.join, commands.values()))}", flush=True)
    run_dirs = common.run_logged(commands, work_dir, at_once=True)
    copies = [common.measure(run_dir, script, mode, 1) for run_dir in run_dirs]
    total = {key: sum(getattr(m, key) for m in copies) for key in ("global_batch", "sps", "script_sps")}
    measurement = replace(copies[0], ranks=ranks, **(total if independent else {}))
    print(f"  SPS {measurement.sps:,.0f} (charts/SPS {measurement.script_sps:,.0f})", flush=True)
    return measurement


@dataclass
class Seconds:
    """A mode's measured seconds per iteration (rank 0): the 1-rank iteration (global batch / SPS), update and sync
    (within the update; with DDP, the backward passes too), the 2-rank sync and update, and the 2-rank efficiency."""

    iteration: float
    update: float
    sync1: float
    sync2: float
    update2: float
    efficiency2: float

    learner = property(lambda self: self.update - self.sync1, doc="the 1-rank update without its sync")
    learner2 = property(lambda self: self.update2 - self.sync2, doc="the 2-rank update without its sync")
    added = property(lambda self: max(self.sync2 - self.sync1, 0.0), doc="c: the sync the second rank added")


def read_scaling(text: str) -> dict[tuple[str, str], Seconds]:
    """Every (script, mode) of a benchmark.scaling results file with both a 1- and a 2-rank row."""
    headers = TABLE_HEADERS.split(" | ")
    mode, ranks, batch, sps, _, _, efficiency_, _, update, sync = headers
    rows: dict[tuple[str, str], dict[int, dict[str, str]]] = {}
    for section in re.split("^## ", text, flags=re.MULTILINE)[1:]:  # `## SCRIPT on ENV`, then its table
        for row in (dict(zip(headers, cells, strict=True)) for cells in common.table_rows(section, mode)):
            rows.setdefault((section.split(" on ")[0], row[mode]), {})[int(row[ranks])] = row

    def number(row: dict[str, str], column: str) -> float:
        return float(row[column].replace(",", "").rstrip("%"))

    found = {}
    for (script, mode), by_ranks in rows.items():
        one = by_ranks.get(1) or rows.get((script, mode.split()[0]), {}).get(1)  # `MODE mpirun`: MODE's 1 rank
        if one and 2 in by_ranks:
            two = by_ranks[2]
            iteration = number(one, batch) / number(one, sps)
            numbers = [number(row, column) for row, column in ((one, update), (one, sync), (two, sync), (two, update))]
            found[script, mode] = Seconds(iteration, *numbers, number(two, efficiency_) / 100)
    return found


def efficiency(seconds: Seconds, mode: str, ranks: int, variant: Variant) -> float:
    """T(1) / T(N), the predicted speedup over 1 rank divided by N, with T(N) as ASSUMPTIONS says."""
    outside_update = seconds.iteration - seconds.update
    if mode.split()[0] == "gather":
        per_rank = seconds.learner if variant == "linear" else max(seconds.learner2 - seconds.learner, 0.0)
        learner = seconds.learner + per_rank * (ranks - 1)
        return seconds.iteration / (outside_update + learner + seconds.sync1 + seconds.added * (ranks - 1))
    growth = ranks - 1 if variant in ("gloo", "shm") else math.log2(ranks)  # g(N): an allreduce's time, N = 2's as 1
    return seconds.iteration / (outside_update + seconds.update + seconds.added * growth)


def stops_paying(seconds: Seconds, mode: str, variant: Variant) -> int | None:
    """The fewest ranks whose efficiency is below 50% (efficiency falls with N in every mode), None up to 2^30."""

    def stops(ranks: int) -> bool:
        return efficiency(seconds, mode, ranks, variant) < 0.5  # where a mode no longer pays for its ranks

    first = bisect.bisect_left(range(MAX_RANKS + 1), True, lo=1, key=stops)  # binary search: stops(N) rises with N
    return first if first <= MAX_RANKS else None


ASSUMPTIONS = """\
## Assumptions

Weak scaling (each rank keeps its batch), rank 0's seconds per iteration. T(1) is the measured 1-rank iteration
(global batch / SPS, iterations 2..); u and s are its update and the sync within it; c = sync(2 ranks) - sync(1 rank)
is the communication the second rank added (for DDP the sync also holds the backward passes, which the difference
removes). The efficiency at N ranks is T(1) / T(N), the SPS relative to 1 rank N x T(1) / T(N).

- **allreduce** (and DDP): T(N) = T(1) + c x g(N); rollout, GAE, logging and the local update stay as at 1 rank,
  and c is latency: the MLPs' flat gradients are tens of kB (a ring's bandwidth term, 2(N-1)/N, at most doubles).
  Gloo runs rings on CPU, 2(N-1) steps: g(N) = N-1. NCCL switches small messages to trees, and under mpirun
  (`allreduce mpirun`) Open MPI's tuned allreduce takes recursive doubling for messages this small (log2 N rounds
  through shared memory): g(N) = log2 N. Both are 1 at N = 2. The MLP scripts' `allreduce` rows under torchrun on one
  node go through ddrl's shared-memory segment, where every rank reads every rank's input (g(N) = N-1, pessimistic)
  and waits for the slowest; where c is mostly that wait (the sync of 2 ranks, minus one allreduce's microseconds
  per step), it grows as the largest of N ranks' step times does, about log2 N (g(N) = log2 N, optimistic).
- **gather** (either launcher): T(N) = T(1) - u + L(N) + s + c x (N-1): rank 0 learns alone on the N ranks' rollouts
  in L(N) seconds, and receives N-1 rollouts and sends the weights to N-1 peers. *update x N*: L(N) = N x (u - s),
  linear in the world batch; pessimistic, as an update of a fixed number of minibatches (PPO) or steps (VPG) costs
  partly per step, whatever the batch. *fitted*: L(N) = (u - s) + (L(2) - (u - s)) x (N-1), its fixed and per-rank
  parts fitted at 1 and 2 ranks (the inputs give L(2) / L(1)); optimistic, as the per-sample share grows with N.

Not modelled: the network between nodes (c was measured on one machine), stragglers (the slowest of N rollouts sets
every iteration's pace; at 2 ranks the gather's wait for the slower rank is inside c), rank 0's memory for N
rollouts, contention between ranks for memory bandwidth, and hierarchical or asynchronous variants of either mode.
"""


def write_model(args: Args, argv) -> Path:
    """OUT.md of the model: the inputs, the predictions, and where each mode stops paying; returns its path."""
    text = args.model_from.read_text()
    measured = read_scaling(text)
    if not measured:
        raise SystemExit(f"benchmark.scaling: error: {args.model_from} has no script with both 1- and 2-rank rows")
    source_facts = [line[2:] for line in text.splitlines() if line.startswith(("- date:", "- machine:", "- checkout:"))]
    warning = f"THE INPUT WAS MEASURED UNDER LOAD ({args.model_from} says so): so are these predictions."
    warning = warning if "MEASURED UNDER LOAD" in text else None
    inputs = []
    predictions = []
    verdicts = []
    for (script, mode), seconds in measured.items():
        gather = mode.split()[0] == "gather"
        numbers = (seconds.iteration, seconds.update, seconds.sync1, seconds.sync2, seconds.added)
        learner_ratio = f"{seconds.learner2 / max(seconds.learner, 1e-9):.2f}" if gather else ""
        inputs.append([script, mode, *(f"{number:.3f}" for number in numbers), learner_ratio])
        kind = "gather" if gather else "allreduce mpirun" if mode.endswith("mpirun") else "allreduce"
        kind = "allreduce shm" if mode == "allreduce" else kind  # the MLP scripts under torchrun, on one node
        for variant, label in VARIANTS[kind].items():
            for ranks in sorted({2, *args.predict}):
                eff = efficiency(seconds, mode, ranks, variant)
                shown = f"{seconds.efficiency2:.0%}" if ranks == 2 else ""
                predictions.append([script, mode, label, ranks, f"{ranks * eff:,.2f}", f"{eff:.0%}", shown])
            limit = stops_paying(seconds, mode, variant)
            where = f"below 50% from {limit:,} ranks" if limit else f"not below 50% up to {MAX_RANKS:,} ranks"
            verdicts.append(f"- {script} {mode} ({label}): {where}")
    body = "\n" + ASSUMPTIONS + "\n## Inputs (seconds per iteration, rank 0)\n\n"
    body += common.markdown_table(INPUT_COLUMNS, inputs) + "\n## Predictions\n\n"
    body += common.markdown_table(PREDICTION_COLUMNS, predictions)
    body += "\n## Where each mode stops paying (efficiency below 50%)\n\n" + "\n".join(verdicts) + "\n"
    title = "Scaling model: efficiency at more ranks, from the 1- and 2-rank measurements"
    facts = [f"input: {args.model_from}, measured with {'; '.join(source_facts)}"]
    return common.write_results(args, argv, title, facts, body, ("", warning))


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    """Run every (script, mode, ranks), write OUT.md and OUT.png after each run (so that a run stopped early keeps
    what it measured, marked partial); returns their paths."""
    args, argv, extra = common.cli(Args, argv, script_args=True)
    if args.model_from is not None:
        return write_model(args, argv)
    cores = common.usable_cores()
    ranks_to_run = rank_counts(args.ranks, len(cores))
    load = common.check_load(args.max_load)
    plan = {script: jobs(args, script, ranks_to_run) for script in args.scripts}
    schedule = [(r, script, job) for r in range(args.rounds) for script in args.scripts for job in plan[script]]
    rounds: dict[tuple[str, str, int], list[common.Measurement]] = {}  # (script, mode, ranks): one per round
    with common.work_folder(args.out_dir, "ddrl_scaling_") as work_dir:
        for done, (round_index, script, job) in enumerate(schedule, start=1):
            name = f"scaling__{Path(script).stem}__{job[0].replace(' ', '_')}__{job[1]}ranks"
            name += f"__round{round_index + 1}" if args.rounds > 1 else ""
            rounds.setdefault((script, *job[:2]), []).append(run_job(args, extra, script, job, name, work_dir))
            partial = f"PARTIAL: {done} of {len(schedule)} runs when this was written" * (done < len(schedule))
            paths = write_tables(args, argv, rounds, ranks_to_run, cores, load, partial)
    return paths


def write_tables(args: Args, argv, rounds: dict, ranks_to_run: list[int], cores: list[int], load: tuple, partial: str):
    """OUT.md and OUT.png of the runs in `rounds` so far (the median run of each (script, mode, ranks)); `load` as
    check_load gave it, `partial` what a benchmark cut short says (empty once every run ran)."""
    results: dict[tuple[str, str], list[common.Measurement]] = {}
    in_order = sorted(rounds.items(), key=lambda item: item[0][1] == INDEPENDENT)  # the ceiling's rows last
    for (script, mode, _), measurements in in_order:
        median_run = sorted(measurements, key=lambda m: m.sps)[(len(measurements) - 1) // 2]  # of the rounds so far
        results.setdefault((script, mode), []).append(median_run)
    png_path, image = common.draw(args, lambda axes: plot(results, axes), "scaling", (1, 2), (12, 5.5))
    facts = ["weak scaling: each rank keeps its batch, the world's grows with N", *pinned_facts(args, cores)]
    body = image
    for script in args.scripts:
        measurements = [m for (name, _), rows in results.items() if name == script for m in rows]
        body += f"\n## {script} on {common.defaults(script).env_id}\n\n{scaling_table(measurements)}\n"
        if args.rounds > 1:
            body += round_speedups({key: value for key, value in rounds.items() if key[0] == script}) + "\n"
        for mode in dict.fromkeys(m.mode for m in measurements if m.mode != INDEPENDENT):
            sync_means = SYNC_MEANS[script, mode.split()[0]].format(**vars(common.defaults(script)))
            body += f"sync with {mode} means {sync_means}.\n\n"
        if args.independent and len(ranks_to_run) > 1:
            body += f"{INDEPENDENT} means {INDEPENDENT_MEANS}.\n\n"
    return common.write_results(args, argv, "Scaling: N ranks on N cores", facts, body, load, partial), png_path


if __name__ == "__main__":
    main()
