"""ppo_continuous_mpi.py: GAE with truncation, the loss against CleanRL's, the distributed update (preemption's unequal
shares, --sync gather, --target-kl) against one process's, and one real run of two ranks: world-wide normalisation,
--compile and its default, the log, seeds, a model file that evaluates to its training return (bad input:
test_bad_input.py)."""

import copy
import dataclasses
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
import tyro

import ppo_continuous_mpi as ppo
from ddrl import compiled_step, machine, one_learner
from tests.helpers import (
    LOG_KEYS,
    Recorder,
    assert_minibatch_loss_is_cleanrls,
    assert_same_parameters,
    progress_lines,
    read_checkpoint,
    read_scalars,
    run_dirs,
    run_ranks,
    train_rank,
    train_ranks,
    union_orders,
    vector_env_spaces,
    write_checkpoint,
)

# --- GAE ---------------------------------------------------------------------------------------------


def test_truncation_bootstraps_from_final_value_and_termination_from_zero():
    """A hand-made path per env (gamma = lambda = 0.5, four steps, next value after the last step 8)."""
    ones = np.ones((4, 4))
    zeros = np.zeros((4, 4))
    values = zeros.copy()
    values[:, 0] = [1, 2, 0, 0]
    final_values = zeros.copy()
    terminations = zeros.copy()
    truncations = zeros.copy()
    final_values[1, :] = 4.0  # V(final observation) of an episode that ended at step 1 (ignored if terminated)
    truncations[1, 0] = 1  # env 0: truncated at step 1, so step 1 bootstraps from 4, not from values[2]
    terminations[1, 1] = 1  # env 1: terminated at step 1, so step 1 bootstraps from zero
    final_values[3, 2] = 4.0  # env 2: truncated at the last step: 4, not the last value 8
    truncations[3, 2] = 1
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


# --- the loss, and the distributed update against one process's -------------------------------------------------

OBS_DIM = 5
ACTION_DIM = 2
BATCH = 64
MINIBATCHES = 4
EPOCHS = 2
UPDATE_ARGS = ppo.Args(num_minibatches=MINIBATCHES, update_epochs=EPOCHS, max_grad_norm=0.05, learning_rate=0.01)


def new_learner() -> tuple[ppo.Agent, torch.optim.Optimizer]:
    """Built in float64 from the start (orthogonal init's float32 QR differs with the thread count, 1e-7), with
    observation statistics of 50 samples, so that the loss sees normalised observations."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        agent = ppo.Agent(vector_env_spaces(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,))))
        agent.obs_rms.update(torch.tensor(50.0), 0.5 * torch.randn(OBS_DIM), 50.0 * (1.0 + torch.rand(OBS_DIM)))
    finally:
        torch.set_default_dtype(torch.float32)
    return agent, torch.optim.Adam(agent.parameters(), lr=UPDATE_ARGS.learning_rate, eps=1e-5)


def fixed_batch(obs_scale: float = 1.0, seed: int = 3) -> dict[str, torch.Tensor]:
    """Raw observations, as main's batch holds them; old log-probabilities near the initial policy's, so ratios both
    clip and do not."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    obs = obs_scale * randn(BATCH, OBS_DIM)
    actions = randn(BATCH, ACTION_DIM)
    with torch.no_grad():
        log_probs = new_learner()[0].get_action_and_value(obs, actions)[1]
    return {
        "obs": obs,
        "actions": actions,
        "log_probs": log_probs + 0.3 * randn(BATCH),
        "values": randn(BATCH),
        "advantages": 3 * randn(BATCH) + 1,  # normalisation matters: the minibatches' means and stds differ
        "returns": randn(BATCH),
    }


def adam_steps(optimizer: torch.optim.Optimizer) -> int:
    """The steps Adam took (it counts them in every parameter's state); 0 for one that never stepped (a rank other
    than the learner under --sync gather)."""
    [count] = {int(state["step"]) for state in optimizer.state.values()} or {0}
    return count


def local_orders(rank: int, size: int, epochs: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.stack([torch.randperm(size, generator=generator) for _ in range(epochs)])


@pytest.mark.parametrize("clip_vloss", [True, False])
def test_minibatch_loss_equals_cleanrl_loss_written_out_independently(clip_vloss):
    """Guards the loss itself (value-clip sign, KL estimators, entropy term), which the equivalence tests cannot:
    they compare the script with itself. Random float64 inputs where ratios and values both clip."""
    agent, _ = new_learner()
    batch = fixed_batch()
    batch["values"] = batch["returns"] + 0.5 * torch.randn(BATCH, dtype=torch.float64)  # some inside the clip range
    args = dataclasses.replace(UPDATE_ARGS, ent_coef=0.01, clip_vloss=clip_vloss)
    assert_minibatch_loss_is_cleanrls(ppo.minibatch_loss, agent, agent, batch, args)


def gathered_update(
    agent: ppo.Agent,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    args: ppo.Args,
    orders: torch.Tensor,
    sizes: torch.Tensor,
    compiled: compiled_step.CompiledStep | None = None,
) -> tuple[dict[str, float], float]:
    """ppo.update under --sync gather, called as main calls it: rank 0 updates on the union, every rank gets its
    weights."""
    return one_learner.update_on_rank0(
        lambda union, union_orders, union_sizes, group: ppo.update(
            agent, optimizer, union, args, union_orders, union_sizes, group=group, compiled=compiled
        ),
        batch,
        orders,
        sizes,
    )


def update_rank(rank: int, world_size: int, sizes: list[int], compiled: bool) -> dict[str, tuple[dict, dict, int]]:
    """Rank r updates on its `sizes[r]` samples of fixed_batch (unequal: rollouts cut short by preemption), from the
    same start in each --sync mode, with the eager or the compiled step: (weights, logged numbers, epochs stepped) by
    mode."""
    start = sum(sizes[:rank])
    local = {key: value[start : start + sizes[rank]] for key, value in fixed_batch().items()}
    minibatch_sizes = ppo.minibatch_sizes(sizes, MINIBATCHES)
    orders = local_orders(rank, sizes[rank], EPOCHS)
    outcome = {}
    for sync in ("allreduce", "gather"):
        agent, optimizer = new_learner()
        step = compiled_step.CompiledStep(
            agent, optimizer, ppo.minibatch_loss, ppo.average_gradients, ppo.clip_gradients, UPDATE_ARGS
        )
        arguments = (agent, optimizer, local, UPDATE_ARGS, orders, minibatch_sizes)
        if sync == "allreduce":
            stats, _ = ppo.update(*arguments, compiled=step if compiled else None)
        else:
            stats, _ = gathered_update(*arguments, compiled=step if compiled else None)
        if compiled and (rank == 0 or sync == "allreduce"):  # it took every step
            assert step.calls == EPOCHS * MINIBATCHES and not step.declined
        outcome[sync] = (agent.state_dict(), stats, adam_steps(optimizer) // MINIBATCHES)
    return outcome


@pytest.mark.parametrize(
    "sizes, mpi_script, compiled",
    [
        pytest.param([32, 32], None, False, id="equal", marks=pytest.mark.quick),
        pytest.param([40, 21], "ppo_continuous_mpi", False, id="preempted-mpi"),
        pytest.param([32, 32], None, True, id="equal-compiled"),
        pytest.param([40, 21], "ppo_continuous_mpi", True, id="preempted-mpi-compiled"),
    ],
)
def test_two_ranks_end_the_update_with_the_one_rank_weights_on_their_union(sizes, mpi_script, compiled, tmp_path):
    """Both --sync modes. Also when preemption cut a rollout short: rank 1's 21 samples give pieces of 6, 5, 5, 5 to
    minibatches of 16, 15, 15, 15 samples; each sample weighs alike, wherever it was collected. That case runs under
    mpirun, with MPI carrying every collective (a collective through torch.distributed fails the test). The ranks take
    the eager steps, or the compiled step (--compile's, in float64, its rows a dynamic size) against the eager one-rank
    update."""
    minibatch_sizes = ppo.minibatch_sizes(sizes, MINIBATCHES)
    union = {key: value[: sum(sizes)] for key, value in fixed_batch().items()}
    assert not dist.is_initialized()  # the collectives do nothing: one rank alone
    agent, optimizer = new_learner()
    initial = copy.deepcopy(agent.state_dict())
    reference_orders = union_orders(
        [local_orders(rank, size, EPOCHS) for rank, size in enumerate(sizes)], minibatch_sizes
    )
    expected_stats, _ = ppo.update(agent, optimizer, union, UPDATE_ARGS, reference_orders, minibatch_sizes.sum(0)[None])
    expected = agent.state_dict()
    assert (expected["actor_mean.0.weight"] - initial["actor_mean.0.weight"]).abs().max() > 1e-3  # it moved
    assert 0 < expected_stats["clipfrac"] < 1  # some ratios were clipped, some not

    ranks = run_ranks(update_rank, 2, tmp_path, sizes, compiled, mpi_script=mpi_script)
    state0, stats0, epochs0 = ranks[0]["allreduce"]
    state1, stats1, epochs1 = ranks[1]["allreduce"]
    assert epochs0 == epochs1 == EPOCHS
    assert_same_parameters([state0, state1])  # bit for bit: every rank took the same step
    assert_same_parameters([expected, state0], atol=1e-10)
    # policy loss, value loss, entropy, both KLs of the last minibatch and the clip fraction are world-wide
    torch.testing.assert_close(stats0, expected_stats, rtol=0, atol=1e-10)
    torch.testing.assert_close(stats1, expected_stats, rtol=0, atol=1e-10)
    # --sync gather: rank 0 took the same steps on the union, every rank holds its weights; only it logs
    learner, learner_stats, learner_epochs = ranks[0]["gather"]
    other, other_stats, _ = ranks[1]["gather"]
    assert learner_epochs == EPOCHS
    assert_same_parameters([learner, other])
    assert_same_parameters([expected, learner], atol=1e-10)
    torch.testing.assert_close(learner_stats, expected_stats, rtol=0, atol=1e-10)
    assert other_stats == {}


# --- --target-kl: ranks whose local KLs differ stop together --------------------------------------------


def local_kl(agent: ppo.Agent, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        logratio = agent.get_action_and_value(batch["obs"], batch["actions"])[1] - batch["log_probs"]
        return ((logratio.exp() - 1) - logratio).mean()


def target_kl_rank(rank: int, world_size: int) -> dict:
    """One minibatch per epoch: epoch 1 starts at the old policy (KL 0); epoch 2's check sees the KL after one
    step, which differs by rank (rank 1's observations are 3x larger). The target lies between the two. Then the
    same update under --sync gather."""
    agent, optimizer = new_learner()
    batch = fixed_batch(obs_scale=1.0 + 2.0 * rank, seed=10 + rank)
    with torch.no_grad():
        batch["log_probs"] = agent.get_action_and_value(batch["obs"], batch["actions"])[1]
    args = dataclasses.replace(UPDATE_ARGS, num_minibatches=1, update_epochs=6)
    orders = local_orders(rank, BATCH, args.update_epochs)
    sizes = ppo.minibatch_sizes([BATCH] * world_size, 1)

    probe = copy.deepcopy(agent)  # one epoch on a copy, to read the local KLs
    probe_optimizer = torch.optim.Adam(probe.parameters(), lr=UPDATE_ARGS.learning_rate, eps=1e-5)
    ppo.update(probe, probe_optimizer, batch, dataclasses.replace(args, update_epochs=1), orders[:1], sizes)
    local_kls = [torch.zeros((), dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(local_kls, local_kl(probe, batch))
    args.target_kl = float(torch.stack(local_kls).prod().sqrt())  # between them, below their mean

    ppo.update(agent, optimizer, batch, args, orders, sizes)  # with a local check one rank runs on: a hang
    learner, learner_optimizer = new_learner()
    gathered_update(learner, learner_optimizer, batch, args, orders, sizes)
    return {
        "kls": torch.stack(local_kls),
        "epochs": adam_steps(optimizer),  # one minibatch an epoch
        "state": agent.state_dict(),
        "gather_epochs": adam_steps(learner_optimizer),
        "gather": learner.state_dict(),
    }


def test_target_kl_stops_every_rank_at_the_same_epoch_in_both_sync_modes(tmp_path):
    ranks = run_ranks(target_kl_rank, 2, tmp_path)
    kls = ranks[0]["kls"]
    assert kls.max() > 1.2 * kls.min() > 0, kls  # the local KLs really differ: a rank-local check would split
    assert ranks[0]["epochs"] == ranks[1]["epochs"] == 2  # the world-averaged KL exceeds the target after epoch 2
    assert_same_parameters([ranks[0]["state"], ranks[1]["state"]])
    assert ranks[0]["gather_epochs"] == 2  # the learner's KL on the union: the same stop, the same weights
    assert_same_parameters([ranks[0]["state"], ranks[0]["gather"], ranks[1]["gather"]], atol=1e-10)


# --- one real run of two ranks -----------------------------------------------------------------------------------


def recording_rank(rank: int, world_size: int, script: str, cwd: str, flags: list[str]) -> dict:
    """train_rank with a Recorder around each env main steps, recording for each update the epochs it stepped, the
    world KL it returned (which its --target-kl check read) and how far the compiled step's weights and numbers lie
    from the eager minibatch_loss's, run beside it from the same state on the same batch."""
    make_env = ppo.make_env
    ppo.make_env = lambda args, video_folder=None: lambda: Recorder(make_env(args, video_folder)())
    update = ppo.update
    updates = []
    compiled_steps = []

    def update_beside_eager(agent, optimizer, batch, args, orders, sizes, loss_fn, *rest, compiled=None):
        if compiled is not None:  # main derived the compiled step (--compile)
            compiled_steps.append(compiled)
            eager = copy.deepcopy(agent)
            eager_optimizer = torch.optim.Adam(eager.parameters(), **optimizer.defaults)
            eager_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # its own moments
            eager_losses, _ = update(eager, eager_optimizer, batch, args, orders, sizes, ppo.minibatch_loss, *rest)
        steps_before = adam_steps(optimizer)
        losses, sync_time = update(agent, optimizer, batch, args, orders, sizes, loss_fn, *rest, compiled=compiled)
        gaps = (None, None)
        if compiled is not None:
            weights_gap = max(
                (p - q).abs().max().item() for p, q in zip(agent.parameters(), eager.parameters(), strict=True)
            )
            gaps = (weights_gap, max(abs(losses[name] - eager_losses[name]) for name in losses))
        epochs = (adam_steps(optimizer) - steps_before) // args.num_minibatches
        updates.append((epochs, losses["approx_kl"], *gaps))
        return losses, sync_time

    ppo.update = update_beside_eager  # main calls both by their module-level names
    state = train_rank(rank, world_size, script, cwd, flags)
    stepped = [env for env in Recorder.instances if env.seen]  # not the env built only to read the spaces
    return {
        "state": state,
        "updates": updates,
        "compiled_steps": [(step.calls, step.declined) for step in compiled_steps[-1:]],
        "torch_seed": torch.initial_seed(),
        **{key: [np.array(getattr(env, key)) for env in stepped] for key in ("seen", "rewards", "ends", "seeds")},
    }


def evaluation_return(model_path: Path, capsys) -> float:
    """The return_mean that `--eval-checkpoint` prints for `model_path` (5 episodes, mean actions), in this process."""
    args = ppo.Args(eval_checkpoint=str(model_path), eval_episodes=5, eval_deterministic=True)
    assert ppo.main(args) is None
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"eval: episodes=5 return_mean=(\S+) return_std=(\S+)", last_line)
    assert match, last_line
    return float(match[1])


def episodes(rewards: np.ndarray, ends: np.ndarray, num_steps: int) -> list[tuple[int, float, int]]:
    """(iteration, return, length) of every episode one env ended, counted from the run's first reset."""
    found = []
    episode_return = 0.0
    length = 0
    for step, (reward, ended) in enumerate(zip(rewards, ends, strict=True)):
        episode_return += reward
        length += 1
        if ended:
            found.append((step // num_steps + 1, episode_return, length))
            episode_return = 0.0
            length = 0
    return found


@pytest.mark.quick
def test_two_ranks_train_alike_on_world_statistics_log_and_evaluate_to_their_return(tmp_path, monkeypatch, capsys):
    """InvertedPendulum, two ranks of two envs, 16 iterations with a --target-kl: the pole falls often
    at first (episodes end and reset inside rollouts) and stands 1000 steps (truncated) once learned. Every rank ends
    with the same weights and statistics, those of the union of all ranks' observations and discounted returns; the
    every update stops on the world's KL, which is logged; the log holds
    the world's episodes; the saved model plays as well as training last did, and only with its statistics."""
    steps = 256
    envs = 2
    iterations = 16
    gamma = 0.99
    seed = 5
    learning_rate = 3e-3
    target_kl = 0.03
    flags = ["--env-id", "InvertedPendulum-v5", "--local-num-envs", str(envs), "--num-steps", str(steps)]
    flags += ["--total-timesteps", str(iterations * 2 * envs * steps), "--num-minibatches", "8", "--seed", str(seed)]
    flags += ["--learning-rate", str(learning_rate), "--save-model", "--target-kl", str(target_kl)]
    results, result = train_ranks("ppo_continuous_mpi.py", flags, tmp_path, worker=recording_rank)
    assert progress_lines(result.stdout) == list(range(1, iterations + 1))
    # --compile's default: a run this short updates eagerly, and the batch table says why
    past = f"{machine.COMPILE_REPAYS_PAST:,}"
    assert f"update            eager (1,280 minibatch steps per rank; it repays past {past})" in result.stdout
    assert all(update[2:] == (None, None) for rank_result in results for update in rank_result["updates"])
    states = [rank_result["state"] for rank_result in results]
    assert_same_parameters(states)  # weights and statistics, bit for bit

    # each env seeded as Args documents (env g: seed + 10_000 g), each rank's streams too (seed + 10_000 r)
    seeds = [int(env_seeds[0]) for rank_result in results for env_seeds in rank_result["seeds"]]
    assert seeds == [seed + 10_000 * env for env in range(2 * envs)]
    assert [rank_result["torch_seed"] for rank_result in results] == [seed, seed + 10_000]
    first_observations = {tuple(seen[0].round(6)) for rank_result in results for seen in rank_result["seen"]}
    assert len(first_observations) == 2 * envs

    # the update stops on the world's KL alike on every rank
    updates = results[0]["updates"]  # (epochs, world KL, ...)
    assert [update[:2] for update in results[1]["updates"]] == [update[:2] for update in updates]
    assert len(updates) == iterations
    epochs = ppo.Args().update_epochs
    assert all(count == epochs or kl > target_kl for count, kl, *_ in updates), updates  # early only past the target
    assert any(count < epochs for count, *_ in updates), updates  # and some stopped early

    # the statistics are those of every rank's observations and discounted returns
    used = iterations * steps  # each env's observations in the rollouts, from its first reset on
    observations = []
    discounted_returns = []
    found = []
    for rank_result in results:
        assert any(ends[:used].any() for ends in rank_result["ends"])
        for seen, rewards, ends in zip(rank_result["seen"], rank_result["rewards"], rank_result["ends"], strict=True):
            observations.append(seen[:used].astype(np.float32))  # as the rollout stores them
            running = 0.0
            for reward, ended in zip(rewards[:used], ends[:used], strict=True):
                running = gamma * running + reward
                discounted_returns.append(running)
                running = 0.0 if ended else running
            found += episodes(rewards[:used], ends[:used], steps)
    observations = np.concatenate(observations).astype(np.float64)
    discounted_returns = np.array(discounted_returns)
    assert len(observations) == len(discounted_returns) == 2 * envs * used
    state = states[0]
    assert state["obs_rms.count"].item() == state["return_rms.count"].item() == len(observations)
    np.testing.assert_allclose(state["obs_rms.mean"].numpy(), observations.mean(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state["obs_rms.var"].numpy(), observations.var(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state["return_rms.mean"].item(), discounted_returns.mean(), rtol=1e-9)
    np.testing.assert_allclose(state["return_rms.var"].item(), discounted_returns.var(), rtol=1e-9)

    # the log: every key, the world's episodes of each iteration, the KL each update stopped on, the annealed rate
    [run_dir] = run_dirs(tmp_path)
    scalars = read_scalars(run_dir)
    for key in LOG_KEYS:
        assert key in scalars, key
    for key in ("losses/value_loss", "losses/policy_loss", "losses/explained_variance"):
        assert all(np.isfinite(value) for _, value in scalars[key]), key
    batch = 2 * envs * steps
    assert [step for step, _ in scalars["charts/SPS"]] == [batch * (i + 1) for i in range(iterations)]
    for key, place in (("charts/episodic_return", 1), ("charts/episodic_length", 2)):
        expected = [
            (batch * i, np.mean([episode[place] for episode in found if episode[0] == i]))
            for i in sorted({episode[0] for episode in found})
        ]
        assert [step for step, _ in scalars[key]] == [step for step, _ in expected], key
        np.testing.assert_allclose([value for _, value in scalars[key]], [value for _, value in expected], rtol=1e-6)
    assert max(length for _, _, length in found) == 1000  # it learned: the time limit truncated its episodes
    logged_kls = [value for _, value in scalars["losses/approx_kl"]]
    assert logged_kls == pytest.approx([kl for _, kl, *_ in updates], rel=1e-5)
    rates = [learning_rate * (1 - i / iterations) for i in range(iterations)]  # annealed linearly
    assert [value for _, value in scalars["charts/learning_rate"]] == pytest.approx(rates, rel=1e-6)

    # the model file holds rank 0's weights and statistics, and plays as training last did only with its statistics
    checkpoint = read_checkpoint(run_dir / "model.safetensors")
    assert checkpoint["env_id"] == "InvertedPendulum-v5" and checkpoint["script"] == "ppo_continuous_mpi.py"
    assert_same_parameters([states[0], {name[len("model.") :]: t for name, t in checkpoint["tensors"].items()}])
    monkeypatch.chdir(tmp_path)
    trained = evaluation_return(run_dir / "model.safetensors", capsys)
    last_training_return = scalars["charts/episodic_return"][-1][1]
    assert trained >= 0.8 * last_training_return
    checkpoint["tensors"]["model.obs_rms.mean"].zero_()
    checkpoint["tensors"]["model.obs_rms.var"].fill_(1.0)
    write_checkpoint(checkpoint, tmp_path / "without_statistics.safetensors")
    assert evaluation_return(tmp_path / "without_statistics.safetensors", capsys) < 0.5 * trained


def test_compile_by_default_where_the_runs_minibatch_steps_repay_it_and_as_the_flag_says():
    """--compile's default decides from the run's minibatch steps per rank: the quick start (two ranks, 1M steps)
    compiles, a 20,480-step run updates eagerly; --compile and --no-compile decide alone, and the batch table's update
    row says which and why. The flag is a pair with no third word to type."""
    repays_past = machine.COMPILE_REPAYS_PAST
    assert not machine.compile_repays(repays_past) and machine.compile_repays(repays_past + 1)

    def decided(world_size: int, *argv: str) -> tuple[bool, str]:
        args = tyro.cli(ppo.Args, args=list(argv))
        rows = {row: local for row, local, _ in ppo.derive_batch_sizes(args, world_size)}
        return args.compile, rows["update"]

    past = f"it repays past {repays_past:,}"
    assert decided(2) == (True, f"compiled (78,080 minibatch steps per rank; {past})")  # 244 x 10 epochs x 32
    assert decided(1, "--total-timesteps", "20480") == (False, f"eager (3,200 minibatch steps per rank; {past})")
    assert decided(2, "--no-compile") == (False, "eager (--no-compile)")
    assert decided(1, "--total-timesteps", "20480", "--compile") == (True, "compiled (--compile)")
    with pytest.raises(SystemExit):
        tyro.cli(ppo.Args, args=["--compile", "None"])


def test_compile_runs_the_update_through_a_compiled_step_that_takes_the_eager_steps(tmp_path):
    """--compile, two iterations of one rank: every minibatch step is the compiled step's (AOTInductor's), and every
    update ends with the weights and logged numbers the eager steps give from the same state, to float32 rounding."""
    flags = ["--env-id", "InvertedPendulum-v5", "--num-steps", "128", "--num-minibatches", "4", "--update-epochs", "2"]
    flags += ["--total-timesteps", "256", "--compile"]
    [result], output = train_ranks("ppo_continuous_mpi.py", flags, tmp_path, nprocs=1, worker=recording_rank)
    assert progress_lines(output.stdout) == [1, 2]
    assert "update            compiled (--compile)" in output.stdout  # a short run, compiled as asked
    assert result["compiled_steps"] == [(2 * 2 * 4, None)]  # 2 updates of 2 epochs of 4 minibatches, none declined
    gaps = [update[2:] for update in result["updates"]]
    assert len(gaps) == 2 and all(gap < 1e-5 for update in gaps for gap in update), gaps
