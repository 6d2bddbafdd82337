"""PPO on Atari (CleanRL's Nature-CNN recipe), data-parallel with torch DistributedDataParallel.

One file: ale-py's native vectorised `AtariVectorEnv` (C++ threads) with the DQN preprocessing (frameskip 4 with
max-pool, 84x84 grayscale, 4-frame stack, up to 30 no-op starts, fire on reset), a Nature CNN with a shared trunk
and policy/value heads, GAE, clipped surrogate and clipped value loss, annealed learning rate. The learner sees
rewards clipped to [-1, 1] and a lost life as a terminal; TensorBoard gets the raw score of whole games.

Launch it any of these ways (no mpi4py needed):

    python ppo_atari_multigpu.py                                          # one process
    torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py        # 2 processes (GPUs) on this machine
    python ppo_atari_multigpu.py --nprocs 2                               # the same, re-launched under torchrun
    mpirun -np 2 python ppo_atari_multigpu.py                             # Open MPI, MPICH or Intel MPI
    srun --ntasks=8 python ppo_atari_multigpu.py                          # SLURM (across nodes: export MASTER_ADDR)
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST --master-port=29500 --nproc_per_node=4 ppo_atari_multigpu.py
    python ppo_atari_multigpu.py --eval-checkpoint runs/RUN/model.pt      # play 10 games with a saved model

Distributed story: `--local-num-envs` and `--num-steps` are per rank, so N ranks collect N times the batch of
one. Each rank steps its own envs (env g seeded `seed + 10_000 * g`) and computes GAE on its share. The agent is
wrapped in DistributedDataParallel: every minibatch goes through `DDP.forward` once, and DDP's backward hooks
average the gradients over ranks bucket by bucket while backward still runs, so each rank clips and applies the
gradient of the world minibatch (the union of every rank's minibatch k). Advantages are normalised with the
world-wide mean and std of each world minibatch; losses, KL and episode statistics are averaged over ranks.
With CUDA each rank uses cuda:LOCAL_RANK and NCCL; with fewer GPUs than ranks on a node, ranks share GPUs over
gloo; on CPU, gloo.

Speed: the agent is kept channels-last (oneDNN's fast convolution layout on CPU, tensor cores' on GPU), and
`--bf16` runs the CNN trunk under bfloat16 autocast, which about doubles the update on CPUs with AVX512-BF16 or
AMX (benchmark/results/throughput.md; its learning curve is in benchmark/results/ppo_atari_learning_curves.md).
`--compile` puts the update's forward and backward through torch.compile.
"""

import contextlib
import gc
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import NoReturn

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from ale_py.vector_env import AtariVectorEnv
from torch.nn.parallel import DistributedDataParallel as DDP

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
    cuda: bool = True
    """if toggled and CUDA is available, rank r uses cuda:LOCAL_RANK"""
    bf16: bool = False
    """if toggled, the convolutions and the 512-unit layer compute in bfloat16 (autocast; weights, Adam and the
    losses stay float32): about 2x the update speed on CPUs with AVX512-BF16 or AMX and on recent GPUs"""
    compile: bool = False
    """if toggled, the update's forward and backward run through torch.compile (the first update compiles for
    several seconds; on CPU this needs a C++ compiler)"""
    track: bool = False
    """if toggled, the run is also sent to Weights and Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "ddrl"
    """the Weights and Biases project"""
    wandb_entity: str | None = None
    """the Weights and Biases entity (team)"""
    capture_video: bool = False
    """if toggled, rank 0 records evaluation games to `runs/{run_name}/videos` (needs moviepy)"""
    save_model: bool = False
    """if toggled, rank 0 writes `runs/{run_name}/model.pt` at the end of training"""
    eval_checkpoint: str = ""
    """if set, load this model.pt, play `--eval-episodes` games on rank 0 and exit"""
    eval_episodes: int = 10
    """games played by `--eval-checkpoint` and after training with `--capture-video`"""
    eval_deterministic: bool = False
    """if toggled, evaluation takes the policy's mode instead of sampling"""
    torch_threads: int = 0
    """torch threads per rank; 0 = usable cores divided by the ranks on this node"""
    nprocs: int = 1
    """if > 1 and not already launched, re-launch this script under `torch.distributed.run --standalone`"""
    backend: str = ""
    """torch.distributed backend; empty = nccl with --cuda on a GPU per rank, gloo otherwise"""
    dist_timeout: float = 1800.0
    """seconds a collective may wait for a peer before the run stops with an error"""
    checkpoint_every: int = 0
    """write `runs/{run_name}/checkpoints/iter_{n:06d}.pt` every this many iterations (0 = only on SIGTERM)"""
    resume: bool = False
    """continue the run `--run-name` from its newest checkpoint (automatic when torchrun restarts the ranks)"""
    check_sync_every: int = 0
    """compare a checksum of the weights across ranks every this many iterations and stop if they differ (0 = never)"""

    # Algorithm specific arguments (names as in CleanRL)
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of a gymnasium Atari game (`{Game}NoFrameskip-v4` or `ALE/{Game}-v5`)"""
    total_timesteps: int = 10_000_000
    """global env steps (agent steps, 4 frames each) over all ranks; sets the number of iterations"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 8
    """parallel game environments stepped by each rank"""
    num_steps: int = 128
    """steps per env in each rollout (per rank)"""
    env_threads: int = 0
    """AtariVectorEnv threads per rank; 0 = usable cores divided by the ranks on this node"""
    anneal_lr: bool = True
    """if toggled, the learning rate decays linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor"""
    gae_lambda: float = 0.95
    """the lambda of generalised advantage estimation"""
    num_minibatches: int = 4
    """minibatches per epoch (each rank's batch splits into this many; world minibatch k is their union)"""
    update_epochs: int = 4
    """epochs over the batch in each update"""
    norm_adv: bool = True
    """if toggled, advantages are normalised with the world-wide mean and std of each minibatch"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """if toggled, the value loss is clipped as in the PPO paper's implementation"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the global norm the (rank-averaged) gradient is clipped to"""
    target_kl: float | None = None
    """if set, an update stops after the epoch whose world-averaged approximate KL exceeds it"""

    # to be filled in at run time
    world_size: int = 0
    """number of ranks (computed at run time)"""
    local_batch_size: int = 0
    """transitions per rollout on one rank: local_num_envs * num_steps (computed at run time)"""
    batch_size: int = 0
    """transitions per rollout over all ranks (computed at run time)"""
    local_minibatch_size: int = 0
    """transitions per minibatch on one rank (computed at run time)"""
    minibatch_size: int = 0
    """transitions per minibatch over all ranks (computed at run time)"""
    num_iterations: int = 0
    """number of rollout-and-update iterations (computed at run time)"""


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


def cores_per_rank() -> int:
    """Usable cores of this node divided by the ranks on it (LOCAL_WORLD_SIZE), at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


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
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        num_gpus = torch.cuda.device_count()
        torch.cuda.set_device(local_rank % num_gpus)
        if num_gpus < local_world_size and not args.backend:
            backend = "gloo"  # NCCL refuses two ranks on one GPU
            if local_rank == 0:
                print(
                    f"{SCRIPT}: warning: {local_world_size} ranks share {num_gpus} GPU(s) on this node, so they "
                    "talk over gloo instead of NCCL (slower); launch one rank per GPU for NCCL",
                    file=sys.stderr,
                    flush=True,
                )
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
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
    torch.set_num_threads(args.torch_threads or cores_per_rank())
    return rank, world_size, device


def has_native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 convolutions and matmuls run natively here (AVX512-BF16 or AMX CPUs, Ampere or newer GPUs)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in `group` (the world by default); 1 where no process group exists, so helpers become no-ops."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def allreduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Average `tensor` over the ranks of `group`, in place."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor /= group_size(group)
    return tensor


def global_mean_std(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std along the last dim of `x` over all ranks' elements, as if concatenated.

    Every row is merged in one all_gather (parallel variance merge), so the statistics of all minibatches of an
    update cost one collective. A 1-D `x` gives scalars.
    """
    local_mean = x.mean(-1)
    count = torch.full_like(local_mean, x.shape[-1])
    local = torch.stack([count, local_mean, ((x - local_mean.unsqueeze(-1)) ** 2).sum(-1)])
    if group_size(group) > 1:
        gathered = [torch.empty_like(local) for _ in range(group_size(group))]
        dist.all_gather(gathered, local, group=group)
        count_i, mean_i, m2_i = torch.stack(gathered, dim=1)  # each [ranks, *rows]
        total = count_i.sum(0)
        mean = (count_i * mean_i).sum(0) / total
        m2 = (m2_i + count_i * (mean_i - mean) ** 2).sum(0)
    else:
        total, mean, m2 = local
    return mean, torch.sqrt(m2 / (total - 1))


def rank_seed(seed: int, rank: int) -> int:
    """Seed of python, numpy and action sampling on `rank` (SpinningUp's stride: nearby seeds never collide)."""
    return seed + 10_000 * rank


def env_seeds(seed: int, rank: int, local_num_envs: int, index_offset: int = 0) -> list[int]:
    """Seeds of this rank's envs: env j of rank r has global index g = index_offset + r * local_num_envs + j.

    A resumed run passes `index_offset` = restarts x the world's envs, so its fresh episodes never replay a seed.
    """
    return [seed + 10_000 * (index_offset + rank * local_num_envs + j) for j in range(local_num_envs)]


# --- environment, agent, GAE -----------------------------------------------------------------------


def atari_settings(env_id: str) -> dict:
    """The game and protocol of a gymnasium Atari id, read from its registration; a clear error for anything else.

    `{Game}NoFrameskip-v4` plays without sticky actions, `ALE/{Game}-v5` repeats the last action with
    probability 0.25; both get this script's own 4-frame skip with max-pool.
    """
    gym.register_envs(ale_py)
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as error:
        fail(f"unknown --env-id {env_id!r} ({error}); pass an Atari game such as BreakoutNoFrameskip-v4")
    if spec.entry_point not in ("ale_py.env:AtariEnv", ale_py.env.AtariEnv):
        fail(f"--env-id {env_id} is not an Atari game; {SCRIPT} trains ALE games such as BreakoutNoFrameskip-v4")
    kwargs = spec.kwargs
    if kwargs.get("obs_type", "rgb") == "ram":
        fail(f"--env-id {env_id} observes RAM; {SCRIPT} learns from pixels: use the id without '-ram'")
    if not isinstance(kwargs.get("frameskip", 1), int):
        fail(
            f"--env-id {env_id} skips a random number of frames, which AtariVectorEnv cannot do; "
            f"use the NoFrameskip-v4 or ALE/...-v5 id of the game"
        )
    return {
        "game": kwargs["game"],
        "repeat_action_probability": kwargs.get("repeat_action_probability", 0.25),
        "full_action_space": kwargs.get("full_action_space", False),
        "max_num_frames_per_episode": kwargs.get("max_num_frames_per_episode") or 108_000,
    }


def make_env(settings: dict, num_envs: int, num_threads: int) -> AtariVectorEnv:
    """This rank's envs: C++ threads with the DQN preprocessing, raw rewards, life losses as terminals.

    AtariVectorEnv's defaults do not fit the recipe: the learner clips rewards itself (the logged score stays
    raw); `life_loss_info` reports a lost life as a terminal but plays on (`episodic_life` would restart the
    game); same-step autoreset makes every stored transition a real one and puts the last observation of an
    ended game in info["final_obs"].
    """
    return AtariVectorEnv(
        settings["game"],
        num_envs,
        num_threads=num_threads,
        repeat_action_probability=settings["repeat_action_probability"],
        full_action_space=settings["full_action_space"],
        max_num_frames_per_episode=settings["max_num_frames_per_episode"],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        frameskip=4,
        maxpool=True,
        stack_num=4,
        img_height=84,
        img_width=84,
        grayscale=True,
        noop_max=30,
        use_fire_reset=True,
        episodic_life=False,
        life_loss_info=True,
        reward_clipping=False,
    )


class GameTracker:
    """Raw score and length (agent steps) of every env's current game, across its lives.

    With `life_loss_info` a lost life is a terminal too; it is told from a finished game by the info: a lost
    life lowers `lives` while `episode_frame_number` runs on, whereas a finished game is reset at once
    (same-step autoreset), which restarts the frame count (and restores the lives).
    """

    def __init__(self, info: dict):
        self.lives = info["lives"].copy()
        self.frames = info["episode_frame_number"].copy()
        self.returns = np.zeros(len(self.lives))
        self.lengths = np.zeros(len(self.lives), dtype=np.int64)

    def step(self, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, info: dict):
        """Count one step; returns (game_over mask, raw returns, lengths) of the games that ended at it."""
        self.returns += rewards
        self.lengths += 1
        lives, frames = info["lives"], info["episode_frame_number"]
        lost_life = terminated & ~truncated & (lives < self.lives) & (frames > self.frames)
        game_over = (terminated | truncated) & ~lost_life
        returns, lengths = self.returns[game_over], self.lengths[game_over]
        self.returns[game_over], self.lengths[game_over] = 0.0, 0
        self.lives, self.frames = lives.copy(), frames.copy()
        return game_over, returns, lengths


def area_resize_matrix(source: int, target: int) -> np.ndarray:
    """[target, source] weights averaging source pixels by their overlap with each target pixel.

    `rows @ image @ cols.T` is OpenCV's INTER_AREA downscaling (which AtariVectorEnv uses) without OpenCV.
    """
    edges = np.arange(target + 1) * source / target
    pixels = np.arange(source)
    overlap = np.minimum(edges[1:, None], pixels + 1) - np.maximum(edges[:-1, None], pixels)
    return np.clip(overlap, 0.0, None) * target / source


class AtariPreprocessing(gym.Wrapper):
    """AtariVectorEnv's preprocessing on one gymnasium ALE env (grayscale frames, frameskip=1), for evaluation.

    Each action is repeated for 4 frames and the last two are max-pooled, resized to 84x84 by area and stacked 4
    deep (zeros at reset); a reset plays up to 30 no-op frames and FIRE. An episode is a whole game.
    """

    def __init__(self, env: gym.Env, frameskip: int = 4, stack_num: int = 4, noop_max: int = 30, size: int = 84):
        super().__init__(env)
        self.frameskip, self.noop_max = frameskip, noop_max
        height, width = env.observation_space.shape
        self.rows, self.cols = area_resize_matrix(height, size), area_resize_matrix(width, size)
        self.stack = np.zeros((stack_num, size, size), dtype=np.uint8)
        self.observation_space = gym.spaces.Box(0, 255, self.stack.shape, np.uint8)
        self.fire = "FIRE" in env.unwrapped.get_action_meanings()

    def _push(self, frame: np.ndarray) -> np.ndarray:
        self.stack[:-1] = self.stack[1:]
        self.stack[-1] = np.clip(np.rint(self.rows @ frame @ self.cols.T), 0, 255)
        return self.stack.copy()

    def _repeat(self, action: int):
        total, previous = 0.0, None
        for _ in range(self.frameskip):
            current = previous
            frame, reward, terminated, truncated, info = self.env.step(action)
            previous = frame
            total += float(reward)
            if terminated or truncated:
                break
        pooled = frame if current is None else np.maximum(current, frame)
        return pooled, total, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        frame, info = self.env.reset(seed=seed, options=options)
        self.stack[:] = 0
        for _ in range(self.np_random.integers(0, self.noop_max + 1)):
            frame, _, _, _, info = self.env.step(0)
        if self.fire:
            frame, _, _, _, info = self._repeat(1)
        return self._push(frame), info

    def step(self, action: int):
        frame, reward, terminated, truncated, info = self._repeat(action)
        return self._push(frame), reward, terminated, truncated, info


def make_eval_env(env_id: str, video_folder: str | None = None) -> gym.Env:
    """One gymnasium ALE env of `env_id` (same game and protocol) with the training preprocessing, whole games."""
    gym.register_envs(ale_py)
    env = gym.make(env_id, obs_type="grayscale", frameskip=1, render_mode="rgb_array" if video_folder else None)
    if video_folder:
        env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
    return AtariPreprocessing(env)


def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Nature CNN trunk shared by a categorical policy head and a value head (CleanRL's Atari agent)."""

    def __init__(self, num_actions: int, bf16: bool = False):
        super().__init__()
        self.bf16 = bf16
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def trunk(self, obs: torch.Tensor) -> torch.Tensor:
        """Features of uint8 frames, converted here (per minibatch) to the weights' dtype and scaled to [0, 1].

        With `bf16` the trunk (nearly all the arithmetic) runs under bfloat16 autocast and its features come back
        in the weights' dtype, so the heads, the log-probabilities and the losses keep full precision.
        """
        x = obs.to(self.critic.weight.dtype) / 255.0
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            hidden = self.network(x)
        return hidden.to(x.dtype)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probability of `actions`, policy entropy and value at `obs`: all the loss needs, in one DDP call."""
        hidden = self.trunk(obs)
        log_probs = torch.log_softmax(self.actor(hidden), dim=-1)
        log_prob = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob, entropy, self.critic(hidden).squeeze(-1)

    @torch.inference_mode()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampled (or modal) actions, their log-probabilities and the values at `obs`, for rollouts."""
        hidden = self.trunk(obs)
        log_probs = torch.log_softmax(self.actor(hidden), dim=-1)
        actions = log_probs.argmax(-1) if deterministic else torch.multinomial(log_probs.exp(), 1).squeeze(-1)
        return actions, log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1), self.critic(hidden).squeeze(-1)

    @torch.inference_mode()
    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.trunk(obs)).squeeze(-1)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminations: torch.Tensor,
    episode_ends: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE-lambda advantages and value targets (advantages + values) for tensors of shape [T, envs].

    `next_values[t]` is V of the state that followed step t in its own episode (V(final observation) where the
    episode was truncated); `terminations[t]` zeroes it; `episode_ends[t]` (terminated or truncated, a lost life
    included) stops the advantage of the next episode from flowing back into step t.
    """
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * (1.0 - terminations[t]) * next_values[t] - values[t]
        next_advantage = delta + gamma * gae_lambda * (1.0 - episode_ends[t]) * next_advantage
        advantages[t] = next_advantage
    return advantages, advantages + values


class NonFiniteError(Exception):
    """A non-finite loss or gradient, raised alike on every rank (DDP gave every rank the same averaged gradient)."""


def minibatch_order(args: Args, device: torch.device) -> torch.Tensor:
    """[update_epochs, num_minibatches, local_minibatch_size] indices into the local batch; one shuffle per epoch."""
    shuffles = [torch.randperm(args.local_batch_size, device=device) for _ in range(args.update_epochs)]
    return torch.stack(shuffles).reshape(args.update_epochs, args.num_minibatches, args.local_minibatch_size)


def update(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], order: torch.Tensor, args: Args
) -> tuple[torch.Tensor, float]:
    """PPO's clipped-surrogate epochs on this rank's batch; `model` is the DDP-wrapped agent (or a plain one alone).

    Minibatch k of epoch e is `order[e, k]` on this rank; the world minibatch is the union over ranks, so with
    equal local sizes DDP's averaged gradient is the gradient of the world minibatch's mean loss. Returns the
    world-averaged [policy_loss, value_loss, entropy, old_approx_kl, approx_kl, clipfrac] of the last minibatch
    (clipfrac: mean over all minibatches so far, as CleanRL logs them) and the seconds counted as sync time.
    """
    # DDP's gradient allreduce runs inside backward, overlapped with it, so it cannot be timed apart: sync time
    # counts the backward passes plus the explicit collectives (compare with a 1-rank run for the comm share)
    sync_time = 0.0
    start = time.perf_counter()
    # the world-wide mean and std of every minibatch this update will see, in one collective
    adv_mean, adv_std = global_mean_std(batch["advantages"][order])
    sync_time += time.perf_counter() - start
    parameters = list(model.parameters())
    clipfracs = []
    for epoch, epoch_order in enumerate(order):
        for k, index in enumerate(epoch_order):
            new_log_prob, entropy, new_value = model(batch["obs"][index], batch["actions"][index])
            log_ratio = new_log_prob - batch["log_probs"][index]
            ratio = log_ratio.exp()
            with torch.no_grad():
                # http://joschu.net/blog/kl-approx.html
                old_approx_kl = (-log_ratio).mean()
                approx_kl = ((ratio - 1) - log_ratio).mean()
                clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).to(ratio.dtype).mean())

            advantages = batch["advantages"][index]
            if args.norm_adv:
                advantages = (advantages - adv_mean[epoch, k]) / (adv_std[epoch, k] + 1e-8)
            policy_loss_unclipped = -advantages * ratio
            policy_loss_clipped = -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            policy_loss = torch.max(policy_loss_unclipped, policy_loss_clipped).mean()

            returns, old_values = batch["returns"][index], batch["values"][index]
            if args.clip_vloss:
                value_loss_unclipped = (new_value - returns) ** 2
                value_clipped = old_values + torch.clamp(new_value - old_values, -args.clip_coef, args.clip_coef)
                value_loss = 0.5 * torch.max(value_loss_unclipped, (value_clipped - returns) ** 2).mean()
            else:
                value_loss = 0.5 * ((new_value - returns) ** 2).mean()
            entropy_loss = entropy.mean()
            loss = policy_loss - args.ent_coef * entropy_loss + args.vf_coef * value_loss

            optimizer.zero_grad()
            start = time.perf_counter()
            loss.backward()  # DDP averages the gradients over ranks here
            sync_time += time.perf_counter() - start
            grad_norm = nn.utils.clip_grad_norm_(parameters, args.max_grad_norm)  # after the sync: alike everywhere
            if not torch.isfinite(grad_norm):  # a NaN or inf on any rank spread through DDP's average to every rank
                raise NonFiniteError("a non-finite loss or gradient")
            optimizer.step()

        # one collective per epoch: world-averaged statistics, which also decide target_kl alike on every rank
        start = time.perf_counter()
        last = [policy_loss, value_loss, entropy_loss, old_approx_kl, approx_kl, torch.stack(clipfracs).mean()]
        stats = allreduce_mean(torch.stack([value.detach() for value in last]).double())
        sync_time += time.perf_counter() - start
        if args.target_kl is not None and stats[4] > args.target_kl:
            break
    return stats, sync_time


# --- checkpoint and evaluation ---------------------------------------------------------------------


def save_checkpoint(path: str, agent: Agent, args: Args, **state) -> None:
    """Everything an evaluation needs (no normalisation statistics here), plus `state` (what a resumed run needs),
    written atomically: a kill at any moment leaves the previous file intact."""
    payload = {
        "script": SCRIPT,
        "env_id": args.env_id,
        "num_actions": agent.actor.out_features,
        "args": asdict(args),
        "model": agent.state_dict(),
        **state,
    }
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
    """Play `args.eval_episodes` whole games with one env; returns their raw scores."""
    env = make_eval_env(env_id, video_folder)
    device = next(agent.parameters()).device
    returns = []
    obs, _ = env.reset(seed=args.seed)
    episode_return = 0.0
    while len(returns) < args.eval_episodes:
        obs_tensor = torch.as_tensor(obs, device=device).unsqueeze(0)
        action, _, _ = agent.act(obs_tensor, deterministic=args.eval_deterministic)
        obs, reward, terminated, truncated, _ = env.step(int(action[0]))
        episode_return += reward
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
    if args.capture_video:
        check_moviepy()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    agent = Agent(checkpoint["num_actions"], bf16=args.bf16).to(memory_format=torch.channels_last)
    agent.load_state_dict(checkpoint["model"])
    video_folder = os.path.join(os.path.dirname(args.eval_checkpoint), "videos") if args.capture_video else None
    returns = evaluate(agent, checkpoint["env_id"], args, video_folder)
    print(f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} return_std={np.std(returns):.2f}")


# --- arguments, batch table, logging ---------------------------------------------------------------


def check_moviepy() -> None:
    try:
        import moviepy  # noqa: F401
    except ImportError:
        fail("--capture-video needs moviepy: pip install moviepy")


def check_args(args: Args, world_size: int) -> dict:
    """Derive the batch arithmetic and refuse what cannot run, before any env or process group exists.

    Returns the game settings of `--env-id` for make_env.
    """
    if args.nprocs < 1:
        fail(f"--nprocs must be at least 1, got {args.nprocs}")
    for name in ("total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "update_epochs", "eval_episodes"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.env_threads < 0 or args.torch_threads < 0 or args.dist_timeout <= 0:
        fail("--env-threads and --torch-threads must be >= 0 (0 = automatic) and --dist-timeout > 0")
    if args.checkpoint_every < 0 or args.check_sync_every < 0:
        fail("--checkpoint-every and --check-sync-every must be >= 0 (0 = off)")
    if args.target_kl is not None and args.target_kl <= 0:
        fail(f"--target-kl must be positive (or left out to switch early stopping off), got {args.target_kl}")
    args.world_size = world_size
    args.local_batch_size = args.local_num_envs * args.num_steps
    if args.local_batch_size % args.num_minibatches:
        fail(
            f"the local batch of --local-num-envs {args.local_num_envs} x --num-steps {args.num_steps} = "
            f"{args.local_batch_size} does not split into --num-minibatches {args.num_minibatches}; "
            f"choose sizes whose product is a multiple of {args.num_minibatches}"
        )
    args.local_minibatch_size = args.local_batch_size // args.num_minibatches
    args.batch_size = args.local_batch_size * world_size
    args.minibatch_size = args.local_minibatch_size * world_size
    args.num_iterations = args.total_timesteps // args.batch_size
    if args.num_iterations < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one iteration's global batch of "
            f"{args.batch_size} ({world_size} ranks x {args.local_batch_size}): zero iterations; "
            "raise --total-timesteps"
        )
    settings = atari_settings(args.env_id)
    if args.capture_video:
        check_moviepy()
    check_compile_support(args)
    return settings


def check_compile_support(args: Args) -> None:
    """torch.compile builds C++ kernels on CPU: without a compiler it would fail deep inside the first update."""
    compiler = os.environ.get("CXX", "g++")
    if args.compile and not (args.cuda and torch.cuda.is_available()) and shutil.which(compiler) is None:
        fail(f"--compile on CPU needs a C++ compiler and {compiler!r} is not on PATH: install g++ or drop --compile")


def print_batch_table(args: Args) -> None:
    rows = [
        ("ranks", args.world_size, ""),
        ("envs", args.local_num_envs, args.world_size * args.local_num_envs),
        ("steps per env", args.num_steps, args.num_steps),
        ("batch", args.local_batch_size, args.batch_size),
        ("minibatches", args.num_minibatches, args.num_minibatches),
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
    finished: torch.Tensor,
    stats: torch.Tensor,
    explained_variance: float,
    times: tuple[float, float, float],
    learning_rate: float,
) -> None:
    """Write one iteration's world-wide scalars to TensorBoard and print the progress line (rank 0)."""
    sps = int((global_step - start_step) / (time.time() - train_start))
    return_sum, length_sum, games = finished.tolist()[:3]
    if games:
        writer.add_scalar("charts/episodic_return", return_sum / games, global_step)
        writer.add_scalar("charts/episodic_length", length_sum / games, global_step)
    policy_loss, value_loss, entropy, old_approx_kl, approx_kl, clipfrac = stats.tolist()
    for key, value in (
        ("charts/SPS", sps),
        ("charts/learning_rate", learning_rate),
        ("losses/policy_loss", policy_loss),
        ("losses/value_loss", value_loss),
        ("losses/entropy", entropy),
        ("losses/old_approx_kl", old_approx_kl),
        ("losses/approx_kl", approx_kl),
        ("losses/clipfrac", clipfrac),
        ("losses/explained_variance", explained_variance),
        ("perf/rollout_time", times[0]),
        ("perf/update_time", times[1]),
        ("perf/sync_time", times[2]),
    ):
        writer.add_scalar(key, value, global_step)
    recent = f"{return_sum / games:.1f}" if games else "n/a"
    print(f"iteration {iteration}/{args.num_iterations} step {global_step} SPS {sps} return {recent}", flush=True)


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent (unwrapped)."""
    # --- launch and set-up ---
    _, world_size, _, _ = read_launcher_environment()
    if args.nprocs > 1 and world_size == 1:
        relaunch_under_torchrun(args.nprocs)
    if args.eval_checkpoint:
        return run_evaluation(args)
    settings = check_args(args, world_size)
    run_name = resolve_run_name(args)
    checkpoint = resume_checkpoint(args, run_name, world_size)
    rank, world_size, device = init_distributed(args)
    resumed_iteration = checkpoint["iteration"] if checkpoint else 0
    check_same_command(args, resumed_iteration)
    restarts = checkpoint["restarts"] + 1 if checkpoint else 0

    # a resumed run starts fresh games, on envs seeded after all the earlier attempts' envs
    index_offset = restarts * world_size * args.local_num_envs
    envs = make_env(settings, args.local_num_envs, args.env_threads or cores_per_rank())
    next_obs, info = envs.reset(seed=np.array(env_seeds(args.seed, rank, args.local_num_envs, index_offset)))
    games = GameTracker(info)

    start_time = torch.tensor(int(time.time()), dtype=torch.int64, device=device)
    dist.broadcast(start_time, src=0)  # every rank names the run folder alike
    run_name = run_name or f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{start_time.item()}"
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

    # identical initial weights everywhere: built from `seed`; DDP also broadcasts rank 0's at construction
    torch.manual_seed(args.seed)
    if args.bf16 and rank == 0 and not has_native_bf16(device):
        print(f"{SCRIPT}: warning: this {device.type} emulates bfloat16, so --bf16 is slower here", file=sys.stderr)
    # channels-last convolutions: about 1.3x the fp32 update on CPU (oneDNN's blocked layout), and what bf16 GPUs want
    agent = Agent(int(envs.single_action_space.n), bf16=args.bf16).to(device, memory_format=torch.channels_last)
    if checkpoint:
        agent.load_state_dict(checkpoint["model"])
    if args.compile:  # only the update's calls, agent(obs, actions); rollouts call agent.act, left eager
        agent.compile(fullgraph=True, dynamic=False)
    model = DDP(agent, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, eps=1e-5)
    random.seed(rank_seed(args.seed, rank))
    np.random.seed(rank_seed(args.seed, rank))
    torch.manual_seed(rank_seed(args.seed, rank))
    torch.backends.cudnn.deterministic = args.torch_deterministic
    global_step = 0
    if checkpoint:  # optimizer, position and this rank's random streams as they were
        optimizer.load_state_dict(checkpoint["optimizer"])
        set_rng_states(checkpoint["rng"][rank])
        global_step = checkpoint["global_step"]

    # rollout storage, one row per step of the local envs; frames stay uint8 until a minibatch needs them
    shape = (args.num_steps, args.local_num_envs)
    obs_shape = envs.single_observation_space.shape
    obs_buf = torch.zeros(shape + obs_shape, dtype=torch.uint8, device=device)
    actions_buf = torch.zeros(shape, dtype=torch.long, device=device)
    log_probs_buf = torch.zeros(shape, device=device)
    values_buf = torch.zeros(shape, device=device)
    final_values_buf = torch.zeros(shape, device=device)  # V(final observation) where a game was truncated
    rewards_buf = np.zeros(shape, dtype=np.float32)
    terminations_buf = np.zeros(shape, dtype=np.float32)
    episode_ends_buf = np.zeros(shape, dtype=np.float32)
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
                learning_rate = args.learning_rate
                if args.anneal_lr:
                    learning_rate *= 1.0 - (iteration - 1.0) / args.num_iterations
                    optimizer.param_groups[0]["lr"] = learning_rate

                # --- rollout (the unwrapped agent: no DDP hooks) ---
                rollout_start = time.perf_counter()
                finished = np.zeros(3)  # world-summed below: raw scores, lengths and count of games ended
                for step in range(args.num_steps):
                    obs = torch.from_numpy(next_obs).to(device)
                    obs_buf[step] = obs
                    action, log_probs_buf[step], values_buf[step] = agent.act(obs)
                    actions_buf[step] = action
                    next_obs, reward, terminated, truncated, info = envs.step(action.cpu().numpy())
                    rewards_buf[step] = np.clip(reward, -1, 1)  # the learner sees clipped rewards, the log raw scores
                    terminations_buf[step] = terminated  # a lost life included
                    episode_ends_buf[step] = terminated | truncated
                    game_over, game_returns, game_lengths = games.step(reward, terminated, truncated, info)
                    if game_over.any():
                        finished += (game_returns.sum(), game_lengths.sum(), len(game_returns))
                        cut = truncated & ~terminated
                        if cut.any():  # truncation is not termination: bootstrap from V(final observation)
                            final_obs = torch.from_numpy(info["final_obs"][cut]).to(device)
                            final_values_buf[step, torch.from_numpy(cut).to(device)] = agent.value(final_obs)
                global_step += args.batch_size
                last_values = agent.value(torch.from_numpy(next_obs).to(device))
                rollout_time = time.perf_counter() - rollout_start

                # --- GAE ---
                rewards = torch.from_numpy(rewards_buf).to(device)
                terminations = torch.from_numpy(terminations_buf).to(device)
                episode_ends = torch.from_numpy(episode_ends_buf).to(device)
                next_values = torch.cat([values_buf[1:], last_values.unsqueeze(0)])
                next_values = torch.where(episode_ends > 0, final_values_buf, next_values)
                advantages, returns = compute_gae(
                    rewards, values_buf, next_values, terminations, episode_ends, args.gamma, args.gae_lambda
                )
                final_values_buf.zero_()
                batch = {
                    "obs": obs_buf.reshape((-1,) + obs_shape),
                    "actions": actions_buf.reshape(-1),
                    "log_probs": log_probs_buf.reshape(-1),
                    "values": values_buf.reshape(-1),
                    "advantages": advantages.reshape(-1),
                    "returns": returns.reshape(-1),
                }

                # --- update (through DDP) ---
                update_start = time.perf_counter()
                stats, sync_time = update(model, optimizer, batch, minibatch_order(args, device), args)
                update_time = time.perf_counter() - update_start

                # --- logging (world-wide statistics and any rank's SIGTERM: one all_gather, one all_reduce) ---
                _, stds = global_mean_std(torch.stack([batch["returns"] - batch["values"], batch["returns"]]))
                explained_variance = (1 - stds[0] ** 2 / (stds[1] ** 2).clamp_min(1e-8)).item()
                finished = [*finished, stop_request.requested]
                finished = torch.as_tensor(finished, dtype=torch.float64, device=device)
                dist.all_reduce(finished)
                if rank == 0:
                    log_iteration(
                        writer,
                        args,
                        iteration,
                        global_step,
                        train_start,
                        start_step,
                        finished,
                        stats,
                        explained_variance,
                        (rollout_time, update_time, sync_time),
                        learning_rate,
                    )

                # --- checkpoint (and, on SIGTERM anywhere, stop: every rank decides alike) ---
                if args.check_sync_every and iteration % args.check_sync_every == 0:
                    check_parameters_in_sync(agent, iteration)
                stopping = finished[3].item() > 0
                if stopping or (args.checkpoint_every and iteration % args.checkpoint_every == 0):
                    path = save(iteration)
                    if rank == 0:
                        writer.flush()  # the curves on disk reach the checkpoint, whatever happens next
                        print(f"checkpoint saved to {path}", flush=True)
                if stopping:
                    if rank == 0:
                        resume = f"continue with --resume --run-name {run_name}"
                        print(f"stopped by SIGTERM at iteration {iteration}; {resume}")
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
