"""A user's own env through gymnasium's `module:EnvId` form, in every script (gym.make imports the module)."""

import pytest

from tests.helpers import ROOT, assert_ok, progress_lines, refuse, run_python

USER_ENV = "tests.user_envs:Point-v0"
# tiny runs of two iterations on one rank
RUNS = {
    "ppo_continuous_mpi.py": ["--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "1"]
    + ["--total-timesteps", "128"],
    "vpg_mpi.py": ["--steps-per-epoch", "100", "--train-v-iters", "2", "--total-timesteps", "200"],
}


@pytest.mark.parametrize("script", RUNS)
def test_a_user_env_module_trains(script, tmp_path):
    result = run_python(ROOT / script, ["--env-id", USER_ENV, *RUNS[script]], tmp_path)
    assert_ok(result)
    assert progress_lines(result.stdout) == [1, 2]


def test_atari_refuses_a_user_env_that_is_not_an_atari_game(monkeypatch, capsys, tmp_path):
    import ppo_atari_multigpu

    monkeypatch.chdir(tmp_path)
    message = refuse(ppo_atari_multigpu, ["--env-id", USER_ENV], monkeypatch, capsys)
    assert "Point-v0" in message and "Atari" in message
