"""Bad input to each script: one clear message and exit 2, no traceback, nothing written under runs/."""

import importlib.util
from pathlib import Path

import gymnasium as gym
import pytest

import ppo_atari_multigpu
import ppo_continuous_mpi
import vpg_mpi
from tests.helpers import ROOT, finish_python, progress_lines, refuse, run_python, start_python, tiny_flags

SCRIPTS = {"atari": ppo_atari_multigpu, "continuous": ppo_continuous_mpi, "vpg": vpg_mpi}


class TupleActions(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
    action_space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(2)))

    def __init__(self, render_mode: str | None = None):
        self.render_mode = render_mode


gym.register("ddrl-test/TupleActions-v0", entry_point=TupleActions)

WITHOUT_MOVIEPY = pytest.mark.skipif(importlib.util.find_spec("moviepy") is not None, reason="moviepy is installed")


@pytest.mark.parametrize(
    ("script", "flags", "world_size", "message"),
    [
        ("atari", "--env-id CartPole-v1", 1, "is not an Atari game"),
        ("atari", "--env-id NoSuchGame-v4", 1, "unknown --env-id 'NoSuchGame-v4'"),
        ("atari", "--env-id Breakout-v4", 1, "skips a random number of frames"),
        ("atari", "--local-num-envs 3 --num-steps 5", 1, "does not split into --num-minibatches 4"),
        ("atari", "--total-timesteps 1024", 2, "zero iterations"),
        ("atari", "--num-steps 0", 1, "--num-steps must be at least 1, got 0"),
        ("atari", "--target-kl 0", 1, "--target-kl must be greater than 0, got 0.0"),
        ("atari", "--eval-checkpoint missing/model.pt", 1, "does not exist"),
        ("atari", "--preempt-fraction 1.5", 2, "--preempt-fraction must be at most 1, got 1.5"),
        ("continuous", "--num-steps 100", 1, "--num-minibatches 32 does not divide the local batch of 100 steps"),
        ("continuous", "--num-steps 64 --local-num-envs 2 --num-minibatches 3", 2, "does not divide the local batch"),
        ("continuous", "--total-timesteps 4000", 2, "less than one iteration's batch of 4096 steps"),
        ("continuous", "--env-id NoSuchEnv-v0", 1, "unknown or unusable --env-id 'NoSuchEnv-v0'"),
        (
            "continuous",
            "--env-id CartPole-v1",
            1,
            "--env-id 'CartPole-v1' has Discrete actions; ppo_continuous_mpi.py needs Box actions",
        ),
        ("continuous", "--eval-checkpoint missing/model.pt", 1, "--eval-checkpoint 'missing/model.pt' does not exist"),
        ("continuous", "--update-epochs 0", 1, "--update-epochs must be at least 1, got 0"),
        (
            "continuous",
            "--preempt-fraction 0.5 --min-rollout-fraction 0",
            2,
            "--min-rollout-fraction must be greater than 0",
        ),
        pytest.param("continuous", "--capture-video", 1, "--capture-video needs moviepy", marks=WITHOUT_MOVIEPY),
        ("vpg", "--steps-per-epoch 4000", 3, "does not split evenly across 3 ranks"),
        ("vpg", "--steps-per-epoch 4000 --local-num-envs 3", 2, "does not split across --local-num-envs 3"),
        ("vpg", "--total-timesteps 1000", 1, "zero epochs"),
        ("vpg", "--env-id NoSuchEnv-v0", 1, "unknown or unusable --env-id 'NoSuchEnv-v0'"),
        ("vpg", "--env-id ddrl-test/TupleActions-v0", 1, "has Tuple actions"),
        ("vpg", "--eval-checkpoint missing/model.pt", 1, "does not exist"),
        ("vpg", "--nprocs 0", 1, "--nprocs must be at least 1, got 0"),
    ],
)
def test_bad_input_is_one_clear_message(script, flags, world_size, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert message in refuse(SCRIPTS[script], flags.split(), monkeypatch, capsys, WORLD_SIZE=str(world_size))
    assert not (tmp_path / "runs").exists()


def test_compile_without_a_cpp_compiler_says_so_in_one_line_and_trains_eagerly(tmp_path):
    """--compile on a CPU without the C++ compiler that torch.compile builds with is no error."""
    flags = tiny_flags("ppo_continuous_mpi.py", 2, "--compile")
    process = start_python(ROOT / "ppo_continuous_mpi.py", flags, tmp_path, CXX="no-such-compiler")
    result = finish_python(process, 120)
    assert result.returncode == 0, result.stderr
    assert progress_lines(result.stdout) == [1, 2]
    warnings = [line for line in result.stderr.splitlines() if "C++ compiler" in line]
    assert warnings == [
        "ppo_continuous_mpi.py: warning: no C++ compiler ('no-such-compiler' is not on PATH), so the update runs "
        "eagerly: install g++ for the compiled update, or pass --no-compile"
    ]


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("atari", "--env-id CartPole-v1", "is not an Atari game"),
        ("continuous", "--num-minibatches 7", "does not divide"),
        ("vpg", "--sync ring", "--sync"),  # refused by tyro: not one of the sync modes
    ],
)
def test_bad_input_from_the_command_line_exits_without_a_traceback(script, flags, message, tmp_path):
    result = run_python(Path(SCRIPTS[script].__file__), flags.split(), tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_every_flag_that_breaks_its_rule_is_one_line_of_its_own(tmp_path):
    """All at once, before anything runs: the user fixes them in one go."""
    result = run_python(Path(vpg_mpi.__file__), ["--gamma", "2", "--hidden-sizes", "0", "70000"], tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "vpg_mpi.py: error: --hidden-sizes[0] must be at least 1, got 0",
        "vpg_mpi.py: error: --hidden-sizes[1] must be at most 65536, got 70000",
        "vpg_mpi.py: error: --gamma must be at most 1, got 2.0",
    ], result.stderr
    assert not (tmp_path / "runs").exists()
