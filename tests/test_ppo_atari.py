"""ppo_atari_multigpu.py: the env protocol on the real ROMs, the loss against CleanRL's, the DDP update against one
process's, the bfloat16 trunk, evaluation, and one real run of two ranks beside the same run in two groups of envs
(bad input: test_bad_input.py)."""

import copy
from contextlib import contextmanager
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_atari_multigpu as ppo
from ddrl import atari, checkpoints, cuda_graphs
from tests.helpers import (
    LOG_KEYS,
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
)

BREAKOUT = atari.settings("BreakoutNoFrameskip-v4")
FOUR_ACTIONS = SimpleNamespace(single_action_space=gym.spaces.Discrete(4))  # what Agent reads of Breakout's envs
FIRE = 1  # in Breakout's minimal action set: NOOP, FIRE, RIGHT, LEFT


def random_actions(seed: int, steps: int, num_envs: int, num_actions: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_actions, size=(steps, num_envs))


def eval_env(env_id: str) -> gym.Env:
    """The evaluation env of `env_id`, as --eval-checkpoint builds it."""
    return atari.eval_env(ppo.Args(env_id=env_id))()


# --- the environment on the real ROMs ------------------------------------------------------------------


def test_env_ids_map_to_the_game_and_its_protocol():
    assert BREAKOUT["game"] == "breakout" and BREAKOUT["repeat_action_probability"] == 0.0
    v5 = atari.settings("ALE/Breakout-v5")
    assert v5["game"] == "breakout" and v5["repeat_action_probability"] == 0.25
    assert atari.settings("SpaceInvadersNoFrameskip-v4")["game"] == "space_invaders"


def test_life_losses_end_learner_episodes_but_logged_games_are_whole_and_raw():
    """Play the training envs and, in lockstep, the same seeds without life-loss signals (the truth of a game).
    SpaceInvaders: three lives, and raw scores that clipped rewards could not reach so fast."""
    settings = atari.settings("SpaceInvadersNoFrameskip-v4")
    num_envs = 2
    steps = 1500
    envs = ppo.make_env(settings, num_envs, 1)
    truth = ppo.AtariVectorEnv(  # default life handling: terminated only when the game is over
        settings["game"],
        num_envs,
        num_threads=1,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        reward_clipping=False,
    )
    seeds = np.array([3, 10_003])
    _, info = envs.reset(seed=seeds)
    truth.reset(seed=seeds)
    games = atari.GameTracker(info)
    logged = []
    true_games = []
    learner_terminals = 0
    true_return = np.zeros(num_envs)
    true_length = np.zeros(num_envs, dtype=np.int64)
    for actions in random_actions(0, steps, num_envs, envs.single_action_space.n):
        _, reward, terminated, truncated, info = envs.step(actions)
        _, true_reward, true_terminated, true_truncated, _ = truth.step(actions)
        np.testing.assert_array_equal(reward, true_reward)  # same game, frame for frame
        learner_terminals += int(terminated.sum())
        game_over, returns, lengths = games.step(reward, terminated, truncated, info)
        logged += [
            (env, float(r), int(n)) for env, r, n in zip(np.flatnonzero(game_over), returns, lengths, strict=True)
        ]
        true_return += true_reward
        true_length += 1
        for env in np.flatnonzero(true_terminated | true_truncated):
            true_games.append((int(env), float(true_return[env]), int(true_length[env])))
            true_return[env] = 0.0
            true_length[env] = 0
        assert (game_over == (true_terminated | true_truncated)).all()
    assert len(true_games) >= 2 and sorted(logged) == sorted(true_games)
    assert learner_terminals >= 2 * len(true_games)  # every lost life ended a learner episode
    assert max(r for _, r, _ in logged) > 30  # raw scores: clipped rewards could not reach this so fast
    envs.close()
    truth.close()


def test_evaluation_preprocessing_resizes_as_the_vector_env():
    """The numpy area resize of the evaluation env against AtariVectorEnv's OpenCV resize, on the same frames."""
    full = ppo.AtariVectorEnv("breakout", 1, img_height=210, img_width=160, num_threads=1)
    small = ppo.AtariVectorEnv("breakout", 1, num_threads=1)
    full_obs, _ = full.reset(seed=np.array([5]))
    small_obs, _ = small.reset(seed=np.array([5]))
    rows = atari.area_resize_matrix(210, 84)
    cols = atari.area_resize_matrix(160, 84)
    for actions in random_actions(1, 40, 1, 4):
        resized = np.rint(rows @ full_obs[0, -1] @ cols.T)
        assert np.abs(resized - small_obs[0, -1]).max() <= 1  # rounding only
        full_obs, *_ = full.step(actions)
        small_obs, *_ = small.step(actions)
    env = eval_env("ALE/Breakout-v5")
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8 and not obs[:3].any() and obs[3].any()
    assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(0.25)
    env.close()


class RecordActions(gym.Wrapper):
    """One gymnasium env, recording the actions it is given."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.actions = []

    def step(self, action):
        self.actions.append(int(action))
        return self.env.step(action)


def test_evaluation_presses_fire_after_a_lost_life_as_training_does():
    env = eval_env("BreakoutNoFrameskip-v4")
    env.env = RecordActions(env.env)  # the frames ALE plays, under the evaluation preprocessing
    env.reset(seed=1)
    for _ in range(3000):  # a stalled game (no ball in play) would run to the 27,000-step limit
        _, _, terminated, truncated, info = env.step(0)
        if terminated or truncated:
            break
    assert terminated and info["lives"] == 0, info
    assert env.env.actions.count(FIRE) == 1 + 4 * 4  # the reset's FIRE frame, then one 4-frame FIRE per lost life
    env.close()


@pytest.mark.parametrize("env_id", ["BreakoutNoFrameskip-v4", "FreewayNoFrameskip-v4"])
def test_evaluation_env_resets_and_plays_as_the_training_env(env_id):
    """ale-py's reset (FIRE for one frame where the game has FIRE, then 0-28 no-op frames, 0-29 without FIRE) draws
    its no-ops from its own C++ generator, so the two envs agree in distribution, not draw for draw: a reset with the
    same number of no-op frames (its episode_frame_number) must give the same observation, and the same play."""
    settings = atari.settings(env_id)
    has_fire = env_id.startswith("Breakout")
    training = ppo.make_env(settings, 1, 1)
    evaluation = eval_env(env_id)
    training.reset(seed=np.array([1]))
    evaluation.reset(seed=1)
    first_obs = {}
    for _ in range(60):
        obs, info = training.reset()
        first_obs[int(info["episode_frame_number"][0])] = obs[0]
    eval_frames = set()
    compared = 0
    for _ in range(60):
        obs, info = evaluation.reset()
        frames = int(info["episode_frame_number"])
        eval_frames.add(frames)
        if frames in first_obs:
            assert not obs[:3].any() and not first_obs[frames][:3].any()  # zeros before the first frame
            assert np.abs(obs.astype(int) - first_obs[frames]).max() <= 1, frames  # the resize's rounding only
            compared += 1
    assert compared >= 30
    assert min(eval_frames) == (1 if has_fire else 0) and max(eval_frames) == 29
    assert min(first_obs) == min(eval_frames) and max(first_obs) == max(eval_frames)

    # from equal fresh resets (a game's start can depend on the console's earlier games), the same actions play the
    # same frames: frameskip, max-pool, FIRE after a lost life
    frames = int(evaluation.reset(seed=1)[1]["episode_frame_number"])
    seeds = (np.array([seed]) for seed in range(1, 300))
    while int(training.reset(seed=next(seeds))[1]["episode_frame_number"][0]) != frames:
        pass
    relaunch = False
    lost_lives = 0
    for action in random_actions(2, 300, 1, evaluation.action_space.n)[:, 0]:
        obs, _, terminated, _, info = evaluation.step(action)
        training_obs, _, training_terminated, _, _ = training.step(np.array([FIRE if relaunch else action]))
        if terminated:  # the game's last frame: ale-py's may be stale when it ends mid-skip (nothing reads it)
            break
        relaunch = has_fire and bool(training_terminated[0])
        lost_lives += int(training_terminated[0])
        assert np.abs(obs.astype(int) - training_obs[0]).max() <= 1
    assert lost_lives >= (2 if has_fire else 0)
    training.close()
    evaluation.close()


def test_gae_cuts_at_life_losses_and_bootstraps_truncations():
    rewards = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    values = torch.zeros(2, 2)
    # env 0 is truncated at step 0 with V(final obs) = 10; env 1 loses a life there (a terminal)
    next_values = torch.tensor([[10.0, 10.0], [3.0, 3.0]])
    terminations = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    episode_ends = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    advantages, returns = ppo.compute_gae(rewards, values, next_values, terminations, episode_ends, 0.5, 1.0)
    assert advantages[0].tolist() == [1.0 + 0.5 * 10.0, 1.0]  # nothing flows back from the next episode
    assert advantages[1].tolist() == [1.0 + 0.5 * 3.0, 1.0 + 0.5 * 3.0]
    torch.testing.assert_close(returns, advantages + values)


# --- the loss, and the DDP update against one process's ----------------------------------------------------------

BATCH = 32
EPOCHS = 2
MINIBATCHES = 2


@contextmanager
def float64():
    """Tensors made inside are float64: the Agent's weights, and its frames / 255 (the uint8 frames stay uint8)."""
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def new_agent(state: dict | None = None) -> ppo.Agent:
    """A channels-last agent (as main builds it) in the default dtype; with `state`, exactly those weights (orthogonal
    init differs with the thread count)."""
    torch.manual_seed(0)
    agent = ppo.Agent(FOUR_ACTIONS).to(memory_format=torch.channels_last)
    if state is not None:
        agent.load_state_dict(state)
    return agent


def atari_batch() -> dict[str, torch.Tensor]:
    """A fixed float64 batch of real Breakout frames (uint8, as main's batch holds them); log-probs and values from
    the initial agent."""
    envs = ppo.make_env(BREAKOUT, 2, 1)
    obs, _ = envs.reset(seed=np.array([1, 10_001]))
    frames = []
    actions = random_actions(7, BATCH // 2, 2, 4)
    for step_actions in actions:
        frames.append(obs.copy())
        obs, *_ = envs.step(step_actions)
    envs.close()
    obs = torch.from_numpy(np.concatenate(frames))
    actions = torch.from_numpy(actions.reshape(-1))
    with float64(), torch.no_grad():
        _, log_prob, _, value = new_agent().get_action_and_value(obs, actions)
    generator = torch.Generator().manual_seed(3)
    return {
        "obs": obs,
        "actions": actions,
        "log_probs": log_prob + 0.05 * torch.randn(BATCH, generator=generator, dtype=torch.float64),
        "values": value.view(-1),
        "advantages": 2 * torch.randn(BATCH, generator=generator, dtype=torch.float64) + 0.5,
        "returns": torch.randn(BATCH, generator=generator, dtype=torch.float64),
    }


@pytest.mark.parametrize("clip_vloss", [True, False])
def test_minibatch_loss_equals_cleanrl_loss_written_out_independently(clip_vloss):
    """Guards the loss itself (value-clip sign, KL estimators, entropy term), which the equivalence tests cannot:
    they compare the script with itself. Random float64 inputs on real frames, where ratios and values both clip."""
    batch = atari_batch()
    generator = torch.Generator().manual_seed(5)
    batch["log_probs"] = batch["log_probs"] + 0.1 * torch.randn(BATCH, generator=generator, dtype=torch.float64)
    batch["values"] = batch["returns"] + 0.2 * torch.randn(BATCH, generator=generator, dtype=torch.float64)
    with float64():
        agent = new_agent()
        args = ppo.Args(clip_vloss=clip_vloss)
        assert_minibatch_loss_is_cleanrls(ppo.minibatch_loss, ppo.ActionAndValue(agent), agent, batch, args)


def update_args(target_kl: float | None) -> ppo.Args:
    return ppo.Args(update_epochs=EPOCHS, num_minibatches=MINIBATCHES, target_kl=target_kl)


def run_update(model, agent: ppo.Agent, batch: dict, orders: torch.Tensor, target_kl: float | None, sizes):
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    stats, _ = ppo.update(model, optimizer, batch, update_args(target_kl), orders, sizes)
    return agent.state_dict(), stats


def ddp_rank(rank: int, world_size: int, batch: dict, orders: list, initial: dict, sizes: list, runs: list) -> list:
    """One rank: its `sizes[rank]` samples of the batch, its own minibatch orders, the Agent's ActionAndValue in DDP
    (gloo, float64), as main builds it; an update for each --target-kl of `runs`."""
    torch.set_default_dtype(torch.float64)
    start = sum(sizes[:rank])
    local = {key: value[start : start + sizes[rank]] for key, value in batch.items()}
    minibatch_sizes = ppo.minibatch_sizes(sizes, MINIBATCHES)
    results = []
    for target_kl in runs:
        agent = new_agent(initial)
        model = torch.nn.parallel.DistributedDataParallel(ppo.ActionAndValue(agent))
        results.append(run_update(model, agent, local, orders[rank], target_kl, minibatch_sizes))
    return results


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([BATCH // 2, BATCH // 2], id="equal", marks=pytest.mark.quick),
        pytest.param([BATCH // 2, 11], id="preempted"),
    ],
)
def test_two_ddp_ranks_end_the_update_with_the_one_rank_weights_on_their_union(sizes, tmp_path):
    """Also when preemption cut rank 1's rollout to 11 samples: minibatches of 8 + 6 and 8 + 5 samples, each sample
    weighing alike wherever it was collected; there also with early stopping on the world's KL (--compile's update
    under DDP: the real run below)."""
    preempted = sizes[0] != sizes[1]
    runs = [None, *([1e-12] if preempted else [])]
    batch = {key: value[: sum(sizes)] for key, value in atari_batch().items()}
    generators = [torch.Generator().manual_seed(100 + rank) for rank in range(2)]
    orders = [
        torch.stack([torch.randperm(size, generator=g) for _ in range(EPOCHS)])
        for g, size in zip(generators, sizes, strict=True)
    ]
    # world minibatch k = the union of the ranks' minibatches k (rank 1's rows come after rank 0's)
    minibatch_sizes = ppo.minibatch_sizes(sizes, MINIBATCHES)
    whole_order = union_orders(orders, minibatch_sizes)
    whole_sizes = minibatch_sizes.sum(0)[None]
    with float64():
        initial = new_agent().state_dict()

    ranks = run_ranks(ddp_rank, 2, tmp_path, batch, orders, initial, sizes, runs)
    with float64():
        for run, target_kl in enumerate(runs):
            agent = new_agent(initial)
            model = ppo.ActionAndValue(agent)
            expected, expected_stats = run_update(model, agent, batch, whole_order, target_kl, whole_sizes)
            state0, stats0 = ranks[0][run]
            state1, stats1 = ranks[1][run]
            assert_same_parameters([state0, state1])  # bit for bit: every rank took the same steps
            assert stats0 == stats1
            assert_same_parameters([expected, state0], atol=1e-10)
            torch.testing.assert_close(stats0, expected_stats, rtol=0, atol=1e-10)  # losses, KL, clipfrac world-wide
            assert not torch.allclose(expected["network.0.weight"], initial["network.0.weight"], atol=1e-4)

        # the test can tell: one rank alone on its share (no sync) ends elsewhere
        agent = new_agent(initial)
        alone_sizes = ppo.minibatch_sizes(sizes[:1], MINIBATCHES)
        share = {key: value[: sizes[0]] for key, value in batch.items()}
        alone, _ = run_update(ppo.ActionAndValue(agent), agent, share, orders[0], None, alone_sizes)
        assert not torch.allclose(alone["network.0.weight"], ranks[0][0][0]["network.0.weight"], atol=1e-6)
        if preempted:  # and early stopping on the world's KL stopped both ranks after one of the two epochs
            agent = new_agent(initial)
            one_epoch, _ = run_update(ppo.ActionAndValue(agent), agent, batch, whole_order[:1], None, whole_sizes)
            assert_same_parameters([one_epoch, ranks[0][1][0]], atol=1e-10)


# --- --bf16 ------------------------------------------------------------------------------------------------------


def test_bf16_computes_the_trunk_in_bfloat16_with_float32_outputs_and_the_float32_gradient_direction():
    batch = atari_batch()
    obs = batch["obs"]
    actions = batch["actions"]
    plain = new_agent()
    fast = new_agent(plain.state_dict())
    cuda_graphs.run_in_bfloat16(fast.network)  # as main does with --bf16
    conv_dtypes = []
    fast.network[0].register_forward_hook(lambda module, inputs, output: conv_dtypes.append(output.dtype))
    outputs = fast.get_action_and_value(obs, actions)
    expected = plain.get_action_and_value(obs, actions)
    assert conv_dtypes == [torch.bfloat16]
    for output, reference in zip(outputs[1:], expected[1:], strict=True):  # log-probabilities, entropies, values
        assert output.dtype == torch.float32
        torch.testing.assert_close(output, reference, atol=0.05, rtol=0.05)
    for _, log_prob, entropy, value in (outputs, expected):
        (-log_prob.mean() - 0.01 * entropy.mean() + 0.5 * (value**2).mean()).backward()
    for name, parameter in fast.named_parameters():
        reference = plain.get_parameter(name).grad
        assert parameter.grad.dtype == torch.float32 and torch.isfinite(parameter.grad).all(), name
        cosine = torch.nn.functional.cosine_similarity(parameter.grad.flatten(), reference.flatten(), dim=0)
        assert cosine > 0.98, (name, cosine)
    assert set(fast.state_dict()) == set(plain.state_dict())  # its weights and state dict unchanged in kind
    assert all(tensor.dtype == torch.float32 for tensor in fast.state_dict().values())


# --- evaluation --------------------------------------------------------------------------------------------------


def policy_checkpoint(path, preferred: int | None) -> str:
    """A Breakout model file whose policy ignores the frames: zero actor weights and a bias of 20 on action
    `preferred` (which it then plays with probability 1 - 6e-9), or on none (uniformly random)."""
    agent = new_agent()
    with torch.no_grad():
        agent.actor.weight.zero_()
        agent.actor.bias.zero_()
        if preferred is not None:
            agent.actor.bias[preferred] = 20.0
    checkpoints.write_model(str(path), ppo.Args(env_id="BreakoutNoFrameskip-v4"), agent)
    return str(path)


def evaluate_in_process(monkeypatch, checkpoint: str, **flags) -> list[int]:
    """`--eval-checkpoint checkpoint --eval-episodes 1` and `flags` through main; returns the actions the policy
    chose, as the evaluation env received them."""
    envs = []

    def recording_eval_env(args, video_folder=None):
        def thunk() -> gym.Env:
            envs.append(RecordActions(make_eval_env(args, video_folder)()))
            return envs[-1]

        return thunk

    make_eval_env = atari.eval_env
    monkeypatch.setattr(atari, "eval_env", recording_eval_env)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one frame a step, as the suite's workers compute: more threads only wait for each other
    try:
        ppo.main(ppo.Args(eval_checkpoint=checkpoint, eval_episodes=1, **flags))
    finally:
        torch.set_num_threads(threads)
        monkeypatch.undo()
    [env] = [env for env in envs if env.actions]  # not the one built to check the env id
    return env.actions


def test_eval_checkpoint_plays_the_policy_its_weights_hold(tmp_path, monkeypatch, capsys):
    preferred = 3  # LEFT, never the first action or FIRE: the paddle stays at the left wall until the game is lost
    checkpoint = policy_checkpoint(tmp_path / "prefers_left.safetensors", preferred)
    actions = evaluate_in_process(monkeypatch, checkpoint, eval_deterministic=True)
    assert len(actions) > 50 and set(actions) == {preferred}
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("eval: episodes=1 return_mean=")


def test_eval_checkpoint_samples_its_actions_from_seed(tmp_path, monkeypatch):
    checkpoint = policy_checkpoint(tmp_path / "uniform.safetensors", None)
    first = evaluate_in_process(monkeypatch, checkpoint, seed=1)
    assert len(set(first)) == 4  # sampled, uniformly
    assert evaluate_in_process(monkeypatch, checkpoint, seed=1) == first  # the same --seed, the same game
    assert evaluate_in_process(monkeypatch, checkpoint, seed=2) != first


# --- one real run of two ranks, beside the same run in two groups of envs ------------------------------------


class RecordingVectorEnv:
    """One group of a rank's envs as main drives them: the seeds and lives of its first reset, and for every step the
    actions sent and the rewards, terminations, truncations and lives received."""

    def __init__(self, envs: ppo.AtariVectorEnv):
        self.envs = envs
        self.seeds = None
        self.reset_lives = None
        self.sent = []
        self.rewards = []
        self.terminated = []
        self.truncated = []
        self.lives = []

    def __getattr__(self, name: str):
        return getattr(self.envs, name)

    def reset(self, *, seed=None, options=None):
        obs, info = self.envs.reset(seed=seed, options=options)
        if self.seeds is None:
            self.seeds = [int(s) for s in seed]
            self.reset_lives = info["lives"].copy()
        return obs, info

    def send(self, actions: np.ndarray) -> None:
        self.sent.append(np.array(actions))
        self.envs.send(actions)

    def recv(self):
        obs, reward, terminated, truncated, info = self.envs.recv()
        for store, value in zip(
            (self.rewards, self.terminated, self.truncated, self.lives),
            (reward, terminated, truncated, info["lives"]),
            strict=True,
        ):
            store.append(value.copy())
        return obs, reward, terminated, truncated, info


def recording_rank(rank: int, world_size: int, script: str, cwd: str, flags: list[str]) -> dict:
    """train_rank with a RecordingVectorEnv around each group of envs, recording the actions the rollout stored (each
    update's batch, [steps, envs]) and how far their log-probabilities lie from the Agent's, whether torch.compile
    compiled, this rank's torch seed, and how far each compiled update's weights and numbers lie from those of the
    eager Agent's update in DDP, run beside it from the same state on the same batch."""
    make_env = ppo.make_env
    groups = []

    def recording_make_env(*arguments) -> RecordingVectorEnv:
        groups.append(RecordingVectorEnv(make_env(*arguments)))
        return groups[-1]

    update = ppo.update
    stored = []
    log_prob_gaps = []
    gaps = []

    def update_beside_eager(model, optimizer, batch, args, *rest):
        stored.append(batch["actions"].view(-1, args.local_num_envs).cpu().numpy().copy())  # storage is reused
        agent_of_model = getattr(model, "module", model).agent
        with torch.no_grad():
            _, log_probs, _, _ = agent_of_model.get_action_and_value(batch["obs"], batch["actions"])
        log_prob_gaps.append((log_probs - batch["log_probs"]).abs().max().item())
        if not args.compile:
            return update(model, optimizer, batch, args, *rest)
        agent = getattr(model, "module", model).agent  # the compiled ActionAndValue's (in DDP, with ranks)
        eager = copy.deepcopy(agent)
        eager_optimizer = torch.optim.Adam(eager.parameters(), **optimizer.defaults)
        eager_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # its own moments
        eager_model = ppo.ActionAndValue(eager)
        if model is not getattr(model, "module", model):
            eager_model = torch.nn.parallel.DistributedDataParallel(eager_model)
        eager_losses, _ = update(eager_model, eager_optimizer, batch, args, *rest)
        losses, sync_time = update(model, optimizer, batch, args, *rest)
        weights_gap = max(
            (p - q).abs().max().item() for p, q in zip(agent.parameters(), eager.parameters(), strict=True)
        )
        gaps.append((weights_gap, max(abs(losses[name] - eager_losses[name]) for name in losses)))
        return losses, sync_time

    ppo.make_env = recording_make_env  # main calls both by their names in the module
    ppo.update = update_beside_eager
    state = train_rank(rank, world_size, script, cwd, flags)
    stepped = [group for group in groups if group.sent]  # not the envs built to size the memory
    recorded = {
        key: np.concatenate([np.stack(getattr(group, key)) for group in stepped], axis=1)
        for key in ("sent", "rewards", "terminated", "truncated", "lives")
    }
    return {
        "state": state,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "gaps": gaps,
        "torch_seed": torch.initial_seed(),
        "seeds": [seed for group in stepped for seed in group.seeds],
        "reset_lives": np.concatenate([group.reset_lives for group in stepped]),
        "stored": np.concatenate(stored),
        "log_prob_gaps": log_prob_gaps,
        **recorded,
    }


@pytest.mark.quick
def test_two_ranks_train_alike_press_fire_after_a_lost_life_and_log_what_one_group_of_envs_logs(tmp_path):
    """Two iterations of two ranks of two envs, with --save-model: once in one group of envs, once in two that step in
    turn (where on a GPU the acting for one group hides behind the other group's env step). Each run: every rank ends
    with the same weights, which the model file holds; the envs are seeded as Args documents; after a lost life FIRE
    goes to the env, else the action the Agent sampled, and the rollout stores the action the env received with its
    log-probability; the log holds every key and whole games' raw scores. The two
    runs: every env plays the same game (on the CPU, whose sampling draws row by row, the same actions), and the log is
    the same, but for the rounding of a forward pass on half the frames."""
    steps = 128
    envs = 2
    seed = 3
    flags = ["--local-num-envs", str(envs), "--num-steps", str(steps), "--num-minibatches", "2", "--update-epochs", "1"]
    flags += ["--total-timesteps", str(2 * 2 * envs * steps), "--seed", str(seed), "--save-model"]
    runs = {}
    for name, groups in (("one group", []), ("two groups", ["--env-groups", "2", "--env-threads", "2"])):
        cwd = tmp_path / name.replace(" ", "_")
        cwd.mkdir()
        results, output = train_ranks("ppo_atari_multigpu.py", [*flags, *groups], cwd, worker=recording_rank)
        assert progress_lines(output.stdout) == [1, 2]
        states = [rank["state"] for rank in results]
        assert_same_parameters(states)
        [run_dir] = run_dirs(cwd)
        model = read_checkpoint(run_dir / "model.safetensors")["tensors"]
        assert_same_parameters([states[0], {key.removeprefix("model."): t for key, t in model.items()}])
        assert [seed for rank in results for seed in rank["seeds"]] == [seed + 10_000 * env for env in range(4)]
        assert [rank["torch_seed"] for rank in results] == [seed, seed + 10_000]
        for rank in results:  # FIRE after a lost life (the game goes on), stored as the action taken
            lives = rank["lives"]
            terminated = rank["terminated"]
            previous_lives = np.concatenate([rank["reset_lives"][None], lives[:-1]])
            lost_life = terminated & ~rank["truncated"] & (lives < previous_lives)
            relaunch = np.concatenate([np.zeros((1, envs), dtype=bool), lost_life[:-1]])
            assert relaunch.sum() >= 2
            assert (rank["sent"][relaunch] == FIRE).all()
            np.testing.assert_array_equal(rank["stored"], rank["sent"])  # what the env received, FIRE too
            assert max(rank["log_prob_gaps"]) < 1e-4  # and its log-probability under the policy that acted
        scalars = read_scalars(run_dir)
        assert [step for step, _ in scalars["charts/SPS"]] == [512, 1024]
        for key in LOG_KEYS:  # every iteration logs each key, and the episodic ones where a game ended
            assert key in scalars and (key.startswith("charts/episodic") or len(scalars[key]) == 2), key
        assert [value for _, value in scalars["charts/learning_rate"]] == pytest.approx([2.5e-4, 2.5e-4 / 2])
        # whole games of a near-random agent: 5 lives last far longer than one learner episode
        assert all(length > 100 for _, length in scalars["charts/episodic_length"])
        runs[name] = results, scalars

    one, one_scalars = runs["one group"]
    two, two_scalars = runs["two groups"]
    for rank_one, rank_two in zip(one, two, strict=True):
        for key in ("sent", "rewards", "terminated", "lives"):
            np.testing.assert_array_equal(rank_one[key], rank_two[key], err_msg=key)
    logged = [key for key in one_scalars if key.startswith(("losses/", "charts/episodic"))]
    assert set(logged) <= set(two_scalars)
    for key in logged:
        if key.startswith("charts/"):
            assert one_scalars[key] == two_scalars[key], key
        else:
            np.testing.assert_allclose(
                [v for _, v in one_scalars[key]], [v for _, v in two_scalars[key]], rtol=1e-4, atol=1e-6, err_msg=key
            )


def test_compile_runs_the_updates_agent_calls_compiled_taking_the_eager_steps(tmp_path):
    """--compile, two iterations of one rank: the update's calls of the Agent are compiled (torch.compile's graphs), and
    every update ends with the weights and logged numbers the eager update gives from the same state, to float32
    rounding."""
    flags = ["--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "1"]
    flags += ["--total-timesteps", "128", "--compile"]
    [result], output = train_ranks("ppo_atari_multigpu.py", flags, tmp_path, nprocs=1, worker=recording_rank)
    assert progress_lines(output.stdout) == [1, 2]
    assert result["graphs"] > 0  # --compile compiled the update's calls
    gaps = result["gaps"]
    assert len(gaps) == 2 and all(gap < 1e-5 for update in gaps for gap in update), gaps
