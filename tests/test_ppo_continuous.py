"""ppo_continuous_mpi.py: GAE with truncation, distributed equivalence, world-wide normalisation,
--target-kl on ranks that disagree, end to end on MuJoCo under torchrun (bad input: test_bad_input.py)."""

import copy
import dataclasses
import os
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
import tyro

import ppo_continuous_mpi as ppo
from ddrl import numpy_rollout
from tests.helpers import (
    LOG_KEYS,
    assert_no_settotalmass_warning,
    assert_same_loss_and_gradients,
    assert_same_parameters,
    cleanrl_ppo_loss,
    compiled_files,
    evaluate_one_episode,
    read_checkpoint,
    read_scalars,
    run_dirs,
    run_ranks,
    train_rank,
    train_ranks,
    union_orders,
    write_checkpoint,
)

# --- GAE ---------------------------------------------------------------------------------------------


def test_truncation_bootstraps_from_final_value_and_termination_from_zero():
    """A hand-made path per env (gamma = lambda = 0.5, four steps, next value after the last step 8)."""
    ones, zeros = np.ones((4, 4)), np.zeros((4, 4))
    values = zeros.copy()
    values[:, 0] = [1, 2, 0, 0]
    final_values, terminations, truncations = zeros.copy(), zeros.copy(), zeros.copy()
    final_values[1, :] = 4.0  # V(final observation) of an episode that ended at step 1 (ignored if terminated)
    truncations[1, 0] = 1  # env 0: truncated at step 1, so step 1 bootstraps from 4, not from values[2]
    terminations[1, 1] = 1  # env 1: terminated at step 1, so step 1 bootstraps from zero
    final_values[3, 2], truncations[3, 2] = 4.0, 1  # env 2: truncated at the last step: 4, not the last value 8
    terminations[1, 3] = truncations[1, 3] = 1  # env 3: both at once: a termination
    episode_ends = np.maximum(terminations, truncations)  # as main builds the next values
    next_values = np.where(episode_ends > 0, final_values, np.concatenate([values[1:], np.full((1, 4), 8.0)]))
    advantages, returns = ppo.compute_gae(ones, values, next_values, terminations, episode_ends, 0.5, 0.5)
    # e.g. env 0, step 1: delta = 1 + 0.5 * 4 - 2 = 1 and its episode ends; step 0: delta = 1 + 0.5 * 2 - 1 = 1,
    # advantage = 1 + 0.25 * 1; steps 3, 2: 1 + 0.5 * 8 = 5, then 1 + 0.25 * 5 = 2.25
    expected = np.array(
        [
            [1.25, 1.25, 1.359375, 1.25],
            [1.0, 1.0, 1.4375, 1.0],
            [2.25, 2.25, 1.75, 2.25],
            [5.0, 5.0, 3.0, 5.0],
        ]
    )
    np.testing.assert_allclose(advantages, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(returns, expected + values, rtol=0, atol=1e-12)


# --- distributed equivalence of the update ------------------------------------------------------------

OBS_DIM, ACTION_DIM, BATCH, MINIBATCHES, EPOCHS = 5, 2, 64, 4, 2
UPDATE_ARGS = ppo.Args(num_minibatches=MINIBATCHES, update_epochs=EPOCHS, max_grad_norm=0.05, learning_rate=0.01)


def new_learner() -> tuple[ppo.Agent, torch.optim.Optimizer]:
    """Built in float64 from the start: orthogonal init's float32 QR differs with the thread count (1e-7)."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        agent = ppo.Agent(OBS_DIM, ACTION_DIM)
    finally:
        torch.set_default_dtype(torch.float32)
    return agent, torch.optim.Adam(agent.parameters(), lr=UPDATE_ARGS.learning_rate, eps=1e-5)


def fixed_batch(obs_scale: float = 1.0, seed: int = 3) -> dict[str, torch.Tensor]:
    """Old log-probabilities near the initial policy's, so ratios both clip and do not."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    obs, actions = obs_scale * randn(BATCH, OBS_DIM), randn(BATCH, ACTION_DIM)
    with torch.no_grad():
        log_probs = new_learner()[0].log_prob_entropy_value(obs, actions)[0]
    return {
        "obs": obs,
        "actions": actions,
        "log_probs": log_probs + 0.3 * randn(BATCH),
        "values": randn(BATCH),
        "advantages": 3 * randn(BATCH) + 1,  # normalisation matters: the minibatches' means and stds differ
        "returns": randn(BATCH),
    }


def epochs_run(optimizer: torch.optim.Optimizer, num_minibatches: int) -> int:
    """The update epochs an optimizer stepped through: Adam counts its steps, `num_minibatches` per epoch."""
    [steps] = {int(state["step"]) for state in optimizer.state.values()}
    return steps // num_minibatches


def local_orders(rank: int, size: int, epochs: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.stack([torch.randperm(size, generator=generator) for _ in range(epochs)])


def update_rank(rank: int, world_size: int, sizes: list[int]) -> tuple[dict, torch.Tensor, int]:
    """Rank r updates on its `sizes[r]` samples of fixed_batch (unequal: rollouts cut short by preemption)."""
    agent, optimizer = new_learner()
    start = sum(sizes[:rank])
    local = {key: value[start : start + sizes[rank]] for key, value in fixed_batch().items()}
    minibatch_sizes = ppo.minibatch_sizes(sizes, MINIBATCHES)
    orders = local_orders(rank, sizes[rank], EPOCHS)
    stats, _ = ppo.update(agent, optimizer, local, UPDATE_ARGS, orders, minibatch_sizes)
    return agent.state_dict(), stats, epochs_run(optimizer, MINIBATCHES)


def test_compiled_loss_takes_the_eager_update_steps():
    """--compile's loss_fn: the same epochs as eager minibatch_loss (float64, to rounding), and it did compile."""
    args = dataclasses.replace(UPDATE_ARGS, local_minibatch_size=BATCH // MINIBATCHES)
    orders = local_orders(0, BATCH, EPOCHS)
    eager, eager_optimizer = new_learner()
    initial = copy.deepcopy(eager.state_dict())
    expected_stats, _ = ppo.update(eager, eager_optimizer, fixed_batch(), args, orders)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    agent, optimizer = new_learner()
    loss_fn = ppo.loss_function(dataclasses.replace(args, compile=True))
    stats, _ = ppo.update(agent, optimizer, fixed_batch(), args, orders, loss_fn=loss_fn)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    assert (eager.actor_mean[0].weight - initial["actor_mean.0.weight"]).abs().max() > 1e-3  # it moved
    assert_same_parameters([eager.state_dict(), agent.state_dict()], atol=1e-10)
    torch.testing.assert_close(stats, expected_stats, rtol=0, atol=1e-10)


def cleanrl_loss(agent: ppo.Agent, mb: dict[str, torch.Tensor], args: ppo.Args) -> tuple[torch.Tensor, list]:
    """CleanRL's ppo_continuous_action.py loss written out independently of the script: torch.distributions.Normal
    on the nn.Sequential modules, advantages normalised over the minibatch, clipped surrogate and value losses."""
    action_mean = agent.actor_mean(mb["obs"])
    distribution = torch.distributions.Normal(action_mean, agent.actor_logstd.exp().expand_as(action_mean))
    newlogprob, entropy = distribution.log_prob(mb["actions"]).sum(1), distribution.entropy().sum(1)
    newvalue = agent.critic(mb["obs"]).view(-1)
    return cleanrl_ppo_loss(newlogprob, entropy, newvalue, mb, args)


@pytest.mark.parametrize("clip_vloss", [True, False])
def test_minibatch_loss_equals_cleanrl_loss_written_out_independently(clip_vloss):
    """Guards the loss itself (value-clip sign, KL estimators, entropy term), which the equivalence tests cannot:
    they compare the script with itself. Random float64 inputs where ratios and values both clip."""
    agent, _ = new_learner()
    batch = fixed_batch()
    batch["values"] = batch["returns"] + 0.5 * torch.randn(BATCH, dtype=torch.float64)  # some inside the clip range
    args = dataclasses.replace(UPDATE_ARGS, ent_coef=0.01, clip_vloss=clip_vloss)
    adv_mean, adv_std = batch["advantages"].mean(), batch["advantages"].std()
    loss, stats = ppo.minibatch_loss(agent, batch, adv_mean, adv_std, args)
    expected_loss, expected_stats = cleanrl_loss(agent, batch, args)
    assert 0 < stats["clipfrac"] < 1  # some ratios clipped, some not
    with torch.no_grad():  # and some value errors beyond the clip range, some within
        value_change = (agent.critic(batch["obs"]).view(-1) - batch["values"]).abs()
    assert (value_change > args.clip_coef).any() and (value_change < args.clip_coef).any()
    # so the other --clip-vloss setting gives another value loss: a script that ignores the flag fails here
    other_value_loss = cleanrl_loss(agent, batch, dataclasses.replace(args, clip_vloss=not clip_vloss))[1][1]
    assert (other_value_loss - expected_stats[1]).abs() > 1e-3
    assert_same_loss_and_gradients(agent, loss, stats, expected_loss, expected_stats)


@pytest.mark.parametrize("collectives", ["torch", "mpi"])
@pytest.mark.parametrize("sizes", [[32, 32], [40, 21]], ids=["equal", "preempted"])
def test_two_ranks_end_the_update_with_the_one_rank_weights_on_their_union(sizes, collectives, tmp_path):
    """Also when preemption cut a rollout short: rank 1's 21 samples give pieces of 6, 5, 5, 5 to minibatches of
    16, 15, 15, 15 samples; each sample weighs alike, wherever it was collected."""
    minibatch_sizes = ppo.minibatch_sizes(sizes, MINIBATCHES)
    union = {key: value[: sum(sizes)] for key, value in fixed_batch().items()}
    assert not dist.is_initialized()  # the helpers are no-ops: one rank alone
    agent, optimizer = new_learner()
    initial = copy.deepcopy(agent.state_dict())
    reference_orders = union_orders(
        [local_orders(rank, size, EPOCHS) for rank, size in enumerate(sizes)], minibatch_sizes
    )
    expected_stats, _ = ppo.update(agent, optimizer, union, UPDATE_ARGS, reference_orders, minibatch_sizes.sum(0)[None])
    expected = agent.state_dict()
    assert (expected["actor_mean.0.weight"] - initial["actor_mean.0.weight"]).abs().max() > 1e-3  # it moved
    assert 0 < expected_stats["clipfrac"] < 1  # some ratios were clipped, some not

    mpi_script = "ppo_continuous_mpi" if collectives == "mpi" else None  # mpirun's ranks, MPI's collectives
    (state0, stats0, epochs0), (state1, stats1, epochs1) = run_ranks(
        update_rank, 2, tmp_path, sizes, mpi_script=mpi_script
    )
    assert epochs0 == epochs1 == EPOCHS
    assert_same_parameters([state0, state1])  # bit for bit: every rank took the same step
    assert_same_parameters([expected, state0], atol=1e-10)
    # policy loss, value loss, entropy, both KLs of the last minibatch and the clip fraction are world-wide
    torch.testing.assert_close(stats0, expected_stats, rtol=0, atol=1e-10)
    torch.testing.assert_close(stats1, expected_stats, rtol=0, atol=1e-10)


# --- --target-kl: ranks whose local KLs differ stop together --------------------------------------------


def local_kl(agent: ppo.Agent, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        logratio = agent.log_prob_entropy_value(batch["obs"], batch["actions"])[0] - batch["log_probs"]
        return ((logratio.exp() - 1) - logratio).mean()


def target_kl_rank(rank: int, world_size: int) -> tuple[torch.Tensor, int, dict]:
    """One minibatch per epoch: epoch 1 starts at the old policy (KL 0); epoch 2's check sees the KL after one
    step, which differs by rank (rank 1's observations are 3x larger). The target lies between the two."""
    agent, optimizer = new_learner()
    batch = fixed_batch(obs_scale=1.0 + 2.0 * rank, seed=10 + rank)
    with torch.no_grad():
        batch["log_probs"] = agent.log_prob_entropy_value(batch["obs"], batch["actions"])[0]
    args = dataclasses.replace(UPDATE_ARGS, num_minibatches=1, update_epochs=6, local_minibatch_size=BATCH)
    orders = local_orders(rank, BATCH, args.update_epochs)

    probe = copy.deepcopy(agent)  # one epoch on a copy, to read the local KLs
    probe_optimizer = torch.optim.Adam(probe.parameters(), lr=UPDATE_ARGS.learning_rate, eps=1e-5)
    ppo.update(probe, probe_optimizer, batch, dataclasses.replace(args, update_epochs=1), orders)
    local_kls = [torch.zeros((), dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(local_kls, local_kl(probe, batch))
    args.target_kl = float(torch.stack(local_kls).prod().sqrt())  # between them, below their mean

    ppo.update(agent, optimizer, batch, args, orders)  # with a local check one rank runs on: a hang
    return torch.stack(local_kls), epochs_run(optimizer, args.num_minibatches), agent.state_dict()


def test_target_kl_stops_every_rank_at_the_same_epoch(tmp_path):
    (kls, epochs0, state0), (_, epochs1, state1) = run_ranks(target_kl_rank, 2, tmp_path, timeout=90)
    assert kls.max() > 1.2 * kls.min() > 0, kls  # the local KLs really differ: a rank-local check would split
    assert epochs0 == epochs1 == 2  # world-averaged KL exceeds the target after epoch 2, on both
    assert_same_parameters([state0, state1])


# --- normalisation statistics are world-wide ----------------------------------------------------------


class Recorder(gym.Wrapper):
    """What a same-step-autoreset vector env shows the agent: reset observations and the observations of
    steps that did not end an episode (a final observation is replaced by the next reset's); rewards; ends."""

    instances: list["Recorder"] = []  # filled in the spawned rank only

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.seen, self.rewards, self.ends = [], [], []
        Recorder.instances.append(self)

    def reset(self, **kwargs):
        obs, info = super().reset(**kwargs)
        self.seen.append(obs)
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        self.rewards.append(float(reward))
        self.ends.append(terminated or truncated)
        if not (terminated or truncated):
            self.seen.append(obs)
        return obs, reward, terminated, truncated, info


def recording_main_rank(rank: int, world_size: int, out_dir: str, flags: list[str]) -> dict:
    """Run the script's whole main as one rank of a launch, with a Recorder around each of its envs."""
    os.chdir(out_dir)
    make_env = ppo.make_env
    ppo.make_env = lambda env_id, video_folder=None: lambda: Recorder(make_env(env_id, video_folder)())
    args = tyro.cli(ppo.Args, args=flags)
    agent = ppo.main(args)
    stepped = [env for env in Recorder.instances if env.seen]  # not the env built only to read the spaces
    return {
        "state": agent.state_dict(),
        "num_iterations": args.num_iterations,
        "seen": [np.array(env.seen) for env in stepped],
        "rewards": [np.array(env.rewards) for env in stepped],
        "ends": [np.array(env.ends) for env in stepped],
    }


def test_normalisation_statistics_equal_those_of_the_union_of_all_ranks_observations(tmp_path):
    steps, envs, gamma = 64, 2, 0.99  # Hopper falls often, so episodes end (and reset) inside the rollouts
    flags = ["--env-id", "Hopper-v5", "--local-num-envs", str(envs), "--num-steps", str(steps)]
    flags += ["--num-minibatches", "2", "--update-epochs", "1", "--total-timesteps", str(2 * 2 * envs * steps)]
    results = run_ranks(recording_main_rank, 2, tmp_path, str(tmp_path), flags, join_group=False, timeout=120)
    assert [result["num_iterations"] for result in results] == [2, 2]
    assert_same_parameters([result["state"] for result in results])  # weights and statistics, bit for bit
    used = 2 * steps  # two rollouts of `steps` observations per env, starting from the reset observation

    observations, discounted_returns = [], []
    for result in results:
        assert len(result["seen"]) == envs and any(ends[:used].any() for ends in result["ends"])
        for seen, rewards, ends in zip(result["seen"], result["rewards"], result["ends"], strict=True):
            observations.append(seen[:used])
            running = 0.0
            for reward, ended in zip(rewards[:used], ends[:used], strict=True):
                running = gamma * running + reward
                discounted_returns.append(running)
                running = 0.0 if ended else running
    observations, discounted_returns = np.concatenate(observations), np.array(discounted_returns)
    assert len(observations) == len(discounted_returns) == 2 * envs * used

    state = results[0]["state"]
    assert state["obs_rms.count"].item() == state["return_rms.count"].item() == len(observations)
    np.testing.assert_allclose(state["obs_rms.mean"].numpy(), observations.mean(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state["obs_rms.var"].numpy(), observations.var(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state["return_rms.mean"].item(), discounted_returns.mean(), rtol=1e-9)
    np.testing.assert_allclose(state["return_rms.var"].item(), discounted_returns.var(), rtol=1e-9)


# --- end to end under torchrun --------------------------------------------------------------------------

TINY = ["--num-minibatches", "4", "--update-epochs", "2"]


def epoch_counting_rank(rank: int, world_size: int, script: str, cwd: str, flags: list[str]) -> dict:
    """train_rank, also recording for each of the rank's updates the epochs its optimizer stepped through and the
    KL the update returned (the world's, which its --target-kl check reads)."""
    update, updates = ppo.update, []

    def counting_update(agent, optimizer, batch, args, *rest, **options):
        def steps() -> int:  # Adam counts the steps it took, the same in every parameter's state
            return max((int(state["step"]) for state in optimizer.state.values()), default=0)

        steps_before = steps()
        losses, sync_time = update(agent, optimizer, batch, args, *rest, **options)
        updates.append(((steps() - steps_before) // args.num_minibatches, losses["approx_kl"]))
        return losses, sync_time

    ppo.update = counting_update  # main calls it by its module-level name
    return {"state": train_rank(rank, world_size, script, cwd, flags), "updates": updates}


def test_halfcheetah_two_ranks_compiled_train_identically_stop_on_their_world_kl_save_and_evaluate_quietly(tmp_path):
    # 2 iterations of 512 steps per rank: each rank's env is truncated once, at step 1000; --compile (the eager default
    # runs in test_reliability.py) and a --target-kl that the first epoch's world KL crosses: every rank stops early,
    # at the same epoch of the same iteration
    compiled_before = compiled_files()
    flags = ["--env-id", "HalfCheetah-v5", "--num-steps", "512", "--total-timesteps", "2048", "--save-model", *TINY]
    target_kl = 1e-7
    flags += ["--compile", "--target-kl", str(target_kl)]
    results, result = train_ranks("ppo_continuous_mpi.py", flags, tmp_path, worker=epoch_counting_rank)
    assert compiled_files() - compiled_before  # it compiled new kernels
    assert_no_settotalmass_warning(result.stdout + result.stderr, tmp_path)
    states = [rank_result["state"] for rank_result in results]
    assert_same_parameters(states)
    updates = results[0]["updates"]  # (epochs, world KL) per iteration
    assert results[1]["updates"] == updates and len(updates) == 2, [rank_result["updates"] for rank_result in results]
    assert all(epochs == 2 or kl > target_kl for epochs, kl in updates), updates  # early only past the target
    assert any(epochs < 2 for epochs, _ in updates), updates  # and it did stop early: fewer epochs than --update-epochs
    [run_dir] = run_dirs(tmp_path)
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["charts/SPS"]] == [1024, 2048]  # two iterations of the global batch
    logged_kls = [value for _, value in scalars["losses/approx_kl"]]
    assert logged_kls == pytest.approx([kl for _, kl in updates], rel=1e-5)  # the KL the update stopped on is logged
    for key in LOG_KEYS:
        assert key in scalars, key
    assert scalars["charts/episodic_length"] == [(2048, 1000.0)]  # the world-wide mean of both ranks' episodes
    assert scalars["charts/learning_rate"][1][1] == pytest.approx(1.5e-4)  # annealed: half-way at iteration 2
    for key in ("losses/value_loss", "losses/policy_loss", "losses/explained_variance"):
        assert all(np.isfinite(value) for _, value in scalars[key]), key

    checkpoint = read_checkpoint(run_dir / "model.safetensors")
    assert checkpoint["env_id"] == "HalfCheetah-v5" and checkpoint["script"] == "ppo_continuous_mpi.py"
    weights = {name.removeprefix("model."): value for name, value in checkpoint["tensors"].items()}
    assert_same_parameters([states[0], weights])  # weights and normalisation statistics
    assert weights["obs_rms.count"].item() == 2048  # every rank's observations of both iterations

    evaluation = evaluate_one_episode("ppo_continuous_mpi.py", run_dir / "model.safetensors", tmp_path)
    assert_no_settotalmass_warning(evaluation.stdout + evaluation.stderr, tmp_path)


def evaluation_return(model_path: Path, monkeypatch, capsys) -> float:
    """The return_mean that `--eval-checkpoint` prints for `model_path` (5 episodes, mean actions)."""
    args = ppo.Args(eval_checkpoint=str(model_path), eval_episodes=5, eval_deterministic=True)
    assert ppo.main(args) is None
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"eval: episodes=5 return_mean=(\S+) return_std=(\S+)", last_line)
    assert match, last_line
    return float(match[1])


def test_a_trained_model_evaluates_to_its_return_and_needs_its_statistics(tmp_path, monkeypatch, capsys):
    """InvertedPendulum learns to balance in 16 iterations; the saved model plays as well only with its observation
    statistics (a checkpoint loaded without them, or without its weights, would do far worse)."""
    flags = ["--env-id", "InvertedPendulum-v5", "--num-steps", "512", "--total-timesteps", "16384", "--save-model"]
    flags += ["--num-minibatches", "8", "--learning-rate", "1e-3"]  # a quarter of the default's steps, each larger
    train_ranks("ppo_continuous_mpi.py", flags, tmp_path)
    [run_dir] = run_dirs(tmp_path)
    training = read_scalars(run_dir)["charts/episodic_return"]
    assert len(read_scalars(run_dir)["charts/SPS"]) == 16 and training[-1][1] > 200  # it learned
    monkeypatch.chdir(tmp_path)
    trained = evaluation_return(run_dir / "model.safetensors", monkeypatch, capsys)
    assert trained >= 0.8 * training[-1][1]
    checkpoint = read_checkpoint(run_dir / "model.safetensors")
    checkpoint["tensors"]["model.obs_rms.mean"].zero_()
    checkpoint["tensors"]["model.obs_rms.var"].fill_(1.0)
    write_checkpoint(checkpoint, tmp_path / "without_statistics.safetensors")
    assert evaluation_return(tmp_path / "without_statistics.safetensors", monkeypatch, capsys) < 0.5 * trained


def test_evaluation_normalises_observations_with_the_frozen_statistics(monkeypatch):
    env = gym.make("Hopper-v5")
    reset_obs, _ = env.reset(seed=7)
    env.close()
    agent = ppo.Agent(len(reset_obs), 3)
    float64 = {"dtype": torch.float64}
    agent.obs_rms.update(
        torch.tensor(10.0, **float64), torch.full((11,), 0.5, **float64), torch.full((11,), 40.0, **float64)
    )
    seen, act = [], numpy_rollout.NumpyPolicy.act

    def recording_act(policy: numpy_rollout.NumpyPolicy, obs: np.ndarray, deterministic: bool = False):
        seen.append(obs)
        return act(policy, obs, deterministic)

    monkeypatch.setattr(numpy_rollout.NumpyPolicy, "act", recording_act)
    assert len(ppo.evaluate(agent, "Hopper-v5", ppo.Args(seed=7, eval_episodes=1))) == 1
    expected = np.clip((reset_obs - 0.5) / np.sqrt(4.0 + 1e-8), -10, 10)  # mean 0.5, variance 40 / 10
    np.testing.assert_allclose(seen[0][0], expected, rtol=1e-6)
    assert len(seen) > 1 and agent.obs_rms.count.item() == 10  # frozen: playing does not update them


# --- --sync gather takes the allreduce update's steps ---------------------------------------------------


def sync_modes_rank(rank: int, world_size: int, target_kl: float | None, sizes: list[int]) -> dict:
    """Different local batches (rank 1's observations 3x larger; `sizes[rank]` samples, padded to BATCH for the
    gather) through both --sync modes from the same start."""
    batch = {
        key: value[: sizes[rank]] for key, value in fixed_batch(obs_scale=1.0 + 2.0 * rank, seed=10 + rank).items()
    }
    args = dataclasses.replace(UPDATE_ARGS, num_minibatches=2, update_epochs=6, target_kl=target_kl, world_size=2)
    args = dataclasses.replace(args, local_batch_size=BATCH, batch_size=2 * BATCH)
    orders = local_orders(rank, sizes[rank], args.update_epochs)
    minibatch_sizes = ppo.minibatch_sizes(sizes, args.num_minibatches)
    agent, optimizer = new_learner()
    stats, _ = ppo.update(agent, optimizer, batch, args, orders, minibatch_sizes)
    outcome = {"allreduce": agent.state_dict(), "stats": stats, "epochs": epochs_run(optimizer, args.num_minibatches)}
    agent, optimizer = new_learner()
    learner_group = dist.new_group([0])
    outcome["gather_stats"], _ = ppo.update_one_learner(
        agent, optimizer, batch, args, orders, minibatch_sizes, ppo.minibatch_loss, learner_group
    )
    outcome["gather"] = agent.state_dict()
    return outcome


@pytest.mark.parametrize(
    "target_kl, sizes, mpi_script",
    [(None, [BATCH, BATCH], None), (0.1, [BATCH, BATCH], None), (0.1, [BATCH, 27], None)]
    + [(0.1, [BATCH, 27], "ppo_continuous_mpi")],
    ids=["", "kl", "kl-cut", "kl-cut-mpi"],
)
def test_gather_ends_the_update_with_the_allreduce_weights(target_kl, sizes, mpi_script, tmp_path):
    results = run_ranks(sync_modes_rank, 2, tmp_path, target_kl, sizes, timeout=90, mpi_script=mpi_script)
    epochs = [result["epochs"] for result in results]
    assert epochs[0] == epochs[1] and (epochs[0] == 6 if target_kl is None else 1 < epochs[0] < 6), epochs
    for result in results:  # every rank holds the learner's weights, and they are allreduce's
        assert_same_parameters([results[0]["allreduce"], result["gather"]], atol=1e-10)
    # the learner's logged numbers are allreduce's; the other ranks, which log nothing, get none
    torch.testing.assert_close(results[0]["gather_stats"], results[0]["stats"], rtol=0, atol=1e-10)
    assert results[1]["gather_stats"] == {}
    assert (results[0]["gather"]["actor_logstd"] - new_learner()[0].actor_logstd).abs().max() > 1e-3  # it moved
