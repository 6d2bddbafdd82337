"""PPO for continuous control (MuJoCo), data-parallel over any number of processes.

CleanRL's ppo_continuous_action.py recipe, so results compare with its table: separate 64-64 tanh
actor and critic MLPs, a state-independent log-std, clipped losses, GAE-lambda, an annealed learning
rate. Observations are normalised, rewards scaled by a per-episode return's running std (README).

    torchrun --standalone --nproc_per_node=2 ppo_continuous_mpi.py    # README: launchers, GPUs

Distributed story: `--local-num-envs` and `--num-steps` are per rank. The world's minibatch k is the
union of the ranks' minibatches k: advantages normalised with its mean and std, gradients averaged
in one allreduce (average_gradients, after loss.backward()). So every rank takes the step one process
would take on the whole batch. `--sync gather`: rank 0 runs that update alone. `--preempt-fraction`:
DD-PPO. What a researcher does not edit (launching, moving tensors between ranks, run folders,
checkpoints, the progress line) is the ddrl package beside this file, called by its modules' names.
"""

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro

from ddrl import checkpoints, checks, collectives, env_support, launching, numpy_rollout, preemption, progress
from ddrl.failures import NonFiniteError, fail

SCRIPT = os.path.basename(__file__)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
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
    """if toggled, rank 0 writes `runs/{run_name}/model.safetensors` (weights, normalisation statistics)"""
    eval_checkpoint: str | None = None
    """if set, load this model file (or a training checkpoint), play `--eval-episodes` episodes on rank 0 and exit"""
    eval_episodes: int = 10
    """episodes played by `--eval-checkpoint` and after training with `--capture-video`"""
    eval_deterministic: bool = False
    """if toggled, evaluation takes the policy's mean action instead of sampling"""
    compile: bool = False
    """if toggled, the update's loss runs through torch.compile (on CPU: needs a C++ compiler)"""
    numpy_rollout: bool = True
    """if toggled, the rollout runs numpy copies of the Agent's networks (fast), else the modules"""

    # Algorithm specific arguments (names and defaults as in CleanRL's ppo_continuous_action.py)
    env_id: str = "HalfCheetah-v5"
    """the id of the gymnasium environment (Box actions)"""
    total_timesteps: int = 1_000_000
    """global env steps over all ranks; sets the number of iterations"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer (Adam)"""
    local_num_envs: int = 1
    """envs stepped by each rank"""
    num_steps: int = 2048
    """steps per env per rollout"""
    anneal_lr: bool = True
    """if toggled, the learning rate decays linearly to zero over the iterations"""
    gamma: float = 0.99
    """the discount factor (also of the return whose running std scales the rewards)"""
    gae_lambda: float = 0.95
    """the lambda of generalized advantage estimation"""
    num_minibatches: int = 32
    """minibatches per update epoch; the world's minibatch k is every rank's minibatch k"""
    update_epochs: int = 10
    """passes over the batch per iteration"""
    norm_adv: bool = True
    """if toggled, advantages are normalised with each world minibatch's mean and std"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """if toggled, the value loss is clipped around the rollout's values (the PPO paper's code)"""
    ent_coef: float = 0.0
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum norm of the (world-averaged) gradient"""
    target_kl: float | None = None
    """if set, stop the update epochs once the world-averaged approximate KL exceeds it"""
    sync: Literal["allreduce", "gather"] = "allreduce"
    """allreduce: ranks update on their shares, gradients averaged; gather: rank 0 on the union"""
    preempt_fraction: float = 0.0
    """DD-PPO: once this share of the ranks ends its rollout, the rest cut theirs short (0 = off)"""
    min_rollout_fraction: float = 0.25
    """with --preempt-fraction, the share of --num-steps a rollout collects before any cut"""

    # Distributed runtime (the same flags in every ddrl script)
    run_name: str = ""
    """the run folder under runs/; default `{env_id}__{exp_name}__{seed}__{unix_time}`"""
    torch_threads: int = 0
    """torch threads per rank; 0 = the cores idle at start divided by the ranks on this node (1 on a GPU)"""
    nprocs: int = 1
    """if > 1, re-launch as that many ranks: mpirun if --collectives allows MPI, else torchrun"""
    collectives: Literal["auto", "mpi", "torch"] = "auto"
    """CPU collectives via mpi4py or gloo; auto: mpi if MPI started the ranks and mpi4py imports"""
    backend: str = ""
    """torch.distributed backend; empty = gloo, and NCCL for CUDA tensors with --cuda"""
    dist_timeout: float = 1800.0
    """seconds a collective may wait for a peer before the run stops with an error"""
    checkpoint_every: int = 0
    """iterations between checkpoints, `runs/{run_name}/checkpoints/iter_{n:06d}.safetensors` (0: SIGTERM)"""
    resume: bool = False
    """continue the run `--run-name` from its newest checkpoint (automatic on a torchrun restart)"""
    check_sync_every: int = 10
    """iterations between checks that all ranks hold the same weights (a checksum), from the first; 0 = never"""

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
Group = dist.ProcessGroup | None  # None: the world


# --- batch arithmetic ---------------------------------------------------------------------------------
def derive_batch_sizes(args: Args, world_size: int) -> None:
    """The per-rank and world batch sizes; sizes that do not divide, or give no iteration, stop."""
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


ENV_MEMORY = 4 * 2**20  # bytes one env takes, at most (MuJoCo's Humanoid-v5: 2.5 MiB)
SIZED_BY = "--local-num-envs x --num-steps (the batch per rank) or --update-epochs"


def rollout_memory(args: Args, obs_dim: int, action_dim: int) -> tuple[int, str]:
    """What one rank holds for an iteration, in bytes, and the flags that size it: the rollout's numpy storage (raw
    observations in float64 for the statistics), their merge's copy, an epoch's shuffled copy of the batch and the
    epochs' orders, per sample; and its envs."""
    per_sample = 24 * obs_dim + 8 * action_dim + 64 + 8 * args.update_epochs
    return args.local_batch_size * per_sample + args.local_num_envs * ENV_MEMORY, SIZED_BY


# --- environment, normalisation, agent ----------------------------------------------------------------
NORM_CLIP = 10.0  # normalised observations and scaled rewards are clipped to +-10, as in CleanRL
NORM_EPS = 1e-8
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)  # of the Gaussian policy's density


def make_env(env_id: str, video_folder: str | None = None) -> Callable[[], gym.Env]:
    """A thunk building one env (normalisation lives in main: gymnasium's wrappers are per env)."""

    def thunk() -> gym.Env:
        env_support.silence_settotalmass_warning()
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
        return env

    return thunk


def refuse_impossible_statistics(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """Before statistics load: refuse what no data gives (a count below 1, unless they are the empty statistics of an
    untrained Agent; a negative variance)."""
    count = state_dict.get(f"{prefix}count")
    mean = state_dict.get(f"{prefix}mean")
    var = state_dict.get(f"{prefix}var")
    if count is None or mean is None or var is None:  # load_state_dict names what is missing
        return
    empty = count == 0 and bool((mean == 0).all() and (var == 1).all())
    if not (count >= 1 or empty):
        raise ValueError(f"its {prefix}count is {count.item():g}, where statistics of data count at least 1 sample")
    if not (var >= 0).all():
        raise ValueError(f"its {prefix}var holds negative numbers, where a variance is at least 0")


class RunningMeanStd(nn.Module):
    """Running mean and population variance in float64 buffers, empty at first (no pseudo-count)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_load_state_dict_pre_hook(refuse_impossible_statistics)

    @torch.no_grad()
    def update(self, count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Merge a batch's moments (parallel variance update) into the statistics of all data."""
        total = self.count + count
        delta = mean - self.mean
        self.var.copy_((self.var * self.count + m2 + delta**2 * self.count * count / total) / total)
        self.mean += delta * count / total
        self.count.copy_(total)

    def frozen(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) as numpy arrays, fixed for a rollout."""
        return self.mean.cpu().numpy().copy(), np.sqrt(self.var.cpu().numpy() + NORM_EPS)


def normalize_obs(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Observations as the agent sees them: standardised with frozen statistics, clipped."""
    return np.clip((x - mean) / std, -NORM_CLIP, NORM_CLIP).astype(np.float32)


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class DispatchFreeSequential(nn.Sequential):
    """nn.Sequential doing Linear and Tanh layers' arithmetic itself (dispatch: ~5% of a step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            parameters = layer._parameters  # not layer.weight: nn.Module.__getattr__ costs ~1.5 us
            if type(layer) is nn.Linear and parameters["bias"] is not None and x.dim() == 2:
                x = torch.addmm(parameters["bias"], x, parameters["weight"].t())
            elif type(layer) is nn.Tanh:
                x = torch.tanh(x)
            else:
                x = layer(x)
        return x


def mlp(in_size: int, out_size: int, out_std: float) -> nn.Sequential:
    """CleanRL's 64-64 tanh MLP with orthogonal init, the output layer scaled by `out_std`."""
    return DispatchFreeSequential(
        layer_init(nn.Linear(in_size, 64)),
        nn.Tanh(),
        layer_init(nn.Linear(64, 64)),
        nn.Tanh(),
        layer_init(nn.Linear(64, out_size), std=out_std),
    )


class GaussianActions:
    """The policy's action distribution at some observations: a Gaussian per action dimension. The rollout samples
    it on numpy rows; the update scores given actions on torch tensors. Both are written here, side by side."""

    def __init__(self, mean, log_std):
        self.mean = mean
        self.log_std = log_std  # broadcasts against the mean

    def sample(self, deterministic: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Actions (the mean if `deterministic`) and their log-probabilities, from numpy's seeded generator."""
        normal = np.zeros if deterministic else np.random.standard_normal
        noise = normal(self.mean.shape).astype(self.mean.dtype)
        actions = self.mean + np.exp(self.log_std) * noise
        log_prob = (-0.5 * noise**2 - self.log_std - LOG_SQRT_2PI).sum(-1)
        return actions, log_prob

    def log_prob_entropy(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probability of `actions` and the distribution's entropy, per row."""
        log_std = self.log_std
        log_prob = (-0.5 * ((actions - self.mean) / log_std.exp()) ** 2 - log_std - LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + LOG_SQRT_2PI + log_std).sum(-1).expand(len(actions))
        return log_prob, entropy


class Agent(nn.Module):
    """CleanRL's continuous agent and the normalisation statistics: the one definition of what the policy and the value
    compute. `policy` and `value` run on torch tensors in the update and on numpy rows in the rollout."""

    def __init__(self, obs_dim: int, action_dim: int):
        super().__init__()
        self.critic = mlp(obs_dim, 1, out_std=1.0)
        self.actor_mean = mlp(obs_dim, action_dim, out_std=0.01)
        self.actor_logstd = nn.Parameter(torch.zeros(action_dim))  # or a module (state-dependent)
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.return_rms = RunningMeanStd(())

    def policy(self, obs) -> GaussianActions:
        """The action distribution at `obs`."""
        log_std = self.actor_logstd  # state-dependent: self.actor_logstd(obs)
        return GaussianActions(self.actor_mean(obs), log_std)

    def value(self, obs) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def log_prob_entropy_value(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The update's view: the log-probability of `actions`, the entropy and the value at `obs`."""
        log_prob, entropy = self.policy(obs).log_prob_entropy(actions)
        return log_prob, entropy, self.value(obs)

    def rollout_policy(self, numpy_layers: bool = True) -> numpy_rollout.NumpyPolicy:
        """This Agent's own `policy` and `value` on numpy copies of its modules, as they are now, for a rollout (which
        never changes them); without `numpy_layers`, its torch modules on the rows."""
        return numpy_rollout.NumpyPolicy(self, numpy_layers)


# --- the rollout (numpy copies of the Agent's networks), checked against the Agent --------------------
def check_rollout_policy(agent: Agent, batch: Batch, when: str) -> None:
    """Stop unless Agent.log_prob_entropy_value gives `batch`'s log-probabilities and values."""
    rows = {k: batch[k][: numpy_rollout.PROBE_SAMPLES] for k in ("obs", "actions", "log_probs", "values")}
    with torch.no_grad():
        log_prob, _, value = agent.log_prob_entropy_value(rows["obs"], rows["actions"])
        distribution = type(agent.policy(rows["obs"])).__name__  # GaussianActions, or what an edit put in its place
    pairs = {"log-probabilities": (log_prob, rows["log_probs"]), "values": (value, rows["values"])}
    acting = f"{distribution}.sample (on numpy copies of the Agent's networks)"
    checks.check_agreement(when, f"{acting} and {distribution}.log_prob_entropy", **pairs)


# --- GAE ----------------------------------------------------------------------------------------------
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


# --- gradient sync and the update ---------------------------------------------------------------------
def global_moments(x: torch.Tensor | list[torch.Tensor], group: Group = None) -> tuple[torch.Tensor, ...]:
    """Count, mean, M2 of `x`'s last dim (or each list item) over all ranks, in one all_gather."""
    if isinstance(x, list):
        moments = [(p.new_tensor(len(p)), p.mean(), ((p - p.mean()) ** 2).sum()) for p in x]
        local = torch.stack([torch.stack(column) for column in zip(*moments, strict=True)])
    else:
        local_mean = x.mean(-1)
        local_m2 = ((x - local_mean.unsqueeze(-1)) ** 2).sum(-1)
        local = torch.stack([torch.full_like(local_mean, x.shape[-1]), local_mean, local_m2])
    if collectives.group_size(group) == 1:
        return local[0], local[1], local[2]
    count_i, mean_i, m2_i = collectives.gather_to_all(local, group).transpose(0, 1)  # each [ranks, rows...]
    count = count_i.sum(0)
    mean = (count_i * mean_i).sum(0) / count
    m2 = (m2_i + count_i * (mean_i - mean) ** 2).sum(0)
    return count, mean, m2


def global_mean_std(x: torch.Tensor | list[torch.Tensor], group: Group = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std along the last dim of `x` over all ranks' elements (concatenated)."""
    count, mean, m2 = global_moments(x, group)
    return mean, torch.sqrt(m2 / (count - 1))


def minibatch_loss(
    agent: Agent, mb: Batch, adv_mean: torch.Tensor | None, adv_std: torch.Tensor | None, args: Args
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped loss on one minibatch, and the numbers logged as `losses/NAME` (the world's mean: they ride in
    the gradients' allreduce), advantages normalised world-wide."""
    new_log_prob, entropy, new_value = agent.log_prob_entropy_value(mb["obs"], mb["actions"])
    if new_log_prob.shape != mb["log_probs"].shape or new_value.shape != mb["values"].shape:
        fail(
            f"Agent.log_prob_entropy_value gives {tuple(new_log_prob.shape)} log-probabilities and "
            f"{tuple(new_value.shape)} values for a minibatch of {tuple(mb['log_probs'].shape)}: it and "
            "minibatches() must agree on what a minibatch holds"
        )
    logratio = new_log_prob - mb["log_probs"]
    ratio = logratio.exp()
    with torch.no_grad():  # calculate approx_kl http://joschu.net/blog/kl-approx.html
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).to(ratio.dtype).mean()
    advantages = mb["advantages"]
    mb_advantages = advantages if adv_mean is None else (advantages - adv_mean) / (adv_std + 1e-8)
    # Policy loss
    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
    # Value loss
    if args.clip_vloss:
        v_loss_unclipped = (new_value - mb["returns"]) ** 2
        v_clipped = mb["values"] + torch.clamp(new_value - mb["values"], -args.clip_coef, args.clip_coef)
        v_loss_clipped = (v_clipped - mb["returns"]) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((new_value - mb["returns"]) ** 2).mean()
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


def loss_function(args: Args) -> Callable:
    """minibatch_loss, through torch.compile with `--compile` (fixed shapes, unless preempted)."""
    dynamic = None if args.preempt_fraction else False
    return torch.compile(minibatch_loss, fullgraph=True, dynamic=dynamic) if args.compile else minibatch_loss


def minibatch_sizes(sample_counts: list[int], num_minibatches: int) -> torch.Tensor:
    """[ranks, num_minibatches]: the samples each rank gives each world minibatch."""
    counts = torch.tensor(sample_counts)[:, None]
    return counts // num_minibatches + (torch.arange(num_minibatches) < counts % num_minibatches)


def local_minibatches(sizes: torch.Tensor, group: Group = None) -> tuple[list[int], list[float] | None]:
    """This rank's minibatch sizes (its row of `sizes`) and its loss's weight in each minibatch: its
    share of the samples times the ranks, so the ranks' mean is the union's (None: all equal)."""
    local_sizes = sizes[dist.get_rank(group) if dist.is_initialized() else 0]
    weights = (local_sizes.double() * len(sizes) / sizes.sum(0)).tolist()
    return local_sizes.tolist(), None if bool((sizes == sizes[0, 0]).all()) else weights


def minibatches(batch: Batch, order: torch.Tensor, local_sizes: list[int]) -> list[Batch]:
    """One epoch's minibatches of this rank: `batch` in the order `order` (one gather per tensor), cut into pieces
    `local_sizes` long. The one place minibatches are made: a recurrent core takes whole envs' sequences here."""
    shuffled = {key: value[order] for key, value in batch.items()}
    starts = np.cumsum([0, *local_sizes]).tolist()
    return [
        {key: value[start:end] for key, value in shuffled.items()}
        for start, end in zip(starts[:-1], starts[1:], strict=True)
    ]


def average_gradients(parameters: list[nn.Parameter], logged: torch.Tensor, group: Group = None) -> torch.Tensor:
    """The gradient sync, after loss.backward(): every gradient and the `logged` numbers in one flat tensor, one
    allreduce, the world's mean written back into each `.grad`, so every rank takes the same step. Returns the flat
    mean (the gradients, then `logged`); a NaN or inf on any rank reaches every rank, which raises NonFiniteError."""
    gradients = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]  # a parameter the loss skips
    flat = torch.cat([*(gradient.reshape(-1) for gradient in gradients), logged])
    collectives.allreduce_mean(flat, group)
    if not torch.isfinite(flat).all():
        raise NonFiniteError("a non-finite loss or gradient")
    sizes = [p.numel() for p in parameters]
    for parameter, mean in zip(parameters, flat[: sum(sizes)].split(sizes), strict=True):
        parameter.grad = mean.view_as(parameter)
    return flat


def update(
    agent: Agent, optimizer: torch.optim.Optimizer, batch: Batch, args: Args, orders: torch.Tensor,
    sizes: torch.Tensor | None = None, loss_fn: Callable = minibatch_loss, group: Group = None,
) -> tuple[dict[str, float], float]:  # fmt: skip
    """PPO's epochs: minibatch k of epoch e is piece k, `sizes[rank, k]` long, of minibatches(batch, orders[e]); the
    world's is the ranks' union. Returns the world-averaged numbers minibatch_loss logs and the collectives' time."""
    parameters = list(agent.parameters())
    num_weights = sum(p.numel() for p in parameters)
    if sizes is None:
        sizes = minibatch_sizes([orders.shape[1]] * collectives.group_size(group), args.num_minibatches)
    local_sizes, weights = local_minibatches(sizes, group)
    if sum(local_sizes) != orders.shape[1] or min(local_sizes) < 1:
        fail(
            f"this rank's minibatch sizes {local_sizes} do not cut an epoch's order of {orders.shape[1]} into "
            "non-empty pieces: main's orders and minibatch_sizes must count the same things (samples, or whole "
            "envs for minibatches of sequences)"
        )
    sync_time = 0.0
    clipfrac_sum = 0.0
    for epoch in range(args.update_epochs):
        epoch_minibatches = minibatches(batch, orders[epoch], local_sizes)
        adv_mean = adv_std = [None] * args.num_minibatches
        if args.norm_adv:  # every world minibatch's mean and std in one collective per epoch
            start = time.perf_counter()
            advantages = [mb["advantages"] for mb in epoch_minibatches]  # this rank's part of each
            advantages = torch.stack(advantages) if weights is None else advantages
            adv_mean, adv_std = global_mean_std(advantages, group)
            sync_time += time.perf_counter() - start
        for k, mb in enumerate(epoch_minibatches):
            loss, logged = loss_fn(agent, mb, adv_mean[k], adv_std[k], args)
            if weights is not None:  # this rank's share of the world minibatch: the ranks' mean is the union's
                loss = loss * weights[k]
                logged = {name: value * weights[k] for name, value in logged.items()}
            optimizer.zero_grad()
            loss.backward()
            clipfrac_sum = clipfrac_sum + logged["clipfrac"]
            logged["clipfrac"] = clipfrac_sum / (epoch * args.num_minibatches + k + 1)  # over the minibatches so far
            start = time.perf_counter()
            flat = average_gradients(parameters, torch.stack(list(logged.values())), group)
            sync_time += time.perf_counter() - start
            gradients = flat[:num_weights]  # the world's mean, which each .grad views: clipped alike on every rank
            gradients.mul_(torch.clamp(args.max_grad_norm / (gradients.norm() + 1e-6), max=1.0))
            optimizer.step()
            losses = dict(zip(logged, flat[num_weights:], strict=True))
        # the KL is the world's, carried by the last gradient allreduce: every rank stops together
        if args.target_kl is not None and losses["approx_kl"] > args.target_kl:
            break
    return {name: value.item() for name, value in losses.items()}, sync_time


# --- --sync gather: rank 0 runs the update on the union of every rank's batch -------------------------
def gather_to_learner(batch: Batch, orders: torch.Tensor, sizes: torch.Tensor) -> tuple[Batch, torch.Tensor] | None:
    """Rank 0's union of all batches (one gather), with orders giving the world's minibatches."""
    padding = int(sizes.sum(1).max()) - orders.shape[1]  # rows; the orders go as [samples, epochs]
    full = [torch.cat([t, t.new_zeros(padding, *t.shape[1:])]) for t in [*batch.values(), orders.T]]
    gathered = collectives.gather_to_rank0(torch.cat([t.reshape(-1).double() for t in full]))  # [ranks, packed]
    if gathered is None:
        return None
    numels = [t.numel() for t in full]
    ranks = [[p.view_as(t) for p, t in zip(r.split(numels), full, strict=True)] for r in gathered]
    counts = sizes.sum(1).tolist()  # each rank's samples, then where they start in the union
    offsets = [0, *np.cumsum(counts)[:-1].tolist()]
    union = {
        key: torch.cat([rank[i][:n] for rank, n in zip(ranks, counts, strict=True)]).to(value.dtype)
        for i, (key, value) in enumerate(batch.items())
    }
    minibatches = [  # each rank's minibatches: [epochs, size] indices into the union
        (rank[-1][:n].T.long() + offset).split(rank_sizes.tolist(), 1)
        for rank, n, offset, rank_sizes in zip(ranks, counts, offsets, sizes, strict=True)
    ]
    union_orders = torch.cat([rank[k] for k in range(sizes.shape[1]) for rank in minibatches], 1)
    return union, union_orders.to(orders.device)


def update_one_learner(
    agent: Agent, optimizer: torch.optim.Optimizer, batch: Batch, args: Args, orders: torch.Tensor,
    sizes: torch.Tensor, loss_fn: Callable, learner_group: Group,
) -> tuple[dict[str, float], float]:  # fmt: skip
    """Rank 0 runs `update` on the union; one broadcast then gives every rank its weights and whether it met a
    non-finite loss. Returns the losses (rank 0's; no other rank logs them) and the collectives' time."""
    start = time.perf_counter()
    union = gather_to_learner(batch, orders, sizes)
    losses = {}
    nonfinite = batch["returns"].new_zeros(1, dtype=torch.float64)
    learner_start = time.perf_counter()
    if union is not None:
        union_batch, union_orders = union  # the learner's minibatch k is the world's
        world_sizes = sizes.sum(0)[None]
        try:
            losses, _ = update(agent, optimizer, union_batch, args, union_orders, world_sizes, loss_fn, learner_group)
        except NonFiniteError:
            nonfinite[0] = 1.0
    learner_time = time.perf_counter() - learner_start
    collectives.broadcast_parameters(agent, nonfinite)
    if nonfinite[0] > 0:
        raise NonFiniteError("a non-finite loss or gradient")
    return losses, time.perf_counter() - start - learner_time


# --- logging and seeds --------------------------------------------------------------------------------
def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the world's batch (float64; constant: NaN)."""
    _, stds = global_mean_std(torch.stack([returns - values, returns]).double())
    return float("nan") if stds[1] == 0 else (1 - stds[0] ** 2 / stds[1] ** 2).item()


def rank_seed(seed: int, rank: int) -> int:
    """The seed of `rank`'s RNGs (SpinningUp's stride: nearby seeds never collide)."""
    return seed + 10_000 * rank


def env_seeds(seed: int, rank: int, local_num_envs: int, index_offset: int = 0) -> list[int]:
    """Env seeds by global index; a resumed run's `index_offset` (restarts x envs) replays none."""
    return [seed + 10_000 * (index_offset + rank * local_num_envs + j) for j in range(local_num_envs)]


# --- input checks, the batch table, evaluation ---------------------------------------------------------
def args_problem(args: Args) -> str | None:
    """The first flag whose value cannot run, as the message naming the fix; None if all can. A checkpoint's args
    are read by the same rules."""
    if problem := checks.runtime_args_problem(args):
        return problem
    rules = (
        (
            "at least 1",
            lambda value: value >= 1,
            ("total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "update_epochs"),
        ),
        ("at most 65536 (envs per rank)", lambda value: value <= 2**16, ("local_num_envs",)),
        ("at most 10000000 (steps per env and rollout)", lambda value: value <= 10**7, ("num_steps",)),
        ("at most 10000", lambda value: value <= 10**4, ("update_epochs",)),
        ("finite and positive", lambda value: 0 < value < math.inf, ("learning_rate", "max_grad_norm")),
        ("finite and at least 0", lambda value: 0 <= value < math.inf, ("clip_coef", "ent_coef", "vf_coef")),
        ("in [0, 1]", lambda value: 0 <= value <= 1, ("gamma", "gae_lambda")),
    )
    for rule, holds, names in rules:
        for name in names:
            if not holds(getattr(args, name)):  # NaN too
                return f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}"
    if args.target_kl is not None and not 0 < args.target_kl < math.inf:
        return f"--target-kl must be positive (or left out to switch early stopping off), got {args.target_kl}"
    if not (0 <= args.preempt_fraction <= 1 and 0 < args.min_rollout_fraction <= 1):
        return (
            f"--preempt-fraction must lie in [0, 1] (0 = off) and --min-rollout-fraction in (0, 1]; got "
            f"{args.preempt_fraction:g} and {args.min_rollout_fraction:g}"
        )
    return None


def check_env(env_id: str, given: str = "--env-id") -> tuple[int, int]:
    """Refuse an env this script cannot train (Box observations and actions) with the fix; else its sizes (observation,
    action). `given` says where the id comes from; `module:EnvId` imports the module first."""
    try:
        probe = make_env(env_id)()  # with make_env's wrappers, which may change the spaces
    except Exception as error:  # an unknown id or module, or MUJOCO_GL naming a missing renderer
        gl = os.environ.get("MUJOCO_GL")
        renderer = f"; or MUJOCO_GL={gl} names a renderer this machine lacks (unset it, or install it)" if gl else ""
        fail(f"unknown or unusable {given} {env_id!r} ({type(error).__name__}: {error}){renderer}")
    probe.close()
    for kind, space in (("actions", probe.action_space), ("observations", probe.observation_space)):
        if not isinstance(space, gym.spaces.Box):
            fail(f"{given} {env_id} has {type(space).__name__} {kind}; {SCRIPT} needs Box {kind}")
    return int(np.prod(probe.observation_space.shape)), int(np.prod(probe.action_space.shape))


def batch_table(args: Args) -> list[tuple[str, object, object]]:
    """What rank 0 prints before training: (name, per rank, world)."""
    return [
        ("ranks", "", args.world_size),
        ("envs", args.local_num_envs, args.world_size * args.local_num_envs),
        ("batch", args.local_batch_size, args.batch_size),
        ("minibatch", args.local_minibatch_size, args.minibatch_size),
        ("iterations", "", args.num_iterations),
        ("total env steps", "", args.num_iterations * args.batch_size),
    ]


def evaluate(agent: Agent, env_id: str, args: Args, video_folder: str | None = None) -> list[float]:
    """Play `args.eval_episodes` whole episodes with one env; returns the raw env returns."""
    env = make_env(env_id, video_folder)()
    obs_mean, obs_std = agent.obs_rms.frozen()
    policy = agent.rollout_policy(args.numpy_rollout)
    returns = []
    episode_return = 0.0
    obs, _ = env.reset(seed=args.seed)
    while len(returns) < args.eval_episodes:
        action, _, _ = policy.act(normalize_obs(obs.reshape(1, -1), obs_mean, obs_std), args.eval_deterministic)
        action = np.clip(action[0], env.action_space.low, env.action_space.high)
        obs, reward, terminated, truncated, _ = env.step(action)
        episode_return += float(reward)
        if terminated or truncated:
            returns.append(episode_return)
            episode_return = 0.0
            obs, _ = env.reset()
    env.close()
    return returns


def evaluate_checkpoint(args: Args, run: launching.Run) -> None:
    """`--eval-checkpoint`: play a model file (or training checkpoint) on rank 0 and print one `eval:` line."""
    path = args.eval_checkpoint
    model, _ = checkpoints.read_model(path, Args, args_problem, args.env_id)
    env_id = model["env_id"]
    obs_dim, action_dim = check_env(env_id, f"the env_id of {path}")
    checks.check_video_support(args.capture_video, lambda: env_support.render_one_frame(env_id))
    if run.rank != 0:
        return
    agent = Agent(obs_dim, action_dim)
    checkpoints.load_weights(agent, path, model)
    np.random.seed(args.seed)  # sampling, like the env, follows --seed: repeatable evaluations
    video_folder = os.path.join(os.path.dirname(path), "videos") if args.capture_video else None
    returns = evaluate(agent, env_id, args, video_folder)
    print(f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} return_std={np.std(returns):.2f}")


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    # every flag checked before anything is launched or written; --nprocs N: this command again as N ranks, then exit
    run = launching.launch(args, __file__, "iteration", args_problem)
    env_support.silence_settotalmass_warning()  # before any env exists, for the input checks and evaluation too
    if args.eval_checkpoint is not None:
        return evaluate_checkpoint(args, run)
    obs_dim, action_dim = check_env(args.env_id)
    checks.check_video_support(args.capture_video, lambda: env_support.render_one_frame(args.env_id))
    derive_batch_sizes(args, run.world_size)
    # the process group, and a checkpoint to resume (checked like the flags)
    memory = rollout_memory(args, obs_dim, action_dim)
    launching.start_run(run, args.batch_size, args.num_iterations, batch_table(args), args_problem, memory)
    device = run.device

    # --- set-up: envs, initial weights (from `seed`, broadcast to every rank), the rank's seeds ---
    thunks = [make_env(args.env_id) for _ in range(args.local_num_envs)]
    envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    action_space = envs.single_action_space
    torch.manual_seed(args.seed)
    agent = Agent(obs_dim, action_dim).to(device)
    collectives.broadcast_parameters(agent)
    probe = numpy_rollout.probe(agent.rollout_policy(args.numpy_rollout), obs_dim, device)
    check_rollout_policy(agent, probe, "at start")
    random.seed(rank_seed(args.seed, run.rank))
    np.random.seed(rank_seed(args.seed, run.rank))
    torch.manual_seed(rank_seed(args.seed, run.rank))
    torch.backends.cudnn.deterministic = args.torch_deterministic
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    loss_fn = loss_function(args)
    # a resumed checkpoint's weights, optimizer state and random streams; then the run folder
    iteration, global_step = checkpoints.resume(run, model=agent, optimizer=optimizer)
    learner_group = dist.new_group([0]) if args.sync == "gather" else None  # rank 0 learning alone

    # rollout storage: numpy, a row per step of the local envs, moved to `device` once per iteration
    shape = (args.num_steps, args.local_num_envs)
    raw_obs = np.zeros(shape + (obs_dim,))  # unnormalised, for the statistics
    obs = np.zeros(shape + (obs_dim,), dtype=np.float32)  # normalised, as the agent saw them
    actions = np.zeros(shape + (action_dim,), dtype=np.float32)
    logprobs = np.zeros(shape, dtype=np.float32)
    values = np.zeros(shape, dtype=np.float32)
    rewards = np.zeros(shape, dtype=np.float32)
    terminations = np.zeros(shape, dtype=np.float32)
    episode_ends = np.zeros(shape, dtype=np.float32)  # terminated or truncated
    final_values = np.zeros(shape, dtype=np.float32)  # V(final observation) where an episode was truncated
    discounted_returns = np.zeros(shape)  # the running return whose std scales the rewards
    index_offset = run.restarts * args.world_size * args.local_num_envs  # resumed: new env seeds
    next_obs, _ = envs.reset(seed=env_seeds(args.seed, run.rank, args.local_num_envs, index_offset))
    episode_return = np.zeros(args.local_num_envs)
    episode_length = np.zeros(args.local_num_envs)
    discounted_return = np.zeros(args.local_num_envs)

    stopping = False
    try:
        while global_step < run.total_steps:  # the world's env steps: a preempted rollout collects fewer
            iteration += 1
            if args.anneal_lr:  # linearly to zero over the run's env steps
                frac = 1.0 - global_step / run.total_steps
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # --- rollout (normalisation statistics frozen, so every rank normalises alike) ---
            rollout_start = time.perf_counter()
            obs_mean, obs_std = agent.obs_rms.frozen()
            policy = agent.rollout_policy(args.numpy_rollout)
            finished = {"episodes": 0, "episode_return": 0.0, "episode_length": 0}  # for the log
            collected = args.num_steps  # steps per env: all, unless preemption cuts the rollout short
            for step in range(args.num_steps):
                if preemption.rollout_preempted(run, iteration, step):  # DD-PPO: most ranks are done
                    collected = step
                    break
                raw_obs[step] = next_obs.reshape(args.local_num_envs, -1)
                obs[step] = normalize_obs(raw_obs[step], obs_mean, obs_std)
                actions[step], logprobs[step], values[step] = policy.act(obs[step])
                clipped_action = np.clip(actions[step], action_space.low, action_space.high)
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
                        final_obs = np.stack(info["final_obs"][cut]).reshape(cut.sum(), -1)
                        final_values[step, cut] = policy.value(normalize_obs(final_obs, obs_mean, obs_std))
            preemption.rollout_finished(run, iteration)
            rows = slice(collected)  # the rollout's rows
            last_obs = normalize_obs(next_obs.reshape(args.local_num_envs, -1), obs_mean, obs_std)
            last_values = policy.value(last_obs)
            rollout_time = time.perf_counter() - rollout_start
            sample_counts = [args.local_batch_size] * args.world_size  # each rank's samples
            if args.preempt_fraction:  # one all_gather
                sample_counts = collectives.gather_ints_to_all([collected * args.local_num_envs], device)[:, 0].tolist()
            global_step += sum(sample_counts)

            # --- normalisation statistics: merged over all ranks' rollouts in one collective ---
            data = [raw_obs[rows].reshape(-1, obs_dim).T, discounted_returns[rows].reshape(1, -1)]
            count, mean, m2 = global_moments(torch.as_tensor(np.concatenate(data), device=device))
            agent.obs_rms.update(count[0], mean[:obs_dim], m2[:obs_dim])
            agent.return_rms.update(count[obs_dim], mean[obs_dim], m2[obs_dim])
            # from here on the rewards are scaled, with statistics that include this rollout
            reward_scale = math.sqrt(agent.return_rms.var.item() + NORM_EPS)
            rewards[rows] = np.clip(rewards[rows] / reward_scale, -NORM_CLIP, NORM_CLIP)

            # --- GAE: bootstrap from the next row's value, or V(final observation) at an end ---
            next_values = np.concatenate([values[rows][1:], last_values[None]])  # cut rollouts too
            next_values = np.where(episode_ends[rows] > 0, final_values[rows], next_values)
            advantages, returns = compute_gae(
                rewards[rows], values[rows], next_values, terminations[rows], episode_ends[rows],
                args.gamma, args.gae_lambda,
            )  # fmt: skip
            final_values[:] = 0.0
            batch = {
                "obs": obs[rows].reshape(-1, obs_dim),
                "actions": actions[rows].reshape(-1, action_dim),
                "log_probs": logprobs[rows].reshape(-1),
                "values": values[rows].reshape(-1),
                "advantages": advantages.reshape(-1),
                "returns": returns.reshape(-1),
            }
            batch = {k: torch.as_tensor(v, dtype=torch.float32, device=device) for k, v in batch.items()}
            check_rollout_policy(agent, batch, f"at iteration {iteration}")  # the first ratios are 1

            # --- update ---
            update_start = time.perf_counter()
            orders = torch.stack([torch.randperm(returns.size, device=device) for _ in range(args.update_epochs)])
            sizes = minibatch_sizes(sample_counts, args.num_minibatches)
            if args.sync == "allreduce":
                losses, sync_time = update(agent, optimizer, batch, args, orders, sizes, loss_fn)
            else:  # the same update, by rank 0 alone on the union of every rank's batch
                losses, sync_time = update_one_learner(
                    agent, optimizer, batch, args, orders, sizes, loss_fn, learner_group
                )
            update_time = time.perf_counter() - update_start

            # --- logging: episodes ended on any rank, world-averaged losses, explained variance ---
            totals = collectives.sum_over_ranks(device, **finished, stops=float(bool(run.stop_requested)))
            scalars = {"charts/learning_rate": optimizer.param_groups[0]["lr"]}
            scalars |= {f"losses/{name}": value for name, value in losses.items()}
            scalars["losses/explained_variance"] = explained_variance(batch["returns"], batch["values"])
            perf = {"rollout_time": rollout_time, "update_time": update_time, "sync_time": sync_time}
            scalars |= {f"perf/{k}": v for k, v in perf.items()}
            progress.log_iteration(run, iteration, global_step, totals, scalars)

            # --- checkpoint and stop: SIGTERM or Ctrl-C on any rank stops every rank after this iteration ---
            if args.check_sync_every and (iteration - 1) % args.check_sync_every == 0:  # an edit that broke the sync
                checks.check_weights_in_sync(agent, iteration)
            stopping = totals["stops"] > 0
            if stopping or args.checkpoint_every and iteration % args.checkpoint_every == 0:
                checkpoints.save(run, iteration, global_step, model=agent, optimizer=optimizer)
            if stopping:
                break
        envs.close()
        progress.finish(
            run, agent, iteration, global_step, stopping, lambda folder: evaluate(agent, args.env_id, args, folder)
        )
    except (NonFiniteError, RuntimeError) as error:  # found alike on every rank: one line, never a hang
        progress.stop_training(
            run, iteration, error, "lower --learning-rate or check the env's observations and rewards"
        )
    return agent


if __name__ == "__main__":
    main(tyro.cli(Args))
