"""Where a rollout step of ppo_atari_multigpu.py spends its time, beside the env-only rate of its envs, in one run.

    python -m benchmark.atari_step --out benchmark/results/atari_step_cpu
    python -m benchmark.atari_step --devices cuda cpu --thread-counts 1 2 4 8 16

For each device and env count, the script's envs (its make_env, as many threads as its `--env-threads 0` gives one
rank), its Agent and its acting step (ddrl.cuda_graphs.acting_step: on a GPU, CUDA graph replays) step for --steps
steps, the device synchronised at the end of each part (PARTS: acting, the env step, bookkeeping such as FIRE after a
lost life and the value of a truncated game's final frame), then unsynchronised, as the rollout runs them; beside them
the envs stepped alone (env-only rate). The script's SPS at an env count is benchmark.throughput's (`--local-envs`).
"""

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
from annotated_types import Ge

from benchmark import common
from ddrl import atari, cuda_graphs, machine

ENV_ID = "BreakoutNoFrameskip-v4"
PARTS = ("acting", "env step", "bookkeeping")


@dataclass(kw_only=True)
class Args(common.TimingArgs):
    envs: tuple[Annotated[int, Ge(1)], ...] = (8, 32, 128)
    """env counts (one rank's --local-num-envs)"""
    devices: tuple[Literal["cpu", "cuda"], ...] = ("cpu",)
    """where the Agent acts"""
    steps: Annotated[int, Ge(1)] = 200
    """timed env steps per configuration, after 10 untimed ones (and as many again unsynchronised)"""
    env_seconds: float = 3.0
    """seconds of env-only stepping per env count"""
    thread_counts: tuple[Annotated[int, Ge(1)], ...] = ()
    """also the env-only rate of each env count at each of these env thread counts (a table of its own)"""
    num_steps: Annotated[int, Ge(1)] = 128
    """rows of the rollout storage the acting step fills (the script's --num-steps)"""
    out: Path = Path("benchmark_results/atari_step")

    def __post_init__(self):
        if "cuda" in self.devices and not torch.cuda.is_available():
            raise SystemExit("benchmark.atari_step: error: --devices cuda needs a GPU that torch sees")


def make_envs(num_envs: int, threads: int):
    """`num_envs` envs as the script makes them, reset with its seeds (env j: seed 1 + 10,000 j)."""
    module = common.load_script(common.ATARI)
    envs = module.make_env(atari.settings(ENV_ID), num_envs, threads)
    frames, info = envs.reset(seed=np.array([1 + 10_000 * j for j in range(num_envs)]))
    return module, envs, frames, info


class Stepper:
    """The script's envs, Agent and acting step on `device`, stepped as its rollout steps them (one group of envs)."""

    def __init__(self, device: torch.device, num_envs: int, threads: int, num_steps: int):
        module, self.envs, self.next_obs, info = make_envs(num_envs, threads)
        self.device = device
        self.rows = num_steps
        self.games = atari.GameTracker(info)
        self.fire = atari.fire_action(self.envs)
        self.relaunch = np.zeros(num_envs, dtype=bool)
        self.rewards = np.zeros((num_steps, num_envs), np.float32)
        torch.manual_seed(1)
        self.agent = module.Agent(self.envs).to(device, memory_format=torch.channels_last)
        shape = (num_steps, num_envs)
        self.storage = {
            "obs": torch.zeros(shape + self.envs.single_observation_space.shape, dtype=torch.uint8, device=device),
            "actions": torch.zeros(shape, dtype=torch.long, device=device),
            "log_probs": torch.zeros(shape, device=device),
            "values": torch.zeros(shape, device=device),
        }
        self.group = slice(0, num_envs)
        graph = device.type == "cuda"
        self.act = cuda_graphs.acting_step(self.agent, *self.storage.values(), [self.group], graph=graph)
        self.step = 0

    def sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run(self, steps: int, synced: bool) -> np.ndarray:
        """Seconds per step in each of PARTS (synced), or the whole step in the last part (not synced)."""
        clock = self.sync if synced else lambda: 0.0
        seconds = np.zeros(len(PARTS))
        start = self.sync()
        for _ in range(steps):
            row = self.step % self.rows
            self.step += 1
            stamps = []
            env_action = self.act(row, self.next_obs, self.group)
            stamps.append(clock())
            if self.fire is not None:
                env_action = np.where(self.relaunch, self.fire, env_action)
            self.next_obs, reward, terminated, truncated, info = self.envs.step(env_action)
            stamps.append(clock())
            self.rewards[row] = np.clip(reward, -1, 1)
            game_over, _, _ = self.games.step(reward, terminated, truncated, info)
            self.relaunch = terminated & ~game_over
            if (cut := truncated & ~terminated).any():
                with torch.inference_mode():
                    self.agent.get_value(torch.from_numpy(info["final_obs"][cut]).to(self.device))
            stamps.append(clock())
            if synced:
                seconds += np.diff([start, *stamps])
                start = stamps[-1]
        if not synced:
            seconds[-1] = self.sync() - start
        return seconds / steps


def env_only_rate(num_envs: int, threads: int, seconds: float) -> float:
    """Env steps per second of `num_envs` envs as the script makes them, stepped alone with random actions."""
    _, envs, _, _ = make_envs(num_envs, threads)
    actions = np.random.default_rng(1).integers(0, envs.single_action_space.n, (16, num_envs))
    with contextlib.closing(envs):
        return num_envs * len(actions) / common.rate(lambda: [envs.step(action) for action in actions], seconds, 1)


def step_row(device: str, num_envs: int, threads: int, env_rate: float, args: Args) -> list[str]:
    """A table row: the step's parts (synchronised), the step unsynchronised, the rates."""
    stepper = Stepper(torch.device(device), num_envs, threads, args.num_steps)
    stepper.run(10, synced=False)
    parts = stepper.run(args.steps, synced=True) * 1e3
    step = stepper.run(args.steps, synced=False)[-1]
    stepper.envs.close()
    cells = [f"{ms:.3f} ({ms / parts.sum():.0%})" for ms in parts]
    row = [f"{num_envs} envs", device, *cells, f"{parts.sum():.3f}", f"{step * 1e3:.3f}"]
    return row + [f"{num_envs / step:,.0f}", f"{env_rate:,.0f}"]


def main(argv: list[str] | None = None) -> Path:
    """Measure every (env count, device), write OUT.md after each (so that a run stopped early keeps what it
    measured, marked partial); returns its path."""
    args, argv, _ = common.cli(Args, argv)
    threads = machine.idle_cores(1)  # the script's rule at one rank
    torch.set_num_threads(threads)
    torch.backends.cudnn.deterministic = True  # the script's --torch-deterministic default
    load = common.check_load(args.max_load)
    facts = [f"{ENV_ID}; torch and env threads: {threads} (the script's rule at one rank); {args.steps} steps timed"]
    if "cuda" in args.devices:
        facts.append(f"GPU: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    headers = "configuration | device | " + " | ".join(f"{part} ms" for part in PARTS)
    headers += " | step ms (sum) | step ms (unsynchronised) | rollout-only SPS | env-only SPS"
    configurations = [(num_envs, device) for num_envs in args.envs for device in args.devices]
    rows = []
    thread_rows = []  # the env-only rate by env threads, per env count
    for measured, (num_envs, device) in enumerate(configurations, start=1):
        if device == args.devices[0]:
            env_rate = env_only_rate(num_envs, threads, args.env_seconds)
            print(f"{num_envs} envs: env-only {env_rate:,.0f} steps/s", flush=True)
            if args.thread_counts:
                rates = [env_only_rate(num_envs, count, args.env_seconds) for count in args.thread_counts]
                thread_rows.append([num_envs, *(f"{rate:,.0f}" for rate in rates)])
        rows.append(step_row(device, num_envs, threads, env_rate, args))
        print(f"  {device}: {' | '.join(rows[-1][2:])}", flush=True)
        partial = f"PARTIAL: {measured} of {len(configurations)} configurations measured when this was written"
        body = "\n" + common.markdown_table(headers, rows) + "\n" + TABLE_MEANS + "\n"
        if thread_rows:
            counts = " | ".join(f"{count} threads" for count in args.thread_counts)
            body += "\n## Env-only steps/s by env threads\n\n" + common.markdown_table(f"envs | {counts}", thread_rows)
        title = "Where a rollout step of ppo_atari_multigpu.py spends its time"
        path = common.write_results(args, argv, title, facts, body, load, partial * (measured < len(configurations)))
    return path


TABLE_MEANS = (
    "Each part: mean ms per step with the device synchronised at its end, and its share of their sum. Unsynchronised: "
    "the same steps as the rollout runs them. rollout-only SPS = envs / unsynchronised step (no update). env-only SPS: "
    "the same envs stepped alone with random actions."
)

if __name__ == "__main__":
    main()
