"""Run a CleanRL file as it is on today's gymnasium: `python benchmark/cleanrl_compat.py FILE ARGS...`.

CleanRL's PPO files are written for gymnasium 0.29. Before running FILE as `__main__` with ARGS, this puts back the
three wrapper names they call that gymnasium 1.0 renamed or changed, registers ale-py's Atari envs (gymnasium 1.x
finds them only so), and puts FILE's checkout on the path (for `cleanrl_utils`). FILE itself is not changed.
"""

import runpy
import sys
from pathlib import Path

import gymnasium as gym


def adapt_gymnasium() -> None:
    """Give gymnasium 1.x the 0.29 wrapper names CleanRL's PPO files call, and register the Atari envs."""
    import ale_py

    gym.register_envs(ale_py)
    wrappers = gym.wrappers
    if not hasattr(wrappers, "FrameStack"):  # gymnasium 1.0 renamed two and made TransformObservation take a space
        wrappers.FrameStack = lambda env, num_stack: wrappers.FrameStackObservation(env, num_stack)
        wrappers.GrayScaleObservation = wrappers.GrayscaleObservation
        transform = wrappers.TransformObservation  # 0.29's takes (env, f), the observation space staying the env's
        wrappers.TransformObservation = lambda env, func, space=None: transform(env, func, space)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not Path(sys.argv[1]).is_file():
        usage = "python benchmark/cleanrl_compat.py CLEANRL_FILE [ARGS...]"
        print(f"cleanrl_compat.py: error: give an existing CleanRL file: {usage}", file=sys.stderr)
        sys.exit(2)
    file = Path(sys.argv[1]).resolve()
    adapt_gymnasium()
    sys.path[:1] = [str(file.parent), str(file.parent.parent)]  # as `python FILE` from its checkout, not benchmark/
    sys.argv = [str(file), *sys.argv[2:]]
    runpy.run_path(str(file), run_name="__main__")
