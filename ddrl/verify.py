"""Check that a ddrl script, or a copy of one, still updates as one process would, in one command:

    python -m ddrl.verify my_copy.py

It imports the script in a process of its own, bounded in time, so that a file that is no script
(not a .py file, a syntax error, a missing module, an exit or a loop at import, no `main` or
`update`) is refused in one line, exit code 2. Then it runs the script's own `main`, small, three
ways, and stops each run at its first update: at one rank, where the update takes the whole batch;
then at two ranks with `--sync allreduce` and, where the script has it, `--sync gather`, where rank
0 and rank 1 take two unequal shares of that same batch (equal shares where the script splits its
batch evenly, as VPG does) and the one-rank run's minibatches. Each rank keeps what it set itself up
with: its weights, its optimizer and options, the numbers in its args. Verify hands it only the
data: the batch, its minibatches and the data's statistics (the Agent's buffers). The update runs in
float64 (float32 where the update cannot), so rounding stays far below any difference an edit makes.
Exit 0 when every rank starts as the one-rank run does and ends with its weights; else exit 1, in
one line naming the mode and what differs. The runs go in a temporary folder; nothing is written
beside the script."""

import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import multiprocessing
import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel

from ddrl import one_learner
from ddrl.failures import first_line, say, shown

USAGE = "usage: python -m ddrl.verify [--import-timeout SECONDS] SCRIPT.py"
# the largest weight difference allowed, by the precision the update ran in: in float64 the scripts
# and the edits tests/test_one_place.py makes end about 1e-16 apart, in float32 up to 6.5e-6 (a VPG
# head); a broken sync moves weights by about 1e-3
TOLERANCES = {"float64": 1e-9, "float32": 1e-5}
IMPORT_SECONDS = 60.0  # the import's bound, unless --import-timeout says otherwise
WORKER_SECONDS = 300  # a run's bound, from its start to its first update's end
GRACE_SECONDS = 10  # once a rank has failed, how long its peer has to end on its own
# env steps per rank and iteration in every run: small, and enough for four minibatches
SAMPLES = 64
SHARE = 5 / 8  # rank 0's share of the batch, where the script takes unequal shares
SMALL = {  # flags every run takes, where the script has them
    "torch_threads": 1,
    "cuda": False,
    "compile": False,
    "check_sync_every": 0,
    "checkpoint_every": 0,
    "capture_video": False,
    "save_model": False,
    "track": False,
    "nprocs": 1,
    "preempt_fraction": 0.0,
    "env_threads": 1,
    "num_minibatches": 4,
    "update_epochs": 2,
    "steps_per_epoch": SAMPLES,
    "train_v_iters": 5,
}
ONE_MODEL = (
    "one launch trains one model, its gradients averaged over the ranks, and every rank sets "
    "itself up as one process would; to sweep a number, start one launch per value"
)
SEE = "see docs/changing-a-script.md"
MISSING = "nothing"  # a record's value where it has no such key


class Stop(BaseException):
    """Ends a run's main once its first update is done (a BaseException: main's own handlers let it
    through)."""


def command_line(argv: list[str]) -> int:
    """`python -m ddrl.verify`: 0 when the script's update passes, 1 when it does not (one line
    saying what differs), 2 when verify cannot run it (one line saying why)."""
    if argv in (["-h"], ["--help"]):
        print(USAGE)
        print(__doc__)
        return 0
    parsed = options(argv)
    if isinstance(parsed, str):
        return refuse(parsed)
    script, import_seconds = parsed
    start = time.time()
    if problem := no_script(script):
        return refuse(problem)
    script = script.resolve()
    with tempfile.TemporaryDirectory(prefix="ddrl-verify-") as folder:
        setup = probe(script, Path(folder), import_seconds)
        if isinstance(setup, str):
            return refuse(setup)
        modes = setup["modes"]
        fallback = ""
        for precision in TOLERANCES:
            work = Path(folder) / precision
            work.mkdir()
            problem = run_all(script, work, setup, precision)
            # an update that cannot run in float64 (float32 tensors of its own): float32 then
            markers = sorted(work.glob("*.float64"))
            if not problem or not markers:
                break
            fallback = markers[0].read_text()
        if problem:
            say(f"verify: {problem}")
            return 1
        tolerance = TOLERANCES[precision]
        message, worst = judged(work, modes, tolerance)
        if message:
            say(f"verify: {message}")
            return 1
        shares = json.loads((work / "shares.json").read_text())
        how = f"in {precision}" + (
            f", as its update does not run in float64 ({fallback})" if fallback else ""
        )
        print(
            f"verify: ok: {script.name}'s update at two ranks ({', '.join(modes)}; shares of "
            f"{shares[0]} and {shares[1]} batch rows) starts from the one-rank run's weights and "
            f"optimizer options on every rank and ends with its weights on their union, within "
            f"{tolerance:g} {how} (largest difference {worst:.2g}), in {time.time() - start:.0f} s"
        )
    return 0


def options(argv: list[str]) -> tuple[Path, float] | str:
    """The script and the import's bound in seconds from the command line, or what is wrong with
    it."""
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
    """Why `script` is no file verify could import ('' if it could be)."""
    if not script.is_file():
        return f"{script} is no file: verify runs a ddrl script (a .py file), or a copy of one"
    if script.suffix != ".py":
        return (
            f"{script.name} is no Python script (a .py file): verify runs a ddrl script, or a "
            "copy of one"
        )
    return ""


# --- the import, in a process of its own ----------------------------------------------------------
def probe(script: Path, folder: Path, seconds: float) -> dict | str:
    """What the runs need to know of the script (its small flags and `--sync` modes), from an
    import in a process of its own that may take `seconds`; or why verify cannot run it."""
    context = multiprocessing.get_context("fork")
    process = context.Process(target=probed, args=(str(script), str(folder)))
    process.start()
    process.join(seconds)
    if process.is_alive():
        process.kill()
        process.join()
        return (
            f"{script.name} did not finish importing within {seconds:g} s (a loop or a wait at "
            'import?): a ddrl script does its work in main, under `if __name__ == "__main__"`'
        )
    report = folder / "probe.json"
    if not report.exists():
        return f"importing {script.name} ended its process: it {ended(process.exitcode)}"
    found = json.loads(report.read_text())
    return found.get("problem") or found


def probed(script: str, folder: str) -> None:
    """The import's process: the script imported (its output to a log), what verify needs to know
    of it written to probe.json."""
    log = os.open(Path(folder) / "probe.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        found = looked_at(Path(script))
    except SystemExit as error:
        found = {
            "problem": f"{Path(script).name} exits when imported (sys.exit({error.code!r})): a "
            'ddrl script does its work in main, under `if __name__ == "__main__"`'
        }
    except BaseException as error:
        found = {"problem": import_problem(Path(script).name, error)}
    (Path(folder) / "probe.json").write_text(json.dumps(found))
    sys.stdout.flush()
    os._exit(0)


def looked_at(script: Path) -> dict:
    """The script imported: its small flags and `--sync` modes, or the problem that no ddrl script
    has."""
    module = load(script)
    names = ("Args", "main", "update")
    missing = [name for name in names if not callable(getattr(module, name, None))]
    if missing:
        return {
            "problem": f"{script.name} defines no {', '.join(missing)}: verify runs a ddrl "
            "script's main and its update (a copy of ppo_continuous_mpi.py, vpg_mpi.py or "
            "ppo_atari_multigpu.py)"
        }
    if not dataclasses.is_dataclass(module.Args):
        return {"problem": f"{script.name}'s Args is no dataclass: verify sets its flags by name"}
    parameters = inspect.signature(module.update).parameters
    needed = ["batch"] + (["sizes"] if "orders" in parameters else [])
    needed = [name for name in needed if name not in parameters]
    if "orders" in parameters and not callable(getattr(module, "minibatch_sizes", None)):
        needed.append("minibatch_sizes beside it")
    if needed:
        return {
            "problem": f"{script.name}'s update takes no {', '.join(needed)}: verify hands the "
            "update its batch (and its orders and sizes) by those names"
        }
    try:
        flags = small_flags(module.Args())
    except Exception as error:
        return {
            "problem": f"{script.name}'s Args() cannot be made from its defaults: "
            f"{type(error).__name__}: {first_line(error)}"
        }
    fields = {field.name for field in dataclasses.fields(module.Args)}
    return {"flags": flags, "modes": ["allreduce", "gather"] if "sync" in fields else ["allreduce"]}


def import_problem(name: str, error: BaseException) -> str:
    """What stopped the import of the script `name`, in a phrase."""
    if isinstance(error, SyntaxError):
        return f"{name} does not compile: {type(error).__name__}: {first_line(error)}"
    if isinstance(error, ModuleNotFoundError):
        return (
            f"importing {name} needs the module {error.name!r}, which is not installed "
            f"(ModuleNotFoundError: {first_line(error)})"
        )
    return f"importing {name} raised {type(error).__name__}: {first_line(error)}"


def small_flags(args) -> dict:
    """The flags of every run: SMALL where the script has them, the batch SAMPLES env steps per
    rank, one iteration of two ranks in all."""
    fields = args.__dataclass_fields__
    flags = {name: value for name, value in SMALL.items() if name in fields}
    if "num_steps" in fields and "steps_per_epoch" not in fields:
        flags["num_steps"] = max(1, SAMPLES // getattr(args, "local_num_envs", 1))
        flags["total_timesteps"] = 2 * flags["num_steps"] * getattr(args, "local_num_envs", 1)
    else:
        flags["total_timesteps"] = SAMPLES
    return flags


# --- the runs -------------------------------------------------------------------------------------
def run_all(script: Path, work: Path, setup: dict, precision: str) -> str:
    """The one-rank run and the two-rank runs, each to the end of its first update; '' when every
    rank got there, else which run stopped and why."""
    (work / "flags.json").write_text(json.dumps(setup["flags"]))
    # all at once: the two-rank runs start up and roll out while the reference does, then wait
    # for its batch
    reference = start_ranks(script, work, "reference", 1, precision)
    launched = {mode: start_ranks(script, work, mode, 2, precision) for mode in setup["modes"]}
    problem = wait(reference, work, "reference")
    if problem:
        problem = f"the one-rank run {problem}"
    for mode, processes in launched.items():
        if not problem and (stopped := wait(processes, work, mode)):
            problem = f"the two-rank run ({mode}) {stopped}"
        for process in processes:  # the runs after a failed one are not needed
            process.kill()
            process.join()
    return problem


def start_ranks(script: Path, work: Path, mode: str, ranks: int, precision: str) -> list:
    """The workers of one run, as a launcher would start them (ranks and a free port in their
    environment): forked from this process, which imported torch once."""
    port = free_port()
    processes = []
    for rank in range(ranks):
        launcher = {
            "RANK": rank,
            "WORLD_SIZE": ranks,
            "LOCAL_RANK": rank,
            "LOCAL_WORLD_SIZE": ranks,
        }
        launcher |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} if ranks > 1 else {}
        launcher = {key: str(value) for key, value in launcher.items()}
        arguments = (mode, str(script), str(work), launcher, precision)
        process = multiprocessing.get_context("fork").Process(target=forked, args=arguments)
        process.start()
        processes.append(process)
    return processes


def forked(mode: str, script: str, work: str, launcher: dict[str, str], precision: str) -> None:
    """A worker's process: the launcher's variables in place of any it inherited, its output to
    its log, then the worker."""
    launched = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "PMIX_", "SLURM_")
    for key in [key for key in os.environ if key.startswith((*launched, "TORCHELASTIC"))]:
        del os.environ[key]
    os.environ.update(launcher)
    os.chdir(work)
    log = os.open(f"{mode}.{launcher['RANK']}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os._exit(worker(mode, script, work, precision))


def wait(processes: list[multiprocessing.Process], work: Path, mode: str) -> str:
    """Wait for a run's workers (a peer of a failed one for GRACE_SECONDS at most); '' if each
    ended its first update, else why the run stopped, in a phrase."""
    deadline = time.monotonic() + WORKER_SECONDS
    failed_at = math.inf
    killed = set()
    while any(process.is_alive() for process in processes):
        now = time.monotonic()
        if any(process.exitcode not in (None, 0) for process in processes):
            failed_at = min(failed_at, now)
        if now > min(deadline, failed_at + GRACE_SECONDS):
            killed = {rank for rank, process in enumerate(processes) if process.is_alive()}
            for process in processes:
                process.kill()
                process.join()
            if failed_at == math.inf:
                return f"did not reach the end of its first update within {WORKER_SECONDS} s"
            break
        time.sleep(0.05)
    names = [f"{mode}.{rank}" for rank in range(len(processes))]
    if all((work / f"{name}.after.safetensors").exists() for name in names):
        return ""
    causes = []
    for rank, process in enumerate(processes):
        if rank in killed:  # by verify, its peer having failed
            continue
        who = f"rank {rank}" if len(processes) > 1 else "it"
        name = names[rank]
        lines = (work / f"{name}.log").read_text(errors="replace").splitlines()
        errors = [line for line in lines if ": error: " in line]
        if process.exitcode < 0:
            causes.append((0, f"{who} {ended(process.exitcode)}"))
        elif (work / f"{name}.raised").exists():
            causes.append((1, f"{who} raised {(work / f'{name}.raised').read_text()}"))
        elif errors:  # not what a peer's end caused, where another error says more
            causes.append((2 + ("lost contact with another rank" in errors[0]), errors[0]))
        elif (work / f"{name}.returned").exists():
            causes.append((4, f"{who}: main returned without calling update"))
        elif not (work / f"{name}.after.safetensors").exists():
            causes.append((5, f"{who} {ended(process.exitcode)}"))
    cause = min(causes)[1] if causes else "a rank was stopped"
    return f"stopped before its first update ended: {cause}"


def ended(exitcode: int) -> str:
    """How a process ended, in words: `was killed by SIGKILL`, `exited with code 3`."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def free_port() -> int:
    """A TCP port that nothing listens on right now (the run's MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the comparison -------------------------------------------------------------------------------
def judged(work: Path, modes: list[str], tolerance: float) -> tuple[str, float]:
    """What differs between the two-rank runs' ranks and the one-rank run, in one sentence ('' if
    nothing), and the largest weight difference after the update."""
    reference = read_run(work, "reference.0")
    shares = json.loads((work / "shares.json").read_text())
    worst = 0.0
    for mode in modes:
        where = f"at two ranks ({mode}, shares of {shares[0]} and {shares[1]} batch rows)"
        ranks = [read_run(work, f"{mode}.{rank}") for rank in (0, 1)]
        if problem := set_up_otherwise(reference, ranks, tolerance):
            return f"{where}, {problem}: {ONE_MODEL}; {SEE}", worst
        for rank, run in enumerate(ranks):
            names = set(run["after"]) | set(reference["after"])
            gaps = differences(run["after"], reference["after"], names)
            worst = max([worst, *gaps.values()])
            if bad := too_far(run["after"], reference["after"], tolerance, names):
                return (
                    f"{where}, rank {rank}'s {bad[1]} from the one-rank update on their "
                    f"union by up to {bad[0]:.3g} (tolerance {tolerance:g}): the update no longer "
                    f"equals one process's on the whole batch; {SEE}",
                    worst,
                )
    return "", worst


def set_up_otherwise(reference: dict, ranks: list[dict], tolerance: float) -> str:
    """How a two-rank run's ranks set themselves up otherwise than the one-rank run, or than each
    other, in a clause: the optimizer's options, the numbers in args, the weights before the update,
    the statistics (buffers) before it; '' if they did not."""
    parameters = set(reference["parameters"]).union(*(run["parameters"] for run in ranks))
    for when, at in (("before", "as its first update starts"), ("after", "after its first update")):
        for rank, run in enumerate(ranks):
            if differ := first_difference(run[f"options {when}"], reference[f"options {when}"]):
                return (
                    f"rank {rank}'s optimizer sets {differ[0]} to {differ[1]} {at}, where the "
                    f"one-rank run's sets it to {differ[2]}"
                )
        if differ := first_difference(ranks[1][f"args {when}"], ranks[0][f"args {when}"]):
            return f"rank 1's args.{differ[0]} is {differ[1]} {at}, where rank 0's is {differ[2]}"
    for rank, run in enumerate(ranks):
        if bad := too_far(run["before"], reference["before"], tolerance, parameters):
            return (
                f"rank {rank}'s {bad[1]} before its first update from the one-rank run's "
                f"by up to {bad[0]:.3g} (tolerance {tolerance:g})"
            )
    buffers = (set(ranks[0]["before"]) | set(ranks[1]["before"])) - parameters
    if bad := too_far(ranks[1]["before"], ranks[0]["before"], tolerance, buffers):
        return (
            f"rank 1's {bad[1]} from rank 0's before its first update by up to "
            f"{bad[0]:.3g} (tolerance {tolerance:g})"
        )
    return ""


def read_run(work: Path, name: str) -> dict:
    """One rank's record: its state before and after the update, its parameters' names, its
    optimizer options and the numbers in its args before and after."""
    record = json.loads((work / f"{name}.setup.json").read_text())
    record |= json.loads((work / f"{name}.finish.json").read_text())
    record["before"] = load_file(work / f"{name}.before.safetensors")
    record["after"] = load_file(work / f"{name}.after.safetensors")
    return record


def too_far(ours: dict, theirs: dict, tolerance: float, names: set[str]) -> tuple[float, str]:
    """The largest difference above `tolerance` among the named tensors, and the names that differ
    (the first three, largest first) with their verb; () if none."""
    gaps = differences(ours, theirs, names)
    bad = sorted(((gap, name) for name, gap in gaps.items() if gap > tolerance), reverse=True)
    if not bad:
        return ()
    names_said = ", ".join(name for _, name in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return bad[0][0], names_said + more + (" differs" if len(bad) == 1 else " differ")


def differences(ours: dict, theirs: dict, names: set[str]) -> dict[str, float]:
    """The largest absolute difference of each named floating tensor (inf where one side lacks it
    or it has another shape)."""
    gaps = {}
    for name in sorted(names):
        mine = ours.get(name)
        other = theirs.get(name)
        if mine is None or other is None or mine.shape != other.shape:
            gaps[name] = math.inf
        elif mine.is_floating_point() or other.is_floating_point():
            gap = (mine.double() - other.double()).abs().max().item() if mine.numel() else 0.0
            gaps[name] = gap if gap == gap else math.inf
        elif not torch.equal(mine, other):
            gaps[name] = math.inf
    return gaps


def first_difference(ours: dict, theirs: dict) -> tuple[str, str, str]:
    """The first key whose value differs between two records of plain values (numbers within a
    relative 1e-6), with both values as a message shows them; () if none."""
    for key in sorted(set(ours) | set(theirs)):
        mine = ours.get(key, MISSING)
        other = theirs.get(key, MISSING)
        if not alike(mine, other):
            return key, shown_value(mine), shown_value(other)
    return ()


def alike(mine: object, other: object) -> bool:
    """Plain values equal, numbers within a relative 1e-6 (a number computed on two batches of the
    same data rounds apart), lists item by item."""
    if isinstance(mine, list) and isinstance(other, list):
        return len(mine) == len(other) and all(map(alike, mine, other))
    numbers = (int, float)
    if isinstance(mine, numbers) and isinstance(other, numbers):
        if isinstance(mine, bool) or isinstance(other, bool):
            return mine is other
        return math.isclose(mine, other, rel_tol=1e-6) or (mine != mine and other != other)
    return mine == other


def shown_value(value: object) -> str:
    """A plain value as a message quotes it: a float in 4 digits, `nothing` where it is missing,
    anything else as failures.shown quotes it (cut)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if value is MISSING else shown(value)


# --- inside a run ---------------------------------------------------------------------------------
def worker(mode: str, script: str, work: str, precision: str) -> int:
    """One rank of one run: the script's main with the small flags (and `--sync mode`), its first
    update replaced by verify's: recorded and run on the whole batch (`reference`), or on this
    rank's share of the reference's batch; the state after it written, then main stopped. An
    exception's first line goes to NAME.raised, a main that returns leaves NAME.returned."""
    work = Path(work)
    name = f"{mode}.{os.environ['RANK']}"
    try:
        module = load(Path(script))
        flags = json.loads((work / "flags.json").read_text())
        if mode != "reference" and "sync" in module.Args.__dataclass_fields__:
            flags["sync"] = mode
        args = module.Args(**flags)
        if mode == "gather":
            one_learner.update_on_rank0 = gathered_update(
                one_learner.update_on_rank0, module, args, work, precision
            )
        else:
            module.update = replaced_update(module, mode, args, work, precision)
        module.main(args)
    except Stop:
        sys.stdout.flush()
        os._exit(0)  # at once: the process group's threads need no orderly teardown
    except Exception as error:
        (work / f"{name}.raised").write_text(f"{type(error).__name__}: {first_line(error)}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    (work / f"{name}.returned").touch()
    return 1


def load(script: Path):
    """The script as a module, without running its main (it runs only under `__main__`)."""
    name = "ddrl_verify_" + re.sub(r"\W", "_", script.stem)
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def replaced_update(script, mode: str, args, work: Path, precision: str):
    """The script's update, called as main calls it, on verify's batch and minibatches (worker):
    its arguments bound to its signature, so that verify finds them by name."""
    update = script.update

    def verify_update(*arguments, **options):
        bound = inspect.signature(update).bind(*arguments, **options)
        model = model_of(bound.arguments)
        prepared(bound.arguments, model, script, mode, args, work, precision)
        try:
            result = update(*bound.args, **bound.kwargs)
        except Exception as error:
            note_failure(error, mode, work, precision)
            raise
        finish(bound.arguments, model, mode, args, work)
        return result

    return verify_update


def gathered_update(update_on_rank0, script, args, work: Path, precision: str):
    """one_learner.update_on_rank0, called as main calls it, on verify's batch and minibatches (see
    worker). The optimizers (and any other module) are the ones the update it is handed holds."""

    def verify_update_on_rank0(update_union, model, batch, orders=None, sizes=None):
        called = {"model": model, "batch": batch}
        if orders is not None:
            called |= {"orders": orders, "sizes": sizes}
        called |= {f"held {index}": value for index, value in enumerate(held_by(update_union))}
        prepared(called, model, script, "gather", args, work, precision)
        data = [called["batch"], called.get("orders"), called.get("sizes")]
        try:
            result = update_on_rank0(update_union, model, *data)
        except Exception as error:
            note_failure(error, "gather", work, precision)
            raise
        finish(called, model, "gather", args, work)
        return result

    return verify_update_on_rank0


def held_by(update_union) -> list:
    """What the update main hands one_learner.update_on_rank0 holds: a lambda's (or a nested
    function's) variables of main (its Agent, optimizer, args, ...), a partial's arguments."""
    if isinstance(update_union, functools.partial):
        return [*held_by(update_union.func), *update_union.args, *update_union.keywords.values()]
    if inspect.isfunction(update_union):
        return list(inspect.getclosurevars(update_union).nonlocals.values())
    return []


def note_failure(error: Exception, mode: str, work: Path, precision: str) -> None:
    """In float64, the first line of what the update raised, in NAME.float64: verify then runs the
    update in float32, as the script wrote it (float32 tensors of its own meet float64 ones)."""
    if precision == "float64":
        name = f"{mode}.{os.environ.get('RANK', '0')}"
        (work / f"{name}.float64").write_text(f"{type(error).__name__}: {first_line(error)}")


def prepared(
    called: dict, module: nn.Module, script, mode: str, args, work: Path, precision: str
) -> None:
    """The update's values by name (`called`: its batch, orders and sizes, optimizers, modules)
    made verify's, in place: verify's batch, orders and sizes, the reference's buffers (the data's
    statistics) in `module` at two ranks, and everything in `precision`. What the rank set itself
    up with is recorded first and kept: its weights, its optimizer's options and learning rates,
    the numbers in its args."""
    batch = called["batch"]
    optimizers = [value for value in called.values() if isinstance(value, torch.optim.Optimizer)]
    takes_orders = "orders" in called
    rank = int(os.environ.get("RANK", "0"))
    name = f"{mode}.{rank}"
    save_file(state(module), work / f"{name}.before.safetensors")
    record = {
        "parameters": [key for key, _ in module.named_parameters()],
        "options before": options_of(optimizers),
        "args before": plain_fields(args),
    }
    (work / f"{name}.setup.json").write_text(json.dumps(record))
    if mode == "reference":
        count = len(batch["returns"])
        shares = [count // 2, count // 2]  # VPG splits its batch evenly
        # unequal, each at least one row a minibatch (rows: samples, or a recurrent copy's envs)
        if takes_orders:
            second = max(called["sizes"].shape[1], count - math.ceil(count * SHARE))
            shares = [count - second, second]
        batch = {key: value[: sum(shares)] for key, value in batch.items()}
        save_file(
            {key: value.contiguous().cpu() for key, value in batch.items()},
            work / "batch.safetensors",
        )
        (work / "shares.json").write_text(json.dumps(shares))
        if takes_orders:
            generator = torch.Generator().manual_seed(0)
            epochs = len(called["orders"])
            orders = [
                torch.stack([torch.randperm(n, generator=generator) for _ in range(epochs)])
                for n in shares
            ]
            save_file(
                {f"orders.{r}": order for r, order in enumerate(orders)},
                work / "orders.safetensors",
            )
        (work / "reference.ready").touch()
    deadline = time.time() + WORKER_SECONDS
    while not (work / "reference.ready").exists():  # the reference's batch and minibatches
        if time.time() > deadline:
            raise Stop
        time.sleep(0.05)
    shares = json.loads((work / "shares.json").read_text())
    batch = {
        key: value.to(called["batch"][key].device)
        for key, value in load_file(work / "batch.safetensors").items()
    }
    if takes_orders:
        orders = load_file(work / "orders.safetensors")
        rank_orders = [orders[f"orders.{r}"] for r in range(2)]
        # the script's own
        sizes = script.minibatch_sizes(shares, called["sizes"].shape[1])
    if mode == "reference" and takes_orders:
        called["orders"] = one_learner.union_orders(rank_orders, sizes).to(called["orders"].device)
        called["sizes"] = sizes.sum(0)[None]
    elif mode != "reference":
        start = sum(shares[:rank])
        batch = {key: value[start : start + shares[rank]] for key, value in batch.items()}
        if takes_orders:
            called["orders"] = rank_orders[rank].to(called["orders"].device)
            called["sizes"] = sizes
        take_buffers(module, load_file(work / "reference.0.before.safetensors"))
    called["batch"] = in_precision(called, batch, precision)


def take_buffers(module: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    """The reference's buffers (the statistics of the data verify hands every run) where the module
    has a buffer of that name and shape; its parameters stay its own."""
    own = module.state_dict()
    parameters = {name for name, _ in module.named_parameters()}
    buffers = {
        name: value
        for name, value in reference.items()
        if name not in parameters and name in own and own[name].shape == value.shape
    }
    module.load_state_dict(buffers, strict=False)


def in_precision(called: dict, batch: dict, precision: str) -> dict:
    """In float64: the update's modules (in place: the optimizer keeps its parameters), a
    DistributedDataParallel made anew around its converted module (its buckets keep the dtype
    they were made with), tensors the update makes, and the batch returned converted."""
    if precision != "float64":
        return batch
    torch.set_default_dtype(torch.float64)
    for key, value in list(called.items()):
        if isinstance(value, nn.Module):
            value.double()
        if isinstance(value, DistributedDataParallel):
            called[key] = DistributedDataParallel(
                value.module,
                device_ids=value.device_ids,
                process_group=value.process_group,
                find_unused_parameters=value.find_unused_parameters,
                gradient_as_bucket_view=value.gradient_as_bucket_view,
                static_graph=value.static_graph,
            )
    return {
        key: value.double() if value.is_floating_point() else value for key, value in batch.items()
    }


def model_of(called: dict) -> nn.Module:
    """The module the update trains: the first among its arguments (DistributedDataParallel's: the
    Agent in it)."""
    module = next(value for value in called.values() if isinstance(value, nn.Module))
    return getattr(module, "module", module)


def finish(called: dict, module: nn.Module, mode: str, args, work: Path) -> None:
    """Write the state `module` ended the update with, the optimizer's options and the numbers in
    args after it, and end the run."""
    name = f"{mode}.{os.environ.get('RANK', '0')}"
    optimizers = [v for v in called.values() if isinstance(v, torch.optim.Optimizer)]
    record = {"options after": options_of(optimizers), "args after": plain_fields(args)}
    (work / f"{name}.finish.json").write_text(json.dumps(record))
    save_file(state(module), work / f"{name}.after.safetensors")
    raise Stop


def options_of(optimizers: list[torch.optim.Optimizer]) -> dict[str, object]:
    """Every option of every parameter group by name (`lr in parameter group 1`), plain values."""
    found = {}
    for index, optimizer in enumerate(optimizers):
        groups = optimizer.param_groups
        for number, group in enumerate(groups):
            where = f" in parameter group {number}" if len(groups) > 1 else ""
            where += f" of optimizer {index}" if len(optimizers) > 1 else ""
            for key, value in group.items():
                if key != "params":
                    found[f"{key}{where}"] = plain(value)
    return found


def plain_fields(args) -> dict[str, object]:
    """The fields of `args` as plain values (what JSON holds)."""
    return {key: plain(value) for key, value in vars(args).items()}


def plain(value: object) -> object:
    """`value` as JSON holds it: numbers, strings, booleans and None as they are, a one-number
    tensor as its number, a tuple as a list, anything else as its repr (without a memory address,
    which differs by process)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple | list):
        return [plain(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers, on the CPU."""
    return {
        name: tensor.detach().cpu().clone().contiguous()
        for name, tensor in module.state_dict().items()
    }


if __name__ == "__main__":
    raise SystemExit(command_line(sys.argv[1:]))
