"""vpg_mpi.py: GAE and rewards-to-go against SpinningUp, the distributed update in both --sync modes against one
process's, one real run of two ranks (seeds, time limit, the world's explained variance, the log, its model file), and
the launchers that start it (bad input: test_bad_input.py)."""

import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist

import vpg_mpi
from ddrl import collectives, one_learner
from ddrl.failures import NonFiniteError
from tests.helpers import (
    LOG_KEYS,
    RANK_ENTRY,
    ROOT,
    Recorder,
    assert_ok,
    assert_same_parameters,
    evaluate_one_episode,
    finish,
    free_port,
    progress_lines,
    rank_parameters,
    read_scalars,
    refuse,
    run_dirs,
    run_python,
    run_ranks,
    start,
    torchrun_with,
    train_rank,
    train_ranks,
    vector_env_spaces,
)

MAX_EP_LEN = 12  # a time limit that cuts most CartPole episodes (a random policy's last about 20 steps, at least 8)
# two epochs of two ranks of two envs, cut at MAX_EP_LEN steps; hidden sizes that
# evaluation must read from the model file; one torch thread per rank, whatever the launch (a node of one rank would
# otherwise take two threads where a node of two takes one each, and two threads may sum a loss in another order)
CARTPOLE = ["--env-id", "CartPole-v1", "--local-num-envs", "2", "--steps-per-epoch", "400", "--total-timesteps", "800"]
CARTPOLE += ["--train-v-iters", "3", "--max-ep-len", str(MAX_EP_LEN), "--hidden-sizes", "16", "16", "--sync", "gather"]
CARTPOLE += ["--torch-threads", "1"]
TWO_RANKS = "ranks                        2"  # the batch table's line, printed by rank 0 of a world of two


# --- GAE and rewards-to-go ---------------------------------------------------------------------------


def discount_cumsum(x: np.ndarray, discount: float) -> np.ndarray:
    out = np.zeros_like(x)
    running = 0.0
    for t in reversed(range(len(x))):
        running = x[t] + discount * running
        out[t] = running
    return out


def spinningup_reference(rewards, values, next_values, terminated, truncated, gamma, lam):
    """SpinningUp's GAEBuffer.finish_path, applied path by path to each env's column."""
    advantages = np.zeros_like(rewards)
    returns = np.zeros_like(rewards)
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
    steps = 60
    num_envs = 4
    gamma = 0.99
    lam = 0.97
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


# --- input --------------------------------------------------------------------------------------------


def test_no_value_steps_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """--train-v-iters 0 would leave the value loss the epoch logs undefined: refused with one line instead."""
    monkeypatch.chdir(tmp_path)
    message = refuse(vpg_mpi, ["--env-id", "CartPole-v1", "--train-v-iters", "0"], monkeypatch, capsys)
    assert "--train-v-iters must be at least 1, got 0" in message
    assert not (tmp_path / "runs").exists()


# --- the distributed update against one process's ----------------------------------------------------------------

OBS_DIM = 5
ACT_DIM = 2
BATCH = 64
V_ITERS = 4
UPDATE_ARGS = vpg_mpi.Args(train_v_iters=V_ITERS, pi_lr=0.05, vf_lr=0.02)


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


def new_learner(
    obs_dim: int = OBS_DIM, hidden_sizes: tuple[int, ...] = (16, 16), args: vpg_mpi.Args = UPDATE_ARGS
) -> tuple[vpg_mpi.Agent, torch.optim.Optimizer]:
    """The Agent (Box actions) and main's one Adam with two parameter groups: the policy's at pi_lr, the critic's at
    vf_lr (SpinningUp's two Adams). Built in the default dtype."""
    torch.manual_seed(0)
    agent = vpg_mpi.Agent(vector_env_spaces(obs_dim, gym.spaces.Box(-1.0, 1.0, (ACT_DIM,))), hidden_sizes)
    policy_parameters = [p for name, p in agent.named_parameters() if not name.startswith("critic.")]
    groups = [{"params": policy_parameters, "lr": args.pi_lr}, {"params": list(agent.critic.parameters())}]
    return agent, torch.optim.Adam(groups, lr=args.vf_lr)


def float64_learner() -> tuple[vpg_mpi.Agent, torch.optim.Optimizer]:
    torch.set_default_dtype(torch.float64)
    try:
        return new_learner()
    finally:
        torch.set_default_dtype(torch.float32)


def gathered_update(
    agent: vpg_mpi.Agent, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], args: vpg_mpi.Args
) -> tuple[dict[str, float], float]:
    """vpg_mpi.update under --sync gather, called as main calls it: rank 0 updates on the union, every rank gets its
    weights."""
    return one_learner.update_on_rank0(lambda union, group: vpg_mpi.update(agent, optimizer, union, args, group), batch)


def vpg_rank(rank: int, world_size: int) -> dict[str, tuple[dict, dict]]:
    """One update on this rank's half of the fixed batch, in each sync mode from the same start."""
    half = BATCH // world_size
    local = {key: value[rank * half : (rank + 1) * half] for key, value in fixed_batch().items()}
    outcome = {}
    for sync in ("allreduce", "gather"):
        agent, optimizer = float64_learner()
        if sync == "allreduce":
            stats, _ = vpg_mpi.update(agent, optimizer, local, UPDATE_ARGS)
        else:
            stats, _ = gathered_update(agent, optimizer, local, UPDATE_ARGS)
        outcome[sync] = (agent.state_dict(), stats)
    return outcome


@pytest.mark.quick
def test_two_ranks_end_an_epoch_with_the_one_rank_weights_in_both_sync_modes(tmp_path):
    initial = float64_learner()[0].state_dict()
    agent, optimizer = float64_learner()
    expected_stats, _ = vpg_mpi.update(agent, optimizer, fixed_batch(), UPDATE_ARGS)
    expected = agent.state_dict()
    for layer in ("actor.0.weight", "critic.0.weight", "log_std"):  # the policy and the value steps moved them
        assert not torch.allclose(expected[layer], initial[layer]), layer
    assert expected_stats.keys() == {"policy_loss", "value_loss", "entropy", "approx_kl"}

    ranks = run_ranks(vpg_rank, 2, tmp_path)
    for sync in ("allreduce", "gather"):
        state0, stats0 = ranks[0][sync]
        state1, stats1 = ranks[1][sync]
        assert_same_parameters([state0, state1])  # bit for bit: every rank took the same step
        assert_same_parameters([expected, state0], atol=1e-10)
        # policy loss, first value loss, entropy and KL are world-wide, equal to the one-rank figures
        assert stats0.keys() == expected_stats.keys(), sync
        for name, value in expected_stats.items():
            assert stats0[name] == pytest.approx(value, rel=0, abs=1e-10), (sync, name)
        assert stats1 == (stats0 if sync == "allreduce" else {})  # under gather only the learner logs


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
    agent, optimizer = new_learner(4, (8,), vpg_mpi.Args(pi_lr=0.01, vf_lr=0.01))
    batch = small_batch()
    batch["returns"][3] += float("nan") if rank == 1 else 0.0
    before = {key: value.clone() for key, value in agent.state_dict().items()}
    try:
        vpg_mpi.update(agent, optimizer, batch, vpg_mpi.Args(train_v_iters=3))
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
        before = outcome["before"]
        after = outcome["after"]
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
    agent, _ = new_learner(4, (8,))
    agent.to("meta")
    optimizer = torch.optim.Adam(agent.parameters())  # holds the meta parameters, as the broadcast does
    batch = {key: value.to("meta") for key, value in small_batch().items()}
    handed = []

    def gather(tensor, gather_list=None, dst=0, async_op=False):
        handed.append(("gather", tensor.device))

    def broadcast(tensor, src=0, async_op=False):
        handed.append(("broadcast", tensor.device))
        raise BroadcastReached  # a meta tensor holds no flag to read back

    monkeypatch.setattr(collectives, "group_size", lambda group=None: 2)
    monkeypatch.setitem(one_learner.LEARNER_GROUPS, 2, None)  # the learner's group, which rank 1 is not in
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "gather", gather)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    with pytest.raises(BroadcastReached):
        gathered_update(agent, optimizer, batch, vpg_mpi.Args())
    meta = torch.device("meta")
    assert handed == [("gather", meta), ("broadcast", meta)]


# --- one real run of two ranks -----------------------------------------------------------------------------------


def recording_rank(rank: int, world_size: int, script: str, cwd: str, flags: list[str]) -> dict:
    """train_rank with a Recorder around each env main steps, recording each epoch's value targets and values (what
    this rank hands the --sync gather update) and this rank's torch seed."""
    make_env = vpg_mpi.make_env
    vpg_mpi.make_env = lambda args, video_folder=None: lambda: Recorder(make_env(args, video_folder)())
    update_on_rank0 = one_learner.update_on_rank0
    batches = []

    def recording_update_on_rank0(update_union, batch, *rest):
        batches.append({key: batch[key].double().numpy() for key in ("returns", "values")})
        return update_on_rank0(update_union, batch, *rest)

    one_learner.update_on_rank0 = recording_update_on_rank0  # main calls it by its name in the module
    state = train_rank(rank, world_size, script, cwd, flags)
    stepped = [env for env in Recorder.instances if env.rewards]  # not the env built only to read the spaces
    return {
        "state": state,
        "batches": batches,
        "torch_seed": torch.initial_seed(),
        "seeds": [env.seeds for env in stepped],
        "first_obs": [env.seen[0] for env in stepped],
        **{key: [np.array(getattr(env, key)) for env in stepped] for key in ("rewards", "terminated", "truncated")},
    }


def explained_variance(batches: list[dict[str, np.ndarray]]) -> float:
    """1 - Var(returns - values) / Var(returns) over the union of `batches`."""
    returns = np.concatenate([batch["returns"] for batch in batches])
    values = np.concatenate([batch["values"] for batch in batches])
    return 1 - np.var(returns - values) / np.var(returns)


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory) -> dict:
    """The CARTPOLE run of two ranks (--sync gather), each recording what recording_rank records; its output and
    scalars: the curve that every other launch of two ranks, with the same seed, must reproduce."""
    cwd = tmp_path_factory.mktemp("cartpole")
    results, output = train_ranks("vpg_mpi.py", [*CARTPOLE, "--save-model"], cwd, worker=recording_rank)
    [run_dir] = run_dirs(cwd)
    return {"ranks": results, "stdout": output.stdout, "run_dir": run_dir, "scalars": read_scalars(run_dir)}


@pytest.mark.quick
def test_two_ranks_train_alike_seeded_apart_and_log_the_world_s_explained_variance(cartpole):
    ranks = cartpole["ranks"]
    scalars = cartpole["scalars"]
    assert progress_lines(cartpole["stdout"]) == [1, 2] and TWO_RANKS in cartpole["stdout"]
    assert_same_parameters([rank["state"] for rank in ranks])  # the learner's weights, broadcast to every rank
    assert [step for step, _ in scalars["losses/policy_loss"]] == [400, 800]
    for key in LOG_KEYS:  # VPG has no clipping and no second KL estimator
        assert key in scalars or key in ("losses/clipfrac", "losses/old_approx_kl"), key

    # each env seeded as Args documents (env g: seed + 10_000 g), each rank's streams too (seed + 10_000 r)
    assert [seeds for rank in ranks for seeds in rank["seeds"]] == [[1 + 10_000 * env] for env in range(4)]
    assert [rank["torch_seed"] for rank in ranks] == [1, 10_001]
    assert len({tuple(obs.round(6)) for rank in ranks for obs in rank["first_obs"]}) == 4

    # --max-ep-len cuts an episode as a time limit: truncated at MAX_EP_LEN steps, never later
    lengths = []
    for rank in ranks:
        for terminated, truncated in zip(rank["terminated"], rank["truncated"], strict=True):
            ends = np.flatnonzero(terminated | truncated)
            lengths += [
                (int(end - start), bool(truncated[end])) for start, end in zip([-1, *ends[:-1]], ends, strict=True)
            ]
    assert max(length for length, _ in lengths) == MAX_EP_LEN
    assert all(cut == (length == MAX_EP_LEN) for length, cut in lengths), lengths
    assert all(8 <= length for _, length in scalars["charts/episodic_length"])  # CartPole lasts >= 8 steps

    # losses/explained_variance is 1 - Var(returns - values) / Var(returns) on the union of the ranks' batches
    assert [step for step, _ in scalars["losses/explained_variance"]] == [400, 800]
    for epoch, (_, value) in enumerate(scalars["losses/explained_variance"]):
        union = explained_variance([rank["batches"][epoch] for rank in ranks])
        per_rank = [explained_variance([rank["batches"][epoch]]) for rank in ranks]
        assert np.mean(per_rank) != pytest.approx(union, rel=1e-5, abs=1e-7), epoch  # the test tells the two apart
        assert value == pytest.approx(union, rel=1e-5, abs=1e-7), epoch

    # the model file evaluates with the hidden sizes it was trained with
    evaluate_one_episode("vpg_mpi.py", cartpole["run_dir"] / "model.safetensors", cartpole["run_dir"].parent.parent)


# --- the launchers: each starts one world of two ranks --------------------------------------------------------


def assert_same_curve(run_dir, cartpole: dict) -> None:
    """Same seed and world size: the same curve, whichever launcher started the ranks."""
    again = read_scalars(run_dir)
    for key in ("charts/episodic_return", "losses/policy_loss", "losses/value_loss"):
        assert again[key] == cartpole["scalars"][key], key


def assert_one_world_of_two_ranks(cwd, stdout: str, cartpole: dict) -> None:
    """Two launched processes trained as one world: rank 0's batch table says two ranks, one run folder logged the
    curve of the recorded run, and ranks 0 and 1 (rank_entry.py's rank0.pt and rank1.pt) end with the same weights.
    Two worlds of one would each print one rank and both write rank0.pt."""
    assert TWO_RANKS in stdout, stdout
    [run_dir] = run_dirs(cwd)
    assert_same_curve(run_dir, cartpole)
    assert sorted(path.name for path in cwd.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    assert_same_parameters(rank_parameters(cwd, 2))


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
    assert TWO_RANKS in result.stdout
    assert "Setting OMP_NUM_THREADS" in result.stderr  # torchrun's banner
    assert_same_curve(run_dirs(tmp_path)[0], cartpole)
