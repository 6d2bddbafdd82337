"""DD-PPO's preemption (--preempt-fraction) in both PPO scripts. A straggling rank 1 is cut short once rank 0 has
finished its rollout; the world trains on what was collected, checkpoints, and a resumed run goes on."""

import importlib
import os
import time

import pytest

from tests.helpers import WAIT, assert_same_parameters, read_scalars, run_dirs, run_ranks

# (flags of a tiny run, env steps per env of a full rollout, envs per rank)
SCRIPTS = {
    "ppo_continuous_mpi": (
        ["--env-id", "Hopper-v5", "--num-steps", "64", "--num-minibatches", "4", "--update-epochs", "2"]
        + ["--no-compile"],
        64,
        1,
    ),
    "ppo_atari_multigpu": (
        ["--env-id", "BreakoutNoFrameskip-v4", "--local-num-envs", "2", "--num-steps", "32"]
        + ["--num-minibatches", "2", "--update-epochs", "1"],
        32,
        2,
    ),
}
CASES = [("ppo_continuous_mpi", ()), ("ppo_continuous_mpi", ("--sync", "gather")), ("ppo_atari_multigpu", ())]


def straggler_rank(rank: int, world_size: int, folder: str, script: str, flags: list[str]) -> dict:
    """`main` of `script` with rank 1 a straggler: once it has collected the least share of a rollout, it steps no
    further until rank 0 has finished its own (as the slowest env would, on a machine however fast or busy), asking
    the run's own preemption check; returns the trained weights."""
    import tyro

    from ddrl import preemption

    os.chdir(folder)
    module = importlib.import_module(script)
    preempted = preemption.rollout_preempted

    def straggling(world, args, iteration: int, step: int) -> bool:
        deadline = time.monotonic() + WAIT
        while step >= args.min_num_steps and not preempted(world, args, iteration, step):
            assert time.monotonic() < deadline, f"rank 0 did not finish its rollout of iteration {iteration}"
            time.sleep(0.01)
        return preempted(world, args, iteration, step)

    if rank == 1:
        preemption.rollout_preempted = straggling
    agent = module.main(tyro.cli(module.Args, args=flags))
    return agent.state_dict()


@pytest.mark.parametrize(("script", "mode"), CASES, ids=["continuous", "continuous-gather", "atari"])
def test_a_straggler_is_cut_short_and_a_preempted_run_checkpoints_and_resumes(script, mode, tmp_path):
    script_flags, num_steps, envs = SCRIPTS[script]
    full, minimum = envs * num_steps, envs * num_steps // 4  # one rank's samples: a whole rollout, the least kept
    run_flags = [*script_flags, *mode, "--preempt-fraction", "0.5", "--run-name", "cut", "--check-sync-every", "1"]
    first = [*run_flags, "--total-timesteps", str(2 * 2 * full), "--checkpoint-every", "1"]  # 2 world batches
    states = run_ranks(straggler_rank, 2, tmp_path, str(tmp_path), script, first, join_group=False, timeout=WAIT)
    assert_same_parameters(states)
    [run_dir] = run_dirs(tmp_path)
    steps = [step for step, _ in read_scalars(run_dir)["charts/SPS"]]
    # rank 0 collects its whole rollout; rank 1 is cut short, after --min-rollout-fraction 0.25 of it
    collected_by_rank1 = [now - before - full for before, now in zip([0, *steps], steps, strict=False)]
    assert collected_by_rank1 == [minimum] * len(steps), (steps, full)
    # so the world needs more than 2 iterations to collect the 2 world batches it was given
    assert len(steps) > 2 and steps[-2] < 4 * full <= steps[-1]

    # resumed with a larger budget, from the last checkpoint: the curve goes on from its step
    checkpoint = sorted(run_dir.glob("checkpoints/iter_*.safetensors"))[-1]
    assert checkpoint.name == f"iter_{len(steps):06d}.safetensors"
    second = [*run_flags, "--total-timesteps", str(2 * 4 * full), "--resume", "--save-model"]
    states = run_ranks(straggler_rank, 2, tmp_path, str(tmp_path), script, second, join_group=False, timeout=WAIT)
    assert_same_parameters(states)
    resumed = [step for step, _ in read_scalars(run_dir)["charts/SPS"]]
    assert resumed[: len(steps)] == steps and len(resumed) > len(steps)
    assert all(now - before == full + minimum for before, now in zip(resumed, resumed[1:], strict=False))
    assert resumed[-2] < 8 * full <= resumed[-1]
    assert (run_dir / "model.safetensors").exists()
