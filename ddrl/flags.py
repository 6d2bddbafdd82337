"""The flags every ddrl script shares (a dataclass each script's `Args` extends) and their rules,
written beside each flag as annotated-types markers (`Annotated[int, Ge(1)]`): pydantic checks a
command line and a file's saved args alike, each violation one line naming the flag."""

import importlib.util
import json
import os
import re
from dataclasses import asdict, dataclass
from functools import cache
from typing import Annotated, Literal

import pydantic
import torch.distributed as dist
from annotated_types import Ge, Interval

from ddrl.failures import shown

Finite = pydantic.AllowInfNan(False)
"""a float flag's rule: no inf, no NaN (`Annotated[float, Gt(0), Finite]`)"""

BACKENDS = {
    "gloo": dist.is_gloo_available,
    "nccl": dist.is_nccl_available,
    "mpi": dist.is_mpi_available,
}
# torch.distributed's backends, and whether this build has each
BACKENDS |= {"ucc": dist.is_ucc_available}
# what --eval-checkpoint never does
TRAINING_ONLY = ("resume", "run_name", "checkpoint_every", "save_model", "track")


def one_folder_name(name: str) -> str:
    """--run-name's rule: empty (the default name), or one folder name right below runs/."""
    if name and not is_one_folder(name):
        raise ValueError(
            "is not one folder name below runs/: use printable characters without '/' or '\\', "
            "not '.' or '..', at most 200 bytes"
        )
    return name


def is_one_folder(name: str) -> bool:
    """Whether `name` names one folder right below runs/, never a path elsewhere."""
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    return (
        name not in (".", "..")
        and name.isprintable()
        and len(name.encode()) <= 200
        and not separators & set(name)
    )


FolderName = pydantic.AfterValidator(one_folder_name)
"""a text flag's rule: one folder name below runs/ (or empty)"""


def torch_backend(backend: str) -> str:
    """--backend's rule: empty, a torch.distributed backend, or DEVICE:BACKEND pairs (cpu, cuda)."""
    pairs = [pair.split(":") for pair in backend.split(",")] if backend else []
    for pair in pairs:
        if (
            len(pair) > 2
            or pair[-1] not in BACKENDS
            or (len(pair) == 2 and pair[0] not in ("cpu", "cuda"))
        ):
            raise ValueError(
                f"is not a torch.distributed backend: pass one of {', '.join(BACKENDS)}, or "
                "DEVICE:BACKEND pairs such as cpu:gloo,cuda:nccl (left out: gloo, with NCCL for "
                "CUDA tensors)"
            )
    return backend


def a_file(path: str | None) -> str | None:
    """--eval-checkpoint's rule: left out, or a path."""
    if path == "":
        raise ValueError("names no file: pass the path of a model file, or drop the flag")
    return path


@dataclass
class RuntimeArgs:
    """The runtime's flags, the same in every ddrl script (each script's Args extends this)."""

    eval_checkpoint: Annotated[str | None, pydantic.AfterValidator(a_file)] = None
    """if set, load this model file (or a training checkpoint), play `--eval-episodes` episodes on
    rank 0 and exit"""
    eval_episodes: Annotated[int, Interval(ge=1, le=10**6)] = 10
    """episodes played by `--eval-checkpoint` and after training with `--capture-video`"""
    eval_deterministic: bool = False
    """if toggled, evaluation takes the policy's mode instead of sampling"""
    run_name: Annotated[str, FolderName] = ""
    """the run folder under runs/; default `{env_id}__{exp_name}__{seed}__{unix_time}`"""
    torch_threads: Annotated[int, Interval(ge=0, le=4096)] = 0
    """torch threads per rank; 0 = the cores idle at start divided by the ranks on this node (1 on a
    GPU)"""
    nprocs: Annotated[int, Interval(ge=1, le=4096)] = 1
    """if > 1, re-launch as that many ranks: mpirun if --collectives allows MPI, else torchrun"""
    collectives: Literal["auto", "mpi", "shm", "torch"] = "auto"
    """CPU collectives via mpi4py, shared memory or gloo; auto: mpi if MPI started the ranks and
    mpi4py imports, else shm where every rank is on one node"""
    backend: Annotated[str, pydantic.AfterValidator(torch_backend)] = ""
    """torch.distributed backend; empty = gloo, and NCCL for CUDA tensors with --cuda"""
    dist_timeout: Annotated[float, Interval(ge=5, le=10**7)] = 1800.0
    """seconds a collective may wait for a peer before the run stops (ranks that start seconds apart
    must meet)"""
    checkpoint_every: Annotated[int, Ge(0)] = 0
    """iterations between checkpoints, `runs/{run_name}/checkpoints/iter_{n:06d}.safetensors` (0: on
    SIGTERM only)"""
    resume: bool = False
    """continue the run `--run-name` from its newest checkpoint (automatic on a torchrun restart)"""
    check_sync_every: Annotated[int, Ge(0)] = 1
    """iterations between checks that all ranks hold the same training state (every module,
    optimizer and number main carries, by checksums), from the first; 0 = never"""


def saved_args(saved: dict, args_type: type):
    """A file's saved args as `args_type` (missing entries default, unknown ones are ignored) by the
    command line's rules, strictly typed as JSON: (args, []) or (None, the violations)."""
    try:
        args = rules(args_type).validate_json(json.dumps(saved, allow_nan=True), strict=True)
    except pydantic.ValidationError as error:
        return None, [violation(detail) for detail in error.errors()]
    return args, violations(args)


def violations(args) -> list[str]:
    """Each flag of `args` whose value breaks its rule, one message each naming the flag and fix."""
    try:
        rules(type(args)).validate_python(asdict(args))
    except pydantic.ValidationError as error:
        return [violation(detail) for detail in error.errors()]
    found = []
    if args.eval_checkpoint is not None:
        given = [
            f"--{name.replace('_', '-')}" for name in TRAINING_ONLY if getattr(args, name, False)
        ]
        given += ["--nprocs"] if args.nprocs > 1 else []
        if given:
            found.append(
                f"--eval-checkpoint evaluates a model on one process, where {', '.join(given)} "
                "belong(s) to training: drop them, or drop --eval-checkpoint to train"
            )
    return found


@cache
def rules(args_type: type) -> pydantic.TypeAdapter:
    """pydantic's validator of `args_type`, built once: the rules beside its fields."""
    return pydantic.TypeAdapter(args_type)


def violation(detail: dict) -> str:
    """One pydantic error as a message: the flag, what its rule asks, the value given."""
    name, *place = detail["loc"]
    flag = f"--{str(name).replace('_', '-')}" + "".join(f"[{index}]" for index in place)
    value = detail.get("input")
    rule = {
        key: int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        for key, bound in (detail.get("ctx") or {}).items()
    }
    kind = detail["type"]
    wanted = {
        "greater_than_equal": f"at least {rule.get('ge')}",
        "greater_than": f"greater than {rule.get('gt')}",
        "less_than_equal": f"at most {rule.get('le')}",
        "less_than": f"less than {rule.get('lt')}",
        "finite_number": "finite",
        "literal_error": f"one of {rule.get('expected')}",
        "too_long": f"at most {rule.get('max_length')} long",
    }
    if kind in wanted:
        return f"{flag} must be {wanted[kind]}, got {shown(value)}"
    if kind == "value_error":
        return f"{flag} {shown(value)} {rule.get('error')}"
    expected = kind.removesuffix("_type").removesuffix("_parsing")
    return f"{flag} holds {shown(value)}, which is no {expected}"


def machine_problem(args) -> str | None:
    """What this machine lacks for the flags (not a checkpoint's: those may come from elsewhere)."""
    if args.track and importlib.util.find_spec("wandb") is None:
        return (
            "--track needs Weights and Biases, which is not installed: pip install wandb, or "
            "drop --track"
        )
    missing = [
        name for name in re.split("[,:]", args.backend) if name in BACKENDS and not BACKENDS[name]()
    ]
    if missing:
        return (
            f"--backend {args.backend} needs {', '.join(missing)}, which this build of torch "
            "lacks: pass gloo"
        )
    return None
