"""PPO for continuous control (MuJoCo), data-parallel over any number of processes.

CleanRL's ppo_continuous_action.py: separate 64-64 tanh actor and critic, a state-independent
log-std, clipped losses, GAE-lambda, an annealed learning rate; observations normalised and rewards
scaled by statistics of every rank's data.

    torchrun --standalone --nproc_per_node=2 ppo_continuous_mpi.py    # or: --nprocs 2, mpirun, srun

Distributed: `--local-num-envs` and `--num-steps` are per rank. The world's minibatch k is the union
of the ranks' minibatches k: its advantages are normalised with the union's mean and std, and the
gradients averaged in one allreduce after loss.backward() (average_gradients), so every rank takes
the step one process would take on the whole batch. `--sync gather`: rank 0 runs that update alone.
The plumbing (launching, run folders, checkpoints, the numpy rollout and the compiled update step
derived from the Agent and the loss) is the ddrl package; `python -m ddrl.verify COPY.py` checks
that a copy still updates as one process would.
"""

import math
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
from annotated_types import Ge, Gt, Interval, Le
from torch.distributions.normal import Normal
from tyro.conf import DisallowNone, arg

import ddrl
from ddrl import (
    checks,
    collectives,
    compiled_step,
    env_support,
    evaluation,
    machine,
    one_learner,
    preemption,
    progress,
    rollout,
)
from ddrl.failures import NonFiniteError, fail
from ddrl.flags import Finite, FolderName, RuntimeArgs
from ddrl.normalization import NORM_CLIP, NORM_EPS, RunningMeanStd


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
    """if toggled, rank 0 writes `runs/{run_name}/model.safetensors` (weights, statistics)"""
    compile: DisallowNone[Annotated[bool | None, arg(help_behavior_hint="")]] = None
    """the update's minibatch step compiled (on CPU ahead of time, derived from minibatch_loss,
    where a C++ compiler exists, else one line and the eager step; on a GPU the loss by
    torch.compile): --compile always, --no-compile never, by default where the run's minibatch
    steps per rank repay the compile's seconds (machine.compile_repays)"""
    numpy_rollout: bool = True
    """if toggled, the rollout runs numpy versions of the Agent's methods (fast), else the Agent"""

    # Algorithm specific arguments (names and defaults as in CleanRL's ppo_continuous_action.py)
    env_id: str = "HalfCheetah-v5"
    """the id of the gymnasium environment (Box actions)"""
    total_timesteps: Annotated[int, Ge(1), Le(10**15)] = 1_000_000
    """global env steps over all ranks; sets the number of iterations"""
    learning_rate: Annotated[float, Gt(0), Finite] = 3e-4
    """the learning rate of the optimizer (Adam)"""
    local_num_envs: Annotated[int, Interval(ge=1, le=2**16)] = 1
    """envs stepped by each rank"""
    num_steps: Annotated[int, Interval(ge=1, le=10**7)] = 2048
    """steps per env per rollout"""
    anneal_lr: bool = True
    """if toggled, the learning rate decays linearly to zero over the iterations"""
    gamma: Annotated[float, Interval(ge=0, le=1)] = 0.99
    """the discount factor (also of the return whose running std scales the rewards)"""
    gae_lambda: Annotated[float, Interval(ge=0, le=1)] = 0.95
    """the lambda of generalized advantage estimation"""
    num_minibatches: Annotated[int, Ge(1)] = 32
    """minibatches per update epoch; the world's minibatch k is every rank's minibatch k"""
    update_epochs: Annotated[int, Interval(ge=1, le=10**4)] = 10
    """passes over the batch per iteration"""
    norm_adv: bool = True
    """if toggled, advantages are normalised with each world minibatch's mean and std"""
    clip_coef: Annotated[float, Ge(0), Finite] = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """if toggled, the value loss is clipped around the rollout's values (the PPO paper's code)"""
    ent_coef: Annotated[float, Ge(0), Finite] = 0.0
    """coefficient of the entropy bonus"""
    vf_coef: Annotated[float, Ge(0), Finite] = 0.5
    """coefficient of the value loss"""
    max_grad_norm: Annotated[float, Gt(0), Finite] = 0.5
    """the maximum norm of the (world-averaged) gradient"""
    target_kl: Annotated[float, Gt(0), Finite] | None = None
    """if set, stop the update epochs once the world-averaged approximate KL exceeds it"""
    sync: Literal["allreduce", "gather"] = "allreduce"
    """allreduce: ranks update on their shares, gradients averaged; gather: rank 0 on the union"""
    preempt_fraction: Annotated[float, Interval(ge=0, le=1)] = 0.0
    """DD-PPO: once this share of the ranks ends its rollout, the rest cut theirs short (0 = off)"""
    min_rollout_fraction: Annotated[float, Gt(0), Le(1)] = 0.25
    """with --preempt-fraction, the share of --num-steps a rollout collects before any cut"""

    # to be filled in at run time
    world_size: int = 0
    """number of ranks (computed at run time)"""
    local_batch_size: int = 0
    """env steps per iteration on one rank: local_num_envs * num_steps (computed at run time)"""
    batch_size: int = 0
    """env steps per iteration on all ranks (computed at run time)"""
    local_minibatch_size: int = 0
    """one rank's share of a minibatch (computed at run time)"""
    minibatch_size: int = 0
    """the world's minibatch size (computed at run time)"""
    num_iterations: int = 0
    """number of iterations: total_timesteps // batch_size (computed at run time)"""
    min_num_steps: int = 0
    """steps per env before --preempt-fraction may cut a rollout short (computed at run time)"""


Batch = dict[str, torch.Tensor]  # obs, actions, log_probs, values, advantages, returns (by name)


# --- batch arithmetic ---------------------------------------------------------------------------
def derive_batch_sizes(args: Args, world_size: int) -> list[tuple[str, object, object]]:
    """The per-rank and world batch sizes, --compile's default, and the batch table rank 0 prints
    (name, per rank, world); sizes that do not divide, or give no iteration, stop here."""
    args.world_size = world_size
    args.local_batch_size = args.local_num_envs * args.num_steps
    args.batch_size = args.local_batch_size * world_size
    if args.local_batch_size % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} does not divide the local batch of "
            f"{args.local_batch_size} steps (--local-num-envs {args.local_num_envs} x --num-steps "
            f"{args.num_steps}); use a divisor of it"
        )
    args.local_minibatch_size = args.local_batch_size // args.num_minibatches
    args.minibatch_size = args.local_minibatch_size * world_size
    args.num_iterations = args.total_timesteps // args.batch_size
    # at least one sample per minibatch, however early a rollout is cut
    min_steps = math.ceil(args.min_rollout_fraction * args.num_steps)
    args.min_num_steps = max(min_steps, math.ceil(args.num_minibatches / args.local_num_envs))
    if args.num_iterations < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one iteration's batch of "
            f"{args.batch_size} steps ({world_size} ranks x {args.local_num_envs} envs x "
            f"{args.num_steps} steps): raise --total-timesteps"
        )
    # the minibatch steps a rank takes, against the compile's one-off seconds
    steps = args.num_iterations * args.update_epochs * args.num_minibatches
    why = "--compile" if args.compile else "--no-compile"
    if args.compile is None:  # the default: compile where this run repays the compile's seconds
        args.compile = machine.compile_repays(steps)
        why = f"{steps:,} minibatch steps per rank; it repays past {machine.COMPILE_REPAYS_PAST:,}"
    return [
        ("ranks", "", world_size),
        ("envs", args.local_num_envs, world_size * args.local_num_envs),
        ("batch", args.local_batch_size, args.batch_size),
        ("minibatch", args.local_minibatch_size, args.minibatch_size),
        ("iterations", "", args.num_iterations),
        ("total env steps", "", args.num_iterations * args.batch_size),
        ("update", f"{'compiled' if args.compile else 'eager'} ({why})", ""),
    ]


def rollout_memory(args: Args, obs_dim: int, action_dim: int) -> tuple[int, str]:
    """What one rank holds for an iteration, in bytes, and the flags that size it: per sample, the
    rollout's storage, the batch's tensors, an epoch's shuffled copy and the epochs' orders; per
    env, at most 4 MiB (MuJoCo's Humanoid-v5: 2.5 MiB)."""
    per_sample = 16 * obs_dim + 12 * action_dim + 80 + 8 * args.update_epochs
    sized_by = "--local-num-envs x --num-steps (the batch per rank) or --update-epochs"
    return args.local_batch_size * per_sample + args.local_num_envs * 4 * 2**20, sized_by


# --- environment, agent ----------------------------------------------------------
def make_env(args: Args, video_folder: str | None = None) -> Callable[[], gym.Env]:
    """A thunk building one env (the world's statistics that normalise it live in the Agent)."""

    def thunk() -> gym.Env:
        env_support.silence_settotalmass_warning()
        env = gym.make(args.env_id, render_mode="rgb_array" if video_folder else None)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
        if len(env.observation_space.shape) != 1:  # the Agent takes flat observations
            env = gym.wrappers.FlattenObservation(env)
        return env

    return thunk


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, envs: gym.vector.VectorEnv):
        super().__init__()
        obs_dim = int(np.prod(envs.single_observation_space.shape))
        action_dim = int(np.prod(envs.single_action_space.shape))
        # every rank's observations, fixed during a rollout
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.return_rms = RunningMeanStd(())  # every rank's discounted returns: the rewards' scale
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, action_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.obs_rms.normalize(x))

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        x = self.obs_rms.normalize(x)
        action_mean = self.actor_mean(x)
        action_logstd = self.actor_logstd.expand_as(action_mean)
        action_std = torch.exp(action_logstd)
        probs = Normal(action_mean, action_std)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


# --- GAE ----------------------------------------------------------------------------------------
def compute_gae(
    rewards: np.ndarray, values: np.ndarray, next_values: np.ndarray, terminations: np.ndarray,
    episode_ends: np.ndarray, gamma: float, gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """GAE-lambda advantages and value targets, [T, envs]. `next_values[t]`: V after step t in its
    episode (the final observation's if truncated, 0 if terminated); `episode_ends` cut the sum."""
    advantages = np.zeros_like(rewards)
    next_advantage = np.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * (1.0 - terminations[t]) * next_values[t] - values[t]
        next_advantage = delta + gamma * gae_lambda * (1.0 - episode_ends[t]) * next_advantage
        advantages[t] = next_advantage
    return advantages, advantages + values


# --- the loss, the minibatches, the gradient sync, the update -----------------------------------
def minibatch_loss(
    agent: Agent, mb: Batch, adv_mean: torch.Tensor | None, adv_std: torch.Tensor | None, args: Args
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped loss on one minibatch, advantages normalised with the world minibatch's mean
    and std; and the numbers logged as `losses/NAME` (the world's mean: they ride in the
    allreduce)."""
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(mb["obs"], mb["actions"])
    newvalue = newvalue.view(-1)
    checks.check_minibatch_scores(newlogprob, newvalue, mb)  # one per row
    logratio = newlogprob - mb["log_probs"]
    ratio = logratio.exp()
    with torch.no_grad():  # calculate approx_kl http://joschu.net/blog/kl-approx.html
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).to(ratio.dtype).mean()
    mb_advantages = mb["advantages"]
    if adv_mean is not None:
        mb_advantages = (mb_advantages - adv_mean) / (adv_std + 1e-8)
    # Policy loss
    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
    # Value loss
    if args.clip_vloss:
        v_loss_unclipped = (newvalue - mb["returns"]) ** 2
        v_delta = torch.clamp(newvalue - mb["values"], -args.clip_coef, args.clip_coef)
        v_loss_clipped = (mb["values"] + v_delta - mb["returns"]) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((newvalue - mb["returns"]) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    logged = {
        "policy_loss": pg_loss.detach(),
        "value_loss": v_loss.detach(),
        "entropy": entropy_loss.detach(),
        "old_approx_kl": old_approx_kl,
        "approx_kl": approx_kl,
        "clipfrac": clipfrac,
    }
    return loss, logged


def minibatch_sizes(sample_counts: list[int], num_minibatches: int) -> torch.Tensor:
    """[ranks, num_minibatches]: the samples each rank gives each world minibatch."""
    counts = torch.tensor(sample_counts)[:, None]
    return counts // num_minibatches + (torch.arange(num_minibatches) < counts % num_minibatches)


def minibatches(batch: Batch, order: torch.Tensor, local_sizes: list[int]) -> list[Batch]:
    """One epoch's minibatches of this rank: `batch` in the order `order`, cut into pieces
    `local_sizes` long. The one place minibatches are made (a recurrent core's sequences: here)."""
    shuffled = {key: value[order] for key, value in batch.items()}
    starts = np.cumsum([0, *local_sizes]).tolist()
    return [
        {key: value[start:end] for key, value in shuffled.items()}
        for start, end in zip(starts[:-1], starts[1:], strict=True)
    ]


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


def clip_gradients(gradients: torch.Tensor, max_grad_norm: float) -> None:
    """Scale the world's mean gradient (flat) to a norm of at most max_grad_norm, alike on every
    rank."""
    gradients.mul_(torch.clamp(max_grad_norm / (gradients.norm() + 1e-6), max=1.0))


def update(
    agent: Agent, optimizer: optim.Optimizer, batch: Batch, args: Args, orders: torch.Tensor,
    sizes: torch.Tensor, loss_fn: Callable = minibatch_loss, group: collectives.Group = None,
    compiled: compiled_step.CompiledStep | None = None,
) -> tuple[dict[str, float], float]:  # fmt: skip
    """PPO's epochs: minibatch k of epoch e is piece k, `sizes[rank, k]` long, of
    minibatches(batch, orders[e]); the world's is the ranks' union. Returns the world-averaged
    numbers minibatch_loss logs and the seconds spent in collectives."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]  # all it steps
    num_weights = sum(p.numel() for p in parameters)
    rank = collectives.rank_in(group)
    local_sizes = sizes[rank].tolist()
    weights = (sizes[rank].double() * len(sizes) / sizes.sum(0)).tolist()
    unequal = bool((sizes != sizes[0, 0]).any())  # a preempted rollout's minibatches are smaller
    checks.check_minibatch_cut(local_sizes, orders.shape[1])
    sync_time = 0.0
    # the sum of every minibatch's logged numbers: the clip fraction is logged as their mean
    logged_sum = 0.0
    for epoch in range(args.update_epochs):
        epoch_minibatches = minibatches(batch, orders[epoch], local_sizes)
        adv_mean = adv_std = [None] * args.num_minibatches
        if args.norm_adv:  # every world minibatch's mean and std in one collective per epoch
            start = time.perf_counter()
            advantages = [mb["advantages"] for mb in epoch_minibatches]
            if not unequal:
                advantages = torch.stack(advantages)
            count, adv_mean, m2 = collectives.moments_over_ranks(advantages, group)
            adv_std = torch.sqrt(m2 / (count - 1))  # unbiased, as CleanRL's .std()
            sync_time += time.perf_counter() - start
        for k, mb in enumerate(epoch_minibatches):
            flat = None
            if compiled is not None:  # the steps below, derived from loss_fn and compiled
                flat = compiled(mb, adv_mean[k], adv_std[k], weights[k], group)
                names = compiled.logged
                sync_time += compiled.sync_time
            if flat is None:
                loss, logged = loss_fn(agent, mb, adv_mean[k], adv_std[k], args)
                # this rank's share of the world minibatch: the ranks' mean is the union's
                if unequal:
                    loss = loss * weights[k]
                    logged = {name: value * weights[k] for name, value in logged.items()}
                optimizer.zero_grad()
                loss.backward()
                names = list(logged)
                start = time.perf_counter()
                flat = average_gradients(parameters, torch.stack(list(logged.values())), group)
                sync_time += time.perf_counter() - start
                clip_gradients(flat[:num_weights], args.max_grad_norm)  # the mean each .grad views
                optimizer.step()
            logged_sum = logged_sum + flat[num_weights:]
        losses = dict(zip(names, flat[num_weights:], strict=True))  # the epoch's last minibatch
        # the KL is the world's, carried by the last gradient allreduce: every rank stops together
        if args.target_kl is not None and losses["approx_kl"] > args.target_kl:
            break
    losses["clipfrac"] = logged_sum[names.index("clipfrac")] / ((epoch + 1) * args.num_minibatches)
    return {name: value.item() for name, value in losses.items()}, sync_time


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    run = ddrl.launch(args)  # every flag checked first; --nprocs N: this command as N ranks
    env_support.silence_settotalmass_warning()
    if args.eval_checkpoint is not None:
        return evaluation.evaluate_checkpoint(args, Agent, make_env, gym.spaces.Box, gym.spaces.Box)
    given = f"--env-id {args.env_id!r}"
    spaces = env_support.check_env(make_env(args), given, gym.spaces.Box, gym.spaces.Box)
    observation_space, action_space = spaces
    obs_dim = observation_space.shape[0]
    env_support.check_video_support(
        args.capture_video, lambda: env_support.render_one_frame(args.env_id)
    )
    batch_table = derive_batch_sizes(args, run.world_size)
    memory = rollout_memory(args, obs_dim, action_space.shape[0])
    run.start(args.num_iterations * args.batch_size, batch_table, memory)  # says its run folder
    stopping = False
    try:  # from here on a lost peer or a non-finite loss, met alike on every rank, is one line
        device = run.device

        # --- envs, the Agent (rank 0's initial weights on every rank), each rank's own seeds ---
        envs = gym.vector.SyncVectorEnv(
            [make_env(args) for _ in range(args.local_num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        torch.manual_seed(args.seed)
        agent = Agent(envs).to(device)
        collectives.broadcast_parameters(agent)
        rank_seed = args.seed + 10_000 * run.rank  # SpinningUp's stride: nearby seeds never collide
        random.seed(rank_seed)
        np.random.seed(rank_seed)
        torch.manual_seed(rank_seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
        iteration, global_step = run.resume(agent=agent, optimizer=optimizer)  # if resuming
        loss_fn = minibatch_loss
        compiled = None  # on CPU, the update's step compiled ahead of time; on a GPU, its loss
        if args.compile and machine.can_compile(device) and device.type == "cpu":
            compiled = compiled_step.CompiledStep(
                agent, optimizer, minibatch_loss, average_gradients, clip_gradients, args
            )
        elif args.compile and device.type == "cuda":
            loss_fn = torch.compile(
                minibatch_loss, fullgraph=True, dynamic=args.preempt_fraction > 0
            )  # fixed shapes, unless preemption cuts
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
        discounted_returns = np.zeros(shape)  # the return whose running std scales the rewards
        first_env = run.first_env_index + run.rank * args.local_num_envs  # after earlier attempts'
        seeds = [args.seed + 10_000 * (first_env + j) for j in range(args.local_num_envs)]
        next_obs, _ = envs.reset(seed=seeds)
        episode_return = np.zeros(args.local_num_envs)
        episode_length = np.zeros(args.local_num_envs)
        discounted_return = np.zeros(args.local_num_envs)

        while global_step < run.total_steps:  # the world's env steps: preemption collects fewer
            iteration += 1
            if args.anneal_lr:  # linearly to zero over the run's env steps
                frac = 1.0 - global_step / run.total_steps
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # --- rollout (the Agent's statistics stay fixed: every rank normalises alike) ---
            rollout_start = time.perf_counter()
            finished = {"episodes": 0, "episode_return": 0.0, "episode_length": 0}  # for the log
            collected = args.num_steps  # steps per env: all, unless preemption cuts it short
            for step in range(args.num_steps):
                # DD-PPO: most ranks are done
                if preemption.rollout_preempted(run.world, args, iteration, step):
                    collected = step
                    break
                obs[step] = next_obs
                action, logprobs[step], _, value = rollout_agent.get_action_and_value(obs[step])
                actions[step] = action
                values[step] = value.flatten()
                clipped_action = np.clip(action, action_space.low, action_space.high)
                next_obs, reward, terminated, truncated, info = envs.step(clipped_action)
                ended = terminated | truncated
                rewards[step] = reward
                terminations[step] = terminated
                episode_ends[step] = ended
                discounted_return = discounted_return * args.gamma + reward
                discounted_returns[step] = discounted_return
                episode_return += reward
                episode_length += 1
                if ended.any():
                    finished["episodes"] += int(ended.sum())
                    finished["episode_return"] += float(episode_return[ended].sum())
                    finished["episode_length"] += int(episode_length[ended].sum())
                    episode_return[ended] = 0
                    episode_length[ended] = 0
                    discounted_return[ended] = 0
                    cut = truncated & ~terminated
                    if cut.any():  # truncated, not terminated: bootstrap from V(final observation)
                        final_obs = np.stack(info["final_obs"][cut]).astype(np.float32)
                        final_values[step, cut] = rollout_agent.get_value(final_obs).flatten()
            preemption.rollout_finished(run.world, args, iteration)
            rows = slice(collected)  # the rollout's rows
            last_values = rollout_agent.get_value(next_obs.astype(np.float32)).flatten()
            rollout_time = time.perf_counter() - rollout_start
            sample_counts = [args.local_batch_size] * args.world_size  # each rank's samples
            if args.preempt_fraction:  # one all_gather
                local_count = [collected * args.local_num_envs]
                sample_counts = collectives.gather_ints_to_all(local_count, device)[:, 0].tolist()
            global_step += sum(sample_counts)

            # --- the statistics of every rank's observations and returns, in one collective ---
            data = [obs[rows].reshape(-1, obs_dim).T, discounted_returns[rows].reshape(1, -1)]
            data = torch.as_tensor(np.concatenate(data), dtype=torch.float64, device=device)
            count, mean, m2 = collectives.moments_over_ranks(data)
            agent.return_rms.update(count[obs_dim], mean[obs_dim], m2[obs_dim])
            # from here on the rewards are scaled, with statistics that include this rollout
            reward_scale = math.sqrt(agent.return_rms.var.item() + NORM_EPS)
            rewards[rows] = np.clip(rewards[rows] / reward_scale, -NORM_CLIP, NORM_CLIP)

            # --- GAE: bootstrap from the next row's value, or V(final observation) at an end ---
            next_values = np.concatenate([values[rows][1:], last_values[None]])
            next_values = np.where(episode_ends[rows] > 0, final_values[rows], next_values)
            advantages, returns = compute_gae(
                rewards[rows], values[rows], next_values, terminations[rows], episode_ends[rows],
                args.gamma, args.gae_lambda,
            )  # fmt: skip
            final_values[:] = 0.0
            batch = {
                "obs": obs[rows].reshape(-1, obs_dim),
                "actions": actions[rows].reshape(-1, action_space.shape[0]),
                "log_probs": logprobs[rows].reshape(-1),
                "values": values[rows].reshape(-1),
                "advantages": advantages.reshape(-1),
                "returns": returns.reshape(-1),
            }
            batch = {k: torch.as_tensor(v, device=device) for k, v in batch.items()}
            rollout.check(agent, batch, f"at iteration {iteration}", rollout_agent.kind)

            # --- update ---
            update_start = time.perf_counter()
            orders = [
                torch.randperm(returns.size, device=device) for _ in range(args.update_epochs)
            ]
            orders = torch.stack(orders)
            sizes = minibatch_sizes(sample_counts, args.num_minibatches)
            if args.sync == "allreduce":
                losses, sync_time = update(
                    agent, optimizer, batch, args, orders, sizes, loss_fn, compiled=compiled
                )
            else:  # --sync gather: rank 0 runs the same update on the union of every rank's batch
                losses, sync_time = one_learner.update_on_rank0(
                    lambda union, union_orders, union_sizes, group: update(
                        agent, optimizer, union, args, union_orders, union_sizes, loss_fn, group,
                        compiled,
                    ),
                    batch, orders, sizes,
                )  # fmt: skip
            update_time = time.perf_counter() - update_start
            # the observation statistics take this rollout in only now: the update saw it as it was
            agent.obs_rms.update(count[0], mean[:obs_dim], m2[:obs_dim])
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
            run.log(iteration, global_step, totals, scalars)
            run.check_in_sync(iteration)  # every module, optimizer and carried number, found
            stopping = totals["stops"] > 0
            if run.checkpoint_due(iteration, stopping):
                run.checkpoint(iteration, global_step, agent=agent, optimizer=optimizer)
            if stopping:
                break
        envs.close()
        run.finish(agent, stopping, make_env)
    except (NonFiniteError, RuntimeError) as error:  # met alike on every rank: one line, no hang
        run.stop_on_error(
            error, "lower --learning-rate or check the env's observations and rewards"
        )
    return agent


if __name__ == "__main__":
    main(tyro.cli(Args))
