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
What a researcher does not edit (launching, run folders, checkpoints, the progress line) is the ddrl package
beside this file, called by its modules' names.
"""

import contextlib
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from ale_py.vector_env import AtariVectorEnv
from torch.nn.parallel import DistributedDataParallel as DDP

from ddrl import checkpoints, checks, collectives, cuda_graphs, env_support, launching, preemption, progress
from ddrl.failures import NonFiniteError, fail, warn

SCRIPT = os.path.basename(__file__)


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
    """if toggled, rank 0 writes `runs/{run_name}/model.safetensors` at the end of training"""
    eval_checkpoint: str | None = None
    """if set, load this model file (or a training checkpoint), play `--eval-episodes` games on rank 0 and exit"""
    eval_episodes: int = 10
    """games played by `--eval-checkpoint` and after training with `--capture-video`"""
    eval_deterministic: bool = False
    """if toggled, evaluation takes the policy's mode instead of sampling"""
    bf16: bool = False
    """if toggled, the CNN trunk runs under bfloat16 autocast (weights, Adam, losses: float32)"""
    compile: bool = False
    """if toggled, the update's Agent calls run through torch.compile (CPU: needs a C++ compiler)"""
    cuda_graph: bool = True
    """if toggled, on a GPU a rollout step is one CUDA graph replay per group of envs (see acting_step); else eager"""
    capture_update: bool = False
    """if toggled, on a GPU the update's minibatch step is one compiled region replayed as CUDA graphs (see
    loss_function; not yet measured on a GPU: docs/gpus.md); else eager"""

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
    env_groups: int = 1
    """the envs step in this many groups in turn, the acting for one group overlapping the others' env step (2 hides
    a GPU's acting behind the envs; not yet measured on a GPU: docs/gpus.md)"""
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


ENV_MEMORY = 4 * 2**20  # bytes one env takes, at most (an ALE game in AtariVectorEnv: 1.7 MiB)
ACTIVATION_MEMORY = 256 * 2**10  # bytes of the Nature CNN's activations per minibatch sample, forward and backward
SIZED_BY = "--local-num-envs x --num-steps (the batch per rank), --update-epochs or --num-minibatches"


def rollout_memory(args: Args, frame_bytes: int) -> tuple[int, str]:
    """What one rank holds for an iteration, in bytes, and the flags that size it: the rollout's frames (on the GPU
    there, counted here alike), an epoch's shuffled copy of the batch and the epochs' orders and advantages, per
    sample; a minibatch's activations through the Nature CNN, forward and backward; and its envs."""
    per_sample = 2 * frame_bytes + 100 + 12 * args.update_epochs
    activations = ACTIVATION_MEMORY * args.local_minibatch_size
    return args.local_batch_size * per_sample + activations + args.local_num_envs * ENV_MEMORY, SIZED_BY


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
        return cuda_graphs.captured_acting_step(policy, obs, actions, log_probs, values, groups)

    def act_eagerly(step: int, frames: np.ndarray, group: slice) -> np.ndarray:
        obs[step, group].copy_(torch.from_numpy(frames), non_blocking=True)
        step_actions, log_probs[step, group], values[step, group] = policy.act(obs[step, group])
        actions[step, group] = step_actions
        return step_actions.cpu().numpy()

    return act_eagerly


ROLLOUT_CHECK_SAMPLES = 32  # frames: their forward costs well under 1% of an iteration


def rollout_probe(policy: RolloutPolicy, shape: tuple[int, ...], device: torch.device) -> Batch:
    """What `policy` does on random frames of `shape`: actions, log-probabilities and values."""
    obs = torch.randint(0, 256, (ROLLOUT_CHECK_SAMPLES, *shape), dtype=torch.uint8, device=device)
    actions, log_probs, values = policy.act(obs)
    checks.check_one_per_row(log_probs, values, ROLLOUT_CHECK_SAMPLES, "Agent.policy_value")
    return {"obs": obs, "actions": actions, "log_probs": log_probs, "values": values}


def check_rollout_policy(agent: Agent, batch: Batch, when: str, count: int = ROLLOUT_CHECK_SAMPLES) -> None:
    """Stop unless Agent.log_prob_entropy_value gives `batch`'s log-probabilities and values, in
    its first `count` rows: as many as one act saw, so the same kernels round bfloat16 alike."""
    rows = {key: batch[key][:count] for key in ("obs", "actions", "log_probs", "values")}
    with torch.no_grad():  # eager, with --compile too
        log_prob, _, value = agent.log_prob_entropy_value(rows["obs"], rows["actions"])
        distribution = type(agent.policy_value(rows["obs"])[0]).__name__  # CategoricalActions, or an edit's class
    pairs = {"log-probabilities": (log_prob, rows["log_probs"]), "values": (value, rows["values"])}
    both = f"{distribution}.sample (in RolloutPolicy.act) and {distribution}.log_prob_entropy"
    checks.check_agreement(when, f"{both} (both on Agent.policy_value)", **pairs)


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
    model: nn.Module, mb: Batch, adv_mean: torch.Tensor | None, adv_std: torch.Tensor | None, args: Args
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped loss on one minibatch, and the numbers logged as `losses/NAME` (the world's mean, averaged once
    per epoch), advantages normalised world-wide."""
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
    logged = {
        "policy_loss": pg_loss.detach(),
        "value_loss": v_loss.detach(),
        "entropy": entropy_loss.detach(),
        "old_approx_kl": old_approx_kl,
        "approx_kl": approx_kl,
        "clipfrac": clipfrac,
    }
    return loss, logged


def loss_function(args: Args, device: torch.device) -> Callable:
    """minibatch_loss as the update calls it: eager (on the CPU --compile compiles the Agent); on a GPU with
    --capture-update, one compiled region (the Agent's forward, the loss and, through autograd, the backward) of static
    shapes unless preempted, replayed as CUDA graphs: a minibatch step is then a few launches, not hundreds."""
    if device.type != "cuda" or not args.capture_update:
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
) -> tuple[dict[str, float], float]:  # fmt: skip
    """PPO's epochs through `model` (DDP's Agent): minibatch k of epoch e is piece k, `sizes[rank, k]` long, of
    minibatches(batch, orders[e]); the world's is the ranks' union. Returns the world-averaged numbers minibatch_loss
    logs, and the backward and sync time."""
    parameters = list(model.parameters())
    sync_time = 0.0
    if sizes is None:
        sizes = minibatch_sizes([orders.shape[1]] * collectives.group_size(), args.num_minibatches)
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
            loss, logged = loss_fn(model, mb, *adv_moments, args)
            if weights is not None:  # this rank's share of the world minibatch: the ranks' mean is the union's
                loss = loss * weights[k]
                logged = {name: value * weights[k] for name, value in logged.items()}
            clipfracs.append(logged["clipfrac"].clone())  # kept past the next step
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
        logged["clipfrac"] = torch.stack(clipfracs).mean()  # the last minibatch's numbers, clipfrac over all so far
        world = collectives.allreduce_mean(torch.stack(list(logged.values())).double())
        losses = dict(zip(logged, world, strict=True))
        sync_time += time.perf_counter() - start
        if args.target_kl is not None and losses["approx_kl"] > args.target_kl:
            break
    if fused and nonfinite.item():  # the steps before the first non-finite gradient stand
        raise NonFiniteError("a non-finite loss or gradient")
    return {name: value.item() for name, value in losses.items()}, sync_time


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
    if problem := checks.runtime_args_problem(args):
        return problem
    rules = (
        (
            "at least 1",
            lambda value: value >= 1,
            ("total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "update_epochs", "env_groups"),
        ),
        ("at least 0 (0 = automatic)", lambda value: value >= 0, ("env_threads",)),
        ("at most 65536 (envs per rank)", lambda value: value <= 2**16, ("local_num_envs", "env_threads")),
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
    if args.local_num_envs % args.env_groups:
        return f"--local-num-envs {args.local_num_envs} does not split into --env-groups {args.env_groups}"
    if not (0 <= args.preempt_fraction <= 1 and 0 < args.min_rollout_fraction <= 1):
        return (
            f"--preempt-fraction must lie in [0, 1] (0 = off) and --min-rollout-fraction in (0, 1]; got "
            f"{args.preempt_fraction:g} and {args.min_rollout_fraction:g}"
        )
    return None


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


def evaluate(agent: Agent, env_id: str, args: Args, video_folder: str | None = None) -> list[float]:
    """Play `args.eval_episodes` whole games with one env; returns their raw scores."""
    env = env_support.atari_eval_env(env_id, video_folder)
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


def evaluate_checkpoint(args: Args, run: launching.Run) -> None:
    """`--eval-checkpoint`: play a model file (or training checkpoint) on rank 0 and print one `eval:` line."""
    path = args.eval_checkpoint
    model, _ = checkpoints.read_model(path, Args, args_problem, args.env_id)
    env_id = model["env_id"]
    atari_settings(env_id, f"the env_id of {path}")
    checks.check_video_support(args.capture_video, lambda: env_support.render_one_frame(env_id))
    if run.rank != 0:
        return
    with contextlib.closing(gym.make(env_id)) as env:  # its actions size the head
        agent = Agent(int(env.action_space.n), bf16=args.bf16).to(memory_format=torch.channels_last)
    checkpoints.load_weights(agent, path, model)
    torch.manual_seed(args.seed)  # the policy's sampling: the same --seed plays the same games
    video_folder = os.path.join(os.path.dirname(path), "videos") if args.capture_video else None
    returns = evaluate(agent, env_id, args, video_folder)
    print(f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} return_std={np.std(returns):.2f}")


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    # every flag checked before anything is launched or written; --nprocs N: this command again as N ranks, then exit
    run = launching.launch(args, __file__, "iteration", args_problem)
    if args.eval_checkpoint is not None:
        return evaluate_checkpoint(args, run)
    settings = atari_settings(args.env_id)  # refuses ids whose pixels AtariVectorEnv cannot play
    checks.check_video_support(args.capture_video, lambda: env_support.render_one_frame(args.env_id))
    derive_batch_sizes(args, run.world_size)
    # the process group, and a checkpoint to resume (checked like the flags)
    memory = rollout_memory(args, 4 * 84 * 84)  # a step's 4 stacked 84x84 frames, one byte a pixel
    launching.start_run(run, args.batch_size, args.num_iterations, batch_table(args), args_problem, memory)
    device = run.device
    gpu = device.type == "cuda"

    # --- set-up: envs, initial weights (from `seed`, DDP broadcasts rank 0's), the rank's seeds ---
    index_offset = run.restarts * args.world_size * args.local_num_envs  # resumed: new env seeds
    seeds = np.array(env_seeds(args.seed, run.rank, args.local_num_envs, index_offset))
    groups = env_groups(args.local_num_envs, args.env_groups)
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
        warn(f"this {device.type} emulates bfloat16, so --bf16 is slower here")
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
    iteration, global_step = checkpoints.resume(run, model=agent, optimizer=optimizer)

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
                acting = step < args.num_steps and not preemption.rollout_preempted(
                    run, iteration, step
                )  # DD-PPO: most are done
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
            preemption.rollout_finished(run, iteration)
            last_values = policy.value(torch.from_numpy(next_obs).to(device))
            rollout_time = time.perf_counter() - rollout_start
            sample_counts = [args.local_batch_size] * args.world_size  # each rank's samples
            if args.preempt_fraction:  # one all_gather
                sample_counts = collectives.gather_ints_to_all([collected * args.local_num_envs], device)[:, 0].tolist()
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
        for group_envs in envs:
            group_envs.close()
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
