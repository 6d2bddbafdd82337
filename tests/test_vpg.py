"""vpg_mpi.py: GAE, seeding, distributed equivalence, every launcher (bad input: test_bad_input.py)."""

import os
import re
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
import tyro

import vpg_mpi
from ddrl import collectives
from ddrl.failures import NonFiniteError
from tests.helpers import (
    RANK_ENTRY,
    ROOT,
    assert_no_settotalmass_warning,
    assert_ok,
    assert_same_parameters,
    evaluate_one_episode,
    finish,
    free_port,
    rank_parameters,
    read_checkpoint,
    read_scalars,
    refuse,
    run_command,
    run_dirs,
    run_python,
    run_ranks,
    start,
    torchrun,
    torchrun_with,
    train_ranks,
    write_checkpoint,
)

# one torch thread per rank, whatever the launch: a node of one rank would otherwise take two threads where a node of
# two takes one each, and on some CPUs two threads sum a loss in another order (the 7th digit differs)
CARTPOLE = ["--env-id", "CartPole-v1", "--steps-per-epoch", "1000", "--total-timesteps", "3000", "--train-v-iters", "5"]
CARTPOLE += ["--torch-threads", "1"]
TWO_RANKS = "ranks                        2"  # the batch table's line, printed by rank 0 of a world of two


# --- GAE and rewards-to-go ---------------------------------------------------------------------------


def discount_cumsum(x: np.ndarray, discount: float) -> np.ndarray:
    out, running = np.zeros_like(x), 0.0
    for t in reversed(range(len(x))):
        running = x[t] + discount * running
        out[t] = running
    return out


def spinningup_reference(rewards, values, next_values, terminated, truncated, gamma, lam):
    """SpinningUp's GAEBuffer.finish_path, applied path by path to each env's column."""
    advantages, returns = np.zeros_like(rewards), np.zeros_like(rewards)
    steps, num_envs = rewards.shape
    for env in range(num_envs):
        start = 0
        for t in range(steps):
            if not (terminated[t, env] or truncated[t, env] or t == steps - 1):
                continue
            last_value = 0.0 if terminated[t, env] else next_values[t, env]
            path_rewards = np.append(rewards[start : t + 1, env], last_value)
            path_values = np.append(values[start : t + 1, env], last_value)
            deltas = path_rewards[:-1] + gamma * path_values[1:] - path_values[:-1]
            advantages[start : t + 1, env] = discount_cumsum(deltas, gamma * lam)
            returns[start : t + 1, env] = discount_cumsum(path_rewards, gamma)[:-1]
            start = t + 1
    return advantages, returns


def test_gae_and_rewards_to_go_match_spinningup_on_random_paths():
    rng = np.random.default_rng(0)
    steps, num_envs, gamma, lam = 60, 4, 0.99, 0.97
    rewards = rng.normal(size=(steps, num_envs))
    values = rng.normal(size=(steps, num_envs))
    terminated = rng.random((steps, num_envs)) < 0.08
    truncated = rng.random((steps, num_envs)) < 0.08  # some steps are both: termination wins
    ended = terminated | truncated
    final_values = rng.normal(size=(steps, num_envs))  # V(final observation) of a cut episode
    last_values = rng.normal(size=num_envs)  # V(observation after the epoch's last step)
    next_values = np.where(ended, final_values, np.concatenate([values[1:], last_values[None]]))
    assert terminated.any() and (truncated & ~terminated).any() and not ended[-1].all()

    advantages, returns = vpg_mpi.compute_gae(
        rewards, values, next_values, terminated.astype(float), ended.astype(float), gamma, lam
    )
    expected_advantages, expected_returns = spinningup_reference(
        rewards, values, next_values, terminated, truncated, gamma, lam
    )
    np.testing.assert_allclose(advantages, expected_advantages, rtol=0, atol=1e-12)
    np.testing.assert_allclose(returns, expected_returns, rtol=0, atol=1e-12)


def test_truncation_bootstraps_from_final_value_and_termination_from_zero():
    rewards = np.array([[1.0, 1.0], [1.0, 1.0]])
    values = np.zeros((2, 2))
    # env 0 is truncated at step 0 with V(final obs) = 10; env 1 terminates there with the same value
    next_values = np.array([[10.0, 10.0], [0.0, 0.0]])
    terminated = np.array([[0.0, 1.0], [0.0, 0.0]])
    ended = np.array([[1.0, 1.0], [0.0, 0.0]])
    _, returns = vpg_mpi.compute_gae(rewards, values, next_values, terminated, ended, gamma=0.5, gae_lambda=1.0)
    assert returns[0].tolist() == [1.0 + 0.5 * 10.0, 1.0]


# --- seeding -------------------------------------------------------------------------------------------


def test_no_two_envs_or_ranks_share_a_seed():
    local_num_envs = 3
    seeds = [s for rank in range(2) for s in vpg_mpi.env_seeds(1, rank, local_num_envs)]
    assert len(set(seeds)) == 2 * local_num_envs
    # nearby run seeds never reuse each other's streams
    assert not set(seeds) & {s for rank in range(2) for s in vpg_mpi.env_seeds(2, rank, local_num_envs)}
    assert vpg_mpi.rank_seed(1, 0) != vpg_mpi.rank_seed(1, 1)
    first_obs = set()
    for seed in seeds:
        env = gym.make("CartPole-v1")
        first_obs.add(tuple(env.reset(seed=seed)[0].round(6)))
        env.close()
    assert len(first_obs) == len(seeds)


# --- input --------------------------------------------------------------------------------------------


def test_no_value_steps_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """--train-v-iters 0 would leave the value loss the epoch logs undefined: refused with one line instead."""
    monkeypatch.chdir(tmp_path)
    message = refuse(vpg_mpi, ["--env-id", "CartPole-v1", "--train-v-iters", "0"], monkeypatch, capsys)
    assert "--train-v-iters must be at least 1, got 0" in message
    assert not (tmp_path / "runs").exists()


# --- distributed equivalence ---------------------------------------------------------------------------

OBS_DIM, ACT_DIM, BATCH, V_ITERS = 5, 2, 64, 4
UPDATE_ARGS = vpg_mpi.Args(train_v_iters=V_ITERS)


def fixed_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "obs": torch.randn(BATCH, OBS_DIM, generator=generator, dtype=torch.float64),
        "actions": torch.randn(BATCH, ACT_DIM, generator=generator, dtype=torch.float64),
        "log_probs": torch.randn(BATCH, generator=generator, dtype=torch.float64) - 2,
        "values": torch.randn(BATCH, generator=generator, dtype=torch.float64),
        "advantages": 3 * torch.randn(BATCH, generator=generator, dtype=torch.float64) + 1,
        "returns": torch.randn(BATCH, generator=generator, dtype=torch.float64),
    }


def new_learner() -> tuple[vpg_mpi.Agent, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    space = gym.spaces.Box(-1.0, 1.0, (ACT_DIM,))
    agent = vpg_mpi.Agent(OBS_DIM, space, (16, 16))
    pi_optimizer = torch.optim.Adam(agent.policy_parameters(), lr=0.05)
    vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=0.05)
    return agent, pi_optimizer, vf_optimizer


def vpg_rank(rank: int, world_size: int) -> dict[str, tuple[dict, torch.Tensor]]:
    """One update on this rank's half of the fixed batch, in each sync mode from the same start."""
    half = BATCH // world_size
    local = {key: value[rank * half : (rank + 1) * half] for key, value in fixed_batch().items()}
    agent, pi_optimizer, vf_optimizer = new_learner()
    allreduce = vpg_mpi.update(agent, pi_optimizer, vf_optimizer, local, UPDATE_ARGS)[0], agent.state_dict()
    agent, pi_optimizer, vf_optimizer = new_learner()
    learner_group = torch.distributed.new_group([0])
    gather = vpg_mpi.update_one_learner(agent, pi_optimizer, vf_optimizer, local, UPDATE_ARGS, learner_group)[0]
    return {"allreduce": (allreduce[1], allreduce[0]), "gather": (agent.state_dict(), gather)}


@pytest.mark.parametrize("collectives", ["torch", "mpi"])
def test_two_ranks_end_an_epoch_with_the_one_rank_weights_in_both_sync_modes(collectives, tmp_path):
    try:
        initial = new_learner()[0].state_dict()
        agent, pi_optimizer, vf_optimizer = new_learner()
        expected_stats, _ = vpg_mpi.update(agent, pi_optimizer, vf_optimizer, fixed_batch(), UPDATE_ARGS)
    finally:
        torch.set_default_dtype(torch.float32)
    expected = agent.state_dict()
    assert not torch.allclose(expected["actor.0.weight"], initial["actor.0.weight"])  # the update moved them

    ranks = run_ranks(vpg_rank, 2, tmp_path, mpi_script="vpg_mpi" if collectives == "mpi" else None)
    for sync in ("allreduce", "gather"):
        (state0, stats0), (state1, _) = ranks[0][sync], ranks[1][sync]
        assert_same_parameters([state0, state1])  # bit for bit: every rank took the same step
        assert_same_parameters([expected, state0], atol=1e-10)
        # policy loss, first value loss, entropy and KL are world-wide, equal to the one-rank figures
        assert stats0.keys() == expected_stats.keys() == {"policy_loss", "value_loss", "entropy", "approx_kl"}
        for name, value in expected_stats.items():
            assert stats0[name] == pytest.approx(value, rel=0, abs=1e-10), name


def small_batch() -> dict[str, torch.Tensor]:
    """16 samples of a 4-dimensional observation and a 2-dimensional Box action."""
    generator = torch.Generator().manual_seed(1)
    return {
        "obs": torch.randn(16, 4, generator=generator),
        "actions": torch.randn(16, 2, generator=generator),
        "log_probs": torch.full((16,), -0.7),
        "values": torch.zeros(16),
        "advantages": torch.randn(16, generator=generator),
        "returns": torch.randn(16, generator=generator),
    }


def nan_value_targets_rank(rank: int, world_size: int) -> dict:
    """One update on a batch whose value targets alone are NaN on rank 1: who raises, what moved."""
    torch.manual_seed(0)
    agent = vpg_mpi.Agent(4, gym.spaces.Box(-1.0, 1.0, (2,)), (8,))
    batch = small_batch()
    batch["returns"][3] += float("nan") if rank == 1 else 0.0
    pi_optimizer = torch.optim.Adam(agent.policy_parameters(), lr=0.01)
    vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=0.01)
    before = {key: value.clone() for key, value in agent.state_dict().items()}
    try:
        vpg_mpi.update(agent, pi_optimizer, vf_optimizer, batch, vpg_mpi.Args(train_v_iters=3))
        raised = False
    except NonFiniteError:
        raised = True
    return {"raised": raised, "before": before, "after": agent.state_dict()}


def test_nan_value_targets_on_one_rank_stop_every_rank_after_the_policy_step(tmp_path):
    """The order update's docstring states: the policy step is taken before the value steps, and a NaN first met in
    the value steps stops every rank before that value step (the runtime's 'stopped before applying it' is true of
    the non-finite step, not of the epoch)."""
    ranks = run_ranks(nan_value_targets_rank, 2, tmp_path)
    for rank, outcome in enumerate(ranks):
        assert outcome["raised"], rank
        before, after = outcome["before"], outcome["after"]
        assert not torch.equal(before["actor.0.weight"], after["actor.0.weight"]), rank  # the policy step was taken
        assert all(torch.equal(before[key], after[key]) for key in before if key.startswith("critic.")), rank
    assert_same_parameters([ranks[0]["after"], ranks[1]["after"]])  # and taken alike on both ranks


class BroadcastReached(Exception):
    pass


def test_gather_mode_hands_every_collective_tensors_on_the_weights_device(monkeypatch):
    """--sync gather --cuda joined a CPU non-finite flag onto the CUDA weights in the broadcast. Without a GPU, the
    agent lives on the meta device (not the CPU; shapes without values) on a rank other than the learner, whose gather
    and broadcast are recorded instead of run. The learner's own update cannot run on meta tensors (it reads values),
    so its side is not covered here."""
    agent = vpg_mpi.Agent(4, gym.spaces.Box(-1.0, 1.0, (2,)), (8,)).to("meta")
    batch = {key: value.to("meta") for key, value in small_batch().items()}
    pi_optimizer = torch.optim.Adam(agent.policy_parameters(), lr=0.01)
    vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=0.01)
    handed = []

    def gather(tensor, gather_list=None, dst=0):
        handed.append(("gather", tensor.device))

    def broadcast(tensor, src=0):
        handed.append(("broadcast", tensor.device))
        raise BroadcastReached  # a meta tensor holds no flag to read back

    monkeypatch.setattr(collectives, "group_size", lambda group=None: 2)
    monkeypatch.setattr(vpg_mpi.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(vpg_mpi.dist, "gather", gather)
    monkeypatch.setattr(vpg_mpi.dist, "broadcast", broadcast)
    with pytest.raises(BroadcastReached):
        vpg_mpi.update_one_learner(agent, pi_optimizer, vf_optimizer, batch, vpg_mpi.Args(), learner_group=None)
    meta = torch.device("meta")
    assert handed == [("gather", meta), ("broadcast", meta)]


# --- the logged explained variance -----------------------------------------------------------------------


def explained_variance_rank(rank: int, world_size: int, cwd: str) -> list[dict[str, np.ndarray]]:
    """Train two CartPole epochs with every rank's main, recording the value targets and values of each epoch."""
    os.chdir(cwd)
    batches, update = [], vpg_mpi.update

    def recording_update(agent, pi_optimizer, vf_optimizer, batch, *args, **kwargs):
        batches.append({key: batch[key].double().numpy() for key in ("returns", "values")})
        return update(agent, pi_optimizer, vf_optimizer, batch, *args, **kwargs)

    vpg_mpi.update = recording_update
    flags = ["--env-id", "CartPole-v1", "--steps-per-epoch", "600", "--total-timesteps", "1200", "--train-v-iters", "2"]
    vpg_mpi.main(tyro.cli(vpg_mpi.Args, args=flags))
    return batches


def test_logged_explained_variance_is_the_world_batch_value(tmp_path):
    """losses/explained_variance is 1 - Var(returns - values) / Var(returns) on the union of the ranks' batches (it
    was the mean of the ranks' own values)."""
    ranks = run_ranks(explained_variance_rank, 2, tmp_path, str(tmp_path), join_group=False)
    [run_dir] = run_dirs(tmp_path)
    logged = read_scalars(run_dir)["losses/explained_variance"]
    assert [step for step, _ in logged] == [600, 1200]
    for epoch, (_, value) in enumerate(logged):
        returns, values = (np.concatenate([rank[epoch][key] for rank in ranks]) for key in ("returns", "values"))
        union = 1 - np.var(returns - values) / np.var(returns)
        per_rank = [1 - np.var(r[epoch]["returns"] - r[epoch]["values"]) / np.var(r[epoch]["returns"]) for r in ranks]
        assert np.mean(per_rank) != pytest.approx(union, rel=1e-5, abs=1e-7), epoch  # the test tells the two apart
        assert value == pytest.approx(union, rel=1e-5, abs=1e-7), epoch


# --- end to end under each launcher --------------------------------------------------------------------


def epochs_logged(run_dir) -> int:
    return len(read_scalars(run_dir)["losses/policy_loss"])


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory) -> dict:
    """The scalars of one CARTPOLE run of two ranks under torchrun (rank_entry.py saving each rank's weights): the
    curve that every other launch of two ranks, with the same seed, must reproduce."""
    cwd = tmp_path_factory.mktemp("cartpole")
    assert_ok(torchrun("vpg_mpi.py", [*CARTPOLE, "--save-model"], cwd, save_ranks=True))
    assert_same_parameters(rank_parameters(cwd, 2))
    [run_dir] = run_dirs(cwd)
    assert (run_dir / "model.safetensors").is_file()
    return read_scalars(run_dir)


def assert_same_curve(run_dir, cartpole: dict) -> None:
    """Same seed and world size: the same curve, whichever launcher started the ranks."""
    again = read_scalars(run_dir)
    for key in ("charts/episodic_return", "losses/policy_loss", "losses/value_loss"):
        assert again[key] == cartpole[key], key


def test_cartpole_two_ranks_train_identically_and_log(cartpole):
    assert [step for step, _ in cartpole["losses/policy_loss"]] == [1000, 2000, 3000]
    for key in (
        "charts/episodic_return",
        "charts/episodic_length",
        "charts/SPS",
        "losses/value_loss",
        "losses/entropy",
        "losses/approx_kl",
        "perf/rollout_time",
        "perf/update_time",
        "perf/sync_time",
    ):
        assert key in cartpole, key
    assert all(length >= 8 for _, length in cartpole["charts/episodic_length"])  # CartPole lasts >= 8 steps


def evaluate_model(path, capsys) -> float:
    """--eval-checkpoint `path` (10 sampled episodes, in this process); the return_mean of its last line."""
    vpg_mpi.main(tyro.cli(vpg_mpi.Args, args=["--eval-checkpoint", str(path), "--eval-episodes", "10"]))
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"eval: episodes=10 return_mean=[-\d.]+ return_std=[\d.]+", last_line), last_line
    return float(last_line.split()[2].split("=")[1])


def test_evaluating_a_trained_cartpole_model_earns_its_training_return(tmp_path, capsys):
    """A short CartPole run learns (pi-lr 0.01: from ~20 to over 100 in 8 epochs); evaluating its model file earns at
    least what training last logged, and the same checkpoint holding a fresh agent's weights does far worse."""
    flags = ["--env-id", "CartPole-v1", "--pi-lr", "0.01", "--steps-per-epoch", "2000", "--total-timesteps", "16000"]
    result = run_python(ROOT / "vpg_mpi.py", [*flags, "--train-v-iters", "20", "--save-model"], tmp_path)
    assert_ok(result)
    [run_dir] = run_dirs(tmp_path)
    returns = read_scalars(run_dir)["charts/episodic_return"]
    assert len(returns) == 8 and returns[-1][1] > 3 * returns[0][1], returns  # training learned

    trained = evaluate_model(run_dir / "model.safetensors", capsys)
    assert trained >= max(0.8 * returns[-1][1], 80), (trained, returns[-1])  # a random policy earns ~20

    checkpoint = read_checkpoint(run_dir / "model.safetensors")
    torch.manual_seed(0)
    hidden_sizes = tuple(checkpoint["args"]["hidden_sizes"])
    fresh = vpg_mpi.Agent(4, gym.spaces.Discrete(2), hidden_sizes).state_dict()
    checkpoint["tensors"] = {f"model.{name}": value for name, value in fresh.items()}
    write_checkpoint(checkpoint, tmp_path / "fresh.safetensors")
    assert evaluate_model(tmp_path / "fresh.safetensors", capsys) < 0.4 * trained


def test_halfcheetah_two_ranks_gather_mode_trains_and_evaluates_quietly(tmp_path):
    args = ["--env-id", "HalfCheetah-v5", "--steps-per-epoch", "2000", "--total-timesteps", "4000"]
    args += ["--train-v-iters", "5", "--sync", "gather", "--save-model"]
    states, result = train_ranks("vpg_mpi.py", args, tmp_path)
    assert_no_settotalmass_warning(result.stdout + result.stderr, tmp_path)
    assert_same_parameters(states)
    [run_dir] = run_dirs(tmp_path)
    scalars = read_scalars(run_dir)
    assert epochs_logged(run_dir) == 2
    assert len(scalars["charts/episodic_return"]) == 2  # 1000-step episodes: one per env per epoch
    assert scalars["charts/episodic_length"][0][1] == 1000

    evaluation = evaluate_one_episode("vpg_mpi.py", run_dir / "model.safetensors", tmp_path)
    assert_no_settotalmass_warning(evaluation.stdout + evaluation.stderr, tmp_path)


def assert_one_world_of_two_ranks(cwd, stdout: str, cartpole: dict) -> None:
    """Two launched processes trained as one world: rank 0's batch table says two ranks, one run folder logged the
    curve of two ranks under torchrun, and ranks 0 and 1 (rank_entry.py's rank0.pt and rank1.pt) end with the same
    weights. Two worlds of one would each print one rank and both write rank0.pt."""
    assert TWO_RANKS in stdout, stdout
    [run_dir] = run_dirs(cwd)
    assert_same_curve(run_dir, cartpole)
    assert sorted(path.name for path in cwd.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    assert_same_parameters(rank_parameters(cwd, 2))


def test_mpirun_launch(tmp_path, cartpole):
    command = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        "-x",
        f"MASTER_PORT={free_port()}",
        "-x",
        "PYTHONPATH",
        sys.executable,
        str(RANK_ENTRY),
        "vpg_mpi.py",
        *CARTPOLE,
    ]
    result = run_command(command, tmp_path)
    assert_ok(result)
    assert_one_world_of_two_ranks(tmp_path, result.stdout, cartpole)


def test_slurm_variables_two_tasks_train_together(tmp_path, cartpole):
    port = str(free_port())
    command = [sys.executable, str(RANK_ENTRY), "vpg_mpi.py", *CARTPOLE]
    tasks = [
        start(
            command, tmp_path, f"task{r}", SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), MASTER_PORT=port
        )
        for r in range(2)
    ]
    results = [finish(task, 180) for task in tasks]
    for result in results:
        assert_ok(result)
    assert_one_world_of_two_ranks(tmp_path, results[0].stdout, cartpole)


def test_two_torchrun_nodes_train_as_one_world(tmp_path, cartpole):
    port = str(free_port())
    nodes = []
    for node_rank in range(2):
        cwd = tmp_path / f"node{node_rank}"
        cwd.mkdir()
        node_flags = ["--nnodes=2", f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}"]
        command = torchrun_with(node_flags, "tests/rank_entry.py", ["vpg_mpi.py", *CARTPOLE], nprocs=1)
        nodes.append(start(command, cwd))
    for node in nodes:
        assert_ok(finish(node, 180))
    # global rank 0 alone logs; node 1's local rank 0 is global rank 1 and writes nothing
    [run_dir] = run_dirs(tmp_path / "node0")
    assert not (tmp_path / "node1" / "runs").exists()
    assert_same_curve(run_dir, cartpole)
    states = [torch.load(tmp_path / f"node{node}" / f"rank{node}.pt") for node in range(2)]
    assert_same_parameters(states)


def test_nprocs_relaunches_under_torchrun(tmp_path, cartpole):
    """--collectives torch: where mpirun and mpi4py exist, --nprocs alone re-launches under mpirun (test_mpi.py)."""
    result = run_python(ROOT / "vpg_mpi.py", ["--nprocs", "2", "--collectives", "torch", *CARTPOLE], tmp_path)
    assert_ok(result)
    assert "ranks                        2" in result.stdout
    assert "Setting OMP_NUM_THREADS" in result.stderr  # torchrun's banner
    assert_same_curve(run_dirs(tmp_path)[0], cartpole)
