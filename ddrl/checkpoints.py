"""Checkpoints' policy: which checkpoint an attempt resumes, what fits, a training state saved and
loaded with every rank's random streams, model files; the format is checkpoint_files'."""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from ddrl import checkpoint_files, failures, flags, launching, run_folders
from ddrl.failures import fail, first_line, shown

MAX_STEPS = 2**53  # env steps and iterations a run can reach (float64 counts them exactly)
MAX_RESTARTS = 10**6  # the attempts a file counts: a run resumed more often writes this bound again
# rank r seeds with seed + SEED_STRIDE * r, env g (over every attempt) with seed + SEED_STRIDE * g
SEED_STRIDE = 10_000
SEED_LIMIT = 2**31  # every env library takes a seed below it (ale-py's are int32)
MAX_ENVS_SEEDED = (SEED_LIMIT - 1) // SEED_STRIDE + 1
IMPLEMENTATION_OPTIONS = {"foreach", "fused", "capturable", "differentiable"}  # how, not what


@dataclass
class Resumption:
    """The checkpoint this attempt resumes and what it carries on from it (a new run: zeros)."""

    header: dict | None = None  # the checkpoint's header, with its path under "path"
    iteration: int = 0  # the iteration it reached
    global_step: int = 0  # the world's env steps it reached
    restarts: int = 0  # the earlier attempts, as this attempt's checkpoints count them
    envs_seeded: int = 0  # the envs earlier attempts seeded: this one's env g is envs_seeded + g


# --- which run to resume, and what its world and seeds allow --------------------------------------
def find_run_to_resume(args) -> tuple[str, Resumption]:
    """The run's name ('' if a new run's folder is named as made) and the checkpoint to resume."""
    name = run_name(args)
    path = checkpoint_to_resume(args, name)
    if path is None:
        return name, Resumption()
    header = {**checked_header(path, args), "path": path}
    return name, Resumption(
        header,
        iteration=header["iteration"],
        global_step=header["global_step"],
        restarts=min(header["restarts"] + 1, MAX_RESTARTS),
        envs_seeded=header["envs_seeded"],
    )


def run_name(args) -> str:
    """--run-name, or where --resume or torchrun's restarts need one, torchrun's id's."""
    if args.run_name or not (args.resume or launching.max_restarts() > 0):
        return args.run_name
    run_id = launch_id()
    if not run_id:
        flag = "--resume" if args.resume else "torchrun --max-restarts"
        fail(
            f"{flag} needs a run folder that every (re)started rank finds again: pass "
            "--run-name NAME"
        )
    name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{run_id}"
    if not flags.is_one_folder(name):
        fail(
            f"the launcher's variable TORCHELASTIC_RUN_ID={shown(run_id)} makes no folder "
            "name below runs/: unset it, or pass --run-name NAME",
            any_rank=True,
        )
    return name


def checkpoint_to_resume(args, name: str) -> str | None:
    """The newest checkpoint of runs/NAME (None: a new run), once the folder is found fit: no link,
    and an existing run continued only by --resume or a restart of the launch that made it."""
    restart_count = launching.restart_count()
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
        same_launch = bool(launch_id()) and record.get("launch") == launch_id()
        if record.get("finished") or not same_launch:
            fail(
                f"runs/{name} already exists, and TORCHELASTIC_RESTART_COUNT={restart_count} is "
                "no restart of the launch that made it (finished, or another torchrun's): pass "
                "--resume to continue it, or choose another --run-name"
            )
    if path is not None:
        run_folders.refuse_link(path)
    return path


def launch_id() -> str:
    """torchrun's id of this launch, by which a restart finds its run folder; '' where none."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return "" if run_id == "none" else run_id


def checked_header(path: str, args) -> dict:
    """The header of the checkpoint to resume, checked before anything is built from it."""
    fix = "delete it to resume from the one before"
    header, found = checkpoint_files.read(path, fix)
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
            found_value = shown(value) if key in header else "nothing"
            fail(
                f"{path} holds {found_value} as its {key!r}, where ddrl writes an int in [0, "
                f"{bound}]: it is damaged; {fix}"
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
    if not (
        1 <= iteration <= global_step < 2 * saved.total_timesteps and header["world_size"] >= 1
    ):
        fail(
            f"{path} says {global_step} env steps in {iteration} iterations by "
            f"{header['world_size']} ranks, of --total-timesteps {saved.total_timesteps}, which "
            f"no run reaches: it is damaged; {fix}"
        )
    checkpoint_files.check_random_streams(path, header, found)
    return header


def env_seeds_problem(args, world_size: int, envs_seeded: int, name: str) -> str:
    """Why this attempt's envs cannot all be seeded below SEED_LIMIT ('' if they can)."""
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


def world_change(header: dict, world_size: int) -> str:
    """What the resume line adds where the checkpoint's world had another size."""
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


# --- loading a training state: every tensor compared with what this run built, then loaded --------
def load_training_state(path: str, header: dict, rank: int, states: dict) -> None:
    """Load the weights, optimizer states and this rank's random streams, each checked first."""
    fix = "delete it to resume from the one before"
    found = checkpoint_files.read(path, fix)[1]
    if not isinstance(header.get("optimizers"), dict):
        fail(f"{path} holds no optimizer states: it is damaged; {fix}")
    model = next(iter(states.values()))
    optimizers = dict(list(states.items())[1:])
    check_weights_fit(path, header, found, model, then="resume with")
    per_parameter = {
        name: optimizer_state(path, header, found, name, optimizer)
        for name, optimizer in optimizers.items()
    }
    load_weights(model, path, header)
    for name, optimizer in optimizers.items():
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": per_parameter[name], "param_groups": groups})
        say_changed_options(path, name, optimizer, header["optimizers"][name])
    if rank < header["world_size"]:
        checkpoint_files.restore_random_streams(path, found, rank)


def check_weights_fit(
    path: str, header: dict, found: dict, model: nn.Module, then: str = "use"
) -> None:
    """Stop in one line naming the file, its writer and the first misfits, unless its `model.*`
    tensors (`found` as read) fit `model` (on any device, meta too) by name, shape and dtype."""
    wanted = {
        f"model.{name}": (tuple(tensor.shape), tensor.dtype)
        for name, tensor in model.state_dict().items()
    }
    if faults := checkpoint_files.misfits(found, wanted, "model."):
        fail(
            f"{path}, written by {writer_of(header)}: its weights do not fit this "
            f"{type(model).__name__} ({faults}): undo the Agent's edit, or {then} the script that "
            "wrote it"
        )


def optimizer_state(
    path: str, header: dict, found: dict, name: str, optimizer: torch.optim.Optimizer
) -> dict[int, dict]:
    """The file's state of optimizer `name` as state_dict holds it, once it fits and is finite."""
    wanted = optimizer_shapes(optimizer, name)
    saved = header["optimizers"].get(name)
    saved_type = saved.get("type") if isinstance(saved, dict) else None
    if saved_type is None or (faults := checkpoint_files.misfits(found, wanted, f"{name}.state.")):
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
    state = {}
    tensors = checkpoint_files.load(path, list(wanted), "delete it to resume from the one before")
    for key, value in tensors.items():
        index, entry = key.removeprefix(f"{name}.state.").split(".", 1)
        state.setdefault(int(index), {})[entry] = value
    return state


def optimizer_shapes(optimizer: torch.optim.Optimizer, name: str) -> dict[str, tuple]:
    """(shape, dtype) of what this optimizer keeps per parameter, by NAME.state.INDEX.KEY: found by
    one step of a copy of it on zero gradients."""
    probe = copy.deepcopy(optimizer)
    for group in probe.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    probe.step()
    return {
        f"{name}.state.{index}.{key}": (tuple(value.shape), value.dtype)
        for index, entries in probe.state_dict()["state"].items()
        for key, value in entries.items()
        if torch.is_tensor(value)
    }


def load_weights(model: nn.Module, path: str, header: dict) -> None:
    """Load the file's `model.*` tensors, found to fit, into `model` once they are finite; a file
    another script wrote says so in one line (rank 0)."""
    names = [f"model.{name}" for name in model.state_dict()]
    weights = checkpoint_files.load(path, names, "use a checkpoint from before")
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


def say_changed_options(
    path: str, name: str, optimizer: torch.optim.Optimizer, saved: dict
) -> None:
    """Rank 0: one line naming the command line's options that differ from the file's."""
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
        options = {key: value for key, value in group.items() if key != "params"}
        now = json.loads(json.dumps(options, default=repr))  # as the file holds them
        keys = sorted((now.keys() | before.keys()) - IMPLEMENTATION_OPTIONS - {"lr"})  # lr: main's
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


# --- saving a training checkpoint -----------------------------------------------------------------
def save(
    world: launching.World,
    name: str,
    args,
    resumption: Resumption,
    iteration: int,
    global_step: int,
    states: dict,
) -> tuple[str, str]:
    """Every rank's random streams to rank 0 through the store, which writes `states` (the Agent,
    then the optimizers by name): the path and, on rank 0, why it is not written ('')."""
    store = world.store
    world_size = world.world_size
    store.set(f"rng/{iteration}/{world.rank}", save_bytes(checkpoint_files.random_streams()))
    path = checkpoint_path(name, iteration)
    if world.rank != 0:
        return path, ""
    streams = []
    for sender in range(world_size):
        streams.append(load_bytes(store.get(f"rng/{iteration}/{sender}")))
        store.delete_key(f"rng/{iteration}/{sender}")
    model = next(iter(states.values()))
    optimizers = dict(list(states.items())[1:])
    progress = {"world_size": world_size, "iteration": iteration, "global_step": global_step}
    envs_seeded = resumption.envs_seeded + world_size * args.local_num_envs
    counts = {"restarts": resumption.restarts, "envs_seeded": envs_seeded}
    written = make_folder(path) or checkpoint_files.write(
        path, args, model, optimizers, streams, **progress, **counts
    )
    return path, written


def stop_if_unwritten(world: launching.World, name: str, path: str, problem: str, fix: str) -> None:
    """Stop every rank in one line if rank 0 could not write `path` (`problem`). Its outcome goes
    through the store: a gather left as the group's last work can deadlock gloo's teardown."""
    if world.world_size > 1:
        if world.rank == 0:
            world.store.set(f"written/{path}", problem)
        problem = world.store.get(f"written/{path}").decode()
    if problem:
        fail(f"{problem}; {last_good_checkpoint(name)}; {fix} --run-name {name}")


def last_good_checkpoint(name: str) -> str:
    """What a message that stops training says of the run's newest checkpoint."""
    last = find_latest_checkpoint(name)
    return f"the last good checkpoint is {last}" if last else "no checkpoint was written"


# --- model files ----------------------------------------------------------------------------------
def write_model(path: str, args, model: nn.Module) -> str:
    """The model file of --save-model: '' once written, else why not."""
    return make_folder(path) or checkpoint_files.write(path, args, model)


def read_model(path: str, args_type: type, env_id: str) -> tuple[dict, dict, object]:
    """--eval-checkpoint's file (a model file or a training checkpoint), checked like a command
    line: its header, its tensors as read and its args."""
    fix = f"pass the {run_folders.MODEL_FILE} that --save-model wrote"
    if not os.path.lexists(path):
        fail(f"--eval-checkpoint {shown(path)} does not exist; {fix}")
    header, found = checkpoint_files.read(path, fix)
    refuse_imported_env(path, header, env_id)
    if env_id not in (args_type().env_id, header["env_id"]):
        fail(
            f"--env-id {shown(env_id)} is not the env of {path} ({shown(header['env_id'])}), "
            "which it plays: drop --env-id"
        )
    saved = saved_args(header, args_type, path, fix)
    if saved.env_id != header["env_id"]:
        fail(
            f"{path} holds args of env {shown(saved.env_id)}, not its {shown(header['env_id'])}: "
            f"it is damaged; {fix}"
        )
    return header, found, saved


# --- where files live, and what a file says of itself ---------------------------------------------
def make_folder(path: str) -> str:
    """Make `path`'s folder where missing, never through a link: '' once there, else why not."""
    problem = run_folders.folder_problem(os.path.dirname(path) or ".", make=True)
    return f"could not write {path}: {problem}" if problem else ""


def checkpoint_path(name: str, iteration: int) -> str:
    """Where runs/NAME's training checkpoint of `iteration` lives."""
    return os.path.join("runs", name, "checkpoints", f"iter_{iteration:06d}.safetensors")


def model_path(name: str) -> str:
    """Where runs/NAME's model file (--save-model) lives."""
    return os.path.join("runs", name, run_folders.MODEL_FILE)


def find_latest_checkpoint(name: str) -> str | None:
    """The run's checkpoint of the highest iteration (iter_N.pt too: reading refuses it)."""
    folder = os.path.join("runs", name, "checkpoints")
    files = os.listdir(folder) if os.path.isdir(folder) and not os.path.islink(folder) else []
    found = {
        int(match[1]): file
        for file in files
        if (match := re.fullmatch(r"iter_(\d+)\.(pt|safetensors)", file))
    }
    return os.path.join(folder, found[max(found)]) if found else None


def refuse_imported_env(path: str, header: dict, env_id: str) -> None:
    """A file's `module:EnvId` env (gymnasium imports `module`) only if --env-id names it too."""
    saved_env_id = header["env_id"]
    if ":" in saved_env_id and saved_env_id != env_id:
        fail(
            f"{path} names its env {shown(saved_env_id)}, whose module gymnasium would import, "
            "running its code: refused; if you trust that module, pass --env-id "
            f"{shown(saved_env_id)[1:-1]} yourself"
        )


def saved_args(header: dict, args_type: type, path: str, fix: str):
    """A file's args as `args_type`, read by the command line's rules, or one line."""
    saved, problems = flags.saved_args(header["args"], args_type)
    if problems:
        fail(f"{path} holds args that no command line gives ({problems[0]}): it is damaged; {fix}")
    return saved


def writer_of(header: dict) -> str:
    """`SCRIPT (ALGORITHM)`: who wrote a file, as the messages name it."""
    script = shown(header["script"])
    return f"{script} ({shown(header['algorithm'].rstrip('.'))})" if header["algorithm"] else script
