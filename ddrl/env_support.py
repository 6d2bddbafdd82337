"""What env libraries need beside the algorithm: MuJoCo's console, an env's spaces checked, and one
frame rendered before a --capture-video run trains."""

import contextlib
import os
import sys
from collections.abc import Callable

import gymnasium as gym

from ddrl import failures
from ddrl.failures import fail, first_line, shown


def silence_settotalmass_warning() -> None:
    """Drop MuJoCo 4's `settotalmass` deprecation warning (HalfCheetah's, per env), no other."""
    try:
        import mujoco
    except ImportError:  # no MuJoCo, no MuJoCo warnings
        return
    except Exception as error:  # MUJOCO_GL naming a renderer MuJoCo cannot load
        gl = os.environ.get("MUJOCO_GL", "")
        fail(
            f"MUJOCO_GL={shown(gl)} names no renderer MuJoCo can load "
            f"({first_line(error)}): unset it, or set it to egl, osmesa or glfw"
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
    """Build one env with the script's `make_env` thunk and return its spaces; one that cannot be
    made, or whose spaces the script cannot train, is one line naming `given` and the fix."""
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


def render_one_frame(env_id: str) -> None:
    """Render one frame of `env_id`: what --capture-video will need, tried before training."""
    register_atari()
    with contextlib.closing(gym.make(env_id, render_mode="rgb_array")) as env:
        env.reset(seed=0)
        env.render()


def register_atari() -> None:
    """Make gymnasium know the ALE's games, where ale-py is installed."""
    try:
        import ale_py
    except ImportError:
        return
    gym.register_envs(ale_py)


def check_video_support(capture_video: bool, render_frame: Callable[[], object]) -> None:
    """With --capture-video, render one frame now rather than fail after training."""
    if not capture_video:
        return
    try:
        import moviepy  # noqa: F401
    except ImportError:
        fail("--capture-video needs moviepy: pip install moviepy")
    try:
        render_frame()
    except Exception as error:
        fail(
            f"--capture-video cannot render a frame ({first_line(error)}): for MuJoCo without a "
            "display use MUJOCO_GL=egl (apt-get install libegl1) or MUJOCO_GL=osmesa (apt-get "
            "install libosmesa6); for classic-control envs pip install pygame; or drop "
            "--capture-video"
        )
