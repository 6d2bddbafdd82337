"""Researchers edit a copy of a script. An edit to the Agent must take effect in the rollout and in the update, or
stop the run at start with a message: never a run that acts with one network and learns with another."""

import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, assert_ok, read_scalars, run_command, run_dirs, run_python

FLAGS = {
    "ppo_continuous_mpi.py": ["--env-id", "InvertedPendulum-v5", "--num-steps", "256", "--total-timesteps", "512"]
    + ["--num-minibatches", "4", "--update-epochs", "2"],
    "vpg_mpi.py": ["--env-id", "CartPole-v1", "--steps-per-epoch", "500", "--total-timesteps", "1000"]
    + ["--train-v-iters", "5"],
    "ppo_atari_multigpu.py": ["--env-id", "BreakoutNoFrameskip-v4", "--num-steps", "32", "--total-timesteps", "512"],
}
PPO_TANH_MLP = "        nn.Tanh(),\n        layer_init(nn.Linear(64, 64)),\n        nn.Tanh(),\n"
VPG_HIDDEN_LAYER = "layers += [layer_init(nn.Linear(size, hidden)), nn.Tanh()]"
PPO_GAUSSIAN_HEADS = (
    "        self.actor_mean = mlp(obs_dim, action_dim, out_std=0.01)\n"
    "        self.actor_logstd = nn.Parameter(torch.zeros(action_dim))  # or a module (state-dependent)\n"
)
PPO_GAUSSIAN_POLICY = (
    "        log_std = self.actor_logstd  # state-dependent: self.actor_logstd(obs)\n"
    "        return GaussianActions(self.actor_mean(obs), log_std)\n"
)
BETA_ACTIONS = """class BetaActions:
    def __init__(self, alpha, beta):
        self.alpha = alpha
        self.beta = beta

    def sample(self, deterministic: bool = False):
        distribution = torch.distributions.Beta(torch.as_tensor(self.alpha), torch.as_tensor(self.beta))
        actions = distribution.mean if deterministic else distribution.sample()
        actions = actions.clamp(1e-6, 1 - 1e-6)
        return actions.numpy(), distribution.log_prob(actions).sum(-1).numpy()

    def log_prob_entropy(self, actions):
        distribution = torch.distributions.Beta(self.alpha, self.beta)
        return distribution.log_prob(actions).sum(-1), distribution.entropy().sum(-1)


class Agent(nn.Module):"""
VPG_SOFTMAX = "return GaussianActions(out, self.log_std) if self.continuous else CategoricalActions(out)"
# edits that a researcher makes in the Agent alone: the rollout follows them and both runs train
EDITS = {
    ("ppo_continuous_mpi.py", "tanh to ReLU"): [(PPO_TANH_MLP, PPO_TANH_MLP.replace("Tanh", "ReLU"))],
    ("ppo_continuous_mpi.py", "an extra hidden layer"): [
        (PPO_TANH_MLP, PPO_TANH_MLP + "        layer_init(nn.Linear(64, 64)),\n        nn.Tanh(),\n")
    ],
    ("ppo_continuous_mpi.py", "a LayerNorm"): [(PPO_TANH_MLP, "        nn.LayerNorm(64),\n" + PPO_TANH_MLP)],
    ("ppo_continuous_mpi.py", "a state-dependent log-std"): [
        (
            "self.actor_logstd = nn.Parameter(torch.zeros(action_dim))",
            "self.actor_logstd = layer_init(nn.Linear(obs_dim, action_dim), std=0.01)",
        ),
        ("log_std = self.actor_logstd  #", "log_std = self.actor_logstd(obs)  #"),
    ],
    ("ppo_continuous_mpi.py", "a wider Gaussian, in the Agent alone"): [
        ("log_std = self.actor_logstd  #", "log_std = self.actor_logstd + 0.5  #")
    ],
    ("ppo_continuous_mpi.py", "a Beta distribution"): [
        ("class Agent(nn.Module):", BETA_ACTIONS),
        (
            PPO_GAUSSIAN_HEADS,
            "        self.actor_alpha = nn.Sequential(mlp(obs_dim, action_dim, out_std=0.01), nn.Softplus())\n"
            "        self.actor_beta = nn.Sequential(mlp(obs_dim, action_dim, out_std=0.01), nn.Softplus())\n",
        ),
        (PPO_GAUSSIAN_POLICY, "        return BetaActions(self.actor_alpha(obs) + 1, self.actor_beta(obs) + 1)\n"),
    ],
    ("vpg_mpi.py", "tanh to ReLU"): [(VPG_HIDDEN_LAYER, VPG_HIDDEN_LAYER.replace("Tanh", "ReLU"))],
    ("vpg_mpi.py", "an extra hidden layer"): [
        ("self.actor = mlp(obs_dim, hidden_sizes,", "self.actor = mlp(obs_dim, (*hidden_sizes, 32),")
    ],
    ("vpg_mpi.py", "a LayerNorm"): [
        (VPG_HIDDEN_LAYER, VPG_HIDDEN_LAYER.replace("nn.Tanh()", "nn.LayerNorm(hidden), nn.Tanh()"))
    ],
    ("vpg_mpi.py", "a softmax temperature, in the Agent alone"): [
        (VPG_SOFTMAX, VPG_SOFTMAX.replace("CategoricalActions(out)", "CategoricalActions(out / 2)"))
    ],
}
# edits to one side only: the agreement check must stop the run before its first step, naming what differs (any
# quantity: "") and the functions that must agree
ONE_SIDED = {
    ("ppo_continuous_mpi.py", "the Gaussian's scoring alone"): (
        [
            (
                "- log_std - LOG_SQRT_2PI).sum(-1)\n        entropy",
                "- log_std - LOG_SQRT_2PI + 0.5).sum(-1)\n        entropy",
            )
        ],
        "log-probabilities",
        "GaussianActions.sample (on numpy copies of the Agent's networks) and GaussianActions.log_prob_entropy",
    ),
    ("ppo_continuous_mpi.py", "the numpy tanh alone"): (
        [("ddrl/numpy_rollout.py", "nn.Tanh: np.tanh,", "nn.Tanh: np.sin,")],
        "",
        "GaussianActions.sample (on numpy copies of the Agent's networks)",
    ),
    ("vpg_mpi.py", "a softmax temperature in the scoring alone"): (
        [
            (
                "log_probs = torch.log_softmax(self.logits, dim=-1)",
                "log_probs = torch.log_softmax(self.logits / 2, dim=-1)",
            )
        ],
        "log-probabilities",
        "CategoricalActions.sample (on numpy copies of the Agent's networks) and CategoricalActions.log_prob_entropy",
    ),
    ("vpg_mpi.py", "the numpy tanh alone"): (
        [("ddrl/numpy_rollout.py", "nn.Tanh: np.tanh,", "nn.Tanh: np.sin,")],
        "",
        "CategoricalActions.sample",
    ),
    ("ppo_atari_multigpu.py", "a softmax temperature in the sampling alone"): (
        [
            (
                "return actions, self.log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)",
                "return actions, torch.log_softmax(self.log_probs / 2, -1).gather(-1, actions[:, None])[:, 0]",
            )
        ],
        "log-probabilities",
        "CategoricalActions.sample (in RolloutPolicy.act) and CategoricalActions.log_prob_entropy",
    ),
}


def edited_copy(directory: Path, script: str, edits: list[tuple[str, ...]]) -> Path:
    """`script` copied into `directory` with every (old, new) edit applied, and (FILE, old, new) to the copy of ddrl's
    FILE beside it (which the copy then imports); each `old` must occur exactly once, so an edit that no longer
    applies fails here instead of testing the unmodified script."""
    directory.mkdir(parents=True, exist_ok=True)
    sources = {script: (ROOT / script).read_text()}
    for *file, old, new in edits:
        name = file[0] if file else script
        if name not in sources:
            shutil.copytree(ROOT / "ddrl", directory / "ddrl", ignore=shutil.ignore_patterns("__pycache__"))
            sources[name] = (ROOT / name).read_text()
        assert sources[name].count(old) == 1, f"{name}: expected {old!r} once"
        sources[name] = sources[name].replace(old, new)
    for name, source in sources.items():
        (directory / name).write_text(source)
    return directory / script


def train(copy: Path, *extra: str):
    """Two iterations of the copy at seed 1 with one rank, in its own folder; in a new process where ddrl was copied
    beside it (run_python's processes have imported the repository's)."""
    args = [*FLAGS[copy.name], "--seed", "1", *extra]
    if (copy.parent / "ddrl").exists():
        return run_command([sys.executable, str(copy), *args], copy.parent)
    return run_python(copy, args, copy.parent)


def losses(directory: Path) -> dict[str, list[tuple[int, float]]]:
    [run_dir] = run_dirs(directory)
    scalars = {key: value for key, value in read_scalars(run_dir).items() if key.startswith("losses/")}
    assert all(len(series) == 2 for series in scalars.values()), "expected two logged iterations"
    return scalars


@pytest.fixture(scope="module")
def unmodified_losses(tmp_path_factory) -> dict[str, dict]:
    """Each MLP script's logged losses, copied without an edit."""
    results = {}
    for script in ("ppo_continuous_mpi.py", "vpg_mpi.py"):
        copy = edited_copy(tmp_path_factory.mktemp("unmodified"), script, [])
        assert_ok(train(copy))
        results[script] = losses(copy.parent)
    return results


@pytest.mark.parametrize("script, edit", list(EDITS), ids=[f"{s[:-3]}: {e}" for s, e in EDITS])
def test_an_edit_to_the_agent_changes_what_the_run_learns(script, edit, tmp_path, unmodified_losses):
    """The copy trains (so the rollout agreed with the Agent at start and at both iterations) and logs other losses
    than the unmodified script at the same seed."""
    copy = edited_copy(tmp_path, script, EDITS[script, edit])
    assert_ok(train(copy))
    edited, unmodified = losses(tmp_path), unmodified_losses[script]
    assert edited.keys() == unmodified.keys()
    assert edited["losses/value_loss"] != unmodified["losses/value_loss"]
    assert edited["losses/policy_loss"] != unmodified["losses/policy_loss"]


@pytest.mark.parametrize("script, edit", list(ONE_SIDED), ids=[f"{s[:-3]}: {e}" for s, e in ONE_SIDED])
def test_an_edit_to_one_side_stops_the_run_at_start_naming_what_differs(script, edit, tmp_path):
    edits, quantity, functions = ONE_SIDED[script, edit]
    result = train(edited_copy(tmp_path, script, edits))
    assert result.returncode == 2, result.stderr[-3000:]
    [message] = [line for line in result.stderr.splitlines() if "error:" in line]
    assert f"at start, the rollout's {quantity}" in message and "differ from the Agent's by up to" in message
    assert functions in message and "edit both alike" in message
    assert "Traceback" not in result.stderr
    assert not re.search(r"(iteration|epoch) 1/", result.stdout), "no iteration may run before the check"


@pytest.mark.parametrize("script", ["ppo_continuous_mpi.py", "vpg_mpi.py"])
def test_a_layer_without_a_numpy_version_is_named_and_runs_with_no_numpy_rollout(script, tmp_path, unmodified_losses):
    old = PPO_TANH_MLP if script == "ppo_continuous_mpi.py" else VPG_HIDDEN_LAYER
    copy = edited_copy(tmp_path, script, [(old, old.replace("Tanh", "GELU"))])
    refused = train(copy)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "no numpy version of the Agent's layer GELU" in refused.stderr
    assert "add one to ddrl/numpy_rollout.py's numpy_module(), or pass --no-numpy-rollout" in refused.stderr
    assert not (tmp_path / "runs").exists()  # refused before its run folder was made
    assert_ok(train(copy, "--no-numpy-rollout"))
    assert losses(tmp_path)["losses/value_loss"] != unmodified_losses[script]["losses/value_loss"]


@pytest.mark.parametrize(
    ("script", "edit", "message"),
    [
        (
            "ppo_continuous_mpi.py",
            (
                "return GaussianActions(self.actor_mean(obs), log_std)",
                "return GaussianActions(torch.tanh(self.actor_mean(obs)), log_std)",
            ),
            "the rollout cannot run Agent.policy or Agent.value on numpy rows (TypeError: tanh(): argument 'input'",
        ),
        (
            "vpg_mpi.py",
            ("return self.critic(obs).squeeze(-1)", "return self.critic(obs)"),
            "the rollout's act gives values of shape (256, 1) for 256 observations",
        ),
    ],
    ids=["a torch function in the Agent's policy", "a value per row forgotten"],
)
def test_an_agent_the_rollout_cannot_run_stops_at_start_in_one_line(script, edit, message, tmp_path):
    result = train(edited_copy(tmp_path, script, [edit]))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if "error:" in line]
    assert message in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("script", "edit", "order"),
    [
        ("ppo_continuous_mpi.py", ("torch.randperm(returns.size, ", "torch.randperm(returns.shape[-1], "), 1),
        ("ppo_atari_multigpu.py", ("torch.randperm(returns.numel(), ", "torch.randperm(returns.shape[-1], "), 8),
    ],
    ids=["continuous", "atari"],
)
def test_minibatches_over_envs_with_sizes_in_samples_stop_in_one_line(script, edit, order, tmp_path):
    """Half of a recurrent edit: main's orders rank envs while minibatch_sizes still counts samples. The update stops
    in one line naming the two places that must agree, not in a traceback from an empty minibatch."""
    result = train(edited_copy(tmp_path, script, [edit]))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if "error:" in line]
    assert f"do not cut an epoch's order of {order} into non-empty pieces" in line
    assert "main's orders and minibatch_sizes must count the same things" in line
