"""Checkpoints: a training checkpoint per iteration (runs/NAME/checkpoints/iter_N.safetensors) and
the model file (runs/NAME/model.safetensors), each one safetensors file: tensors (the Agent's state,
each optimizer's per-parameter state, every rank's random streams) and a small JSON header saying
what wrote them, so nothing in a file can run code, and every tensor's dtype, shape and bytes are
declared before any is read. Rank 0 writes them atomically and never through a link. Reading one is
checking it like a command line: the header within the bounds of what ddrl writes, its args by the
script's own rules, every tensor's name, shape and dtype against the Agent and optimizers this run
built, every number finite, before any of it loads; every misfit is one line that names the file and
the fix, with any text the file holds shown escaped."""

from __future__ import annotations

import json
import os
import random
import re
import stat
import sys
import tempfile
from dataclasses import asdict
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from ddrl import checks, failures, flags, run_folders
from ddrl.failures import fail, first_line, shown

if TYPE_CHECKING:
    from ddrl.run import Run

FORMAT = "ddrl"  # the header's one metadata entry, a JSON object; its "format" is this too
VERSION = 2
SUFFIX = ".safetensors"
# safetensors' own header (the tensors' table and ours): ddrl's files hold a few hundred tensors, a
# few KB of table; a
# network of ten thousand parameters' tensors would take about 3 MB. A file declaring more is
# refused, unread.
MAX_HEADER_BYTES = 16 * 2**20
MAX_METADATA_CHARS = 2**20  # ddrl's JSON in it: args and optimizer options, a few KB at most
# how deep ddrl's JSON nests: header, optimizers, one optimizer, its groups, a group, a tuple
MAX_DEPTH = 8
# env steps and iterations a run can reach (float64 counts them exactly up to here)
MAX_STEPS = 2**53
MAX_RESTARTS = 10**6  # the attempts a file counts: a run resumed more often writes this bound again
# the scripts' seeds: rank r seeds its generators with seed + SEED_STRIDE * r, env g (counted over
# every attempt of the run) with seed + SEED_STRIDE * g; every env library takes a seed below
# SEED_LIMIT (ale-py's are int32), so a run's envs are at most MAX_ENVS_SEEDED, over all attempts
SEED_STRIDE = 10_000
SEED_LIMIT = 2**31
MAX_ENVS_SEEDED = (SEED_LIMIT - 1) // SEED_STRIDE + 1
# how an optimizer runs, not what
IMPLEMENTATION_OPTIONS = {"foreach", "fused", "capturable", "differentiable"}
RANDOM_STREAMS = {  # the tensors of every rank's random streams: name, dtype, shape after the ranks
    "rng.python": (torch.int64, (625,)),  # Python's Mersenne Twister: its 624 words and position
    "rng.python_gauss": (torch.float64, ()),  # its cached gaussian, NaN where none
    "rng.numpy": (torch.int64, (624,)),  # numpy's legacy generator: its key
    # its position, whether a gaussian is cached, that gaussian
    "rng.numpy_state": (torch.float64, (3,)),
}
MT_WORDS = 624  # a Mersenne Twister's key, 32-bit words; its position lies in [0, 624]
# a gaussian a generator caches is below 12.1 in size (numpy's polar method on 53-bit uniforms;
# Python's and torch's Box-Muller: 8.6): one beyond this no draw gave
MAX_GAUSSIAN = 16.0
# torch's CPU generator state (at::CPUGeneratorImplState, as torch.get_rng_state() returns it): by
# byte offset, its `left` and `seeded` (int32), `next`, the key (624 uint64 words), the cached
# normal (a double) and whether it is valid (int32), the cached float normal and whether it is valid
TORCH_STATE_BYTES = 5056
TORCH_FIELDS = {
    "left": (8, "<i4"),
    "seeded": (12, "<i4"),
    "next": (16, "<u8"),
    "normal": (5024, "<f8"),
    "normal_valid": (5040, "<i4"),
    "float_normal": (5048, "<f4"),
    "float_valid": (5052, "u1"),
}
TORCH_KEY_OFFSET = 24
STREAM_ROWS = 256  # ranks' streams checked at once: memory bounded, whatever world a file claims


# --- where checkpoints live -----------------------------------------------------------------------
def checkpoint_path(run_name: str, iteration: int) -> str:
    return os.path.join("runs", run_name, "checkpoints", f"iter_{iteration:06d}{SUFFIX}")


def model_path(run_name: str) -> str:
    return os.path.join("runs", run_name, run_folders.MODEL_FILE)


def find_latest_checkpoint(run_name: str) -> str | None:
    """The run's checkpoint of the highest iteration (an earlier version's iter_N.pt too, which
    reading refuses with the reason), or None."""
    folder = os.path.join("runs", run_name, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) and not os.path.islink(folder) else []
    found = {
        int(match[1]): name
        for name in names
        if (match := re.fullmatch(r"iter_(\d+)\.(pt|safetensors)", name))
    }
    return os.path.join(folder, found[max(found)]) if found else None


def last_good_checkpoint(run_name: str) -> str:
    """What a message that stops training says of the run's checkpoints: the newest one, or that
    there is none."""
    last = find_latest_checkpoint(run_name)
    return f"the last good checkpoint is {last}" if last else "no checkpoint was written"


# --- writing --------------------------------------------------------------------------------------
def write(path: str, tensors: dict[str, torch.Tensor], header: dict) -> str:
    """`tensors` and the JSON `header` as one safetensors file at `path`, atomically and never
    through a link: the bytes go to a new file made exclusively beside it, which then takes `path`'s
    place (a link there is replaced, not followed). A kill at any moment leaves the old file; a
    failed write leaves no part behind. Returns '' once written, else why not, in words that name
    the fix: the caller stops every rank with it, as only this rank knows."""
    folder = os.path.dirname(path) or "."
    if problem := run_folders.folder_problem(folder, make=True):
        return f"could not write {path}: {problem}"
    temporary = ""
    try:
        on_host = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
        data = save_bytes(on_host, metadata={FORMAT: json.dumps(header)})
        descriptor, temporary = tempfile.mkstemp(
            dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
        )
        os.fchmod(descriptor, 0o644)  # readable as a file open() makes, not mkstemp's owner-only
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
        temporary = ""
    # a full disk, a folder made unwritable, a folder where the file goes
    except (OSError, RuntimeError, SafetensorError) as error:
        return (
            f"could not write {path} ({first_line(error)}): free disk space or make the folder "
            "writable"
        )
    finally:
        if temporary and os.path.lexists(temporary):
            os.remove(temporary)
    return ""


def header_of(args, kind: Literal["training", "model"], model: nn.Module, **fields) -> dict:
    """What a file says of itself: the format, what it holds, which script and algorithm wrote it (a
    copy of a script loads the original's file where its Agent fits, and says whose it is), the env,
    the args, and `fields`."""
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


def write_model(path: str, args, model: nn.Module) -> str:
    """The model file of --save-model: the Agent's weights and buffers, and what wrote them. Returns
    '' once written, else why not (write)."""
    tensors = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    return write(path, tensors, header_of(args, "model", model))


def optimizer_entries(
    name: str, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's per-parameter state as tensors named NAME.state.INDEX.KEY (INDEX: the
    parameter's place across the groups, as torch's state_dict numbers them), and what the header
    says of it: its type, its options, and the per-parameter numbers that are no tensors."""
    state = optimizer.state_dict()
    tensors = {}
    numbers = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{name}.state.{index}.{key}"] = value
            else:
                numbers[f"{index}.{key}"] = value
    groups = [
        {key: value for key, value in group.items() if key != "params"}
        for group in state["param_groups"]
    ]
    return tensors, {
        "type": type(optimizer).__name__,
        "param_groups": json_safe(groups),
        "numbers": numbers,
    }


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
    """Every rank's random streams to rank 0 (through the process group's store), which writes
    `states` (the Agent, then the optimizers by the names resume() loads them by) to the run's
    checkpoint of `iteration`; a write that fails stops every rank in one line naming the last good
    checkpoint."""
    key = f"rng/{iteration}/{run.rank}"
    run.store.set(key, save_bytes(random_streams()))
    path = checkpoint_path(run.name, iteration)
    problem = ""
    if run.rank == 0:
        model_name, model = next(iter(states.items()))
        tensors = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
        optimizers = {}
        for name, optimizer in list(states.items())[1:]:
            entries, optimizers[name] = optimizer_entries(name, optimizer)
            tensors |= entries
        streams = []
        for rank in range(run.world_size):
            streams.append(load_bytes(run.store.get(f"rng/{iteration}/{rank}")))
            run.store.delete_key(f"rng/{iteration}/{rank}")
        for name in streams[0]:
            tensors[name] = torch.stack([rank_streams[name] for rank_streams in streams])
        progress = {
            "world_size": run.world_size,
            "iteration": iteration,
            "global_step": global_step,
        }
        envs_seeded = run.first_env_index + run.world_size * run.args.local_num_envs
        header = header_of(
            run.args, "training", model, **progress, restarts=run.restarts, envs_seeded=envs_seeded
        )
        header["optimizers"] = optimizers
        problem = write(path, tensors, header)
        if not problem and run.writer is not None:
            try:
                run.writer.flush()  # the curves on disk reach the checkpoint, whatever happens next
            except OSError as error:
                problem = (
                    f"could not write TensorBoard's events in runs/{run.name} "
                    f"({first_line(error)}): free disk space or make the folder writable"
                )
        if not problem:
            failures.tell(f"checkpoint saved to {path}")
    stop_if_unwritten(run, path, problem, "then --resume")


def random_streams() -> dict[str, torch.Tensor]:
    """This process's random streams as tensors: Python's, numpy's, torch's CPU generator (CUDA's
    with it where CUDA is in use)."""
    _, python_state, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state()
    streams = {
        "rng.python": torch.tensor(python_state, dtype=torch.int64),
        "rng.python_gauss": torch.tensor(
            float("nan") if gauss is None else gauss, dtype=torch.float64
        ),
        "rng.numpy": torch.from_numpy(keys.astype(np.int64)),
        "rng.numpy_state": torch.tensor([position, has_gauss, cached], dtype=torch.float64),
        "rng.torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():
        streams["rng.cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return streams


def stop_if_unwritten(run: Run, path: str, problem: str, fix: str) -> None:
    """Stop every rank, in one line naming the last good checkpoint, if rank 0 could not write
    `path` (`problem`, which names what to do about it; `fix` says how to go on). Rank 0's outcome
    reaches the others through the store, not a gather: a gather left as the group's last work can
    deadlock its teardown (gloo's thread frees it needing the GIL the destroying thread holds)."""
    if run.world_size > 1:
        if run.rank == 0:
            run.store.set(f"written/{path}", problem)
        problem = run.store.get(f"written/{path}").decode()
    if problem:
        fail(f"{problem}; {last_good_checkpoint(run.name)}; {fix} --run-name {run.name}")


# --- reading: the file, then its header, each refused in one line ---------------------------------
def read(path: str, fix: str) -> tuple[dict, dict[str, tuple[tuple[int, ...], str]]]:
    """The header of the checkpoint or model file at `path` and its tensors' (shape, dtype) by name,
    read without loading any tensor: only a regular file, whose first 8 bytes declare a header
    within MAX_HEADER_BYTES and within the file, which safetensors then checks (every tensor's bytes
    inside the file, none overlapping); ddrl's JSON in it within MAX_METADATA_CHARS and MAX_DEPTH.
    Anything else is one line naming the file, what it is and `fix`."""
    if problem := file_problem(path):
        fail(f"{path} {problem}; {fix}")
    try:
        with safe_open(path, framework="pt") as opened:
            metadata = opened.metadata() or {}
            tensors = {}
            for name in opened.keys():
                declared = opened.get_slice(name)
                tensors[name] = (tuple(declared.get_shape()), declared.get_dtype())
    # safetensors' checks, or the OS refusing to map it (a huge sparse file)
    except Exception as error:
        fail(
            f"{path} could not be opened as a safetensors file ({type(error).__name__}: "
            f"{first_line(error)}): it is truncated, no safetensors file, or larger than this "
            f"machine can map; {fix}"
        )
    text = metadata.get(FORMAT) if isinstance(metadata, dict) else None
    if not isinstance(text, str):
        fail(
            f"{path} is a safetensors file without ddrl's header: it is no checkpoint of a ddrl "
            f"script; {fix}"
        )
    if len(text) > MAX_METADATA_CHARS:
        fail(
            f"{path} holds a header of {len(text):,} characters, more than ddrl writes "
            f"({MAX_METADATA_CHARS:,}); {fix}"
        )
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as error:
        fail(f"{path} holds a header that is no JSON ddrl writes ({type(error).__name__}); {fix}")
    if depth(header) > MAX_DEPTH:
        fail(f"{path} holds a header nested deeper than ddrl writes ({MAX_DEPTH} levels); {fix}")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = (
            f"of format {shown(header.get('format'))}"
            if isinstance(header, dict)
            else "that is no JSON object"
        )
        fail(
            f"{path} holds a header {found}, not ddrl's: it is no checkpoint of a ddrl script; "
            f"{fix}"
        )
    if header.get("version") != VERSION:
        fail(
            f"{path} holds a header of ddrl's format version {shown(header.get('version'))}, not "
            f"{VERSION}: use the ddrl that wrote it"
        )
    for key, kind in {
        "kind": str,
        "script": str,
        "algorithm": str,
        "env_id": str,
        "args": dict,
    }.items():
        if not isinstance(header.get(key), kind):
            found = type(header[key]).__name__ if key in header else "nothing"
            fail(
                f"{path} holds {found} as its {key!r}, where ddrl writes a {kind.__name__}: it is "
                f"damaged; {fix}"
            )
    return header, tensors


def depth(value) -> int:
    """How deep JSON `value` nests (a number or string: 0), found without recursion."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            pending.extend(
                (child, level + 1) for child in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


def file_problem(path: str) -> str | None:
    """What makes `path` no safetensors file, found from its type and first 8 bytes at most: not a
    regular file (a folder, a device, a named pipe), too short, a header longer than the bound or
    the file, an earlier version's torch.save zip archive, a pickle. None if safetensors may open
    it."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            return "is a folder"
        if not stat.S_ISREG(mode):
            kinds = {
                stat.S_ISCHR: "character device",
                stat.S_ISBLK: "block device",
                stat.S_ISFIFO: "named pipe",
            }
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
            "is a zip archive, as torch.save wrote an earlier version's checkpoints (.pt), which "
            "this version does not read (they need pickle, which can run code): resume or "
            "evaluate it with the version that wrote it"
        )
    # a header's length may begin with 0x80 too: 384, 640, ... bytes
    if first[:1] == b"\x80" and not fits:
        return "is a pickle, which can run code: refused, unread"
    if len(first) < 8:
        return (
            f"is {size} bytes long, too short for a safetensors header: it is truncated or no "
            "checkpoint"
        )
    if not fits:
        bound = (
            f"more than the {MAX_HEADER_BYTES:,} bytes ddrl writes"
            if declared > MAX_HEADER_BYTES
            else "more than it holds"
        )
        return (
            f"declares a header of {declared:,} bytes, {bound}: it is truncated or no checkpoint; "
            "refused, unread"
        )
    return None


def refuse_imported_env(path: str, header: dict, env_id: str) -> None:
    """An env id of the `module:EnvId` form makes gymnasium import `module`, running its code: from
    a file, only if the user passed that same --env-id."""
    saved_env_id = header["env_id"]
    if ":" in saved_env_id and saved_env_id != env_id:
        fail(
            f"{path} names its env {shown(saved_env_id)}, whose module gymnasium would import, "
            "running its code: refused; if you trust that module, pass --env-id "
            f"{shown(saved_env_id)[1:-1]} yourself"
        )


def saved_args(header: dict, args_type: type, path: str, fix: str):
    """A file's args as `args_type` (the script's Args), read by the command line's rules, or one
    line."""
    saved, problems = flags.saved_args(header["args"], args_type)
    if problems:
        fail(f"{path} holds args that no command line gives ({problems[0]}): it is damaged; {fix}")
    return saved


def read_model(path: str, args_type: type, env_id: str) -> tuple[dict, object]:
    """--eval-checkpoint's file (a model file, or a training checkpoint: both hold the Agent),
    checked like a command line: the file, its env id, then its args by the script's rules. Returns
    its header and its args."""
    fix = f"pass the {run_folders.MODEL_FILE} that --save-model wrote"
    if not os.path.lexists(path):
        fail(f"--eval-checkpoint {shown(path)} does not exist; {fix}")
    header, _ = read(path, fix)
    refuse_imported_env(path, header, env_id)
    # --env-id given, and another than the file's
    if env_id not in (args_type().env_id, header["env_id"]):
        fail(
            f"--env-id {shown(env_id)} is not the env of {path} ({shown(header['env_id'])}), "
            "which it plays: drop --env-id"
        )
    saved = saved_args(header, args_type, path, fix)
    # the env played is the args': one the check above never saw
    if saved.env_id != header["env_id"]:
        fail(
            f"{path} holds args of env {shown(saved.env_id)}, not its {shown(header['env_id'])}: "
            f"it is damaged; {fix}"
        )
    return header, saved


def writer_of(header: dict) -> str:
    """`SCRIPT (ALGORITHM)`: who wrote a file, as the messages name it (the file's text shown
    escaped)."""
    script = shown(header["script"])
    return f"{script} ({shown(header['algorithm'].rstrip('.'))})" if header["algorithm"] else script


# --- loading: every tensor compared with what this run built, then loaded -------------------------
def load_weights(model: nn.Module, path: str, header: dict) -> None:
    """Load the file's `model.*` tensors into `model` once each fits it by name, shape and dtype and
    is finite, or stop in one line naming the file, who wrote it and the first misfits. A file
    another script wrote loads where its Agent fits, saying so in one line (rank 0)."""
    found = read(path, "")[1]
    wanted = {
        f"model.{name}": (tuple(tensor.shape), tensor.dtype)
        for name, tensor in model.state_dict().items()
    }
    if faults := misfits(found, wanted, "model."):
        fail(
            f"{path}, written by {writer_of(header)}: its weights do not fit this "
            f"{type(model).__name__} ({faults}): undo the Agent's edit, or use the script that "
            "wrote it"
        )
    weights = load_tensors(path, list(wanted))
    refuse_nonfinite(path, weights, "use a checkpoint from before")
    try:
        model.load_state_dict(
            {name.removeprefix("model."): value for name, value in weights.items()}
        )
    except (RuntimeError, ValueError) as error:  # a module's own check of what it loads
        fail(f"{path}: {first_line(error)}; use a checkpoint from before")
    if header["script"] != failures.script and failures.this_rank() == 0:
        failures.tell(
            f"{path} was written by {writer_of(header)}; its weights fit this {failures.script}"
        )


def refuse_nonfinite(path: str, tensors: dict[str, torch.Tensor], fix: str) -> None:
    """Stop in one line naming the file and its first tensors that hold NaN or infinity."""
    nonfinite = [
        name
        for name, value in tensors.items()
        if value.is_floating_point() and not value.isfinite().all()
    ]
    if nonfinite:
        fail(
            f"{path}: its {', '.join(shown(name) for name in nonfinite[:3])} hold(s) NaN or "
            f"infinity; {fix}"
        )


def misfits(found: dict[str, tuple], wanted: dict[str, tuple], prefix: str) -> str:
    """The first few differences between the file's tensors named `prefix`... and the ones `wanted`
    (name: (shape, torch dtype)), as a message lists them, the file's names escaped; '' if none."""
    faults = []
    for name, (shape, dtype) in wanted.items():
        if name not in found:
            faults.append(f"{name.removeprefix(prefix)} missing")
        elif found[name][0] != shape:
            faults.append(f"{name.removeprefix(prefix)} {found[name][0]}, not {shape}")
        elif found[name][1] != safetensors_dtype(dtype):
            faults.append(
                f"{name.removeprefix(prefix)} {shown(found[name][1])}, not "
                f"{safetensors_dtype(dtype)}"
            )
    faults += [
        f"{shown(name.removeprefix(prefix))} unknown"
        for name in found
        if name.startswith(prefix) and name not in wanted
    ]
    return ", ".join(faults[:3]) + (", ..." if len(faults) > 3 else "")


def safetensors_dtype(dtype: torch.dtype) -> str:
    """torch's dtype as safetensors names it (F32, F64, I64, U8, BOOL, ...)."""
    names = {
        torch.float32: "F32",
        torch.float64: "F64",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
    }
    names |= {
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
    }
    return names.get(dtype, "BOOL" if dtype == torch.bool else str(dtype))


def load_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of the file at `path` (checked before: they exist, with the shapes and
    dtypes wanted)."""
    try:
        with safe_open(path, framework="pt") as opened:
            return {name: opened.get_tensor(name) for name in names}
    except Exception as error:  # the file changed since it was checked, or the OS refused to map it
        fail(
            f"{path} could not be read ({type(error).__name__}: {first_line(error)}); use a "
            "checkpoint from before"
        )


def expected_optimizer_state(optimizer: torch.optim.Optimizer, name: str) -> dict[str, tuple]:
    """What this optimizer keeps per parameter, as NAME.state.INDEX.KEY: (shape, dtype): found by
    one step of a copy of it, with the same options, on zero gradients of parameters shaped like its
    own."""
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


def load_training_state(path: str, header: dict, rank: int, states: dict) -> None:
    """The training checkpoint's optimizer states, per-parameter only (the options stay the command
    line's, and those that differ from the checkpoint's are named in one line), then the weights,
    then this rank's random streams; each compared with what this run built, and found finite,
    before anything loads."""
    fix = "delete it to resume from the one before"
    found = read(path, fix)[1]
    optimizers = header.get("optimizers")
    if not isinstance(optimizers, dict):
        fail(f"{path} holds no optimizer states: it is damaged; {fix}")
    model = next(iter(states.values()))
    wanted_weights = {
        f"model.{name}": (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
    }
    if faults := misfits(found, wanted_weights, "model."):
        fail(
            f"{path}, written by {writer_of(header)}: its weights do not fit this "
            f"{type(model).__name__} ({faults}): undo the Agent's edit, or resume with the script "
            "that wrote it"
        )
    loads = {}
    for name, optimizer in list(states.items())[1:]:
        wanted = expected_optimizer_state(optimizer, name)
        saved = optimizers.get(name)
        saved_type = saved.get("type") if isinstance(saved, dict) else None
        if saved_type is None or (faults := misfits(found, wanted, f"{name}.state.")):
            fault = (
                "no state of it"
                if saved_type is None
                else f"the state of a {shown(saved_type)} ({faults})"
            )
            fail(
                f"{path}, written by {writer_of(header)}: its {name!r} holds {fault}, which does "
                f"not fit this run's {type(optimizer).__name__}: resume with the optimizer that "
                "wrote it, or start a new run"
            )
        tensors = load_tensors(path, list(wanted))
        refuse_nonfinite(path, tensors, fix)
        loads[name] = (optimizer, tensors, saved)
    load_weights(model, path, header)
    for name, (optimizer, tensors, saved) in loads.items():
        per_parameter = {}
        for key, value in tensors.items():
            index, entry = key.removeprefix(f"{name}.state.").split(".", 1)
            per_parameter.setdefault(int(index), {})[entry] = value
        current = optimizer.state_dict()
        optimizer.load_state_dict({"state": per_parameter, "param_groups": current["param_groups"]})
        say_changed_options(path, name, optimizer, saved)
    load_random_streams(path, header, found, rank)


def say_changed_options(
    path: str, name: str, optimizer: torch.optim.Optimizer, saved: dict
) -> None:
    """Rank 0: one line naming the options of `optimizer` (the command line's) that differ from the
    checkpoint's."""
    groups = saved.get("param_groups")
    if (
        failures.this_rank() != 0
        or not isinstance(groups, list)
        or len(groups) != len(optimizer.param_groups)
    ):
        return
    changes = []
    for before, group in zip(groups, optimizer.param_groups, strict=True):
        if not isinstance(before, dict):
            return
        now = json_safe({key: value for key, value in group.items() if key != "params"})
        # lr: main's schedule sets it
        keys = sorted((now.keys() | before.keys()) - IMPLEMENTATION_OPTIONS - {"lr"})
        changes += [
            f"{shown(key)[1:-1]} {shown(before.get(key))} -> {now.get(key)}"
            for key in keys
            if now.get(key) != before.get(key)
        ]
    if changes or saved.get("type") != type(optimizer).__name__:
        failures.tell(
            f"{path}: its {name!r} state, a {shown(saved.get('type'))}'s, loads into this run's "
            f"{type(optimizer).__name__}, with the command line's {', '.join(changes)}"
        )


def load_random_streams(path: str, header: dict, found: dict, rank: int) -> None:
    """This rank's random streams where the checkpoint left them, once every rank's are found to be
    states their generators leave (check_random_streams); a rank the checkpoint's world did not have
    keeps the streams the rank-offset rule seeded. What does not fit is one line."""
    check_random_streams(path, header, found)
    if rank >= header["world_size"]:
        return
    names = [*RANDOM_STREAMS, "rng.torch"]
    # copies: torch.set_rng_state misreads a view into the stacked ranks' states (rank r's starts
    # past offset 0)
    streams = {name: rows[0].clone() for name, rows in load_rows(path, names, rank, 1).items()}
    try:
        python_state = tuple(int(word) for word in streams["rng.python"])
        gauss = float(streams["rng.python_gauss"])
        random.setstate((3, python_state, None if np.isnan(gauss) else gauss))
        position, has_gauss, cached = streams["rng.numpy_state"].tolist()
        keys = streams["rng.numpy"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(position), int(has_gauss), cached))
        torch.set_rng_state(streams["rng.torch"])
        if "rng.cuda" in found and torch.cuda.is_available():
            # the GPUs both machines have: a rank uses one, cuda:LOCAL_RANK
            cuda = load_rows(path, ["rng.cuda"], rank, 1)["rng.cuda"][0]
            devices = torch.cuda.device_count()
            torch.cuda.set_rng_state_all([state.clone() for state in cuda[:devices]])
    except (LookupError, TypeError, ValueError, OverflowError, RuntimeError) as error:
        fail(
            f"{path}: its random streams of rank {rank} do not fit this run "
            f"({first_line(error)}); delete it to resume from the one before",
            any_rank=True,  # this rank's alone: rank 0 may have loaded its own
        )


def check_random_streams(path: str, header: dict, found: dict) -> None:
    """Stop in one line naming the file, the rank and the stream unless the checkpoint holds every
    rank's random streams (Python's, numpy's, torch's, CUDA's where it has them) in the shapes its
    world gives, each a state its generator leaves: a key that is no zeros, a position within it, a
    cached gaussian that a draw gives. numpy resumed from a key of zeros would hang in its next
    gaussian; a NaN cached would reach the first actions. Read STREAM_ROWS ranks at a time."""
    world_size = header["world_size"]
    wanted = {
        name: ((world_size, *shape), dtype) for name, (dtype, shape) in RANDOM_STREAMS.items()
    }
    wanted["rng.torch"] = ((world_size, TORCH_STATE_BYTES), torch.uint8)
    faults = misfits({name: found[name] for name in wanted if name in found}, wanted, "")
    cuda_shape, cuda_dtype = found.get("rng.cuda", ((world_size, 1, 16), "U8"))
    if not faults and (
        len(cuda_shape) != 3 or cuda_shape[::2] != (world_size, 16) or cuda_dtype != "U8"
    ):
        faults = f"rng.cuda {cuda_shape} {shown(cuda_dtype)}, not ({world_size}, devices, 16) U8"
    if faults:
        fail(
            f"{path}: its random streams do not fit its {world_size} ranks ({faults}); delete it "
            "to resume from the one before"
        )
    names = [*wanted, *(["rng.cuda"] if "rng.cuda" in found else [])]
    for first in range(0, world_size, STREAM_ROWS):
        rows = {
            name: tensor.numpy()
            for name, tensor in load_rows(path, names, first, STREAM_ROWS).items()
        }
        for ranks, fault in stream_faults(rows):
            if ranks.any():
                fail(
                    f"{path}: its random streams of rank {first + int(ranks.argmax())} do not fit "
                    f"this run ({fault}), a state no generator leaves: it is damaged; delete it to "
                    "resume from the one before"
                )


def load_rows(path: str, names: list[str], first: int, count: int) -> dict[str, torch.Tensor]:
    """Rows `first` to `first + count` (at most) of the named tensors of the file at `path` (checked
    before: they exist, with the shapes and dtypes wanted), read without the rest."""
    try:
        with safe_open(path, framework="pt") as opened:
            return {name: opened.get_slice(name)[first : first + count] for name in names}
    except Exception as error:  # the file changed since it was checked, or the OS refused to map it
        fail(
            f"{path} could not be read ({type(error).__name__}: {first_line(error)}); use a "
            "checkpoint from before"
        )


def stream_faults(rows: dict[str, np.ndarray]) -> list[tuple[np.ndarray, str]]:
    """Each way the ranks' random streams in `rows` (a row a rank) can hold a state no generator
    leaves: which rows do, and what a message says of it."""
    python = rows["rng.python"]
    gauss = rows["rng.python_gauss"]
    position, has_gauss, cached = rows["rng.numpy_state"].T
    faults = mersenne_faults("Python's", python[:, :MT_WORDS], python[:, MT_WORDS])
    # NaN: none cached, as the file writes Python's None
    faults.append((np.abs(gauss) > MAX_GAUSSIAN, "Python's cached gaussian is no draw's"))
    faults += mersenne_faults("numpy's", rows["rng.numpy"], position)
    faults.append((~np.isin(has_gauss, (0, 1)), "numpy's has_gauss is neither 0 nor 1"))
    faults.append((~(np.abs(cached) <= MAX_GAUSSIAN), "numpy's cached gaussian is no draw's"))
    faults += torch_faults(rows["rng.torch"])
    if "rng.cuda" in rows:
        offsets = rows["rng.cuda"][..., 8:16].copy().view("<i8")[..., 0]
        # CUDA's Philox offset: torch refuses one that is no multiple of 4, and never counts back
        wrong = ((offsets < 0) | (offsets % 4 != 0)).any(axis=1)
        faults.append((wrong, "CUDA's offset is negative or no multiple of 4"))
    return faults


def mersenne_faults(
    name: str, key: np.ndarray, position: np.ndarray | None
) -> list[tuple[np.ndarray, str]]:
    """stream_faults' of a Mersenne Twister's `key` (a row of 624 words a rank) and `position`
    (None: the caller checks it): words that are no 32-bit numbers (Python's and torch's generators
    would cut them), a position outside the key, and a key whose 19937 bits (the first word's top
    bit, the other words) are zeros, which no seeding leaves and from which the generator draws
    zeros forever."""
    outside = ((key < 0) | (key >= 2**32)).any(axis=1)
    zeros = (key[:, 0] % 2**32 < 2**31) & ~key[:, 1:].any(axis=1)
    faults = [(outside, f"{name} key holds numbers outside [0, 2**32)")]
    if position is not None:
        placed = (position >= 0) & (position <= MT_WORDS) & (position == np.floor(position))
        faults.append((~placed, f"{name} position lies outside [0, {MT_WORDS}]"))
    faults.append((zeros, f"{name} key is zeros, from which it would draw nothing but zeros"))
    return faults


def torch_faults(states: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """stream_faults' of torch's CPU generator states (a row of TORCH_STATE_BYTES bytes a rank):
    its key as mersenne_faults checks it, a generator never seeded, a position past the key's end
    (`left` words to draw from `next` on: a seeded generator has left 1 and next 0, and from its
    first draw on left + next is 625), and cached normals no draw gives."""
    fields = {
        name: states[:, offset : offset + np.dtype(kind).itemsize].copy().view(kind)[:, 0]
        for name, (offset, kind) in TORCH_FIELDS.items()
    }
    key = states[:, TORCH_KEY_OFFSET : TORCH_KEY_OFFSET + 8 * MT_WORDS].copy().view("<u8")
    left = fields["left"].astype(np.int64)
    after = left + fields["next"].astype(np.float64)
    placed = (left >= 1) & (left <= MT_WORDS) & (fields["next"] <= MT_WORDS)
    faults = [(fields["seeded"] != 1, "torch's generator was never seeded")]
    faults.append((~(placed & (after <= MT_WORDS + 1)), "torch's position lies outside its key"))
    faults += mersenne_faults("torch's", key, None)
    for cached, valid in (("normal", "normal_valid"), ("float_normal", "float_valid")):
        size = np.abs(fields[cached].astype(np.float64))
        wrong = ~np.isin(fields[valid], (0, 1)) | ((fields[valid] == 1) & ~(size <= MAX_GAUSSIAN))
        faults.append((wrong, f"torch's cached {cached.replace('_', ' ')} is no draw's"))
    return faults


def world_change(header: dict, world_size: int) -> str:
    """What the resume line adds where the checkpoint's world had another size: what goes on, and
    what is new."""
    written = header["world_size"]
    if written == world_size:
        return ""
    new = (
        f"; the rank-offset rule seeds {span(written, world_size)}" if world_size > written else ""
    )
    gone = (
        f"; the random streams of its {span(world_size, written)} end here"
        if written > world_size
        else ""
    )
    return (
        f", written by {written} ranks and continued by {world_size}: the batch table's world "
        "sizes are this run's, the env steps and learning-rate schedule go on from its step "
        f"count, every env starts a fresh episode{new}{gone}"
    )


def span(first: int, end: int) -> str:
    """Ranks first to end - 1, as a message names them."""
    return f"rank {first}" if end - first == 1 else f"ranks {first}-{end - 1}"


# --- finding the run to resume --------------------------------------------------------------------
def find_run_to_resume(args, total_steps: int) -> tuple[str, dict | None]:
    """The run folder restarted ranks must find again ('' if none) and the header of its checkpoint
    to resume (its path under "path"), checked up front: the file, its env, its args by the script's
    rules, its progress. A restart count (torchrun's) resumes a run of this launch, never a finished
    one."""
    name = args.run_name
    # torchrun's id of this launch, `none` under static rendezvous: a restart finds the run folder
    # again by it
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    in_launch = run_id not in ("", "none")
    if not name and (args.resume or checks.max_restarts() > 0):
        if not in_launch:
            flag = "--resume" if args.resume else "torchrun --max-restarts"
            fail(
                f"{flag} needs a run folder that every (re)started rank finds again: pass "
                "--run-name NAME"
            )
        name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{run_id}"
        if not run_folders.is_one_folder(name):
            fail(
                f"the launcher's variable TORCHELASTIC_RUN_ID={shown(run_id)} makes no folder "
                "name below runs/: unset it, or pass --run-name NAME",
                any_rank=True,
            )
    restart_count = checks.restart_count()
    restarted = restart_count > 0
    folder = os.path.join("runs", name)
    exists = bool(name) and os.path.lexists(folder)
    if exists and (args.resume or restarted):
        run_folders.refuse_link(folder)
        run_folders.refuse_link(os.path.join(folder, "checkpoints"))
    path = find_latest_checkpoint(name) if name else None
    if args.resume and path is None and not restarted:
        fail(
            f"--resume found no checkpoint in runs/{name}/checkpoints; check --run-name, or drop "
            "--resume"
        )
    if exists and not (args.resume or restarted):
        fail(
            f"runs/{name} already exists: pass --resume to continue it, or choose another "
            "--run-name"
        )
    if exists and restarted and not args.resume:
        record = run_folders.lock_record(name)
        same_launch = in_launch and record.get("launch") == run_id
        if record.get("finished") or not same_launch:
            fail(
                f"runs/{name} already exists, and TORCHELASTIC_RESTART_COUNT={restart_count} is "
                "no restart of the launch that made it (finished, or another torchrun's): pass "
                "--resume to continue it, or choose another --run-name"
            )
    if path is None:
        return name, None
    fix = "delete it to resume from the one before"
    run_folders.refuse_link(path)
    header, found = read(path, fix)
    if header["kind"] != "training":
        fail(
            f"{path} is a {shown(header['kind'])} file, not a training checkpoint: it is damaged; "
            f"{fix}"
        )
    bounds = {
        "iteration": MAX_STEPS,
        "global_step": MAX_STEPS,
        "world_size": 2**20,
        "restarts": MAX_RESTARTS,
        "envs_seeded": MAX_ENVS_SEEDED,
    }
    for key, bound in bounds.items():
        value = header.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= bound:
            found = shown(value) if key in header else "nothing"
            fail(
                f"{path} holds {found} as its {key!r}, where ddrl writes an int in [0, {bound}]: "
                f"it is damaged; {fix}"
            )
    refuse_imported_env(path, header, args.env_id)
    if header["env_id"] != args.env_id:
        fail(
            f"{path} trains {shown(header['env_id'])}, not --env-id {args.env_id}; pass that "
            "--env-id"
        )
    saved = saved_args(header, type(args), path, fix)
    iteration = header["iteration"]
    global_step = header["global_step"]
    # a run stops within one iteration past its total, and an iteration is at most the total
    if not (
        1 <= iteration <= global_step < 2 * saved.total_timesteps and header["world_size"] >= 1
    ):
        fail(
            f"{path} says {global_step} env steps in {iteration} iterations by "
            f"{header['world_size']} ranks, of --total-timesteps {saved.total_timesteps}, which "
            f"no run reaches: it is damaged; {fix}"
        )
    check_random_streams(path, header, found)
    return name, {**header, "path": path}


def env_seeds_problem(args, world_size: int, envs_seeded: int, name: str) -> str:
    """Why this attempt's envs cannot all be seeded ('' if they can): env g of the run, counted
    over its attempts from `envs_seeded` (the earlier attempts' envs of runs/NAME) on, is seeded
    with seed + SEED_STRIDE * g, which every env library takes below SEED_LIMIT."""
    envs = world_size * args.local_num_envs
    last = args.seed + SEED_STRIDE * (envs_seeded + envs - 1)
    if last < SEED_LIMIT:
        return ""
    rule = f"seed + {SEED_STRIDE:_} x env, up to {last}, where envs take seeds below 2**31"
    these = f"{envs} env(s), {world_size} rank(s) x --local-num-envs {args.local_num_envs}"
    room = (SEED_LIMIT - 1 - args.seed) // SEED_STRIDE + 1 - envs_seeded
    if envs_seeded == 0:
        largest = SEED_LIMIT - 1 - SEED_STRIDE * (envs - 1)
        fix = f"pass --seed {largest} or less" if largest >= 0 else f"use {room} envs or fewer"
        return f"--seed {args.seed} cannot seed {these} ({rule}): {fix}"
    fix = (
        f"resume with {room} envs or fewer, or start a new run"
        if room > 0
        else "no env seed is left to it: start a new run"
    )
    return (
        f"runs/{name}'s earlier attempts seeded {envs_seeded} envs, and --seed {args.seed} cannot "
        f"seed {these} more ({rule}): {fix}"
    )
