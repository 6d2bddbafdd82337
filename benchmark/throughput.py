"""Throughput at default hyperparameters beside what bounds it, and beside CleanRL, measured side by side in one run.

    python -m benchmark.throughput --out benchmark/results/throughput
    python -m benchmark.throughput --compare-with ../before --repeats 3     # A/B against another checkout
    python -m benchmark.throughput --cleanrl ../cleanrl --cores all one     # beside CleanRL's PPO files

Each script runs one rank at its defaults beside its bound: the MLP scripts' env-only step rate, the Atari script's
fp32 eager compute limit (TARGETS: the least ratio to it each script aims for). With --cleanrl, CleanRL's file for
each PPO script (REFERENCE) runs beside it on the same env and batch (its defaults), by cleanrl_compat.py. Every run's
SPS is counted alike: env steps over wall time from its first to its last `charts/SPS` event, leaving out iteration 1
(start-up). Checkouts, CleanRL, loads and core settings alternate every round, the two checkouts swapping places each
round, so drift affects all; cells: medians.
"""

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch

from benchmark import common, stragglers

TARGETS = {"vpg_mpi.py": 0.5, "ppo_continuous_mpi.py": 0.3, common.ATARI: 1.2}
"""the throughput targets: the least ratio of a script's SPS to the env-only rate (MLP scripts) or to the compute
limit (Atari)"""
REFERENCE = {"ppo_continuous_mpi.py": "ppo_continuous_action.py", common.ATARI: "ppo_atari.py"}
"""CleanRL's file that each PPO script follows, run beside it with --cleanrl"""
COMPAT = Path(__file__).with_name("cleanrl_compat.py")
MAX_OTHERS = 0.25
"""above this many cores kept busy by other processes during a run, the results file opens with a warning"""


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
    cleanrl: Path | None = None
    """a CleanRL checkout, a folder of its files, or one of them: its PPO files (REFERENCE) run beside ours"""
    env_id: str = ""
    """the env id of the MLP scripts; empty = each script's default"""
    variants: tuple[str, ...] = (
        "ppo_continuous_mpi.py --compile",
        "ppo_atari_multigpu.py --bf16",
        "ppo_atari_multigpu.py --compile",
        "ppo_atari_multigpu.py --bf16 --compile",
    )
    """extra rows of this checkout, each `SCRIPT FLAG...`, run on all cores (when SCRIPT is among --scripts)"""
    loads: tuple[Literal["quiet", "busy core"], ...] = ("quiet",)
    """measure on the machine as it is, and/or beside a process busy on the last usable core"""
    cores: tuple[Literal["all", "one"], ...] = ("all",)
    """run on the usable cores (as the defaults do), and/or with every run and bound on the first core, one thread"""
    max_load: float = 1.2
    out: Path = Path("benchmark_results/throughput")

    def __post_init__(self):
        super().__post_init__()
        if self.repeats < 1 or any(variant.split()[0] not in TARGETS for variant in self.variants):
            raise SystemExit(
                f"benchmark.throughput: error: need --repeats >= 1; each variant's first word in {tuple(TARGETS)}"
            )


class Contender(NamedTuple):
    """What a row runs: its label, a tag in its run names, `python FILE FLAGS...` before the run's arguments."""

    label: str
    tag: str
    command: tuple[str, ...]
    kind: Literal["checkout", "variant", "cleanrl"] = "checkout"


def cleanrl_files(path: Path, scripts: Sequence[str]) -> dict[str, Path]:
    """CleanRL's file for each of `scripts` that `path` holds: a checkout (its cleanrl/ folder), a folder, or a file."""
    found = {}
    for script in (script for script in scripts if script in REFERENCE):
        name = REFERENCE[script]
        candidates = [path] if path.is_file() else [path / "cleanrl" / name, path / name]
        if file := next((file for file in candidates if file.name == name and file.is_file()), None):
            found[script] = file.resolve()
    if not found:
        names = " or ".join(REFERENCE[script] for script in scripts if script in REFERENCE) or "file"
        raise SystemExit(
            f"benchmark.throughput: error: {path} holds no CleanRL {names} for --scripts {' '.join(scripts)}; give a "
            "clone of CleanRL's repository (github.com/vwxyzjn/cleanrl) or one of its PPO files"
        )
    if common.ATARI in found and importlib.util.find_spec("cv2") is None:
        raise SystemExit(
            "benchmark.throughput: error: CleanRL's ppo_atari.py resizes frames with gymnasium's ResizeObservation, "
            "which needs OpenCV: pip install opencv-python-headless"
        )
    return found


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


@contextlib.contextmanager
def on_core(core: int | None) -> Iterator[None]:
    """The with-block with this thread on `core` alone (so the Atari compute limit takes one torch thread)."""
    if core is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def setting(load: str, cores: str) -> str:
    """How a row's runs were placed, as its label ends (empty: the machine as it is, the defaults' cores)."""
    return ", one core, one thread" * (cores == "one") + ", beside a busy core" * (load != "quiet")


def contenders(args: Args, script: str, checkouts: dict[str, Path], labels: dict[str, str], cleanrl: dict[str, Path]):
    """What runs for `script` in every round and setting: each checkout's script, the variants, CleanRL's file."""
    python = sys.executable
    rows = [Contender(labels[key], key, (python, str(root / script))) for key, root in checkouts.items()]
    for flags in (variant.split()[1:] for variant in args.variants if variant.split()[0] == script):
        label, tag = f"{labels['this']} {' '.join(flags)}", "_".join(flag.strip("-") for flag in flags)
        rows.append(Contender(label, tag, (python, str(common.ROOT / script), *flags), "variant"))
    if script in cleanrl:
        command = (python, str(COMPAT), str(cleanrl[script]))
        rows.append(Contender(f"{labels['cleanrl']} {cleanrl[script].name}", "cleanrl", command, "cleanrl"))
    return rows


def in_turn(contenders: list[Contender], round_index: int) -> list[Contender]:
    """The contenders in the order of this round: the two checkouts swap places every other round, so neither
    always runs right after the bound or right after the other."""
    checkouts = [contender for contender in contenders if contender.kind == "checkout"]
    others = [contender for contender in contenders if contender.kind != "checkout"]
    return (checkouts if round_index % 2 == 0 else checkouts[::-1]) + others


def run_once(contender: Contender, name: str, run_args: list[str], work_dir: Path, core: int | None) -> Path:
    """Run `contender` as NAME in `work_dir` (on `core` with one thread, if given); its TensorBoard folder."""
    cleanrl_runs = f"*__{name}__*"  # CleanRL names its folder ENV_ID__EXP_NAME__SEED__TIME
    for old in (work_dir / "runs").glob(cleanrl_runs):
        shutil.rmtree(old)
    if contender.kind == "cleanrl":  # the same run under CleanRL's flag names
        run_args = [{"--local-num-envs": "--num-envs", "--run-name": "--exp-name"}.get(arg, arg) for arg in run_args]
    command = [*contender.command, *run_args]
    if core is not None:
        command = ["taskset", "-c", str(core), "env", "OMP_NUM_THREADS=1", *command]
    [run_dir] = common.run_logged({name: command}, work_dir)
    if contender.kind == "cleanrl":
        [run_dir] = (work_dir / "runs").glob(cleanrl_runs)
    return run_dir


Runs = dict[tuple[str, Contender, str, str], list[common.Measurement]]
"""(script, contender, load, cores) -> a Measurement per round"""


def throughput_rows(runs: Runs, bounds: dict, others: dict, env_ids: dict[str, str]) -> list[list[str]]:
    """A row per script, contender and setting: the bound, the SPS, their ratio, the target (ours), the time split and
    the most cores other processes kept busy during one of its runs (`bounds`, `others`: lists per round)."""
    rows = []
    for (script, contender, load, cores), measurements in runs.items():
        limit, atari, target = statistics.median(bounds[script, load, cores]), script == common.ATARI, TARGETS[script]
        sps = statistics.median(m.sps for m in measurements)
        goal = [f"{target:.1f}x" if atari else f"{target:.0%}", "yes" if sps / limit >= target else "no"]
        seconds = [statistics.median(getattr(m, part) for m in measurements) for part in ("rollout", "update")]
        kind = "compute limit" if atari else "env only"
        rows.append([script, contender.label + setting(load, cores), env_ids[script], f"{limit:,.0f} ({kind})"])
        rows[-1] += [f"{sps:,.0f}", f"{sps / limit:.2f}" if atari else f"{sps / limit:.0%}"]
        rows[-1] += ["", ""] if contender.kind == "cleanrl" else goal
        rows[-1] += ["" if second != second else f"{second:.3f}" for second in seconds]  # NaN: CleanRL times none
        rows[-1].append(f"{max(others[script, contender, load, cores]):.2f}")
    return rows


def cleanrl_rows(runs: Runs, env_ids: dict[str, str]) -> list[list[str]]:
    """A row per script and setting that ran CleanRL's file: our SPS and its (medians), their ratio, its range."""
    ours_by_setting = {(script, *where): ms for (script, program, *where), ms in runs.items() if program.tag == "this"}
    rows = []
    for (script, contender, load, cores), theirs in runs.items():
        if contender.kind == "cleanrl":
            ours = ours_by_setting[script, load, cores][: len(theirs)]  # rounds that ran both (all, once done)
            per_round = [mine.sps / their.sps for mine, their in zip(ours, theirs, strict=True)]
            ours_sps, their_sps = (statistics.median(m.sps for m in ms) for ms in (ours, theirs))
            place = setting(load, cores)[2:] or "all usable cores (the defaults)"
            rows.append([script, Path(contender.command[-1]).name, env_ids[script], place, f"{ours_sps:,.0f}"])
            rows[-1] += [f"{their_sps:,.0f}", f"{ours_sps / their_sps:.2f}x"]
            rows[-1] += [f"{min(per_round):.2f}x - {max(per_round):.2f}x"]
    return rows


def checkout_rows(runs: Runs, env_ids: dict[str, str]) -> list[list[str]]:
    """A row per script and setting that ran both checkouts: each one's SPS (medians), the ratio of the medians, and
    this checkout's SPS over the other's within each round (their median, lowest and highest)."""
    by_checkout = {}
    for (script, contender, load, cores), measurements in runs.items():
        if contender.kind == "checkout":
            by_checkout.setdefault((script, load, cores), {})[contender.tag] = measurements
    rows = []
    for (script, load, cores), checkouts in by_checkout.items():
        if len(checkouts) == 2:
            other = checkouts["other"]
            this = checkouts["this"]
            rounds = min(len(other), len(this))  # rounds that ran both (all, once done)
            per_round = [mine.sps / theirs.sps for mine, theirs in zip(this[:rounds], other[:rounds], strict=True)]
            this_sps, other_sps = (statistics.median(m.sps for m in ms[:rounds]) for ms in (this, other))
            place = setting(load, cores)[2:] or "all usable cores (the defaults)"
            rows.append([script, env_ids[script], place, f"{other_sps:,.0f}", f"{this_sps:,.0f}"])
            rows[-1] += [f"{this_sps / other_sps:.3f}", f"{statistics.median(per_round):.3f}"]
            rows[-1] += [f"{min(per_round):.2f} - {max(per_round):.2f}"]
    return rows


def main(argv: list[str] | None = None) -> Path:
    """Measure every script beside its bound (and CleanRL's file), write OUT.md; returns its path."""
    args, argv, _ = common.cli(Args, argv)
    checkouts = {"this": common.ROOT}
    if args.compare_with is not None:
        other = args.compare_with.resolve()
        if missing := [script for script in args.scripts if not (other / script).is_file()]:
            raise SystemExit(f"benchmark.throughput: error: {other} has no {', '.join(missing)}")
        checkouts = {"other": other, "this": common.ROOT}
    labels = {key: common.code_version(root, short=True) for key, root in checkouts.items()}
    labels["this"] += " (this checkout)"
    cleanrl = {} if args.cleanrl is None else cleanrl_files(args.cleanrl, args.scripts)
    facts = []
    if cleanrl:
        files = list(cleanrl.values())
        labels["cleanrl"] = f"CleanRL {common.code_version(files[0].parent, short=True, files=files)}"
        facts.append(
            f"CleanRL: {', '.join(str(file) for file in files)} ({labels['cleanrl']}), each run as `python "
            f"benchmark/{COMPAT.name} FILE ARGS` on gymnasium {importlib.metadata.version('gymnasium')}"
        )
    env_ids = {script: common.env_id(script, "" if script == common.ATARI else args.env_id) for script in args.scripts}
    programs = {script: contenders(args, script, checkouts, labels, cleanrl) for script in args.scripts}
    load_before = common.check_load(args.max_load)
    bounds: dict[tuple[str, str, str], list[float]] = {}  # (script, load, cores) -> the bound per round
    atari_parts: list[list[float]] = []
    runs: Runs = {}
    others: dict[tuple[str, Contender, str, str], list[float]] = {}  # cores other processes used, per round
    settings = [(index, load, cores) for index in range(args.repeats) for load in args.loads for cores in args.cores]
    done = 0
    total = sum(
        1
        for _, _, cores in settings
        for script in args.scripts
        for contender in programs[script]
        if not (contender.kind == "variant" and cores == "one")
    )
    with common.work_folder(args.out_dir, "ddrl_throughput_") as work_dir:
        for round_index, load, cores in settings:
            core = common.usable_cores()[0] if cores == "one" else None
            with stragglers.cpu_hog(common.usable_cores()[-1]) if load == "busy core" else contextlib.nullcontext():
                for script in args.scripts:
                    with on_core(core):
                        limit, parts = bound(script, env_ids[script], args.env_seconds)
                    bounds.setdefault((script, load, cores), []).append(limit)
                    atari_parts += [parts] if parts and (load, cores) == ("quiet", "all") else []
                    for contender in in_turn(programs[script], round_index):
                        if contender.kind == "variant" and cores == "one":
                            continue
                        row = (script, contender, load, cores)
                        place = "__busy" * (load != "quiet") + "__one_core" * (cores == "one")
                        name = f"throughput__{Path(script).stem}__{contender.tag}{place}__{round_index}"
                        run_args = ["--env-id", env_ids[script], "--run-name", name]
                        run_args += common.budget_args(script, 1, args.local_steps, args.iterations)
                        clock = common.cpu_clock()
                        run_dir = run_once(contender, name, run_args, work_dir, core)
                        others.setdefault(row, []).append(common.other_cores(clock))
                        runs.setdefault(row, []).append(common.measure(run_dir, script, "default", 1))
                        print(f"  {contender.label}{setting(load, cores)}: SPS {runs[row][-1].sps:,.0f}", flush=True)
                        done += 1
                        partial = f"PARTIAL: {done} of {total} runs when this was written" if done < total else None
                        measured = (runs, bounds, others, atari_parts)
                        path = write_tables(args, argv, facts, measured, env_ids, cleanrl, load_before, partial)
    return path


def write_tables(
    args: Args, argv, facts: list[str], measured: tuple, env_ids: dict, cleanrl: dict, load_before: tuple,
    partial: str | None,
) -> Path:  # fmt: skip
    """OUT.md as the runs so far make it (`measured`: the runs, the bounds, the others' cores and Atari's compute
    parts; `partial`: what a benchmark cut short leaves, said at the top; None once every run ran)."""
    runs, bounds, others, atari_parts = measured
    facts = list(facts)
    runs = dict(sorted(runs.items(), key=lambda item: args.scripts.index(item[0][0])))  # by script, else as run
    headers = (
        "script | checkout | env | bound (steps/s) | script SPS (iterations 2..) | ratio | target | met | "
        "rollout s / it | update s / it | others (cores)"
    )
    atari = common.defaults(common.ATARI)
    envs, minibatch = atari.local_num_envs, atari.local_num_envs * atari.num_steps // atari.num_minibatches
    body = "\n" + common.markdown_table(headers, throughput_rows(runs, bounds, others, env_ids))
    body += (
        "\nbound: for the MLP scripts, env steps per second of the same env in the same SyncVectorEnv (one env, "
        f"same-step autoreset, random actions); for Atari, the fp32 eager compute limit (one batch-{envs} act per env "
        f"step plus {atari.update_epochs * atari.num_minibatches} minibatch forward/backward/Adam steps of {minibatch} "
        f"per {envs * atari.num_steps:,} samples, with the script's Agent as plain PyTorch builds it: float32, NCHW). "
        "ratio = script SPS / bound. One core, one thread: each run under `taskset -c CORE env OMP_NUM_THREADS=1`, "
        "its bound measured on that core alone. others: the most cores that processes other than the benchmark's "
        "kept busy, on average over one of the row's runs (/proc/stat's busy time less the runs' own CPU time), "
        "beside a busy core its spinning process (about 1) included.\n"
    )
    if atari_parts:
        act_ms, step_ms = (statistics.median(part) for part in zip(*atari_parts, strict=True))
        body += f"\nAtari compute limit parts: batch-{envs} act {act_ms:.2f} ms, minibatch-{minibatch} step"
        body += f" {step_ms:.1f} ms.\n"
    if args.compare_with is not None:
        headers = "script | env | cores | other (SPS) | this (SPS) | this / other | per round: median | range"
        body += "\n## This checkout beside the other\n\n" + common.markdown_table(headers, checkout_rows(runs, env_ids))
        body += (
            "\nthis / other: the ratio of the medians; per round: this checkout's SPS over the other's in the same "
            "round (the two ran one after the other, their order swapped every round), the median and the range.\n"
        )
    if cleanrl:
        headers = "script | CleanRL file | env | cores | ours (SPS) | CleanRL (SPS) | ours / CleanRL | per round"
        body += "\n## Beside CleanRL\n\n" + common.markdown_table(headers, cleanrl_rows(runs, env_ids))
        body += (
            "\nIn every round and setting our script's run is followed by CleanRL's file, one rank each, on the same "
            "env and batch. Both SPS are env steps over the wall time between the first and the last `charts/SPS` "
            "event of the run's TensorBoard file (iteration 1, with start-up, left out). ours / CleanRL = the ratio "
            "of the medians; per round: its lowest and highest value in a single round.\n"
        )
    batch = f"{args.local_steps:,} env steps per iteration" if args.local_steps else "default hyperparameters"
    facts.insert(0, f"1 rank, {batch}, {args.iterations} iterations per run, {args.repeats} round(s): medians")
    title = "Throughput against the env-only rate and the compute limit"
    load, warning = load_before
    beyond = [max(shared) - (place == "busy core") for (*_, place, _), shared in others.items()]  # less the hog
    if (most := max(beyond, default=0.0)) > MAX_OTHERS:
        shared = f"SHARED CPU: other processes kept up to {most:.2f} cores busy during a run (column others, less the"
        shared += f" busy core's process); rows above {MAX_OTHERS} are distorted."
        warning = " ".join(filter(None, [warning, shared]))
    return common.write_results(
        args, argv, title, facts, body, load, " ".join(filter(None, [partial, warning])) or None
    )


if __name__ == "__main__":
    main()
