"""What the benchmark modules share: arguments, the scripts and their defaults, launching them, reading their
TensorBoard event files, and writing a results file."""

import contextlib
import datetime
import functools
import importlib.util
import itertools
import math
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO, TypeVar, get_args

import torch
import tyro

from ddrl import env_support

ROOT = Path(__file__).resolve().parent.parent
"""the repository root, where the scripts live"""
Script = Literal["vpg_mpi.py", "ppo_continuous_mpi.py", "ppo_atari_multigpu.py"]
SCRIPTS: tuple[str, ...] = get_args(Script)
"""the training scripts the benchmarks know"""
ATARI = "ppo_atari_multigpu.py"
ArgsT = TypeVar("ArgsT")
PINNED = (
    "`taskset -c C0,..,C(N-1) env PYTHONPATH=benchmark/pin_rank DDRL_PIN_CORES=C0,..,C(N-1) python SCRIPT --nprocs N "
    "--collectives torch` (`mpi` under mpirun), benchmark/pin_rank/sitecustomize.py pinning local rank r to core Cr"
)
"""how script_command launches N pinned ranks, as a results file says it"""


def usable_cores() -> list[int]:
    """The cores this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


@dataclass(kw_only=True)
class ResultsArgs:
    """The arguments of every module that writes a results file (each sets its own default `out`)."""

    out: Path = Path("benchmark_results/results")
    """output stem: writes OUT.md (and OUT.png where the module plots)"""
    notes: tuple[str, ...] = ()
    """paragraphs of prose under the results file's header (what was run, how and why), not in its command line"""


@dataclass(kw_only=True)
class TimingArgs(ResultsArgs):
    max_load: float = 1.0
    """above this 1-minute load average at the start, the results file opens with a MEASURED UNDER LOAD warning"""


@dataclass(kw_only=True)
class RunsArgs(TimingArgs):
    iterations: int = 6
    """iterations (epochs) per run; at least 2 (the first is left out of SPS and the time split)"""
    local_steps: int = 0
    """env steps per rank per iteration; 0 = the script's own default batch"""
    out_dir: Path | None = None
    """where the runs are launched (runs/ and logs/ land there, and are kept); default: a temporary folder"""

    def __post_init__(self):
        if self.iterations < 2:
            raise SystemExit("benchmark: error: need --iterations >= 2 (the first is left out of SPS)")


def cli(args_class: type[ArgsT], argv: Sequence[str] | None, script_args: bool = False) -> tuple[ArgsT, list, list]:
    """A module's Args (its docstring the help), the command line, and the arguments after `--` (for the script)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    if cut < len(argv) and not script_args:
        raise SystemExit("benchmark: error: this module runs no script, so it takes no arguments after --")
    description = sys.modules[args_class.__module__].__doc__
    return tyro.cli(args_class, args=argv[:cut], description=description), argv, argv[cut + 1 :]


@contextlib.contextmanager
def work_folder(out_dir: Path | None, prefix: str) -> Iterator[Path]:
    """Where the runs are launched for the with-block: `out_dir`, or a temporary folder deleted afterwards."""
    if out_dir is not None:
        yield out_dir.resolve()
        return
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as folder:
        yield Path(folder)


@functools.cache
def load_script(script: str, root: Path = ROOT):
    """A training script of checkout `root` imported as a module (importing one does no work)."""
    spec = importlib.util.spec_from_file_location(f"{Path(script).stem}_{abs(hash(str(root)))}", root / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def defaults(script: str):
    """The script's default hyperparameters: its `Args()`."""
    return load_script(script).Args()


def env_id(script: str, chosen: str = "") -> str:
    """`chosen`, or else the script's default env id."""
    return chosen or defaults(script).env_id


def env_spaces(script: str) -> tuple:
    """(observation space, action space) of the script's default env, with the script's warning filters."""
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env_support.silence_settotalmass_warning()
    with contextlib.closing(gym.make(defaults(script).env_id)) as env:
        return env.observation_space, env.action_space


def budget_args(script: str, ranks: int, local_steps: int, iterations: int) -> list[str]:
    """`script`'s arguments for `local_steps` env steps per rank (0: its default batch) for `iterations` iterations."""
    args = defaults(script)
    if not local_steps:
        local_steps = args.steps_per_epoch if script == "vpg_mpi.py" else args.local_num_envs * args.num_steps
    total = ["--total-timesteps", str(iterations * ranks * local_steps)]
    if script == "vpg_mpi.py":  # SpinningUp's global steps per epoch
        return ["--steps-per-epoch", str(ranks * local_steps), *total]
    if local_steps % args.local_num_envs:
        raise SystemExit(f"benchmark: error: --local-steps must be a multiple of {script}'s {args.local_num_envs} envs")
    steps = ["--num-steps", str(local_steps // args.local_num_envs)]
    return ["--local-num-envs", str(args.local_num_envs), *steps, *total]


def script_command(
    script: Path, args: Sequence[str], ranks: int = 1, launcher: str = "", cores: Sequence[int] = ()
) -> list[str]:
    """`python SCRIPT ARGS` as `ranks` ranks by the script's own `--nprocs`, with `cores` pinned as PINNED says."""
    command = [sys.executable, str(script)]
    if ranks > 1:
        collectives = {"torchrun": ["--collectives", "torch"], "mpirun": ["--collectives", "mpi"], "": []}[launcher]
        command += ["--nprocs", str(ranks), *collectives]
    if not cores:
        return [*command, *args]
    if ranks > len(cores):
        raise ValueError(f"{ranks} ranks but only {len(cores)} usable cores")
    pinned = ",".join(str(core) for core in cores[:ranks])
    if ranks > 1:
        path = os.pathsep.join(filter(None, [str(ROOT / "benchmark" / "pin_rank"), os.environ.get("PYTHONPATH")]))
        command = ["env", f"PYTHONPATH={path}", f"DDRL_PIN_CORES={pinned}", *command]
    return ["taskset", "-c", pinned, *command, *args]


def start(command: Sequence[str], cwd: Path, log_path: Path, pipe: bool = False) -> tuple[subprocess.Popen, TextIO]:
    """Start `command` in `cwd`, its output to `log_path` (headed by the command) or with `pipe` to the caller."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 (the caller closes it)
    log.write(f"$ (cd {shlex.quote(str(cwd))} && {shlex.join(command)})\n")
    log.flush()
    env, output = {**os.environ, "PYTHONUNBUFFERED": "1"}, subprocess.PIPE if pipe else log
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True, bufsize=1)
    return process, log


def run_at_once(commands: Sequence[Sequence[str]], log_paths: Sequence[Path], cwd: Path) -> list[int]:
    """Start every command in `cwd` at once, each one's output to its log; wait for all, their exit codes."""
    started = [start(command, cwd, log_path) for command, log_path in zip(commands, log_paths, strict=True)]
    for _, log in started:
        log.close()  # each child keeps its own copy of the file
    return [process.wait() for process, _ in started]


def last_lines(path: Path, count: int = 15) -> str:
    """The last `count` lines of a log file (to show why a run failed)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-count:])


def run_logged(commands: dict[str, list[str]], work_dir: Path, at_once: bool = False) -> list[Path]:
    """Run each command NAME in `work_dir` (output to logs/NAME.log), in turn or at once; their folders runs/NAME."""
    logs = [work_dir / "logs" / f"{name}.log" for name in commands]
    for name in commands:
        shutil.rmtree(work_dir / "runs" / name, ignore_errors=True)
    pairs = list(zip(commands.values(), logs, strict=True))
    batches = [pairs] if at_once else [[pair] for pair in pairs]  # all at once, or one after the other
    codes = [code for batch in batches for code in run_at_once(*zip(*batch, strict=True), cwd=work_dir)]
    for name, log, code in zip(commands, logs, codes, strict=True):
        if code:
            raise SystemExit(f"benchmark: error: run {name} failed (exit {code}); {log}:\n{last_lines(log)}")
    return [work_dir / "runs" / name for name in commands]


def _accumulator(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def read_scalar_events(run_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar series in a run folder's event files, as (wall_time, step, value) triples in logged order."""
    accumulator = _accumulator(run_dir)
    tags = accumulator.Tags()["scalars"]
    return {tag: [(event.wall_time, event.step, event.value) for event in accumulator.Scalars(tag)] for tag in tags}


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a run folder's event files, as (step, value) pairs."""
    return {tag: [(step, value) for _, step, value in events] for tag, events in read_scalar_events(run_dir).items()}


def read_hyperparameters(run_dir: Path) -> dict[str, str]:
    """The `hyperparameters` text table every script writes (its Args, as strings); empty if there is none."""
    accumulator = _accumulator(run_dir)
    if "hyperparameters/text_summary" not in accumulator.Tags()["tensors"]:
        return {}
    text = accumulator.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    rows = [line.strip().strip("|").split("|", 1) for line in text.splitlines()[2:]]
    return {row[0]: row[1] for row in rows if len(row) == 2}


@dataclass
class Measurement:
    """One run of a script reduced to its speed and rank 0's seconds per iteration in each part."""

    script: str
    mode: str
    ranks: int
    global_batch: int
    iterations: int
    sps: float
    script_sps: float
    rollout: float
    update: float
    sync: float


def measure(run_dir: Path, script: str, mode: str, ranks: int) -> Measurement:
    """A run as a Measurement: SPS and perf/PART_time medians over iterations 2.. (no start-up), and charts/SPS.
    A run that logs no perf/PART_time (CleanRL's) gets NaN seconds for it."""
    scalars = read_scalar_events(run_dir)
    sps_events = scalars.get("charts/SPS", [])
    if len(sps_events) < 2:
        raise SystemExit(f"benchmark: error: {run_dir} logged {len(sps_events)} iterations; need at least 2")
    (first_wall, first_step, _), (last_wall, last_step, script_sps) = sps_events[0], sps_events[-1]
    sps = (last_step - first_step) / max(last_wall - first_wall, 1e-9)
    batch = (last_step - first_step) // (len(sps_events) - 1)
    parts = [scalars.get(f"perf/{part}_time", [])[1:] for part in ("rollout", "update", "sync")]  # as the scripts time
    seconds = [statistics.median(event[2] for event in events) if events else math.nan for events in parts]
    return Measurement(script, mode, ranks, batch, len(sps_events), sps, script_sps, *seconds)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def cpu_details() -> str:
    """What tells apart CPUs of one model name: family, model and the vector extensions torch uses; empty if unknown."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    if "model" not in fields:
        return ""
    flags = fields.get("flags", "").split()
    extensions = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags] or ["no AVX2"]
    return f"family {fields.get('cpu family', '?')} model {fields['model']}, {' '.join(extensions)}"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` shows them."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"


def cpu_clock() -> tuple[float, float, float]:
    """(wall seconds, busy CPU seconds of the machine, CPU seconds of this process and its waited-for children)."""
    busy = math.nan
    with contextlib.suppress(OSError):  # /proc/stat's first line: cpu user nice system idle iowait irq softirq ...
        ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return time.perf_counter(), busy, sum(use.ru_utime + use.ru_stime for use in usage)


def other_cores(since: tuple[float, float, float]) -> float:
    """The cores that other processes kept busy, on average, since `since` (a cpu_clock()); NaN off Linux."""
    (wall, busy, own), (start_wall, start_busy, start_own) = cpu_clock(), since
    others = max((busy - start_busy) - (own - start_own), 0.0)  # NaN stays NaN; the clock ticks' jitter stays >= 0
    return others / max(wall - start_wall, 1e-9)


def check_load(max_load: float) -> tuple[str, str | None]:
    """Before a timing: the load averages now, and a warning (printed too) if the 1-minute one exceeds `max_load`."""
    load = load_average()
    if load == "unknown" or float(load.split(",")[0]) <= max_load:
        return load, None
    warning = (
        f"MEASURED UNDER LOAD: the 1-minute load average was {load.split(',')[0]} when the measurement started (more "
        f"than {max_load}): other processes shared the CPU, so these timings are distorted. Re-run on a quiet machine."
    )
    print(f"benchmark: warning: {warning}", file=sys.stderr)
    return load, warning


def code_version(root: Path = ROOT, short: bool = False, files: Sequence[str | Path] = (*SCRIPTS, "ddrl")) -> str:
    """The git commit of a checkout, and which of `files` (the scripts and the package they import) differ from it
    (`+changes` if `short`)."""
    try:
        git = ["git", "-C", str(root)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        status = [*git, "status", "--porcelain", "--", *map(str, files)]
        changed = subprocess.run(status, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    dirty = [line[3:] for line in changed.stdout.splitlines()]
    changes = ("+changes" if short else f" with uncommitted changes to {', '.join(dirty)}") if dirty else ""
    return commit.stdout.strip() + changes


def command_line(module: str, argv: Sequence[str]) -> str:
    """The shell command of a `python -m benchmark.X` invocation without `--notes` (a results file's prose)."""
    shown, in_notes = [], False
    for index, arg in enumerate(argv):
        if arg == "--":  # the rest goes to the script
            shown += argv[index:]
            break
        if arg.startswith("--"):
            in_notes = arg == "--notes"
        if not (in_notes or arg.startswith("--notes=")):
            shown.append(arg)
    return shlex.join(["python", "-m", module, *shown])


def results_header(title: str, module: str, argv: Sequence[str], facts=(), notes=(), warning: str | None = None) -> str:
    """A results file's header: title, warning, the command, date, machine, checkout, load, `facts`, then `notes`."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    details = f" ({cpu_details()})" if cpu_details() else ""
    machine = (
        f"{cpu_model()}{details}, {len(usable_cores())} usable cores ({os.cpu_count()} online), {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
    )
    lines = [f"# {title}", "", *([f"**{warning}**", ""] if warning else [])]
    lines += [f"- command: `{command_line(module, argv)}` (from the repository root)", f"- date: {now}"]
    lines += [f"- machine: {machine}", f"- checkout: commit {code_version()}"]
    lines += [f"- load average (1, 5, 15 min) when written: {load_average()}", *(f"- {fact}" for fact in facts), ""]
    return "\n".join(lines + [line for note in notes for line in (note, "")])


def write_results(args: ResultsArgs, argv, title: str, facts: list[str], body: str, load="", warning=None) -> Path:
    """Write OUT.md, the results header then `body` (`load` and `warning` as check_load gives them); its path."""
    facts = [*facts, *([f"load average (1, 5, 15 min) before the measurement: {load}"] if load else [])]
    module = sys.modules[type(args).__module__].__spec__.name  # benchmark.X, also when run as __main__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = args.out.with_name(args.out.name + ".md")
    path.write_text(results_header(title, module, argv, facts, args.notes, warning) + body)
    print(f"wrote {path}")
    return path


def markdown_table(header_row: str, rows: Sequence[Sequence[object]]) -> str:
    """A markdown table under `header_row` (`a | b | c`), columns of numbers right-aligned."""

    filled = [[str(row[column]) for row in rows if str(row[column])] for column in range(header_row.count(" | ") + 1)]
    alignments = ["--:" if rows and all(re.match(r"[-+]?[\d.]", cell) for cell in cells) else ":--" for cells in filled]
    lines = [f"| {header_row} |", "|" + "|".join(alignments) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]) + "\n"


def table_rows(markdown: str, first_header: str) -> list[list[str]]:
    """The cells of each body row of the first markdown table whose first header is `first_header` (none: [])."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |")), len(lines))
    body = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :])
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in body]


def draw(args: ResultsArgs, plot: Callable[[Path], None], alt: str) -> tuple[Path, str]:
    """OUT.png drawn by `plot`: its path, and the markdown line that shows it in OUT.md."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png_path = args.out.with_name(args.out.name + ".png")
    plot(png_path)
    return png_path, f"\n![{alt}]({png_path.name})\n"


@contextlib.contextmanager
def figure(path: Path, rows: int = 1, cols: int = 1, size: tuple[float, float] = (8, 5)) -> Iterator[list]:
    """A matplotlib figure of rows x cols axes (no display needed) for the with-block, then saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    try:
        yield list(axes.flat)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
