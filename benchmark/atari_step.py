"""Where a rollout step of ppo_atari_multigpu.py spends its time, beside the env-only rate of its envs, in one run.

    python -m benchmark.atari_step --out benchmark/results/atari_step_cpu
    python -m benchmark.atari_step --devices cuda cpu --baseline /tmp/old/ppo_atari_multigpu.py --iterations 8

For each device and env count, each script (--baseline's, then this checkout's) steps its own envs (make_env, as many
threads as its `--env-threads 0` gives one rank) with its own Agent and acting step for --steps steps, the device
synchronised at the end of each part: acting (frames to the device, forward and sampling, actions to the host), the
env step, bookkeeping (FIRE after a lost life, rewards, game tracking). The same steps unsynchronised give the step as
the rollout runs it. Beside them: the envs stepped alone with random actions (env-only rate) and, with --iterations,
the script's SPS in a run of its own (iterations 2..) and its rollout time per step.
"""

import hashlib
import inspect
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from benchmark import common
from ddrl import machine

ENV_ID = "BreakoutNoFrameskip-v4"
PARTS = ("acting", "env step", "bookkeeping")


@dataclass(kw_only=True)
class Args(common.TimingArgs):
    envs: tuple[int, ...] = (8, 32, 128)
    """env counts (one rank's --local-num-envs)"""
    devices: tuple[Literal["cpu", "cuda"], ...] = ("cpu",)
    """where the Agent acts"""
    steps: int = 200
    """timed env steps per configuration and script, after 10 untimed ones (and as many again unsynchronised)"""
    threads: int = 0
    """torch and env threads of the steps and the runs (`--torch-threads` and `--env-threads`); 0 = the script's rule
    at one rank (the cores idle at start)"""
    env_seconds: float = 3.0
    """seconds of env-only stepping per env count"""
    thread_counts: tuple[int, ...] = ()
    """also the env-only rate of each env count at each of these env thread counts (a table of its own)"""
    baseline: Path | None = None
    """another ppo_atari_multigpu.py (e.g. `git show REV:ppo_atari_multigpu.py > /tmp/old/ppo_atari_multigpu.py`),
    measured beside this checkout's"""
    iterations: int = 0
    """also train each script for this many iterations of --num-steps per configuration, for its SPS (0 = no runs)"""
    rounds: int = 1
    """rounds of those runs, the scripts alternating; cells show the median run, each round's SPS ratio follows"""
    num_steps: int = 128
    """--num-steps of those runs, and the rows of the rollout storage the acting step fills"""
    out_dir: Path | None = None
    """where those runs are launched (runs/ and logs/ are kept there); default: a temporary folder"""
    out: Path = Path("benchmark_results/atari_step")

    def __post_init__(self):
        if min(self.envs) < 1 or min(self.steps, self.num_steps, self.rounds) < 1 or self.iterations == 1:
            raise SystemExit("benchmark.atari_step: error: need --envs, --steps, --rounds >= 1, --iterations 0 or >= 2")
        if self.thread_counts and min(self.thread_counts) < 1:
            raise SystemExit("benchmark.atari_step: error: --thread-counts must be at least 1 each")
        if "cuda" in self.devices and not torch.cuda.is_available():
            raise SystemExit("benchmark.atari_step: error: --devices cuda needs a GPU that torch sees")
        if self.baseline is not None and not self.baseline.is_file():
            raise SystemExit(f"benchmark.atari_step: error: --baseline {self.baseline} is not a file")


def acting_of(module, agent, num_steps: int, num_envs: int, obs_shape: tuple, device: torch.device):
    """A script's acting step as `act(row, frames) -> the envs' actions` for all its envs at once, its RolloutPolicy,
    the storage the step fills (obs, actions, log_probs, values) and what made the step: the script's acting_step
    (in one group of envs); an older script's Rollout; or, older still, the step its main wrote inline."""
    shape = (num_steps, num_envs)
    storage = {
        "obs": torch.zeros(shape + obs_shape, dtype=torch.uint8, device=device),
        "actions": torch.zeros(shape, dtype=torch.long, device=device),
        "log_probs": torch.zeros(shape, device=device),
        "values": torch.zeros(shape, device=device),
    }
    policy = agent.rollout_policy()
    graph = device.type == "cuda"
    if hasattr(module, "acting_step"):
        if "groups" not in inspect.signature(module.acting_step).parameters:  # before env groups
            return module.acting_step(policy, *storage.values(), graph=graph), policy, storage, "acting_step"
        every_env = slice(0, num_envs)
        act = module.acting_step(policy, *storage.values(), [every_env], graph=graph)
        return lambda row, frames: act(row, frames, every_env), policy, storage, "acting_step"
    if hasattr(module, "Rollout"):
        rollout = module.Rollout(agent, shape, obs_shape, device, graph)

        def act_through_rollout(row: int, frames: np.ndarray) -> np.ndarray:
            rollout.observe(row, frames)
            rollout.act(row)
            return rollout.actions_to_host()

        return act_through_rollout, rollout.policy, {key: getattr(rollout, key) for key in storage}, "Rollout"

    def act_inline(row: int, frames: np.ndarray) -> np.ndarray:
        storage["obs"][row] = torch.from_numpy(frames).to(device)
        step_actions, storage["log_probs"][row], storage["values"][row] = policy.act(storage["obs"][row])
        storage["actions"][row] = step_actions
        return step_actions.cpu().numpy()

    return act_inline, policy, storage, "inline"


class Stepper:
    """One script's envs, Agent and acting step on `device`, stepped as its rollout steps them."""

    def __init__(self, module, device: torch.device, num_envs: int, threads: int, num_steps: int):
        self.device = device
        self.rows = num_steps
        self.envs = module.make_env(module.atari_settings(ENV_ID), num_envs, threads)
        self.next_obs, info = self.envs.reset(seed=np.array(module.env_seeds(1, 0, num_envs)))
        self.games = module.GameTracker(info)
        self.fire = module.fire_action(self.envs)
        self.relaunch = np.zeros(num_envs, dtype=bool)
        self.rewards = np.zeros((num_steps, num_envs), np.float32)
        self.ends = np.zeros((num_steps, num_envs), bool)
        torch.manual_seed(1)
        agent = module.Agent(int(self.envs.single_action_space.n)).to(device, memory_format=torch.channels_last)
        shape = self.envs.single_observation_space.shape
        self.act, self.policy, self.storage, self.acting = acting_of(module, agent, num_steps, num_envs, shape, device)
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
            env_action = self.act(row, self.next_obs)
            stamps.append(clock())
            if self.fire is not None:
                env_action = np.where(self.relaunch, self.fire, env_action)
            self.next_obs, reward, terminated, truncated, info = self.envs.step(env_action)
            stamps.append(clock())
            self.rewards[row] = np.clip(reward, -1, 1)
            self.ends[row] = terminated | truncated
            game_over, _, _ = self.games.step(reward, terminated, truncated, info)
            self.relaunch = terminated & ~game_over
            if (cut := truncated & ~terminated).any():
                self.policy.value(torch.from_numpy(info["final_obs"][cut]).to(self.device))
            stamps.append(clock())
            if synced:
                seconds += np.diff([start, *stamps])
                start = stamps[-1]
        if not synced:
            seconds[-1] = self.sync() - start
        return seconds / steps

    def close(self) -> None:
        self.envs.close()


def env_only_rate(module, num_envs: int, threads: int, seconds: float) -> float:
    """Env steps per second of `num_envs` envs as `module` makes them, stepped alone with random actions."""
    envs = module.make_env(module.atari_settings(ENV_ID), num_envs, threads)
    envs.reset(seed=np.array(module.env_seeds(1, 0, num_envs)))
    actions = np.random.default_rng(1).integers(0, envs.single_action_space.n, (64, num_envs))
    for action in actions[:10]:
        envs.step(action)
    steps, start = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - start < seconds:
        for action in actions:
            envs.step(action)
        steps += len(actions)
    rate = steps * num_envs / (time.perf_counter() - start)
    envs.close()
    return rate


def step_row(module, label: str, device: str, num_envs: int, threads: int, env_rate: float, args: Args) -> list[str]:
    """A table row of the script `module`: its step's parts (synchronised), the step unsynchronised, the rates."""
    stepper = Stepper(module, torch.device(device), num_envs, threads, args.num_steps)
    stepper.run(10, synced=False)
    parts, step = stepper.run(args.steps, synced=True) * 1e3, stepper.run(args.steps, synced=False)[-1]
    stepper.close()
    cells = [f"{ms:.3f} ({ms / parts.sum():.0%})" for ms in parts]
    row = [f"{num_envs} envs", label, device, *cells, f"{parts.sum():.3f}", f"{step * 1e3:.3f}"]
    return row + [f"{num_envs / step:,.0f}", f"{env_rate:,.0f}"]


def script_runs(args: Args, scripts: dict[str, Path], device: str, num_envs: int, extra: list[str], work_dir: Path):
    """Each script trained --iterations iterations of `num_envs` envs on `device`, in --rounds rounds, the scripts
    alternating: their Measurements by label (none without --iterations)."""
    runs = {label: [] for label in scripts}
    for round_index in range(args.rounds if args.iterations else 0):
        for label, path in scripts.items():
            name = f"atari_step__{label.split()[0]}__{device}__{num_envs}envs"
            name += f"__round{round_index + 1}" if args.rounds > 1 else ""
            run_args = ["--env-id", ENV_ID, "--local-num-envs", str(num_envs), "--num-steps", str(args.num_steps)]
            run_args += ["--total-timesteps", str(args.iterations * num_envs * args.num_steps), "--run-name", name]
            run_args += ["--no-cuda"] * (device == "cpu")
            [run_dir] = common.run_logged({name: common.script_command(path, [*run_args, *extra])}, work_dir)
            runs[label].append(common.measure(run_dir, path.name, device, 1))
            print(f"  {device}, {label}: SPS {runs[label][-1].sps:,.0f}", flush=True)
    return runs


def main(argv: list[str] | None = None) -> Path:
    """Measure every (device, env count, script), write OUT.md after each configuration (so that a run stopped
    early keeps what it measured, marked partial); returns its path."""
    args, argv, extra = common.cli(Args, argv, script_args=True)
    scripts = {"this checkout": common.ROOT / common.ATARI}
    if args.baseline is not None:
        scripts = {"baseline": args.baseline.resolve(), **scripts}
    modules = {label: common.load_script(path.name, path.parent) for label, path in scripts.items()}
    this = modules["this checkout"]
    threads = args.threads or machine.idle_cores(1)  # the script's rule at one rank
    extra = [*(["--torch-threads", str(threads), "--env-threads", str(threads)] if args.threads else []), *extra]
    torch.set_num_threads(threads)
    torch.backends.cudnn.deterministic = True  # the script's --torch-deterministic default
    load, load_warning = common.check_load(args.max_load)
    rule = "--threads" if args.threads else "the script's rule at one rank"
    facts = [f"{ENV_ID}; torch and env threads: {threads} ({rule}); {args.steps} steps timed"]
    if "cuda" in args.devices:
        facts.append(f"GPU: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    for label, path in scripts.items():
        facts.append(f"{label}: {path} (sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:12]})")
    headers = "configuration | script | device | " + " | ".join(f"{part} ms" for part in PARTS)
    headers += " | step ms (sum) | step ms (unsynchronised) | rollout-only SPS | env-only SPS"
    headers += " | script SPS | script / env-only | script rollout ms / step" if args.iterations else ""
    configurations = [(num_envs, device) for num_envs in args.envs for device in args.devices]
    rows, ratios = [], ""
    thread_rows = []  # the env-only rate by env threads, per env count

    def write(measured: int) -> Path:
        """OUT.md with the rows of the first `measured` configurations."""
        partial = None
        if measured < len(configurations):
            partial = f"PARTIAL: {measured} of {len(configurations)} configurations measured when this was written"
        body = "\n" + common.markdown_table(headers, rows) + "\n" + (ratios and ratios + "\n")
        body += TABLE_MEANS.format(num_steps=args.num_steps) + "\n"
        if thread_rows:
            counts = " | ".join(f"{count} threads" for count in args.thread_counts)
            body += "\n## Env-only steps/s by env threads\n\n" + common.markdown_table(f"envs | {counts}", thread_rows)
        title = "Where a rollout step of ppo_atari_multigpu.py spends its time"
        warning = " ".join(filter(None, [partial, load_warning])) or None
        return common.write_results(args, argv, title, facts, body, load, warning)

    with common.work_folder(args.out_dir, "ddrl_atari_step_") as work_dir:
        for measured, (num_envs, device) in enumerate(configurations, start=1):
            if device == args.devices[0]:
                env_rate = env_only_rate(this, num_envs, threads, args.env_seconds)
                print(f"{num_envs} envs: env-only {env_rate:,.0f} steps/s", flush=True)
                by_threads = [env_only_rate(this, num_envs, count, args.env_seconds) for count in args.thread_counts]
                if by_threads:
                    thread_rows.append([num_envs, *(f"{rate:,.0f}" for rate in by_threads)])
            found = {
                label: step_row(modules[label], label, device, num_envs, threads, env_rate, args) for label in modules
            }
            runs = script_runs(args, scripts, device, num_envs, extra, work_dir)
            for label, measured_runs in runs.items() if args.iterations else ():
                run = sorted(measured_runs, key=lambda m: m.sps)[(args.rounds - 1) // 2]  # the median run
                rollout_ms = run.rollout / args.num_steps * 1e3
                found[label] += [f"{run.sps:,.0f}", f"{run.sps / env_rate:.2f}", f"{rollout_ms:.3f}"]
            if args.iterations and len(scripts) > 1:
                each = [new.sps / old.sps for old, new in zip(*runs.values(), strict=True)]
                ratios += f"- {num_envs} envs, {device}: this checkout's SPS / the baseline's, each round: "
                ratios += f"{', '.join(f'{ratio:.3f}' for ratio in each)}; median {statistics.median(each):.3f}\n"
            rows += found.values()
            print("\n".join(f"  {device}, {label}: {' | '.join(row[3:])}" for label, row in found.items()), flush=True)
            path = write(measured)
    return path


TABLE_MEANS = (
    "Each part: mean ms per step with the device synchronised at its end, and its share of their sum. Unsynchronised: "
    "the same steps as the rollout runs them. rollout-only SPS = envs / unsynchronised step (no update). env-only SPS: "
    "the same envs stepped alone with random actions. script SPS: the script's own run of {num_steps} steps per "
    "iteration, iterations 2.. (update included; the median run of the rounds); script rollout ms / step: its "
    "perf/rollout_time / {num_steps}."
)

if __name__ == "__main__":
    main()
