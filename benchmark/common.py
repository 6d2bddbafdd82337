"""What the benchmark modules (and the tests) share: launching a script under torchrun, streaming its
output, reading TensorBoard event files, and the header every results file starts with."""

import datetime
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import torch

ROOT = Path(__file__).resolve().parent.parent
"""the repository root, where the scripts live"""
SCRIPTS = ("vpg_mpi.py", "ppo_continuous_mpi.py", "ppo_atari_multigpu.py")
"""the training scripts the benchmarks know"""
PROGRESS_LINE = re.compile(r"^(?:iteration|epoch) (\d+)/(\d+) step (\d+) SPS (\d+) return (\S+)")
"""the per-iteration line rank 0 of every script prints: (iteration, iterations, global step, SPS, return)"""


# --- launching ---------------------------------------------------------------------------------------


def torchrun_launcher(nprocs: int) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node=N`: what precedes the program to launch."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]


def mpirun_launcher(nprocs: int) -> list[str]:
    """Open MPI's `mpirun -np N` (as root too; no binding of its own: the caller pins), with a free MASTER_PORT for the
    scripts' store: what precedes the program to launch."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return ["mpirun", *root, "--bind-to", "none", "-np", str(nprocs), "-x", f"MASTER_PORT={port}", sys.executable]


def torchrun_command(script: str, nprocs: int, script_args: Sequence[str] = ()) -> list[str]:
    """The command that runs `script` (a file in the repo root) as `nprocs` ranks on this machine."""
    if script not in SCRIPTS:
        raise ValueError(f"unknown script {script!r}; expected one of {', '.join(SCRIPTS)}")
    return [*torchrun_launcher(nprocs), str(ROOT / script), *script_args]


def split_script_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split a command line at the first `--`: (the benchmark's own arguments, arguments passed to the script)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def open_log(command: Sequence[str], cwd: Path, log_path: Path) -> TextIO:
    """`log_path` opened for writing, its first line the command as a shell would run it in `cwd`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 (the caller closes it)
    log.write(f"$ (cd {shlex.quote(str(cwd))} && {shlex.join(command)})\n")
    log.flush()
    return log


def run_streaming(
    command: Sequence[str], cwd: Path, log_path: Path, on_line: Callable[[str], None] | None = None
) -> int:
    """Run `command` in `cwd`, copy its stdout and stderr to `log_path`, call `on_line` on each line; the exit code."""
    with open_log(command, cwd, log_path) as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))
        return process.wait()


def run_at_once(commands: Sequence[Sequence[str]], cwd: Path, log_paths: Sequence[Path]) -> list[int]:
    """Start every command in `cwd` at once, each one's stdout and stderr to its log; wait for all, their exit codes."""
    processes = []
    for command, log_path in zip(commands, log_paths, strict=True):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open_log(command, cwd, log_path) as log:  # the child keeps its own copy of the file
            processes.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return [process.wait() for process in processes]


def last_lines(path: Path, count: int = 15) -> str:
    """The last `count` lines of a log file (to show why a run failed)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-count:])


# --- reading TensorBoard -----------------------------------------------------------------------------


def _accumulator(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def read_scalar_events(run_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar series in a run folder's event files, as (wall_time, step, value) triples in logged order."""
    accumulator = _accumulator(run_dir)
    return {
        tag: [(event.wall_time, event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a run folder's TensorBoard event files, as (step, value) pairs."""
    return {tag: [(step, value) for _, step, value in events] for tag, events in read_scalar_events(run_dir).items()}


def read_hyperparameters(run_dir: Path) -> dict[str, str]:
    """The `hyperparameters` text table every script writes (its Args, as strings); empty if there is none."""
    accumulator = _accumulator(run_dir)
    if "hyperparameters/text_summary" not in accumulator.Tags()["tensors"]:
        return {}
    text = accumulator.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    rows = [line.strip().strip("|").split("|", 1) for line in text.splitlines()[2:]]
    return {row[0]: row[1] for row in rows if len(row) == 2}


def find_run_dirs(paths: Sequence[Path]) -> list[Path]:
    """Every folder under (or equal to) `paths` that holds TensorBoard event files, sorted."""
    found = set()
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        found.update(event.parent for event in path.rglob("events.out.tfevents.*"))
    return sorted(found)


# --- results files -----------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` shows them."""
    try:
        return ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def load_warning(max_load: float) -> str | None:
    """A loud warning for a timing results file when the 1-minute load average exceeds `max_load`, else None."""
    try:
        one_minute = os.getloadavg()[0]
    except OSError:
        return None
    if one_minute <= max_load:
        return None
    return (
        f"MEASURED UNDER LOAD: the 1-minute load average was {one_minute:.2f} when the measurement started (more "
        f"than {max_load}): other processes shared the CPU, so these timings are distorted. Re-run on a quiet machine."
    )


def check_load(max_load: float) -> tuple[str, str | None]:
    """Before a timing: the load averages now, and `load_warning(max_load)`, which is also printed to stderr."""
    load, warning = load_average(), load_warning(max_load)
    if warning:
        print(f"benchmark: warning: {warning}", file=sys.stderr)
    return load, warning


def machine_description() -> str:
    """One line: CPU model, usable cores, OS, Python and torch versions."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cpu_model()}, {cores} usable cores ({os.cpu_count()} online), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def code_version() -> str:
    """The git commit of the checkout the benchmark runs from, and which scripts differ from it, if any."""
    try:
        git = ["git", "-C", str(ROOT)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        changed = subprocess.run([*git, "status", "--porcelain", "--", *SCRIPTS], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    dirty = [line[3:] for line in changed.stdout.splitlines()]
    return commit.stdout.strip() + (f" with uncommitted changes to {', '.join(dirty)}" if dirty else "")


def command_line(module: str, argv: Sequence[str]) -> str:
    """The shell command that reproduces a `python -m benchmark.X` invocation, less the values of `--notes` (a results
    file shows those as prose under its header, not as one long line)."""
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


def results_header(
    title: str,
    module: str,
    argv: Sequence[str],
    facts: Sequence[str] = (),
    notes: Sequence[str] = (),
    warning: str | None = None,
) -> str:
    """The markdown header of a results file: title, a bold warning if any, then a list of the command that reproduces
    it (`python -m MODULE ARGV` without `--notes`), date, machine, checkout, load and the `facts` the module measured
    or fixed, then each of `notes` (what was run, by whom and why) as a paragraph of prose."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# {title}",
        "",
        *([f"**{warning}**", ""] if warning else []),
        f"- command: `{command_line(module, argv)}` (from the repository root)",
        f"- date: {now}",
        f"- machine: {machine_description()}",
        f"- checkout: commit {code_version()}",
        f"- load average (1, 5, 15 min) when written: {load_average()}",
        *(f"- {fact}" for fact in facts),
        "",
    ]
    for note in notes:
        lines += [note, ""]
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; columns whose cells all start with a number are right-aligned, the others left-aligned."""

    def numeric(column: int) -> bool:
        return all(re.match(r"^[-+]?[\d.]", str(row[column])) for row in rows if str(row[column]))

    alignments = ["--:" if rows and numeric(column) else ":--" for column in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(alignments) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def output_paths(stem: Path) -> tuple[Path, Path]:
    """STEM.md and STEM.png, with the parent folder created."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    return stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".png")
