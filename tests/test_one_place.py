"""Researchers edit a copy of a script. An edit to the Agent must take effect in the rollout and in the update, or
stop the run at start with a message: never a run that acts with one network and learns with another."""

import re
from pathlib import Path

import pytest

from tests.helpers import ROOT, assert_ok, read_scalars, run_dirs, run_python

FLAGS = {
    "ppo_continuous_mpi.py": ["--env-id", "InvertedPendulum-v5", "--num-steps", "256", "--total-timesteps", "512"]
    + ["--num-minibatches", "4", "--update-epochs", "2"],
    "vpg_mpi.py": ["--env-id", "CartPole-v1", "--steps-per-epoch", "500", "--total-timesteps", "1000"]
    + ["--train-v-iters", "5"],
    "ppo_atari_multigpu.py": ["--env-id", "BreakoutNoFrameskip-v4", "--num-steps", "32", "--total-timesteps", "512"],
}
PPO_TANH_MLP = "        nn.Tanh(),\n        layer_init(nn.Linear(64, 64)),\n        nn.Tanh(),\n"
ATARI_SAMPLING = "actions = log_probs.argmax(-1) if deterministic"
VPG_HIDDEN_LAYER = "layers += [layer_init(nn.Linear(size, hidden)), nn.Tanh()]"
# edits that a researcher makes in the Agent's modules alone: the rollout follows them and both runs train
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
    ("vpg_mpi.py", "tanh to ReLU"): [(VPG_HIDDEN_LAYER, VPG_HIDDEN_LAYER.replace("Tanh", "ReLU"))],
    ("vpg_mpi.py", "an extra hidden layer"): [
        ("self.actor = mlp(obs_dim, hidden_sizes,", "self.actor = mlp(obs_dim, (*hidden_sizes, 32),")
    ],
    ("vpg_mpi.py", "a LayerNorm"): [
        (VPG_HIDDEN_LAYER, VPG_HIDDEN_LAYER.replace("nn.Tanh()", "nn.LayerNorm(hidden), nn.Tanh()"))
    ],
    ("vpg_mpi.py", "a softmax temperature, in the Agent and the rollout alike"): [
        ("log_probs = torch.log_softmax(out, dim=-1)", "log_probs = torch.log_softmax(out / 2, dim=-1)"),
        ("shifted = out - out.max(-1, keepdims=True)", "shifted = out / 2 - (out / 2).max(-1, keepdims=True)"),
    ],
}
# edits to one side only: the agreement check must stop the run before its first step, naming what differs (any
# quantity: "") and the functions that must agree
ONE_SIDED = {
    ("ppo_continuous_mpi.py", "the Agent's log-std, not the rollout's"): (
        [("log_std = self.actor_logstd  #", "log_std = self.actor_logstd + 0.5  #")],
        "log-probabilities",
        "RolloutPolicy.act",
    ),
    ("ppo_continuous_mpi.py", "the numpy tanh alone"): (
        [("nn.Tanh: np.tanh,", "nn.Tanh: np.sin,")],
        "",
        "RolloutPolicy.act",
    ),
    ("vpg_mpi.py", "a softmax temperature in the Agent alone"): (
        [("log_probs = torch.log_softmax(out, dim=-1)", "log_probs = torch.log_softmax(out / 2, dim=-1)")],
        "log-probabilities",
        "Agent.log_prob_entropy",
    ),
    ("vpg_mpi.py", "the numpy tanh alone"): ([("nn.Tanh: np.tanh,", "nn.Tanh: np.sin,")], "", "RolloutPolicy.act"),
    ("ppo_atari_multigpu.py", "a softmax temperature in act alone"): (
        [(ATARI_SAMPLING, "log_probs = torch.log_softmax(log_probs / 2, dim=-1)\n        " + ATARI_SAMPLING)],
        "log-probabilities",
        "RolloutPolicy.act and Agent.log_prob_entropy_value",
    ),
}


def edited_copy(directory: Path, script: str, edits: list[tuple[str, str]]) -> Path:
    """`script` copied into `directory` with every (old, new) edit applied; each `old` must occur exactly once, so an
    edit that no longer applies fails here instead of testing the unmodified script."""
    source = (ROOT / script).read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"{script}: expected {old!r} once"
        source = source.replace(old, new)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / script).write_text(source)
    return directory / script


def train(copy: Path, *extra: str):
    """Two iterations of the copy at seed 1 with one rank, in its own folder."""
    return run_python(copy, [*FLAGS[copy.name], "--seed", "1", *extra], copy.parent)


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
    assert "add one to numpy_module(), or pass --no-numpy-rollout" in refused.stderr
    assert not (tmp_path / "runs").exists()  # refused before its run folder was made
    assert_ok(train(copy, "--no-numpy-rollout"))
    assert losses(tmp_path)["losses/value_loss"] != unmodified_losses[script]["losses/value_loss"]
