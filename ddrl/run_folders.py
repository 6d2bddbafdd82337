"""runs/NAME: created by rank 0 exclusively, so that no run writes into another's, and locked for
the run's life, so that no two launches train one run; never written through a link."""

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import IO

import torch

from ddrl import collectives
from ddrl.failures import fail

LOCK_FILE = "run.lock"  # in every run folder: locked by the run's rank 0, and who holds it
WRITTEN_FOLDERS = ("checkpoints", "videos")
MODEL_FILE = "model.safetensors"


@dataclass
class RunFolder:
    """The run's folder name ('' until known) and, on rank 0, its run.lock, held."""

    name: str = ""
    lock: IO | None = None


def refuse_link(path: str) -> None:
    """Stop in one line if `path` is a symbolic link: a run reads and writes nothing through one."""
    if os.path.islink(path):
        fail(link_problem(path))


def real_folder(path: str) -> None:
    """Make the folder `path` if missing; stop in one line if it is, or holds, a link."""
    if problem := folder_problem(path, make=True):
        fail(problem)


def create_run_folder(args, name: str, rank: int, device: torch.device, resumed: bool) -> RunFolder:
    """The run's folder on every rank: `name`, or a default from rank 0's clock, suffixed where
    taken; rank 0 creates (or finds) it, checks it and locks it, or every rank stops."""
    folder = RunFolder()
    default_name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__"
    start_time = int(time.time())
    suffix = 0
    problem = ""
    if rank == 0:
        suffix, problem = make_run_folder(name or f"{default_name}{start_time}", not name, resumed)
        made = (name or f"{default_name}{start_time}") + (f"-{suffix}" if suffix else "")
        if not problem:
            problem = run_folder_problem(made, args.save_model)
        if not problem:
            folder.lock, problem = lock_run_folder(made)
    start_time, suffix, failed = collectives.gather_ints_to_all(
        [start_time, suffix, len(problem)], device
    )[0].tolist()
    if failed:
        fail(problem)
    folder.name = (name or f"{default_name}{start_time}") + (f"-{suffix}" if suffix else "")
    return folder


def run_folder_problem(name: str, save_model: bool) -> str:
    """Why the run cannot write its files in runs/NAME (''), found before the first iteration."""
    folder = os.path.join("runs", name)
    for path in (folder, *(os.path.join(folder, child) for child in WRITTEN_FOLDERS)):
        if problem := folder_problem(path, make=False):
            return problem
    model = os.path.join(folder, MODEL_FILE)
    if save_model and os.path.isdir(model):
        return f"{model} is a folder, where --save-model writes the model file: move it away"
    return ""


def folder_problem(path: str, make: bool) -> str:
    """Why a run cannot write into the folder `path` (made where missing: `make`), or ''."""
    if os.path.islink(path):
        return link_problem(path)
    try:
        if make and not os.path.lexists(path):
            os.mkdir(path)
        if not os.path.lexists(path):
            return ""
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return f"{path} is no folder: move it away"
        links = [entry.path for entry in os.scandir(path) if entry.is_symlink()]
    except OSError as error:
        return f"cannot make or read the folder {path} ({error.strerror}): make it writable"
    return link_problem(sorted(links)[0]) if links else ""


def link_problem(path: str) -> str:
    """What a message says of `path`, a symbolic link."""
    return (
        f"{path} is a symbolic link, which a run never reads or writes through: replace it with "
        "the real folder or file"
    )


def lock_run_folder(name: str) -> tuple[IO | None, str]:
    """Rank 0 locks runs/NAME/run.lock for the process's life, saying who holds it: the open lock
    file, and what went wrong ('')."""
    path = os.path.join("runs", name, LOCK_FILE)
    try:  # never through a link: O_NOFOLLOW refuses one
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        lock = os.fdopen(descriptor, "r+")
    except OSError as error:
        if error.errno == errno.ELOOP:
            return (
                None,
                f"{path} is a symbolic link, which a run never writes through: delete it, then "
                "--resume",
            )
        return None, f"cannot open {path} ({error.strerror}): make the run folder writable"
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = lock_record(name)
        lock.close()
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
        return None, (
            f"runs/{name} is in use by another run (process {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}, since {since}): wait for it to end, or choose another "
            "--run-name"
        )
    write_lock_record(lock, finished=False)
    return lock, ""


def lock_record(name: str) -> dict:
    """What runs/NAME/run.lock says of the launch that holds or held the run ({} if nothing)."""
    try:
        descriptor = os.open(os.path.join("runs", name, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(descriptor) as lock:
            record = json.loads(lock.read(4096) or "{}")
    except (OSError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def release_run_folder(folder: RunFolder, finished: bool) -> None:
    """Rank 0 marks the run finished (or not: stopped, it can be resumed) and lets its folder go."""
    if folder.lock is None:
        return
    with contextlib.suppress(OSError):
        write_lock_record(folder.lock, finished)
    folder.lock.close()
    folder.lock = None


def write_lock_record(lock: IO, finished: bool) -> None:
    """Say in the held lock file which launch, process and host hold the run, and if it finished."""
    record = {
        "launch": os.environ.get("TORCHELASTIC_RUN_ID", ""),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.time(),
        "finished": finished,
    }
    lock.seek(0)
    lock.truncate()
    lock.write(json.dumps(record))
    lock.flush()


def make_run_folder(name: str, suffixed: bool, resumed: bool) -> tuple[int, str]:
    """Rank 0 creates runs/NAME exclusively (`suffixed`: the first free NAME-2, ...), or finds a
    resumed run's, and checks it is writable: the suffix taken (0: none) and what went wrong."""
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as error:
        return (
            0,
            f"cannot create the folder runs/ here ({error.strerror}): run from a folder you can "
            "write to",
        )
    suffix = 0
    while True:
        folder = os.path.join("runs", name + (f"-{suffix}" if suffix else ""))
        try:
            os.mkdir(folder)
            break
        except FileExistsError:
            if resumed:
                if os.path.islink(folder) or not os.path.isdir(folder):
                    return (
                        0,
                        f"{folder} is a symbolic link or no folder, which a run never writes "
                        "through",
                    )
                break
            if not suffixed:
                return (
                    0,
                    f"{folder} already exists: pass --resume to continue it, or choose another "
                    "--run-name",
                )
            suffix = max(suffix, 1) + 1
        except OSError as error:
            return (
                0,
                f"cannot create the run folder {folder} ({error.strerror}): make runs/ writable, "
                "or run elsewhere",
            )
    for writable in (folder, os.path.join(folder, "checkpoints")):
        try:
            if os.path.lexists(writable) or writable == folder:
                with tempfile.TemporaryFile(dir=writable):
                    pass
        except OSError as error:
            return (
                suffix,
                f"cannot write into {writable} ({error.strerror}): make it a writable folder",
            )
    return suffix, ""


def open_tensorboard(args, name: str, resumed_step: int | None):
    """Rank 0's SummaryWriter for runs/NAME (resumed after `resumed_step`) and W&B's run."""
    wandb_run = None
    if args.track:
        import wandb

        settings = {
            "project": args.wandb_project_name,
            "entity": args.wandb_entity,
            "config": asdict(args),
        }
        resume = "allow" if resumed_step is not None else None
        wandb_run = wandb.init(
            **settings, name=name, sync_tensorboard=True, save_code=True, resume=resume
        )
    from torch.utils.tensorboard import SummaryWriter

    # a random suffix: no link placed in the run folder beforehand bears the event file's name
    purge_step = None if resumed_step is None else resumed_step + 1
    writer = SummaryWriter(
        f"runs/{name}", purge_step=purge_step, filename_suffix=f".{secrets.token_hex(8)}"
    )
    if resumed_step is None:
        table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer, wandb_run
