"""Vanilla policy gradient (VPG) with GAE-lambda, data-parallel over any number of processes.

SpinningUp's VPG in one file: separate policy and value MLPs, GAE-lambda advantages, one
policy-gradient step and `--train-v-iters` value steps per epoch; a Gaussian policy with a
state-independent log-std for Box actions, a Categorical for Discrete ones.

    torchrun --standalone --nproc_per_node=2 vpg_mpi.py --env-id CartPole-v1    # or --nprocs 2

Distributed: `--steps-per-epoch` is global and split evenly across ranks. Advantages are normalised
with the world's mean and std, and every step's gradients averaged in one allreduce
(average_gradients), so every rank takes the step one process would take on the whole batch.
`--sync gather`: rank 0 runs that update alone on every rank's rollout. An epoch is one iteration of
the ddrl package (checkpoints `iter_{epoch:06d}.safetensors`); `python -m ddrl.verify COPY.py`
checks that a copy still updates as one process would.

SpinningUp's defaults: PyTorch's initialisation, a log-std starting at -0.5, hidden sizes (64, 64),
advantages normalised by the population std. Unlike it, a sampled Box action is clipped to the
space before the env sees it (docs/differences.md).
"""

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tyro
from annotated_types import Ge, Gt, Interval, Le, MaxLen
from torch.distributions import Categorical, Normal

import ddrl
from ddrl import collectives, env_support, evaluation, one_learner, progress, rollout
from ddrl.failures import NonFiniteError, fail
from ddrl.flags import Finite, FolderName, RuntimeArgs


@dataclass
class Args(RuntimeArgs):
    exp_name: Annotated[str, FolderName] = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: Annotated[int, Interval(ge=0, lt=2**30)] = 1
    """seed of the experiment; rank r uses `seed + 10_000 * r`, env g uses `seed + 10_000 * g`"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """if toggled and CUDA exists, rank r uses cuda:LOCAL_RANK (small MLPs: CPU is often faster)"""
    track: bool = False
    """if toggled, the run is also sent to Weights and Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "ddrl"
    """the Weights and Biases project"""
    wandb_entity: str | None = None
    """the Weights and Biases entity (team)"""
    capture_video: bool = False
    """if toggled, rank 0 films evaluation episodes into `runs/{run_name}/videos` (needs moviepy)"""
    save_model: bool = False
    """if toggled, rank 0 writes `runs/{run_name}/model.safetensors` at the end of training"""
    numpy_rollout: bool = True
    """if toggled, the rollout runs numpy versions of the Agent's methods (fast), else the Agent"""

    # Algorithm specific arguments (names as in SpinningUp)
    env_id: str = "HalfCheetah-v5"
    """the id of the gymnasium environment (Box or Discrete actions)"""
    total_timesteps: Annotated[int, Ge(1), Le(10**15)] = 200_000
    """global env steps over all ranks; sets the number of epochs"""
    steps_per_epoch: Annotated[int, Interval(ge=1, le=10**9)] = 4000
    """global env steps per epoch, split evenly across ranks"""
    local_num_envs: Annotated[int, Interval(ge=1, le=2**16)] = 1
    """envs stepped by each rank (the local epoch share is split evenly across them)"""
    hidden_sizes: Annotated[tuple[Annotated[int, Interval(ge=1, le=2**16)], ...], MaxLen(64)] = (
        64,
        64,
    )
    """hidden layer sizes of the policy and value MLPs (tanh)"""
    gamma: Annotated[float, Interval(ge=0, le=1)] = 0.99
    """the discount factor"""
    lam: Annotated[float, Interval(ge=0, le=1)] = 0.97
    """the GAE lambda"""
    pi_lr: Annotated[float, Gt(0), Finite] = 3e-4
    """policy learning rate (Adam)"""
    vf_lr: Annotated[float, Gt(0), Finite] = 1e-3
    """value-function learning rate (Adam)"""
    train_v_iters: Annotated[int, Interval(ge=1, le=10**5)] = 80
    """value-function gradient steps per epoch"""
    max_ep_len: Annotated[int, Ge(1)] = 1000
    """episodes are cut (and bootstrapped) after this many steps"""
    sync: Literal["allreduce", "gather"] = "allreduce"
    """allreduce: average the gradients; gather: rank 0 learns on all rollouts, sends the weights"""

    # to be filled in at run time
    world_size: int = 0
    """number of ranks (computed at run time)"""
    local_steps_per_epoch: int = 0
    """env steps per epoch on one rank (computed at run time)"""
    num_steps: int = 0
    """env steps per epoch of one env (computed at run time)"""
    num_epochs: int = 0
    """number of epochs: total_timesteps // steps_per_epoch (computed at run time)"""


Batch = dict[str, torch.Tensor]  # obs, actions, log_probs, values, advantages, returns (by name)


# --- batch arithmetic ---------------------------------------------------------------------------
def derive_batch_sizes(args: Args, world_size: int) -> list[tuple[str, object, object]]:
    """Each rank's and each env's share of the global epoch, the number of epochs, and the batch
    table rank 0 prints (name, per rank, world). Uneven shares or zero epochs stop the run here."""
    args.world_size = world_size
    args.local_steps_per_epoch = args.steps_per_epoch // world_size
    args.num_steps = args.local_steps_per_epoch // args.local_num_envs
    fix = f"use a --steps-per-epoch that is a multiple of {world_size * args.local_num_envs}"
    if args.steps_per_epoch % world_size:
        fail(
            f"--steps-per-epoch {args.steps_per_epoch} does not split evenly across {world_size} "
            f"ranks; {fix}"
        )
    if args.local_steps_per_epoch % args.local_num_envs:
        local = f"the local epoch of {args.local_steps_per_epoch} steps"
        fail(f"{local} does not split across --local-num-envs {args.local_num_envs}; {fix}")
    args.num_epochs = args.total_timesteps // args.steps_per_epoch
    if args.num_epochs < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one epoch of "
            f"--steps-per-epoch {args.steps_per_epoch}: zero epochs to train; raise "
            "--total-timesteps"
        )
    return [
        ("ranks", world_size, ""),
        ("envs", args.local_num_envs, world_size * args.local_num_envs),
        ("steps per epoch", args.local_steps_per_epoch, args.steps_per_epoch),
        ("epochs", "", args.num_epochs),
        ("total env steps", "", args.num_epochs * args.steps_per_epoch),
    ]


def rollout_memory(args: Args, obs_dim: int, action_dim: int) -> tuple[int, str]:
    """What one rank holds for an epoch, in bytes, and the flags that size it: per sample, the
    rollout's storage and batch and the two networks' activations on the whole batch, forward and
    backward; the networks' weights with their gradients and Adam's moments; per env, at most 4 MiB
    (MuJoCo's Humanoid-v5: 2.5 MiB)."""
    per_sample = 8 * obs_dim + 8 * action_dim + 48 + 2 * 3 * 4 * sum(args.hidden_sizes)
    layers = zip((obs_dim, *args.hidden_sizes), (*args.hidden_sizes, action_dim + 1), strict=True)
    weights = 2 * 16 * sum(inputs * outputs for inputs, outputs in layers)
    sized_by = "--steps-per-epoch (split over the ranks) or --hidden-sizes"
    return (
        args.local_steps_per_epoch * per_sample + weights + args.local_num_envs * 4 * 2**20,
        sized_by,
    )


# --- environment, agent -------------------------------------------------------------------------
def make_env(args: Args, video_folder: str | None = None) -> Callable[[], gym.Env]:
    """A thunk building one env. `--max-ep-len` becomes a time limit: a cut episode is truncated."""

    def thunk() -> gym.Env:
        env_support.silence_settotalmass_warning()
        env = gym.make(args.env_id, render_mode="rgb_array" if video_folder else None)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
        if len(env.observation_space.shape) != 1:  # the Agent takes flat observations
            env = gym.wrappers.FlattenObservation(env)
        return gym.wrappers.TimeLimit(env, max_episode_steps=args.max_ep_len)

    return thunk


def layer_init(layer: nn.Linear) -> nn.Linear:
    """PyTorch's default initialisation (SpinningUp's; CleanRL's is orthogonal): change it here."""
    return layer


def mlp(in_size: int, hidden_sizes: tuple[int, ...], out_size: int) -> nn.Sequential:
    layers = []
    size = in_size
    for hidden in hidden_sizes:
        layers += [layer_init(nn.Linear(size, hidden)), nn.Tanh()]
        size = hidden
    return nn.Sequential(*layers, layer_init(nn.Linear(size, out_size)))


class Agent(nn.Module):
    def __init__(self, envs: gym.vector.VectorEnv, hidden_sizes: tuple[int, ...] = (64, 64)):
        super().__init__()
        obs_dim = int(np.prod(envs.single_observation_space.shape))
        action_space = envs.single_action_space
        self.continuous = isinstance(action_space, gym.spaces.Box)
        num_outputs = int(np.prod(action_space.shape)) if self.continuous else int(action_space.n)
        self.actor = mlp(obs_dim, hidden_sizes, num_outputs)
        self.critic = mlp(obs_dim, hidden_sizes, 1)
        if self.continuous:  # a state-independent log-std, as SpinningUp's
            self.log_std = nn.Parameter(torch.full((num_outputs,), -0.5))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        logits = self.actor(x)
        if self.continuous:
            probs = Normal(logits, torch.exp(self.log_std))
        else:
            probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        log_prob = probs.log_prob(action)
        entropy = probs.entropy()
        if self.continuous:  # one action's log-probability: the sum over its dimensions
            log_prob = log_prob.sum(1)
            entropy = entropy.sum(1)
        return action, log_prob, entropy, self.critic(x)


# --- GAE ----------------------------------------------------------------------------------------
def compute_gae(
    rewards: np.ndarray, values: np.ndarray, next_values: np.ndarray, terminations: np.ndarray,
    episode_ends: np.ndarray, gamma: float, gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """GAE-lambda advantages and discounted rewards-to-go (the value targets), [T, envs].
    `next_values[t]` is V of the state after step t in its episode (V(final observation) where it
    was truncated), zeroed where `terminations[t]`. `episode_ends[t]` ends the path at t. The last
    row ends a path too, bootstrapping from `next_values` (SpinningUp's `finish_path(last_val)`)."""
    advantages = np.zeros_like(rewards)
    rewards_to_go = np.zeros_like(rewards)
    next_advantage = np.zeros_like(rewards[0])
    next_return = np.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        bootstrap = gamma * (1.0 - terminations[t]) * next_values[t]
        continues = np.zeros_like(rewards[t]) if t == len(rewards) - 1 else 1.0 - episode_ends[t]
        delta = rewards[t] + bootstrap - values[t]
        next_advantage = delta + gamma * gae_lambda * continues * next_advantage
        next_return = rewards[t] + continues * gamma * next_return + (1.0 - continues) * bootstrap
        advantages[t] = next_advantage
        rewards_to_go[t] = next_return
    return advantages, rewards_to_go


# --- the gradient sync and the update -----------------------------------------------------------
def average_gradients(
    parameters: list[nn.Parameter], logged: torch.Tensor, group: collectives.Group = None
) -> torch.Tensor:
    """The gradient sync, after loss.backward(): every gradient and the `logged` numbers in one flat
    tensor, one allreduce, the world's mean written back into each `.grad`, so every rank takes the
    same step. Returns the flat mean; a NaN or inf on any rank raises NonFiniteError on every
    rank."""
    gradients = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
    flat = torch.cat([*(gradient.reshape(-1) for gradient in gradients), logged])
    collectives.allreduce_mean(flat, group)
    if not flat.sum().isfinite():  # one reduction: any NaN or inf makes the sum one
        raise NonFiniteError("a non-finite loss or gradient")
    sizes = [p.numel() for p in parameters]
    for parameter, mean in zip(parameters, flat[: sum(sizes)].split(sizes), strict=True):
        parameter.grad = mean.view_as(parameter)
    return flat


def update(
    agent: Agent,
    optimizer: optim.Optimizer,
    batch: Batch,
    args: Args,
    group: collectives.Group = None,
) -> tuple[dict[str, float], float]:
    """One VPG epoch on this rank's batch, gradients averaged over `group`: the policy step, then
    the value steps, each averaging the gradient of every parameter its loss reached, whichever of
    the optimizer's groups holds it (a trunk the policy and the value share too). Each step's loss
    rides in its gradients' allreduce, so a non-finite one stops every rank before that step, not
    earlier ones. Returns the world-averaged losses (the first value loss) by name and the
    collectives' time."""
    obs = batch["obs"]
    returns = batch["returns"]
    # every parameter the optimizer steps, whichever module holds it: each step averages those
    # its loss reached
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    start = time.perf_counter()
    count, adv_mean, m2 = collectives.moments_over_ranks(batch["advantages"], group)
    adv_std = torch.sqrt(m2 / count)  # the population std, as SpinningUp's
    sync_time = time.perf_counter() - start
    advantages = (batch["advantages"] - adv_mean) / (adv_std + 1e-8)

    # one policy-gradient step
    _, log_prob, entropy, _ = agent.get_action_and_value(obs, batch["actions"])
    policy_loss = -(log_prob * advantages).mean()
    optimizer.zero_grad()
    policy_loss.backward()
    start = time.perf_counter()
    reached = [p for p in stepped if p.grad is not None]  # the same on every rank
    average_gradients(reached, policy_loss.detach().reshape(1), group)
    sync_time += time.perf_counter() - start
    optimizer.step()  # the value function's own parameters have no gradient: Adam leaves them

    # value regression on the rewards-to-go
    for i in range(args.train_v_iters):
        value_loss = ((agent.get_value(obs).view(-1) - returns) ** 2).mean()
        if i == 0:
            first_value_loss = value_loss.detach()
        optimizer.zero_grad()
        value_loss.backward()
        start = time.perf_counter()
        reached = [p for p in stepped if p.grad is not None]
        average_gradients(reached, value_loss.detach().reshape(1), group)
        sync_time += time.perf_counter() - start
        optimizer.step()

    with torch.no_grad():  # logged as losses/NAME, the world's mean
        _, new_log_prob, _, _ = agent.get_action_and_value(obs, batch["actions"])
        logged = {
            "policy_loss": policy_loss.detach(),
            "value_loss": first_value_loss,
            "entropy": entropy.mean(),
            "approx_kl": (batch["log_probs"] - new_log_prob).mean(),
        }
    world = collectives.allreduce_mean(torch.stack(list(logged.values())).double(), group)
    return dict(zip(logged, world.tolist(), strict=True)), sync_time


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    run = ddrl.launch(args, unit="epoch")  # every flag checked first; --nprocs N: N ranks
    env_support.silence_settotalmass_warning()
    action_kinds = gym.spaces.Box | gym.spaces.Discrete
    if args.eval_checkpoint is not None:
        return evaluation.evaluate_checkpoint(args, Agent, make_env, gym.spaces.Box, action_kinds)
    spaces = env_support.check_env(
        make_env(args), f"--env-id {args.env_id!r}", gym.spaces.Box, action_kinds
    )
    observation_space, action_space = spaces
    obs_dim = observation_space.shape[0]
    continuous = isinstance(action_space, gym.spaces.Box)
    env_support.check_video_support(
        args.capture_video, lambda: env_support.render_one_frame(args.env_id)
    )
    batch_table = derive_batch_sizes(args, run.world_size)
    memory = rollout_memory(args, obs_dim, int(np.prod(action_space.shape)) if continuous else 1)
    run.start(args.num_epochs * args.steps_per_epoch, batch_table, memory)  # says its run folder
    stopping = False
    try:  # from here on a lost peer or a non-finite loss, met alike on every rank, is one line
        device = run.device

        # --- envs, the Agent (rank 0's initial weights on every rank), each rank's own seeds ---
        envs = gym.vector.SyncVectorEnv(
            [make_env(args) for _ in range(args.local_num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        torch.manual_seed(args.seed)
        agent = Agent(envs, args.hidden_sizes).to(device)
        collectives.broadcast_parameters(agent)
        rank_seed = args.seed + 10_000 * run.rank  # SpinningUp's stride: nearby seeds never collide
        random.seed(rank_seed)
        np.random.seed(rank_seed)
        torch.manual_seed(rank_seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        # SpinningUp's two Adams as two parameter groups of one: Adam keeps its state per parameter
        policy_parameters = [
            p for name, p in agent.named_parameters() if not name.startswith("critic.")
        ]
        optimizer = optim.Adam(
            [
                {"params": policy_parameters, "lr": args.pi_lr},
                {"params": list(agent.critic.parameters()), "lr": args.vf_lr},
            ]
        )
        epoch, global_step = run.resume(agent=agent, optimizer=optimizer)  # if resuming
        rollout_agent = rollout.derive(agent, observation_space, args.numpy_rollout)
        probe = rollout.probe(rollout_agent, observation_space, device)
        rollout.check(agent, probe, "at start", rollout_agent.kind)

        # --- rollout storage: numpy, a row per step of this rank's envs ---
        shape = (args.num_steps, args.local_num_envs)
        obs = np.zeros(shape + observation_space.shape, dtype=np.float32)
        actions = np.zeros(shape + action_space.shape, dtype=np.float32)
        logprobs = np.zeros(shape, dtype=np.float32)
        rewards = np.zeros(shape, dtype=np.float32)
        terminations = np.zeros(shape, dtype=np.float32)
        episode_ends = np.zeros(shape, dtype=np.float32)  # terminated or truncated
        values = np.zeros(shape, dtype=np.float32)
        final_values = np.zeros(shape, dtype=np.float32)  # V(final observation) where truncated
        first_env = run.first_env_index + run.rank * args.local_num_envs  # after earlier attempts'
        seeds = [args.seed + 10_000 * (first_env + j) for j in range(args.local_num_envs)]
        next_obs, _ = envs.reset(seed=seeds)
        episode_return = np.zeros(args.local_num_envs)
        episode_length = np.zeros(args.local_num_envs, dtype=np.int64)

        while global_step < run.total_steps:  # the world's env steps
            epoch += 1

            # --- rollout ---
            rollout_start = time.perf_counter()
            finished = {"episodes": 0, "episode_return": 0.0, "episode_length": 0}  # for the log
            for step in range(args.num_steps):
                obs[step] = next_obs
                action, logprobs[step], _, value = rollout_agent.get_action_and_value(obs[step])
                actions[step] = action
                values[step] = value.flatten()
                if continuous:
                    action = np.clip(action, action_space.low, action_space.high)
                next_obs, reward, terminated, truncated, info = envs.step(action)
                ended = terminated | truncated
                rewards[step] = reward
                terminations[step] = terminated
                episode_ends[step] = ended
                episode_return += reward
                episode_length += 1
                if ended.any():
                    finished["episodes"] += int(ended.sum())
                    finished["episode_return"] += float(episode_return[ended].sum())
                    finished["episode_length"] += int(episode_length[ended].sum())
                    episode_return[ended] = 0.0
                    episode_length[ended] = 0
                    cut = truncated & ~terminated
                    if cut.any():  # truncated, not terminated: bootstrap from V(final observation)
                        final_obs = np.stack(info["final_obs"][cut]).astype(np.float32)
                        final_values[step, cut] = rollout_agent.get_value(final_obs).flatten()
            global_step += args.steps_per_epoch
            last_values = rollout_agent.get_value(next_obs.astype(np.float32)).flatten()
            rollout_time = time.perf_counter() - rollout_start

            # --- GAE: bootstrap from the next row's value, or V(final observation) at an end ---
            next_values = np.concatenate([values[1:], last_values[None]])
            next_values = np.where(episode_ends > 0, final_values, next_values)
            advantages, returns = compute_gae(
                rewards, values, next_values, terminations, episode_ends, args.gamma, args.lam
            )
            final_values[:] = 0.0
            batch = {
                "obs": obs.reshape(-1, obs_dim),
                "actions": actions.reshape((-1,) + action_space.shape),
                "log_probs": logprobs.reshape(-1),
                "values": values.reshape(-1),
                "advantages": advantages.reshape(-1),
                "returns": returns.reshape(-1),  # the rewards-to-go
            }
            batch = {key: torch.as_tensor(value, device=device) for key, value in batch.items()}
            rollout.check(agent, batch, f"at epoch {epoch}", rollout_agent.kind)

            # --- update ---
            update_start = time.perf_counter()
            if args.sync == "allreduce":
                losses, sync_time = update(agent, optimizer, batch, args)
            else:  # --sync gather: rank 0 runs the same update on the union of every rank's batch
                losses, sync_time = one_learner.update_on_rank0(
                    lambda union, group: update(agent, optimizer, union, args, group), batch
                )
            update_time = time.perf_counter() - update_start
            rollout_agent.reread()  # views anew any tensor the update replaced

            # --- log, check, checkpoint, stop (SIGTERM or Ctrl-C on any rank stops every rank) ---
            totals = collectives.sum_over_ranks(
                device, **finished, stops=float(bool(run.stop_requested))
            )
            scalars = {"charts/learning_rate": optimizer.param_groups[0]["lr"]}
            scalars |= {f"losses/{name}": value for name, value in losses.items()}
            explained_variance = progress.explained_variance(batch["returns"], batch["values"])
            scalars["losses/explained_variance"] = explained_variance
            scalars["perf/rollout_time"] = rollout_time
            scalars["perf/update_time"] = update_time
            scalars["perf/sync_time"] = sync_time
            run.log(epoch, global_step, totals, scalars)
            run.check_in_sync(epoch)  # every module, optimizer and carried number, found
            stopping = totals["stops"] > 0
            if run.checkpoint_due(epoch, stopping):
                run.checkpoint(epoch, global_step, agent=agent, optimizer=optimizer)
            if stopping:
                break
        envs.close()
        run.finish(agent, stopping, make_env)
    except (NonFiniteError, RuntimeError) as error:  # met alike on every rank: one line, no hang
        run.stop_on_error(
            error, "lower --pi-lr/--vf-lr or check the env's observations and rewards"
        )
    return agent


if __name__ == "__main__":
    main(tyro.cli(Args))
