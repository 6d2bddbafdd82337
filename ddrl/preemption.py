"""DD-PPO's preemption (--preempt-fraction): once that share of the ranks finished its rollout, the
others cut theirs short, each having collected --min-rollout-fraction of its steps; the count lives
in the process group's store."""

from ddrl.launching import World


def rollout_preempted(world: World, args, iteration: int, step: int) -> bool:
    """Whether this rank ends its rollout of `iteration` before `step`, because --preempt-fraction
    of the ranks finished theirs and this one collected --min-rollout-fraction of its steps."""
    if not args.preempt_fraction or world.world_size == 1 or step < args.min_num_steps:
        return False
    if step % max(1, args.num_steps // 64):  # the store is asked every 64th of a rollout
        return False
    done = world.store.add(f"rollouts_done/{iteration}", 0)
    return done >= args.preempt_fraction * world.world_size


def rollout_finished(world: World, args, iteration: int) -> None:
    """Count this rank's rollout of `iteration` among the finished ones (rollout_preempted's)."""
    if args.preempt_fraction and world.world_size > 1:
        world.store.add(f"rollouts_done/{iteration}", 1)
