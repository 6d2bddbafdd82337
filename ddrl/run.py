"""A run's life, in the calls a script's main makes, each named for what it does:

    run = ddrl.launch(args)  # every flag checked; --nprocs N: this command again as N ranks
    run.start(total_steps, batch_table, memory)  # process group; run folder made (or found), locked
    iteration, global_step = run.resume(agent=agent, optimizer=optimizer)  # loads, nothing else
    run.log(iteration, global_step, totals, scalars)  # TensorBoard (from the first log), progress
    run.checkpoint(iteration, global_step, agent=agent, optimizer=optimizer)
    run.finish(agent, stopped, make_env)  # model file, videos, the group left, the folder let go

The methods are short: each hands the Run to the module that holds its concern (launching,
checkpoints, run_folders, progress, stopping), so each part reads on its own."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ddrl import (
    checkpoints,
    checks,
    failures,
    flags,
    launching,
    machine,
    progress,
    run_folders,
    stopping,
)
from ddrl.failures import fail


@dataclass
class Run:
    """What the runtime keeps of one run on each rank, and the calls of its life."""

    args: object  # the script's Args
    script: str  # the script's path, as launched
    unit: str  # what the progress line and messages call an iteration ("epoch" in VPG)
    rank: int  # this rank's place in the world, from the launcher's variables
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device = torch.device("cpu")
    # the cores idle at start, per rank of this node: the default torch and env threads
    cores: int = 1
    # the process group's key-value store (rollout preemption counts in it)
    store: dist.Store | None = None
    collectives: str = ""  # what carries the CPU collectives, for the batch table
    name: str = ""  # the run folder's name below runs/
    lock: IO | None = None  # rank 0's open run.lock, locked for the run's life (run_folders)
    # the header of the checkpoint to resume, read and checked by start
    resumed_from: dict | None = None
    restarts: int = 0  # earlier attempts of this run (resumed or restarted)
    # envs seeded by earlier attempts: this attempt's env g is seeded as env first + g
    first_env_index: int = 0
    total_steps: int = 0  # the world's env steps to train
    start_step: int = 0  # the world's env steps when this attempt began
    resumed_iteration: int = 0
    iteration: int = 0  # the last iteration logged
    global_step: int = 0  # the world's env steps at the last iteration logged
    # why this rank asks every rank to stop after this iteration (SIGTERM, Ctrl-C, ...)
    stop_requested: str = ""
    writer: object = None  # rank 0's TensorBoard SummaryWriter, opened at the first log
    wandb_run: object = None
    launched_at: float = field(default_factory=time.time)
    train_start: float = 0.0
    load_since: np.ndarray | None = None  # machine.load_sample() at the last progress line
    oversubscribed: bool = False  # the oversubscription warning was printed
    last_return: str = "n/a"  # the last progress line's return, for the summary

    def start(
        self,
        total_steps: int,
        batch_table: list[tuple[str, object, object]],
        memory: tuple[int, str],
    ) -> None:
        """Everything before the Agent exists, on every rank: what an iteration's data takes
        (`memory`: bytes per rank, and the flags that size them) against this machine's memory; the
        checkpoint to resume, checked up front; the process group; the same script, ddrl and command
        everywhere. Then rank 0 makes the run folder (or finds the resumed run's) and locks it for
        the run's life, and prints the batch table (rows: name, per rank, world) and the folder;
        from here on SIGTERM and Ctrl-C ask every rank to stop after the iteration."""
        self.total_steps = total_steps
        rollout_bytes, sized_by = memory
        if problem := machine.memory_problem(rollout_bytes, sized_by, self.local_world_size):
            fail(problem)
        self.name, self.resumed_from = checkpoints.find_run_to_resume(self.args, total_steps)
        if self.resumed_from:
            self.resumed_iteration = self.resumed_from["iteration"]
            # at most the bound a file is read with: what this attempt writes, the next one reads
            self.restarts = min(self.resumed_from["restarts"] + 1, checkpoints.MAX_RESTARTS)
            self.first_env_index = self.resumed_from["envs_seeded"]
        seeds = checkpoints.env_seeds_problem(
            self.args, self.world_size, self.first_env_index, self.name
        )
        if seeds:
            fail(seeds)
        self.collectives = launching.join_process_group(self)
        launching.check_same_command(self)
        # rank 0 finds every path the run writes in its folder fit (no link) before the first
        # iteration, and tells every rank
        run_folders.create_run_folder(
            self, resumed=self.resumed_from is not None or checks.restart_count() > 0
        )
        if self.rank == 0:
            lines = [f"{'':18}{'per rank':>12}{'world':>12}"]
            lines += [f"{row:18}{local!s:>12}{world!s:>12}" for row, local, world in batch_table]
            lines.append(f"{'memory':18}{machine.size(rollout_bytes):>12}{'':>12}")
            lines.append(f"{'collectives':18}{self.collectives:>24}")
            lines.append(f"{'run folder':18}{'runs/' + self.name:>24}")
            failures.tell("\n".join(lines))
        stopping.arm(self)

    def resume(self, **states) -> tuple[int, int]:
        """Load the checkpoint start found into `states` (the Agent under any name, the optimizers
        by name; this rank's random streams too), each compared with what this run built before any
        of it loads; nothing else. Returns the iteration and the world's env steps reached (0, 0 for
        a new run)."""
        header = self.resumed_from
        if header:
            checkpoints.load_training_state(header["path"], header, self.rank, states)
            if self.rank == 0:
                failures.tell(
                    "resuming from "
                    f"{header['path']}{checkpoints.world_change(header, self.world_size)}"
                )
        self.start_step = header["global_step"] if header else 0
        self.train_start = time.time()
        self.load_since = machine.load_sample()
        return self.resumed_iteration, self.start_step

    def log(
        self, iteration: int, global_step: int, totals: dict[str, float], scalars: dict[str, float]
    ) -> None:
        """Rank 0: the episodes that ended on any rank (`totals`: episodes, episode_return,
        episode_length, summed over ranks), SPS and `scalars` to TensorBoard at `global_step`, and
        the progress line."""
        self.iteration = iteration
        self.global_step = global_step
        if self.rank == 0 and self.writer is None:
            resumed_step = self.resumed_from["global_step"] if self.resumed_from else None
            self.writer, self.wandb_run = run_folders.open_tensorboard(
                self.args, self.name, resumed_step
            )
        progress.log_iteration(self, iteration, global_step, totals, scalars)

    def check_in_sync(
        self, iteration: int, agent: torch.nn.Module, *optimizers: torch.optim.Optimizer
    ) -> None:
        """Every --check-sync-every iterations from the first: stop every rank unless all hold the
        same Agent (parameters and buffers), optimizer options and numbers in args
        (checks.check_in_sync)."""
        every = self.args.check_sync_every
        if every and (iteration - 1) % every == 0:
            checks.check_in_sync(iteration, self.unit, agent, *optimizers, args=self.args)

    def checkpoint_due(self, iteration: int, stopping: bool) -> bool:
        """Whether this iteration ends with a checkpoint: every --checkpoint-every iterations, and
        when stopping."""
        every = self.args.checkpoint_every
        return stopping or bool(every and iteration % every == 0)

    def checkpoint(self, iteration: int, global_step: int, **states) -> None:
        """Write the checkpoint of `iteration` (rank 0, atomically; every rank's random streams in
        it): `states` are the Agent (under any name) and the optimizers, by the names resume() loads
        them by."""
        checkpoints.save(self, iteration, global_step, **states)

    def finish(
        self, agent: torch.nn.Module, stopped: bool, make_env: Callable | None = None
    ) -> None:
        """The end of training on every rank: unless `stopped`, rank 0 writes the model file
        (--save-model) and films evaluation episodes (--capture-video, with envs from
        `make_env(args, video_folder)`); every rank leaves the process group; rank 0 lets the run
        folder go (finished, or to be resumed) and sums the run up in one line."""
        progress.finish(self, agent, stopped, make_env)

    def stop_on_error(self, error: Exception, nonfinite_fix: str) -> NoReturn:
        """End training on an error every rank met alike, in one line: a non-finite loss or gradient
        (no rank applied that step; `nonfinite_fix` says what to try) or a lost peer. Anything else
        is a bug: raised as is."""
        progress.stop_training(self, self.iteration + 1, error, nonfinite_fix)


def launch(args, unit: str = "iteration") -> Run:
    """This process's place in the launch, once every flag of `args` (the script's Args, whose
    module is the script) keeps its rule and the machine has what they need. With --nprocs N and no
    launcher, run this command again as N ranks instead (under mpirun where --collectives allows MPI
    and mpirun and mpi4py exist, else torchrun) and exit as they do."""
    script = os.path.abspath(sys.modules[type(args).__module__].__file__)
    # torch.distributions' argument checks cost a few ops per distribution made, and a NaN they
    # would meet raises a traceback mid-update; without them a NaN reaches the loss, which stops
    # every rank in one line
    torch.distributions.Distribution.set_default_validate_args(False)
    failures.script = os.path.basename(script)
    # until training starts (Run.start)
    signal.signal(signal.SIGINT, launching.stop_before_training)
    problems = flags.violations(args) or [
        problem for problem in [checks.machine_problem(args)] if problem
    ]
    if problems:
        failures.fail_all(problems)
    if args.capture_video and "MUJOCO_GL" not in os.environ and not os.environ.get("DISPLAY"):
        # headless: MuJoCo's GPU-or-CPU EGL renderer, read when mujoco loads
        os.environ["MUJOCO_GL"] = "egl"
    rank, world_size, local_rank, local_world_size = launching.read_launcher_environment()
    # a new run's env seeds, before --nprocs launches its ranks (Run.start adds earlier attempts')
    ranks = args.nprocs if world_size == 1 else world_size
    evaluated = args.eval_checkpoint is not None  # one env, seeded with --seed
    seeds = "" if evaluated else checkpoints.env_seeds_problem(args, ranks, 0, args.run_name)
    if seeds:
        fail(seeds)
    run = Run(args, script, unit, rank, world_size, local_rank, local_world_size)
    if args.nprocs > 1 and world_size == 1:
        launching.relaunch_as_ranks(args, script)
    return run
