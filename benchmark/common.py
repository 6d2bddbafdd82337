"""What the benchmark modules share: arguments, the scripts and their defaults, launching them and following their
output, reading their TensorBoard event files, and writing a results file."""

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
import types
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from subprocess import PIPE, STDOUT
from typing import Annotated, Literal, TypeVar, get_args

import pydantic
import torch
import tyro
from annotated_types import Ge

from ddrl import env_support, flags

ROOT = Path(__file__).resolve().parent.parent
"""the repository root, where the scripts live"""
Script = Literal["vpg_mpi.py", "ppo_continuous_mpi.py", "ppo_atari_multigpu.py"]
SCRIPTS: tuple[str, ...] = get_args(Script)
"""the training scripts the benchmarks know"""
ATARI = "ppo_atari_multigpu.py"
ArgsT = TypeVar("ArgsT")
PINNED = (
    "`taskset -c C0,..,C(N-1) env PYTHONPATH=benchmark/pin_rank DDRL_PIN_CORES=C0,..,C(N-1) python SCRIPT --nprocs N "
    "--collectives shm` (torchrun, CPU collectives through shared memory; `mpi` under mpirun), "
    "benchmark/pin_rank/sitecustomize.py pinning local rank r to core Cr"
)
"""how script_command launches N pinned ranks, as a results file says it"""
PROGRESS_LINE = re.compile(r"^(?:iteration|epoch) (\d+)/(\d+) step (\d+) SPS (\d+) return (\S+)")
"""the per-iteration line rank 0 of every script prints: (iteration, iterations, global step, SPS, return)"""


def usable_cores() -> list[int]:
    """The cores this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


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
    iterations: Annotated[int, Ge(2)] = 6
    """iterations (epochs) per run; at least 2 (the first is left out of SPS and the time split)"""
    local_steps: Annotated[int, Ge(0)] = 0
    """env steps per rank per iteration; 0 = the script's own default batch"""
    out_dir: Path | None = None
    """where the runs are launched (runs/ and logs/ land there, and are kept); default: a temporary folder"""


def cli(args_class: type[ArgsT], argv: Sequence[str] | None, script_args: bool = False) -> tuple[ArgsT, list, list]:
    """A module's Args (its docstring the help; each flag's rule beside it, as the scripts write theirs, checked
    here), the command line, and the arguments after `--` (for the script)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    module = sys.modules[args_class.__module__]
    name = module.__spec__.name
    if cut < len(argv) and not script_args:
        raise SystemExit(f"{name}: error: this module runs no script, so it takes no arguments after --")
    args = tyro.cli(args_class, args=argv[:cut], description=module.__doc__)
    try:
        flags.rules(args_class).validate_python(asdict(args))
    except pydantic.ValidationError as error:
        raise SystemExit(f"{name}: error: {flags.violation(error.errors()[0])}") from None
    return args, argv, argv[cut + 1 :]


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
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # by name, as the rollout's tracer finds it
    spec.loader.exec_module(module)
    return module


def defaults(script: str):
    """The script's default hyperparameters: its `Args()`."""
    return load_script(script).Args()


def env_spaces(script: str) -> tuple:
    """(observation space, action space) of the script's default env, with the script's warning filters."""
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env_support.silence_settotalmass_warning()
    with contextlib.closing(gym.make(defaults(script).env_id)) as env:
        return env.observation_space, env.action_space


def agent_of(script: str, root: Path = ROOT) -> torch.nn.Module:
    """The script's Agent (of checkout `root`) for its default env at its default sizes, built as its main builds it
    from a vector env's spaces (here the env's own), VPG's with its hidden sizes."""
    spaces = dict(zip(("single_observation_space", "single_action_space"), env_spaces(script), strict=True))
    module = load_script(script, root)
    return module.Agent(types.SimpleNamespace(**spaces), *([module.Args().hidden_sizes] if "vpg" in script else []))


def budget_args(script: str, ranks: int, local_steps: int, iterations: int, envs: int = 0) -> list[str]:
    """`script`'s arguments for `local_steps` env steps per rank (0: its default batch) in `envs` envs per rank (0: its
    default) for `iterations` iterations."""
    args = defaults(script)
    envs = envs or args.local_num_envs
    if not local_steps:
        local_steps = args.steps_per_epoch if script == "vpg_mpi.py" else envs * args.num_steps
    if local_steps % envs:
        raise SystemExit(f"benchmark: error: --local-steps {local_steps} is no multiple of {envs} envs per rank")
    total = ["--total-timesteps", str(iterations * ranks * local_steps), "--local-num-envs", str(envs)]
    if script == "vpg_mpi.py":  # SpinningUp's global steps per epoch
        return ["--steps-per-epoch", str(ranks * local_steps), *total]
    return ["--num-steps", str(local_steps // envs), *total]


def script_command(
    script: Path, args: Sequence[str], ranks: int = 1, launcher: str = "", cores: Sequence[int] = ()
) -> list[str]:
    """`python SCRIPT ARGS` as `ranks` ranks by the script's own `--nprocs`, with `cores` pinned as PINNED says."""
    command = [sys.executable, str(script)]
    if ranks > 1:
        collectives = {"torchrun": ["--collectives", "shm"], "mpirun": ["--collectives", "mpi"], "": []}[launcher]
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


def follow(
    command: Sequence[str], cwd: Path, log_path: Path, on_line: Callable[[subprocess.Popen, float, str], None]
) -> tuple[int, float]:
    """Run `command` in `cwd` to its end, its output written to `log_path` (headed by the command) and each line handed
    to `on_line(process, seconds since the start, line)` as it comes; returns its exit code and its seconds."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ (cd {shlex.quote(str(cwd))} && {shlex.join(command)})\n")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=PIPE, stderr=STDOUT, text=True, bufsize=1)
        for line in process.stdout:
            log.write(line)
            on_line(process, time.perf_counter() - began, line.rstrip("\n"))
        code = process.wait()
    return code, time.perf_counter() - began


def last_lines(path: Path, count: int = 15) -> str:
    """The last `count` lines of a log file (to show why a run failed)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-count:])


def failed(name: str, code: int, log: Path) -> SystemExit:
    """The error that ends a benchmark whose run NAME exited with `code`: the end of its log."""
    return SystemExit(f"benchmark: error: run {name} failed (exit {code}); {log}:\n{last_lines(log)}")


def run_logged(commands: dict[str, list[str]], work_dir: Path, at_once: bool = False) -> list[Path]:
    """Run each command NAME in `work_dir` (output to logs/NAME.log), in turn or at once; their folders runs/NAME."""
    for name in commands:
        shutil.rmtree(work_dir / "runs" / name, ignore_errors=True)

    def run(name: str) -> int:
        return follow(commands[name], work_dir, work_dir / "logs" / f"{name}.log", lambda *_: None)[0]

    with ThreadPoolExecutor(len(commands) if at_once else 1) as pool:
        codes = dict(zip(commands, pool.map(run, commands), strict=True))
    if bad := [name for name, code in codes.items() if code]:
        raise failed(bad[0], codes[bad[0]], work_dir / "logs" / f"{bad[0]}.log")
    return [work_dir / "runs" / name for name in commands]


def _accumulator(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def read_scalar_events(run_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar series in a run folder's event files, as (wall_time, step, value) triples in logged order."""
    found = _accumulator(run_dir)
    return {tag: [(e.wall_time, e.step, e.value) for e in found.Scalars(tag)] for tag in found.Tags()["scalars"]}


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
    first_wall, first_step, _ = sps_events[0]
    last_wall, last_step, script_sps = sps_events[-1]
    sps = (last_step - first_step) / max(last_wall - first_wall, 1e-9)
    batch = (last_step - first_step) // (len(sps_events) - 1)
    parts = [scalars.get(f"perf/{part}_time", [])[1:] for part in ("rollout", "update", "sync")]  # as the scripts time
    seconds = [statistics.median(event[2] for event in events) if events else math.nan for events in parts]
    return Measurement(script, mode, ranks, batch, len(sps_events), sps, script_sps, *seconds)


def rate(call: Callable[[], object], seconds: float, warmup: int = 3) -> float:
    """Median seconds per `call()` over about `seconds` of calls (at least 5), after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_model() -> str:
    """The CPU as lscpu names it, with what tells apart CPUs of one name: family, model, the vector extensions torch
    uses, and the hypervisor it runs under."""
    output = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in output.splitlines())}
    fields = {"Model name": "unknown CPU", "CPU family": "?", "Model": "?", "Flags": "", **fields}
    extensions = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in fields["Flags"].split()]
    details = f"family {fields['CPU family']} model {fields['Model']}, {' '.join(extensions or ['no AVX2'])}"
    guest = f", a {fields['Hypervisor vendor']} guest" if "Hypervisor vendor" in fields else ""
    return f"{fields['Model name']} ({details}{guest}; lscpu)"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` shows them."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def cpu_clock() -> tuple[float, float, float]:
    """(wall seconds, busy CPU seconds of the machine, CPU seconds of this process and its waited-for children)."""
    # /proc/stat's first line: cpu user nice system idle iowait irq softirq ...
    ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return time.perf_counter(), busy, sum(use.ru_utime + use.ru_stime for use in usage)


def other_cores(since: tuple[float, float, float]) -> float:
    """The cores that other processes kept busy, on average, since `since` (a cpu_clock())."""
    wall, busy, own = cpu_clock()
    start_wall, start_busy, start_own = since
    others = max((busy - start_busy) - (own - start_own), 0.0)  # the clock ticks' jitter stays >= 0
    return others / max(wall - start_wall, 1e-9)


def check_load(max_load: float) -> tuple[str, str | None]:
    """Before a timing: the load averages now, and a warning (printed too) if the 1-minute one exceeds `max_load`."""
    load = load_average()
    if float(load.split(",")[0]) <= max_load:
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
    cut = argv.index("--") if "--" in argv else len(argv)  # the rest goes to the script
    starts = [index for index, arg in enumerate(argv[:cut]) if arg.startswith("--")] + [cut]
    notes = {i for start, end in itertools.pairwise(starts) if argv[start] == "--notes" for i in range(start, end)}
    shown = [arg for i, arg in enumerate(argv[:cut]) if i not in notes and not arg.startswith("--notes=")]
    return shlex.join(["python", "-m", module, *shown, *argv[cut:]])


def results_header(title: str, module: str, argv: Sequence[str], facts=(), notes=(), warning: str | None = None) -> str:
    """A results file's header: title, warning, the command, date, machine, checkout, load, `facts`, then `notes`."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (
        f"{cpu_model()}, {len(usable_cores())} usable cores ({os.cpu_count()} online), {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
    )
    lines = [f"# {title}", "", *([f"**{warning}**", ""] if warning else [])]
    lines += [f"- command: `{command_line(module, argv)}` (from the repository root)", f"- date: {now}"]
    lines += [f"- machine: {machine}", f"- checkout: commit {code_version()}"]
    lines += [f"- load average (1, 5, 15 min) when written: {load_average()}", *(f"- {fact}" for fact in facts), ""]
    return "\n".join(lines + [line for note in notes for line in (note, "")])


def write_results(args: ResultsArgs, argv, title: str, facts: list[str], body: str, load=("", None), *warnings) -> Path:
    """Write OUT.md, the results header then `body`; `load` as check_load gives it, its warning and `warnings` (None
    or a line each) at the top; its path."""
    facts = [*facts, *([f"load average (1, 5, 15 min) before the measurement: {load[0]}"] if load[0] else [])]
    module = sys.modules[type(args).__module__].__spec__.name  # benchmark.X, also when run as __main__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = args.out.with_name(args.out.name + ".md")
    warning = " ".join(filter(None, [load[1], *warnings])) or None
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
    start_line = next((i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |")), len(lines))
    body = itertools.takewhile(lambda line: line.startswith("|"), lines[start_line + 2 :])
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in body]


def draw(args: ResultsArgs, plot: Callable[[list], None], alt: str, grid=(1, 1), size=(8.0, 5.0)) -> tuple[Path, str]:
    """OUT.png of a matplotlib figure of `grid` (rows, columns) axes that `plot(axes)` draws (no display needed): its
    path, and the markdown line that shows it in OUT.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.parent.mkdir(parents=True, exist_ok=True)
    png_path = args.out.with_name(args.out.name + ".png")
    fig, axes = plt.subplots(*grid, figsize=size, squeeze=False)
    try:
        plot(list(axes.flat))
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
    finally:
        plt.close(fig)
    return png_path, f"\n![{alt}]({png_path.name})\n"
