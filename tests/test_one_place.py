"""Researchers edit a copy of a script. An edit to the Agent takes effect in the rollout and the update alike (the
rollout is derived from the Agent), on the fast numpy path where ddrl has numpy versions of what the edit uses, else
on the Agent's own torch code, said in one line; and `python -m ddrl.verify COPY` tells whether a copy's update is
still the one-rank update on the union of the ranks' batches."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import (
    ROOT,
    assert_ok,
    edited_copy,
    progress_lines,
    read_scalars,
    run_command,
    run_dirs,
    run_python,
    torchrun_with,
    verify,
)

FLAGS = {
    "ppo_continuous_mpi.py": ["--env-id", "InvertedPendulum-v5", "--num-steps", "128", "--total-timesteps", "256"]
    + ["--no-compile"]
    + ["--num-minibatches", "4", "--update-epochs", "2"],
    "vpg_mpi.py": ["--env-id", "CartPole-v1", "--steps-per-epoch", "200", "--total-timesteps", "400"]
    + ["--train-v-iters", "5"],
}
SLOWER = "the rollout runs the Agent's own torch code, the slower path"
PPO_HIDDEN = (
    "            nn.Tanh(),\n            layer_init(nn.Linear(64, 64)),\n            nn.Tanh(),\n"
    "            layer_init(nn.Linear(64, action_dim)"
)
PPO_HEADS = (
    "            layer_init(nn.Linear(64, action_dim), std=0.01),\n        )\n"
    "        self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))\n"
)
PPO_DISTRIBUTION = (
    "        action_logstd = self.actor_logstd.expand_as(action_mean)\n"
    "        action_std = torch.exp(action_logstd)\n"
    "        probs = Normal(action_mean, action_std)\n"
)
PPO_RETURN = "        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)\n"
EDITS = {  # edits a researcher makes in the Agent alone: the rollout follows them, numpy all the way
    ("ppo_continuous_mpi.py", "tanh to ReLU and a LayerNorm"): [
        (
            PPO_HIDDEN,
            PPO_HIDDEN.replace("Tanh", "ReLU").replace(
                "            nn.ReLU(),\n", "            nn.LayerNorm(64),\n            nn.ReLU(),\n", 1
            ),
        )
    ],
    ("ppo_continuous_mpi.py", "a state-dependent log-std"): [
        (
            "self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))",
            "self.actor_logstd = layer_init(nn.Linear(obs_dim, action_dim), std=0.01)",
        ),
        ("action_logstd = self.actor_logstd.expand_as(action_mean)", "action_logstd = self.actor_logstd(x)"),
    ],
    ("ppo_continuous_mpi.py", "a Beta distribution"): [
        (
            PPO_HEADS,
            PPO_HEADS.replace("std=0.01),\n", "std=0.01),\n            nn.Softplus(),\n")
            + "        self.actor_beta = nn.Sequential("
            + "layer_init(nn.Linear(obs_dim, action_dim), std=0.01), nn.Softplus())\n",
        ),
        (PPO_DISTRIBUTION, "        probs = torch.distributions.Beta(action_mean + 1, self.actor_beta(x) + 1)\n"),
    ],
    ("ppo_continuous_mpi.py", "a tanh-squashed Gaussian"): [
        (
            PPO_DISTRIBUTION,
            PPO_DISTRIBUTION
            + "        base = probs\n"
            + "        probs = torch.distributions.TransformedDistribution("
            + "base, [torch.distributions.TanhTransform()])\n",
        ),
        (PPO_RETURN, PPO_RETURN.replace("probs.entropy()", "base.entropy()")),
    ],
    ("vpg_mpi.py", "tanh to ReLU"): [("nn.Tanh()]", "nn.ReLU()]")],
    ("vpg_mpi.py", "a softmax temperature"): [("Categorical(logits=logits)", "Categorical(logits=logits / 2)")],
}
# edits that leave the numpy path: a layer ddrl has no numpy version of, and control flow torch.fx cannot follow
SLOWER_EDITS = {
    "a GELU": (
        [(PPO_HIDDEN, PPO_HIDDEN.replace("Tanh", "GELU"))],
        "the layer GELU (actor_mean.1) has no numpy version",
    ),
    "a branch on the data": (
        [
            (
                "        x = self.obs_rms.normalize(x)\n",
                "        x = self.obs_rms.normalize(x)\n        if x.sum() > 1e9:\n            x = x / 2\n",
            )
        ],
        "torch.fx cannot trace it",
    ),
}


def train(copy: Path, *extra: str) -> subprocess.CompletedProcess:
    """Two iterations of the copy at seed 1 with one rank, in its own folder."""
    result = run_python(copy, [*FLAGS[copy.name], "--seed", "1", *extra], copy.parent)
    assert_ok(result)
    return result


def losses(directory: Path) -> dict[str, list[tuple[int, float]]]:
    [run_dir] = run_dirs(directory)
    scalars = {key: value for key, value in read_scalars(run_dir).items() if key.startswith("losses/")}
    assert all(len(series) == 2 for series in scalars.values()), "expected two logged iterations"
    return scalars


@pytest.fixture(scope="module")
def unmodified_losses(tmp_path_factory) -> dict[str, dict]:
    """Each MLP script's logged losses, copied without an edit."""
    results = {}
    for script in FLAGS:
        copy = edited_copy(tmp_path_factory.mktemp("unmodified"), script, [])
        train(copy)
        results[script] = losses(copy.parent)
    return results


@pytest.mark.parametrize(("script", "edit"), list(EDITS), ids=[f"{s[:-3]}: {e}" for s, e in EDITS])
def test_an_edit_to_the_agent_changes_what_the_run_learns_on_the_numpy_path(script, edit, tmp_path, unmodified_losses):
    """The run trains two iterations with the edit in both the rollout (checked against the Agent before the first
    step and on every batch) and the update: its losses differ from the unmodified script's."""
    result = train(edited_copy(tmp_path, script, EDITS[script, edit]))
    assert SLOWER not in result.stdout, result.stdout
    assert losses(tmp_path) != unmodified_losses[script]


@pytest.mark.parametrize("edit", list(SLOWER_EDITS))
def test_an_agent_the_numpy_path_cannot_run_trains_on_its_own_torch_code_saying_so_once(edit, tmp_path):
    edits, reason = SLOWER_EDITS[edit]
    result = train(edited_copy(tmp_path, "ppo_continuous_mpi.py", edits))
    said = [line for line in result.stdout.splitlines() if SLOWER in line]
    assert len(said) == 1 and reason in said[0], result.stdout
    losses(tmp_path)


def test_minibatches_over_envs_with_sizes_in_samples_stop_in_one_line(tmp_path):
    """Half of a recurrent edit: orders over the envs while minibatch_sizes still counts samples."""
    copy = edited_copy(
        tmp_path,
        "ppo_continuous_mpi.py",
        [
            (
                "torch.randperm(returns.size, device=device) for _ in",
                "torch.randperm(args.local_num_envs, device=device) for _ in",
            )
        ],
    )
    result = run_python(copy, [*FLAGS[copy.name], "--local-num-envs", "4", "--num-steps", "32"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "main's orders and minibatch_sizes must count the same things" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("script", ["ppo_continuous_mpi.py", "vpg_mpi.py", "ppo_atari_multigpu.py"])
def test_verify_passes_an_unedited_copy_in_another_folder_and_writes_nothing_beside_it(script, tmp_path):
    copy = tmp_path / "elsewhere" / f"my_{script}"
    copy.parent.mkdir()
    shutil.copy(ROOT / script, copy)
    result = verify(copy)
    assert result.returncode == 0, result.stderr
    modes = "allreduce, gather" if script != "ppo_atari_multigpu.py" else "allreduce"
    assert result.stdout.startswith(f"verify: ok: my_{script} at two ranks ({modes}) trains as one rank "), (
        result.stdout
    )
    assert sorted(path.name for path in copy.parent.iterdir()) == [copy.name]


def test_verify_names_the_mode_and_parameters_an_edit_breaks_in_one_line(tmp_path):
    """CleanRL's own advantage normalisation, over each rank's minibatch instead of the world's: the ranks' update is
    no longer the one-rank update on their union."""
    copy = edited_copy(
        tmp_path,
        "ppo_continuous_mpi.py",
        [
            (
                "    if adv_mean is not None:\n        mb_advantages = (mb_advantages - adv_mean) / (adv_std + 1e-8)",
                "    if args.norm_adv:\n"
                "        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)",
            )
        ],
    )
    result = verify(copy)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("verify: at two ranks (allreduce), iteration 1: rank 0's "), line
    assert "differ from the one-rank run's on the union by up to" in line


def test_a_number_each_rank_computes_from_its_own_data_stops_every_rank_at_the_first_check(tmp_path):
    """A coefficient an edit adapts from this rank's KL alone (kept in args) splits the ranks with their weights still
    equal after that iteration's update: the check of the ranks' training state catches it."""
    copy = edited_copy(
        tmp_path,
        "ppo_continuous_mpi.py",
        [
            (
                "    return {name: value.item() for name, value in losses.items()}, sync_time",
                '    args.vf_coef = 0.5 + float(logged["approx_kl"])  # this rank\'s own KL\n'
                "    return {name: value.item() for name, value in losses.items()}, sync_time",
            )
        ],
    )
    flags = [*FLAGS["ppo_continuous_mpi.py"], "--torch-threads", "1"]  # the check's default: every 10, from the first
    result = run_command(torchrun_with(["--standalone"], str(copy), flags), tmp_path)
    assert result.returncode != 0
    [line] = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert line.startswith(
        "ppo_continuous_mpi.py: error: the training state of ranks [1] differs from this rank's at iteration 1"
    ), line
    assert "a number computed from this rank's data alone" in line
    assert progress_lines(result.stdout) == [1]


VPG_SHARED_TRUNK = [  # SpinningUp's core.py with one trunk for the policy and the value: the Agent alone edited
    (
        "        self.actor = mlp(obs_dim, hidden_sizes, num_outputs)\n"
        "        self.critic = mlp(obs_dim, hidden_sizes, 1)\n",
        "        self.trunk = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden_sizes[0])), nn.Tanh())\n"
        "        self.actor = mlp(hidden_sizes[0], hidden_sizes[1:], num_outputs)\n"
        "        self.critic = mlp(hidden_sizes[0], hidden_sizes[1:], 1)\n",
    ),
    ("        return self.critic(x)\n", "        return self.critic(self.trunk(x))\n"),
    ("        logits = self.actor(x)\n", "        logits = self.actor(self.trunk(x))\n"),
    (
        "        return action, log_prob, entropy, self.critic(x)\n",
        "        return action, log_prob, entropy, self.critic(self.trunk(x))\n",
    ),
]


def test_a_trunk_the_policy_and_the_value_share_trains_in_sync_with_the_update_untouched(tmp_path):
    """The trunk sits in the optimizer's policy group, and the value steps reach it: every step averages the gradient
    of every parameter its loss reached, whichever group holds it, so the ranks' weights agree at every check."""
    copy = edited_copy(tmp_path, "vpg_mpi.py", VPG_SHARED_TRUNK)
    flags = [*FLAGS["vpg_mpi.py"], "--torch-threads", "1", "--check-sync-every", "1"]
    result = run_command(torchrun_with(["--standalone"], str(copy), flags), tmp_path)
    assert result.returncode == 0, result.stderr
    assert progress_lines(result.stdout) == [1, 2]
