"""What ale-py needs beside the Atari script's algorithm: AtariVectorEnv's settings, env groups,
FIRE, raw game scores, and the training protocol on one gymnasium env (evaluation and videos)."""

from collections.abc import Callable

import ale_py
import gymnasium as gym
import numpy as np
from ale_py.vector_env import AtariVectorEnv

from ddrl import failures
from ddrl.failures import fail


class GameTracker:
    """Raw score and length (agent steps) of every env's current game, across its lives."""

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


class TrainingProtocol(gym.Wrapper):
    """The Atari script's make_env protocol on one gymnasium ALE env (grayscale, frameskip=1), for
    evaluation; an episode is a whole game."""

    def __init__(self, env: gym.Env, frameskip: int = 4, noop_max: int = 30, size: int = 84):
        super().__init__(env)
        self.frameskip = frameskip
        self.noop_max = noop_max
        height, width = env.observation_space.shape
        self.rows = area_resize_matrix(height, size)
        self.cols = area_resize_matrix(width, size)
        self.stack = np.zeros((4, size, size), dtype=np.uint8)  # 4 frames stacked
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


def settings(env_id: str, given: str = "--env-id") -> dict:
    """AtariVectorEnv's game and protocol arguments for a gymnasium Atari id; others stop here."""
    gym.register_envs(ale_py)
    example = "such as BreakoutNoFrameskip-v4"
    try:
        spec = gym.spec(env_id)  # `module:EnvId` imports the module first
    except Exception as error:  # an unknown id, or a module that does not import
        fail(
            f"unknown {given} {env_id!r} ({type(error).__name__}: {error}); pass an Atari game "
            f"{example}"
        )
    given = f"{given} {env_id}"
    if spec.entry_point not in ("ale_py.env:AtariEnv", ale_py.env.AtariEnv):
        fail(f"{given} is not an Atari game; {failures.script} trains ALE games {example}")
    kwargs = spec.kwargs
    if kwargs.get("obs_type", "rgb") == "ram":
        fail(
            f"{given} observes RAM; {failures.script} learns from pixels: use the id without '-ram'"
        )
    if not isinstance(kwargs.get("frameskip", 1), int):
        fix = "use the NoFrameskip-v4 or ALE/...-v5 id of the game"
        fail(f"{given} skips a random number of frames, which AtariVectorEnv cannot do; {fix}")
    return {
        "game": kwargs["game"],
        "repeat_action_probability": kwargs.get("repeat_action_probability", 0.25),
        "full_action_space": kwargs.get("full_action_space", False),
        "max_num_frames_per_episode": kwargs.get("max_num_frames_per_episode") or 108_000,
    }


def env_groups(num_envs: int, groups: int) -> list[slice]:
    """The envs of a rank as `groups` equal slices, which step in turn while the next group acts."""
    if num_envs % groups:
        fail(f"--local-num-envs {num_envs} does not split into --env-groups {groups}")
    size = num_envs // groups
    return [slice(start, start + size) for start in range(0, num_envs, size)]


def fire_action(envs: AtariVectorEnv) -> int | None:
    """The index of FIRE among the game's actions, None without it (FireResetEnv's test)."""
    action_set = list(envs.ale.get_action_set())
    return action_set.index(ale_py.Action.FIRE) if ale_py.Action.FIRE in action_set else None


def area_resize_matrix(source: int, target: int) -> np.ndarray:
    """[target, source] pixel overlaps: `rows @ image @ cols.T` is OpenCV's INTER_AREA resize."""
    edges = np.arange(target + 1) * source / target
    pixels = np.arange(source)
    overlap = np.minimum(edges[1:, None], pixels + 1) - np.maximum(edges[:-1, None], pixels)
    return np.clip(overlap, 0.0, None) * target / source


def eval_env(args, video_folder: str | None = None) -> Callable[[], gym.Env]:
    """A thunk building one gymnasium ALE env with the script's protocol (evaluation, video)."""

    def thunk() -> gym.Env:
        gym.register_envs(ale_py)
        render_mode = "rgb_array" if video_folder else None
        env = gym.make(args.env_id, obs_type="grayscale", frameskip=1, render_mode=render_mode)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
        return TrainingProtocol(env)

    return thunk
