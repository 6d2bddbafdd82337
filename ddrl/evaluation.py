"""Evaluation: whole episodes played with one env by the Agent (through the rollout derived from
it), for --eval-checkpoint and for the videos --capture-video films after training."""

import inspect
import os
import random
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

from ddrl import checkpoints, env_support, failures, machine, rollout, run_folders
from ddrl.failures import fail


def evaluate_checkpoint(
    args,
    agent_class: type,
    make_env: Callable,
    observations: type = gym.Space,
    actions: type = gym.Space,
) -> None:
    """--eval-checkpoint: play the file on rank 0 with the env and network its args describe (the
    Agent sized on no device first) and print one `eval:` line."""
    path = args.eval_checkpoint
    header, found, saved = checkpoints.read_model(path, type(args), args.env_id)
    video_folder = os.path.join(os.path.dirname(path), "videos") if args.capture_video else None
    env_support.check_video_support(
        args.capture_video, lambda: env_support.render_one_frame(saved.env_id)
    )
    given = f"the env_id of {path}, {saved.env_id!r},"
    env_support.check_env(make_env(saved), given, observations, actions)  # what the script trains
    if failures.this_rank() != 0:
        return
    if video_folder:
        run_folders.real_folder(video_folder)
    envs = gym.vector.SyncVectorEnv(
        [make_env(saved, video_folder)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    with torch.device("meta"):  # sizes only: nothing allocated
        shapes = build_agent(agent_class, envs, saved)
    checkpoints.check_weights_fit(path, header, found, shapes)
    needed = 2 * sum(
        tensor.numel() * tensor.element_size() for tensor in shapes.state_dict().values()
    )
    if needed > machine.available_memory():
        fail(
            f"{path}: the network its args describe takes {machine.size(needed)} to load, more "
            f"than the {machine.size(machine.available_memory())} this machine has available: "
            "evaluate it on a larger machine"
        )
    agent = build_agent(agent_class, envs, saved)
    checkpoints.load_weights(agent, path, header)
    random.seed(args.seed)  # sampling, like the env, follows --seed: repeatable evaluations
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    returns = play(agent, envs, args)
    print(
        f"eval: episodes={len(returns)} return_mean={np.mean(returns):.2f} "
        f"return_std={np.std(returns):.2f}"
    )


def build_agent(agent_class: type, envs: gym.vector.VectorEnv, args) -> nn.Module:
    """The Agent as a script's main builds it, from the envs and the args its parameters name."""
    names = list(inspect.signature(agent_class).parameters)[1:]
    return agent_class(envs, **{name: getattr(args, name) for name in names if hasattr(args, name)})


def film(agent: nn.Module, make_env: Callable, args, video_folder: str) -> str:
    """--capture-video after training: rank 0 plays episodes into `video_folder`; why not, or ''."""
    if unfit := run_folders.folder_problem(video_folder, make=True):
        return f"trained, but could not film into {video_folder}: {unfit}"
    envs = gym.vector.SyncVectorEnv(
        [make_env(args, video_folder)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    play(agent, envs, args)
    return ""


def play(agent: nn.Module, envs: gym.vector.VectorEnv, args) -> list[float]:
    """The returns of `args.eval_episodes` episodes on `envs` (one env), Box actions clipped."""
    numpy_layers = getattr(args, "numpy_rollout", False)  # the MLP scripts' flag
    rollout_agent = rollout.derive(
        agent, envs.single_observation_space, numpy_layers, args.eval_deterministic
    )
    space = envs.single_action_space
    returns = []
    episode_return = 0.0
    obs, _ = envs.reset(seed=args.seed)
    while len(returns) < args.eval_episodes:
        if np.issubdtype(obs.dtype, np.floating):
            obs = obs.astype(np.float32)
        action = rollout_agent.get_action_and_value(obs)[0]
        if isinstance(space, gym.spaces.Box):
            action = np.clip(action, space.low, space.high)
        obs, reward, terminated, truncated, _ = envs.step(action)
        episode_return += float(reward[0])
        if terminated[0] or truncated[0]:
            returns.append(episode_return)
            episode_return = 0.0
    envs.close()
    return returns
