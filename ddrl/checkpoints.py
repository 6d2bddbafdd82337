"""Checkpoints: a training checkpoint per iteration (runs/NAME/checkpoints/iter_N.pt) and the model file
(model.pt), written atomically by rank 0; reading one is checking it like a command line, through torch's
weights-only loader, so loading a file never runs code; every misfit is one line naming the file and the fix."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import random
import re
import signal
import stat
import time
import types
import typing
import zipfile
from dataclasses import asdict
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from ddrl import failures, machine, run_folders
from ddrl.failures import fail

if TYPE_CHECKING:
    from ddrl.launching import Run


def saved_args(checkpoint: dict, args_type: type, path: str):
    """A checkpoint's args as `args_type` (the script's Args): each entry of the type its field declares, or one error
    (entries it lacks take their defaults; others are ignored). The caller checks their values as it checks flags."""
    hints = typing.get_type_hints(args_type)
    saved = {name: value for name, value in checkpoint["args"].items() if name in hints}
    for name, value in saved.items():
        if not fits_type(value, hints[name]):
            fail(f"{path} holds {value!r} as its args' {name}, which is no {hints[name]}: it is damaged")
    return args_type(**saved)


def fits_type(value, hint) -> bool:
    """Whether `value` is of the annotated type `hint` (int, float, bool, str, None, a Literal, union or tuple)."""
    origin = typing.get_origin(hint)
    options = typing.get_args(hint)
    if origin is Literal:
        return value in options
    if origin in (types.UnionType, typing.Union):
        return any(fits_type(value, option) for option in options)
    if origin is tuple:
        return isinstance(value, tuple | list) and all(fits_type(item, options[0]) for item in value)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return value is None if hint is type(None) else isinstance(value, hint)


def read_checkpoint(path: str, fix: str, env_id: str, **entries: type) -> dict:
    """The checkpoint at `path`, its entries of their types, or one error naming the file, its fault and `fix`. Only a
    file torch.save could have written is read at all; an env id that names a module to import must be `env_id`."""
    if not os.path.exists(path):  # only --eval-checkpoint names a file that may be missing
        fail(f"--eval-checkpoint {path!r} does not exist; {fix}")
    if problem := archive_problem(path):
        fail(f"{path} {problem}; {fix}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # the file needs pickle, which can run code: refused before any of it ran
        fail(f"{path} {pickled_objects_problem(path)}")
    except Exception as error:  # a damaged archive
        reason = (str(error) or type(error).__name__).splitlines()[0]
        fail(f"{path} is truncated or not a checkpoint ({reason}); {fix}")
    if not isinstance(checkpoint, dict) or checkpoint.get("script") != failures.script:
        fail(
            f"{path} is not a {'training checkpoint' if entries else 'model'} of {failures.script}; "
            "use the one that wrote it"
        )
    for key, kind in {"env_id": str, "args": dict, "model": dict, **entries}.items():
        if not isinstance(checkpoint.get(key), kind):
            found = type(checkpoint[key]).__name__ if key in checkpoint else "nothing"
            fail(
                f"{path} holds {found} as {key!r} where {failures.script} writes a {kind.__name__}: "
                f"it is damaged; {fix}"
            )
    saved_env_id = checkpoint["env_id"]
    if ":" in saved_env_id and saved_env_id != env_id:  # gymnasium imports `module` of `module:EnvId` to make it
        fail(
            f"{path} names its env {saved_env_id!r}, whose module gymnasium would import, running its code: refused; "
            f"if you trust that module, pass --env-id {saved_env_id} yourself"
        )
    return checkpoint


def read_model(path: str, args_type: type, args_problem, env_id: str) -> tuple[dict, object]:
    """--eval-checkpoint's model file, checked like a command line: the file (read_checkpoint), then its args by
    `args_problem` (the script's check of its flags). Returns the checkpoint and its args as `args_type`."""
    checkpoint = read_checkpoint(path, "pass the model.pt that --save-model wrote", env_id)
    saved = saved_args(checkpoint, args_type, path)
    if problem := args_problem(saved):
        fail(f"{path} holds args that no command line gives ({problem}): it is damaged")
    return checkpoint, saved


def archive_problem(path: str) -> str | None:
    """What makes `path` a file torch.save never writes, found before reading it: not a regular file, not a zip archive,
    or entries that are compressed or claim more bytes than the file holds (what the loader would allocate)."""
    try:
        mode = os.stat(path).st_mode
        size = os.path.getsize(path)
        if stat.S_ISDIR(mode):
            return "is a folder"
        if not stat.S_ISREG(mode):
            kinds = {stat.S_ISCHR: "character device", stat.S_ISBLK: "block device", stat.S_ISFIFO: "named pipe"}
            kind = next((name for test, name in kinds.items() if test(mode)), "socket")
            return f"is a {kind}, not a file: refused, unread"
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except zipfile.BadZipFile as error:
        return f"is truncated or not a checkpoint ({error})"
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if compressed := [entry.filename for entry in entries if entry.compress_type != zipfile.ZIP_STORED]:
        return f"holds compressed entries ({', '.join(compressed[:2])}), which torch.save never writes: refused, unread"
    claimed = sum(max(entry.file_size, entry.compress_size) for entry in entries)
    if claimed > size:
        return f"claims {claimed} bytes in its entries, more than its own {size}: refused, unread"
    return None


def pickled_objects_problem(path: str) -> str:
    """What a file that torch's weights-only loader refused holds instead of a checkpoint, found without building any
    of it: objects only pickle builds (and from which version), or a malformed pickle."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)  # a scan of its opcodes, which runs nothing
    except Exception:
        names = []
    if not names:
        return "is not a checkpoint (its pickle is malformed): refused"
    if holds_earlier_random_states(path):
        return (
            f"was written by an earlier version of {failures.script}, whose numpy random states need pickle to load "
            "(which can run code): resume or evaluate it with the version that wrote it"
        )
    return (
        f"carries code or objects that no checkpoint holds ({', '.join(sorted(names)[:3])}), which only pickle loads: "
        "refused, unread"
    )


class PickleStandIn:
    """What PickleScan puts where a pickle names an object: calling or building it runs nothing from the file."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args) -> PickleStandIn:
        return PickleStandIn(self.name)

    def __setstate__(self, state) -> None:
        pass


class PickleScan(pickle.Unpickler):
    """Reads the shape of a pickle with a PickleStandIn for every object it names (a state dict's OrderedDict aside)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return PickleStandIn(f"{module}.{name}")

    def persistent_load(self, pid) -> None:  # torch's tensor data: not read
        return None


def holds_earlier_random_states(path: str) -> bool:
    """Whether `path` is a training checkpoint of an earlier version: beyond torch's own objects, it holds nothing but
    numpy random-state arrays at rng[rank]["numpy"][1], where those versions kept them."""
    try:
        with zipfile.ZipFile(path) as archive:
            [pickled] = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            top = PickleScan(io.BytesIO(archive.read(pickled))).load()
    except Exception:  # anything a stand-in cannot take (a class built by NEWOBJ, an item set on it): not that
        return False
    places = []  # where each object of the file's own sits, as a path of keys and indices
    pending = [((), top)]
    seen = set()
    while pending:
        place, value = pending.pop()
        if id(value) in seen:  # a pickle may hold a list inside itself
            continue
        seen.add(id(value))
        if isinstance(value, PickleStandIn) and not value.name.startswith("torch."):
            places.append(place)
        elif isinstance(value, dict):
            pending += [((*place, key), item) for key, item in value.items()]
        elif isinstance(value, list | tuple):
            pending += [((*place, index), item) for index, item in enumerate(value)]
    in_rng = all(place[0] == "rng" and place[2:] == ("numpy", 1) for place in places)
    return bool(places) and in_rng and isinstance(top, dict) and top.get("script") == failures.script


def load_weights(module: nn.Module, weights: dict, path: str) -> None:
    """Load a checkpoint's `weights` into `module`, or stop naming the file and the first entries that do not fit."""
    wanted = module.state_dict()
    faults = []
    for key, tensor in wanted.items():
        value = weights.get(key)
        if not torch.is_tensor(value):
            faults.append(f"{key} {'missing' if key not in weights else type(value).__name__}")
        elif value.shape != tensor.shape:
            faults.append(f"{key} {tuple(value.shape)}, not {tuple(tensor.shape)}")
        elif value.dtype != tensor.dtype:
            faults.append(f"{key} {value.dtype}, not {tensor.dtype}")
    faults += [f"{key} unknown" for key in weights.keys() - wanted.keys()]
    if faults:
        fail(
            f"{path}: its weights do not fit this {type(module).__name__} ({', '.join(faults[:3])}"
            f"{', ...' if len(faults) > 3 else ''}): undo the Agent's edit or use the {failures.script} that wrote it"
        )
    if nonfinite := [key for key, value in weights.items() if not torch.isfinite(value).all()]:
        fail(f"{path}: its weights {', '.join(nonfinite[:3])} are not finite; use a checkpoint from before")
    try:
        module.load_state_dict(weights)
    except (RuntimeError, ValueError) as error:  # a module's own check of what it loads
        fail(f"{path}: {str(error).splitlines()[0]}; use a checkpoint from before")


def optimizer_state_problem(optimizer: torch.optim.Optimizer, state) -> str | None:
    """What keeps a checkpoint's optimizer `state` from fitting `optimizer`, checked before loading it: another
    optimizer's options, other parameter groups, per-parameter tensors unlike their parameter. None if it fits."""
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict)):
        return "it is no optimizer's state"
    groups = optimizer.param_groups
    saved_groups = state.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        return f"its parameter groups are not the {len(groups)} of this {type(optimizer).__name__}"
    parameters = {}
    for saved, group in zip(saved_groups, groups, strict=True):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            return "its parameter groups are damaged"
        if others := sorted(map(str, saved.keys() - group.keys())):
            options = ", ".join(others[:3])
            return f"it is another optimizer's, with options ({options}) this {type(optimizer).__name__} lacks"
        if len(saved["params"]) != len(group["params"]):
            return f"it holds {len(saved['params'])} parameters in a group of {len(group['params'])}"
        parameters.update(zip(saved["params"], group["params"], strict=True))
    for index, entries in state["state"].items():
        if index not in parameters or not isinstance(entries, dict):
            return f"its state {index!r} belongs to no parameter"
        parameter = parameters[index]
        for key, value in entries.items():
            if not (torch.is_tensor(value) or isinstance(value, int | float)):
                return f"its {key!r} of parameter {index} is a {type(value).__name__}"
            if not torch.is_tensor(value) or value.dim() == 0:  # a step count
                continue
            if (value.shape, value.dtype) != (parameter.shape, parameter.dtype):
                found = f"{value.dtype} {tuple(value.shape)}"
                wanted = f"{parameter.dtype} {tuple(parameter.shape)}"
                return f"its {key!r} of parameter {index} is {found}, where the parameter is {wanted}"
    return None


def write_checkpoint(path: str, args, **state) -> None:
    """Write `state` with the script, env and args to `path` atomically: a kill at any moment leaves the old file, and a
    failed write (OSError, or torch's RuntimeError) leaves no part behind."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        torch.save({"script": failures.script, "env_id": args.env_id, "args": asdict(args), **state}, path + ".tmp")
        os.replace(path + ".tmp", path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise


def checkpoint_path(run_name: str, iteration: int) -> str:
    return os.path.join("runs", run_name, "checkpoints", f"iter_{iteration:06d}.pt")


def find_latest_checkpoint(run_name: str) -> str | None:
    """The newest `iter_*.pt` of the run (the highest iteration), or None."""
    names = os.listdir(folder) if os.path.isdir(folder := os.path.join("runs", run_name, "checkpoints")) else []
    iterations = [int(match[1]) for name in names if (match := re.fullmatch(r"iter_(\d+)\.pt", name))]
    return checkpoint_path(run_name, max(iterations)) if iterations else None


def last_good_checkpoint(run_name: str) -> str:
    """What a message that stops training says of the run's checkpoints: the newest one, or that there is none."""
    last = find_latest_checkpoint(run_name)
    return f"the last good checkpoint is {last}" if last else "no checkpoint was written"


def find_run_to_resume(args, world_size: int, steps_per_iteration: int, args_problem) -> tuple[str, dict | None]:
    """The run folder restarted ranks must find again ('' if none) and its checkpoint to resume, checked up front (its
    args by `args_problem`, the script's check of flags)."""
    name = args.run_name
    if not name and (args.resume or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # `none` under static rendezvous
        if run_id in ("", "none"):
            flag = "--resume" if args.resume else "torchrun --max-restarts"
            fail(f"{flag} needs a run folder that every (re)started rank finds again: pass --run-name NAME")
        name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{run_id}"
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    path = find_latest_checkpoint(name) if name else None
    if args.resume and path is None and not restarted:
        fail(f"--resume found no checkpoint in runs/{name}/checkpoints; check --run-name, or drop --resume")
    if name and not (args.resume or restarted) and os.path.lexists(os.path.join("runs", name)):
        fail(f"runs/{name} already exists: pass --resume to continue it, or choose another --run-name")
    if path is None:
        return name, None
    fix = "delete it to resume from the one before"
    progress = {"iteration": int, "global_step": int, "world_size": int, "restarts": int, "rng": list}
    checkpoint = read_checkpoint(path, fix, args.env_id, **progress)
    if checkpoint["env_id"] != args.env_id:
        fail(f"{path} trains {checkpoint['env_id']}, not --env-id {args.env_id}; pass that --env-id")
    if checkpoint["world_size"] != world_size:
        fail(f"{path} was written by {checkpoint['world_size']} ranks, not {world_size}; resume with as many")
    if problem := args_problem(saved_args(checkpoint, type(args), path)):
        fail(f"{path} holds args that no command line gives ({problem}): it is damaged; {fix}")
    iteration = checkpoint["iteration"]
    global_step = checkpoint["global_step"]
    restarts = checkpoint["restarts"]
    if not (1 <= iteration <= global_step <= iteration * steps_per_iteration and restarts >= 0):
        fail(
            f"{path} says {global_step} env steps in {iteration} iterations after {restarts} restarts, which no run of "
            f"{steps_per_iteration} steps per iteration reaches: it is damaged, or was trained with other sizes; {fix}"
        )
    return name, checkpoint


def load_checkpoint(checkpoint: dict, path: str, rank: int, states: dict) -> None:
    """Load the checkpoint to resume into `states` and this rank's random streams, each checked before it loads."""
    load_weights(states["model"], checkpoint["model"], path)
    try:
        for entry, state in states.items():
            if entry == "model":
                continue
            if problem := optimizer_state_problem(state, checkpoint.get(entry)):
                fail(
                    f"{path}: its {entry!r} does not fit this run's {type(state).__name__} ({problem}): resume "
                    "with the optimizer that wrote it, or start a new run"
                )
            state.load_state_dict(checkpoint[entry])
        entry = "rng"  # this rank's random streams, where the checkpoint left them
        rng = checkpoint["rng"][rank]
        random.setstate(rng["python"])
        name, keys, *rest = rng["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    except (LookupError, TypeError, ValueError, OverflowError, RuntimeError) as error:
        reason = (str(error) or type(error).__name__).splitlines()[0]
        fail(f"{path}: its {entry!r} does not fit this run ({reason}); delete it to resume from the one before")


def resume(run: Run, **states) -> tuple[int, int]:
    """The last step before training: load the checkpoint start_run found into `states` (the Agent as `model`, the
    optimizers by name; every rank's random streams too), each checked first; then make the run folder, open rank 0's
    TensorBoard, and from here on let SIGTERM set run.sigterm_received. Returns the iteration and env step reached."""
    checkpoint = run.checkpoint
    if checkpoint:
        load_checkpoint(checkpoint, checkpoint_path(run.name, run.resumed_iteration), run.rank, states)
    run.name = run_folders.create_run_folder(run.args, run.name, checkpoint is not None, run.rank, run.device)
    if run.rank == 0:
        if checkpoint:
            print(f"resuming from {checkpoint_path(run.name, run.resumed_iteration)}", flush=True)
        resumed_step = checkpoint["global_step"] if checkpoint else None
        run.writer, run.wandb_run = run_folders.open_tensorboard(run.args, run.name, resumed_step)
    signal.signal(signal.SIGTERM, lambda signum, frame: setattr(run, "sigterm_received", True))
    run.start_step = checkpoint["global_step"] if checkpoint else 0
    run.train_start = time.time()
    run.load_since = machine.load_sample()
    return run.resumed_iteration, run.start_step


def save(run: Run, iteration: int, global_step: int, **states) -> None:
    """Every rank's random streams to rank 0, which writes `states` (the names resume() loads them by) to the run's
    checkpoint of `iteration`; a write that fails stops every rank in one line naming the last good checkpoint."""
    name, keys, *rest = np.random.get_state()  # its key array as a list: a checkpoint holds no numpy object
    rng = {"python": random.getstate(), "numpy": [name, keys.tolist(), *rest], "torch": torch.get_rng_state()}
    rng |= {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}
    rngs = [None] * run.world_size if run.rank == 0 else None
    dist.gather_object(rng, rngs, dst=0)
    path = checkpoint_path(run.name, iteration)
    problem = ""
    if run.rank == 0:
        weights = {entry: state.state_dict() for entry, state in states.items()}
        progress = {"world_size": run.world_size, "iteration": iteration, "global_step": global_step}
        try:
            write_checkpoint(path, run.args, **weights, rng=rngs, **progress, restarts=run.restarts)
            run.writer.flush()  # the curves on disk reach the checkpoint, whatever happens next
            print(f"checkpoint saved to {path}", flush=True)
        except (OSError, RuntimeError) as error:  # a full disk, a folder made unwritable
            problem = f"could not write {path} ({str(error).splitlines()[0]})"
    stop_if_unwritten(run, path, problem, "free disk space or make the folder writable, then --resume")


def stop_if_unwritten(run: Run, path: str, problem: str, fix: str) -> None:
    """Stop every rank, in one line naming the last good checkpoint, if rank 0 could not write `path` (`problem`).
    Rank 0's outcome reaches the others through the store, not a gather: a gather left as the group's last work
    can deadlock its teardown (gloo's thread frees it needing the GIL the destroying thread holds)."""
    if run.world_size > 1:
        if run.rank == 0:
            run.store.set(f"written/{path}", problem)
        problem = run.store.get(f"written/{path}").decode()
    if problem:
        fail(f"{problem}: {last_good_checkpoint(run.name)}; {fix} --run-name {run.name}")
