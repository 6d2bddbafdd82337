"""Learning curves (PNG) and a final-return table (markdown) from the TensorBoard event files of run folders.

    python -m benchmark.plot bench/runs --out benchmark/results/ppo_continuous \\
        --reference HalfCheetah-v5="1442.64 +- 46.03" --reference-name "CleanRL, v4 envs, 1M steps"

Every folder under the given paths that holds event files is one run, its env id, seed and label read from the
`hyperparameters` table the scripts write (runs of any name mix). One panel and one row per env id, one line and one
column per label. With --values and no paths, it prints the table's cell for per-seed final returns alone (results
whose run folders are gone): `python -m benchmark.plot --values 1801.9 1783.8 3455.1 --steps 1,000,000`.
"""

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from benchmark import common

RETURN_KEY = "charts/episodic_return"
CONFIDENCE = 0.95
"""the bootstrap's interval"""
RESAMPLES = 10_000
"""the bootstrap's draws (seeded: a table is reproducible)"""


@dataclass(kw_only=True)
class Args(common.ResultsArgs):
    paths: tyro.conf.Positional[tuple[Path, ...]] = ()
    """run folders, or folders holding run folders (searched recursively for event files)"""
    values: tuple[float, ...] = ()
    """no run folders: the final return of seeds 1, 2, ..., whose cell is printed (with --steps)"""
    steps: str = "?"
    """with --values, the env steps of the runs, as the cell should say them (e.g. 1,000,000)"""
    label_keys: tuple[str, ...] = ("exp_name",)
    """hyperparameters whose values name a line (e.g. exp_name world_size)"""
    last_points: int = 10
    """a run's final return is the mean of its last this many logged episodic returns"""
    smooth: int = 10
    """plotted curves are a trailing mean over this many logged points"""
    reference: tuple[str, ...] = ()
    """reference returns as ENV_ID=TEXT: a table column, and a dashed line where TEXT starts with a number"""
    reference_name: str = "reference"
    """the heading of the reference column (say where the numbers come from)"""
    reference_label: str = "reference"
    """the reference line's (short) name in the plots' legends"""
    title: str = "Learning curves and final returns"
    """the heading of the markdown file"""
    out: Path = Path("benchmark_results/learning_curves")


@dataclass
class Run:
    """One run folder's identity and return curve."""

    path: Path
    env_id: str
    seed: str
    label: str
    steps: np.ndarray
    returns: np.ndarray
    seconds: np.ndarray  # training wall time at each of `steps` (charts/SPS counts from the start of training)


def load_run(path: Path, label_keys: tuple[str, ...]) -> Run | None:
    """A run folder as a Run, its identity from the hyperparameters table it logged (ours, CleanRL's); None if empty."""
    scalars = common.read_scalar_events(path)  # (wall time, step, value) triples
    series = scalars.get(RETURN_KEY, [])
    if not series:
        return None
    if not (hyper := common.read_hyperparameters(path)):
        raise SystemExit(f"benchmark.plot: error: {path} logged no hyperparameters table (its env id, seed, label)")
    label = [f"{hyper.get(key, '?')}" if len(label_keys) == 1 else f"{key}={hyper.get(key)}" for key in label_keys]
    _, steps, returns = (np.array(values, dtype=np.float64) for values in zip(*series, strict=True))
    sps = np.array(scalars.get("charts/SPS", [(0, 0, 1)]), dtype=np.float64)
    seconds = np.interp(steps, sps[:, 1], sps[:, 1] / np.maximum(sps[:, 2], 1))
    return Run(path, hyper.get("env_id", "?"), hyper.get("seed", "?"), " ".join(label), steps, returns, seconds)


def reference_value(text: str) -> float | None:
    """The number a reference starts with ("~630 at 3M steps" has none: it is not comparable)."""
    number = re.match(r"\s*-?\d+(?:\.\d+)?", text)
    return float(number.group()) if number else None


def time_to_reference(runs: list[Run], smooth: int, reference: float) -> str:
    """Where the runs' mean curve (as plotted) first reaches `reference`: env steps, the seeds' mean training time."""
    grid, middle, _, _ = mean_curve(runs, smooth)
    if not (middle >= reference).any():
        return "not reached"
    step = grid[np.argmax(middle >= reference)]
    seconds = np.mean([np.interp(step, run.steps, run.seconds) for run in runs])
    return f"{step:,.0f} steps, {int(seconds // 60)}:{int(seconds % 60):02d}"


def final_return(run: Run, last_points: int) -> float:
    """Mean of the run's last `last_points` logged episodic returns."""
    return float(np.mean(run.returns[-last_points:]))


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of each value and the up to window-1 values before it."""
    cumulative = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (cumulative[1:] - cumulative[np.arange(1, len(values) + 1) - counts]) / counts


def center(values: np.ndarray) -> np.ndarray:
    """The return reported over seeds (the last axis): their mean, or from 5 seeds their interquartile mean (the mean
    of the middle half, a quarter cut from each end, as rliable's IQM), which one lucky or unlucky seed moves less."""
    seeds = values.shape[-1]
    if seeds < 5:
        return values.mean(-1)
    cut = seeds // 4
    return np.sort(values, -1)[..., cut : seeds - cut].mean(-1)


def bootstrap_interval(values: np.ndarray, resamples: int = RESAMPLES) -> tuple[float, float]:
    """The percentile bootstrap's 95% confidence interval of `center(values)` (seeded); (nan, nan) for one value."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return math.nan, math.nan
    draws = np.random.default_rng(0).integers(len(values), size=(resamples, len(values)))
    low, high = np.quantile(center(values[draws]), [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return float(low), float(high)


def mean_curve(runs: list[Run], smooth: int, points: int = 200) -> tuple[np.ndarray, ...]:
    """(steps, center over seeds, its 95% bootstrap interval's low and high) of the runs' smoothed curves on a common
    step grid; at each step only the runs that reached it count."""
    grid = np.linspace(min(run.steps[0] for run in runs), max(run.steps[-1] for run in runs), points)

    def on_grid(run: Run) -> np.ndarray:  # NaN where the run did not reach
        smoothed = np.interp(grid, run.steps, trailing_mean(run.returns, smooth))
        return np.where((grid >= run.steps[0]) & (grid <= run.steps[-1]), smoothed, np.nan)

    curves = np.stack([on_grid(run) for run in runs])
    middle, low, high = (np.empty(points) for _ in range(3))
    for index, column in enumerate(curves.T):
        reached = column[~np.isnan(column)]
        middle[index] = center(reached)
        low[index], high[index] = bootstrap_interval(reached, resamples=1_000)
    return grid, middle, low, high


def final_returns_cell(finals: dict[str, float], steps: str) -> str:
    """One table cell: mean +- std over seeds, the 95% bootstrap interval (from 5 seeds the IQM first), each seed's."""
    values = np.array(list(finals.values()))
    per_seed = ", ".join(f"{value:.2f} (seed {seed})" for seed, value in finals.items())
    if len(values) == 1:
        return f"{values[0]:.2f} (1 seed, {steps} steps)"
    low, high = bootstrap_interval(values)
    mean = f"{values.mean():.2f} +- {values.std():.2f}"
    interval = f"95% CI [{low:.2f}, {high:.2f}]"
    stated = f"{mean}, {interval}" if len(values) < 5 else f"IQM {center(values):.2f}, {interval}; {mean}"
    return f"{stated} ({len(values)} seeds, {steps} steps: {per_seed})"


def summarize(runs: list[Run], args: Args, references: dict[str, str]) -> str:
    """The final-return table: one row per env id, one column per label (final_returns_cell), the references, and
    where each label's mean curve first reaches a reference."""
    env_ids = sorted({run.env_id for run in runs} | set(references))
    labels = sorted({run.label for run in runs})
    rows = []
    for env_id in env_ids:
        row: list[object] = [env_id]
        reference = references.get(env_id, "")
        value = reference_value(reference)
        reached = []
        for label in labels:
            group = [run for run in runs if run.env_id == env_id and run.label == label]
            if not group:
                row.append("")
                continue
            if value is not None:
                reached.append(f"{label}: " * (len(labels) > 1) + time_to_reference(group, args.smooth, value))
            ends = sorted(int(run.steps[-1]) for run in group)
            steps = f"{ends[0]:,}" if ends[0] == ends[-1] else f"{ends[0]:,}-{ends[-1]:,}"
            if len({run.seed for run in group}) < len(group):  # a seed run twice: one value per run, not per seed
                finals = {f"{run.seed}, {run.path.name}": final_return(run, args.last_points) for run in group}
            else:
                in_order = sorted(group, key=lambda run: (len(run.seed), run.seed))  # numbers as numbers
                finals = {run.seed: final_return(run, args.last_points) for run in in_order}
            row.append(final_returns_cell(finals, steps))
        if references:
            row += [reference, "; ".join(reached)]
        rows.append(row)
    reference_columns = [args.reference_name, "mean curve first reaches the reference (training time)"]
    return common.markdown_table(" | ".join(["env", *labels, *(reference_columns if references else [])]), rows)


def plot(runs: list[Run], args: Args, references: dict[str, str], axes: list) -> None:
    """One panel per env id (in a grid of 3 columns), one line per label (mean_curve, its interval shaded), references
    dashed."""
    env_ids = sorted({run.env_id for run in runs})
    labels = sorted({run.label for run in runs})
    for axis, env_id in zip(axes, env_ids, strict=False):
        for color, label in enumerate(labels):
            group = [run for run in runs if run.env_id == env_id and run.label == label]
            if not group:
                continue
            steps, middle, low, high = mean_curve(group, args.smooth)
            distinct = len({run.seed for run in group})  # `3 seeds`, or `4 runs of 3 seeds` where one repeats
            seeds = f"{distinct} seed{'s' * (distinct > 1)}"
            seeds = seeds if distinct == len(group) else f"{len(group)} runs of {seeds}"
            axis.plot(steps, middle, color=f"C{color}", label=f"{label} ({seeds})")
            if len(group) > 1:
                axis.fill_between(steps, low, high, color=f"C{color}", alpha=0.2)
        if (value := reference_value(references.get(env_id, ""))) is not None:
            axis.axhline(value, color="gray", linestyle="--", label=args.reference_label)
        axis.set(title=env_id, xlabel="global env steps", ylabel="episodic return")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    for axis in axes[len(env_ids) :]:
        axis.set_visible(False)


def main(argv: list[str] | None = None) -> tuple[Path, Path] | str:
    """Read the runs, write OUT.png and OUT.md; returns their paths. With --values: print their cell, return it."""
    args, argv, _ = common.cli(Args, argv)
    if args.values or not args.paths:
        if not args.values or args.paths:
            raise SystemExit("benchmark.plot: error: give run folders, or --values alone")
        cell = final_returns_cell({str(seed): value for seed, value in enumerate(args.values, 1)}, args.steps)
        print(cell)
        return cell
    references = dict(item.partition("=")[::2] for item in args.reference)
    if bad := [f"{env_id}={text}" for env_id, text in references.items() if not env_id or not text]:
        raise SystemExit(f"benchmark.plot: error: --reference {bad[0]!r} is not ENV_ID=TEXT")
    if missing := [str(path) for path in args.paths if not path.exists()]:
        raise SystemExit(f"benchmark.plot: error: {', '.join(missing)} does not exist")
    run_dirs = sorted({event.parent for path in args.paths for event in path.rglob("events.out.tfevents.*")})
    runs = [run for path in run_dirs if (run := load_run(path, args.label_keys)) is not None]
    if not runs:
        raise SystemExit(f"benchmark.plot: error: no {RETURN_KEY} in any event file under {args.paths}")
    panels = len({run.env_id for run in runs})
    grid = (math.ceil(panels / min(3, panels)), min(3, panels))
    size = (5 * grid[1], 3.8 * grid[0])
    png_path, image = common.draw(args, functools.partial(plot, runs, args, references), "learning curves", grid, size)
    facts = [
        f"final return: mean of the last {args.last_points} logged `{RETURN_KEY}` values of a run (each the mean "
        "return of the episodes that ended in one iteration), then over seeds mean +- std (ddof 0), the 95% "
        f"percentile-bootstrap confidence interval of the mean ({RESAMPLES:,} draws of the seeds with replacement; "
        "of the interquartile mean, which leads the cell, from 5 seeds) and each seed's value; the curves are the "
        "same statistic of the smoothed returns at each step, shaded with its interval",
        "last column (with --reference): the first step of the plotted mean curve at or above the reference's number "
        "and the seeds' mean training wall time to it (charts/SPS counts from the start of training: no start-up)",
    ]
    body = image + "\n" + summarize(runs, args, references) + "\nRuns read:\n\n"
    body += "".join(f"- {run.label} {run.env_id} seed {run.seed}: `{run.path}`\n" for run in runs)
    return common.write_results(args, argv, args.title, facts, body), png_path


if __name__ == "__main__":
    main()
