"""Vanilla policy gradient (VPG) with GAE-lambda, data-parallel over any number of processes.

SpinningUp's VPG in one file: an actor-critic MLP (Gaussian policy with a state-independent log-std
for Box actions, Categorical for Discrete), advantages from GAE-lambda, one policy-gradient step and
`--train-v-iters` value steps per epoch. It trains CartPole-v1 and the MuJoCo tasks (HalfCheetah-v5...).

Launch it any of these ways (no mpi4py needed):

    python vpg_mpi.py --env-id CartPole-v1                        # one process
    torchrun --standalone --nproc_per_node=2 vpg_mpi.py           # 2 processes on this machine
    python vpg_mpi.py --nprocs 2                                  # the same, re-launched under torchrun
    mpirun -np 2 python vpg_mpi.py                                # Open MPI, MPICH or Intel MPI
    srun --ntasks=8 python vpg_mpi.py                             # SLURM (across nodes: export MASTER_ADDR)
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST --master-port=29500 --nproc_per_node=4 vpg_mpi.py

Distributed story: `--steps-per-epoch` is global and split evenly across ranks; each rank steps its own
envs (seeded `seed + 10_000 * global_env_index`) and computes GAE on its share. Advantages are
normalised with the world-wide mean and std. With `--sync allreduce` (default) every rank computes
gradients on its local batch and one flat allreduce per optimiser step averages them, so each rank
takes the step that one process would take on the concatenated batch. With `--sync gather` (the
one-learner pattern) the rollouts are gathered to rank 0, which updates alone and broadcasts the new
weights. Both modes end an epoch with the same weights on every rank, up to float rounding.
"""

import contextlib
import gc
import hashlib
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Literal, NoReturn

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro

SCRIPT = os.path.basename(__file__)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    run_name: str = ""
    """the run folder under runs/; default `{env_id}__{exp_name}__{seed}__{unix_time}`"""
    seed: int = 1
    """seed of the experiment; rank r uses `seed + 10_000 * r`, env g uses `seed + 10_000 * g`"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """if toggled and CUDA is available, rank r uses cuda:LOCAL_RANK (small MLPs are usually faster on CPU)"""
    track: bool = False
    """if toggled, the run is also sent to Weights and Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "ddrl"
    """the Weights and Biases project"""
    wandb_entity: str | None = None
    """the Weights and Biases entity (team)"""
    capture_video: bool = False
    """if toggled, rank 0 records evaluation episodes to `runs/{run_name}/videos` (needs moviepy)"""
    save_model: bool = False
    """if toggled, rank 0 writes `runs/{run_name}/model.pt` at the end of training"""
    eval_checkpoint: str = ""
    """if set, load this model.pt, play `--eval-episodes` episodes on rank 0 and exit"""
    eval_episodes: int = 10
    """episodes played by `--eval-checkpoint` and after training with `--capture-video`"""
    eval_deterministic: bool = False
    """if toggled, evaluation takes the policy's mode instead of sampling"""
    torch_threads: int = 0
    """torch threads per rank; 0 = usable cores divided by the ranks on this node"""
    nprocs: int = 1
    """if > 1 and not already launched, re-launch this script under `torch.distributed.run --standalone`"""
    backend: str = ""
    """torch.distributed backend; empty = nccl with --cuda on a GPU, gloo otherwise"""
    dist_timeout: float = 1800.0
    """seconds a collective may wait for a peer before the run stops with an error"""
    checkpoint_every: int = 0
    """write `runs/{run_name}/checkpoints/iter_{n:06d}.pt` every this many epochs (0 = only on SIGTERM)"""
    resume: bool = False
    """continue the run `--run-name` from its newest checkpoint (automatic when torchrun restarts the ranks)"""
    check_sync_every: int = 0
    """compare a checksum of the weights across ranks every this many epochs and stop if they differ (0 = never)"""

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
    """allreduce: average gradients over ranks; gather: rank 0 learns on all rollouts, then broadcasts weights"""

    # to be filled in at run time
    world_size: int = 0
    """number of ranks (computed at run time)"""
    local_steps_per_epoch: int = 0
    """env steps per epoch on one rank (computed at run time)"""
    num_steps: int = 0
    """env steps per epoch of one env (computed at run time)"""
    num_epochs: int = 0
    """number of epochs (computed at run time)"""


# --- errors and launch ------------------------------------------------------------------------------


def fail(message: str, every_rank: bool = False) -> NoReturn:
    """Stop with one readable line naming the fix and exit code 2; only global rank 0 prints it, unless
    `every_rank` (a failure some ranks may survive alone, such as a lost peer: each says it, naming itself)."""
    if dist.is_initialized() and not every_rank:  # every rank stops here together: leave the group cleanly
        dist.destroy_process_group()
        gc.collect()
    rank = int(os.environ.get("RANK", "0"))
    if every_rank and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print(f"{SCRIPT}: error: rank {rank}: {message}", file=sys.stderr, flush=True)
    elif rank == 0:
        print(f"{SCRIPT}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# (rank, world size, local rank, local world size) as each launcher names them; the first match wins,
# so torchrun's variables win under `srun torchrun` or `mpirun torchrun`.
LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def read_launcher_environment() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun, MPI or SLURM; a world of one if none."""
    for rank_key, size_key, local_rank_key, local_size_key in LAUNCHER_VARIABLES:
        if rank_key not in os.environ or size_key not in os.environ:
            continue
        try:
            rank, world_size = int(os.environ[rank_key]), int(os.environ[size_key])
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


def relaunch_under_torchrun(nprocs: int) -> NoReturn:
    """SpinningUp's mpi_fork: run this same command as `nprocs` ranks under torch.distributed.run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]
    raise SystemExit(subprocess.call([*command, os.path.abspath(__file__), *sys.argv[1:]]))


# --- distributed helpers ---------------------------------------------------------------------------


def init_distributed(args: Args) -> tuple[int, int, torch.device]:
    """Join the process group; returns (global rank, world size, device). A world of one needs no network."""
    rank, world_size, local_rank, local_world_size = read_launcher_environment()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world_size))
    if world_size > 1 and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        if local_world_size != world_size:
            fail("the ranks span several nodes: export MASTER_ADDR (rank 0's host) and MASTER_PORT on every node")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")

    use_cuda = args.cuda and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    timeout = timedelta(seconds=args.dist_timeout)
    try:
        if world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            # torchrun keeps one store across restarts: a restarted group under the old keys would dial dead peers
            store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
            store = dist.PrefixStore(f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, ValueError) as error:
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        fail(f"could not form a process group of {world_size} ranks at {address} with {backend}: {error}")

    # torchrun's OMP_NUM_THREADS=1 does not decide this: share the usable cores among the ranks of this node
    threads = args.torch_threads or max(1, len(os.sched_getaffinity(0)) // local_world_size)
    torch.set_num_threads(threads)
    return rank, world_size, device


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in `group` (the world by default); 1 where no process group exists, so helpers become no-ops."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def allreduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Average `tensor` over the ranks of `group`, in place.

    With gloo the wait yields the CPU in a loop instead of sleeping until woken: a small allreduce takes ~0.4 ms
    here but has a tail of several ms (benchmark/results/grad_sync.md), much of it a sleeping waiter being woken
    late; yielding cut ppo_continuous_mpi.py's mean sync at 2 ranks on 2 cores from 1.3 to 0.9 ms. A dead peer
    still ends the wait: gloo fails the collective, and `wait()` raises.
    """
    if group_size(group) > 1:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        if dist.get_backend(group) == "gloo":
            while not work.is_completed():
                os.sched_yield()
        work.wait()
        tensor /= group_size(group)
    return tensor


class NonFiniteError(Exception):
    """A non-finite loss or gradient, raised alike on every rank (the check reads a buffer every rank shares)."""


def average_gradients(
    parameters: list[nn.Parameter], group: dist.ProcessGroup | None = None, extras: torch.Tensor | None = None
) -> None:
    """Average the gradients over ranks with one allreduce of one flat buffer (not one call per tensor).

    `extras` (the loss) ride at the end of the buffer. A NaN or inf anywhere in the world spreads through the
    sum, so every rank finds it in its copy and raises NonFiniteError before any optimizer step.
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    pieces = [*(g.reshape(-1) for g in grads), *([] if extras is None else [extras.detach().reshape(-1)])]
    flat = allreduce_mean(torch.cat(pieces), group)
    if not torch.isfinite(flat).all():
        raise NonFiniteError("a non-finite loss or gradient")
    offset = 0
    for parameter, grad in zip(parameters, grads, strict=True):
        parameter.grad = flat[offset : offset + grad.numel()].view_as(grad)
        offset += grad.numel()


def broadcast_parameters(module: nn.Module, src: int = 0, extras: torch.Tensor | None = None) -> torch.Tensor | None:
    """Copy rank `src`'s parameters and buffers to every rank with one flat broadcast; `extras` (flags rank
    `src` must tell everyone) ride at its end and come back, as rank `src` sent them."""
    if group_size() == 1:
        return extras
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if extras is not None:
            flat = torch.cat([flat, extras.to(flat.dtype).reshape(-1)])
        dist.broadcast(flat, src=src)
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
    return None if extras is None else flat[offset:]


def global_mean_std(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std of `x` over all ranks' elements, as if concatenated (parallel variance merge)."""
    local_mean = x.mean()
    local = torch.stack([x.new_tensor(x.numel()), local_mean, ((x - local_mean) ** 2).sum()])
    if group_size(group) > 1:
        gathered = [torch.empty_like(local) for _ in range(group_size(group))]
        dist.all_gather(gathered, local, group=group)
        count, mean_i, m2_i = torch.stack(gathered).T
        total = count.sum()
        mean = (count * mean_i).sum() / total
        m2 = (m2_i + count * (mean_i - mean) ** 2).sum()
    else:
        total, mean, m2 = local
    return mean, torch.sqrt(m2 / (total - 1))


def gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's equally-shaped `tensor` along dim 0 on rank 0 (rank order); None elsewhere."""
    if group_size() == 1:
        return tensor
    is_root = dist.get_rank() == 0
    pieces = [torch.empty_like(tensor) for _ in range(group_size())] if is_root else None
    dist.gather(tensor, gather_list=pieces, dst=0)
    return torch.cat(pieces) if is_root else None


def pack_batch(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One [n, width] float tensor holding a rank's batch, so --sync gather needs one collective."""
    dtype = batch["obs"].dtype  # actions of a Discrete space are small integers: exact in any float type
    return torch.cat([tensor.reshape(len(tensor), -1).to(dtype) for tensor in batch.values()], dim=1)


def unpack_batch(packed: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of pack_batch, with the field shapes of `like`."""
    batch, offset = {}, 0
    for key, tensor in like.items():
        width = tensor[0].numel()
        batch[key] = packed[:, offset : offset + width].reshape((-1,) + tensor.shape[1:]).to(tensor.dtype)
        offset += width
    return batch


def rank_seed(seed: int, rank: int) -> int:
    """Seed of python, numpy and action sampling on `rank` (SpinningUp's stride: nearby seeds never collide)."""
    return seed + 10_000 * rank


def env_seeds(seed: int, rank: int, local_num_envs: int, index_offset: int = 0) -> list[int]:
    """Seeds of this rank's envs: env j of rank r has global index g = index_offset + r * local_num_envs + j.

    A resumed run passes `index_offset` = restarts x the world's envs, so its fresh episodes never replay a seed.
    """
    return [seed + 10_000 * (index_offset + rank * local_num_envs + j) for j in range(local_num_envs)]


# --- environment, agent, GAE -----------------------------------------------------------------------


def make_env(env_id: str, max_ep_len: int, video_folder: str | None = None) -> callable:
    """A thunk building one env; `max_ep_len` becomes a time limit, so a cut episode is a truncation."""

    def thunk() -> gym.Env:
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
        return gym.wrappers.TimeLimit(env, max_episode_steps=max_ep_len)

    return thunk


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(in_size: int, hidden_sizes: tuple[int, ...], out_size: int, out_std: float) -> nn.Sequential:
    layers, size = [], in_size
    for hidden in hidden_sizes:
        layers += [layer_init(nn.Linear(size, hidden)), nn.Tanh()]
        size = hidden
    return nn.Sequential(*layers, layer_init(nn.Linear(size, out_size), std=out_std))


def numpy_mlp_forward(linears: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """A tanh MLP given as the (weight, bias) of its nn.Linear layers, in numpy: on one observation per env step
    numpy's calls cost a fraction of torch's dispatch and nn.Module calls."""
    *hidden, (weight, bias) = linears
    for hidden_weight, hidden_bias in hidden:
        x = np.tanh(x @ hidden_weight.T + hidden_bias)
    return x @ weight.T + bias


LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class Agent(nn.Module):
    """Separate policy and value MLPs (as SpinningUp's MLPActorCritic)."""

    def __init__(self, obs_dim: int, action_space: gym.Space, hidden_sizes: tuple[int, ...]):
        super().__init__()
        self.continuous = isinstance(action_space, gym.spaces.Box)
        num_outputs = int(np.prod(action_space.shape)) if self.continuous else int(action_space.n)
        self.actor = mlp(obs_dim, hidden_sizes, num_outputs, out_std=0.01)
        self.critic = mlp(obs_dim, hidden_sizes, 1, out_std=1.0)
        if self.continuous:
            self.log_std = nn.Parameter(torch.full((num_outputs,), -0.5))

    def policy_parameters(self) -> list[nn.Parameter]:
        return [*self.actor.parameters(), *([self.log_std] if self.continuous else [])]

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def log_prob_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of `actions` and the policy's entropy at `obs` (closed forms, no Distribution objects)."""
        out = self.actor(obs)
        if self.continuous:
            log_prob = (-0.5 * ((actions - out) / self.log_std.exp()) ** 2 - self.log_std - LOG_SQRT_2PI).sum(-1)
            entropy = (0.5 + LOG_SQRT_2PI + self.log_std).sum().expand(len(obs))
            return log_prob, entropy
        log_probs = torch.log_softmax(out, dim=-1)
        log_prob = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        return log_prob, -(log_probs.exp() * log_probs).sum(-1)

    def rollout_policy(self) -> "RolloutPolicy":
        """The policy and value function as they are now, in numpy, for a rollout (which never changes them)."""
        return RolloutPolicy(self)


class RolloutPolicy:
    """The agent's current weights as numpy arrays, acting one env step at a time.

    On CPU the arrays are views of the parameters (no copy); with --cuda they are copied once per rollout. Each env
    step then costs a few numpy calls instead of a dozen torch dispatches, and a GPU is used only for the update.
    Sampling draws from numpy's global generator (seeded per rank and saved in checkpoints).
    """

    def __init__(self, agent: Agent):
        def linears(network: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray]]:
            layers = [m for m in network if isinstance(m, nn.Linear)]
            return [(m.weight.detach().cpu().numpy(), m.bias.detach().cpu().numpy()) for m in layers]

        self.continuous = agent.continuous
        self.actor, self.critic = linears(agent.actor), linears(agent.critic)
        if self.continuous:
            self.log_std = agent.log_std.detach().cpu().numpy()

    def act(self, obs: np.ndarray, deterministic: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sampled (or modal) actions, their log-probabilities and the values at `obs` [envs, obs_dim]."""
        out = numpy_mlp_forward(self.actor, obs)
        if self.continuous:
            noise = np.zeros_like(out) if deterministic else np.random.standard_normal(out.shape).astype(out.dtype)
            actions = out + np.exp(self.log_std) * noise
            log_prob = (-0.5 * noise**2 - self.log_std - LOG_SQRT_2PI).sum(-1)
        else:
            shifted = out - out.max(-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # log_softmax
            if deterministic:
                actions = log_probs.argmax(-1)
            else:  # inverse CDF: the first action whose cumulative probability reaches a uniform draw
                uniform = np.random.random_sample((len(out), 1))
                actions = np.minimum((np.exp(log_probs).cumsum(-1) < uniform).sum(-1), out.shape[-1] - 1)
            log_prob = np.take_along_axis(log_probs, actions[:, None], -1)[:, 0]
        return actions, log_prob, self.value(obs)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return numpy_mlp_forward(self.critic, obs)[:, 0]


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminations: np.ndarray,
    episode_ends: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE-lambda advantages and discounted rewards-to-go (the value targets) for arrays of shape [T, envs].

    `next_values[t]` is V of the state that followed step t in its own episode (V(final observation)
    where the episode was truncated); `terminations[t]` zeroes it; `episode_ends[t]` (terminated or
    truncated) ends the path at t. The last row is always a path end: the epoch cut it, and its
    rewards-to-go bootstrap from `next_values`, as SpinningUp's `finish_path(last_val)` does.
    """
    advantages = np.zeros_like(rewards)
    rewards_to_go = np.zeros_like(rewards)
    next_advantage = np.zeros_like(rewards[0])
    next_return = np.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        bootstrap = gamma * (1.0 - terminations[t]) * next_values[t]
        continues = np.zeros_like(rewards[t]) if t == len(rewards) - 1 else 1.0 - episode_ends[t]
        delta = rewards[t] + bootstrap - values[t]
        next_advantage = delta + gamma * lam * continues * next_advantage
        next_return = rewards[t] + continues * gamma * next_return + (1.0 - continues) * bootstrap
        advantages[t], rewards_to_go[t] = next_advantage, next_return
    return advantages, rewards_to_go


def update(
    agent: Agent,
    pi_optimizer: torch.optim.Optimizer,
    vf_optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    train_v_iters: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, float]:
    """One VPG epoch on this rank's batch, gradients averaged over `group` (a group of one learns alone).

    Returns the group-averaged [policy_loss, value_loss, entropy, approx_kl, explained_variance] and the
    seconds spent in gradient collectives.
    """
    obs, actions, returns, old_log_prob = batch["obs"], batch["actions"], batch["returns"], batch["log_probs"]
    adv_mean, adv_std = global_mean_std(batch["advantages"], group)
    advantages = (batch["advantages"] - adv_mean) / (adv_std + 1e-8)
    sync_time = 0.0

    # one policy-gradient step
    log_prob, entropy = agent.log_prob_entropy(obs, actions)
    policy_loss = -(log_prob * advantages).mean()
    pi_optimizer.zero_grad()
    policy_loss.backward()
    start = time.perf_counter()
    average_gradients(agent.policy_parameters(), group, extras=policy_loss)
    sync_time += time.perf_counter() - start
    pi_optimizer.step()

    # value regression on the rewards-to-go
    for i in range(train_v_iters):
        value_loss = ((agent.value(obs) - returns) ** 2).mean()
        if i == 0:
            first_value_loss = value_loss.detach()
        vf_optimizer.zero_grad()
        value_loss.backward()
        start = time.perf_counter()
        average_gradients(list(agent.critic.parameters()), group, extras=value_loss)
        sync_time += time.perf_counter() - start
        vf_optimizer.step()

    with torch.no_grad():
        new_log_prob, _ = agent.log_prob_entropy(obs, actions)
        approx_kl = (old_log_prob - new_log_prob).mean()
        residual_var = (returns - batch["values"]).var()
        explained_variance = 1 - residual_var / returns.var().clamp_min(1e-8)
        stats = torch.stack([policy_loss.detach(), first_value_loss, entropy.mean().detach(), approx_kl])
        stats = allreduce_mean(torch.cat([stats, explained_variance.reshape(1)]).double(), group)
    return stats, sync_time


def update_one_learner(
    agent: Agent,
    pi_optimizer: torch.optim.Optimizer,
    vf_optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    train_v_iters: int,
    learner_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, float]:
    """--sync gather: rollouts gathered to rank 0, which updates alone (in `learner_group`, a group of one),
    then broadcasts its weights. Returns rank 0's statistics (zeros elsewhere) and the seconds spent in
    the gather and the broadcast."""
    start = time.perf_counter()
    gathered = gather_to_rank0(pack_batch(batch))
    sync_time = time.perf_counter() - start
    stats = torch.zeros(5, dtype=torch.float64)
    nonfinite = torch.zeros(1)  # rank 0 learns alone: it tells the others in the weights' broadcast
    if gathered is not None:
        try:
            stats, _ = update(
                agent, pi_optimizer, vf_optimizer, unpack_batch(gathered, batch), train_v_iters, learner_group
            )
        except NonFiniteError:
            nonfinite[0] = 1.0
    start = time.perf_counter()
    nonfinite = broadcast_parameters(agent, extras=nonfinite)
    if nonfinite.item():
        raise NonFiniteError("a non-finite loss or gradient")
    return stats, sync_time + time.perf_counter() - start


def save_checkpoint(path: str, agent: Agent, args: Args, **state) -> None:
    """Everything an evaluation needs, plus `state` (what a resumed run needs), written atomically: a kill at any
    moment leaves the previous file intact."""
    payload = {"script": SCRIPT, "env_id": args.env_id, "args": asdict(args), "model": agent.state_dict(), **state}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)


# --- reliability: run names, checkpoints, restarts, agreement between ranks -------------------------


def resolve_run_name(args: Args) -> str:
    """The run folder's name when restarted ranks must find it again (--resume, torchrun --max-restarts); else ''
    (named after rank 0's clock once the process group exists)."""
    if args.run_name:
        return args.run_name
    restartable = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    if not (args.resume or restartable):
        return ""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # `none` under static rendezvous
    if run_id in ("", "none"):
        flag = "--resume" if args.resume else "torchrun --max-restarts"
        fail(f"{flag} needs a run folder that every (re)started rank finds again: pass --run-name NAME")
    return f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{run_id}"


def checkpoint_path(run_name: str, iteration: int) -> str:
    return os.path.join("runs", run_name, "checkpoints", f"iter_{iteration:06d}.pt")


def find_latest_checkpoint(run_name: str) -> str | None:
    """The newest `iter_*.pt` of the run (the highest iteration), or None."""
    folder = os.path.join("runs", run_name, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    iterations = [int(match[1]) for name in names if (match := re.fullmatch(r"iter_(\d+)\.pt", name))]
    return checkpoint_path(run_name, max(iterations)) if iterations else None


def load_checkpoint(path: str, args: Args, world_size: int) -> dict:
    """Read a training checkpoint and refuse one of another script, env or world size (before any env exists)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a truncated or foreign file
        fail(f"{path} is not a readable checkpoint ({error}); delete it to resume from the one before")
    if not isinstance(checkpoint, dict) or checkpoint.get("script") != SCRIPT or "iteration" not in checkpoint:
        fail(f"{path} is not a training checkpoint of {SCRIPT}; resume it with the script that wrote it")
    if checkpoint["env_id"] != args.env_id:
        fail(f"{path} trains {checkpoint['env_id']}, not --env-id {args.env_id}; pass --env-id {checkpoint['env_id']}")
    if checkpoint["world_size"] != world_size:
        fail(f"{path} was written by {checkpoint['world_size']} ranks, not {world_size}; resume with as many ranks")
    return checkpoint


def resume_checkpoint(args: Args, run_name: str, world_size: int) -> dict | None:
    """The checkpoint this run continues from: with --resume or after a torchrun restart, the run's newest one."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    path = find_latest_checkpoint(run_name) if run_name and (args.resume or restarted) else None
    if args.resume and path is None and not restarted:
        fail(f"--resume found no checkpoint in runs/{run_name}/checkpoints; check --run-name, or drop --resume")
    if not args.resume and not restarted and run_name and find_latest_checkpoint(run_name):
        fail(f"runs/{run_name} already holds checkpoints: pass --resume to continue it, or choose another --run-name")
    return None if path is None else load_checkpoint(path, args, world_size)


def rng_states() -> dict:
    """This rank's python, numpy and torch random states (what its next samples depend on)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def gather_objects(obj: object) -> list | None:
    """Every rank's `obj` on rank 0 (rank order), None elsewhere; one collective."""
    if group_size() == 1:
        return [obj]
    gathered = [None] * group_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def save_training_checkpoint(path: str, agent: Agent, args: Args, **state) -> None:
    """Every rank's RNG states gathered to rank 0, which writes `path` with them and `state` (all ranks call this)."""
    rngs = gather_objects(rng_states())
    if rngs is not None:
        save_checkpoint(path, agent, args, rng=rngs, world_size=group_size(), **state)


def digest(data: bytes) -> int:
    """A 63-bit digest of `data`, to compare across ranks in an int64 tensor."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


def check_same_command(args: Args, resumed_iteration: int) -> None:
    """Stop every rank before training unless all run the same source with the same arguments, from the same
    checkpoint (one all_gather)."""
    with open(__file__, "rb") as source:
        mine = [digest(source.read()), digest(repr(sorted(asdict(args).items())).encode()), resumed_iteration]
    local = torch.tensor(mine, dtype=torch.int64)
    if group_size() == 1:
        return
    gathered = [torch.empty_like(local) for _ in range(group_size())]
    dist.all_gather(gathered, local)
    table = torch.stack(gathered)
    for column, problem, fix in (
        (0, f"run a different copy of {SCRIPT} than rank 0", "copy the same script to every node"),
        (1, "were given different arguments than rank 0", "launch every rank with the same command line"),
        (2, "resume from a different checkpoint than rank 0", "put runs/ on a filesystem every node shares"),
    ):
        differ = (table[:, column] != table[0, column]).nonzero().flatten().tolist()
        if differ:
            fail(f"ranks {differ} {problem}; {fix}")


def check_parameters_in_sync(module: nn.Module, iteration: int) -> None:
    """Stop every rank if the weights differ between ranks (a checksum of their bytes, one all_gather)."""
    if group_size() == 1:
        return
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()
    local = torch.tensor([digest(flat.numpy().tobytes())], dtype=torch.int64)
    gathered = [torch.empty_like(local) for _ in range(group_size())]
    dist.all_gather(gathered, local)
    differ = [rank for rank, checksum in enumerate(gathered) if checksum.item() != local.item()]
    if differ:
        fail(
            f"the weights of ranks {differ} differ from this rank's at iteration {iteration}: the ranks no longer "
            "train one model (a bug, or a faulty node); resume from the last checkpoint with --resume"
        )


def is_lost_peer(error: BaseException) -> bool:
    """Whether `error` is the backend's report of a dead or stalled peer (gloo, NCCL, the store)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        word in text for word in ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out")
    )


@contextlib.contextmanager
def stop_on_lost_peer(args: Args, run_name: str):
    """Turn the backend's error about a dead or silent peer into one clear message on every surviving rank."""
    try:
        yield
    except RuntimeError as error:
        if not is_lost_peer(error):
            raise
        reason = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0]).split(". ")[0]
        with contextlib.suppress(SystemExit):
            fail(
                f"lost contact with another rank ({reason}): it died, or stalled longer than --dist-timeout "
                f"{args.dist_timeout:g} s; see its log, then resume with --resume --run-name {run_name}",
                every_rank=True,
            )
        sys.stdout.flush()
        os._exit(2)  # at once: the broken group's threads can abort an orderly interpreter exit (SIGABRT)


class StopRequest:
    """SIGTERM (a cluster's preemption notice) sets a flag; the loop agrees on it across ranks at an epoch's end."""

    def __init__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def evaluate(agent: Agent, env_id: str, args: Args, video_folder: str | None = None) -> list[float]:
    """Play `args.eval_episodes` whole episodes with one env and return their returns."""
    env = make_env(env_id, args.max_ep_len, video_folder)()
    policy = agent.rollout_policy()
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


def run_evaluation(args: Args) -> None:
    """`--eval-checkpoint`: load a model.pt of this script and print one `eval:` line (rank 0 only)."""
    if not os.path.isfile(args.eval_checkpoint):
        fail(f"--eval-checkpoint {args.eval_checkpoint!r} does not exist; pass the model.pt that --save-model wrote")
    try:
        checkpoint = torch.load(args.eval_checkpoint, map_location="cpu", weights_only=False)
    except Exception as error:  # a truncated or foreign file
        fail(f"--eval-checkpoint {args.eval_checkpoint!r} is not a readable checkpoint ({error})")
    if not isinstance(checkpoint, dict) or checkpoint.get("script") != SCRIPT:
        fail(f"--eval-checkpoint {args.eval_checkpoint!r} was not written by {SCRIPT}; use that script to evaluate it")
    if int(os.environ.get("RANK", "0")) != 0:
        return
    saved = checkpoint["args"]
    env = gym.make(checkpoint["env_id"])
    agent = Agent(int(np.prod(env.observation_space.shape)), env.action_space, tuple(saved["hidden_sizes"]))
    env.close()
    agent.load_state_dict(checkpoint["model"])
    args.max_ep_len = saved["max_ep_len"]
    video_folder = os.path.join(os.path.dirname(args.eval_checkpoint), "videos") if args.capture_video else None
    np.random.seed(args.seed)  # the rollout policy's sampling, like the env, follows --seed: repeatable evaluations
    returns = evaluate(agent, checkpoint["env_id"], args, video_folder)
    print(f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} return_std={np.std(returns):.2f}")


def check_args(args: Args, world_size: int) -> None:
    """Derive the batch arithmetic and refuse what cannot run, before any env or process group exists."""
    if args.nprocs < 1:
        fail(f"--nprocs must be at least 1, got {args.nprocs}")
    for name in ("steps_per_epoch", "local_num_envs", "eval_episodes", "max_ep_len", "total_timesteps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.train_v_iters < 0 or args.dist_timeout <= 0:
        fail("--train-v-iters must be >= 0 and --dist-timeout > 0")
    if args.checkpoint_every < 0 or args.check_sync_every < 0:
        fail("--checkpoint-every and --check-sync-every must be >= 0 (0 = off)")
    args.world_size = world_size
    if args.steps_per_epoch % world_size:
        fail(
            f"--steps-per-epoch {args.steps_per_epoch} does not split evenly across {world_size} ranks; "
            f"use a multiple of {world_size * args.local_num_envs}"
        )
    args.local_steps_per_epoch = args.steps_per_epoch // world_size
    if args.local_steps_per_epoch % args.local_num_envs:
        fail(
            f"the local epoch of {args.local_steps_per_epoch} steps does not split across --local-num-envs "
            f"{args.local_num_envs}; use a --steps-per-epoch that is a multiple of {world_size * args.local_num_envs}"
        )
    args.num_steps = args.local_steps_per_epoch // args.local_num_envs
    args.num_epochs = args.total_timesteps // args.steps_per_epoch
    if args.num_epochs < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one epoch of --steps-per-epoch "
            f"{args.steps_per_epoch}: zero epochs to train; raise --total-timesteps"
        )
    try:
        probe = gym.make(args.env_id)  # one env, closed at once, to learn the spaces
    except gym.error.Error as error:
        fail(f"unknown --env-id {args.env_id!r} ({error})")
    action_space, observation_space = probe.action_space, probe.observation_space
    probe.close()
    if not isinstance(action_space, gym.spaces.Box | gym.spaces.Discrete):
        fail(f"{args.env_id} has {type(action_space).__name__} actions; {SCRIPT} trains Box or Discrete action spaces")
    if not isinstance(observation_space, gym.spaces.Box):
        fail(f"{args.env_id} has {type(observation_space).__name__} observations; {SCRIPT} needs a Box space")
    if args.capture_video:
        try:
            import moviepy  # noqa: F401
        except ImportError:
            fail("--capture-video needs moviepy: pip install moviepy")


def print_batch_table(args: Args) -> None:
    rows = [
        ("ranks", args.world_size, ""),
        ("envs", args.local_num_envs, args.world_size * args.local_num_envs),
        ("steps per epoch", args.local_steps_per_epoch, args.steps_per_epoch),
        ("epochs", "", args.num_epochs),
        ("total env steps", "", args.num_epochs * args.steps_per_epoch),
    ]
    print(f"{'':18}{'per rank':>12}{'world':>12}")
    for name, local, world in rows:
        print(f"{name:18}{local!s:>12}{world!s:>12}")


def log_epoch(
    writer,
    args: Args,
    epoch: int,
    global_step: int,
    train_start: float,
    start_step: int,
    finished: torch.Tensor,
    stats: torch.Tensor,
    times: tuple[float, float, float],
    pi_optimizer: torch.optim.Optimizer,
) -> None:
    """Write one epoch's world-wide scalars to TensorBoard and print the progress line (rank 0)."""
    sps = int((global_step - start_step) / (time.time() - train_start))
    return_sum, length_sum, episodes = finished.tolist()[:3]
    if episodes:
        writer.add_scalar("charts/episodic_return", return_sum / episodes, global_step)
        writer.add_scalar("charts/episodic_length", length_sum / episodes, global_step)
    policy_loss, value_loss, entropy, approx_kl, explained_variance = stats.tolist()
    for key, value in (
        ("charts/SPS", sps),
        ("charts/learning_rate", pi_optimizer.param_groups[0]["lr"]),
        ("losses/policy_loss", policy_loss),
        ("losses/value_loss", value_loss),
        ("losses/entropy", entropy),
        ("losses/approx_kl", approx_kl),
        ("losses/explained_variance", explained_variance),
        ("perf/rollout_time", times[0]),
        ("perf/update_time", times[1]),
        ("perf/sync_time", times[2]),
    ):
        writer.add_scalar(key, value, global_step)
    recent = f"{return_sum / episodes:.1f}" if episodes else "n/a"
    print(f"epoch {epoch}/{args.num_epochs} step {global_step} SPS {sps} return {recent}", flush=True)


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    # --- launch and set-up ---
    _, world_size, _, _ = read_launcher_environment()
    if args.nprocs > 1 and world_size == 1:
        relaunch_under_torchrun(args.nprocs)
    if args.eval_checkpoint:
        return run_evaluation(args)
    check_args(args, world_size)
    run_name = resolve_run_name(args)
    checkpoint = resume_checkpoint(args, run_name, world_size)
    rank, world_size, device = init_distributed(args)
    resumed_iteration = checkpoint["iteration"] if checkpoint else 0
    check_same_command(args, resumed_iteration)

    start_time = torch.tensor(int(time.time()), dtype=torch.int64)
    dist.broadcast(start_time, src=0)  # every rank names the run folder alike
    run_name = run_name or f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{start_time.item()}"
    restarts = checkpoint["restarts"] + 1 if checkpoint else 0
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.max_ep_len) for _ in range(args.local_num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    writer = None
    if rank == 0:
        print_batch_table(args)
        if checkpoint:
            print(f"resuming from {checkpoint_path(run_name, resumed_iteration)} (epoch {resumed_iteration})")
        if args.track:
            import wandb

            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=asdict(args),
                name=run_name,
                save_code=True,
                resume="allow" if checkpoint else None,
            )
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops what the interrupted one logged after its checkpoint, then continues the curves
        purge_step = checkpoint["global_step"] + 1 if checkpoint else None
        writer = SummaryWriter(f"runs/{run_name}", purge_step=purge_step)
        if not checkpoint:
            table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
            writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")

    # identical initial weights everywhere: built from `seed`, then broadcast from rank 0
    torch.manual_seed(args.seed)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    agent = Agent(obs_dim, envs.single_action_space, args.hidden_sizes).to(device)
    broadcast_parameters(agent)
    random.seed(rank_seed(args.seed, rank))
    np.random.seed(rank_seed(args.seed, rank))
    torch.manual_seed(rank_seed(args.seed, rank))
    torch.backends.cudnn.deterministic = args.torch_deterministic
    pi_optimizer = torch.optim.Adam(agent.policy_parameters(), lr=args.pi_lr)
    vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=args.vf_lr)
    global_step = 0
    if checkpoint:  # weights, optimizers, position and this rank's random streams as they were
        agent.load_state_dict(checkpoint["model"])
        pi_optimizer.load_state_dict(checkpoint["pi_optimizer"])
        vf_optimizer.load_state_dict(checkpoint["vf_optimizer"])
        set_rng_states(checkpoint["rng"][rank])
        global_step = checkpoint["global_step"]
    # --sync gather: rank 0 learns alone, so its collectives run in a group of one
    learner_group = dist.new_group([0]) if args.sync == "gather" else None

    # rollout storage, one row per step of the local envs
    shape = (args.num_steps, args.local_num_envs)
    obs_buf = np.zeros(shape + (obs_dim,), dtype=np.float32)
    actions_buf = np.zeros(shape + envs.single_action_space.shape, dtype=np.float32)
    log_probs_buf = np.zeros(shape, dtype=np.float32)
    values_buf = np.zeros(shape, dtype=np.float32)
    rewards_buf = np.zeros(shape, dtype=np.float32)
    terminations_buf = np.zeros(shape, dtype=np.float32)
    episode_ends_buf = np.zeros(shape, dtype=np.float32)
    final_values_buf = np.zeros(shape, dtype=np.float32)  # V(final observation) where an episode was truncated

    # a resumed run starts fresh episodes, on envs seeded after all the earlier attempts' envs
    index_offset = restarts * world_size * args.local_num_envs
    next_obs, _ = envs.reset(seed=env_seeds(args.seed, rank, args.local_num_envs, index_offset))
    envs.action_space.seed(rank_seed(args.seed, rank) + index_offset)
    episode_return = np.zeros(args.local_num_envs)
    episode_length = np.zeros(args.local_num_envs, dtype=np.int64)
    start_step = global_step
    train_start = time.time()
    stop_request = StopRequest()

    def save(epoch: int) -> str:
        path = checkpoint_path(run_name, epoch)
        state = {"pi_optimizer": pi_optimizer.state_dict(), "vf_optimizer": vf_optimizer.state_dict()}
        save_training_checkpoint(
            path, agent, args, iteration=epoch, global_step=global_step, restarts=restarts, **state
        )
        return path

    epoch, stopping = resumed_iteration, False
    try:
        with stop_on_lost_peer(args, run_name):
            for epoch in range(resumed_iteration + 1, args.num_epochs + 1):
                # --- rollout ---
                rollout_start = time.perf_counter()
                finished = np.zeros(3)  # world-summed below: returns, lengths, count of episodes ended this epoch
                policy = agent.rollout_policy()
                for step in range(args.num_steps):
                    obs_buf[step] = next_obs.reshape(args.local_num_envs, -1)
                    env_action, log_probs_buf[step], values_buf[step] = policy.act(obs_buf[step])
                    actions_buf[step] = env_action
                    if agent.continuous:
                        env_action = np.clip(env_action, envs.single_action_space.low, envs.single_action_space.high)
                    next_obs, reward, terminated, truncated, info = envs.step(env_action)
                    rewards_buf[step], terminations_buf[step] = reward, terminated
                    ended = terminated | truncated
                    episode_ends_buf[step] = ended
                    episode_return += reward
                    episode_length += 1
                    if ended.any():
                        finished += (episode_return[ended].sum(), episode_length[ended].sum(), ended.sum())
                        episode_return[ended], episode_length[ended] = 0.0, 0
                        cut = truncated & ~terminated
                        if cut.any():  # truncation is not termination: bootstrap from V(final observation)
                            final_obs = np.stack(info["final_obs"][cut]).reshape(cut.sum(), -1)
                            final_values_buf[step, cut] = policy.value(final_obs.astype(np.float32))
                global_step += args.steps_per_epoch
                last_values = policy.value(next_obs.reshape(args.local_num_envs, -1).astype(np.float32))
                rollout_time = time.perf_counter() - rollout_start

                # --- GAE ---
                next_values = np.concatenate([values_buf[1:], last_values[None]])
                next_values = np.where(episode_ends_buf > 0, final_values_buf, next_values)
                advantages, rewards_to_go = compute_gae(
                    rewards_buf, values_buf, next_values, terminations_buf, episode_ends_buf, args.gamma, args.lam
                )
                final_values_buf[:] = 0.0
                batch = {
                    "obs": obs_buf.reshape(-1, obs_dim),
                    "actions": actions_buf.reshape((-1,) + envs.single_action_space.shape),
                    "log_probs": log_probs_buf.reshape(-1),
                    "values": values_buf.reshape(-1),
                    "advantages": advantages.reshape(-1),
                    "returns": rewards_to_go.reshape(-1),
                }
                batch = {key: torch.as_tensor(value, device=device) for key, value in batch.items()}

                # --- update ---
                update_start = time.perf_counter()
                if args.sync == "allreduce":
                    stats, sync_time = update(agent, pi_optimizer, vf_optimizer, batch, args.train_v_iters)
                else:
                    stats, sync_time = update_one_learner(
                        agent, pi_optimizer, vf_optimizer, batch, args.train_v_iters, learner_group
                    )
                update_time = time.perf_counter() - update_start

                # --- logging (world-wide episode statistics and any rank's SIGTERM in one collective) ---
                finished = torch.as_tensor([*finished, stop_request.requested], dtype=torch.float64)
                dist.all_reduce(finished)
                if rank == 0:
                    log_epoch(
                        writer,
                        args,
                        epoch,
                        global_step,
                        train_start,
                        start_step,
                        finished,
                        stats,
                        (rollout_time, update_time, sync_time),
                        pi_optimizer,
                    )

                # --- checkpoint (and, on SIGTERM anywhere, stop: every rank decides alike) ---
                if args.check_sync_every and epoch % args.check_sync_every == 0:
                    check_parameters_in_sync(agent, epoch)
                stopping = finished[3].item() > 0
                if stopping or (args.checkpoint_every and epoch % args.checkpoint_every == 0):
                    path = save(epoch)
                    if rank == 0:
                        writer.flush()  # the curves on disk reach the checkpoint, whatever happens next
                        print(f"checkpoint saved to {path}", flush=True)
                if stopping:
                    if rank == 0:
                        print(f"stopped by SIGTERM at epoch {epoch}; continue with --resume --run-name {run_name}")
                    break

            # --- final model and clean-up ---
            envs.close()
            if rank == 0:
                if args.save_model and not stopping:
                    save_checkpoint(f"runs/{run_name}/model.pt", agent, args)
                    print(f"model saved to runs/{run_name}/model.pt")
                if args.capture_video and not stopping:
                    evaluate(agent, args.env_id, args, video_folder=f"runs/{run_name}/videos")
                writer.close()
                if args.track:
                    import wandb

                    wandb.finish()
            dist.barrier()
    except NonFiniteError:
        last = find_latest_checkpoint(run_name)
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
        fail(
            f"non-finite loss or gradient at epoch {epoch}, so no rank took the step ({kept}); lower --pi-lr/--vf-lr "
            "or check the env's observations and rewards, then --resume"
        )
    finally:
        stop_request.restore()
    dist.destroy_process_group()
    gc.collect()  # free gloo's worker threads now: left to interpreter shutdown they can abort the process
    return agent


if __name__ == "__main__":
    main(tyro.cli(Args))
