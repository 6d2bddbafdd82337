"""Throughput, start-up and the weight check's cost, side by side: the benchmarks' one A/B runner.

    python -m benchmark.throughput --out benchmark/results/throughput
    python -m benchmark.throughput --compare-with ../before --repeats 3     # A/B against another checkout
    python -m benchmark.throughput --cleanrl ../cleanrl --cores all one     # beside CleanRL's PPO files

Each script runs (--ranks ranks, by its own --nprocs) beside its bound (the MLP scripts' env-only step rate, the Atari
script's fp32 eager compute limit), its variants, the other checkout's script and CleanRL's file (by cleanrl_compat.py).
A run's SPS: env steps over the wall time from its first to its last `charts/SPS` event (iteration 1 left out); its
start-up: seconds from the launch to its batch table, its first progress line and its exit. The weight check
(ddrl.in_sync.check_in_sync) is timed beside the bound. Contenders, loads and core settings alternate every round, the
two checkouts swapping places, so drift affects all; cells: medians over the rounds.
"""

import contextlib
import importlib.metadata
import importlib.util
import math
import os
import shutil
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import torch
from annotated_types import Ge

from benchmark import common, grad_sync, stragglers
from ddrl import in_sync
from ddrl.flags import RuntimeArgs

REFERENCE = {"ppo_continuous_mpi.py": "ppo_continuous_action.py", common.ATARI: "ppo_atari.py"}
"""CleanRL's file that each PPO script follows, run beside it with --cleanrl"""
COMPAT = Path(__file__).with_name("cleanrl_compat.py")
ATARI_VARIANTS = tuple(f"{common.ATARI} {flags}" for flags in ("--bf16", "--compile", "--bf16 --compile"))
MAX_OTHERS = 0.25
"""above this many cores kept busy by other processes during a run, the results file opens with a warning"""
CHECK_EVERY = RuntimeArgs.check_sync_every
"""--check-sync-every's default, at which the weight check's share of an iteration is given"""


@dataclass(kw_only=True)
class Args(common.RunsArgs):
    scripts: tuple[common.Script, ...] = common.SCRIPTS
    """the scripts to measure"""
    env_seconds: float = 3.0
    """seconds of env-only stepping per env id (and of each timed part of the Atari compute limit, and of the check)"""
    repeats: Annotated[int, Ge(1)] = 1
    """rounds of every measurement; each table cell is the median over the rounds"""
    ranks: Annotated[int, Ge(1)] = 1
    """ranks of every run of our scripts (their --nprocs); CleanRL's files run one process"""
    local_envs: Annotated[int, Ge(0)] = 0
    """envs per rank (--local-num-envs); 0 = the script's default"""
    compare_with: Path | None = None
    """another checkout (e.g. `git worktree add ../before HEAD~1`) whose scripts run beside this checkout's (A/B)"""
    cleanrl: Path | None = None
    """a CleanRL checkout, a folder of its files, or one of them: its PPO files (REFERENCE) run beside ours"""
    variants: tuple[str, ...] = ("ppo_continuous_mpi.py --compile", *ATARI_VARIANTS)
    """extra rows of this checkout, each `SCRIPT FLAG...` (when SCRIPT is among --scripts)"""
    loads: tuple[Literal["quiet", "busy core"], ...] = ("quiet",)
    """measure on the machine as it is, and/or beside a process busy on the last usable core"""
    cores: tuple[Literal["all", "one"], ...] = ("all",)
    """run on the usable cores (as the defaults do), and/or with every run and bound on the first core, one thread"""
    max_load: float = 1.2
    out: Path = Path("benchmark_results/throughput")

    def __post_init__(self):
        if any(variant.split()[0] not in common.SCRIPTS for variant in self.variants):
            raise SystemExit(f"benchmark.throughput: error: each of --variants starts with one of {common.SCRIPTS}")
        if self.ranks > 1 and ("one" in self.cores or self.cleanrl is not None):
            raise SystemExit("benchmark.throughput: error: --ranks above 1 runs without --cores one and --cleanrl")


class Contender(NamedTuple):
    """What a row runs: its label, a tag in its run names, `FILE FLAGS...` (run by Python, before the run's own)."""

    label: str
    tag: str
    command: tuple[str, ...]
    kind: Literal["checkout", "variant", "cleanrl"] = "checkout"


class Result(NamedTuple):
    """One run: its SPS and rank 0's seconds per rollout and update, the cores other processes kept busy meanwhile,
    and its start-up: seconds to its batch table, to its first progress line, to its exit (NaN if never: CleanRL)."""

    sps: float
    rollout: float
    update: float
    others: float
    table: float
    progress: float
    end: float


Runs = dict[tuple[str, Contender, str, str], list[Result]]
"""(script, contender, load, cores) -> a Result per round"""


def cleanrl_files(path: Path, scripts: Sequence[str]) -> dict[str, Path]:
    """CleanRL's file for each of `scripts` that `path` holds: a checkout (its cleanrl/ folder), a folder, or a file."""
    found = {}
    for script, name in ((script, REFERENCE[script]) for script in scripts if script in REFERENCE):
        candidates = [path] if path.is_file() else [path / "cleanrl" / name, path / name]
        if file := next((file for file in candidates if file.name == name and file.is_file()), None):
            found[script] = file.resolve()
    if not found:
        names = " or ".join(REFERENCE[script] for script in scripts if script in REFERENCE) or "file"
        raise SystemExit(f"benchmark.throughput: error: {path} holds no CleanRL {names}: give a CleanRL clone")
    if common.ATARI in found and importlib.util.find_spec("cv2") is None:
        raise SystemExit("benchmark.throughput: error: CleanRL's ppo_atari.py needs pip install opencv-python-headless")
    return found


def env_only_rate(script: str, seconds: float) -> float:
    """Env steps per second of the script's default env as it builds it, in a SyncVectorEnv of one, random actions."""
    import gymnasium as gym

    module = common.load_script(script)
    autoreset = gym.vector.AutoresetMode.SAME_STEP
    envs = gym.vector.SyncVectorEnv([module.make_env(module.Args())], autoreset_mode=autoreset)
    with contextlib.closing(envs):
        envs.reset(seed=1)
        envs.action_space.seed(1)
        actions = [envs.action_space.sample() for _ in range(1000)]
        for action in actions[:200]:  # warm-up
            envs.step(action)
        return len(actions) / common.rate(lambda: [envs.step(action) for action in actions], seconds, warmup=0)


def atari_compute_limit(seconds: float) -> tuple[float, float, float]:
    """ppo_atari_multigpu.py's fp32 eager compute limit at its defaults: (samples/s, ms per act of its envs, ms per
    minibatch forward+backward+Adam step), its Agent's get_action_and_value as plain PyTorch runs it (NCHW)."""
    defaults = common.defaults(common.ATARI)
    model, minibatch, _ = grad_sync.build("atari", rank=0)  # the Agent in a PPO-like loss, a random minibatch
    optimizer = torch.optim.Adam(model.parameters(), lr=defaults.learning_rate, eps=1e-5)
    frames = minibatch[0][: defaults.local_num_envs]
    with torch.inference_mode():
        act = common.rate(lambda: model.agent.get_action_and_value(frames), seconds)
    step = common.rate(lambda: (grad_sync.backward(model, minibatch), optimizer.step()), seconds)
    update_steps = defaults.update_epochs * defaults.num_minibatches
    return defaults.local_num_envs / (act + update_steps * step / defaults.num_steps), act * 1e3, step * 1e3


def bound(script: str, seconds: float) -> tuple[float, list[float]]:
    """What bounds `script`'s SPS, measured now: the env-only rate, or for Atari the compute limit (and its parts)."""
    if script == common.ATARI:
        limit, *parts = atari_compute_limit(seconds)
        return limit, parts
    return env_only_rate(script, seconds), []


def check_seconds(script: str, seconds: float) -> tuple[float, int]:
    """Seconds per weight check (ddrl.in_sync.check_in_sync in one process: the checksum of the script's Agent for its
    default env, an Adam's options and its default args) and the Agent's parameter count."""
    agent = common.agent_of(script)
    optimizer = torch.optim.Adam(agent.parameters())
    args = common.defaults(script)
    main = sys._getframe()  # the frame whose variables the check reads, as main's in a run
    device = torch.device("cpu")
    check = common.rate(lambda: in_sync.check_in_sync(1, "iteration", main, args, device), seconds)
    return check, sum(p.numel() for group in optimizer.param_groups for p in group["params"])


@contextlib.contextmanager
def on_core(core: int | None) -> Iterator[None]:
    """The with-block with this process on `core` alone, one torch thread (as a run under `taskset` takes it)."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    if core is not None:
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
    yield  # an error ends the benchmark: nothing to restore then
    os.sched_setaffinity(0, before[0])
    torch.set_num_threads(before[1])


def setting(load: str, cores: str) -> str:
    """How a row's runs were placed, as its label ends (empty: the machine as it is, the defaults' cores)."""
    return ", one core, one thread" * (cores == "one") + ", beside a busy core" * (load != "quiet")


def contenders(args: Args, script: str, checkouts: dict[str, Path], labels: dict[str, str], cleanrl: dict[str, Path]):
    """What runs for `script` in every round and setting: each checkout's script, the variants, CleanRL's file."""
    rows = [Contender(labels[key], key, (str(root / script),)) for key, root in checkouts.items()]
    for flags in (variant.split()[1:] for variant in args.variants if variant.split()[0] == script):
        tag = "_".join(flag.strip("-") for flag in flags)
        command = (str(common.ROOT / script), *flags)
        rows.append(Contender(f"{labels['this']} {' '.join(flags)}", tag, command, "variant"))
    if script in cleanrl:
        command = (str(COMPAT), str(cleanrl[script]))
        rows.append(Contender(f"{labels['cleanrl']} {cleanrl[script].name}", "cleanrl", command, "cleanrl"))
    return rows


def in_turn(contenders: list[Contender], round_index: int) -> list[Contender]:
    """The contenders in the order of this round: the two checkouts swap places every other round, so neither
    always runs right after the bound or right after the other."""
    checkouts = [contender for contender in contenders if contender.kind == "checkout"]
    others = [contender for contender in contenders if contender.kind != "checkout"]
    return (checkouts if round_index % 2 == 0 else checkouts[::-1]) + others


def run_once(contender: Contender, name: str, run_args: list[str], work_dir: Path, core: int | None, ranks: int):
    """Run `contender` as NAME in `work_dir` (on `core` with one thread, if given), following its output: its
    TensorBoard folder, and its start-up (seconds to the batch table, to the first progress line, to the exit)."""
    cleanrl_runs = f"*__{name}__*"  # CleanRL names its folder ENV_ID__EXP_NAME__SEED__TIME
    for old in [*(work_dir / "runs").glob(cleanrl_runs), work_dir / "runs" / name]:
        shutil.rmtree(old, ignore_errors=True)
    command = [sys.executable, *contender.command, *(["--nprocs", str(ranks)] if ranks > 1 else []), *run_args]
    if contender.kind == "cleanrl":  # the same run under CleanRL's flag names
        command = [{"--local-num-envs": "--num-envs", "--run-name": "--exp-name"}.get(arg, arg) for arg in command]
    if core is not None:
        command = ["taskset", "-c", str(core), "env", "OMP_NUM_THREADS=1", *command]
    seen = {}

    def note(process, seconds: float, line: str) -> None:
        if line.split()[:1] == ["ranks"]:  # the batch table's first row
            seen.setdefault("table", seconds)
        if common.PROGRESS_LINE.match(line):
            seen.setdefault("progress", seconds)

    log = work_dir / "logs" / f"{name}.log"
    code, end = common.follow(command, work_dir, log, note)
    if code:
        raise common.failed(name, code, log)
    [run_dir] = (work_dir / "runs").glob(cleanrl_runs) if contender.kind == "cleanrl" else [work_dir / "runs" / name]
    return run_dir, (seen.get("table", math.nan), seen.get("progress", math.nan), end)


def median(results: list[Result], part: str) -> float:
    """The median over the rounds of one of a Result's numbers."""
    return statistics.median(getattr(result, part) for result in results)


def throughput_rows(runs: Runs, bounds: dict) -> list[list[str]]:
    """A row per script, contender and setting: the bound, the SPS, their ratio, the time split and the most cores
    other processes kept busy during one of its runs (`bounds`: a list per round)."""
    rows = []
    for (script, contender, load, cores), results in runs.items():
        limit = statistics.median(bounds[script, load, cores])
        atari = script == common.ATARI
        sps = median(results, "sps")
        env_id = common.defaults(script).env_id
        cell = f"{limit:,.0f} ({'compute limit' if atari else 'env only'})"
        ratio = f"{sps / limit:.2f}" if atari else f"{sps / limit:.0%}"
        rows.append([script, contender.label + setting(load, cores), env_id, cell, f"{sps:,.0f}", ratio])
        seconds = [median(results, part) for part in ("rollout", "update")]
        rows[-1] += ["" if math.isnan(second) else f"{second:.3f}" for second in seconds]  # CleanRL times none
        rows[-1].append(f"{max(r.others for r in results):.2f}")
    return rows


def beside_rows(runs: Runs, kind: str) -> list[list[str]]:
    """A row per script and setting that ran this checkout beside a contender of `kind` (the other checkout, or
    CleanRL's file): its SPS and ours (medians), their ratio, and ours over its within each round (median, range)."""
    rows = []
    for (script, contender, load, cores), theirs in runs.items():
        if contender.kind != kind or contender.tag == "this":
            continue
        for (our_script, program, our_load, our_cores), mine in runs.items():
            ours = program.tag == "this" or program.kind == "variant"
            if not ours or (our_script, our_load, our_cores) != (script, load, cores):
                continue
            flags = " ".join(word for word in program.command if word.startswith("-"))
            mine = mine[: len(theirs)]  # rounds that ran both (all, once done)
            per_round = [a.sps / b.sps for a, b in zip(mine, theirs[: len(mine)], strict=True)]
            place = setting(load, cores)[2:] or "all usable cores (the defaults)"
            name = [Path(contender.command[-1]).name] if kind == "cleanrl" else []
            their_sps = median(theirs[: len(mine)], "sps")
            this_sps = median(mine, "sps")
            env = common.defaults(script).env_id
            rows.append([script, *name, env, place, flags or "as run", f"{their_sps:,.0f}", f"{this_sps:,.0f}"])
            rows[-1] += [f"{this_sps / their_sps:.3f}", f"{statistics.median(per_round):.3f}"]
            rows[-1].append(f"{min(per_round):.2f} - {max(per_round):.2f}")
    return rows


def startup_rows(runs: Runs) -> list[list[str]]:
    """A row per script, contender and setting of our scripts: the medians of its start-up and the range of its first
    progress line; below this checkout's, where the other checkout ran too, the difference of their medians."""
    others = {(script, *where): found for (script, program, *where), found in runs.items() if program.tag == "other"}
    rows = []
    for (script, contender, load, cores), results in runs.items():
        if contender.kind != "cleanrl":
            spread = f"{min(r.progress for r in results):.2f} - {max(r.progress for r in results):.2f}"
            cells = [f"{median(results, part):.2f}" for part in ("table", "progress", "end")]
            rows.append([script, contender.label + setting(load, cores), *cells[:2], spread, cells[2]])
        if contender.tag == "this" and (script, load, cores) in others:
            difference = median(results, "progress") - median(others[script, load, cores], "progress")
            rows.append([script, f"difference (this - other){setting(load, cores)}", "", f"{difference:+.2f}", "", ""])
    return rows


def check_rows(runs: Runs, checked: dict[str, list[tuple[float, int]]]) -> list[list[str]]:
    """A row per script: the weight check's median seconds beside this checkout's iteration (its first setting's
    rollout + update), their ratio, and its share of an iteration at --check-sync-every CHECK_EVERY."""
    rows = []
    for script, timings in checked.items():
        results = next((found for key, found in runs.items() if key[0] == script and key[1].tag == "this"), None)
        if results:  # this checkout's script has run
            seconds = statistics.median(timing[0] for timing in timings)
            iteration = median(results, "rollout") + median(results, "update")
            rows.append([script, f"{timings[0][1]:,}", f"{1e3 * seconds:.2f}", f"{iteration:.3f}"])
            rows[-1] += [f"{seconds / iteration:.3%}", f"{seconds / iteration / CHECK_EVERY:.3%}"]
    return rows


def main(argv: list[str] | None = None) -> Path:
    """Measure every script beside its bound, its variants, the other checkout and CleanRL's file, write OUT.md after
    every run (a run stopped early keeps what it measured, marked partial); returns its path."""
    args, argv, _ = common.cli(Args, argv)
    checkouts = {"other": args.compare_with.resolve()} if args.compare_with else {}
    if missing := [script for script in args.scripts for root in checkouts.values() if not (root / script).is_file()]:
        raise SystemExit(f"benchmark.throughput: error: {checkouts['other']} has no {', '.join(missing)}")
    checkouts["this"] = common.ROOT
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
    programs = {script: contenders(args, script, checkouts, labels, cleanrl) for script in args.scripts}
    load_before = common.check_load(args.max_load)
    measured = {"runs": {}, "bounds": {}, "atari_parts": [], "checked": {}}
    settings = [(index, load, cores) for index in range(args.repeats) for load in args.loads for cores in args.cores]
    total = len(settings) * sum(len(found) for found in programs.values())
    with common.work_folder(args.out_dir, "ddrl_throughput_") as work_dir:
        for round_index, load, cores in settings:
            core = common.usable_cores()[0] if cores == "one" else None
            with stragglers.cpu_hog(common.usable_cores()[-1]) if load == "busy core" else contextlib.nullcontext():
                for script in args.scripts:
                    with on_core(core):
                        limit, parts = bound(script, args.env_seconds)
                        if (load, cores) == (args.loads[0], args.cores[0]):  # once per round
                            measured["checked"].setdefault(script, []).append(check_seconds(script, args.env_seconds))
                            measured["atari_parts"] += [parts] if parts else []
                    measured["bounds"].setdefault((script, load, cores), []).append(limit)
                    for contender in in_turn(programs[script], round_index):
                        place = "__busy" * (load != "quiet") + "__one_core" * (cores == "one")
                        name = f"throughput__{Path(script).stem}__{contender.tag}{place}__{round_index}"
                        ranks = 1 if contender.kind == "cleanrl" else args.ranks
                        budget = common.budget_args(script, ranks, args.local_steps, args.iterations, args.local_envs)
                        clock = common.cpu_clock()
                        run_args = [*budget, "--env-id", common.defaults(script).env_id, "--run-name", name]
                        run_dir, start_up = run_once(contender, name, run_args, work_dir, core, ranks)
                        others = common.other_cores(clock)
                        found = common.measure(run_dir, script, "default", ranks)
                        result = Result(found.sps, found.rollout, found.update, others, *start_up)
                        measured["runs"].setdefault((script, contender, load, cores), []).append(result)
                        print(f"  {contender.label}{setting(load, cores)}: SPS {result.sps:,.0f}", flush=True)
                        done = sum(len(results) for results in measured["runs"].values())
                        partial = f"PARTIAL: {done} of {total} runs when this was written" if done < total else None
                        path = write_tables(args, argv, facts, measured, load_before, partial)
    return path


def write_tables(args: Args, argv, facts: list[str], measured: dict, load: tuple, partial: str | None) -> Path:
    """OUT.md as the runs so far make it (`measured`: the runs, the bounds, Atari's compute parts and the weight
    checks; `load` as check_load gave it; `partial`: what a benchmark cut short says, None once every run ran)."""
    runs = dict(sorted(measured["runs"].items(), key=lambda item: args.scripts.index(item[0][0])))  # by script
    atari = common.defaults(common.ATARI)
    envs = atari.local_num_envs
    minibatch = envs * atari.num_steps // atari.num_minibatches
    headers = "script | checkout | env | bound (steps/s) | script SPS (iterations 2..) | ratio | rollout s / it | "
    headers += "update s / it | others (cores)"
    body = "\n" + common.markdown_table(headers, throughput_rows(runs, measured["bounds"]))
    body += (
        "\nbound: for the MLP scripts, the same env stepped alone (a SyncVectorEnv of one, random actions); for Atari, "
        f"the fp32 eager compute limit (a batch-{envs} act per env step, {atari.update_epochs * atari.num_minibatches} "
        f"minibatch forward/backward/Adam steps of {minibatch} per {envs * atari.num_steps:,} samples, the Agent in "
        "plain PyTorch: float32, NCHW). ratio = SPS / bound. One core, one thread: `taskset -c CORE env "
        "OMP_NUM_THREADS=1`, the bound on that core alone. others: the most cores that other processes kept busy "
        "during one of the row's runs (/proc/stat's busy time less the runs' own), a busy core's process included.\n"
    )
    if measured["atari_parts"]:
        act_ms, step_ms = (statistics.median(part) for part in zip(*measured["atari_parts"], strict=True))
        body += f"\nAtari compute limit parts: batch-{envs} act {act_ms:.2f} ms, minibatch-{minibatch} step "
        body += f"{step_ms:.1f} ms.\n"
    per_round = "per round: ours over theirs in each round (run one after the other), the median | range"
    columns = {"checkout": "script | env | cores | this's flags | other (SPS) | this (SPS) | this / other"}
    columns["cleanrl"] = "script | CleanRL file | env | cores | our flags | CleanRL (SPS) | ours (SPS) | ours / CleanRL"
    for kind, title in (("checkout", "This checkout beside the other"), ("cleanrl", "Beside CleanRL")):
        if rows := beside_rows(runs, kind):
            body += f"\n## {title}\n\n" + common.markdown_table(f"{columns[kind]} | {per_round}", rows)
    headers = "script | run | to the batch table, s | to the first progress line, s | its range, s | to the exit, s"
    body += "\n## Start-up (seconds from the launch)\n\n" + common.markdown_table(headers, startup_rows(runs))
    headers = "script | parameters | one check, ms | one iteration, s (this checkout) | one check / one iteration | "
    headers += f"per iteration at --check-sync-every {CHECK_EVERY}"
    body += "\n## The weight check\n\n" + common.markdown_table(headers, check_rows(runs, measured["checked"]))
    body += (
        "\nThe check: ddrl.in_sync.check_in_sync in this process (a world of one: no gather) on the script's Agent for "
        "its default env, an Adam's options and its default args; the iteration: this checkout's perf/rollout_time + "
        "perf/update_time (medians).\n"
    )
    batch = f"{args.local_steps:,} env steps per iteration" if args.local_steps else "default hyperparameters"
    facts = [f"{args.ranks} rank(s), {batch}, {args.iterations} iterations per run, {args.repeats} round(s)", *facts]
    beyond = [max(r.others for r in results) - (key[2] == "busy core") for key, results in runs.items()]
    shared = None
    if (most := max(beyond, default=0.0)) > MAX_OTHERS:
        shared = f"SHARED CPU: other processes kept up to {most:.2f} cores busy during a run (column others, less a "
        shared += f"busy core's process); rows above {MAX_OTHERS} are distorted."
    title = "Throughput against the env-only rate and the compute limit"
    return common.write_results(args, argv, title, facts, body, load, partial, shared)


if __name__ == "__main__":
    main()
