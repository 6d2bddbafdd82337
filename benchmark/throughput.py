"""Throughput at default hyperparameters beside what bounds it, measured side by side in one run (issue 7).

    python -m benchmark.throughput --out benchmark/results/throughput
    python -m benchmark.throughput --compare-with ../before --repeats 3     # A/B against another checkout

For each script, one rank at its defaults (`python SCRIPT`; the scripts' default torch threads: every usable core):

- vpg_mpi.py and ppo_continuous_mpi.py against the env-only step rate: the same env built by the script's own
  `make_env`, in the same vector env (SyncVectorEnv of `--local-num-envs` 1, same-step autoreset), stepped with
  uniformly random actions drawn beforehand, so only the env is timed. Targets: ppo_continuous at least 30% of
  it, vpg at least 50%.
- ppo_atari_multigpu.py against its fp32 eager compute limit: the script's own Agent timed in plain PyTorch on
  random frames, one `act` on the script's envs per env step plus the update's minibatch forward/backward/Adam
  steps, all at its default sizes, expressed as samples per second. Target: at least 1.2x that limit (the script
  overlaps nothing, so beating it takes a cheaper update than the plain one, e.g. bf16 or compile).

A script's SPS and its `perf/rollout_time` and `perf/update_time` medians are those of iterations 2.., as in
`benchmark.scaling`. `--compare-with DIR` also runs the scripts of another checkout (e.g. `git worktree add ../before
HEAD~1`), alternating with this checkout's in every one of `--repeats` rounds, so load on the machine affects both
alike; each cell is the median over the rounds. Timing on a loaded machine is distorted: the output records the load.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmark import common

TARGETS = {"vpg_mpi.py": 0.5, "ppo_continuous_mpi.py": 0.3, common.ATARI: 1.2}
"""issue 7: the least ratio of a script's SPS to the env-only rate (MLP scripts) or to the compute limit (Atari)"""


@dataclass(kw_only=True)
class Args(common.RunsArgs):
    scripts: tuple[str, ...] = common.SCRIPTS
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
    """the env id of the MLP scripts; empty = each script's default"""
    variants: tuple[str, ...] = (
        "ppo_continuous_mpi.py --compile",
        "ppo_atari_multigpu.py --bf16",
        "ppo_atari_multigpu.py --compile",
        "ppo_atari_multigpu.py --bf16 --compile",
    )
    """extra rows of this checkout, each `SCRIPT FLAG...`: the script at its defaults plus documented flags (run
    when SCRIPT is among --scripts)"""
    max_load: float = 1.2
    out: Path = Path("benchmark_results/throughput")


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

    module = common.load_script(script)
    extra = [module.Args().max_ep_len] if script == "vpg_mpi.py" else []
    envs = gym.vector.SyncVectorEnv(
        [module.make_env(env_id, *extra)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    envs.reset(seed=1)
    space, rng = envs.single_action_space, np.random.default_rng(1)
    if isinstance(space, gym.spaces.Box):
        actions = rng.uniform(space.low, space.high, size=(4096, 1, *space.shape)).astype(space.dtype)
    else:
        actions = rng.integers(0, space.n, size=(4096, 1))
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
    """ppo_atari_multigpu.py's fp32 eager compute limit at its defaults: (samples/s, ms per act of its envs, ms per
    minibatch forward+backward+Adam step), with the torch threads the script takes at one rank."""
    atari, defaults = common.load_script(common.ATARI), common.defaults(common.ATARI)
    minibatch = defaults.local_num_envs * defaults.num_steps // defaults.num_minibatches
    update_steps = defaults.update_epochs * defaults.num_minibatches
    actions = common.env_spaces(defaults.env_id)[1].n
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

        act, step = rate(lambda: agent.act(frames), seconds), rate(train_step, seconds)
    finally:
        torch.set_num_threads(threads_before)
    batch = defaults.local_num_envs * defaults.num_steps
    return batch / (defaults.num_steps * act + update_steps * step), act * 1e3, step * 1e3


def run_script(script: str, root: Path, args: Args, work_dir: Path, name: str, flags: tuple[str, ...] = ()):
    """Run `script` of checkout `root` at one rank, its defaults plus `flags`, for `args.iterations`; its
    Measurement."""
    script_args = [*flags, "--env-id", args.env_id or common.defaults(script).env_id, "--run-name", name]
    script_args += common.budget_args(script, 1, common.default_local_steps(script), args.iterations)
    [run_dir] = common.run_logged({name: common.script_command(root / script, script_args)}, work_dir)
    return common.measure(run_dir, script, "default", 1)


def main(argv: list[str] | None = None) -> Path:
    """Measure every script beside its bound, write OUT.md; returns its path."""
    args, argv, _ = common.cli(Args, argv)
    variants = [tuple(variant.split()) for variant in args.variants]
    unknown = [script for script in args.scripts if script not in TARGETS]
    unknown += [variant[0] for variant in variants if variant[0] not in TARGETS]
    if unknown or args.iterations < 2 or args.repeats < 1:
        raise SystemExit(
            f"benchmark.throughput: error: scripts (and each variant's first word) must be in {tuple(TARGETS)}, "
            "iterations >= 2"
        )
    checkouts = {"this": common.ROOT}
    if args.compare_with is not None:
        other = args.compare_with.resolve()
        if missing := [script for script in args.scripts if not (other / script).is_file()]:
            raise SystemExit(f"benchmark.throughput: error: {other} has no {', '.join(missing)}")
        checkouts = {"other": other, "this": common.ROOT}
    labels = {key: common.code_version(root, short=True) for key, root in checkouts.items()}
    labels["this"] += " (this checkout)"
    load_before, warning = common.check_load(args.max_load)

    bounds: dict[str, list[float]] = {}  # script -> env-only rate or compute limit, per round
    atari_parts = []
    runs: dict[tuple[str, str], list] = {}  # (checkout or flags, script) -> Measurement per round
    with common.work_folder(args.out_dir, "ddrl_throughput_") as work_dir:
        for round_index in range(args.repeats):
            for script in args.scripts:
                if script == common.ATARI:
                    limit, *parts = atari_compute_limit(args.env_seconds)
                    bounds.setdefault(script, []).append(limit)
                    atari_parts.append(parts)
                    print(f"{script}: compute limit {limit:,.0f} samples/s", flush=True)
                else:
                    env_id = args.env_id or common.defaults(script).env_id
                    bounds.setdefault(script, []).append(env_only_rate(script, env_id, args.env_seconds))
                    print(f"{script}: {env_id} env-only {bounds[script][-1]:,.0f} steps/s", flush=True)
                flag_runs = [(key, root, ()) for key, root in checkouts.items()]
                flag_runs += [(" ".join(v[1:]), common.ROOT, v[1:]) for v in variants if v[0] == script]
                for key, root, flags in flag_runs:
                    tag = "_".join(flag.strip("-") for flag in flags) or key
                    name = f"throughput__{Path(script).stem}__{tag}__{round_index}"
                    runs.setdefault((key, script), []).append(run_script(script, root, args, work_dir, name, flags))
                    print(f"  {labels.get(key, labels['this'] + ' ' + key)}: SPS {runs[key, script][-1].sps:,.0f}")

    rows = []
    for script in args.scripts:
        bound, atari = statistics.median(bounds[script]), script == common.ATARI
        env_id = common.defaults(script).env_id if atari else args.env_id or common.defaults(script).env_id
        for key in [*checkouts, *(" ".join(variant[1:]) for variant in variants if variant[0] == script)]:
            measurements = runs[key, script]
            sps = statistics.median(m.sps for m in measurements)
            ratio, target = sps / bound, TARGETS[script]
            row = [script, labels.get(key, f"{labels['this']} {key}"), env_id]
            row += [f"{bound:,.0f} ({'compute limit' if atari else 'env only'})", f"{sps:,.0f}"]
            row += [f"{ratio:.2f}", f"{target:.1f}x"] if atari else [f"{ratio:.0%}", f"{target:.0%}"]
            row += ["yes" if ratio >= target else "no"]
            row += [
                f"{statistics.median(getattr(m, part) for m in measurements):.3f}" for part in ("rollout", "update")
            ]
            rows.append(row)
    facts = [
        f"1 rank, default hyperparameters, {args.iterations} iterations per script run, {args.repeats} round(s); "
        "each cell the median over rounds",
        f"load average (1, 5, 15 min) before the runs: {load_before}",
    ]
    title = "Throughput against the env-only rate and the compute limit"
    text = common.results_header(title, "benchmark.throughput", argv, facts, args.notes, warning)
    headers = common.columns(
        "script | checkout | env | bound (steps/s) | script SPS (iterations 2..) | ratio | target | met | "
        "rollout s / it | update s / it"
    )
    text += "\n" + common.markdown_table(headers, rows)
    atari = common.defaults(common.ATARI)
    envs, minibatch = atari.local_num_envs, atari.local_num_envs * atari.num_steps // atari.num_minibatches
    text += (
        "\nbound: for the MLP scripts, env steps per second of the same env in the same SyncVectorEnv (one env, "
        f"same-step autoreset, random actions); for Atari, the fp32 eager compute limit (one batch-{envs} act per env "
        f"step plus {atari.update_epochs * atari.num_minibatches} minibatch forward/backward/Adam steps of {minibatch} "
        f"per {envs * atari.num_steps:,} samples, with the script's Agent as plain PyTorch builds it: float32, NCHW). "
        "ratio = script SPS / bound.\n"
    )
    if atari_parts:
        act_ms, step_ms = (statistics.median(part) for part in zip(*atari_parts, strict=True))
        text += f"\nAtari compute limit parts: batch-{envs} act {act_ms:.2f} ms, "
        text += f"minibatch-{minibatch} step {step_ms:.1f} ms.\n"
    table_path, _ = common.output_paths(args.out)
    table_path.write_text(text)
    print(f"wrote {table_path}")
    return table_path


if __name__ == "__main__":
    main()
