"""ppo_atari_multigpu.py: the env protocol on the real ROMs, DDP equivalence, end to end under torchrun (bad input:
test_bad_input.py)."""

import dataclasses
import os

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_atari_multigpu as ppo
from ddrl import checkpoints, env_support
from tests.helpers import (
    LOG_KEYS,
    ROOT,
    assert_ok,
    assert_same_loss_and_gradients,
    assert_same_parameters,
    cleanrl_ppo_loss,
    compiled_files,
    evaluate_one_episode,
    progress_lines,
    read_scalars,
    run_dirs,
    run_python,
    run_ranks,
    train_ranks,
    union_orders,
)

BREAKOUT = ppo.atari_settings("BreakoutNoFrameskip-v4")


def random_actions(seed: int, steps: int, num_envs: int, num_actions: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_actions, size=(steps, num_envs))


# --- the environment on the real ROMs ------------------------------------------------------------------


def test_env_ids_map_to_the_game_and_its_protocol():
    assert BREAKOUT["game"] == "breakout" and BREAKOUT["repeat_action_probability"] == 0.0
    v5 = ppo.atari_settings("ALE/Breakout-v5")
    assert v5["game"] == "breakout" and v5["repeat_action_probability"] == 0.25
    assert ppo.atari_settings("SpaceInvadersNoFrameskip-v4")["game"] == "space_invaders"


def test_each_sub_env_is_seeded_on_its_own():
    seeds = ppo.env_seeds(1, 1, 2)  # rank 1 of a run with 2 envs per rank: global envs 2 and 3
    assert seeds == [20_001, 30_001] and not set(seeds) & set(ppo.env_seeds(1, 0, 2))
    pair, single = ppo.make_env(BREAKOUT, 2, 1), ppo.make_env(BREAKOUT, 1, 1)
    pair_obs, _ = pair.reset(seed=np.array(seeds))
    single_obs, _ = single.reset(seed=np.array(seeds[1:]))
    for actions in random_actions(0, 60, 2, 4):
        np.testing.assert_array_equal(pair_obs[1], single_obs[0])  # env 1 of the pair plays the same game alone
        pair_obs, *_ = pair.step(actions)
        single_obs, *_ = single.step(actions[1:])
    assert not np.array_equal(pair_obs[0], pair_obs[1])
    pair.close()
    single.close()


@pytest.mark.parametrize("env_id", ["BreakoutNoFrameskip-v4", "SpaceInvadersNoFrameskip-v4"])
def test_life_losses_end_learner_episodes_but_logged_games_are_whole_and_raw(env_id):
    """Play the training envs and, in lockstep, the same seeds without life-loss signals (the truth of a game)."""
    settings = ppo.atari_settings(env_id)
    num_envs, steps = 2, 1500
    envs = ppo.make_env(settings, num_envs, 1)
    truth = ppo.AtariVectorEnv(  # default life handling: terminated only when the game is over
        settings["game"],
        num_envs,
        num_threads=1,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        reward_clipping=False,
    )
    seeds = np.array(ppo.env_seeds(3, 0, num_envs))
    _, info = envs.reset(seed=seeds)
    truth.reset(seed=seeds)
    games = ppo.GameTracker(info)
    logged, true_games, learner_terminals = [], [], 0
    true_return, true_length = np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)
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
            true_return[env], true_length[env] = 0.0, 0
        assert (game_over == (true_terminated | true_truncated)).all()
    assert len(true_games) >= 2 and sorted(logged) == sorted(true_games)
    assert learner_terminals >= 2 * len(true_games)  # every lost life ended a learner episode
    if env_id.startswith("SpaceInvaders"):
        assert max(r for _, r, _ in logged) > 30  # raw scores: clipped rewards could not reach this so fast
    envs.close()
    truth.close()


def test_evaluation_preprocessing_resizes_as_the_vector_env():
    """The numpy area resize of the evaluation env against AtariVectorEnv's OpenCV resize, on the same frames."""
    full = ppo.AtariVectorEnv("breakout", 1, img_height=210, img_width=160, num_threads=1)
    small = ppo.AtariVectorEnv("breakout", 1, num_threads=1)
    full_obs, _ = full.reset(seed=np.array([5]))
    small_obs, _ = small.reset(seed=np.array([5]))
    rows, cols = env_support.area_resize_matrix(210, 84), env_support.area_resize_matrix(160, 84)
    for actions in random_actions(1, 40, 1, 4):
        resized = np.rint(rows @ full_obs[0, -1] @ cols.T)
        assert np.abs(resized - small_obs[0, -1]).max() <= 1  # rounding only
        full_obs, *_ = full.step(actions)
        small_obs, *_ = small.step(actions)
    env = env_support.atari_eval_env("ALE/Breakout-v5")
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8 and not obs[:3].any() and obs[3].any()
    assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(0.25)
    env.close()


class RecordingVectorEnv:
    """The training envs, recording the actions each step sends and the terminations and lives it receives."""

    def __init__(self, envs: ppo.AtariVectorEnv):
        self.envs = envs
        self.actions = []
        self.terminated = []
        self.truncated = []
        self.lives = []

    def __getattr__(self, name: str):
        return getattr(self.envs, name)

    def send(self, actions: np.ndarray) -> None:
        self.actions.append(np.array(actions))
        self.envs.send(actions)

    def recv(self):
        obs, reward, terminated, truncated, info = self.envs.recv()
        self.terminated.append(terminated.copy())
        self.truncated.append(truncated.copy())
        self.lives.append(info["lives"].copy())
        return obs, reward, terminated, truncated, info


class RecordActions(gym.Wrapper):
    """One gymnasium env, recording the actions it is given."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.actions = []

    def step(self, action):
        self.actions.append(int(action))
        return self.env.step(action)


def never_fire_rank(rank: int, world_size: int, folder: str) -> dict[str, np.ndarray]:
    """Two iterations of `main` on Breakout (2 envs x 128 steps each) with a policy that only ever chooses NOOP;
    returns what the envs were sent and what they reported."""
    os.chdir(folder)
    recorders = []

    def recording_make_env(*args, **kwargs):
        recorders.append(RecordingVectorEnv(make_env(*args, **kwargs)))
        return recorders[-1]

    @torch.inference_mode()
    def never_fire(self, obs, deterministic=False):  # NOOP, with its log-probability (the agreement check reads it)
        policy, values = self.agent.policy_value(obs)
        noop = torch.zeros(len(obs), dtype=torch.long, device=obs.device)
        return noop, policy.log_prob_entropy(noop)[0], values

    make_env = ppo.make_env
    ppo.make_env, ppo.RolloutPolicy.act = recording_make_env, never_fire
    args = ppo.Args(cuda=False, total_timesteps=512, local_num_envs=2, num_steps=128, num_minibatches=2)
    ppo.main(dataclasses.replace(args, update_epochs=1))
    [envs] = recorders
    return {key: np.stack(getattr(envs, key)) for key in ("actions", "terminated", "truncated", "lives")}


def test_training_presses_fire_after_a_lost_life_so_a_policy_that_never_fires_plays_on(tmp_path):
    """CleanRL's FireResetEnv presses FIRE after every lost life; without it, a Breakout agent that does not fire
    would wait forever with no ball in play after its first lost life."""
    [sent] = run_ranks(never_fire_rank, 1, tmp_path, str(tmp_path), join_group=False, timeout=300)
    actions, terminated, truncated, lives = sent["actions"], sent["terminated"], sent["truncated"], sent["lives"]
    assert actions.shape == (256, 2)  # two iterations of 128 steps
    previous_lives = np.concatenate([np.full((1, 2), 5), lives[:-1]])
    lost_life = terminated & ~truncated & (lives < previous_lives) & (lives > 0)
    relaunch = np.concatenate([np.zeros((1, 2), dtype=bool), lost_life[:-1]])
    assert (lost_life.sum(0) >= 3).all()  # the ball was relaunched, and lost again, again and again
    assert (actions[relaunch] == 1).all() and (actions[~relaunch] == 0).all()  # FIRE once per lost life, else NOOP


def test_evaluation_presses_fire_after_a_lost_life_as_training_does():
    env = env_support.atari_eval_env("BreakoutNoFrameskip-v4")
    env.env = RecordActions(env.env)  # the frames ALE plays, under the evaluation preprocessing
    env.reset(seed=1)
    for _ in range(3000):  # a stalled game (no ball in play) would run to the 27,000-step limit
        _, _, terminated, truncated, info = env.step(0)
        if terminated or truncated:
            break
    assert terminated and info["lives"] == 0, info
    assert env.env.actions.count(1) == 1 + 4 * 4  # the reset's FIRE frame, then one 4-frame FIRE per lost life
    env.close()


@pytest.mark.parametrize("env_id", ["BreakoutNoFrameskip-v4", "FreewayNoFrameskip-v4"])
def test_evaluation_env_resets_and_plays_as_the_training_env(env_id):
    """ale-py's reset (FIRE for one frame where the game has FIRE, then 0-28 no-op frames, 0-29 without FIRE) draws
    its no-ops from its own C++ generator, so the two envs agree in distribution, not draw for draw: a reset with the
    same number of no-op frames (its episode_frame_number) must give the same observation, and the same play."""
    settings = ppo.atari_settings(env_id)
    has_fire = env_id.startswith("Breakout")
    training, evaluation = ppo.make_env(settings, 1, 1), env_support.atari_eval_env(env_id)
    training.reset(seed=np.array([1]))
    evaluation.reset(seed=1)
    first_obs = {}
    for _ in range(60):
        obs, info = training.reset()
        first_obs[int(info["episode_frame_number"][0])] = obs[0]
    eval_frames, compared = set(), 0
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
    relaunch, lost_lives = False, 0
    for action in random_actions(2, 300, 1, evaluation.action_space.n)[:, 0]:
        obs, _, terminated, _, info = evaluation.step(action)
        training_obs, _, training_terminated, _, _ = training.step(np.array([1 if relaunch else action]))
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


# --- DDP equivalence -------------------------------------------------------------------------------------

BATCH, EPOCHS, MINIBATCHES = 32, 2, 2


def atari_batch() -> dict[str, torch.Tensor]:
    """A fixed float64 batch of real Breakout frames; log-probs and values from the initial agent."""
    envs = ppo.make_env(BREAKOUT, 2, 1)
    obs, _ = envs.reset(seed=np.array([1, 10_001]))
    frames, actions = [], random_actions(7, BATCH // 2, 2, 4)
    for step_actions in actions:
        frames.append(obs.copy())
        obs, *_ = envs.step(step_actions)
    envs.close()
    obs = torch.from_numpy(np.concatenate(frames))
    actions = torch.from_numpy(actions.reshape(-1))
    log_prob, _, value = new_agent()(obs, actions)
    generator = torch.Generator().manual_seed(3)
    return {
        "obs": obs,
        "actions": actions,
        "log_probs": log_prob.detach() + 0.05 * torch.randn(BATCH, generator=generator, dtype=torch.float64),
        "values": value.detach(),
        "advantages": 2 * torch.randn(BATCH, generator=generator, dtype=torch.float64) + 0.5,
        "returns": torch.randn(BATCH, generator=generator, dtype=torch.float64),
    }


def new_agent(state: dict | None = None) -> ppo.Agent:
    """A float64, channels-last agent (as main builds it); with `state`, exactly those weights (orthogonal init
    differs with the thread count)."""
    torch.manual_seed(0)
    agent = ppo.Agent(4).double().to(memory_format=torch.channels_last)
    if state is not None:
        agent.load_state_dict(state)
    return agent


def update_args(target_kl: float | None) -> ppo.Args:
    return ppo.Args(update_epochs=EPOCHS, num_minibatches=MINIBATCHES, target_kl=target_kl)


def run_update(model, agent: ppo.Agent, batch: dict, orders: torch.Tensor, target_kl: float | None, sizes=None):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    stats, _ = ppo.update(model, optimizer, batch, update_args(target_kl), orders, sizes)
    return agent.state_dict(), stats


def cleanrl_loss(agent: ppo.Agent, mb: dict[str, torch.Tensor], args: ppo.Args) -> tuple[torch.Tensor, list]:
    """CleanRL's ppo_atari.py loss written out independently of the script: torch.distributions.Categorical on the
    logits of the agent's modules, advantages normalised over the minibatch, clipped surrogate and value losses."""
    hidden = agent.network(mb["obs"].double() / 255.0)
    distribution = torch.distributions.Categorical(logits=agent.actor(hidden))
    newlogprob, entropy = distribution.log_prob(mb["actions"]), distribution.entropy()
    newvalue = agent.critic(hidden).view(-1)
    return cleanrl_ppo_loss(newlogprob, entropy, newvalue, mb, args)


@pytest.mark.parametrize("clip_vloss", [True, False])
def test_minibatch_loss_equals_cleanrl_loss_written_out_independently(clip_vloss):
    """Guards the loss itself (value-clip sign, KL estimators, entropy term), which the equivalence tests cannot:
    they compare the script with itself. Random float64 inputs on real frames, where ratios and values both clip."""
    agent = new_agent()
    batch = atari_batch()
    generator = torch.Generator().manual_seed(5)
    batch["log_probs"] = batch["log_probs"] + 0.1 * torch.randn(BATCH, generator=generator, dtype=torch.float64)
    batch["values"] = batch["returns"] + 0.2 * torch.randn(BATCH, generator=generator, dtype=torch.float64)
    args = ppo.Args(clip_vloss=clip_vloss)
    adv_mean, adv_std = batch["advantages"].mean(), batch["advantages"].std()
    loss, stats = ppo.minibatch_loss(agent, batch, adv_mean, adv_std, args)
    expected_loss, expected_stats = cleanrl_loss(agent, batch, args)
    assert 0 < stats["clipfrac"] < 1  # some ratios clipped, some not
    with torch.no_grad():  # and some value errors beyond the clip range, some within
        value_change = (agent(batch["obs"], batch["actions"])[2] - batch["values"]).abs()
    assert (value_change > args.clip_coef).any() and (value_change < args.clip_coef).any()
    assert_same_loss_and_gradients(agent, loss, stats, expected_loss, expected_stats)


def ddp_rank(rank: int, world_size: int, batch: dict, orders: list[torch.Tensor], initial: dict, sizes: list) -> list:
    """One rank: its `sizes[rank]` samples of the batch, its own minibatch orders, the agent wrapped in DDP (gloo,
    float64). Unequal sizes are rollouts cut short by preemption."""
    start = sum(sizes[:rank])
    local = {key: value[start : start + sizes[rank]] for key, value in batch.items()}
    minibatch_sizes = ppo.minibatch_sizes(sizes, MINIBATCHES)
    results, preempted = [], sizes[0] != sizes[1]
    # early stopping off; on after the first epoch; and once preempted, off with --compile's agent as main compiles it
    # with preemption (dynamic shapes): compiling is the slow part, and main's static --compile runs end to end below
    runs = [(None, False), (1e-12, False), *([(None, True)] if preempted else [])]
    for target_kl, compile in runs:
        agent = new_agent(initial)
        if compile:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            agent.compile(fullgraph=True, dynamic=None)
        model = torch.nn.parallel.DistributedDataParallel(agent)
        results.append(run_update(model, agent, local, orders[rank], target_kl, minibatch_sizes))
        if compile:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    return results


@pytest.mark.parametrize("sizes", [[BATCH // 2, BATCH // 2], [BATCH // 2, 11]], ids=["equal", "preempted"])
def test_two_ddp_ranks_end_the_update_with_the_one_rank_weights_on_their_union(sizes, tmp_path):
    """Also when preemption cut rank 1's rollout to 11 samples: minibatches of 8 + 6 and 8 + 5 samples, each sample
    weighing alike wherever it was collected."""
    batch = {key: value[: sum(sizes)] for key, value in atari_batch().items()}
    half = sizes[0]
    generators = [torch.Generator().manual_seed(100 + rank) for rank in range(2)]
    orders = [
        torch.stack([torch.randperm(size, generator=g) for _ in range(EPOCHS)])
        for g, size in zip(generators, sizes, strict=True)
    ]
    # world minibatch k = the union of the ranks' minibatches k (rank 1's rows come after rank 0's)
    minibatch_sizes = ppo.minibatch_sizes(sizes, MINIBATCHES)
    whole_order, whole_sizes = union_orders(orders, minibatch_sizes), minibatch_sizes.sum(0)[None]
    initial = new_agent().state_dict()

    ranks = run_ranks(ddp_rank, 2, tmp_path, batch, orders, initial, sizes, timeout=300)  # it compiles: minutes
    for run, target_kl in enumerate((None, 1e-12)):
        agent = new_agent(initial)
        expected, expected_stats = run_update(agent, agent, batch, whole_order, target_kl, whole_sizes)
        (state0, stats0), (state1, stats1) = ranks[0][run], ranks[1][run]
        assert_same_parameters([state0, state1])  # bit for bit: every rank took the same steps
        assert stats0 == stats1
        assert_same_parameters([expected, state0], atol=1e-10)
        torch.testing.assert_close(stats0, expected_stats, rtol=0, atol=1e-10)  # losses, KL, clipfrac world-wide
        assert not torch.allclose(expected["network.0.weight"], initial["network.0.weight"], atol=1e-4)

    if sizes[0] != sizes[1]:  # the compiled agent's forward and backward under DDP: the same steps, to rounding
        (compiled0, compiled_stats0), (compiled1, _) = ranks[0][2], ranks[1][2]
        assert_same_parameters([compiled0, compiled1])
        assert_same_parameters([ranks[0][0][0], compiled0], atol=1e-10)
        torch.testing.assert_close(compiled_stats0, ranks[0][0][1], rtol=0, atol=1e-10)

    # the test can tell: one rank alone on its half (no sync) ends elsewhere
    agent = new_agent(initial)
    alone, _ = run_update(agent, agent, {key: value[:half] for key, value in batch.items()}, orders[0], None)
    assert not torch.allclose(alone["network.0.weight"], ranks[0][0][0]["network.0.weight"], atol=1e-6)
    # and early stopping on the averaged KL stopped both ranks after one of the two epochs
    agent = new_agent(initial)
    one_epoch, _ = run_update(agent, agent, batch, whole_order[:1], None, whole_sizes)
    assert_same_parameters([one_epoch, ranks[0][1][0]], atol=1e-10)


# --- end to end under torchrun ---------------------------------------------------------------------------

TINY = ["--local-num-envs", "2", "--num-steps", "128", "--num-minibatches", "2", "--update-epochs", "1"]


def test_bf16_computes_the_trunk_in_bfloat16_with_float32_outputs_and_the_float32_gradient_direction():
    batch = atari_batch()
    obs, actions = batch["obs"], batch["actions"]
    torch.manual_seed(0)
    plain = ppo.Agent(4)
    fast = ppo.Agent(4, bf16=True).to(memory_format=torch.channels_last)
    fast.load_state_dict(plain.state_dict())
    conv_dtypes = []
    fast.network[0].register_forward_hook(lambda module, inputs, output: conv_dtypes.append(output.dtype))
    outputs, expected = fast(obs, actions), plain(obs, actions)
    assert conv_dtypes == [torch.bfloat16]
    for output, reference in zip(outputs, expected, strict=True):
        assert output.dtype == torch.float32
        torch.testing.assert_close(output, reference, atol=0.05, rtol=0.05)
    for log_prob, entropy, value in (outputs, expected):
        (-log_prob.mean() - 0.01 * entropy.mean() + 0.5 * (value**2).mean()).backward()
    for name, parameter in fast.named_parameters():
        reference = plain.get_parameter(name).grad
        assert parameter.grad.dtype == torch.float32 and torch.isfinite(parameter.grad).all(), name
        cosine = torch.nn.functional.cosine_similarity(parameter.grad.flatten(), reference.flatten(), dim=0)
        assert cosine > 0.98, (name, cosine)


def policy_checkpoint(path, preferred: int | None) -> str:
    """A Breakout model file whose policy ignores the frames: zero actor weights and a bias of 20 on action
    `preferred` (which it then plays with probability 1 - 6e-9), or on none (uniformly random)."""
    torch.manual_seed(0)
    agent = ppo.Agent(4)
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

    def recording_make_eval_env(*args, **kwargs):
        envs.append(RecordActions(make_eval_env(*args, **kwargs)))
        return envs[-1]

    make_eval_env = env_support.atari_eval_env
    monkeypatch.setattr(env_support, "atari_eval_env", recording_make_eval_env)
    ppo.main(ppo.Args(eval_checkpoint=checkpoint, eval_episodes=1, **flags))
    monkeypatch.undo()
    [env] = envs
    return env.actions


def test_eval_checkpoint_plays_the_policy_its_weights_hold(tmp_path, monkeypatch, capsys):
    for preferred in (2, 3):  # RIGHT, LEFT: the paddle stays at one wall until the game is lost
        checkpoint = policy_checkpoint(tmp_path / f"prefers{preferred}.safetensors", preferred)
        actions = evaluate_in_process(monkeypatch, checkpoint, eval_deterministic=True)
        assert len(actions) > 50 and set(actions) == {preferred}
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("eval: episodes=1 return_mean=")


def test_eval_checkpoint_samples_its_actions_from_seed(tmp_path, monkeypatch):
    checkpoint = policy_checkpoint(tmp_path / "uniform.safetensors", None)
    first = evaluate_in_process(monkeypatch, checkpoint, seed=1)
    assert len(set(first)) == 4  # sampled, uniformly
    assert evaluate_in_process(monkeypatch, checkpoint, seed=1) == first  # the same --seed, the same game
    assert evaluate_in_process(monkeypatch, checkpoint, seed=2) != first


def test_breakout_two_ranks_compiled_train_identically_log_and_evaluate(tmp_path):
    # 2 ranks x 2 envs x 128 steps: 2 iterations; --compile here (test_reliability.py runs the eager default)
    args = [*TINY, "--total-timesteps", "1024", "--save-model", "--compile"]
    compiled_before = compiled_files()
    states, result = train_ranks("ppo_atari_multigpu.py", args, tmp_path)
    assert compiled_files() - compiled_before  # it compiled new kernels
    assert "ranks                        2" in result.stdout and "iteration 2/2 step 1024" in result.stdout
    assert_same_parameters(states)
    [run_dir] = run_dirs(tmp_path)
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["charts/SPS"]] == [512, 1024]
    for key in LOG_KEYS:
        if key.startswith("charts/episodic"):
            continue  # no game of Breakout ends in 2 tiny iterations
        assert len(scalars[key]) == 2, key
    assert scalars["charts/learning_rate"][1][1] == pytest.approx(2.5e-4 / 2)  # annealed
    # whole games of a near-random agent: 5 lives last far longer than one learner episode
    assert scalars["charts/episodic_return"] and all(length > 100 for _, length in scalars["charts/episodic_length"])

    evaluate_one_episode("ppo_atari_multigpu.py", run_dir / "model.safetensors", tmp_path)


def test_the_update_takes_the_eager_steps_through_a_compiled_region_replayed_as_on_a_gpu():
    """What a GPU's --capture-update runs (loss_function: the minibatch step compiled, mode reduce-overhead), on the
    CPU, where no CUDA graph replays it (tests/test_cuda.py checks the replays): the same steps as the eager update,
    to float32 rounding, with the same losses."""
    args = ppo.Args(num_minibatches=4, update_epochs=2)
    torch.manual_seed(2)
    batch = {key: value.float() if value.is_floating_point() else value for key, value in atari_batch().items()}
    orders = torch.stack([torch.randperm(BATCH) for _ in range(args.update_epochs)])
    compiled = torch.compile(ppo.minibatch_loss, mode="reduce-overhead", dynamic=False)
    ends = []
    for loss_fn in (ppo.minibatch_loss, compiled):
        torch.manual_seed(1)
        agent = ppo.Agent(4).to(memory_format=torch.channels_last)
        optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
        losses, _ = ppo.update(agent, optimizer, batch, args, orders, loss_fn=loss_fn)
        ends.append((agent.state_dict(), losses))
    (eager, eager_losses), (replayed, replayed_losses) = ends
    for key in eager:
        torch.testing.assert_close(replayed[key], eager[key], rtol=1e-4, atol=1e-6, msg=key)
    torch.testing.assert_close(replayed_losses, eager_losses, rtol=1e-3, atol=1e-6)


def test_envs_in_two_groups_stepping_in_turn_log_what_one_group_logs(tmp_path):
    """--env-groups 2 (where on a GPU the acting for one group hides behind the other group's env step): every
    env still steps once per rollout step with this iteration's policy, in the same rows of the batch, seeded alike.
    On the CPU, whose sampling draws row by row, a seeded run plays the same games (the same actions) and logs the same
    losses, but for the rounding of a forward pass on half the frames."""
    flags = ["--local-num-envs", "4", "--num-steps", "64", "--num-minibatches", "2", "--total-timesteps", "512"]
    flags += ["--update-epochs", "1", "--torch-threads", "1", "--seed", "3"]
    logged = []
    for name, groups in (("one", ["--env-threads", "1"]), ("two", ["--env-groups", "2", "--env-threads", "2"])):
        (tmp_path / name).mkdir()
        result = run_python(ROOT / "ppo_atari_multigpu.py", [*flags, *groups, "--no-cuda"], tmp_path / name)
        assert_ok(result)
        assert progress_lines(result.stdout) == [1, 2]
        [run_dir] = run_dirs(tmp_path / name)
        logged.append(
            {key: value for key, value in read_scalars(run_dir).items() if key.startswith(("losses/", "charts/e"))}
        )
    one, two = logged
    assert one.keys() == two.keys() and "charts/episodic_return" in one and "losses/value_loss" in one
    for key in one:
        if key.startswith("charts/"):
            assert one[key] == two[key], key
        else:
            np.testing.assert_allclose(
                [v for _, v in one[key]], [v for _, v in two[key]], rtol=1e-4, atol=1e-6, err_msg=key
            )
