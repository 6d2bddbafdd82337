"""The checks every script shares: the flags of the runtime (a checkpoint's args pass the same rules), what a run
needs of this machine, the rollout's numbers against the Agent's, the ranks' weights against each other, and video
support, each ending in one line that names the fix."""

import hashlib
import importlib.util
import os
import re
import shutil
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ddrl import collectives, run_folders
from ddrl.failures import fail, shown

DIST_TIMEOUTS = (5, 10**7)  # seconds: ranks that start seconds apart must meet; torch's timeout overflows far beyond
TRAINING_ONLY = ("resume", "run_name", "checkpoint_every", "save_model", "track")  # what --eval-checkpoint never does
BACKENDS = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
BACKENDS |= {"ucc": dist.is_ucc_available}  # torch.distributed's backends, and whether this build has each


def runtime_args_problem(args) -> str | None:
    """The first flag every script shares whose value cannot run, as the message naming the fix; None if all can. A
    checkpoint's args pass the same rules, so none of them depends on this machine (machine_problem does)."""
    for flag in ("nprocs", "eval_episodes"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
    if not 0 <= args.seed < 2**31:
        return f"--seed must lie in [0, 2**31), got {args.seed}: rank r is seeded with seed + 10000 x r, env g alike"
    if args.torch_threads < 0:
        return f"--torch-threads must be >= 0 (0 = automatic), got {args.torch_threads}"
    low, high = DIST_TIMEOUTS
    if not low <= args.dist_timeout <= high:
        return (
            f"--dist-timeout must be a number of seconds in [{low}, {high:g}], got {args.dist_timeout}: ranks that "
            "start seconds apart must meet within it"
        )
    if args.checkpoint_every < 0 or args.check_sync_every < 0:
        return "--checkpoint-every and --check-sync-every must be >= 0 (0 = off)"
    if problem := backend_problem(args.backend):
        return problem
    for flag, name in (("--run-name", args.run_name), ("--exp-name", args.exp_name)):
        if name and not run_folders.is_one_folder(name):
            return (
                f"{flag} {shown(name)} is not one folder name below runs/: use printable characters without '/' "
                "or '\\', not '.' or '..', at most 200 bytes"
            )
    if args.eval_checkpoint is not None:
        if not args.eval_checkpoint:
            return "--eval-checkpoint '' names no file: pass the path of a model file, or drop the flag"
        given = [f"--{name.replace('_', '-')}" for name in TRAINING_ONLY if getattr(args, name)]
        given += ["--nprocs"] if args.nprocs > 1 else []
        if given:
            return (
                f"--eval-checkpoint evaluates a model on one process, where {', '.join(given)} belong(s) to training: "
                "drop them, or drop --eval-checkpoint to train"
            )
    return None


def backend_problem(backend: str) -> str | None:
    """What makes --backend no torch.distributed backend, or no DEVICE:BACKEND pairs of them (cpu, cuda)."""
    pairs = [pair.split(":") for pair in backend.split(",")] if backend else []
    names = [pair[-1] for pair in pairs]
    devices = [pair[0] for pair in pairs if len(pair) == 2]
    if any(len(pair) > 2 or name not in BACKENDS for pair, name in zip(pairs, names, strict=True)) or any(
        device not in ("cpu", "cuda") for device in devices
    ):
        return (
            f"--backend {shown(backend)} is not a torch.distributed backend: pass one of {', '.join(BACKENDS)}, or "
            "DEVICE:BACKEND pairs such as cpu:gloo,cuda:nccl (left out: gloo, with NCCL for CUDA tensors)"
        )
    return None


def environment_int(name: str, low: int, high: int, because: str = "", text: str | None = None, unset: str = "") -> int:
    """The environment variable `name` (`unset` where it is not set, or `text` read from it) as an integer in [low,
    high], else one line, printed by this process whatever its rank (a rank number that is wrong cannot decide who
    speaks)."""
    text = os.environ.get(name, unset) if text is None else text
    try:
        value = int(text)
    except ValueError:
        fail(
            f"the launcher's variable {name}={shown(text)} is no integer: unset it, or launch with torchrun, mpirun or "
            "srun",
            any_rank=True,
        )
    if not low <= value <= high:
        where = f" (with {because})" if because else ""
        fail(
            f"the launcher's variable {name}={value} lies outside [{low}, {high}]{where}: unset it, or launch with "
            "torchrun, mpirun or srun",
            any_rank=True,
        )
    return value


def restart_count() -> int:
    """How many times torchrun restarted this launch's group (TORCHELASTIC_RESTART_COUNT; 0 outside torchrun)."""
    return environment_int("TORCHELASTIC_RESTART_COUNT", 0, 10**6, unset="0")


def max_restarts() -> int:
    """How many restarts torchrun allows this launch (TORCHELASTIC_MAX_RESTARTS; 0 outside torchrun)."""
    return environment_int("TORCHELASTIC_MAX_RESTARTS", 0, 10**6, unset="0")


def machine_problem(args) -> str | None:
    """What this machine lacks for the flags (not a checkpoint's args: those may come from another machine)."""
    compiler = os.environ.get("CXX", "g++")  # torch.compile builds C++ kernels on CPU
    on_gpu = getattr(args, "cuda", False) and torch.cuda.is_available()
    if getattr(args, "compile", False) and not on_gpu and shutil.which(compiler) is None:
        return f"--compile on CPU needs a C++ compiler and {compiler!r} is not on PATH: install g++ or drop --compile"
    if args.track and importlib.util.find_spec("wandb") is None:
        return "--track needs Weights and Biases, which is not installed: pip install wandb, or drop --track"
    missing = [name for name in re.split("[,:]", args.backend) if name in BACKENDS and not BACKENDS[name]()]
    if missing:
        return f"--backend {args.backend} needs {', '.join(missing)}, which this build of torch lacks: pass gloo"
    return None


def check_agreement(when: str, must_agree: str, **pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Stop every rank unless each pair (the Agent's numbers, the rollout's) agrees on all ranks: a relative gap above
    1e-3, far above float32 rounding (of small stds too), means the two compute different things."""
    tolerance = 1e-3
    with torch.no_grad():
        relative = [(mine - theirs).abs() / (1 + theirs.abs()) for mine, theirs in pairs.values()]
        gaps = torch.stack([gap.max() for gap in relative]).double()
    if collectives.group_size() > 1:
        collectives.reduce_to_all(gaps, "max")
    for name, gap in zip(pairs, gaps.tolist(), strict=True):
        if not gap <= tolerance:  # NaN too
            fail(
                f"{when}, the rollout's {name} differ from the Agent's by up to {gap:.3g} (relative; tolerance "
                f"{tolerance:g}): {must_agree} must compute the same distribution and value; edit both alike"
            )


def check_one_per_row(log_probs, values, count: int, methods: str) -> None:
    """Stop unless a rollout's probe of `count` observations gave one log-probability and one value per observation, as
    GAE needs; `methods` names the Agent's methods that compute them."""
    for name, per_row in (("log-probabilities", log_probs), ("values", values)):
        if tuple(per_row.shape) != (count,):
            fail(
                f"the rollout's act gives {name} of shape {tuple(per_row.shape)} for {count} observations: "
                f"{methods} must give one per row"
            )


def digest(data: bytes) -> int:
    """A 63-bit digest of `data`, to compare across ranks in an int64 tensor."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


def check_weights_in_sync(module: nn.Module, iteration: int, unit: str = "iteration") -> None:
    """Stop every rank if the weights differ between ranks (a checksum of their bytes, one gather)."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()
    checksums = collectives.gather_ints_to_all([digest(flat.numpy().tobytes())], next(module.parameters()).device)
    checksums = checksums[:, 0]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if differ := (checksums != checksums[rank]).nonzero().flatten().tolist():
        fail(
            f"the weights of ranks {differ} differ from this rank's at {unit} {iteration}: the ranks no longer train "
            "one model. Likely causes: an edit of the update that skips or changes the gradients' allreduce for some "
            "parameters (a parameter left out of the flattened gradients, a gradient changed after the sync), a random "
            "draw in the update that differs by rank, or a faulty node. Undo that edit, then resume from the last "
            "checkpoint with --resume"
        )


def check_video_support(capture_video: bool, render_frame: Callable[[], object]) -> None:
    """With --capture-video, render one frame now rather than fail after training."""
    if not capture_video:
        return
    try:
        import moviepy  # noqa: F401
    except ImportError:
        fail("--capture-video needs moviepy: pip install moviepy")
    try:
        render_frame()
    except Exception as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        fail(
            f"--capture-video cannot render a frame ({reason}): for MuJoCo without a display use MUJOCO_GL=egl "
            "(apt-get install libegl1) or MUJOCO_GL=osmesa (apt-get install libosmesa6); for classic-control envs "
            "pip install pygame; or drop --capture-video"
        )
