"""Throughput at default hyperparameters beside what bounds it, measured side by side in one run (issue 7).

    python -m benchmark.throughput --out benchmark/results/throughput
    python -m benchmark.throughput --compare-with ../before --repeats 3     # A/B against another checkout

Each script runs one rank at its defaults, SPS and time split from iterations 2.. (common.measure), beside its bound
(TARGETS: issue 7's least ratios to it): the MLP scripts' env-only step rate, the Atari script's fp32 eager compute
limit (only bf16 or compile beat it). Checkouts and loads alternate every round, so drift affects all; cells: medians.
"""

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from benchmark import common, stragglers

TARGETS = {"vpg_mpi.py": 0.5, "ppo_continuous_mpi.py": 0.3, common.ATARI: 1.2}
"""issue 7: the least ratio of a script's SPS to the env-only rate (MLP scripts) or to the compute limit (Atari)"""


@dataclass(kw_only=True)
class Args(common.RunsArgs):
    scripts: tuple[common.Script, ...] = common.SCRIPTS
    """the scripts to measure"""
    env_seconds: float = 3.0
    """seconds of env-only stepping per env id (and of each timed part of the Atari compute limit)"""
    repeats: int = 1
    """rounds of every measurement; each table cell is the median over the rounds"""
    compare_with: Path | None = None
    """another checkout (e.g. `git worktree add ../before HEAD~1`) whose scripts run beside this checkout's (A/B)"""
    env_id: str = ""
    """the env id of the MLP scripts; empty = each script's default"""
    variants: tuple[str, ...] = (
        "ppo_continuous_mpi.py --compile",
        "ppo_atari_multigpu.py --bf16",
        "ppo_atari_multigpu.py --compile",
        "ppo_atari_multigpu.py --bf16 --compile",
    )
    """extra rows of this checkout, each `SCRIPT FLAG...` (run when SCRIPT is among --scripts)"""
    loads: tuple[Literal["quiet", "busy core"], ...] = ("quiet",)
    """measure on the machine as it is, and/or beside a process busy on the last usable core (issue 37)"""
    max_load: float = 1.2
    out: Path = Path("benchmark_results/throughput")

    def __post_init__(self):
        super().__post_init__()
        if self.repeats < 1 or any(variant.split()[0] not in TARGETS for variant in self.variants):
            raise SystemExit(
                f"benchmark.throughput: error: need --repeats >= 1; each variant's first word in {tuple(TARGETS)}"
            )


def rate(call: Callable[[], object], seconds: float, warmup: int = 3) -> float:
    """Median seconds per `call()` over about `seconds` of calls (at least 5), after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def env_only_rate(script: str, env_id: str, seconds: float) -> float:
    """Env steps per second of `env_id` as `script` builds it, in a SyncVectorEnv of one, with random actions."""
    import gymnasium as gym

    module = common.load_script(script)
    make_env = module.make_env(env_id, *([module.Args().max_ep_len] if script == "vpg_mpi.py" else []))
    autoreset = gym.vector.AutoresetMode.SAME_STEP
    with contextlib.closing(gym.vector.SyncVectorEnv([make_env], autoreset_mode=autoreset)) as envs:
        envs.reset(seed=1)
        envs.action_space.seed(1)
        actions = [envs.action_space.sample() for _ in range(1000)]
        for action in actions[:200]:  # warm-up
            envs.step(action)
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for action in actions:
                envs.step(action)
            steps += len(actions)
        return steps / (time.perf_counter() - start)


def atari_compute_limit(seconds: float) -> tuple[float, float, float]:
    """ppo_atari_multigpu.py's fp32 eager compute limit at its defaults: (samples/s, ms per act of its envs, ms per
    minibatch forward+backward+Adam step), with the torch threads the script takes at one rank."""
    atari, defaults = common.load_script(common.ATARI), common.defaults(common.ATARI)
    minibatch = defaults.local_num_envs * defaults.num_steps // defaults.num_minibatches
    actions = common.env_spaces(common.ATARI)[1].n
    threads_before = torch.get_num_threads()
    torch.set_num_threads(len(common.usable_cores()))
    try:
        torch.manual_seed(1)
        agent = atari.Agent(actions)
        optimizer = torch.optim.Adam(agent.parameters(), lr=defaults.learning_rate, eps=1e-5)
        frames = torch.randint(0, 256, (defaults.local_num_envs, 4, 84, 84), dtype=torch.uint8)
        minibatch_frames = torch.randint(0, 256, (minibatch, 4, 84, 84), dtype=torch.uint8)
        minibatch_actions = torch.randint(0, actions, (minibatch,))

        def train_step() -> None:
            log_prob, entropy, value = agent(minibatch_frames, minibatch_actions)
            loss = -log_prob.mean() - defaults.ent_coef * entropy.mean() + defaults.vf_coef * (value**2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        policy = agent.rollout_policy()
        act, step = rate(lambda: policy.act(frames), seconds), rate(train_step, seconds)
    finally:
        torch.set_num_threads(threads_before)
    update_steps = defaults.update_epochs * defaults.num_minibatches
    return defaults.local_num_envs / (act + update_steps * step / defaults.num_steps), act * 1e3, step * 1e3


def bound(script: str, env_id: str, seconds: float) -> tuple[float, list[float]]:
    """What bounds `script`'s SPS, measured now: the env-only rate, or for Atari the compute limit (and its parts)."""
    if script == common.ATARI:
        limit, *parts = atari_compute_limit(seconds)
        print(f"{script}: compute limit {limit:,.0f} samples/s", flush=True)
        return limit, parts
    steps = env_only_rate(script, env_id, seconds)
    print(f"{script}: {env_id} env-only {steps:,.0f} steps/s", flush=True)
    return steps, []


def main(argv: list[str] | None = None) -> Path:
    """Measure every script beside its bound, write OUT.md; returns its path."""
    args, argv, _ = common.cli(Args, argv)
    checkouts = {"this": common.ROOT}
    if args.compare_with is not None:
        other = args.compare_with.resolve()
        if missing := [script for script in args.scripts if not (other / script).is_file()]:
            raise SystemExit(f"benchmark.throughput: error: {other} has no {', '.join(missing)}")
        checkouts = {"other": other, "this": common.ROOT}
    labels = {key: common.code_version(root, short=True) for key, root in checkouts.items()}
    labels["this"] += " (this checkout)"
    env_ids = {script: common.env_id(script, "" if script == common.ATARI else args.env_id) for script in args.scripts}
    load_before = common.check_load(args.max_load)
    bounds: dict[tuple[str, str], list[float]] = {}  # (script, load) -> env-only rate or compute limit, per round
    atari_parts: list[list[float]] = []
    runs: dict[tuple[str, str, str], list] = {}  # (row label, script, load) -> Measurement per round
    with common.work_folder(args.out_dir, "ddrl_throughput_") as work_dir:
        for round_index, load in ((index, load) for index in range(args.repeats) for load in args.loads):
            with stragglers.cpu_hog(common.usable_cores()[-1]) if load == "busy core" else contextlib.nullcontext():
                for script in args.scripts:
                    limit, parts = bound(script, env_ids[script], args.env_seconds)
                    bounds.setdefault((script, load), []).append(limit)
                    atari_parts += [parts] if parts and load == "quiet" else []
                    flag_runs = [(labels[key], root, [], key) for key, root in checkouts.items()]
                    for flags in (variant.split()[1:] for variant in args.variants if variant.split()[0] == script):
                        tag = "_".join(flag.strip("-") for flag in flags)
                        flag_runs.append((f"{labels['this']} {' '.join(flags)}", common.ROOT, flags, tag))
                    for label, root, flags, tag in flag_runs:
                        name = f"throughput__{Path(script).stem}__{tag}{'__busy' * (load != 'quiet')}__{round_index}"
                        run_args = [*flags, "--env-id", env_ids[script], "--run-name", name]
                        run_args += common.budget_args(script, 1, args.local_steps, args.iterations)
                        [run_dir] = common.run_logged({name: common.script_command(root / script, run_args)}, work_dir)
                        runs.setdefault((label, script, load), []).append(common.measure(run_dir, script, "default", 1))
                        print(f"  {label}, {load}: SPS {runs[label, script, load][-1].sps:,.0f}", flush=True)
    rows = []
    for (label, script, load), measurements in sorted(runs.items(), key=lambda item: args.scripts.index(item[0][1])):
        limit, atari, target = statistics.median(bounds[script, load]), script == common.ATARI, TARGETS[script]
        sps = statistics.median(m.sps for m in measurements)
        ratio = [f"{sps / limit:.2f}", f"{target:.1f}x"] if atari else [f"{sps / limit:.0%}", f"{target:.0%}"]
        seconds = [f"{statistics.median(getattr(m, part) for m in measurements):.3f}" for part in ("rollout", "update")]
        label += "" if load == "quiet" else ", beside a busy core"
        kind = "compute limit" if atari else "env only"
        rows.append([script, label, env_ids[script], f"{limit:,.0f} ({kind})", f"{sps:,.0f}", *ratio])
        rows[-1] += ["yes" if sps / limit >= target else "no", *seconds]
    headers = (
        "script | checkout | env | bound (steps/s) | script SPS (iterations 2..) | ratio | target | met | "
        "rollout s / it | update s / it"
    )
    atari = common.defaults(common.ATARI)
    envs, minibatch = atari.local_num_envs, atari.local_num_envs * atari.num_steps // atari.num_minibatches
    body = "\n" + common.markdown_table(headers, rows)
    body += (
        "\nbound: for the MLP scripts, env steps per second of the same env in the same SyncVectorEnv (one env, "
        f"same-step autoreset, random actions); for Atari, the fp32 eager compute limit (one batch-{envs} act per env "
        f"step plus {atari.update_epochs * atari.num_minibatches} minibatch forward/backward/Adam steps of {minibatch} "
        f"per {envs * atari.num_steps:,} samples, with the script's Agent as plain PyTorch builds it: float32, NCHW). "
        "ratio = script SPS / bound.\n"
    )
    if atari_parts:
        act_ms, step_ms = (statistics.median(part) for part in zip(*atari_parts, strict=True))
        body += f"\nAtari compute limit parts: batch-{envs} act {act_ms:.2f} ms, minibatch-{minibatch} step"
        body += f" {step_ms:.1f} ms.\n"
    batch = f"{args.local_steps:,} env steps per iteration" if args.local_steps else "default hyperparameters"
    facts = [f"1 rank, {batch}, {args.iterations} iterations per run, {args.repeats} round(s): cells are medians"]
    title = "Throughput against the env-only rate and the compute limit"
    return common.write_results(args, argv, title, facts, body, *load_before)


if __name__ == "__main__":
    main()
