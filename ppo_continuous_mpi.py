"""PPO for continuous control (MuJoCo), data-parallel over any number of processes.

CleanRL's continuous-action PPO recipe in one file (ppo_continuous_action.py, so results compare with
its published table): separate 64-64 tanh actor and critic MLPs with orthogonal init, a state-independent
log-std, clipped surrogate and clipped value loss, GAE-lambda, annealed learning rate, actions clipped to
the space, observations normalised and rewards scaled by a running return std (each clipped to +-10).

Launch it any of these ways (no mpi4py needed):

    python ppo_continuous_mpi.py --env-id Hopper-v5                     # one process
    torchrun --standalone --nproc_per_node=2 ppo_continuous_mpi.py      # 2 processes on this machine
    python ppo_continuous_mpi.py --nprocs 2                             # the same, re-launched under torchrun
    mpirun -np 2 python ppo_continuous_mpi.py                           # Open MPI, MPICH or Intel MPI
    srun --ntasks=8 python ppo_continuous_mpi.py                        # SLURM (across nodes: export MASTER_ADDR)
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST --master-port=29500 --nproc_per_node=4 ppo_continuous_mpi.py
    python ppo_continuous_mpi.py --eval-checkpoint runs/RUN/model.pt    # evaluate a --save-model checkpoint

Distributed story: `--local-num-envs` and `--num-steps` are per rank (as in CleanRL's multi-GPU script),
so N ranks collect an N times larger batch per iteration; `--num-steps 2048/N` keeps CleanRL's batch.
Each rank steps its own envs (seeded `seed + 10_000 * global_env_index`) and computes GAE on its share.
The world's minibatch k is the union of every rank's minibatch k: advantages are normalised with that
union's mean and std (one collective per epoch carries every minibatch's moments), and after each
backward() one allreduce of one flat buffer averages the gradients, plus the scalars every rank must agree
on (the KL for `--target-kl`, the logged losses), before gradient clipping. Observation and return
statistics are frozen during a rollout and merged world-wide once per iteration, so every rank
normalises with the same numbers. Every rank therefore takes the step one process would take on the
concatenated batch and holds the same weights.

Speed: rollouts act through numpy copies of the weights (a few numpy calls per env step), the update slices
one shuffled batch per epoch and accumulates gradients into one flat buffer, and `--compile` puts the
minibatch loss's forward and backward through torch.compile (about 1.25x the SPS on a 2-core CPU;
benchmark/results/throughput.md).
"""

import contextlib
import gc
import hashlib
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import NoReturn

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
    """if toggled, rank 0 writes `runs/{run_name}/model.pt` (weights and normalisation statistics)"""
    eval_checkpoint: str = ""
    """if set, load this model.pt, play `--eval-episodes` episodes on rank 0 and exit"""
    eval_episodes: int = 10
    """episodes played by `--eval-checkpoint` and after training with `--capture-video`"""
    eval_deterministic: bool = False
    """if toggled, evaluation takes the policy's mean action instead of sampling"""
    compile: bool = False
    """if toggled, the update's loss runs through torch.compile (the first update compiles for a few seconds;
    on CPU this needs a C++ compiler)"""
    torch_threads: int = 0
    """torch threads per rank; 0 = usable cores divided by the ranks on this node"""
    nprocs: int = 1
    """if > 1 and not already launched, re-launch this script under `torch.distributed.run --standalone`"""
    backend: str = ""
    """torch.distributed backend; empty = nccl with --cuda on a GPU, gloo otherwise"""
    dist_timeout: float = 1800.0
    """seconds a collective may wait for a peer before the run stops with an error"""
    checkpoint_every: int = 0
    """write `runs/{run_name}/checkpoints/iter_{n:06d}.pt` every this many iterations (0 = only on SIGTERM)"""
    resume: bool = False
    """continue the run `--run-name` from its newest checkpoint (automatic when torchrun restarts the ranks)"""
    check_sync_every: int = 0
    """compare a checksum of the weights across ranks every this many iterations and stop if they differ (0 = never)"""

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
    """minibatches per update epoch; the world's minibatch k is the union of every rank's minibatch k"""
    update_epochs: int = 10
    """passes over the batch per iteration"""
    norm_adv: bool = True
    """if toggled, advantages are normalised with the world-wide mean and std of each global minibatch"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """if toggled, the value loss is clipped around the rollout's values, as in the PPO paper's code"""
    ent_coef: float = 0.0
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum norm of the (world-averaged) gradient"""
    target_kl: float | None = None
    """if set, stop the update epochs once the world-averaged approximate KL exceeds it"""

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


def flat_gradient_buffer(parameters: list[nn.Parameter], num_extras: int) -> torch.Tensor:
    """One zeroed flat buffer holding every parameter's gradient, followed by `num_extras` slots for scalars.

    Each parameter's `.grad` becomes a view into it, so backward() accumulates straight into the buffer that
    one allreduce sends and the clipping scales: no copy before the collective, none after. Zero it with
    `buffer.zero_()`; `optimizer.zero_grad()` would set the views to None.
    """
    size = sum(p.numel() for p in parameters) + num_extras
    flat = torch.zeros(size, dtype=parameters[0].dtype, device=parameters[0].device)
    offset = 0
    for parameter in parameters:
        parameter.grad = flat[offset : offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()
    return flat


def average_gradients(flat: torch.Tensor) -> torch.Tensor:
    """Average a flat_gradient_buffer (gradients plus the scalars riding at its end) over ranks: one allreduce.

    The scalars are those every rank must agree on (the KL that decides early stopping, the logged losses).
    A NaN or inf anywhere in the world spreads through the sum, so every rank finds it in its copy and raises
    NonFiniteError before any step.
    """
    allreduce_mean(flat)
    if not torch.isfinite(flat).all():
        raise NonFiniteError("a non-finite loss or gradient")
    return flat


def clip_flat_gradients(gradients: torch.Tensor, max_norm: float) -> None:
    """Scale the flat gradients to a total norm of at most `max_norm` (nn.utils.clip_grad_norm_, in one piece)."""
    total_norm = gradients.norm()
    gradients.mul_(torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))


def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers to every rank with one flat broadcast."""
    if group_size() == 1:
        return
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=src)
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def global_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count, mean and sum of squared deviations (M2) along the last dim of `x`, over all ranks' elements as if
    concatenated: one all_gather of every row's local moments, merged with the parallel variance update."""
    local_mean = x.mean(-1)
    local_m2 = ((x - local_mean.unsqueeze(-1)) ** 2).sum(-1)
    local = torch.stack([torch.full_like(local_mean, x.shape[-1]), local_mean, local_m2])
    if group_size() == 1:
        return local[0], local[1], local[2]
    gathered = [torch.empty_like(local) for _ in range(group_size())]
    dist.all_gather(gathered, local)
    count_i, mean_i, m2_i = torch.stack(gathered, dim=1)  # each [ranks, rows...]
    count = count_i.sum(0)
    mean = (count_i * mean_i).sum(0) / count
    m2 = (m2_i + count_i * (mean_i - mean) ** 2).sum(0)
    return count, mean, m2


def global_mean_std(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std along the last dim of `x` over all ranks' elements, as if concatenated (one collective)."""
    count, mean, m2 = global_moments(x)
    return mean, torch.sqrt(m2 / (count - 1))


def rank_seed(seed: int, rank: int) -> int:
    """Seed of python, numpy and action sampling on `rank` (SpinningUp's stride: nearby seeds never collide)."""
    return seed + 10_000 * rank


def env_seeds(seed: int, rank: int, local_num_envs: int, index_offset: int = 0) -> list[int]:
    """Seeds of this rank's envs: env j of rank r has global index g = index_offset + r * local_num_envs + j.

    A resumed run passes `index_offset` = restarts x the world's envs, so its fresh episodes never replay a seed.
    """
    return [seed + 10_000 * (index_offset + rank * local_num_envs + j) for j in range(local_num_envs)]


# --- environment, normalisation, agent, GAE --------------------------------------------------------

NORM_CLIP = 10.0  # normalised observations and scaled rewards are clipped to +-10, as in CleanRL
NORM_EPS = 1e-8


def make_env(env_id: str, video_folder: str | None = None) -> callable:
    """A thunk building one env with its registered time limit (a cut episode is a truncation).

    Normalisation and action clipping live in main, not in wrappers: gymnasium's normalising wrappers
    keep per-env statistics and refuse same-step autoreset vector envs.
    """

    def thunk() -> gym.Env:
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
        return env

    return thunk


class RunningMeanStd(nn.Module):
    """Running mean and (population) variance, as float64 buffers so state_dict and checkpoints carry them.

    It starts empty (mean 0, var 1, count 0, so the first rollout sees raw values) rather than with
    gymnasium's 1e-4 pseudo-count: after any update the statistics are exactly those of the data seen.
    """

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Merge a batch's moments (parallel variance update): the result is the statistics of all data seen."""
        total = self.count + count
        delta = mean - self.mean
        m2_total = self.var * self.count + m2 + delta**2 * self.count * count / total
        self.mean += delta * count / total
        self.var.copy_(m2_total / total)
        self.count.copy_(total)

    def frozen(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) as numpy arrays, fixed for a rollout."""
        return self.mean.cpu().numpy().copy(), np.sqrt(self.var.cpu().numpy() + NORM_EPS)


def normalize(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Observations as the agent sees them: standardised with frozen statistics, clipped, float32."""
    return np.clip((x - mean) / std, -NORM_CLIP, NORM_CLIP).astype(np.float32)


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp_forward(linears: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """A tanh MLP given as the (weight, bias) of its nn.Linear layers, one addmm per layer and tanh between: the
    nn.Sequential's arithmetic bit for bit, without its per-call dispatch and attribute look-ups (the update runs
    it 320 times an iteration on minibatches of 64, where those cost as much as the arithmetic)."""
    *hidden, (weight, bias) = linears
    for hidden_weight, hidden_bias in hidden:
        x = torch.tanh(torch.addmm(hidden_bias, x, hidden_weight.t()))
    return torch.addmm(bias, x, weight.t())


def numpy_mlp_forward(linears: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """mlp_forward in numpy: on one observation per env step numpy's calls cost a fraction of torch's."""
    *hidden, (weight, bias) = linears
    for hidden_weight, hidden_bias in hidden:
        x = np.tanh(x @ hidden_weight.T + hidden_bias)
    return x @ weight.T + bias


LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class Agent(nn.Module):
    """CleanRL's continuous agent: separate 64-64 tanh MLPs, a state-independent log-std, and the
    observation and return statistics (buffers, so they travel with the weights)."""

    def __init__(self, obs_dim: int, action_dim: int):
        super().__init__()
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
        self.actor_logstd = nn.Parameter(torch.zeros(action_dim))
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.return_rms = RunningMeanStd(())
        # the same Parameter objects, listed once for mlp_forward (optimizer steps update them in place)
        self.actor_linears = [(m.weight, m.bias) for m in self.actor_mean if isinstance(m, nn.Linear)]
        self.critic_linears = [(m.weight, m.bias) for m in self.critic if isinstance(m, nn.Linear)]

    def log_prob_entropy_value(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probability of `actions`, the policy's entropy and the value at `obs` (closed-form Gaussian; the
        networks through mlp_forward, the same arithmetic as calling them, with fewer calls per minibatch)."""
        mean = mlp_forward(self.actor_linears, obs)
        log_prob = (-0.5 * ((actions - mean) / self.actor_logstd.exp()) ** 2 - self.actor_logstd - LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + LOG_SQRT_2PI + self.actor_logstd).sum().expand(len(obs))
        return log_prob, entropy, mlp_forward(self.critic_linears, obs).squeeze(-1)

    def rollout_policy(self) -> "RolloutPolicy":
        """The policy and value function as they are now, in numpy, for a rollout (which never changes them)."""
        return RolloutPolicy(self)


class RolloutPolicy:
    """The agent's current weights as numpy arrays, acting one env step at a time.

    On CPU the arrays are views of the parameters (no copy); with --cuda they are copied once per rollout. Each env
    step then costs a few numpy calls instead of a dozen torch dispatches, and a GPU is used only for the update.
    The noise comes from numpy's global generator (seeded per rank and saved in checkpoints).
    """

    def __init__(self, agent: Agent):
        def to_numpy(tensor: torch.Tensor) -> np.ndarray:
            return tensor.detach().cpu().numpy()

        self.actor = [(to_numpy(weight), to_numpy(bias)) for weight, bias in agent.actor_linears]
        self.critic = [(to_numpy(weight), to_numpy(bias)) for weight, bias in agent.critic_linears]
        self.log_std = to_numpy(agent.actor_logstd)

    def act(self, obs: np.ndarray, deterministic: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sampled (or mean) actions, their log-probabilities and the values at `obs` [envs, obs_dim]."""
        mean = numpy_mlp_forward(self.actor, obs)
        noise = np.zeros_like(mean) if deterministic else np.random.standard_normal(mean.shape).astype(mean.dtype)
        actions = mean + np.exp(self.log_std) * noise
        log_prob = (-0.5 * noise**2 - self.log_std - LOG_SQRT_2PI).sum(-1)
        return actions, log_prob, self.value(obs)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return numpy_mlp_forward(self.critic, obs)[:, 0]


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    last_values: np.ndarray,
    final_values: np.ndarray,
    terminations: np.ndarray,
    truncations: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE-lambda advantages and value targets (advantages + values) for arrays of shape [T, envs].

    The state after step t is the next row's state, or after the last row the state whose values are
    `last_values`, unless the episode ended at t: a termination bootstraps from zero, a truncation from
    `final_values[t]` = V(final observation), since truncation is not termination.
    """
    next_values = np.concatenate([values[1:], last_values[None]])
    next_values = np.where(truncations > 0, final_values, next_values)
    deltas = rewards + gamma * (1.0 - terminations) * next_values - values
    continues = 1.0 - np.maximum(terminations, truncations)
    advantages = np.zeros_like(rewards)
    last_advantage = np.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        last_advantage = deltas[t] + gamma * gae_lambda * continues[t] * last_advantage
        advantages[t] = last_advantage
    return advantages, advantages + values


def minibatch_loss(
    agent: Agent,
    mb: dict[str, torch.Tensor],
    adv_mean: torch.Tensor | None,
    adv_std: torch.Tensor | None,
    args: Args,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped loss on one minibatch, and [policy_loss, value_loss, entropy, old_approx_kl, approx_kl,
    clipfrac] about it. Advantages are normalised with `adv_mean` and `adv_std` (the global minibatch's) if given.
    `--compile` runs this through torch.compile: forward and backward become a few fused kernels."""
    new_log_prob, entropy, new_value = agent.log_prob_entropy_value(mb["obs"], mb["actions"])
    logratio = new_log_prob - mb["log_probs"]
    ratio = logratio.exp()
    with torch.no_grad():
        # calculate approx_kl http://joschu.net/blog/kl-approx.html
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
        v_loss_unclipped = (new_value - mb["returns"]) ** 2
        v_clipped = mb["values"] + torch.clamp(new_value - mb["values"], -args.clip_coef, args.clip_coef)
        v_loss_clipped = (v_clipped - mb["returns"]) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((new_value - mb["returns"]) ** 2).mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    stats = torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()
    return loss, stats


def loss_function(args: Args) -> Callable:
    """minibatch_loss, or with `--compile` minibatch_loss through torch.compile (one graph for forward and one for
    backward; fixed shapes, since every minibatch has the same size)."""
    return torch.compile(minibatch_loss, fullgraph=True, dynamic=False) if args.compile else minibatch_loss


def update(
    agent: Agent,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    args: Args,
    orders: torch.Tensor,
    loss_fn: Callable = minibatch_loss,
) -> tuple[torch.Tensor, float, int]:
    """PPO's update epochs on this rank's batch, the world's minibatch k being the union of all ranks' minibatch k.

    `orders[e]` is a permutation of this rank's batch for epoch e; its k-th slice of `local_minibatch_size`
    indices is this rank's share of minibatch k. `loss_fn` is minibatch_loss or its compiled form. Returns the
    world-averaged [policy_loss, value_loss, entropy, old_approx_kl, approx_kl] of the last minibatch and
    clipfrac over all minibatches, the seconds spent in collectives, and the number of epochs run (fewer than
    update_epochs after a `--target-kl` stop, identical on every rank).
    """
    parameters = list(agent.parameters())
    num_gradients = sum(p.numel() for p in parameters)
    flat = flat_gradient_buffer(parameters, num_extras=6)  # the gradients, then the 6 numbers every rank logs
    gradients, stats = flat[:num_gradients], flat[num_gradients:]
    sync_time = 0.0
    clipfrac_sum = torch.zeros((), dtype=flat.dtype, device=flat.device)
    minibatches_run = 0
    size = args.local_minibatch_size
    for epoch in range(args.update_epochs):
        # one gather per tensor per epoch; each minibatch is then a slice, not another gather
        shuffled = {key: value[orders[epoch]] for key, value in batch.items()}
        adv_mean = adv_std = [None] * args.num_minibatches
        if args.norm_adv:  # every global minibatch's mean and std in one collective per epoch
            start = time.perf_counter()
            adv_mean, adv_std = global_mean_std(shuffled["advantages"].view(args.num_minibatches, size))
            sync_time += time.perf_counter() - start
        for k in range(args.num_minibatches):
            mb = {key: value[k * size : (k + 1) * size] for key, value in shuffled.items()}
            loss, minibatch_stats = loss_fn(agent, mb, adv_mean[k], adv_std[k], args)
            flat.zero_()
            loss.backward()  # accumulates into the views flat_gradient_buffer gave the parameters
            minibatches_run += 1
            clipfrac_sum += minibatch_stats[5]
            with torch.no_grad():
                stats[:5] = minibatch_stats[:5]
                stats[5] = clipfrac_sum / minibatches_run
            # equal local minibatch sizes make the mean of local gradients the gradient of the union; clipping
            # after averaging means every rank clips the same gradient
            start = time.perf_counter()
            average_gradients(flat)
            sync_time += time.perf_counter() - start
            clip_flat_gradients(gradients, args.max_grad_norm)
            optimizer.step()

        # the KL is the world average carried by the last gradient allreduce: every rank stops together
        if args.target_kl is not None and stats[4] > args.target_kl:
            break
    for parameter in parameters:  # let the buffer go (optimizer.zero_grad() would do the same)
        parameter.grad = None
    return stats.clone(), sync_time, epoch + 1


# --- checkpoints and evaluation --------------------------------------------------------------------


def save_checkpoint(path: str, agent: Agent, args: Args, **state) -> None:
    """Everything an evaluation needs (weights and normalisation statistics), plus `state` (what a resumed run
    needs), written atomically: a kill at any moment leaves the previous file intact."""
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
    """Play `args.eval_episodes` whole episodes with one env (observation statistics frozen); raw env returns."""
    env = make_env(env_id, video_folder)()
    obs_mean, obs_std = agent.obs_rms.frozen()
    policy = agent.rollout_policy()
    returns = []
    obs, _ = env.reset(seed=args.seed)
    episode_return = 0.0
    while len(returns) < args.eval_episodes:
        action, _, _ = policy.act(normalize(obs.reshape(1, -1), obs_mean, obs_std), args.eval_deterministic)
        action = np.clip(action[0], env.action_space.low, env.action_space.high)
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
    if args.eval_episodes < 1:
        fail(f"--eval-episodes must be at least 1, got {args.eval_episodes}")
    check_video_support(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    env = gym.make(checkpoint["env_id"])
    agent = Agent(int(np.prod(env.observation_space.shape)), int(np.prod(env.action_space.shape)))
    env.close()
    agent.load_state_dict(checkpoint["model"])
    torch.manual_seed(args.seed)  # reproducible sampled actions
    video_folder = os.path.join(os.path.dirname(args.eval_checkpoint), "videos") if args.capture_video else None
    np.random.seed(args.seed)  # the rollout policy's sampling, like the env, follows --seed: repeatable evaluations
    returns = evaluate(agent, checkpoint["env_id"], args, video_folder)
    print(f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} return_std={np.std(returns):.2f}")


# --- arguments, batch table, logging ---------------------------------------------------------------


def check_args(args: Args, world_size: int) -> None:
    """Derive the batch arithmetic and refuse what cannot run, before any process group or rollout env exists."""
    if args.nprocs < 1:
        fail(f"--nprocs must be at least 1, got {args.nprocs}")
    for name in ("total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "update_epochs", "eval_episodes"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.dist_timeout <= 0:
        fail(f"--dist-timeout must be > 0, got {args.dist_timeout}")
    if args.checkpoint_every < 0 or args.check_sync_every < 0:
        fail("--checkpoint-every and --check-sync-every must be >= 0 (0 = off)")
    args.world_size = world_size
    args.local_batch_size = args.local_num_envs * args.num_steps
    args.batch_size = args.local_batch_size * world_size
    if args.local_batch_size % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} does not divide the local batch of {args.local_batch_size} "
            f"steps (--local-num-envs {args.local_num_envs} x --num-steps {args.num_steps}); use a divisor of it"
        )
    args.local_minibatch_size = args.local_batch_size // args.num_minibatches
    args.minibatch_size = args.local_minibatch_size * world_size
    args.num_iterations = args.total_timesteps // args.batch_size
    if args.num_iterations < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one iteration's batch of {args.batch_size} steps "
            f"({world_size} ranks x {args.local_num_envs} envs x {args.num_steps} steps): raise --total-timesteps"
        )
    try:
        gym.spec(args.env_id)
        probe = gym.make(args.env_id)  # only to read its spaces
    except gym.error.Error as error:
        fail(f"unknown or unusable --env-id {args.env_id!r} ({error})")
    action_space, observation_space = probe.action_space, probe.observation_space
    probe.close()
    if not isinstance(action_space, gym.spaces.Box):
        fail(f"{args.env_id} has {type(action_space).__name__} actions; {SCRIPT} needs Box (continuous) actions")
    if not isinstance(observation_space, gym.spaces.Box):
        fail(f"{args.env_id} has {type(observation_space).__name__} observations; {SCRIPT} needs Box observations")
    check_video_support(args)
    check_compile_support(args)


def check_compile_support(args: Args) -> None:
    """torch.compile builds C++ kernels on CPU: without a compiler it would fail deep inside the first update."""
    compiler = os.environ.get("CXX", "g++")
    if args.compile and not (args.cuda and torch.cuda.is_available()) and shutil.which(compiler) is None:
        fail(f"--compile on CPU needs a C++ compiler and {compiler!r} is not on PATH: install g++ or drop --compile")


def check_video_support(args: Args) -> None:
    if args.capture_video:
        try:
            import moviepy  # noqa: F401
        except ImportError:
            fail("--capture-video needs moviepy: pip install moviepy")


def print_batch_table(args: Args) -> None:
    rows = [
        ("ranks", args.world_size, ""),
        ("envs", args.local_num_envs, args.world_size * args.local_num_envs),
        ("batch", args.local_batch_size, args.batch_size),
        ("minibatch", args.local_minibatch_size, args.minibatch_size),
        ("iterations", "", args.num_iterations),
        ("total env steps", "", args.num_iterations * args.batch_size),
    ]
    print(f"{'':18}{'per rank':>12}{'world':>12}")
    for name, local, world in rows:
        print(f"{name:18}{local!s:>12}{world!s:>12}")


def log_iteration(
    writer,
    args: Args,
    iteration: int,
    global_step: int,
    train_start: float,
    start_step: int,
    world_sums: torch.Tensor,
    stats: torch.Tensor,
    times: tuple[float, float, float],
    learning_rate: float,
) -> None:
    """Write one iteration's world-wide scalars to TensorBoard and print the progress line (rank 0)."""
    sps = int((global_step - start_step) / (time.time() - train_start))
    return_sum, length_sum, episodes, n, y_sum, y_sq_sum, residual_sum, residual_sq_sum = world_sums.tolist()[:8]
    if episodes:
        writer.add_scalar("charts/episodic_return", return_sum / episodes, global_step)
        writer.add_scalar("charts/episodic_length", length_sum / episodes, global_step)
    var_y = y_sq_sum / n - (y_sum / n) ** 2
    explained_var = np.nan if var_y <= 0 else 1 - (residual_sq_sum / n - (residual_sum / n) ** 2) / var_y
    policy_loss, value_loss, entropy, old_approx_kl, approx_kl, clipfrac = stats.tolist()
    for key, value in (
        ("charts/SPS", sps),
        ("charts/learning_rate", learning_rate),
        ("losses/value_loss", value_loss),
        ("losses/policy_loss", policy_loss),
        ("losses/entropy", entropy),
        ("losses/old_approx_kl", old_approx_kl),
        ("losses/approx_kl", approx_kl),
        ("losses/clipfrac", clipfrac),
        ("losses/explained_variance", explained_var),
        ("perf/rollout_time", times[0]),
        ("perf/update_time", times[1]),
        ("perf/sync_time", times[2]),
    ):
        writer.add_scalar(key, value, global_step)
    recent = f"{return_sum / episodes:.1f}" if episodes else "n/a"
    print(f"iteration {iteration}/{args.num_iterations} step {global_step} SPS {sps} return {recent}", flush=True)


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

    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id) for _ in range(args.local_num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    start_time = torch.tensor(int(time.time()), dtype=torch.int64, device=device)
    dist.broadcast(start_time, src=0)  # every rank names the run folder alike
    run_name = run_name or f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{start_time.item()}"
    restarts = checkpoint["restarts"] + 1 if checkpoint else 0
    writer = None
    if rank == 0:
        print_batch_table(args)
        if checkpoint:
            print(f"resuming from {checkpoint_path(run_name, resumed_iteration)} (iteration {resumed_iteration})")
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
    action_dim = int(np.prod(envs.single_action_space.shape))
    agent = Agent(obs_dim, action_dim).to(device)
    broadcast_parameters(agent)
    random.seed(rank_seed(args.seed, rank))
    np.random.seed(rank_seed(args.seed, rank))
    torch.manual_seed(rank_seed(args.seed, rank))
    torch.backends.cudnn.deterministic = args.torch_deterministic
    # fused: one kernel for all parameters (about 25% off the update on CPU), the same Adam step as CleanRL's
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    loss_fn = loss_function(args)
    global_step = 0
    if checkpoint:  # weights, normalisation statistics, optimizer, position and this rank's random streams
        agent.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        set_rng_states(checkpoint["rng"][rank])
        global_step = checkpoint["global_step"]

    # rollout storage (numpy, one row per step of the local envs; moved to `device` once per iteration)
    shape = (args.num_steps, args.local_num_envs)
    raw_obs_buf = np.zeros(shape + (obs_dim,))  # unnormalised, for the statistics
    obs_buf = np.zeros(shape + (obs_dim,), dtype=np.float32)  # normalised, as the agent saw them
    actions_buf = np.zeros(shape + (action_dim,), dtype=np.float32)
    log_probs_buf = np.zeros(shape, dtype=np.float32)
    values_buf = np.zeros(shape, dtype=np.float32)
    rewards_buf = np.zeros(shape, dtype=np.float32)  # raw env rewards
    terminations_buf = np.zeros(shape, dtype=np.float32)
    truncations_buf = np.zeros(shape, dtype=np.float32)
    final_values_buf = np.zeros(shape, dtype=np.float32)  # V(final observation) where an episode was truncated
    discounted_returns_buf = np.zeros(shape)  # the running return whose std scales the rewards
    action_low, action_high = envs.single_action_space.low, envs.single_action_space.high

    # a resumed run starts fresh episodes, on envs seeded after all the earlier attempts' envs
    index_offset = restarts * world_size * args.local_num_envs
    next_obs, _ = envs.reset(seed=env_seeds(args.seed, rank, args.local_num_envs, index_offset))
    envs.action_space.seed(rank_seed(args.seed, rank) + index_offset)
    episode_return = np.zeros(args.local_num_envs)
    episode_length = np.zeros(args.local_num_envs, dtype=np.int64)
    discounted_return = np.zeros(args.local_num_envs)
    start_step = global_step
    train_start = time.time()
    stop_request = StopRequest()

    def save(iteration: int) -> str:
        path = checkpoint_path(run_name, iteration)
        save_training_checkpoint(
            path,
            agent,
            args,
            iteration=iteration,
            global_step=global_step,
            restarts=restarts,
            optimizer=optimizer.state_dict(),
        )
        return path

    iteration, stopping = resumed_iteration, False
    try:
        with stop_on_lost_peer(args, run_name):
            for iteration in range(resumed_iteration + 1, args.num_iterations + 1):
                if args.anneal_lr:
                    frac = 1.0 - (iteration - 1.0) / args.num_iterations
                    optimizer.param_groups[0]["lr"] = frac * args.learning_rate

                # --- rollout (normalisation statistics frozen, so every rank normalises alike) ---
                rollout_start = time.perf_counter()
                obs_mean, obs_std = agent.obs_rms.frozen()
                policy = agent.rollout_policy()
                finished = np.zeros(3)  # world-summed below: returns, lengths, count of episodes ended
                for step in range(args.num_steps):
                    raw_obs = next_obs.reshape(args.local_num_envs, -1)
                    raw_obs_buf[step] = raw_obs
                    obs_buf[step] = normalize(raw_obs, obs_mean, obs_std)
                    action, log_probs_buf[step], values_buf[step] = policy.act(obs_buf[step])
                    actions_buf[step] = action
                    next_obs, reward, terminated, truncated, info = envs.step(np.clip(action, action_low, action_high))
                    rewards_buf[step], terminations_buf[step], truncations_buf[step] = reward, terminated, truncated
                    discounted_return = discounted_return * args.gamma + reward
                    discounted_returns_buf[step] = discounted_return
                    episode_return += reward
                    episode_length += 1
                    ended = terminated | truncated
                    if ended.any():
                        finished += (episode_return[ended].sum(), episode_length[ended].sum(), ended.sum())
                        episode_return[ended], episode_length[ended], discounted_return[ended] = 0.0, 0, 0.0
                        cut = truncated & ~terminated
                        if cut.any():  # truncation is not termination: bootstrap from V(final observation)
                            final_obs = np.stack(info["final_obs"][cut]).reshape(cut.sum(), -1)
                            final_values_buf[step, cut] = policy.value(normalize(final_obs, obs_mean, obs_std))
                global_step += args.batch_size
                last_values = policy.value(normalize(next_obs.reshape(args.local_num_envs, -1), obs_mean, obs_std))
                rollout_time = time.perf_counter() - rollout_start

                # --- normalisation statistics: merged over all ranks' rollouts in one collective ---
                returns_row = discounted_returns_buf.reshape(1, -1)
                local_data = np.concatenate([raw_obs_buf.reshape(-1, obs_dim).T, returns_row])
                count, mean, m2 = global_moments(torch.as_tensor(local_data, device=device))
                agent.obs_rms.update(count[0], mean[:obs_dim], m2[:obs_dim])
                agent.return_rms.update(count[obs_dim], mean[obs_dim], m2[obs_dim])
                # the rewards are used only from here on, so they are scaled with statistics that include this rollout
                reward_scale = math.sqrt(agent.return_rms.var.item() + NORM_EPS)
                scaled_rewards = np.clip(rewards_buf / reward_scale, -NORM_CLIP, NORM_CLIP)

                # --- GAE ---
                advantages, returns = compute_gae(
                    scaled_rewards,
                    values_buf,
                    last_values,
                    final_values_buf,
                    terminations_buf,
                    truncations_buf,
                    args.gamma,
                    args.gae_lambda,
                )
                batch = {
                    "obs": obs_buf.reshape(-1, obs_dim),
                    "actions": actions_buf.reshape(-1, action_dim),
                    "log_probs": log_probs_buf.reshape(-1),
                    "values": values_buf.reshape(-1),
                    "advantages": advantages.reshape(-1),
                    "returns": returns.reshape(-1),
                }
                batch = {key: torch.as_tensor(v, dtype=torch.float32, device=device) for key, v in batch.items()}

                # --- update ---
                update_start = time.perf_counter()
                orders = [torch.randperm(args.local_batch_size, device=device) for _ in range(args.update_epochs)]
                stats, sync_time, _ = update(agent, optimizer, batch, args, torch.stack(orders), loss_fn)
                update_time = time.perf_counter() - update_start

                # --- logging (world-wide episode statistics, explained variance and any SIGTERM: one collective) ---
                residuals = returns - values_buf
                world_sums = torch.tensor(
                    [
                        *finished,
                        returns.size,
                        returns.sum(dtype=np.float64),
                        (returns.astype(np.float64) ** 2).sum(),
                        residuals.sum(dtype=np.float64),
                        (residuals.astype(np.float64) ** 2).sum(),
                        stop_request.requested,
                    ],
                    dtype=torch.float64,
                    device=device,
                )
                dist.all_reduce(world_sums)
                if rank == 0:
                    log_iteration(
                        writer,
                        args,
                        iteration,
                        global_step,
                        train_start,
                        start_step,
                        world_sums,
                        stats,
                        (rollout_time, update_time, sync_time),
                        optimizer.param_groups[0]["lr"],
                    )

                # --- checkpoint (and, on SIGTERM anywhere, stop: every rank decides alike) ---
                if args.check_sync_every and iteration % args.check_sync_every == 0:
                    check_parameters_in_sync(agent, iteration)
                stopping = world_sums[8].item() > 0
                if stopping or (args.checkpoint_every and iteration % args.checkpoint_every == 0):
                    path = save(iteration)
                    if rank == 0:
                        writer.flush()  # the curves on disk reach the checkpoint, whatever happens next
                        print(f"checkpoint saved to {path}", flush=True)
                if stopping:
                    if rank == 0:
                        print(
                            f"stopped by SIGTERM at iteration {iteration}; continue with --resume --run-name {run_name}"
                        )
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
            f"non-finite loss or gradient at iteration {iteration}, so no rank took the step ({kept}); lower "
            "--learning-rate or check the env's observations and rewards, then --resume"
        )
    finally:
        stop_request.restore()
    dist.destroy_process_group()
    gc.collect()  # free gloo's worker threads now: left to interpreter shutdown they can abort the process
    return agent


if __name__ == "__main__":
    main(tyro.cli(Args))
