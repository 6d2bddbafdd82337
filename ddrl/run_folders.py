"""Run folders: runs/NAME, one folder name below runs/, created by rank 0 exclusively so that no run writes into
another's, and its TensorBoard writer (and Weights and Biases run, with --track)."""

import os
import tempfile
import time
from dataclasses import asdict

import torch

from ddrl import collectives
from ddrl.failures import fail


def is_one_folder(name: str) -> bool:
    """Whether `name` names one folder right below runs/, never a path elsewhere."""
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    return name not in (".", "..") and name.isprintable() and len(name.encode()) <= 200 and not separators & set(name)


def create_run_folder(args, name: str, resumed: bool, rank: int, device: torch.device) -> str:
    """The run's name, on every rank: `name`, or a default from rank 0's clock (suffixed where taken); rank 0 creates
    its folder, and every rank stops with rank 0's one line if it could not."""
    default_name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__"
    start_time = int(time.time())
    suffix = 0
    problem = ""
    if rank == 0:
        resumed = resumed or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        suffix, problem = make_run_folder(name or f"{default_name}{start_time}", not name, resumed)
    start_time, suffix, failed = collectives.gather_ints_to_all([start_time, suffix, len(problem)], device)[0].tolist()
    if failed:
        fail(problem)
    return (name or f"{default_name}{start_time}") + (f"-{suffix}" if suffix else "")


def make_run_folder(name: str, suffixed: bool, resumed: bool) -> tuple[int, str]:
    """Rank 0 creates runs/NAME: exclusively for a new run, so that no run writes into another's (`suffixed`: the first
    free NAME-2, NAME-3, ... instead), or finds a resumed run's; then checks that it and its checkpoints can be written.
    Returns the suffix taken (0: none) and what went wrong ('' if nothing)."""
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as error:
        return 0, f"cannot create the folder runs/ here ({error.strerror}): run from a folder you can write to"
    suffix = 0
    while True:
        folder = os.path.join("runs", name + (f"-{suffix}" if suffix else ""))
        try:
            os.mkdir(folder)
            break
        except FileExistsError:
            if resumed:
                break
            if not suffixed:
                return 0, f"{folder} already exists: pass --resume to continue it, or choose another --run-name"
            suffix = max(suffix, 1) + 1
        except OSError as error:
            return 0, f"cannot create the run folder {folder} ({error.strerror}): make runs/ writable, or run elsewhere"
    for writable in (folder, os.path.join(folder, "checkpoints")):
        try:
            if os.path.lexists(writable) or writable == folder:
                with tempfile.TemporaryFile(dir=writable):
                    pass
        except OSError as error:
            return suffix, f"cannot write into {writable} ({error.strerror}): make it a writable folder"
    return suffix, ""


def open_tensorboard(args, name: str, resumed_step: int | None):
    """Rank 0's SummaryWriter for runs/NAME (a resumed run's curves go on after `resumed_step`), W&B's run or None."""
    wandb_run = None
    if args.track:
        import wandb

        settings = {"project": args.wandb_project_name, "entity": args.wandb_entity, "config": asdict(args)}
        resume = "allow" if resumed_step is not None else None
        wandb_run = wandb.init(**settings, name=name, sync_tensorboard=True, save_code=True, resume=resume)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(f"runs/{name}", purge_step=None if resumed_step is None else resumed_step + 1)
    if resumed_step is None:
        table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer, wandb_run
