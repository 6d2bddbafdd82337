"""DD-PPO's preemption (--preempt-fraction): once that share of the ranks finished its rollout, the
others cut theirs short, each having collected --min-rollout-fraction of its steps; the count lives
in the process group's store."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddrl.run import Run


def rollout_preempted(run: Run, iteration: int, step: int) -> bool:
    """Whether this rank ends its rollout of `iteration` before `step`, because --preempt-fraction
    of the ranks finished theirs and this one collected --min-rollout-fraction of its steps."""
    args = run.args
    if not args.preempt_fraction or run.world_size == 1 or step < args.min_num_steps:
        return False
    if step % max(1, args.num_steps // 64):  # the store is asked every 64th of a rollout
        return False
    return run.store.add(f"rollouts_done/{iteration}", 0) >= args.preempt_fraction * run.world_size


def rollout_finished(run: Run, iteration: int) -> None:
    """Count this rank's rollout of `iteration` among the finished ones, which rollout_preempted
    reads."""
    if run.args.preempt_fraction and run.world_size > 1:
        run.store.add(f"rollouts_done/{iteration}", 1)
