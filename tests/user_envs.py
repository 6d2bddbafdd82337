"""A user's own env, registered when this module is imported: what gymnasium's `module:EnvId` form loads
(`--env-id tests.user_envs:Point-v0`)."""

import gymnasium as gym
import numpy as np


class Point(gym.Env):
    """Move a point on a line towards 0: observation (x, step / 20), action a velocity in [-1, 1], reward -|x|."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, render_mode: str | None = None):
        self.render_mode = render_mode

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.x, self.steps = self.np_random.uniform(-2, 2), 0
        return self.observation(), {}

    def step(self, action):
        self.x += 0.1 * float(np.clip(action[0], -1, 1))
        self.steps += 1
        return self.observation(), -abs(self.x), abs(self.x) > 3, False, {}

    def observation(self) -> np.ndarray:
        return np.array([self.x, self.steps / 20], dtype=np.float32)


gym.register("Point-v0", entry_point=Point, max_episode_steps=20)
