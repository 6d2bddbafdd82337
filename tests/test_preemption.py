"""DD-PPO's preemption (--preempt-fraction) in both PPO scripts. A straggling rank 1 (its env steps sleep) is cut
short once rank 0 has finished its rollout; the world trains on what was collected, checkpoints, and a resumed run
goes on."""

import importlib
import os
import time

import gymnasium as gym
import pytest

from tests.helpers import assert_same_parameters, read_scalars, run_dirs, run_ranks

# (flags of a tiny run, env steps per env of a full rollout, envs per rank, seconds rank 1 sleeps per env step)
SCRIPTS = {
    "ppo_continuous_mpi": (
        ["--env-id", "Hopper-v5", "--num-steps", "64", "--num-minibatches", "4", "--update-epochs", "2"]
        + ["--no-compile"],
        64,
        1,
        0.01,
    ),
    "ppo_atari_multigpu": (
        ["--env-id", "BreakoutNoFrameskip-v4", "--local-num-envs", "2", "--num-steps", "32"]
        + ["--num-minibatches", "2", "--update-epochs", "1"],
        32,
        2,
        0.025,
    ),
}
CASES = [("ppo_continuous_mpi", ()), ("ppo_continuous_mpi", ("--sync", "gather")), ("ppo_atari_multigpu", ())]


class SlowEnv(gym.Wrapper):
    """A straggler's env: each step first sleeps (a slower simulator, a loaded node)."""

    delay = 0.0

    def step(self, action):
        time.sleep(self.delay)
        return super().step(action)


class SlowVectorEnv:
    """AtariVectorEnv whose every step (the script sends actions, then receives the results) first sleeps."""

    def __init__(self, envs, delay: float):
        self.envs, self.delay = envs, delay

    def __getattr__(self, name: str):
        return getattr(self.envs, name)

    def send(self, actions):
        time.sleep(self.delay)
        return self.envs.send(actions)


def straggler_rank(rank: int, world_size: int, folder: str, script: str, flags: list[str]) -> dict:
    """`main` of `script` with rank 1's env steps slowed down; returns the trained weights."""
    import tyro

    os.chdir(folder)
    module = importlib.import_module(script)
    delay = SCRIPTS[script][3] if rank == 1 else 0.0
    make_env = module.make_env
    if script == "ppo_atari_multigpu":
        module.make_env = lambda *args, **kwargs: SlowVectorEnv(make_env(*args, **kwargs), delay)
    else:
        SlowEnv.delay = delay
        module.make_env = lambda args, video_folder=None: lambda: SlowEnv(make_env(args, video_folder)())
    agent = module.main(tyro.cli(module.Args, args=flags))
    return agent.state_dict()


@pytest.mark.parametrize(("script", "mode"), CASES, ids=["continuous", "continuous-gather", "atari"])
def test_a_straggler_is_cut_short_and_a_preempted_run_checkpoints_and_resumes(script, mode, tmp_path):
    script_flags, num_steps, envs, _ = SCRIPTS[script]
    full, minimum = envs * num_steps, envs * num_steps // 4  # one rank's samples: a whole rollout, the least kept
    run_flags = [*script_flags, *mode, "--preempt-fraction", "0.5", "--run-name", "cut", "--check-sync-every", "1"]
    first = [*run_flags, "--total-timesteps", str(2 * 2 * full), "--checkpoint-every", "1"]  # 2 world batches
    states = run_ranks(straggler_rank, 2, tmp_path, str(tmp_path), script, first, join_group=False, timeout=180)
    assert_same_parameters(states)
    [run_dir] = run_dirs(tmp_path)
    steps = [step for step, _ in read_scalars(run_dir)["charts/SPS"]]
    # rank 0 collects its whole rollout; rank 1 is cut short, after at least --min-rollout-fraction 0.25 of it
    collected_by_rank1 = [now - before - full for before, now in zip([0, *steps], steps, strict=False)]
    assert all(minimum <= samples < full for samples in collected_by_rank1), (steps, full)
    # so the world needs more than 2 iterations to collect the 2 world batches it was given
    assert len(steps) > 2 and steps[-2] < 4 * full <= steps[-1]

    # resumed with a larger budget, from the last checkpoint: the curve goes on from its step
    checkpoint = sorted(run_dir.glob("checkpoints/iter_*.safetensors"))[-1]
    assert checkpoint.name == f"iter_{len(steps):06d}.safetensors"
    second = [*run_flags, "--total-timesteps", str(2 * 4 * full), "--resume", "--save-model"]
    states = run_ranks(straggler_rank, 2, tmp_path, str(tmp_path), script, second, join_group=False, timeout=180)
    assert_same_parameters(states)
    resumed = [step for step, _ in read_scalars(run_dir)["charts/SPS"]]
    assert resumed[: len(steps)] == steps and len(resumed) > len(steps)
    assert all(full + minimum <= now - before < 2 * full for before, now in zip(resumed, resumed[1:], strict=False))
    assert resumed[-2] < 8 * full <= resumed[-1]
    assert (run_dir / "model.safetensors").exists()
