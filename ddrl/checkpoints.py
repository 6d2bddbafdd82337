"""Checkpoints: a training checkpoint per iteration (runs/NAME/checkpoints/iter_N.safetensors) and the model file
(runs/NAME/model.safetensors), each one safetensors file: tensors, and a JSON header saying what wrote them, so
nothing in a file can run code, and every tensor's dtype, shape and bytes are declared before any is read. Rank 0
writes them atomically. Reading one is checking it like a command line: its args by the script's own rules, every
tensor's name, shape and dtype against the Agent and optimizers this run built, before any of it loads; every misfit
is one line that names the file and the fix."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import stat
import sys
import time
import types
import typing
from dataclasses import asdict
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ddrl import checks, failures, machine, run_folders, stopping
from ddrl.failures import fail, shown

if TYPE_CHECKING:
    from ddrl.launching import Run

FORMAT = "ddrl"  # the header's one metadata entry, a JSON object; its "format" is this too
VERSION = 1
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound: a file claiming a longer header is refused, unread
IMPLEMENTATION_OPTIONS = {"foreach", "fused", "capturable", "differentiable"}  # how an optimizer runs, not what
NUMPY_RANDOM_STATE = ("MT19937", 624)  # numpy's legacy generator: its name, the length of its key


# --- where checkpoints live ---------------------------------------------------------------------------------------
def checkpoint_path(run_name: str, iteration: int) -> str:
    return os.path.join("runs", run_name, "checkpoints", f"iter_{iteration:06d}{SUFFIX}")


def model_path(run_name: str) -> str:
    return os.path.join("runs", run_name, f"model{SUFFIX}")


def find_latest_checkpoint(run_name: str) -> str | None:
    """The run's checkpoint of the highest iteration (an earlier version's iter_N.pt too, which reading refuses with
    the reason), or None."""
    folder = os.path.join("runs", run_name, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    found = {int(match[1]): name for name in names if (match := re.fullmatch(r"iter_(\d+)\.(pt|safetensors)", name))}
    return os.path.join(folder, found[max(found)]) if found else None


def last_good_checkpoint(run_name: str) -> str:
    """What a message that stops training says of the run's checkpoints: the newest one, or that there is none."""
    last = find_latest_checkpoint(run_name)
    return f"the last good checkpoint is {last}" if last else "no checkpoint was written"


# --- writing --------------------------------------------------------------------------------------------------------
def write(path: str, tensors: dict[str, torch.Tensor], header: dict) -> None:
    """`tensors` and the JSON `header` as one safetensors file at `path`, atomically: a kill at any moment leaves the
    old file, and a failed write (OSError, or safetensors' own error) leaves no part behind."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    on_host = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    try:
        save_file(on_host, path + ".tmp", metadata={FORMAT: json.dumps(header)})
        os.replace(path + ".tmp", path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise


def header_of(args, kind: Literal["training", "model"], model: nn.Module, **fields) -> dict:
    """What a file says of itself: the format, what it holds, which script and algorithm wrote it (a copy of a script
    loads the original's file where its Agent fits, and says whose it is), the env, the args, and `fields`."""
    writer = sys.modules.get(type(model).__module__)
    algorithm = ((writer.__doc__ or "").strip().splitlines() or [""])[0] if writer else ""
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "script": failures.script,
        "algorithm": algorithm,
        "env_id": args.env_id,
        "args": asdict(args),
        **fields,
    }


def write_model(path: str, args, model: nn.Module) -> None:
    """The model file of --save-model: the Agent's weights and buffers, and what wrote them."""
    tensors = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    write(path, tensors, header_of(args, "model", model))


def optimizer_entries(name: str, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's per-parameter state as tensors named NAME.state.INDEX.KEY (INDEX: the parameter's place across
    the groups, as torch's state_dict numbers them), and what the header says of it: its type, its options, and the
    per-parameter numbers that are no tensors."""
    state = optimizer.state_dict()
    tensors = {}
    numbers = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{name}.state.{index}.{key}"] = value
            else:
                numbers[f"{index}.{key}"] = value
    groups = [{key: value for key, value in group.items() if key != "params"} for group in state["param_groups"]]
    return tensors, {"type": type(optimizer).__name__, "param_groups": json_safe(groups), "numbers": numbers}


def json_safe(value):
    """`value` with its tuples as lists and anything JSON cannot hold as its repr."""
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def save(run: Run, iteration: int, global_step: int, **states) -> None:
    """Every rank's random streams to rank 0 (through the process group's store), which writes `states` (the Agent as
    `model`, the optimizers by the names resume() loads them by) to the run's checkpoint of `iteration`; a write that
    fails stops every rank in one line naming the last good checkpoint."""
    key = f"rng/{iteration}/{run.rank}"
    streams = random_streams()
    run.store.set(key, json.dumps(streams["json"]))
    run.store.set(f"{key}/torch", streams["torch"].numpy().tobytes())
    path = checkpoint_path(run.name, iteration)
    problem = ""
    if run.rank == 0:
        tensors = {f"model.{name}": tensor for name, tensor in states["model"].state_dict().items()}
        optimizers = {}
        for name, optimizer in states.items():
            if name != "model":
                entries, optimizers[name] = optimizer_entries(name, optimizer)
                tensors |= entries
        rngs = []
        for rank in range(run.world_size):
            rngs.append(json.loads(run.store.get(f"rng/{iteration}/{rank}")))
            state = bytearray(run.store.get(f"rng/{iteration}/{rank}/torch"))
            tensors[f"rng.{rank}.torch"] = torch.frombuffer(state, dtype=torch.uint8).clone()
            run.store.delete_key(f"rng/{iteration}/{rank}")
            run.store.delete_key(f"rng/{iteration}/{rank}/torch")
        progress = {"world_size": run.world_size, "iteration": iteration, "global_step": global_step}
        header = header_of(run.args, "training", states["model"], **progress, restarts=run.restarts)
        header |= {"optimizers": optimizers, "rng": rngs}
        try:
            write(path, tensors, header)
            run.writer.flush()  # the curves on disk reach the checkpoint, whatever happens next
            failures.tell(f"checkpoint saved to {path}")
        except (OSError, RuntimeError, SafetensorError) as error:  # a full disk, a folder made unwritable
            problem = f"could not write {path} ({str(error).splitlines()[0]})"
    stop_if_unwritten(run, path, problem, "free disk space or make the folder writable, then --resume")


def random_streams() -> dict:
    """This process's random streams: Python's and numpy's as JSON, torch's CPU generator as a tensor (CUDA's kept
    with it where CUDA is in use)."""
    version, python_state, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state()
    found = {
        "python": [version, list(python_state), gauss],
        "numpy": [name, keys.tolist(), position, has_gauss, cached],
    }
    if torch.cuda.is_initialized():
        found["cuda"] = [state.tolist() for state in torch.cuda.get_rng_state_all()]
    return {"json": found, "torch": torch.get_rng_state()}


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


# --- reading: the file, then its header, each refused in one line ------------------------------------------------
def read(path: str, fix: str) -> tuple[dict, dict[str, tuple[tuple[int, ...], str]]]:
    """The header of the checkpoint or model file at `path` and its tensors' (shape, dtype) by name, read without
    loading any tensor: only a regular file, whose first 8 bytes declare a header within MAX_HEADER_BYTES and within
    the file, which safetensors then checks (every tensor's bytes inside the file, none overlapping). Anything else
    is one line naming the file, what it is and `fix`."""
    if problem := file_problem(path):
        fail(f"{path} {problem}; {fix}")
    try:
        with safe_open(path, framework="pt") as opened:
            metadata = opened.metadata() or {}
            tensors = {}
            for name in opened.keys():
                declared = opened.get_slice(name)
                tensors[name] = (tuple(declared.get_shape()), declared.get_dtype())
    except (SafetensorError, OSError) as error:
        fail(f"{path} is truncated or no safetensors file ({str(error).splitlines()[0]}); {fix}")
    try:
        header = json.loads(metadata[FORMAT])
    except (KeyError, TypeError, ValueError):
        fail(f"{path} is a safetensors file without ddrl's header: it is no checkpoint of a ddrl script; {fix}")
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        version = header.get("version") if isinstance(header, dict) else None
        fail(
            f"{path} holds a header of ddrl's format version {shown(version)}, not {VERSION}: "
            "use the ddrl that wrote it"
        )
    for key, kind in {"kind": str, "script": str, "algorithm": str, "env_id": str, "args": dict}.items():
        if not isinstance(header.get(key), kind):
            found = type(header[key]).__name__ if key in header else "nothing"
            fail(f"{path} holds {found} as its {key!r}, where ddrl writes a {kind.__name__}: it is damaged; {fix}")
    return header, tensors


def file_problem(path: str) -> str | None:
    """What makes `path` no safetensors file, found from its type and first 8 bytes at most: not a regular file (a
    folder, a device, a named pipe), too short, a header longer than the bound or the file, an earlier version's
    torch.save zip archive, a pickle. None if safetensors may open it."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            return "is a folder"
        if not stat.S_ISREG(mode):
            kinds = {stat.S_ISCHR: "character device", stat.S_ISBLK: "block device", stat.S_ISFIFO: "named pipe"}
            kind = next((name for test, name in kinds.items() if test(mode)), "socket")
            return f"is a {kind}, not a file: refused, unread"
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            first = file.read(8)
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    declared = int.from_bytes(first, "little")
    fits = len(first) == 8 and declared <= MAX_HEADER_BYTES and 8 + declared <= size
    if first.startswith(b"PK\x03\x04") and not fits:
        return (
            "is a zip archive, as torch.save wrote an earlier version's checkpoints (.pt), which this version does not "
            "read (they need pickle, which can run code): resume or evaluate it with the version that wrote it"
        )
    if first[:1] == b"\x80" and not fits:  # a header's length may begin with 0x80 too: 384, 640, ... bytes
        return "is a pickle, which can run code: refused, unread"
    if len(first) < 8:
        return f"is {size} bytes long, too short for a safetensors header: it is truncated or no checkpoint"
    if not fits:
        bound = (
            f"more than the {MAX_HEADER_BYTES:,} bytes ddrl reads"
            if declared > MAX_HEADER_BYTES
            else "more than it holds"
        )
        return f"declares a header of {declared:,} bytes, {bound}: it is truncated or no checkpoint; refused, unread"
    return None


def saved_args(header: dict, args_type: type, path: str):
    """A file's args as `args_type` (the script's Args): each entry of the type its field declares, or one error
    (entries it lacks take their defaults; others are ignored). The caller checks their values as it checks flags."""
    hints = typing.get_type_hints(args_type)
    saved = {name: value for name, value in header["args"].items() if name in hints}
    for name, value in saved.items():
        if not fits_type(value, hints[name]):
            fail(f"{path} holds {shown(value)} as its args' {name}, which is no {hints[name]}: it is damaged")
        if typing.get_origin(hints[name]) is tuple:
            saved[name] = tuple(value)
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


def refuse_imported_env(path: str, header: dict, env_id: str) -> None:
    """An env id of the `module:EnvId` form makes gymnasium import `module`, running its code: from a file, only if
    the user passed that same --env-id."""
    saved_env_id = header["env_id"]
    if ":" in saved_env_id and saved_env_id != env_id:
        fail(
            f"{path} names its env {shown(saved_env_id)}, whose module gymnasium would import, running its code: "
            f"refused; if you trust that module, pass --env-id {saved_env_id} yourself"
        )


def read_model(path: str, args_type: type, args_problem, env_id: str) -> tuple[dict, object]:
    """--eval-checkpoint's file (a model file, or a training checkpoint: both hold the Agent), checked like a
    command line: the file, its env id, then its args by `args_problem` (the script's check of its flags). Returns its
    header and its args as `args_type`."""
    if not os.path.lexists(path):
        fail(f"--eval-checkpoint {shown(path)} does not exist; pass the model{SUFFIX} that --save-model wrote")
    header, _ = read(path, f"pass the model{SUFFIX} that --save-model wrote")
    refuse_imported_env(path, header, env_id)
    if env_id not in (args_type().env_id, header["env_id"]):  # --env-id given, and another than the file's
        fail(
            f"--env-id {shown(env_id)} is not the env of {path} ({shown(header['env_id'])}), which it plays: "
            "drop --env-id"
        )
    saved = saved_args(header, args_type, path)
    if problem := args_problem(saved):
        fail(f"{path} holds args that no command line gives ({problem}): it is damaged")
    return header, saved


def writer_of(header: dict) -> str:
    """`SCRIPT (ALGORITHM)`: who wrote a file, as the messages name it."""
    return f"{header['script']} ({header['algorithm'].rstrip('.')})" if header["algorithm"] else header["script"]


# --- loading: every tensor compared with what this run built, then loaded --------------------------------------------
def load_weights(model: nn.Module, path: str, header: dict) -> None:
    """Load the file's `model.*` tensors into `model` once each fits it by name, shape and dtype and is finite, or
    stop in one line naming the file, who wrote it and the first misfits. A file another script wrote loads where
    its Agent fits, saying so in one line (rank 0)."""
    found = read(path, "")[1]
    wanted = {f"model.{name}": (tuple(tensor.shape), tensor.dtype) for name, tensor in model.state_dict().items()}
    if faults := misfits(found, wanted, "model."):
        fail(
            f"{path}, written by {writer_of(header)}: its weights do not fit this {type(model).__name__} "
            f"({faults}): undo the Agent's edit, or use the script that wrote it"
        )
    weights = load_tensors(path, list(wanted))
    if nonfinite := [
        name for name, value in weights.items() if value.is_floating_point() and not value.isfinite().all()
    ]:
        fail(f"{path}: its weights {', '.join(nonfinite[:3])} are not finite; use a checkpoint from before")
    try:
        model.load_state_dict({name.removeprefix("model."): value for name, value in weights.items()})
    except (RuntimeError, ValueError) as error:  # a module's own check of what it loads
        fail(f"{path}: {str(error).splitlines()[0]}; use a checkpoint from before")
    if header["script"] != failures.script and failures.this_rank() == 0:
        failures.tell(f"{path} was written by {writer_of(header)}; its weights fit this {failures.script}")


def misfits(found: dict[str, tuple], wanted: dict[str, tuple], prefix: str) -> str:
    """The first few differences between the file's tensors named `prefix`... and the ones `wanted` (name: (shape,
    torch dtype)), as a message lists them; '' if none."""
    faults = []
    for name, (shape, dtype) in wanted.items():
        if name not in found:
            faults.append(f"{name.removeprefix(prefix)} missing")
        elif found[name][0] != shape:
            faults.append(f"{name.removeprefix(prefix)} {found[name][0]}, not {shape}")
        elif found[name][1] != safetensors_dtype(dtype):
            faults.append(f"{name.removeprefix(prefix)} {found[name][1]}, not {safetensors_dtype(dtype)}")
    faults += [
        f"{name.removeprefix(prefix)} unknown" for name in found if name.startswith(prefix) and name not in wanted
    ]
    return ", ".join(faults[:3]) + (", ..." if len(faults) > 3 else "")


def safetensors_dtype(dtype: torch.dtype) -> str:
    """torch's dtype as safetensors names it (F32, F64, I64, U8, BOOL, ...)."""
    names = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16"}
    names |= {torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8"}
    return names.get(dtype, "BOOL" if dtype == torch.bool else str(dtype))


def load_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of the file at `path` (checked before: they exist, with the shapes and dtypes wanted)."""
    with safe_open(path, framework="pt") as opened:
        return {name: opened.get_tensor(name) for name in names}


def expected_optimizer_state(optimizer: torch.optim.Optimizer, name: str) -> dict[str, tuple]:
    """What this optimizer keeps per parameter, as NAME.state.INDEX.KEY: (shape, dtype): found by one step of a copy
    of it, with the same options, on zero gradients of parameters shaped like its own."""
    groups = []
    for group in optimizer.param_groups:
        options = {key: value for key, value in group.items() if key != "params"}
        parameters = [torch.zeros_like(p, requires_grad=True) for p in group["params"]]
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)
        groups.append({**options, "params": parameters})
    probe = type(optimizer)(groups)
    probe.step()
    return {
        f"{name}.state.{index}.{key}": (tuple(value.shape), value.dtype)
        for index, entries in probe.state_dict()["state"].items()
        for key, value in entries.items()
        if torch.is_tensor(value)
    }


def resume(run: Run, **states) -> tuple[int, int]:
    """The last step before training: load the checkpoint start_run found into `states` (the Agent as `model`, the
    optimizers by name; this rank's random streams too), each compared with what this run built before any of it
    loads; then make and lock the run folder, open rank 0's TensorBoard, and from here on let SIGTERM and Ctrl-C ask
    every rank to stop after the iteration (run.stop_requested). Returns the iteration and env step reached."""
    header = run.checkpoint
    if header:
        load_training_state(header["path"], header, run.rank, states)
    run_folders.create_run_folder(run, resumed=header is not None or checks.restart_count() > 0)
    if run.rank == 0:
        if header:
            failures.tell(f"resuming from {header['path']}")
        resumed_step = header["global_step"] if header else None
        run.writer, run.wandb_run = run_folders.open_tensorboard(run.args, run.name, resumed_step)
    stopping.arm(run)
    run.start_step = header["global_step"] if header else 0
    run.train_start = time.time()
    run.load_since = machine.load_sample()
    return run.resumed_iteration, run.start_step


def load_training_state(path: str, header: dict, rank: int, states: dict) -> None:
    """The training checkpoint's optimizer states, per-parameter only (the options stay the command line's, and
    those that differ from the checkpoint's are named in one line), then the weights, then this rank's random
    streams; each compared with what this run built before anything loads."""
    found = read(path, "delete it to resume from the one before")[1]
    optimizers = header.get("optimizers")
    if not isinstance(optimizers, dict):
        fail(f"{path} holds no optimizer states: it is damaged; delete it to resume from the one before")
    loads = {}
    for name, optimizer in states.items():
        if name == "model":
            continue
        wanted = expected_optimizer_state(optimizer, name)
        saved = optimizers.get(name)
        saved_type = saved.get("type") if isinstance(saved, dict) else None
        if saved_type is None or (faults := misfits(found, wanted, f"{name}.state.")):
            fault = "no state of it" if saved_type is None else f"{saved_type}'s state ({faults})"
            fail(
                f"{path}, written by {writer_of(header)}: its {name!r} holds {fault}, which does not fit this run's "
                f"{type(optimizer).__name__}: resume with the optimizer that wrote it, or start a new run"
            )
        loads[name] = (optimizer, wanted, saved)
    load_weights(states["model"], path, header)
    for name, (optimizer, wanted, saved) in loads.items():
        tensors = load_tensors(path, list(wanted))
        per_parameter = {}
        for key, value in tensors.items():
            index, entry = key.removeprefix(f"{name}.state.").split(".", 1)
            per_parameter.setdefault(int(index), {})[entry] = value
        current = optimizer.state_dict()
        optimizer.load_state_dict({"state": per_parameter, "param_groups": current["param_groups"]})
        say_changed_options(path, name, optimizer, saved)
    load_random_streams(path, header, rank)


def say_changed_options(path: str, name: str, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Rank 0: one line naming the options of `optimizer` (the command line's) that differ from the checkpoint's."""
    groups = saved.get("param_groups")
    if failures.this_rank() != 0 or not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return
    changes = []
    for before, group in zip(groups, optimizer.param_groups, strict=True):
        now = json_safe({key: value for key, value in group.items() if key != "params"})
        keys = sorted((now.keys() | before.keys()) - IMPLEMENTATION_OPTIONS - {"lr"})  # lr: main's schedule sets it
        changes += [f"{key} {before.get(key)} -> {now.get(key)}" for key in keys if now.get(key) != before.get(key)]
    if changes or saved.get("type") != type(optimizer).__name__:
        names = f"{saved.get('type')} -> {type(optimizer).__name__}"
        failures.tell(
            f"{path}: its {name!r} state loads into this run's {names}, with the command line's {', '.join(changes)}"
        )


def load_random_streams(path: str, header: dict, rank: int) -> None:
    """This rank's random streams where the checkpoint left them, or one line saying what does not fit."""
    try:
        streams = header["rng"][rank]
        version, python_state, gauss = streams["python"]
        random.setstate((version, tuple(python_state), gauss))
        name, keys, position, has_gauss, cached = streams["numpy"]
        if (name, len(keys)) != NUMPY_RANDOM_STATE:
            raise ValueError(f"numpy's generator {shown(name)} with a key of {len(keys)}")
        np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
        torch.set_rng_state(load_tensors(path, [f"rng.{rank}.torch"])[f"rng.{rank}.torch"])
        if "cuda" in streams and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(state, dtype=torch.uint8) for state in streams["cuda"]])
    except (LookupError, TypeError, ValueError, OverflowError, RuntimeError, SafetensorError) as error:
        reason = (str(error) or type(error).__name__).splitlines()[0]
        fail(
            f"{path}: its random streams of rank {rank} do not fit this run ({reason}); "
            "delete it to resume from the one before"
        )


# --- finding the run to resume -------------------------------------------------------------------------------------
def find_run_to_resume(args, world_size: int, steps_per_iteration: int, args_problem) -> tuple[str, dict | None]:
    """The run folder restarted ranks must find again ('' if none) and the header of its checkpoint to resume (its
    path under "path"), checked up front: the file, its env, its world, its args by `args_problem` (the script's check
    of flags), its progress. A restart count (torchrun's) resumes a run of this launch, never a finished one."""
    name = args.run_name
    # torchrun's id of this launch, `none` under static rendezvous: a restart finds the run folder again by it
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    in_launch = run_id not in ("", "none")
    if not name and (args.resume or checks.max_restarts() > 0):
        if not in_launch:
            flag = "--resume" if args.resume else "torchrun --max-restarts"
            fail(f"{flag} needs a run folder that every (re)started rank finds again: pass --run-name NAME")
        name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{run_id}"
        if not run_folders.is_one_folder(name):
            fail(
                f"the launcher's variable TORCHELASTIC_RUN_ID={shown(run_id)} makes no folder name below runs/: "
                "unset it, or pass --run-name NAME",
                any_rank=True,
            )
    restart_count = checks.restart_count()
    restarted = restart_count > 0
    path = find_latest_checkpoint(name) if name else None
    exists = bool(name) and os.path.lexists(os.path.join("runs", name))
    if args.resume and path is None and not restarted:
        fail(f"--resume found no checkpoint in runs/{name}/checkpoints; check --run-name, or drop --resume")
    if exists and not (args.resume or restarted):
        fail(f"runs/{name} already exists: pass --resume to continue it, or choose another --run-name")
    if exists and restarted and not args.resume:
        record = run_folders.lock_record(name)
        same_launch = in_launch and record.get("launch") == run_id
        if record.get("finished") or not same_launch:
            fail(
                f"runs/{name} already exists, and TORCHELASTIC_RESTART_COUNT={restart_count} is no restart of the "
                "launch that made it (finished, or another torchrun's): pass --resume to continue it, or choose "
                "another --run-name"
            )
    if path is None:
        return name, None
    fix = "delete it to resume from the one before"
    header, _ = read(path, fix)
    if header["kind"] != "training":
        fail(f"{path} is a {header['kind']} file, not a training checkpoint: it is damaged; {fix}")
    for key in ("iteration", "global_step", "world_size", "restarts"):
        if not isinstance(header.get(key), int) or isinstance(header.get(key), bool):
            found = type(header[key]).__name__ if key in header else "nothing"
            fail(f"{path} holds {found} as its {key!r}, where ddrl writes an int: it is damaged; {fix}")
    if not isinstance(header.get("rng"), list):
        fail(f"{path} holds no random streams: it is damaged; {fix}")
    refuse_imported_env(path, header, args.env_id)
    if header["env_id"] != args.env_id:
        fail(f"{path} trains {shown(header['env_id'])}, not --env-id {args.env_id}; pass that --env-id")
    if header["world_size"] != world_size:
        fail(f"{path} was written by {header['world_size']} ranks, not {world_size}; resume with as many")
    if problem := args_problem(saved_args(header, type(args), path)):
        fail(f"{path} holds args that no command line gives ({problem}): it is damaged; {fix}")
    iteration = header["iteration"]
    global_step = header["global_step"]
    restarts = header["restarts"]
    if not (1 <= iteration <= global_step <= iteration * steps_per_iteration and restarts >= 0):
        fail(
            f"{path} says {global_step} env steps in {iteration} iterations after {restarts} restarts, which no run of "
            f"{steps_per_iteration} steps per iteration reaches: it is damaged, or was trained with other sizes; {fix}"
        )
    return name, {**header, "path": path}
