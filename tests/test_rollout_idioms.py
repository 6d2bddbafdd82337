"""Idioms researchers copy into the Agent, as edits of ppo_continuous_mpi.py's: CleanRL SAC's tanh-squashed Gaussian
rescaled by registered buffers (as transforms of a TransformedDistribution, and written out on a sample), parameters
in an AffineTransform, and the alternatives the slower path's line names. Each edited Agent is built in-process on a
real env: the rollout derived from it stays on the numpy path and agrees with it, also after its buffers and
parameters change in place; or, where something has no numpy version, it runs the Agent's own torch code and says in
one line which construct, and what to write instead where there is an alternative."""

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from benchmark import common
from ddrl import rollout
from tests.helpers import ROOT

SCRIPT = "ppo_continuous_mpi.py"
ENV_ID = "HalfCheetah-v5"  # six action dims: a log-probability sums over them
FAST = "numpy versions of the Agent's methods"
SLOWER = "the rollout runs the Agent's own torch code, the slower path"
LOGSTD = "        self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))\n"
BUFFERS = LOGSTD + (  # as CleanRL's SAC registers them
    "        space = envs.single_action_space\n"
    "        scale = torch.tensor((space.high - space.low) / 2.0, dtype=torch.float32)\n"
    "        bias = torch.tensor((space.high + space.low) / 2.0, dtype=torch.float32)\n"
    '        self.register_buffer("action_scale", scale)\n'
    '        self.register_buffer("action_bias", bias)\n'
)
PARAMETERS = LOGSTD + (
    "        self.action_scale = nn.Parameter(torch.ones(action_dim))\n"
    "        self.action_bias = nn.Parameter(torch.zeros(action_dim))\n"
)
DISTRIBUTION = "        probs = Normal(action_mean, action_std)\n"
SAMPLE_AND_RETURN = (
    "        if action is None:\n"
    "            action = probs.sample()\n"
    "        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)\n"
)
TRANSFORMED = (
    "        probs = torch.distributions.TransformedDistribution(\n"
    "            Normal(action_mean, action_std),\n"
    "            [\n"
    "                torch.distributions.TanhTransform(),\n"
    "                torch.distributions.AffineTransform(self.action_bias, self.action_scale),\n"
    "            ],\n"
    "        )\n"
)
TRANSFORMED_RETURN = SAMPLE_AND_RETURN.replace("probs.entropy()", "probs.base_dist.entropy()")
WRITTEN_OUT = (  # CleanRL SAC's get_action, scoring a given action too
    "        if action is None:\n"
    "            x_t = probs.rsample()\n"
    "            y_t = torch.tanh(x_t)\n"
    "            action = y_t * self.action_scale + self.action_bias\n"
    "        else:\n"
    "            y_t = (action - self.action_bias) / self.action_scale\n"
    "            x_t = torch.atanh(y_t)\n"
    "        log_prob = probs.log_prob(x_t)\n"
    "        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)\n"
    "        return action, log_prob.sum(1), probs.entropy().sum(1), self.critic(x)\n"
)
ACTOR_HIDDEN = (  # the actor's, as test_one_place.py's edits find it
    "            nn.Tanh(),\n            layer_init(nn.Linear(64, 64)),\n            nn.Tanh(),\n"
    "            layer_init(nn.Linear(64, action_dim)"
)
# edits the rollout follows on the numpy path; those with a rescale have action_scale and action_bias
FAST_EDITS = {
    "buffers in a TransformedDistribution's tanh and affine transforms": [
        (LOGSTD, BUFFERS),
        (DISTRIBUTION, TRANSFORMED),
        (SAMPLE_AND_RETURN, TRANSFORMED_RETURN),
    ],
    "buffers rescaling the tanh of a sample, written out": [
        (LOGSTD, BUFFERS),
        (SAMPLE_AND_RETURN, WRITTEN_OUT),
    ],
    "parameters in an AffineTransform": [
        (LOGSTD, PARAMETERS),
        (DISTRIBUTION, TRANSFORMED),
        (SAMPLE_AND_RETURN, TRANSFORMED_RETURN),
    ],
    # the alternatives the slower path's lines below name
    "an Independent Normal for a diagonal MultivariateNormal": [
        (DISTRIBUTION, "        probs = torch.distributions.Independent(Normal(action_mean, action_std), 1)\n"),
        (SAMPLE_AND_RETURN, SAMPLE_AND_RETURN.replace(".sum(1)", "")),
    ],
    "a GELU's tanh approximation": [
        (ACTOR_HIDDEN, ACTOR_HIDDEN.replace("nn.Tanh()", 'nn.GELU(approximate="tanh")')),
    ],
}
# edits without a numpy version, and the line that says so
SLOWER_EDITS = {
    "a MultivariateNormal": (
        [
            (LOGSTD, LOGSTD + '        self.register_buffer("scale_tril", torch.eye(action_dim))\n'),
            (
                DISTRIBUTION,
                "        probs = torch.distributions.MultivariateNormal(action_mean, scale_tril=self.scale_tril)\n",
            ),
            (SAMPLE_AND_RETURN, SAMPLE_AND_RETURN.replace(".sum(1)", "")),
        ],
        "the distribution MultivariateNormal has no numpy version in ddrl/numpy_versions.py; with a diagonal "
        "covariance, Independent(Normal(loc, scale), 1) is the same distribution and has one",
    ),
    "an exact GELU": (
        [(ACTOR_HIDDEN, ACTOR_HIDDEN.replace("nn.Tanh()", "nn.GELU()", 1))],
        'the layer GELU (actor_mean.1) has no numpy version in ddrl/numpy_versions.py; nn.GELU(approximate="tanh"), '
        "its tanh approximation, has one",
    ),
    "a transform of a buffer without a numpy version": (
        [
            (LOGSTD, LOGSTD + '        self.register_buffer("cdf_scale", torch.tensor(3.0))\n'),
            (
                DISTRIBUTION,
                "        probs = torch.distributions.TransformedDistribution(Normal(action_mean, action_std), "
                "[torch.distributions.transforms.CumulativeDistributionTransform(Normal(0.0, self.cdf_scale))])\n",
            ),
            (SAMPLE_AND_RETURN, TRANSFORMED_RETURN),
        ],
        "the transform CumulativeDistributionTransform has no numpy version in ddrl/numpy_versions.py",
    ),
    "a tensor method": (
        [
            (
                "        action_mean = self.actor_mean(x)\n",
                "        action_mean = self.actor_mean(x)\n"
                "        action_mean = action_mean - action_mean.max(1, keepdim=True)[0]\n",
            )
        ],
        "the tensor method .max() has no numpy version in ddrl/numpy_versions.py; .amax(dim) has one "
        "(the maxima alone)",
    ),
    "a method the numpy distribution lacks": (
        [(SAMPLE_AND_RETURN, SAMPLE_AND_RETURN.replace("probs.log_prob(action)", "probs.cdf(action).log()"))],
        "the method Normal.cdf() has no numpy version in ddrl/numpy_versions.py",
    ),
}


def edited_agent(directory: Path, edits: list[tuple[str, str]]) -> tuple[torch.nn.Module, gym.vector.VectorEnv]:
    """ppo_continuous_mpi.py with every (old, new) edit applied (each `old` exactly once, so that an edit that no
    longer applies fails here), imported from `directory`, and its Agent built (seeded) on ENV_ID's env."""
    source = (ROOT / SCRIPT).read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"{SCRIPT}: expected {old!r} once"
        source = source.replace(old, new)
    (directory / SCRIPT).write_text(source)
    module = common.load_script(SCRIPT, directory)
    envs = gym.vector.SyncVectorEnv([module.make_env(module.Args(env_id=ENV_ID))])
    torch.manual_seed(0)
    return module.Agent(envs), envs


@pytest.mark.parametrize("edit", list(FAST_EDITS))
def test_an_idiom_stays_on_the_numpy_path_and_agrees_with_the_agent(edit, tmp_path, capsys):
    """The rollout is numpy's, said by nothing; after the rescale's buffers or parameters change in place (as a
    load_state_dict or an optimizer step changes them), its actions lie within bias +- scale, and the Agent gives the
    log-probabilities and values it recorded for them (rollout.check, and a direct comparison)."""
    agent, envs = edited_agent(tmp_path, FAST_EDITS[edit])
    space = envs.single_observation_space
    acting = rollout.derive(agent, space)
    assert acting.kind == FAST
    assert SLOWER not in capsys.readouterr().out
    action_dim = envs.single_action_space.shape[0]
    scale = torch.linspace(0.5, 2.0, action_dim)
    if hasattr(agent, "action_scale"):
        with torch.no_grad():
            agent.action_scale.copy_(scale)
            agent.action_bias.fill_(0.25)
    probe = rollout.probe(acting, space, torch.device("cpu"))
    rollout.check(agent, probe, "at start", acting.kind)  # stops (SystemExit) where they differ
    with torch.no_grad():
        _, log_prob, _, value = agent.get_action_and_value(probe["obs"], probe["actions"])
    np.testing.assert_allclose(probe["log_probs"], log_prob, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(probe["values"], value.flatten(), rtol=1e-5, atol=1e-5)
    if hasattr(agent, "action_scale"):
        assert ((probe["actions"] - 0.25).abs() <= scale).all()
        assert ((probe["actions"] - 0.25).abs() > 1).any()  # the new scale, not the one traced
    envs.close()


def test_the_mode_of_a_written_out_rescale_is_the_rescaled_tanh_of_the_mean(tmp_path):
    """Evaluation's deterministic program (each sample its distribution's mode): tanh(mean) * scale + bias, with the
    buffers as they are now."""
    agent, envs = edited_agent(tmp_path, FAST_EDITS["buffers rescaling the tanh of a sample, written out"])
    mode = rollout.derive(agent, envs.single_observation_space, deterministic=True)
    assert mode.kind == FAST
    with torch.no_grad():
        agent.action_bias.fill_(-0.5)
        agent.action_scale.fill_(3.0)
    obs = torch.randn(5, envs.single_observation_space.shape[0])
    with torch.no_grad():
        expected = torch.tanh(agent.actor_mean(agent.obs_rms.normalize(obs))) * 3.0 - 0.5
    np.testing.assert_allclose(mode.get_action_and_value(obs.numpy())[0], expected, rtol=1e-5, atol=1e-5)
    envs.close()


def test_a_rollout_derived_once_follows_the_weights_as_training_changes_them(tmp_path):
    """The scripts derive the rollout's Agent once, before the loop: after a fused Adam step and a statistics update
    (RunningMeanStd.update's copy_ and +=), as an iteration makes them, and again after a parameter's data and a
    buffer are put in another's place and the rollout's Agent rereads them (as the scripts call it where their update
    ends), it gives the Agent's log-probabilities and values at the new weights."""
    agent, envs = edited_agent(tmp_path, [])
    space = envs.single_observation_space
    cpu = torch.device("cpu")
    acting = rollout.derive(agent, space)
    assert acting.kind == FAST

    def follows(earlier: dict) -> dict:
        """The rollout's probe now, which the Agent gives, where it no longer gives `earlier`'s."""
        probe = rollout.probe(acting, space, cpu)
        with torch.no_grad():
            _, log_prob, _, value = agent.get_action_and_value(probe["obs"], probe["actions"])
            _, moved, _, _ = agent.get_action_and_value(earlier["obs"], earlier["actions"])
        assert (moved - earlier["log_probs"]).abs().max() > 0.1  # the weights changed
        np.testing.assert_allclose(probe["log_probs"], log_prob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(probe["values"], value.flatten(), rtol=1e-5, atol=1e-5)
        values = acting.get_value(probe["obs"].numpy()).flatten()
        np.testing.assert_allclose(values, value.flatten(), rtol=1e-5, atol=1e-5)
        return probe

    start = rollout.probe(acting, space, cpu)
    optimizer = torch.optim.Adam(agent.parameters(), lr=0.01, eps=1e-5, fused=True)
    _, log_prob, _, value = agent.get_action_and_value(start["obs"], start["actions"])
    (value.square().mean() - log_prob.mean()).backward()
    optimizer.step()
    observations = 3.0 * torch.randn(64, space.shape[0], dtype=torch.float64) + 1.0
    mean = observations.mean(0)
    agent.obs_rms.update(torch.tensor(64.0, dtype=torch.float64), mean, ((observations - mean) ** 2).sum(0))
    trained = follows(start)
    rollout.check(agent, trained, "after the rollout", acting.kind)  # as every iteration does, before its update
    agent.actor_logstd.data = torch.full_like(agent.actor_logstd, -0.5)
    agent.obs_rms.shift = agent.obs_rms.shift + 0.5
    acting.reread()  # as the scripts call it where their update ends
    follows(trained)
    envs.close()


@pytest.mark.parametrize("edit", list(SLOWER_EDITS))
def test_a_construct_without_a_numpy_version_is_named_in_one_line(edit, tmp_path, capsys):
    """The rollout runs the Agent's own torch code (which agrees with it) and says so once, however often it is
    derived: the line names the construct, and the alternative where there is one; never a numpy error's text."""
    edits, reason = SLOWER_EDITS[edit]
    agent, envs = edited_agent(tmp_path, edits)
    space = envs.single_observation_space
    acting = rollout.derive(agent, space)
    assert rollout.derive(agent, space).kind == acting.kind == "the Agent's own torch code"
    said = [line for line in capsys.readouterr().out.splitlines() if SLOWER in line]
    assert said == [f"{SLOWER}: {reason}"]
    probe = rollout.probe(acting, space, torch.device("cpu"))
    rollout.check(agent, probe, "at start", acting.kind)
    envs.close()


def test_a_deterministic_rollout_of_a_distribution_without_a_mode_stops_in_one_line(tmp_path, capsys):
    """--eval-deterministic takes each distribution's mode; a TransformedDistribution has none, in numpy or torch, so
    the rollout stops before an episode begins, in one line naming the flag, where it raised mid-episode."""
    edits = FAST_EDITS["buffers in a TransformedDistribution's tanh and affine transforms"]
    agent, envs = edited_agent(tmp_path, edits)
    with pytest.raises(SystemExit) as stopped:
        rollout.derive(agent, envs.single_observation_space, deterministic=True)
    envs.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(lines) == 1, lines
    assert "--eval-deterministic needs the mode of the Agent's distribution" in lines[0]
    assert "evaluate without --eval-deterministic" in lines[0]
