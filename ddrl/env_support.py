"""What env libraries need beside the algorithm: MuJoCo's console without its one deprecation
warning, one frame rendered before a --capture-video run trains, and the Atari script's training
protocol on one gymnasium env (for evaluation and videos, which AtariVectorEnv cannot record)."""

import contextlib
import os
import sys
from collections.abc import Callable

import gymnasium as gym
import numpy as np

from ddrl import failures
from ddrl.failures import fail, shown


def silence_settotalmass_warning() -> None:
    """Drop MuJoCo 4's warning on the deprecated `settotalmass` in gymnasium's HalfCheetah model
    (printed for every env of every rank, and logged to MUJOCO_LOG.TXT); any other MuJoCo warning
    prints as before."""
    try:
        import mujoco
    except ImportError:  # no MuJoCo, no MuJoCo warnings
        return
    # MUJOCO_GL naming a renderer MuJoCo does not know, or one this machine lacks
    except Exception as error:
        gl = os.environ.get("MUJOCO_GL", "")
        fail(
            f"MUJOCO_GL={shown(gl)} names no renderer MuJoCo can load "
            f"({str(error).splitlines()[0]}): unset it, or set it to egl, osmesa or glfw"
        )

    def warn(message: str) -> None:
        if "'settotalmass' is deprecated" not in message:
            print(f"WARNING: {message}\n", file=sys.stderr, flush=True)

    mujoco.set_mju_user_warning(warn)


def check_env(
    make_env: Callable[[], gym.Env],
    given: str,
    observations: type = gym.Space,
    actions: type = gym.Space,
):
    """Build one env with the script's `make_env` thunk (its wrappers may change the spaces), refuse
    one that cannot be made or whose spaces the script cannot train, in one line naming `given`
    (where the id comes from) and the fix; else its (observation space, action space)."""
    try:
        env = make_env()
    except Exception as error:  # an unknown id or module, or MUJOCO_GL naming a missing renderer
        gl = os.environ.get("MUJOCO_GL")
        renderer = (
            f"; or MUJOCO_GL={gl} names a renderer this machine lacks (unset it, or install it)"
            if gl
            else ""
        )
        fail(f"unknown or unusable {given} ({type(error).__name__}: {first_line(error)}){renderer}")
    env.close()
    for kind, space, wanted in (
        ("observations", env.observation_space, observations),
        ("actions", env.action_space, actions),
    ):
        if not isinstance(space, wanted):
            names = " or ".join(
                getattr(wanted, "__args__", None)
                and [t.__name__ for t in wanted.__args__]
                or [wanted.__name__]
            )
            fail(
                f"{given} has {type(space).__name__} {kind}; {failures.script} needs {names} {kind}"
            )
    return env.observation_space, env.action_space


def first_line(error: Exception) -> str:
    return shown((str(error) or type(error).__name__).strip().splitlines()[0])[1:-1]


def register_atari() -> None:
    """Make gymnasium know the ALE's games, where ale-py is installed."""
    try:
        import ale_py
    except ImportError:
        return
    gym.register_envs(ale_py)


def render_one_frame(env_id: str) -> None:
    """Render one frame of `env_id`: what --capture-video will need, tried before training."""
    register_atari()
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
    """The Atari script's make_env protocol on one gymnasium ALE env (grayscale, frameskip=1), for
    evaluation: its resets, 4 frames per action (the last two max-pooled), 84x84 by area, 4 stacked,
    FIRE after a lost life. An episode is a whole game."""

    def __init__(
        self,
        env: gym.Env,
        frameskip: int = 4,
        stack_num: int = 4,
        noop_max: int = 30,
        size: int = 84,
    ):
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


def atari_eval_env(args, video_folder: str | None = None) -> Callable[[], gym.Env]:
    """A thunk building one gymnasium ALE env of `args.env_id` with the Atari script's preprocessing
    and protocol (evaluation, video)."""

    def thunk() -> gym.Env:
        register_atari()
        render_mode = "rgb_array" if video_folder else None
        env = gym.make(args.env_id, obs_type="grayscale", frameskip=1, render_mode=render_mode)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True)
        return TrainingProtocol(env)

    return thunk
