"""Vanilla policy gradient (VPG) with GAE-lambda, data-parallel over any number of processes.

SpinningUp's VPG in one file: separate policy and value MLPs, GAE-lambda advantages, one
policy-gradient step and `--train-v-iters` value steps per epoch. The policy is a Gaussian with a
state-independent log-std for Box actions, a Categorical for Discrete ones. It trains CartPole-v1
and the MuJoCo tasks (HalfCheetah-v5...). README.md shows every launcher and how to evaluate.

    torchrun --standalone --nproc_per_node=2 vpg_mpi.py --env-id CartPole-v1

Distributed story: `--steps-per-epoch` is global and split evenly across ranks. Each rank steps its
own envs and computes GAE on its share; advantages are normalised with the world-wide mean and std.
`--sync allreduce` (default) averages the gradients in one flat allreduce per optimizer step, so
every rank takes the step one process would take on the concatenated batch. `--sync gather` (one
learner) gathers the rollouts to rank 0, which updates alone and broadcasts the weights. An epoch is
one iteration of the ddrl runtime, the package beside this file (checkpoints `iter_{epoch:06d}.safetensors`).

SpinningUp's defaults: PyTorch's initialisation, a log-std starting at -0.5, hidden sizes (64, 64)
(its benchmark's net is (64, 32)), advantages normalised by the population std (+ 1e-8, so that a
constant batch cannot divide by zero). Unlike it, a sampled Box action is clipped to the space
before the env sees it, which raises MuJoCo returns (docs/differences.md).
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

from ddrl import checkpoints, checks, collectives, env_support, launching, numpy_rollout, progress
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
    """if toggled, rank 0 writes `runs/{run_name}/model.safetensors` at the end of training"""
    eval_checkpoint: str | None = None
    """if set, load this model file (or a training checkpoint), play `--eval-episodes` episodes on rank 0 and exit"""
    eval_episodes: int = 10
    """episodes played by `--eval-checkpoint` and after training with `--capture-video`"""
    eval_deterministic: bool = False
    """if toggled, evaluation takes the policy's mode instead of sampling"""
    numpy_rollout: bool = True
    """if toggled, the rollout runs numpy copies of the Agent's networks (fast), else the modules"""

    # Algorithm specific arguments (names as in SpinningUp)
    env_id: str = "HalfCheetah-v5"
    """the id of the gymnasium environment (Box or Discrete actions)"""
    total_timesteps: int = 200_000
    """global env steps over all ranks; sets the number of epochs"""
    steps_per_epoch: int = 4000
    """global env steps per epoch, split evenly across ranks"""
    local_num_envs: int = 1
    """envs stepped by each rank (the local epoch share is split evenly across them)"""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """hidden layer sizes of the policy and value MLPs (tanh)"""
    gamma: float = 0.99
    """the discount factor"""
    lam: float = 0.97
    """the GAE lambda"""
    pi_lr: float = 3e-4
    """policy learning rate (Adam)"""
    vf_lr: float = 1e-3
    """value-function learning rate (Adam)"""
    train_v_iters: int = 80
    """value-function gradient steps per epoch"""
    max_ep_len: int = 1000
    """episodes are cut (and bootstrapped) after this many steps"""
    sync: Literal["allreduce", "gather"] = "allreduce"
    """allreduce: average the gradients; gather: rank 0 learns on all rollouts, sends the weights"""

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
    local_steps_per_epoch: int = 0
    """env steps per epoch on one rank (computed at run time)"""
    num_steps: int = 0
    """env steps per epoch of one env (computed at run time)"""
    num_epochs: int = 0
    """number of epochs: total_timesteps // steps_per_epoch (computed at run time)"""


# a rollout's tensors by name: obs, actions, log_probs, values, advantages, returns
Batch = dict[str, torch.Tensor]
Group = dist.ProcessGroup | None  # None: the world


# --- batch arithmetic ---------------------------------------------------------------------------------
def derive_batch_sizes(args: Args, world_size: int) -> None:
    """Each rank's and each env's share of the global epoch, and the number of epochs. Uneven shares
    or zero epochs stop the run here."""
    args.world_size = world_size
    args.local_steps_per_epoch = args.steps_per_epoch // world_size
    args.num_steps = args.local_steps_per_epoch // args.local_num_envs
    fix = f"use a --steps-per-epoch that is a multiple of {world_size * args.local_num_envs}"
    if args.steps_per_epoch % world_size:
        uneven = f"--steps-per-epoch {args.steps_per_epoch} does not split evenly"
        fail(f"{uneven} across {world_size} ranks; {fix}")
    if args.local_steps_per_epoch % args.local_num_envs:
        local = f"the local epoch of {args.local_steps_per_epoch} steps"
        fail(f"{local} does not split across --local-num-envs {args.local_num_envs}; {fix}")
    args.num_epochs = args.total_timesteps // args.steps_per_epoch
    if args.num_epochs < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one epoch of --steps-per-epoch "
            f"{args.steps_per_epoch}: zero epochs to train; raise --total-timesteps"
        )


ENV_MEMORY = 4 * 2**20  # bytes one env takes, at most (MuJoCo's Humanoid-v5: 2.5 MiB)
SIZED_BY = "--steps-per-epoch (split over the ranks) or --hidden-sizes"


def rollout_memory(args: Args, obs_dim: int, action_dim: int) -> tuple[int, str]:
    """What one rank holds for an epoch, in bytes, and the flags that size it: the rollout's numpy storage and the
    two networks' activations on the whole batch, forward and backward, per sample; and its envs."""
    per_sample = 4 * obs_dim + 4 * action_dim + 32 + 2 * 3 * 4 * sum(args.hidden_sizes)
    return args.local_steps_per_epoch * per_sample + args.local_num_envs * ENV_MEMORY, SIZED_BY


# --- environment, agent -------------------------------------------------------------------------------
def make_env(env_id: str, max_ep_len: int, video_folder: str | None = None) -> Callable[[], gym.Env]:
    """A thunk building one env. `max_ep_len` becomes a time limit: a cut episode is truncated."""

    def thunk() -> gym.Env:
        env_support.silence_settotalmass_warning()
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
        return gym.wrappers.TimeLimit(env, max_episode_steps=max_ep_len)

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


LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class GaussianActions:
    """The policy's action distribution at some observations, for Box actions: a Gaussian per action dimension. The
    rollout samples it on numpy rows; the update scores given actions on torch tensors. Both are written here."""

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
        noise = (actions - self.mean) / self.log_std.exp()
        log_prob = (-0.5 * noise**2 - self.log_std - LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + LOG_SQRT_2PI + self.log_std).sum(-1).expand(len(actions))
        return log_prob, entropy


class CategoricalActions:
    """The policy's action distribution at some observations, for Discrete actions: a softmax of `logits`. The rollout
    samples it on numpy rows; the update scores given actions on torch tensors. Both are written here."""

    def __init__(self, logits):
        self.logits = logits

    def sample(self, deterministic: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Actions (the likeliest if `deterministic`) and their log-probabilities, from numpy's seeded generator."""
        shifted = self.logits - self.logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # log_softmax
        if deterministic:
            actions = log_probs.argmax(-1)
        else:  # inverse CDF: the first action whose cumulative probability reaches a draw
            uniform = np.random.random_sample((len(log_probs), 1))
            below = (np.exp(log_probs).cumsum(-1) < uniform).sum(-1)
            actions = np.minimum(below, log_probs.shape[-1] - 1)
        return actions, np.take_along_axis(log_probs, actions[:, None], -1)[:, 0]

    def log_prob_entropy(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probability of `actions` and the distribution's entropy, per row."""
        log_probs = torch.log_softmax(self.logits, dim=-1)
        log_prob = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        return log_prob, -(log_probs.exp() * log_probs).sum(-1)


class Agent(nn.Module):
    """Separate policy and value MLPs (as SpinningUp's MLPActorCritic): the one definition of what the policy and the
    value compute. `policy` and `value` run on torch tensors in the update and on numpy rows in the rollout."""

    def __init__(self, obs_dim: int, action_space: gym.Space, hidden_sizes: tuple[int, ...]):
        super().__init__()
        self.continuous = isinstance(action_space, gym.spaces.Box)
        num_outputs = int(np.prod(action_space.shape)) if self.continuous else int(action_space.n)
        self.actor = mlp(obs_dim, hidden_sizes, num_outputs)
        self.critic = mlp(obs_dim, hidden_sizes, 1)
        if self.continuous:  # a state-independent log-std, as SpinningUp's
            self.log_std = nn.Parameter(torch.full((num_outputs,), -0.5))

    def policy(self, obs) -> GaussianActions | CategoricalActions:
        """The action distribution at `obs`."""
        out = self.actor(obs)
        return GaussianActions(out, self.log_std) if self.continuous else CategoricalActions(out)

    def value(self, obs) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def log_prob_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The update's view: the log-probability of `actions` and the policy's entropy at `obs`."""
        return self.policy(obs).log_prob_entropy(actions)

    def policy_parameters(self) -> list[nn.Parameter]:
        """All parameters but the critic's: what the policy step trains. A module added on the
        actor's side joins by itself."""
        return [p for name, p in self.named_parameters() if not name.startswith("critic.")]

    def rollout_policy(self, numpy_layers: bool = True) -> numpy_rollout.NumpyPolicy:
        """This Agent's own `policy` and `value` on numpy copies of its modules, as they are now, for a rollout (which
        never changes them); without `numpy_layers`, its torch modules on the rows."""
        return numpy_rollout.NumpyPolicy(self, numpy_layers)


# --- the rollout (numpy copies of the Agent's networks), checked against the Agent --------------------
def check_rollout_policy(agent: Agent, batch: Batch, when: str) -> None:
    """Stop unless Agent.log_prob_entropy and Agent.value agree with the rollout's numbers."""
    obs = batch["obs"][: numpy_rollout.PROBE_SAMPLES]
    actions = batch["actions"][: numpy_rollout.PROBE_SAMPLES]
    log_probs = batch["log_probs"][: numpy_rollout.PROBE_SAMPLES]
    values = batch["values"][: numpy_rollout.PROBE_SAMPLES]
    with torch.no_grad():
        agent_log_probs = agent.log_prob_entropy(obs, actions)[0]
        agent_values = agent.value(obs)
        distribution = type(agent.policy(obs)).__name__  # Gaussian- or CategoricalActions, or an edit's class
    pairs = {"log-probabilities": (agent_log_probs, log_probs), "values": (agent_values, values)}
    sampling = f"{distribution}.sample (on numpy copies of the Agent's networks)"
    checks.check_agreement(when, f"{sampling} and {distribution}.log_prob_entropy", **pairs)


# --- GAE ----------------------------------------------------------------------------------------------
def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminations: np.ndarray,
    episode_ends: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE-lambda advantages and discounted rewards-to-go (the value targets) for arrays [T, envs].
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


# --- gradient sync and the update ---------------------------------------------------------------------
def global_mean_std(x: torch.Tensor, group: Group = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std (SpinningUp's) along the last dim of `x`, over the elements of all
    ranks as if concatenated."""
    local_mean = x.mean(-1)
    local_m2 = ((x - local_mean.unsqueeze(-1)) ** 2).sum(-1)
    local = torch.stack([torch.full_like(local_mean, x.shape[-1]), local_mean, local_m2])
    count, mean, m2 = local
    if collectives.group_size(group) > 1:
        count_i, mean_i, m2_i = collectives.gather_to_all(local, group).transpose(0, 1)  # each [ranks, rows...]
        count = count_i.sum(0)
        mean = (count_i * mean_i).sum(0) / count
        m2 = (m2_i + count_i * (mean_i - mean) ** 2).sum(0)
    return mean, torch.sqrt(m2 / count)


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
    agent: Agent,
    pi_optimizer: torch.optim.Optimizer,
    vf_optimizer: torch.optim.Optimizer,
    batch: Batch,
    args: Args,
    group: Group = None,
) -> tuple[dict[str, float], float]:
    """One VPG epoch on this rank's batch, gradients averaged over `group`: the policy step, then the value steps. Each
    step's loss rides in its gradients' allreduce, so a non-finite one stops every rank before that step, not earlier
    ones. Returns the group-averaged losses (the first value loss) by name and the seconds in collectives."""
    obs = batch["obs"]
    actions = batch["actions"]
    returns = batch["returns"]
    adv_mean, adv_std = global_mean_std(batch["advantages"], group)
    advantages = (batch["advantages"] - adv_mean) / (adv_std + 1e-8)
    sync_time = 0.0

    # one policy-gradient step
    log_prob, entropy = agent.log_prob_entropy(obs, actions)
    policy_loss = -(log_prob * advantages).mean()
    pi_optimizer.zero_grad()
    policy_loss.backward()
    start = time.perf_counter()
    average_gradients(agent.policy_parameters(), policy_loss.detach().reshape(1), group)
    sync_time += time.perf_counter() - start
    pi_optimizer.step()

    # value regression on the rewards-to-go
    value_parameters = list(agent.critic.parameters())
    for i in range(args.train_v_iters):
        value_loss = ((agent.value(obs) - returns) ** 2).mean()
        if i == 0:
            first_value_loss = value_loss.detach()
        vf_optimizer.zero_grad()
        value_loss.backward()
        start = time.perf_counter()
        average_gradients(value_parameters, value_loss.detach().reshape(1), group)
        sync_time += time.perf_counter() - start
        vf_optimizer.step()

    with torch.no_grad():  # logged as losses/NAME, the group's mean
        new_log_prob, _ = agent.log_prob_entropy(obs, actions)
        logged = {
            "policy_loss": policy_loss.detach(),
            "value_loss": first_value_loss,
            "entropy": entropy.mean(),
            "approx_kl": (batch["log_probs"] - new_log_prob).mean(),
        }
    world = collectives.allreduce_mean(torch.stack(list(logged.values())).double(), group)
    return dict(zip(logged, world.tolist(), strict=True)), sync_time


# --- --sync gather: rank 0 runs the update on the union of every rank's batch -------------------------
def gather_to_learner(batch: Batch) -> Batch | None:
    """Every rank's batch on rank 0 (one gather), as their union in rank order; None elsewhere."""
    packed = torch.cat([value.reshape(-1).double() for value in batch.values()])
    gathered = collectives.gather_to_rank0(packed)  # [ranks, packed] on rank 0
    if gathered is None:
        return None
    sizes = [value.numel() for value in batch.values()]
    union = gathered.split(sizes, 1)  # per field: [ranks, its elements]
    return {
        key: part.reshape(-1, *value.shape[1:]).to(value.dtype)
        for (key, value), part in zip(batch.items(), union, strict=True)
    }


def update_one_learner(
    agent: Agent,
    pi_optimizer: torch.optim.Optimizer,
    vf_optimizer: torch.optim.Optimizer,
    batch: Batch,
    args: Args,
    learner_group: Group,
) -> tuple[dict[str, float], float]:
    """Rank 0 runs `update` on the union of the ranks' batches in `learner_group` (a group of one). Then one broadcast
    gives every rank its weights and whether rank 0 met a non-finite loss. Returns the losses (rank 0's; no other
    rank logs them) and the seconds of the gather and the broadcast."""
    start = time.perf_counter()
    union = gather_to_learner(batch)
    losses = {}
    nonfinite = torch.zeros(1, dtype=torch.float64, device=batch["returns"].device)
    learner_start = time.perf_counter()
    if union is not None:
        try:  # the learner's batch is the world's
            losses, _ = update(agent, pi_optimizer, vf_optimizer, union, args, learner_group)
        except NonFiniteError:
            nonfinite[0] = 1.0
    learner_time = time.perf_counter() - learner_start
    collectives.broadcast_parameters(agent, nonfinite)
    if nonfinite[0] > 0:
        raise NonFiniteError("a non-finite loss or gradient")
    return losses, time.perf_counter() - start - learner_time


# --- logging and seeds --------------------------------------------------------------------------------
def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the world's batch, in float64 (one collective).
    NaN where the returns are constant."""
    _, stds = global_mean_std(torch.stack([returns - values, returns]).double())
    return float("nan") if stds[1] == 0 else (1 - stds[0] ** 2 / stds[1] ** 2).item()


def rank_seed(seed: int, rank: int) -> int:
    """Seed of python, numpy and action sampling on `rank`. SpinningUp's stride keeps nearby seeds
    from colliding."""
    return seed + 10_000 * rank


def env_seeds(seed: int, rank: int, local_num_envs: int, index_offset: int = 0) -> list[int]:
    """Seeds of this rank's envs: env j of rank r has the global index
    g = index_offset + r * local_num_envs + j. A resumed run passes `index_offset` = restarts x the
    world's envs, so its fresh episodes never replay a seed."""
    first = index_offset + rank * local_num_envs  # the global index of this rank's env 0
    return [seed + 10_000 * (first + j) for j in range(local_num_envs)]


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
            ("total_timesteps", "steps_per_epoch", "local_num_envs", "train_v_iters", "max_ep_len"),
        ),
        ("at most 65536 (envs per rank)", lambda value: value <= 2**16, ("local_num_envs",)),
        ("at most 1000000000", lambda value: value <= 10**9, ("steps_per_epoch",)),
        ("at most 100000", lambda value: value <= 10**5, ("train_v_iters",)),
        ("finite and positive", lambda value: 0 < value < math.inf, ("pi_lr", "vf_lr")),
        ("in [0, 1]", lambda value: 0 <= value <= 1, ("gamma", "lam")),
    )
    for rule, holds, names in rules:
        for name in names:
            if not holds(getattr(args, name)):  # NaN too
                return f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}"
    sizes = " ".join(map(str, args.hidden_sizes))
    if not all(size >= 1 for size in args.hidden_sizes):
        return f"--hidden-sizes must be at least 1 each, got {sizes}"
    # at least the layers' weights between one input and one output, twice (policy and value), each with its
    # gradient and Adam's two moments: 16 bytes
    layers = zip((1, *args.hidden_sizes), (*args.hidden_sizes, 1), strict=True)
    weights = 2 * sum(inputs * outputs for inputs, outputs in layers)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 16 * weights > memory:
        return (
            f"--hidden-sizes {sizes} make networks of {weights:.3g} weights, which need {16 * weights / 2**30:.3g} GiB "
            f"to train, more than this machine's {memory / 2**30:.3g} GiB: choose smaller layers"
        )
    return None


def check_env(env_id: str, given: str = "--env-id") -> tuple[int, gym.Space]:
    """Refuse an env this script cannot train (Box observations; Box or Discrete actions) with the fix; else its
    observation size and action space. `given` says where the id comes from; `module:EnvId` imports the module first."""
    try:
        probe = make_env(env_id, max_ep_len=1)()  # with make_env's wrappers, which may change the spaces
    except Exception as error:  # unknown id or module, or MUJOCO_GL's renderer failing to load
        gl = os.environ.get("MUJOCO_GL")
        lacks = f"; or MUJOCO_GL={gl} names a renderer this machine lacks (unset it, or install it)"
        renderer = lacks if gl else ""
        reason = f"{type(error).__name__}: {error}"
        fail(f"unknown or unusable {given} {env_id!r} ({reason}){renderer}")
    action_space = probe.action_space
    observation_space = probe.observation_space
    probe.close()
    if not isinstance(action_space, gym.spaces.Box | gym.spaces.Discrete):
        kind = type(action_space).__name__
        fail(f"{given} {env_id} has {kind} actions; {SCRIPT} trains Box or Discrete action spaces")
    if not isinstance(observation_space, gym.spaces.Box):
        kind = type(observation_space).__name__
        fail(f"{given} {env_id} has {kind} observations; {SCRIPT} needs a Box space")
    return int(np.prod(observation_space.shape)), action_space


def batch_table(args: Args) -> list[tuple[str, object, object]]:
    """What rank 0 prints before training: (name, per rank, world)."""
    return [
        ("ranks", args.world_size, ""),
        ("envs", args.local_num_envs, args.world_size * args.local_num_envs),
        ("steps per epoch", args.local_steps_per_epoch, args.steps_per_epoch),
        ("epochs", "", args.num_epochs),
        ("total env steps", "", args.num_epochs * args.steps_per_epoch),
    ]


def evaluate(agent: Agent, env_id: str, args: Args, video_folder: str | None = None) -> list[float]:
    """Play `args.eval_episodes` whole episodes with one env and return their returns."""
    env = make_env(env_id, args.max_ep_len, video_folder)()
    policy = agent.rollout_policy(args.numpy_rollout)
    returns = []
    obs, _ = env.reset(seed=args.seed)
    episode_return = 0.0
    while len(returns) < args.eval_episodes:
        action, _, _ = policy.act(obs.reshape(1, -1).astype(np.float32), args.eval_deterministic)
        action = action[0]
        if agent.continuous:
            action = np.clip(action, env.action_space.low, env.action_space.high)
        obs, reward, terminated, truncated, _ = env.step(action)
        episode_return += float(reward)
        if terminated or truncated:
            returns.append(episode_return)
            episode_return = 0.0
            obs, _ = env.reset()
    env.close()
    return returns


def evaluate_checkpoint(args: Args, run: launching.Run) -> None:
    """`--eval-checkpoint`: play a model file (or training checkpoint) on rank 0, with the network and episode length
    it was trained with, and print one `eval:` line."""
    path = args.eval_checkpoint
    model, saved = checkpoints.read_model(path, Args, args_problem, args.env_id)  # its network sizes, episode length
    env_id = model["env_id"]
    obs_dim, action_space = check_env(env_id, f"the env_id of {path}")
    checks.check_video_support(args.capture_video, lambda: env_support.render_one_frame(env_id))
    if run.rank != 0:
        return
    agent = Agent(obs_dim, action_space, tuple(saved.hidden_sizes))
    checkpoints.load_weights(agent, path, model)
    args.max_ep_len = saved.max_ep_len
    # the rollout policy's sampling, like the env, follows --seed: repeatable evaluations
    np.random.seed(args.seed)
    video_folder = os.path.join(os.path.dirname(path), "videos") if args.capture_video else None
    returns = evaluate(agent, env_id, args, video_folder)
    print(f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} return_std={np.std(returns):.2f}")


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    # every flag checked before anything is launched or written; --nprocs N: this command again as N ranks, then exit
    run = launching.launch(args, __file__, "epoch", args_problem)
    env_support.silence_settotalmass_warning()  # before any env: the input checks' probe and evaluation too
    if args.eval_checkpoint is not None:
        return evaluate_checkpoint(args, run)
    obs_dim, action_space = check_env(args.env_id)
    checks.check_video_support(args.capture_video, lambda: env_support.render_one_frame(args.env_id))
    derive_batch_sizes(args, run.world_size)
    # the process group, and a checkpoint to resume (checked like the flags)
    memory = rollout_memory(args, obs_dim, int(np.prod(action_space.shape)) or 1)
    launching.start_run(run, args.steps_per_epoch, args.num_epochs, batch_table(args), args_problem, memory)
    device = run.device

    # --- set-up: envs, identical weights on every rank (from `seed`, broadcast), rank seeds ---
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.max_ep_len) for _ in range(args.local_num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    torch.manual_seed(args.seed)
    agent = Agent(obs_dim, action_space, args.hidden_sizes).to(device)
    collectives.broadcast_parameters(agent)
    probe = numpy_rollout.probe(agent.rollout_policy(args.numpy_rollout), obs_dim, device)
    check_rollout_policy(agent, probe, "at start")
    random.seed(rank_seed(args.seed, run.rank))
    np.random.seed(rank_seed(args.seed, run.rank))
    torch.manual_seed(rank_seed(args.seed, run.rank))
    torch.backends.cudnn.deterministic = args.torch_deterministic
    pi_optimizer = torch.optim.Adam(agent.policy_parameters(), lr=args.pi_lr)
    vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=args.vf_lr)
    # a resumed checkpoint's weights, optimizer states and random streams; then the run folder
    epoch, global_step = checkpoints.resume(run, model=agent, pi_optimizer=pi_optimizer, vf_optimizer=vf_optimizer)
    learner_group = dist.new_group([0]) if args.sync == "gather" else None  # rank 0 learning alone

    # rollout storage (numpy, one row per step of the local envs; moved to `device` once per epoch)
    shape = (args.num_steps, args.local_num_envs)
    obs = np.zeros(shape + (obs_dim,), dtype=np.float32)
    actions = np.zeros(shape + action_space.shape, dtype=np.float32)
    logprobs = np.zeros(shape, dtype=np.float32)
    values = np.zeros(shape, dtype=np.float32)
    rewards = np.zeros(shape, dtype=np.float32)
    terminations = np.zeros(shape, dtype=np.float32)
    episode_ends = np.zeros(shape, dtype=np.float32)  # terminated or truncated
    final_values = np.zeros(shape, dtype=np.float32)  # V(final observation) where an episode was truncated

    # a resumed run starts fresh episodes, on envs seeded after all the earlier attempts' envs
    index_offset = run.restarts * args.world_size * args.local_num_envs
    next_obs, _ = envs.reset(seed=env_seeds(args.seed, run.rank, args.local_num_envs, index_offset))
    episode_return = np.zeros(args.local_num_envs)
    episode_length = np.zeros(args.local_num_envs, dtype=np.int64)

    stopping = False
    try:
        while global_step < run.total_steps:  # the world's env steps
            epoch += 1

            # --- rollout ---
            rollout_start = time.perf_counter()
            policy = agent.rollout_policy(args.numpy_rollout)
            # summed over ranks for the log
            finished = {"episodes": 0, "episode_return": 0.0, "episode_length": 0}
            for step in range(args.num_steps):
                obs[step] = next_obs.reshape(args.local_num_envs, -1)
                action, logprobs[step], values[step] = policy.act(obs[step])
                actions[step] = action
                if agent.continuous:
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
                        final_obs = np.stack(info["final_obs"][cut]).reshape(cut.sum(), -1)
                        final_values[step, cut] = policy.value(final_obs.astype(np.float32))
            global_step += args.steps_per_epoch
            last_values = policy.value(next_obs.reshape(args.local_num_envs, -1).astype(np.float32))
            rollout_time = time.perf_counter() - rollout_start

            # --- GAE: bootstrap from the next row's value, or V(final_obs) where an episode ended
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
            # the rollout's policy is the Agent's
            check_rollout_policy(agent, batch, f"at epoch {epoch}")

            # --- update (--sync gather: the same update, by rank 0 alone on every rank's batch) ---
            update_start = time.perf_counter()
            if args.sync == "allreduce":
                losses, sync_time = update(agent, pi_optimizer, vf_optimizer, batch, args)
            else:
                losses, sync_time = update_one_learner(agent, pi_optimizer, vf_optimizer, batch, args, learner_group)
            update_time = time.perf_counter() - update_start

            # --- logging: episodes ended on any rank, rank-averaged losses, explained variance ---
            totals = collectives.sum_over_ranks(device, **finished, stops=float(bool(run.stop_requested)))
            scalars = {"charts/learning_rate": pi_optimizer.param_groups[0]["lr"]}
            scalars |= {f"losses/{name}": value for name, value in losses.items()}
            scalars["losses/explained_variance"] = explained_variance(batch["returns"], batch["values"])
            scalars |= {"perf/rollout_time": rollout_time, "perf/update_time": update_time}
            scalars["perf/sync_time"] = sync_time
            progress.log_iteration(run, epoch, global_step, totals, scalars)

            # --- checkpoint and stop: SIGTERM or Ctrl-C on any rank stops every rank after this epoch ---
            if args.check_sync_every and (epoch - 1) % args.check_sync_every == 0:  # an edit that broke the sync
                checks.check_weights_in_sync(agent, epoch, "epoch")
            stopping = totals["stops"] > 0
            if stopping or args.checkpoint_every and epoch % args.checkpoint_every == 0:
                checkpoints.save(
                    run, epoch, global_step, model=agent, pi_optimizer=pi_optimizer, vf_optimizer=vf_optimizer
                )
            if stopping:
                break
        envs.close()
        progress.finish(
            run, agent, epoch, global_step, stopping, lambda folder: evaluate(agent, args.env_id, args, folder)
        )
    except (NonFiniteError, RuntimeError) as error:  # found alike on every rank: one line, never a hang
        progress.stop_training(run, epoch, error, "lower --pi-lr/--vf-lr or check the env's observations and rewards")
    return agent


if __name__ == "__main__":
    main(tyro.cli(Args))
