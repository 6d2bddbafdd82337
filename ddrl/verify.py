"""Check that a ddrl script, or a copy of one, trains at two ranks as one process would on the union
of their batches, over its whole run, in one command:

    python -m ddrl.verify my_copy.py

It reads the file (no `Args`, `main` and `update`: no ddrl script, refused in one line, exit code
2), imports it in a process of its own, bounded in time, then runs the copy's own `main`, small, for
three iterations: at two ranks with `--sync allreduce`; then at one rank stepping both ranks' envs
and, where the script has it, at two ranks with `--sync gather`, each drawing what the allreduce
ranks drew from torch.distributions (so that their envs see the same) and taking their minibatches.
After each iteration every rank records the training state its main holds (ddrl.training_state:
every module's parameters and buffers, every optimizer's state and options, the numbers main
carries); verify compares each rank's with the one-rank run's, and the one-rank run's batch with the
union of the ranks'. Float64 (float32, said, where the copy cannot), a temporary folder, every
process verify started or its copy forked ended. Exit 0 when they agree; else exit 1, in one line
naming the mode, the iteration, the rank and the first thing that differs."""

import ast
import contextlib
import ctypes
import importlib
import json
import math
import multiprocessing
import os
import re
import signal
import socket
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from ddrl.failures import first_line, say
from ddrl.verify_rank import ITERATIONS, Rank, file_of, load, read_record

USAGE = "usage: python -m ddrl.verify [--import-timeout SECONDS] SCRIPT.py"
# the largest relative difference allowed: float64 leaves about 1e-14, a broken sync about 1e-3
TOLERANCES = {"float64": 1e-9, "float32": 1e-5}
BATCH_TOLERANCE = 1e-5  # the batch is stored in float32: values a rounding apart near its boundary
IMPORT_SECONDS = 60.0  # the import's bound, unless --import-timeout says otherwise
PHASE_SECONDS = 300  # a phase's bound
GRACE_SECONDS = 10  # once a rank has failed, how long its peers have to end on their own
SMALL = {  # flags every run takes, where the script has them
    "torch_threads": 1,
    "cuda": False,
    "compile": False,
    "check_sync_every": 1,  # where each rank records its state (verify_rank.Rank.record)
    "checkpoint_every": 0,
    "capture_video": False,
    "save_model": False,
    "track": False,
    "nprocs": 1,
    "preempt_fraction": 0.0,
    "env_threads": 1,
    "env_groups": 1,  # one acting call a step, as the one-rank run makes
    "numpy_rollout": False,  # actions drawn through torch.distributions, which verify replays
    "num_minibatches": 2,  # no more than an env per rank: a recurrent copy's minibatch holds envs
    "update_epochs": 2,
    "num_steps": 16,  # an iteration's steps per env (the PPO scripts)
    "steps_per_epoch": 64,  # an iteration's steps over all ranks and envs (VPG)
    "train_v_iters": 5,
}
ONE_MODEL = (
    "one launch trains one model, its gradients averaged over the ranks, and every rank sets "
    "itself up as one process would; to sweep a number, start one launch per value"
)
SEE = "see docs/changing-a-script.md"
PR_SET_CHILD_SUBREAPER = 36  # prctl: orphans of verify's descendants become verify's children


def command_line(argv: list[str]) -> int:
    """`python -m ddrl.verify`: 0 when the copy passes, 1 when it does not, 2 when it cannot run."""
    if argv in (["-h"], ["--help"]):
        print(f"{USAGE}\n{__doc__}")
        return 0
    parsed = options(argv)
    if isinstance(parsed, str):
        return refuse(parsed)
    script, import_seconds = parsed
    start = time.time()
    if problem := no_script(script):
        return refuse(problem)
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        with tempfile.TemporaryDirectory(prefix="ddrl-verify-") as folder:
            return verified(script.resolve(), Path(folder), import_seconds, start)
    finally:
        end_descendants()


def verified(script: Path, folder: Path, import_seconds: float, start: float) -> int:
    """The probe, the runs in float64 (float32 where they cannot), the judgement in one line."""
    setup = probe(script, folder, import_seconds)
    if isinstance(setup, str):
        return refuse(setup)
    for library in ["torch._dynamo", *setup["libraries"]]:  # imported once, for every rank forked
        with contextlib.suppress(Exception):
            importlib.import_module(library)
    fallback = ""
    for precision in TOLERANCES:
        work = folder / precision
        work.mkdir()
        problem, raised = run_phases(script, work, setup, precision)
        # float32 tensors of the copy's own met float64 ones: float32 then
        if precision == "float32" or not re.search(r"dtype|Double|Float|scalar type", raised):
            break
        fallback = raised
    tolerance = TOLERANCES[precision]
    message, worst = judged(work, setup["modes"], tolerance, precision)
    if problem or message:
        say(f"verify: {message or problem}")
        return 1
    how = f"in {precision}" + (f", as it does not run in float64 ({fallback})" if fallback else "")
    print(
        f"verify: ok: {script.name} at two ranks ({', '.join(setup['modes'])}) trains as one rank "
        f"on the union of their batches for {ITERATIONS} iterations: every module's parameters "
        f"and buffers, every optimizer's state and options and the numbers main carries within "
        f"{tolerance:g} {how} (largest difference {worst:.2g}), in {time.time() - start:.0f} s"
    )
    return 0


def options(argv: list[str]) -> tuple[Path, float] | str:
    """The script and the import's bound in seconds, or what is wrong with the command line."""
    import_seconds = IMPORT_SECONDS
    words = list(argv)
    if words and words[0].startswith("--import-timeout"):
        flag = words.pop(0)
        value = flag.partition("=")[2] if "=" in flag else (words.pop(0) if words else "")
        try:
            import_seconds = float(value)
        except ValueError:
            import_seconds = math.nan
        if not 0 < import_seconds <= 86400:
            return f"--import-timeout takes seconds above 0 (at most a day), got {value!r}; {USAGE}"
    if len(words) != 1 or words[0].startswith("-"):
        return USAGE
    return Path(words[0]), import_seconds


def refuse(problem: str) -> int:
    """Say why verify cannot run the script, in one line; exit code 2."""
    say(f"verify: error: {problem}")
    return 2


def no_script(script: Path) -> str:
    """Why `script` is no ddrl script, read and not run ('' if it may be one)."""
    if not script.is_file():
        return f"{script} is no file: verify runs a ddrl script (a .py file), or a copy of one"
    if script.suffix != ".py":
        return (
            f"{script.name} is no Python script (a .py file): verify runs a ddrl script, or a copy"
        )
    try:
        tree = ast.parse(script.read_bytes())
    except (SyntaxError, ValueError) as error:
        return f"{script.name} does not compile: {type(error).__name__}: {first_line(error)}"
    defined = {node.name for node in tree.body if hasattr(node, "name")}
    if missing := [name for name in ("Args", "main", "update") if name not in defined]:
        return (
            f"{script.name} defines no {', '.join(missing)}: verify runs a ddrl script's main, "
            "which calls its update (a copy of ppo_continuous_mpi.py, vpg_mpi.py or "
            'ppo_atari_multigpu.py); a file that trains under `if __name__ == "__main__"` '
            "cannot be run an iteration at a time"
        )
    return ""


def end_descendants() -> None:
    """SIGKILL every process verify started or they forked (verify is their subreaper)."""
    while children := [pid for task in Path("/proc/self/task").glob("*/children")
                       for pid in map(int, task.read_text().split())]:  # fmt: skip
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


# --- the import, in a process of its own ----------------------------------------------------------
def probe(script: Path, folder: Path, seconds: float) -> dict | str:
    """The script's small flags and `--sync` modes, from an import in a process of its own bounded
    by `seconds`; or why verify cannot run it."""
    process = multiprocessing.get_context("fork").Process(target=probed, args=(script, folder))
    process.start()
    deadline = time.monotonic() + seconds
    # not join(seconds): a child the copy forks holds join's pipe open after the import has ended
    while process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.is_alive():
        process.kill()
        return (
            f"{script.name} did not finish importing within {seconds:g} s (a loop or a wait at "
            'import?): a ddrl script does its work in main, under `if __name__ == "__main__"`'
        )
    end = file_of(folder, "probe", 0, "end")
    if not end.exists():
        return f"importing {script.name} ended its process: it {ended(process.exitcode)}"
    found = json.loads(end.read_text())
    return found.get("problem") or found


def probed(script: Path, folder: Path) -> None:
    """The import's process: what verify needs of the script, written to its end file."""
    os.chdir(folder)
    log = os.open(file_of(folder, "probe", 0, "log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        found = looked_at(load(script), script.name)
    except SystemExit as error:
        found = {
            "problem": f"{script.name} exits when imported (sys.exit({error.code!r})): a ddrl "
            'script does its work in main, under `if __name__ == "__main__"`'
        }
    except BaseException as error:
        found = {"problem": import_problem(script.name, error)}
    file_of(folder, "probe", 0, "end").write_text(json.dumps(found))
    os._exit(0)


def looked_at(module, name: str) -> dict:
    """The imported script's small flags and `--sync` modes, or the problem no ddrl script has."""
    try:
        args = module.Args()
    except Exception as error:
        return {
            "problem": f"{name}'s Args() cannot be made from its defaults: "
            f"{type(error).__name__}: {first_line(error)}"
        }
    fields = set(vars(args))
    if "local_num_envs" not in fields:
        return {
            "problem": f"{name}'s Args has no local_num_envs: verify's one-rank run steps the "
            "envs of both ranks of its two-rank runs"
        }
    envs = min(args.local_num_envs, 2)
    flags = {key: value for key, value in SMALL.items() if key in fields} | {"local_num_envs": envs}
    if "steps_per_epoch" in fields:  # a global batch, split over the ranks
        flags["total_timesteps"] = ITERATIONS * flags["steps_per_epoch"]
    else:
        flags["total_timesteps"] = ITERATIONS * 2 * envs * flags["num_steps"]
    modes = ["allreduce", "gather"] if "sync" in fields else ["allreduce"]
    installed = sysconfig.get_paths()["purelib"]
    files = {name: str(getattr(module, "__file__", "")) for name, module in sys.modules.items()}
    libraries = sorted({name.split(".")[0] for name, file in files.items() if installed in file})
    return {"flags": flags, "modes": modes, "libraries": libraries}


def import_problem(name: str, error: BaseException) -> str:
    """What stopped the import of the script `name`, in a phrase."""
    if isinstance(error, ModuleNotFoundError):
        return (
            f"importing {name} needs the module {error.name!r}, which is not installed "
            f"(ModuleNotFoundError: {first_line(error)})"
        )
    return f"importing {name} raised {type(error).__name__}: {first_line(error)}"


# --- the runs -------------------------------------------------------------------------------------
def run_phases(script: Path, work: Path, setup: dict, precision: str) -> tuple[str, str]:
    """The allreduce run, then the one-rank and gather runs replaying its draws: which run stopped
    and why (''), and the first line of an exception a rank raised ('')."""
    flags = setup["flags"]
    wide = flags | {"local_num_envs": 2 * flags["local_num_envs"]}
    phases = [[("allreduce", 2, flags)], [("reference", 1, wide)]]
    phases[1] += [("gather", 2, flags | {"sync": "gather"})] if "gather" in setup["modes"] else []
    for phase in phases:
        started = [(role, start_ranks(script, work, role, ranks, precision, flags)) for role, ranks,
                   flags in phase]  # fmt: skip
        if problem := "".join(stopped(processes, work, role) for role, processes in started):
            ends = [json.loads(path.read_text()) for path in sorted(work.glob("*.end"))]
            return problem, next((end["raised"] for end in ends if "raised" in end), "")
    return "", ""


def start_ranks(script: Path, work: Path, role: str, ranks: int, precision: str, flags: dict):
    """The ranks of one run, forked from this process with a launcher's variables."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = []
    for rank in range(ranks):
        launcher = {"RANK": rank, "WORLD_SIZE": ranks, "LOCAL_RANK": rank}
        launcher |= {"LOCAL_WORLD_SIZE": ranks, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        run = (Rank(role, rank, work, precision), script, flags, launcher)
        process = multiprocessing.get_context("fork").Process(target=forked, args=run)
        process.start()
        processes.append(process)
    return processes


def forked(rank: "Rank", script: Path, flags: dict, launcher: dict) -> None:
    """A rank's process: the launcher's variables in place of any inherited, its output to a log."""
    launched = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "PMIX_", "SLURM_")
    for key in [key for key in os.environ if key.startswith((*launched, "TORCHELASTIC"))]:
        del os.environ[key]
    os.environ.update({key: str(value) for key, value in launcher.items()})
    os.chdir(rank.work)
    log = os.open(rank.file("log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os._exit(rank.run(script, flags))


def stopped(processes: list, work: Path, role: str) -> str:
    """Wait for a run's ranks (a failed one's peers GRACE_SECONDS at most); '' if each recorded its
    last iteration, else why the run stopped, in a phrase."""
    deadline = time.monotonic() + PHASE_SECONDS
    failed_at = math.inf
    killed = set()  # by verify: past the deadline, or a peer having failed
    while any(process.is_alive() for process in processes):
        if any(process.exitcode not in (None, 0) for process in processes):
            failed_at = min(failed_at, time.monotonic())
        if time.monotonic() > min(deadline, failed_at + GRACE_SECONDS):
            killed = {rank for rank, process in enumerate(processes) if process.is_alive()}
            for process in processes:
                process.kill()
                process.join()
        time.sleep(0.05)
    name = "the one-rank run" if role == "reference" else f"the two-rank run ({role})"
    if all(file_of(work, role, rank, ITERATIONS).exists() for rank in range(len(processes))):
        return ""
    if failed_at == math.inf and killed:
        return f"{name} did not end {ITERATIONS} iterations within {PHASE_SECONDS} s"
    causes = []
    for rank, process in enumerate(processes):
        who = f"rank {rank}" if len(processes) > 1 else "it"
        end = file_of(work, role, rank, "end")
        end = json.loads(end.read_text()) if end.exists() else {}
        log = file_of(work, role, rank, "log").read_text(errors="replace").splitlines()
        errors = [line for line in log if ": error: " in line]
        if rank in killed:
            continue
        if "said" in end:
            causes.append((0, end["said"]))
        elif process.exitcode < 0:
            causes.append((1, f"{who} {ended(process.exitcode)}"))
        elif "raised" in end:
            causes.append((2, f"{who} raised {end['raised']}"))
        elif errors:  # not what a peer's end caused, where another error says more
            causes.append((3 + ("lost contact with another rank" in errors[0]), errors[0]))
        elif "returned" in end:
            causes.append((5, f"{who}: main returned without calling run.check_in_sync, where "
                              "verify records the state after each iteration"))  # fmt: skip
    reached = [i for i in range(1, ITERATIONS) if file_of(work, role, 0, i).exists()]
    cause = min(causes)[1] if causes else "a rank was stopped"
    return f"{name} stopped before iteration {len(reached) + 1} ended: {cause}"


def ended(exitcode: int) -> str:
    """How a process ended, in words: `was killed by SIGKILL`, `exited with code 3`."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


# --- the comparison -------------------------------------------------------------------------------
def judged(work: Path, modes: list[str], tolerance: float, precision: str) -> tuple[str, float]:
    """What first differs between a two-rank run and the one-rank run (''), and the largest gap."""
    worst = 0.0
    for iteration in range(1, ITERATIONS + 1):
        reference = read_record(work, "reference", 0, iteration)
        for mode in modes:
            ranks = [read_record(work, mode, rank, iteration) for rank in (0, 1)]
            if reference is None or None in ranks:
                return "", worst
            problem, gap = compared(reference, ranks, tolerance, mode, precision)
            worst = max(worst, gap)
            if problem:
                where = f"at two ranks ({mode}), iteration {iteration}"
                return f"{where}: {problem}; {SEE}", worst
    return "", worst


def compared(
    reference: dict, ranks: list[dict], tolerance: float, mode: str, precision: str
) -> tuple[str, float]:
    """What first differs (''), and the largest tensor gap: the ranks' args, then against the
    one-rank run's the numbers, statistics, the batch, the parameters and the optimizers' state."""
    numbers = [rank["meta"]["numbers"] for rank in ranks]
    for name in numbers[0]:
        if name.startswith("args.") and not alike(numbers[1].get(name), numbers[0][name], 0):
            return (
                f"rank 1's {name} is {shown_value(numbers[1].get(name))}, where rank 0's is "
                f"{shown_value(numbers[0][name])}: {ONE_MODEL}"
            ), 0.0
    ours = reference["meta"]["numbers"]
    for rank, theirs in enumerate(numbers):
        for name in [*ours, *(name for name in theirs if name not in ours)]:
            if name.startswith("args.") or alike(theirs.get(name), ours.get(name), tolerance):
                continue
            cause = ONE_MODEL if "'s " in name else "computed from that rank's data alone"
            return (
                f"rank {rank}'s {name} is {shown_value(theirs.get(name))}, where the one-rank "
                f"run's is {shown_value(ours.get(name))}: {cause}"
            ), 0.0
    count = len(reference["meta"]["names"])
    gaps = []  # each rank's: key -> gap
    for rank, record in enumerate(ranks):
        if len(record["meta"]["names"]) != count:
            return (
                f"rank {rank} holds {len(record['meta']['names'])} parameters and buffers, where "
                f"the one-rank run holds {count}: every rank makes the same modules"
            ), 0.0
        stepped = record["meta"]["stepped"]
        held = [key for key in reference if key.startswith("optimizer.")]
        keys = [f"state.{i}" for i in range(count)]
        keys += [key for key in held if stepped[int(key.split(".")[1])]]
        gaps.append({key: gap(record.get(key), reference[key]) for key in keys})
    worst = max(value for found in gaps for value in [0.0, *found.values()] if value < math.inf)
    moved = {f"state.{key.split('.')[1]}" for key in reference if key.startswith("gradient.")}
    for statistics in (True, False):
        for rank, found in enumerate(gaps):
            bad = [key for key, value in found.items() if value > tolerance]
            bad = [
                key for key in bad if (key.startswith("state.") and key not in moved) is statistics
            ]
            bad.sort(key=lambda key: (key[0] != "s", -found[key]))  # parameters, then their state
            if bad:
                said = ", ".join(thing_named(key, ranks[rank], reference) for key in bad[:3])
                more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
                return (
                    f"rank {rank}'s {said}{more} {'differs' if len(bad) == 1 else 'differ'} from "
                    f"the one-rank run's on the union by up to {max(found[k] for k in bad):.3g} "
                    f"(tolerance {tolerance:g} in {precision}): {cause_of(bad, ranks, mode)}"
                ), worst
        for key, (value, rank) in reference["meta"]["batch"].items() if mode == "allreduce" else []:
            if statistics and value > BATCH_TOLERANCE:
                return (
                    f"rank {rank}'s batch holds {key} up to {value:.3g} (relative) away from the "
                    f"one-rank run's for the same observations and actions (tolerance "
                    f"{BATCH_TOLERANCE:g}): computed from that rank's data alone, not the world's"
                ), worst
    return "", worst


def cause_of(keys: list[str], ranks: list[dict], mode: str) -> str:
    """Why tensors differ, as far as the records tell."""
    gradients = [f"gradient.{key.split('.')[1]}" for key in keys if key.startswith("state.")]
    held = [key for key in gradients if key in ranks[0]]
    if mode == "allreduce" and any(gap(ranks[1].get(key), ranks[0][key]) > 0 for key in held):
        return (
            "their gradients differed between the ranks, so they were not averaged: every "
            "parameter an optimizer steps must be in the gradients' allreduce (under DDP, run "
            "through the model DDP wraps)"
        )
    if gradients and not held:
        return (
            "no gradient moves them: statistics or a number kept in a buffer, computed from each "
            "rank's data alone; take the world's (collectives.moments_over_ranks, allreduce_mean)"
        )
    return "the update no longer equals one process's on the whole batch"


def gap(ours: torch.Tensor | None, theirs: torch.Tensor | None) -> float:
    """The largest difference of two tensors relative to the second's scale (at least 1), or inf."""
    if ours is None or theirs is None or ours.shape != theirs.shape:
        return math.inf
    if not theirs.is_floating_point() or not theirs.numel():
        return 0.0 if torch.equal(ours, theirs) else math.inf
    scale = theirs.double().abs().max().clamp(min=1)
    found = ((ours.double() - theirs.double()).abs().max() / scale).item()
    return found if found == found else math.inf


def thing_named(key: str, record: dict, reference: dict) -> str:
    """A record's key as a message names it: a tensor's name, or an optimizer's state of one."""
    kind, index, *rest = key.split(".")
    if kind == "state":
        return record["meta"]["names"][int(index)]
    parameter = reference["meta"]["held"][int(index)][int(rest[0])]
    return f"{reference['meta']['optimizers'][int(index)]}'s {rest[1]} of {parameter}"


def alike(mine: float | None, other: float | None, tolerance: float) -> bool:
    """Two numbers (or missing ones) equal within `tolerance` of their scale (at least 1)."""
    if mine is None or other is None or mine != mine:
        return mine is other or (mine != mine and other != other)
    return abs(mine - other) <= tolerance * max(1.0, abs(other))


def shown_value(value: float | None) -> str:
    return "nothing" if value is None else f"{value:.4g}"


if __name__ == "__main__":
    raise SystemExit(command_line(sys.argv[1:]))
