"""A run's life, in the calls a script's main makes, each named for what it does:

    run = ddrl.launch(args)  # every flag checked; --nprocs N: this command again as N ranks
    run.start(total_steps, batch_table, memory)  # process group; run folder made (or found), locked
    iteration, global_step = run.resume(agent=agent, optimizer=optimizer)  # loads, nothing else
    run.log(iteration, global_step, totals, scalars)  # TensorBoard (from the first log), progress
    run.checkpoint(iteration, global_step, agent=agent, optimizer=optimizer)
    run.finish(agent, stopped, make_env)  # model file, videos, the group left, the folder let go

The Run is the only module that knows all the run's parts; each part keeps its state in an object
of its module (World, RunFolder, Resumption, Progress, StopRequest) and takes plain values."""

from __future__ import annotations

import gc
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from ddrl import (
    checkpoints,
    evaluation,
    failures,
    flags,
    in_sync,
    launching,
    machine,
    progress,
    run_folders,
    stopping,
)
from ddrl.failures import NonFiniteError, fail


@dataclass
class Run:
    """One run on this rank: its flags and script, and the state of each of its parts."""

    args: object  # the script's Args
    script: str  # the script's path, as launched
    world: launching.World  # this rank's place in the launch and the process group's
    folder: run_folders.RunFolder = field(default_factory=run_folders.RunFolder)
    resumption: checkpoints.Resumption = field(default_factory=checkpoints.Resumption)
    progress: progress.Progress = field(default_factory=lambda: progress.Progress("iteration"))
    stop: stopping.StopRequest = field(default_factory=stopping.StopRequest)
    total_steps: int = 0  # the world's env steps to train

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def device(self) -> torch.device:
        return self.world.device

    @property
    def cores(self) -> int:
        """The cores idle at start, per rank of this node: the default torch and env threads."""
        return self.world.cores

    @property
    def name(self) -> str:
        """The run folder's name below runs/."""
        return self.folder.name

    @property
    def first_env_index(self) -> int:
        """Envs seeded by earlier attempts: this attempt's env g is seeded as env first + g."""
        return self.resumption.envs_seeded

    @property
    def stop_requested(self) -> str:
        """Why this rank asks every rank to stop after this iteration ('' if nothing asks)."""
        return self.stop.reason

    def start(
        self,
        total_steps: int,
        batch_table: list[tuple[str, object, object]],
        memory: tuple[int, str],
    ) -> None:
        """Everything before the Agent exists, on every rank: `memory` (bytes per rank, the flags
        that size them) against this machine's, the checkpoint to resume, the process group, the
        same command everywhere; rank 0 makes (or finds) and locks the run folder and prints the
        batch table (rows: name, per rank, world). Then SIGTERM and Ctrl-C ask all ranks to stop."""
        self.total_steps = total_steps
        rollout_bytes, sized_by = memory
        if problem := machine.memory_problem(rollout_bytes, sized_by, self.world.local_world_size):
            fail(problem)
        name, self.resumption = checkpoints.find_run_to_resume(self.args)
        envs_seeded = self.resumption.envs_seeded
        if seeds := checkpoints.env_seeds_problem(self.args, self.world_size, envs_seeded, name):
            fail(seeds)
        try:  # the set-up's collectives: a peer lost in them ends every rank as in training
            launching.join_process_group(self.args, self.world)
            resumed_iteration = self.resumption.iteration
            in_sync.check_same_command(self.script, self.args, resumed_iteration, self.device)
            # rank 0 finds every path the run writes fit (no link) before the first iteration
            resumed = self.resumption.header is not None or launching.restart_count() > 0
            device = self.device
            self.folder = run_folders.create_run_folder(self.args, name, self.rank, device, resumed)
        except RuntimeError as error:
            self.stop_on_error(error, "")
        if self.rank == 0:
            lines = [f"{'':18}{'per rank':>12}{'world':>12}"]
            lines += [
                f"{row:18}{local!s:>12}{world!s:>12}".rstrip() for row, local, world in batch_table
            ]
            lines.append(f"{'memory':18}{machine.size(rollout_bytes):>12}")
            lines.append(f"{'collectives':18}{self.world.collectives:>24}")
            lines.append(f"{'run folder':18}{'runs/' + self.name:>24}")
            failures.tell("\n".join(lines))
        self.stop = stopping.StopRequest(self.name)
        stopping.arm(self.stop)

    def resume(self, **states) -> tuple[int, int]:
        """Load the checkpoint start found into `states` (the Agent, then the optimizers by name)
        and this rank's random streams, each checked before any loads; returns the iteration and
        the world's env steps reached (0, 0 for a new run)."""
        header = self.resumption.header
        if header:
            checkpoints.load_training_state(header["path"], header, self.rank, states)
            if self.rank == 0:
                change = checkpoints.world_change(header, self.world_size)
                failures.tell(f"resuming from {header['path']}{change}")
        iteration = self.resumption.iteration
        global_step = self.resumption.global_step
        progress.start_clock(self.progress, iteration, global_step, bool(header))
        return iteration, global_step

    def log(
        self, iteration: int, global_step: int, totals: dict[str, float], scalars: dict[str, float]
    ) -> None:
        """Rank 0: progress.log_iteration's TensorBoard scalars and progress line; a closed output
        (`| head`) asks for a stop, and a rank whose torchrun agent exited stops at once."""
        if launching.agent_exited(self.world):
            self.stop_on_error(dist.DistError("the torchrun agent exited"), "")
        try:
            printed = progress.log_iteration(
                self.progress,
                iteration,
                global_step,
                totals,
                scalars,
                args=self.args,
                name=self.name,
                rank=self.rank,
                cores=self.cores,
                total_steps=self.total_steps,
            )
        except OSError as error:  # TensorBoard's writer, its folder removed or its disk full
            fail(
                f"could not write TensorBoard's events in runs/{self.name} "
                f"({failures.first_line(error)}): keep the run folder in place while it trains "
                f"and free disk space; {checkpoints.last_good_checkpoint(self.name)}",
                every_rank=True,
            )
        if not printed:
            stopping.request(self.stop, "a closed output")

    def check_in_sync(self, iteration: int) -> None:
        """Every --check-sync-every iterations: stop every rank unless all hold the same training
        state as main's variables find it (in_sync.check_in_sync)."""
        every = self.args.check_sync_every
        if every and (iteration - 1) % every == 0:
            main = sys._getframe(1)
            unit = self.progress.unit
            in_sync.check_in_sync(iteration, unit, main, self.args, self.device)

    def checkpoint_due(self, iteration: int, stop_after: bool) -> bool:
        """Whether this iteration ends with a checkpoint (--checkpoint-every, or `stop_after`)."""
        every = self.args.checkpoint_every
        return stop_after or bool(every and iteration % every == 0)

    def checkpoint(self, iteration: int, global_step: int, **states) -> None:
        """Rank 0 writes the checkpoint of `iteration` (every rank's random streams in it) of
        `states` (as resume() names them) and TensorBoard's events; a failure stops every rank."""
        path, problem = checkpoints.save(
            self.world, self.name, self.args, self.resumption, iteration, global_step, states
        )
        if self.rank == 0 and not problem:
            problem = progress.flush_writer(self.progress, self.name)
        checkpoints.stop_if_unwritten(self.world, self.name, path, problem, "then --resume")
        if self.rank == 0:
            failures.tell(f"checkpoint saved to {path}")

    def finish(
        self, agent: torch.nn.Module, stopped: bool, make_env: Callable | None = None
    ) -> None:
        """The end of training: unless `stopped`, rank 0 writes the model file and films episodes
        (`make_env(args, video_folder)`); every rank leaves the group; rank 0 sums the run up."""
        args = self.args
        folder = f"runs/{self.name}"
        path = checkpoints.model_path(self.name)
        saved = ""  # the summary's mention of the model file
        problem = ""  # rank 0's: what it could not write, which stops every rank
        fix = "then write it with --resume --save-model"
        if self.rank == 0 and stopped:
            reason = self.stop.reason or "SIGTERM or Ctrl-C on another rank"
            failures.tell(
                f"stopped by {reason} at {self.progress.unit} {self.progress.iteration}; continue "
                f"with --resume --run-name {self.name}"
            )
        if self.rank == 0:
            if args.save_model and not stopped:
                written = checkpoints.write_model(path, args, agent)
                problem = f"trained, but {written}" if written else ""
                saved = "" if written else f", model {path}"
            if args.capture_video and not stopped and make_env is not None and not problem:
                problem = evaluation.film(agent, make_env, args, f"{folder}/videos")
                fix = "then film it with --resume --capture-video" if problem else fix
            progress.close_writer(self.progress)
        checkpoints.stop_if_unwritten(self.world, self.name, path, problem, fix)
        dist.barrier()  # every rank leaves the group together
        stopping.disarm()
        dist.destroy_process_group()
        # free gloo's worker threads now: left to interpreter shutdown they can abort the process
        gc.collect()
        run_folders.release_run_folder(self.folder, finished=not stopped)
        if self.rank == 0:
            saved += f"; continue with --resume --run-name {self.name}" if stopped else ""
            failures.tell(progress.summary(self.progress, stopped, folder) + saved)

    def stop_on_error(self, error: Exception, nonfinite_fix: str) -> NoReturn:
        """End training in one line on an error every rank met alike: a non-finite loss or gradient
        (`nonfinite_fix` says what to try), a lost peer, or the torchrun agent gone with its store.
        Anything else is a bug: raised as is."""
        unit = self.progress.unit
        iteration = self.progress.iteration + 1
        if isinstance(error, NonFiniteError):
            fail(
                f"non-finite loss or gradient at {unit} {iteration}: every rank stopped before "
                f"applying that step, earlier steps of the {unit} stand "
                f"({checkpoints.last_good_checkpoint(self.name)}); {nonfinite_fix}, then --resume"
            )
        # gloo's own errors (DDP's backward, the last barrier) are bare RuntimeErrors from its
        # transport; ddrl's collectives and the store raise torch.distributed's DistError
        if not (isinstance(error, dist.DistError) or "gloo/transport/" in str(error)):
            raise error
        reason = re.sub(
            r"^\[[^\]]*\]\s*", "", (str(error) or type(error).__name__).splitlines()[0]
        ).split(". ")[0]
        then = f"resume with --resume --run-name {self.name}" if self.name else "launch it again"
        message = (
            f"lost contact with another rank ({reason}): it died, or stalled longer than "
            f"--dist-timeout {self.args.dist_timeout:g} s; see its log, then {then}"
        )
        if launching.agent_exited(self.world):
            message = f"the torchrun agent exited, taking its store: every rank stops; {then}"
        fail(message + ("" if self.name else ": nothing was written"), every_rank=True)


def launch(args, unit: str = "iteration") -> Run:
    """This process's place in the launch, once every flag of `args` keeps its rule; with --nprocs N
    and no launcher, run this command again as N ranks instead and exit as they do."""
    script = os.path.abspath(sys.modules[type(args).__module__].__file__)
    # torch.distributions' argument checks cost ops per distribution and raise a traceback at a
    # NaN mid-update; without them a NaN reaches the loss, which stops every rank in one line
    torch.distributions.Distribution.set_default_validate_args(False)
    failures.script = os.path.basename(script)
    # until training starts (Run.start)
    signal.signal(signal.SIGINT, launching.stop_before_training)
    problems = flags.violations(args) or [
        problem for problem in [flags.machine_problem(args)] if problem
    ]
    if problems:
        failures.fail_all(problems)
    if args.capture_video and "MUJOCO_GL" not in os.environ and not os.environ.get("DISPLAY"):
        # headless: MuJoCo's GPU-or-CPU EGL renderer, read when mujoco loads
        os.environ["MUJOCO_GL"] = "egl"
    world = launching.read_launcher_environment()
    # a new run's env seeds, before --nprocs launches its ranks (Run.start adds earlier attempts')
    ranks = args.nprocs if world.world_size == 1 else world.world_size
    evaluated = args.eval_checkpoint is not None  # one env, seeded with --seed
    seeds = "" if evaluated else checkpoints.env_seeds_problem(args, ranks, 0, args.run_name)
    if seeds:
        fail(seeds)
    run = Run(args, script, world, progress=progress.Progress(unit))
    if args.nprocs > 1 and world.world_size == 1:
        launching.relaunch_as_ranks(args, script)
    return run
