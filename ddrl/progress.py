"""The account of training: the iteration every rank reached, and on rank 0 each iteration's
progress line and TensorBoard scalars, the oversubscription warning and the run's summary line."""

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ddrl import collectives, failures, machine, run_folders


@dataclass
class Progress:
    """What the progress line and the summary need across iterations: clock, counts, writer."""

    unit: str  # what the progress line and messages call an iteration ("epoch" in VPG)
    launched_at: float = field(default_factory=time.time)
    start_iteration: int = 0  # the iteration this attempt resumed from (0 for a new run)
    start_step: int = 0  # the world's env steps when this attempt began
    resumed: bool = False
    started_at: float = 0.0  # when this attempt's training began
    iteration: int = 0  # the last iteration logged
    global_step: int = 0  # the world's env steps at the last iteration logged
    load_since: np.ndarray | None = None  # machine.load_sample() at the last progress line
    oversubscribed: bool = False  # the oversubscription warning was printed
    last_return: str = "n/a"  # the last progress line's return, for the summary
    writer: object = None  # rank 0's TensorBoard SummaryWriter
    wandb_run: object = None


def start_clock(progress: Progress, iteration: int, global_step: int, resumed: bool) -> None:
    """Training begins now, at `iteration` and `global_step` (0, 0 for a new run)."""
    progress.start_iteration = iteration
    progress.start_step = global_step
    progress.resumed = resumed
    progress.started_at = time.time()
    progress.load_since = machine.load_sample()


def log_iteration(
    progress: Progress,
    iteration: int,
    global_step: int,
    totals: dict[str, float],
    scalars: dict[str, float],
    *,
    args,
    name: str,
    rank: int,
    cores: int,
    total_steps: int,
) -> bool:
    """Rank 0: the episodes that ended on any rank (`totals`: episodes, episode_return,
    episode_length, summed over ranks), SPS and `scalars` to TensorBoard at `global_step`, and the
    progress line; False where the line could not be printed (`| head` closed the output)."""
    progress.iteration = iteration
    progress.global_step = global_step
    if rank != 0:
        return True
    if progress.writer is None:
        resumed_step = progress.start_step if progress.resumed else None
        progress.writer, progress.wandb_run = run_folders.open_tensorboard(args, name, resumed_step)
    # said once, after the first iteration
    if not progress.oversubscribed and iteration > progress.start_iteration + 1:
        progress.oversubscribed = warn_if_oversubscribed(
            progress.load_since, args.torch_threads, cores
        )
    progress.load_since = machine.load_sample()
    elapsed = time.time() - progress.started_at
    steps = global_step - progress.start_step
    sps = int(steps / elapsed)
    steps_per_iteration = steps / (iteration - progress.start_iteration)
    iterations = iteration + max(0, math.ceil((total_steps - global_step) / steps_per_iteration))
    count = totals["episodes"]  # the games (episodes) that ended on any rank this iteration
    episodes = {
        f"charts/episodic_{key}": totals[f"episode_{key}"] / count
        for key in ("return", "length")
        if count
    }
    folder = progress.writer.get_logdir()
    if not os.path.isdir(folder):  # seen here, not by the writer's thread (a traceback there)
        raise FileNotFoundError(f"no folder {folder}")
    for key, value in {**episodes, "charts/SPS": sps, **scalars}.items():
        progress.writer.add_scalar(key, value, global_step)
    progress.writer.flush()  # written before the line is said: the line tells what is on disk
    left = elapsed / steps * max(0, total_steps - global_step)
    recent = f"{episodes['charts/episodic_return']:.1f}" if episodes else "n/a"
    progress.last_return = recent if episodes else progress.last_return
    line = f"{progress.unit} {iteration}/{iterations} step {global_step} SPS {sps} return {recent}"
    return failures.tell(f"{line} elapsed {clock(elapsed)} left {clock(left)}")


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the world's batch (constant returns: NaN)."""
    returns = returns.reshape(-1)
    _, _, m2 = collectives.moments_over_ranks(
        torch.stack([returns - values.reshape(-1), returns]).double()
    )
    return float("nan") if m2[1] == 0 else (1 - m2[0] / m2[1]).item()


def warn_if_oversubscribed(since: np.ndarray, torch_threads: int, idle_cores: int) -> bool:
    """Warn (True) if the torch threads outnumber the cores idle at start, or idle since `since`."""
    busy, total, cpu, seconds = machine.load_sample() - since
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    others = cores * busy / max(total, 1) - cpu / seconds  # busy cores, less this process's own
    oversubscribed = threads > 1 and (torch_threads > idle_cores or threads + others > cores + 0.5)
    if oversubscribed:
        failures.warn(
            f"{threads} torch threads per rank oversubscribe the {cores} usable cores "
            f"({others:.1f} busy with other work): every op waits for threads not running; pass "
            "--torch-threads 1"
        )
    return oversubscribed


def flush_writer(progress: Progress, name: str) -> str:
    """Rank 0's TensorBoard events flushed with the checkpoint; what went wrong ('' if nothing)."""
    if progress.writer is None:
        return ""
    try:
        progress.writer.flush()
    except OSError as error:
        return (
            f"could not write TensorBoard's events in runs/{name} "
            f"({failures.first_line(error)}): free disk space or make the folder writable"
        )
    return ""


def close_writer(progress: Progress) -> None:
    """Rank 0's TensorBoard writer (and W&B run) closed, its events on disk."""
    if progress.writer is not None:
        progress.writer.close()
    if progress.wandb_run:
        progress.wandb_run.finish()


def summary(progress: Progress, stopped: bool, folder: str) -> str:
    """The line that sums the run up: done or stopped, env steps, time since launch, last return."""
    ended = "stopped" if stopped else "done"
    spent = clock(time.time() - progress.launched_at)
    return (
        f"{ended}: {progress.global_step} env steps in {spent}, last return "
        f"{progress.last_return}; TensorBoard run {folder}"
    )


def clock(seconds: float) -> str:
    """`h:mm:ss`, or `m:ss` under an hour."""
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
