"""The training loop's end of each iteration and of the run: the progress line and TensorBoard's
scalars, the oversubscription warning, the summary line, and the one line that stops training on an
error every rank met."""

from __future__ import annotations

import gc
import math
import os
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from ddrl import checkpoints, collectives, evaluation, failures, machine, run_folders, stopping
from ddrl.failures import NonFiniteError, fail

if TYPE_CHECKING:
    from ddrl.run import Run


def log_iteration(
    run: Run, iteration: int, global_step: int, totals: dict[str, float], scalars: dict[str, float]
) -> None:
    """Rank 0: the episodes that ended on any rank (`totals`: episodes, episode_return,
    episode_length, summed over ranks), SPS and `scalars` to TensorBoard at `global_step`, and the
    progress line."""
    if run.rank != 0:
        return
    # said once, after the first iteration
    if not run.oversubscribed and iteration > run.resumed_iteration + 1:
        run.oversubscribed = warn_if_oversubscribed(
            run.load_since, run.args.torch_threads, run.cores
        )
    run.load_since = machine.load_sample()
    elapsed = time.time() - run.train_start
    steps = global_step - run.start_step
    sps = int(steps / elapsed)
    steps_per_iteration = steps / (iteration - run.resumed_iteration)
    iterations = iteration + max(
        0, math.ceil((run.total_steps - global_step) / steps_per_iteration)
    )
    count = totals["episodes"]  # the games (episodes) that ended on any rank this iteration
    episodes = {
        f"charts/episodic_{key}": totals[f"episode_{key}"] / count
        for key in ("return", "length")
        if count
    }
    for key, value in {**episodes, "charts/SPS": sps, **scalars}.items():
        run.writer.add_scalar(key, value, global_step)
    left = elapsed / steps * max(0, run.total_steps - global_step)
    recent = f"{episodes['charts/episodic_return']:.1f}" if episodes else "n/a"
    run.last_return = recent if episodes else run.last_return
    line = f"{run.unit} {iteration}/{iterations} step {global_step} SPS {sps} return {recent}"
    if not failures.tell(f"{line} elapsed {clock(elapsed)} left {clock(left)}"):
        # `| head`: the run ends quietly, with a checkpoint
        stopping.request(run, "a closed output")


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the world's batch (float64, one gather;
    constant returns: NaN)."""
    returns = returns.reshape(-1)
    _, _, m2 = collectives.moments_over_ranks(
        torch.stack([returns - values.reshape(-1), returns]).double()
    )
    return float("nan") if m2[1] == 0 else (1 - m2[0] / m2[1]).item()


def warn_if_oversubscribed(since: np.ndarray, torch_threads: int, idle_cores: int) -> bool:
    """Warn (True) if the torch threads outnumber the cores idle at start, or those other work left
    since `since`."""
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


def clock(seconds: float) -> str:
    """`h:mm:ss`, or `m:ss` under an hour."""
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def finish(run: Run, model: nn.Module, stopped: bool, make_env: Callable | None) -> None:
    """The end of training on every rank: unless a stop request `stopped` it, rank 0 writes the
    model file (--save-model) and films evaluation episodes (--capture-video, one env from
    `make_env(args, video_folder)`); every rank leaves the process group; rank 0 lets the run folder
    go (finished, or to be resumed) and sums the run up in one line."""
    args = run.args
    folder = f"runs/{run.name}"
    path = checkpoints.model_path(run.name)
    saved = ""  # the summary's mention of the model file
    problem = ""  # rank 0's: what it could not write, which stops every rank
    fix = "then write it with --resume --save-model"
    if run.rank == 0 and stopped:
        reason = run.stop_requested or "SIGTERM or Ctrl-C on another rank"
        failures.tell(
            f"stopped by {reason} at {run.unit} {run.iteration}; continue with --resume "
            f"--run-name {run.name}"
        )
    if run.rank == 0:
        if args.save_model and not stopped:
            written = checkpoints.write_model(path, args, model)
            problem = f"trained, but {written}" if written else ""
            saved = "" if written else f", model {path}"
        if args.capture_video and not stopped and make_env is not None and not problem:
            video_folder = f"{folder}/videos"
            if unfit := run_folders.folder_problem(video_folder, make=True):
                problem = f"trained, but could not film into {video_folder}: {unfit}"
                fix = "then film it with --resume --capture-video"
            else:
                envs = gym.vector.SyncVectorEnv(
                    [make_env(args, video_folder)],
                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
                )
                evaluation.play(model, envs, args)
        if run.writer is not None:
            run.writer.close()
        if run.wandb_run:
            run.wandb_run.finish()
    checkpoints.stop_if_unwritten(run, path, problem, fix)
    dist.barrier()  # every rank leaves the group together
    stopping.disarm()
    dist.destroy_process_group()
    # free gloo's worker threads now: left to interpreter shutdown they can abort the process
    gc.collect()
    run_folders.release_run_folder(run, finished=not stopped)
    if run.rank == 0:
        saved += f"; continue with --resume --run-name {run.name}" if stopped else ""
        summary = (
            f"{'stopped' if stopped else 'done'}: {run.global_step} env steps in "
            f"{clock(time.time() - run.launched_at)}"
        )
        failures.tell(f"{summary}, last return {run.last_return}; TensorBoard run {folder}{saved}")


def stop_training(run: Run, iteration: int, error: Exception, nonfinite_fix: str) -> NoReturn:
    """End training on an error every rank met alike, in one line: a non-finite loss or gradient (no
    rank applied that step; `nonfinite_fix` says what to try) or a lost peer (each rank says so).
    Anything else is a bug: raised as is."""
    if isinstance(error, NonFiniteError):
        fail(
            f"non-finite loss or gradient at {run.unit} {iteration}: every rank stopped before "
            f"applying that step, earlier steps of the {run.unit} stand "
            f"({checkpoints.last_good_checkpoint(run.name)}); {nonfinite_fix}, then --resume"
        )
    lost_peer = ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out")
    if not (isinstance(error, dist.DistError) or any(word in str(error) for word in lost_peer)):
        raise error
    reason = re.sub(
        r"^\[[^\]]*\]\s*", "", (str(error) or type(error).__name__).splitlines()[0]
    ).split(". ")[0]
    fail(
        f"lost contact with another rank ({reason}): it died, or stalled longer than "
        f"--dist-timeout {run.args.dist_timeout:g} s; see its log, then resume with --resume "
        f"--run-name {run.name}",
        every_rank=True,
    )
