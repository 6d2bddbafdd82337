"""benchmark.throughput on tiny budgets (real runs of every script, 2 iterations of 64 steps), no timing asserts."""

import numpy as np
import pytest
import torch

from benchmark import common, throughput
from tests.helpers import ROOT


def test_throughput_table_sets_every_script_beside_its_bound(tmp_path, capsys):
    work = tmp_path / "work"
    argv = ["--iterations", "2", "--local-steps", "64", "--env-seconds", "0.1", "--out", str(tmp_path / "throughput")]
    argv += ["--out-dir", str(work), "--variants", "ppo_atari_multigpu.py --bf16"]  # --compile: a minute of compiling
    text = throughput.main([*argv, "--max-load", "1000"]).read_text()
    assert "MEASURED UNDER LOAD" not in text and "python -m benchmark.throughput --iterations 2" in text
    rows = common.table_rows(text, "script")
    # every script (its defaults but the batch), then the variant: Atari with --bf16, beside the same bound
    assert [row[0] for row in rows] == [*common.SCRIPTS, "ppo_atari_multigpu.py"]
    assert rows[-1][1].endswith("(this checkout) --bf16") and rows[-1][3] == rows[-2][3]
    printed = capsys.readouterr().out
    runs = [f"throughput__{script[:-3]}__this__0" for script in common.SCRIPTS]
    runs.append("throughput__ppo_atari_multigpu__bf16__0")
    for script, row, run in zip([*common.SCRIPTS, "ppo_atari_multigpu.py"], rows, runs, strict=True):
        assert "(this checkout)" in row[1]
        bound, kind = row[3].split(" ", 1)
        assert kind == ("(compute limit)" if script == "ppo_atari_multigpu.py" else "(env only)")
        # the script's SPS is the one from its own TensorBoard events, iterations 2.. (two iterations logged)
        events = common.read_scalar_events(work / "runs" / run)
        (wall_1, step_1, _), (wall_2, step_2, _) = events["charts/SPS"]
        assert step_2 - step_1 == 64  # --local-steps, whatever the script's own batch
        assert row[4] == f"{(step_2 - step_1) / (wall_2 - wall_1):,.0f}"
        sps, bound_sps = float(row[4].replace(",", "")), float(bound.replace(",", ""))
        ratio = sps / bound_sps
        # the ratio column comes from the unrounded numbers, the table shows whole SPS: on a loaded machine a bound of
        # a few dozen SPS moves the ratio by more than its own last digit
        slack = ratio * (0.5 / sps + 0.5 / bound_sps)
        if script == "ppo_atari_multigpu.py":
            assert row[6] == "1.2x"
            assert float(row[5]) == pytest.approx(ratio, abs=0.011 + slack)
        else:
            assert float(row[5].rstrip("%")) == pytest.approx(100 * ratio, abs=1.01 + 100 * slack)
            assert row[6] == ("50%" if script == "vpg_mpi.py" else "30%")
        assert row[7] in ("yes", "no")
        assert f"{script}: " in printed
    assert "Atari compute limit parts: batch-8 act" in text


def test_compare_with_another_checkout_alternates_the_two_quiet_and_beside_a_busy_core(tmp_path):
    """Both checkouts, alternately, on the machine as it is and again beside a process spinning on the last usable core
    (issue 37's table)."""
    work = tmp_path / "work"
    argv = ["--scripts", "vpg_mpi.py", "--env-id", "CartPole-v1", "--iterations", "2", "--local-steps", "500"]
    argv += ["--env-seconds", "0.1"]
    argv += ["--compare-with", str(ROOT), "--loads", "quiet", "busy core"]
    argv += ["--out", str(tmp_path / "ab"), "--out-dir", str(work), "--max-load", "-1"]
    text = throughput.main(argv).read_text()
    assert text.splitlines()[2].startswith("**MEASURED UNDER LOAD")  # above the load limit: said at the top
    rows = common.table_rows(text, "script")
    assert [row[:3:2] for row in rows] == [["vpg_mpi.py", "CartPole-v1"]] * 4
    busy = ", beside a busy core"
    assert not rows[0][1].endswith("(this checkout)") and rows[1][1].endswith("(this checkout)")
    assert rows[2][1] == rows[0][1] + busy and rows[3][1] == rows[1][1] + busy
    assert rows[0][3] == rows[1][3] and rows[2][3] == rows[3][3]  # one bound for both checkouts, per load
    runs = sorted(path.name for path in (work / "runs").iterdir())
    assert runs == [f"throughput__vpg_mpi__{tag}__0" for tag in ("other", "other__busy", "this", "this__busy")]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="iterations >= 2"):
        throughput.main(["--iterations", "1", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="variant's first word"):
        throughput.main(["--variants", "ppo_atari.py --bf16", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="has no vpg_mpi.py"):
        throughput.main(["--scripts", "vpg_mpi.py", "--compare-with", str(tmp_path), "--out", str(tmp_path / "x")])


@pytest.mark.parametrize(
    ("script", "env_id"),
    [("vpg_mpi.py", "HalfCheetah-v5"), ("vpg_mpi.py", "CartPole-v1"), ("ppo_continuous_mpi.py", "HalfCheetah-v5")],
)
def test_numpy_rollout_policy_acts_as_the_torch_modules_and_follows_updates_and_loads(script, env_id):
    """RolloutPolicy (numpy views of the parameters) against the nn.Sequential modules and the log-probabilities the
    update computes, after an optimizer step and a load_state_dict made with the policy already built."""
    import gymnasium as gym

    module = common.load_script(script)
    env = gym.make(env_id)
    obs_dim = env.observation_space.shape[0]
    torch.manual_seed(0)
    if script == "vpg_mpi.py":
        agent, other = (module.Agent(obs_dim, env.action_space, (64, 64)) for _ in range(2))
        actor, critic = agent.actor, agent.critic

        def log_prob_of(obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
            return agent.log_prob_entropy(obs, actions)[0]
    else:
        agent, other = (module.Agent(obs_dim, env.action_space.shape[0]) for _ in range(2))
        actor, critic = agent.actor_mean, agent.critic

        def log_prob_of(obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
            return agent.log_prob_entropy_value(obs, actions)[0]

    policy = agent.rollout_policy()
    obs = torch.randn(5, obs_dim)
    for change in ("none", "step", "load"):
        if change == "step":
            optimizer = torch.optim.Adam(agent.parameters(), lr=0.1)
            sum(p.sum() for p in agent.parameters()).backward()
            optimizer.step()
        elif change == "load":
            agent.load_state_dict(other.state_dict())
        with torch.no_grad():
            expected_out, expected_value = actor(obs), critic(obs).squeeze(-1)
        np.random.seed(1)
        actions, log_prob, value = policy.act(obs.numpy())
        np.random.seed(1)
        assert np.array_equal(policy.act(obs.numpy())[0], actions), change  # reproducible from numpy's seed
        np.testing.assert_allclose(value, expected_value.numpy(), rtol=1e-5, atol=1e-5, err_msg=change)
        with torch.no_grad():  # the rollout's log-probabilities are the update's: PPO's ratio starts at 1
            expected_log_prob = log_prob_of(obs, torch.as_tensor(actions, dtype=torch.float32)).numpy()
        np.testing.assert_allclose(log_prob, expected_log_prob, rtol=1e-5, atol=1e-5, err_msg=change)
        mode = policy.act(obs.numpy(), deterministic=True)[0]
        expected_mode = expected_out.argmax(-1) if env_id == "CartPole-v1" else expected_out
        np.testing.assert_allclose(mode, expected_mode.numpy(), rtol=1e-5, atol=1e-5, err_msg=change)
    if env_id == "CartPole-v1":  # sampled actions follow the softmax (made far from uniform first)
        with torch.no_grad():  # logits 0 and log 3 at every observation: probabilities 1/4 and 3/4, whatever the init
            actor[-1].weight.zero_()
            actor[-1].bias.copy_(torch.tensor([0.0, np.log(3.0)]))
        probabilities = torch.softmax(actor(obs[:1]), -1)[0].detach().numpy()
        assert 0.1 < probabilities[0] < 0.4 or 0.6 < probabilities[0] < 0.9, probabilities
        np.random.seed(2)
        draws = policy.act(np.repeat(obs[:1].numpy(), 20_000, axis=0))[0]
        np.testing.assert_allclose(np.bincount(draws, minlength=2) / len(draws), probabilities, atol=0.015)
