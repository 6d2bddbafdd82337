"""PPO on Atari, data-parallel with torch DistributedDataParallel over any number of processes.

CleanRL's ppo_atari.py: ale-py's `AtariVectorEnv` with the DQN preprocessing, a Nature CNN trunk
shared by policy and value heads, clipped losses, GAE-lambda, an annealed learning rate. The learner
sees clipped rewards and a lost life as a terminal (then FIRE); TensorBoard logs games' raw scores.

    torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py    # or: --nprocs 2, mpirun, srun

Distributed: `--local-num-envs` and `--num-steps` are per rank. The world's minibatch k is the union
of the ranks' minibatches k: its advantages are normalised with the union's mean and std, and the
gradients averaged by DistributedDataParallel during loss.backward(), so every rank takes the step
one process would take on the whole batch. `--preempt-fraction`: DD-PPO. The plumbing is the ddrl
package; `python -m ddrl.verify COPY.py` checks that a copy still updates as one process would.
"""

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tyro
from ale_py.vector_env import AtariVectorEnv
from annotated_types import Ge, Gt, Interval, Le
from torch.distributions.categorical import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP

import ddrl
from ddrl import (
    atari,
    checks,
    collectives,
    cuda_graphs,
    env_support,
    evaluation,
    machine,
    preemption,
    progress,
    rollout,
)
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
    bf16: bool = False
    """if toggled, the CNN trunk runs under bfloat16 autocast (weights, heads, losses: float32)"""
    compile: bool = False
    """if toggled, the update's Agent calls run through torch.compile (CPU: needs a C++ compiler)"""
    cuda_graph: bool = True
    """if toggled, on a GPU a rollout step is one CUDA graph replay per group of envs; else eager"""
    capture_update: bool = False
    """if toggled, on a GPU the update's minibatch step is captured as CUDA graphs (docs/gpus.md)"""

    # Algorithm specific arguments (names and defaults as in CleanRL's ppo_atari.py)
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of a gymnasium Atari game (`{Game}NoFrameskip-v4` or `ALE/{Game}-v5`)"""
    total_timesteps: Annotated[int, Ge(1), Le(10**15)] = 10_000_000
    """global env steps (4 frames each) over all ranks; sets the number of iterations"""
    learning_rate: Annotated[float, Gt(0), Finite] = 2.5e-4
    """the learning rate of the optimizer (Adam)"""
    local_num_envs: Annotated[int, Interval(ge=1, le=2**16)] = 8
    """envs stepped by each rank"""
    num_steps: Annotated[int, Interval(ge=1, le=10**7)] = 128
    """steps per env per rollout"""
    env_threads: Annotated[int, Interval(ge=0, le=2**16)] = 0
    """AtariVectorEnv threads per rank; 0 = one per env, at most the cores idle at start per rank"""
    env_groups: Annotated[int, Ge(1)] = 1
    """the envs step in this many groups in turn, one group's acting beside the others' env step"""
    anneal_lr: bool = True
    """if toggled, the learning rate decays linearly to zero over the iterations"""
    gamma: Annotated[float, Interval(ge=0, le=1)] = 0.99
    """the discount factor"""
    gae_lambda: Annotated[float, Interval(ge=0, le=1)] = 0.95
    """the lambda of generalized advantage estimation"""
    num_minibatches: Annotated[int, Ge(1)] = 4
    """minibatches per update epoch; the world's minibatch k is every rank's minibatch k"""
    update_epochs: Annotated[int, Interval(ge=1, le=10**4)] = 4
    """passes over the batch per iteration"""
    norm_adv: bool = True
    """if toggled, advantages are normalised with each world minibatch's mean and std"""
    clip_coef: Annotated[float, Ge(0), Finite] = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """if toggled, the value loss is clipped around the rollout's values (the PPO paper's code)"""
    ent_coef: Annotated[float, Ge(0), Finite] = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: Annotated[float, Ge(0), Finite] = 0.5
    """coefficient of the value loss"""
    max_grad_norm: Annotated[float, Gt(0), Finite] = 0.5
    """the maximum norm of the (world-averaged) gradient"""
    target_kl: Annotated[float, Gt(0), Finite] | None = None
    """if set, stop the update epochs once the world-averaged approximate KL exceeds it"""
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
    """The per-rank and world batch sizes, and the batch table; sizes that do not divide stop."""
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
            f"--total-timesteps {args.total_timesteps} is less than one iteration's global batch "
            f"of {args.batch_size} ({world_size} ranks x {args.local_batch_size}): zero "
            "iterations; raise --total-timesteps"
        )
    return [
        ("ranks", world_size, ""),
        ("envs", args.local_num_envs, world_size * args.local_num_envs),
        ("steps per env", args.num_steps, args.num_steps),
        ("batch", args.local_batch_size, args.batch_size),
        ("minibatches", args.num_minibatches, args.num_minibatches),
        ("minibatch", args.local_minibatch_size, args.minibatch_size),
        ("iterations", "", args.num_iterations),
        ("total env steps", "", args.num_iterations * args.batch_size),
    ]


def rollout_memory(args: Args, frame_bytes: int, activation_bytes: int) -> tuple[int, str]:
    """What one rank holds for an iteration, in bytes, and the flags that size it: per sample, the
    frames twice, the orders and advantages; a minibatch's activations; per env, at most 4 MiB."""
    per_sample = 2 * frame_bytes + 100 + 12 * args.update_epochs
    activations = activation_bytes * args.local_minibatch_size
    memory = args.local_batch_size * per_sample + activations + args.local_num_envs * 4 * 2**20
    return (
        memory,
        "--local-num-envs x --num-steps (the batch per rank), --update-epochs or --num-minibatches",
    )


# --- environment, agent -------------------------------------------------------------------------
def make_env(settings: dict, num_envs: int, num_threads: int) -> AtariVectorEnv:
    """This rank's envs, C++ threads with the DQN preprocessing; rewards stay raw (the learner clips
    them), and same-step autoreset keeps every transition real (final frames: info["final_obs"])."""
    return AtariVectorEnv(
        num_envs=num_envs, num_threads=num_threads, **settings, reward_clipping=False,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, episodic_life=False, life_loss_info=True,
        frameskip=4, maxpool=True, stack_num=4, img_height=84, img_width=84, grayscale=True,
        # a reset presses FIRE for one frame, then plays 0-28 no-op frames (0-29 without FIRE)
        use_fire_reset=True, noop_max=30,
    )  # fmt: skip


def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, envs: gym.vector.VectorEnv):
        super().__init__()
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
        self.actor = layer_init(nn.Linear(512, envs.single_action_space.n), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


@torch.inference_mode()
def score_forced_actions(
    agent: Agent, obs: torch.Tensor, actions: torch.Tensor, log_probs: torch.Tensor,
    forced: np.ndarray,
) -> None:  # fmt: skip
    """The rollout's `forced` rows acted FIRE whatever the policy sampled (CleanRL's FireResetEnv):
    store its log-probability under the policy that acted, so the loss learns what the env did."""
    rows = torch.from_numpy(forced).to(obs.device)
    log_probs[rows] = agent.get_action_and_value(obs[rows], actions[rows])[1]


# --- GAE ------------------------------------------------------------------------------------------
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


# --- the loss, the minibatches, the gradient sync (DDP), the update ----------------------------
class ActionAndValue(nn.Module):
    """Agent.get_action_and_value as a forward, the only call whose gradients DDP averages."""

    def __init__(self, agent: Agent):
        super().__init__()
        self.agent = agent

    def forward(self, x: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.agent.get_action_and_value(x, action)


def minibatch_loss(
    model: nn.Module,
    mb: Batch,
    adv_mean: torch.Tensor | None,
    adv_std: torch.Tensor | None,
    args: Args,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped loss on one minibatch, and the numbers logged as `losses/NAME`."""
    _, newlogprob, entropy, newvalue = model(mb["obs"], mb["actions"])  # Agent.get_action_and_value
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
    `local_sizes` long (the one place minibatches are made)."""
    shuffled = {key: value[order] for key, value in batch.items()}
    starts = np.cumsum([0, *local_sizes]).tolist()
    return [
        {key: value[start:end] for key, value in shuffled.items()}
        for start, end in zip(starts[:-1], starts[1:], strict=True)
    ]


def update(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, args: Args,
    orders: torch.Tensor, sizes: torch.Tensor, loss_fn: Callable = minibatch_loss,
) -> tuple[dict[str, float], float]:  # fmt: skip
    """PPO's epochs through `model` (ActionAndValue, in DDP): minibatch k of epoch e is piece k of
    minibatches(batch, orders[e]). Returns the world-averaged losses, and the sync time."""
    parameters = list(model.parameters())
    sync_time = 0.0
    rank = collectives.rank_in()
    local_sizes = sizes[rank].tolist()
    weights = (sizes[rank].double() * len(sizes) / sizes.sum(0)).tolist()
    unequal = bool((sizes != sizes[0, 0]).any())  # a preempted rollout's minibatches are smaller
    checks.check_minibatch_cut(local_sizes, orders.shape[1])
    if args.norm_adv:  # every world minibatch's mean and std, of all epochs, in one collective
        start = time.perf_counter()
        adv = {"advantages": batch["advantages"]}  # the minibatches of the advantages alone
        pieces = [
            mb["advantages"] for order in orders for mb in minibatches(adv, order, local_sizes)
        ]
        shape = (len(orders), args.num_minibatches)
        pieces = pieces if unequal else torch.stack(pieces).view(*shape, -1)
        count, adv_mean, m2 = collectives.moments_over_ranks(pieces)
        adv_mean = adv_mean.view(shape)
        adv_std = torch.sqrt(m2 / (count - 1)).view(shape)  # unbiased, as CleanRL's .std()
        sync_time += time.perf_counter() - start
    clipfracs = []
    fused = optimizer.defaults.get("fused")
    nonfinite = torch.zeros((), device=parameters[0].device) if fused else None
    optimizer.found_inf = nonfinite  # fused Adam skips a step whose flag is set
    for epoch, order in enumerate(orders):
        for k, mb in enumerate(minibatches(batch, order, local_sizes)):
            adv_moments = (adv_mean[epoch, k], adv_std[epoch, k]) if args.norm_adv else (None, None)
            if args.capture_update:  # a new step: a CUDA graph may reuse the last one's outputs
                torch.compiler.cudagraph_mark_step_begin()
            loss, logged = loss_fn(model, mb, *adv_moments, args)
            if unequal:  # this rank's share of the world minibatch: the ranks' mean is the union's
                loss = loss * weights[k]
                logged = {name: value * weights[k] for name, value in logged.items()}
            clipfracs.append(logged["clipfrac"].clone())  # kept past the next step
            optimizer.zero_grad()
            start = time.perf_counter()
            loss.backward()  # DDP averages the (weighted) gradients over ranks here
            sync_time += time.perf_counter() - start
            grad_norm = nn.utils.clip_grad_norm_(parameters, args.max_grad_norm)  # of the world's
            if fused:  # NaN or inf on any rank reaches all; fused Adam reads it on the GPU
                torch.maximum(nonfinite, (~grad_norm.isfinite()).float(), out=nonfinite)
            elif not torch.isfinite(grad_norm):
                raise NonFiniteError("a non-finite loss or gradient")
            optimizer.step()
        start = time.perf_counter()  # one collective an epoch: target_kl decided alike everywhere
        logged["clipfrac"] = torch.stack(clipfracs).mean()  # over every minibatch so far
        world = collectives.allreduce_mean(torch.stack(list(logged.values())).double())
        losses = dict(zip(logged, world, strict=True))
        sync_time += time.perf_counter() - start
        if args.target_kl is not None and losses["approx_kl"] > args.target_kl:
            break
    if fused and nonfinite.item():  # the steps before the first non-finite gradient stand
        raise NonFiniteError("a non-finite loss or gradient")
    return {name: value.item() for name, value in losses.items()}, sync_time


def main(args: Args) -> Agent | None:
    """Train (or, with --eval-checkpoint, evaluate); returns this rank's trained agent."""
    run = ddrl.launch(args)  # every flag checked first; --nprocs N: this command as N ranks
    if args.eval_checkpoint is not None:
        return evaluation.evaluate_checkpoint(args, Agent, atari.eval_env)
    settings = atari.settings(args.env_id)  # refuses ids whose pixels AtariVectorEnv cannot play
    env_support.check_video_support(
        args.capture_video, lambda: env_support.render_one_frame(args.env_id)
    )
    batch_table = derive_batch_sizes(args, run.world_size)
    groups = atari.env_groups(args.local_num_envs, args.env_groups)  # which step in turn
    probe_envs = make_env(settings, 1, 1)
    frame_bytes = int(np.prod(probe_envs.single_observation_space.shape))  # uint8 pixels
    memory = rollout_memory(args, frame_bytes, machine.activation_bytes(Agent, probe_envs))
    probe_envs.close()
    run.start(args.num_iterations * args.batch_size, batch_table, memory)  # says its run folder
    stopping = False
    try:  # from here on a lost peer or a non-finite loss, met alike on every rank, is one line
        device = run.device
        gpu = device.type == "cuda"

        # --- envs (in their groups), the Agent (rank 0's initial weights: DDP), seeds -
        threads = max(1, (args.env_threads or min(run.cores, args.local_num_envs)) // len(groups))
        envs = [make_env(settings, group.stop - group.start, threads) for group in groups]
        first_env = run.first_env_index + run.rank * args.local_num_envs  # after earlier attempts'
        seeds = np.array([args.seed + 10_000 * (first_env + j) for j in range(args.local_num_envs)])
        resets = [
            group_envs.reset(seed=seeds[group])
            for group, group_envs in zip(groups, envs, strict=True)
        ]
        next_obs = np.concatenate([frames for frames, _ in resets])
        trackers = [atari.GameTracker(info) for _, info in resets]  # each group's games
        observation_space = envs[0].single_observation_space
        fire = atari.fire_action(envs[0])
        relaunch = np.zeros(args.local_num_envs, dtype=bool)  # a life was lost: FIRE next
        torch.manual_seed(args.seed)
        agent = Agent(envs[0]).to(device, memory_format=torch.channels_last)  # cuDNN's, oneDNN's
        if args.bf16:  # the trunk only: the heads, the losses and Adam stay float32
            cuda_graphs.run_in_bfloat16(agent.network)  # says so where bfloat16 is emulated
        model = ActionAndValue(agent)  # what the update calls; DDP broadcasts rank 0's weights
        if args.compile and machine.can_compile(device):  # the update's calls, not the acting
            model.compile(fullgraph=True, dynamic=args.preempt_fraction > 0)
        if run.world_size > 1:  # buffers stay each rank's: the sync check finds a per-rank one
            model = DDP(
                model, device_ids=[device.index] if gpu else None, **collectives.KEEP_BUFFERS
            )
        rank_seed = args.seed + 10_000 * run.rank  # SpinningUp's stride: nearby seeds never collide
        random.seed(rank_seed)
        np.random.seed(rank_seed)
        torch.manual_seed(rank_seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=gpu)
        loss_fn = minibatch_loss
        if gpu and args.capture_update:  # forward, loss and backward, replayed as CUDA graphs
            loss_fn = torch.compile(
                minibatch_loss, mode="reduce-overhead", dynamic=args.preempt_fraction > 0
            )
        iteration, global_step = run.resume(agent=agent, optimizer=optimizer)  # if resuming
        rollout_agent = rollout.derive(agent, observation_space, numpy_layers=False)  # no autograd
        probe = rollout.probe(rollout_agent, observation_space, device, count=32)
        acting_kind = "the Agent acting on frames"  # what the rollout checks name
        rollout.check(agent, probe, "at start", acting_kind, rows=32)

        # --- rollout storage: a row per step of this rank's envs, on the device (frames in uint8) -
        shape = (args.num_steps, args.local_num_envs)
        obs = torch.zeros(shape + observation_space.shape, dtype=torch.uint8, device=device)
        actions = torch.zeros(shape, dtype=torch.long, device=device)
        logprobs = torch.zeros(shape, device=device)
        values = torch.zeros(shape, device=device)
        act = cuda_graphs.acting_step(
            agent, obs, actions, logprobs, values, groups, graph=args.cuda_graph and gpu
        )
        final_values = np.zeros(shape, np.float32)  # V(final observation) where truncated
        rewards = np.zeros(shape, np.float32)  # GAE's inputs, on the host with the envs
        terminations = np.zeros(shape, np.float32)
        episode_ends = np.zeros(shape, np.float32)  # terminated or truncated
        forced = np.zeros(shape, dtype=bool)  # rows that acted FIRE, not the sampled action

        while global_step < run.total_steps:  # the world's env steps: preemption collects fewer
            iteration += 1
            if args.anneal_lr:  # linearly to zero over the run's env steps
                frac = 1.0 - global_step / run.total_steps
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # --- rollout: each group receives its last step, acts, and steps while the next acts --
            rollout_start = time.perf_counter()
            finished = {"episodes": 0, "episode_return": 0.0, "episode_length": 0}  # whole games
            for step in range(args.num_steps + 1):
                acting = step < args.num_steps and not preemption.rollout_preempted(
                    run.world, args, iteration, step
                )
                for group, group_envs, games in zip(groups, envs, trackers, strict=True):
                    if step > 0:  # the group's envs stepped while the groups after it acted
                        row = step - 1
                        frames, reward, terminated, truncated, info = group_envs.recv()
                        next_obs[group] = frames
                        rewards[row, group] = np.clip(reward, -1, 1)  # for the learner; logged raw
                        terminations[row, group] = terminated
                        episode_ends[row, group] = terminated | truncated
                        game_over, scores, lengths = games.step(reward, terminated, truncated, info)
                        relaunch[group] = terminated & ~game_over  # a lost life: the game goes on
                        if game_over.any():
                            finished["episodes"] += len(scores)
                            finished["episode_return"] += float(scores.sum())
                            finished["episode_length"] += int(lengths.sum())
                            cut = truncated & ~terminated  # bootstrap from V(final obs)
                            if cut.any():
                                final_value = rollout_agent.get_value(info["final_obs"][cut])
                                final_values[row, group][cut] = final_value.flatten()
                    if acting:
                        env_action = act(step, next_obs[group], group)  # row `step` of obs, ...
                        # FireResetEnv: FIRE after a lost life, stored as the action taken
                        if fire is not None and relaunch[group].any():
                            env_action = np.where(relaunch[group], fire, env_action)
                            actions[step, group] = torch.from_numpy(env_action)
                            forced[step, group] = relaunch[group]
                        group_envs.send(env_action)  # the envs step while the next group acts
                if not acting:
                    collected = step  # steps per env: all, unless preemption cut the rollout short
                    break
            preemption.rollout_finished(run.world, args, iteration)
            if forced.any():  # their log-probabilities, under the weights that acted
                score_forced_actions(agent, obs, actions, logprobs, forced)
                forced[:] = False
            last_values = torch.from_numpy(rollout_agent.get_value(next_obs).flatten())
            rollout_time = time.perf_counter() - rollout_start
            sample_counts = [args.local_batch_size] * args.world_size  # each rank's samples
            if args.preempt_fraction:  # one all_gather
                local_count = [collected * args.local_num_envs]
                sample_counts = collectives.gather_ints_to_all(local_count, device)[:, 0].tolist()
            global_step += sum(sample_counts)

            # --- GAE, on the host (no kernel launches): bootstrap from the next row's value ---
            rows = slice(collected)  # the rollout's rows; a cut one bootstraps as a full one does
            ends = torch.from_numpy(episode_ends[rows])
            kept_values = values[rows].cpu()
            next_values = torch.cat([kept_values[1:], last_values.unsqueeze(0)])
            next_values = torch.where(ends > 0, torch.from_numpy(final_values[rows]), next_values)
            advantages, returns = compute_gae(
                torch.from_numpy(rewards[rows]), kept_values, next_values,
                torch.from_numpy(terminations[rows]), ends, args.gamma, args.gae_lambda,
            )  # fmt: skip
            final_values[:] = 0.0
            batch = {
                "obs": obs[rows].flatten(0, 1),
                "actions": actions[rows].flatten(0, 1),
                "log_probs": logprobs[rows].flatten(0, 1),
                "values": values[rows].flatten(0, 1),
                "advantages": advantages.flatten().to(device),
                "returns": returns.flatten().to(device),
            }
            rollout.check(agent, batch, f"at iteration {iteration}", acting_kind, groups[0].stop)

            # --- update (through DDP) ---
            update_start = time.perf_counter()
            orders = [
                torch.randperm(returns.numel(), device=device) for _ in range(args.update_epochs)
            ]
            orders = torch.stack(orders)
            sizes = minibatch_sizes(sample_counts, args.num_minibatches)
            losses, sync_time = update(model, optimizer, batch, args, orders, sizes, loss_fn)
            update_time = time.perf_counter() - update_start

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
        for group_envs in envs:
            group_envs.close()
        run.finish(agent, stopping, atari.eval_env)
    except (NonFiniteError, RuntimeError) as error:  # met alike on every rank: one line, no hang
        run.stop_on_error(
            error, "lower --learning-rate or check the env's observations and rewards"
        )
    return agent


if __name__ == "__main__":
    main(tyro.cli(Args))
