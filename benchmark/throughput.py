"""Throughput at default hyperparameters beside what bounds it, measured side by side in one run (issue 7).

    python -m benchmark.throughput --out benchmark/results/throughput
    python -m benchmark.throughput --compare-with ../before --repeats 3     # A/B against another checkout

For each script, one rank at its defaults (the scripts' default torch threads: every usable core):

- vpg_mpi.py and ppo_continuous_mpi.py against the env-only step rate: the same env built by the script's own
  `make_env`, in the same vector env (SyncVectorEnv of `--local-num-envs` 1, same-step autoreset), stepped with
  uniformly random actions drawn beforehand, so only the env is timed. Targets: ppo_continuous at least 30% of
  it, vpg at least 50%.
- ppo_atari_multigpu.py against its fp32 eager compute limit: the script's own Agent timed in plain PyTorch on
  random frames, one batch-8 `act` per env step plus 16 minibatch forward/backward/Adam steps of 256 per 1,024
  samples (4 epochs x 4 minibatches), expressed as samples per second. Target: at least 1.2x that limit (the
  script overlaps nothing, so beating it takes a cheaper update than the plain one, e.g. bf16 or compile).

A script's SPS is taken from its TensorBoard events as `benchmark.scaling` does: global steps from the end of
iteration 1 to the end of the last, over the wall time between them (start-up and the first iteration's warm-up,
which pays for lazy initialisation and the first allocator growth, are left out). Its `perf/rollout_time` and
`perf/update_time` medians over iterations 2.. are shown beside it.

`--compare-with DIR` also runs the scripts of another checkout (e.g. `git worktree add ../before HEAD~1`),
alternating with this checkout's in every one of `--repeats` rounds, so load on the machine affects both alike;
each cell is the median over the rounds. Timing on a loaded machine is distorted: the output records the load.
"""

import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tyro

from benchmark.common import (
    ROOT,
    SCRIPTS,
    check_load,
    last_lines,
    markdown_table,
    results_header,
    run_streaming,
    torchrun_launcher,
)
from benchmark.scaling import SCRIPT_DEFAULTS, budget_args, measure, script_modes

TARGETS = {"vpg_mpi.py": 0.5, "ppo_continuous_mpi.py": 0.3, "ppo_atari_multigpu.py": 1.2}
"""issue 7: the least ratio of a script's SPS to the env-only rate (MLP scripts) or to the compute limit (Atari)"""
ATARI_MINIBATCH = 256
ATARI_UPDATE_STEPS = 16  # update_epochs 4 x num_minibatches 4
ATARI_ACTIONS = 4  # Breakout's action set


@dataclass
class Args:
    scripts: tuple[str, ...] = ("vpg_mpi.py", "ppo_continuous_mpi.py", "ppo_atari_multigpu.py")
    """the scripts to measure"""
    iterations: int = 6
    """iterations (epochs) per script run at its default batch; at least 2 (the first is left out of SPS)"""
    env_seconds: float = 3.0
    """seconds of env-only stepping per env id (and of each timed part of the Atari compute limit)"""
    repeats: int = 1
    """rounds of every measurement; each table cell is the median over the rounds"""
    compare_with: Path | None = None
    """another checkout of this repository whose scripts run alternately with this checkout's (A/B)"""
    env_id: str = ""
    """the env id of the MLP scripts; empty = each script's default (HalfCheetah-v5)"""
    out: Path = Path("benchmark_results/throughput")
    """output stem: writes OUT.md"""
    out_dir: Path | None = None
    """where the runs are launched (runs/ and logs/ land there, and are kept); default: a temporary folder"""
    notes: tuple[str, ...] = ()
    """paragraphs of prose under the header of the markdown file (what was run, how and why); the command shown there
    leaves them out"""
    variants: tuple[str, ...] = (
        "ppo_continuous_mpi.py --compile",
        "ppo_atari_multigpu.py --bf16",
        "ppo_atari_multigpu.py --compile",
        "ppo_atari_multigpu.py --bf16 --compile",
    )
    """extra rows of this checkout, each `SCRIPT FLAG...`: the script at its defaults plus documented flags (run
    when SCRIPT is among --scripts)"""
    max_load: float = 1.2
    """above this 1-minute load average at the start, the results file opens with a MEASURED UNDER LOAD warning"""


def load_script(script: str, root: Path = ROOT):
    """Import a training script of `root` as a module (importing one does no work)."""
    name = f"throughput_{Path(script).stem}_{abs(hash(str(root)))}"
    spec = importlib.util.spec_from_file_location(name, root / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    """Env steps per second of `env_id` as `script` builds and vectorises it (one env), with random actions."""
    import gymnasium as gym

    module = load_script(script)
    extra = [module.Args().max_ep_len] if script == "vpg_mpi.py" else []
    envs = gym.vector.SyncVectorEnv(
        [module.make_env(env_id, *extra)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    envs.reset(seed=1)
    space = envs.single_action_space
    if isinstance(space, gym.spaces.Box):
        rng = np.random.default_rng(1)
        actions = rng.uniform(space.low, space.high, size=(4096, 1, *space.shape)).astype(space.dtype)
    else:
        actions = np.random.default_rng(1).integers(0, space.n, size=(4096, 1))
    for step in range(200):  # warm-up
        envs.step(actions[step])
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for step in range(1000):
            envs.step(actions[step + (steps % 3000)])
        steps += 1000
    elapsed = time.perf_counter() - start
    envs.close()
    return steps / elapsed


def atari_compute_limit(seconds: float) -> tuple[float, float, float]:
    """ppo_atari_multigpu.py's fp32 eager compute limit at its defaults: (samples/s, ms per batch-8 act, ms per
    minibatch-256 forward+backward+Adam step), with the torch threads the script takes at one rank."""
    import os

    atari = load_script("ppo_atari_multigpu.py")
    defaults = atari.Args()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        torch.manual_seed(1)
        agent = atari.Agent(ATARI_ACTIONS)
        optimizer = torch.optim.Adam(agent.parameters(), lr=defaults.learning_rate, eps=1e-5)
        frames = torch.randint(0, 256, (defaults.local_num_envs, 4, 84, 84), dtype=torch.uint8)
        minibatch = torch.randint(0, 256, (ATARI_MINIBATCH, 4, 84, 84), dtype=torch.uint8)
        actions = torch.randint(0, ATARI_ACTIONS, (ATARI_MINIBATCH,))

        def train_step() -> None:
            log_prob, entropy, value = agent(minibatch, actions)
            loss = -log_prob.mean() - defaults.ent_coef * entropy.mean() + defaults.vf_coef * (value**2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        policy = agent.rollout_policy()
        act = rate(lambda: policy.act(frames), seconds)
        step = rate(train_step, seconds)
    finally:
        torch.set_num_threads(threads_before)
    batch = defaults.local_num_envs * defaults.num_steps
    return batch / (defaults.num_steps * act + ATARI_UPDATE_STEPS * step), act * 1e3, step * 1e3


def checkout_commit(root: Path) -> str:
    """The short commit of a checkout, with `+changes` when its scripts differ from it."""
    git = ["git", "-C", str(root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--", *SCRIPTS], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return commit.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def run_script(
    script: str, root: Path, env_id: str, iterations: int, work_dir: Path, name: str, flags: tuple[str, ...] = ()
):
    """Run `script` of checkout `root` at one rank, its defaults plus `flags`, for `iterations`; its
    scaling.Measurement."""
    default_env, default_steps = SCRIPT_DEFAULTS[script]
    script_args = [*flags, "--env-id", env_id or default_env, "--run-name", name]
    script_args += budget_args(script, 1, default_steps, iterations)
    command = [*torchrun_launcher(1), str(root / script), *script_args]
    shutil.rmtree(work_dir / "runs" / name, ignore_errors=True)
    log_path = work_dir / "logs" / f"{name}.log"
    if run_streaming(command, work_dir, log_path):
        raise SystemExit(f"benchmark.throughput: error: {name} failed; {log_path}:\n{last_lines(log_path)}")
    return measure(work_dir / "runs" / name, script, script_modes(script, ("allreduce",))[0], 1)  # the default mode


def main(argv: list[str] | None = None) -> Path:
    """Measure every script beside its bound, write OUT.md; returns its path."""
    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv, description=__doc__)
    variants = [tuple(variant.split()) for variant in args.variants]
    unknown = [script for script in args.scripts if script not in TARGETS]
    unknown += [variant[0] for variant in variants if variant[0] not in TARGETS]
    if unknown or args.iterations < 2 or args.repeats < 1:
        raise SystemExit(
            f"benchmark.throughput: error: scripts (and each variant's first word) must be in {tuple(TARGETS)}, "
            "iterations >= 2"
        )
    checkouts = {"this": ROOT}
    if args.compare_with is not None:
        other = args.compare_with.resolve()
        missing = [script for script in args.scripts if not (other / script).is_file()]
        if missing:
            raise SystemExit(f"benchmark.throughput: error: {other} has no {', '.join(missing)}")
        checkouts = {"other": other, "this": ROOT}
    labels = {
        key: f"{checkout_commit(root)}{' (this checkout)' if key == 'this' else ''}" for key, root in checkouts.items()
    }
    work_dir = args.out_dir.resolve() if args.out_dir else Path(tempfile.mkdtemp(prefix="ddrl_throughput_"))
    load_before, warning = check_load(args.max_load)

    bounds: dict[str, list[float]] = {}  # script -> env-only rate or compute limit, per round
    atari_parts: list[tuple[float, float]] = []
    runs: dict[tuple[str, str], list] = {}  # (checkout, script) -> Measurement per round
    try:
        for round_index in range(args.repeats):
            for script in args.scripts:
                if script == "ppo_atari_multigpu.py":
                    limit, act_ms, step_ms = atari_compute_limit(args.env_seconds)
                    bounds.setdefault(script, []).append(limit)
                    atari_parts.append((act_ms, step_ms))
                    print(f"{script}: compute limit {limit:,.0f} samples/s", flush=True)
                else:
                    env_id = args.env_id or SCRIPT_DEFAULTS[script][0]
                    bounds.setdefault(script, []).append(env_only_rate(script, env_id, args.env_seconds))
                    print(f"{script}: {env_id} env-only {bounds[script][-1]:,.0f} steps/s", flush=True)
                for key, root in checkouts.items():
                    name = f"throughput__{Path(script).stem}__{key}__{round_index}"
                    measurement = run_script(script, root, args.env_id, args.iterations, work_dir, name)
                    runs.setdefault((key, script), []).append(measurement)
                    print(f"  {labels[key]}: SPS {measurement.sps:,.0f}", flush=True)
                for flags in (variant[1:] for variant in variants if variant[0] == script):
                    tag = "_".join(flag.strip("-") for flag in flags)
                    name = f"throughput__{Path(script).stem}__{tag}__{round_index}"
                    measurement = run_script(script, ROOT, args.env_id, args.iterations, work_dir, name, tuple(flags))
                    runs.setdefault((" ".join(flags), script), []).append(measurement)
                    print(f"  {labels['this']} {' '.join(flags)}: SPS {measurement.sps:,.0f}", flush=True)
    finally:
        if args.out_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)

    rows = []
    for script in args.scripts:
        bound = statistics.median(bounds[script])
        atari = script == "ppo_atari_multigpu.py"
        flag_keys = [" ".join(variant[1:]) for variant in variants if variant[0] == script]
        for key in [*checkouts, *flag_keys]:
            measurements = runs[(key, script)]
            sps = statistics.median(m.sps for m in measurements)
            ratio = sps / bound
            rows.append(
                [
                    script,
                    labels[key] if key in labels else f"{labels['this']} {key}",
                    "BreakoutNoFrameskip-v4" if atari else args.env_id or SCRIPT_DEFAULTS[script][0],
                    f"{bound:,.0f} ({'compute limit' if atari else 'env only'})",
                    f"{sps:,.0f}",
                    f"{ratio:.2f}" if atari else f"{ratio:.0%}",
                    f"{TARGETS[script]:.1f}x" if atari else f"{TARGETS[script]:.0%}",
                    "yes" if ratio >= TARGETS[script] else "no",
                    f"{statistics.median(m.rollout for m in measurements):.3f}",
                    f"{statistics.median(m.update for m in measurements):.3f}",
                ]
            )
    headers = [
        "script",
        "checkout",
        "env",
        "bound (steps/s)",
        "script SPS (iterations 2..)",
        "ratio",
        "target",
        "met",
        "rollout s / it",
        "update s / it",
    ]
    facts = [
        f"1 rank, default hyperparameters, {args.iterations} iterations per script run, {args.repeats} round(s); "
        "each cell the median over rounds",
        f"load average (1, 5, 15 min) before the runs: {load_before}",
    ]
    text = results_header(
        "Throughput against the env-only rate and the compute limit",
        "benchmark.throughput",
        argv,
        facts,
        args.notes,
        warning,
    )
    text += "\n" + markdown_table(headers, rows)
    text += (
        "\nbound: for the MLP scripts, env steps per second of the same env in the same SyncVectorEnv (one env, "
        "same-step autoreset, random actions); for Atari, the fp32 eager compute limit (one batch-8 act per env "
        f"step plus {ATARI_UPDATE_STEPS} minibatch forward/backward/Adam steps of {ATARI_MINIBATCH} per 1,024 "
        "samples, with the script's Agent as plain PyTorch builds it: float32, NCHW). ratio = script SPS / bound.\n"
    )
    if atari_parts:
        act_ms = statistics.median(part[0] for part in atari_parts)
        step_ms = statistics.median(part[1] for part in atari_parts)
        text += f"\nAtari compute limit parts: batch-8 act {act_ms:.2f} ms, minibatch-256 step {step_ms:.1f} ms.\n"
    table_path = args.out.with_name(args.out.name + ".md")
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(text)
    print(f"wrote {table_path}")
    return table_path


if __name__ == "__main__":
    main()
