"""The checks every script shares: what a run needs of this machine, the launchers' variables, the
rollout's numbers against the Agent's, the ranks' training state against each other, and video
support, each ending in one line that names the fix."""

import hashlib
import importlib.util
import os
import re
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ddrl import collectives, flags
from ddrl.failures import fail, first_line, shown


def environment_int(
    name: str, low: int, high: int, because: str = "", text: str | None = None, unset: str = ""
) -> int:
    """The environment variable `name` (`unset` where it is not set, or `text` read from it) as an
    integer in [low, high], else one line, printed by this process whatever its rank (a rank number
    that is wrong cannot decide who speaks)."""
    text = os.environ.get(name, unset) if text is None else text
    try:
        value = int(text)
    except ValueError:
        fail(
            f"the launcher's variable {name}={shown(text)} is no integer: unset it, or launch "
            "with torchrun, mpirun or srun",
            any_rank=True,
        )
    if not low <= value <= high:
        where = f" (with {because})" if because else ""
        fail(
            f"the launcher's variable {name}={value} lies outside [{low}, {high}]{where}: unset "
            "it, or launch with torchrun, mpirun or srun",
            any_rank=True,
        )
    return value


def restart_count() -> int:
    """How many times torchrun restarted this launch's group (TORCHELASTIC_RESTART_COUNT; 0 outside
    torchrun)."""
    return environment_int("TORCHELASTIC_RESTART_COUNT", 0, 10**6, unset="0")


def max_restarts() -> int:
    """How many restarts torchrun allows this launch (TORCHELASTIC_MAX_RESTARTS; 0 outside
    torchrun)."""
    return environment_int("TORCHELASTIC_MAX_RESTARTS", 0, 10**6, unset="0")


def machine_problem(args) -> str | None:
    """What this machine lacks for the flags (not a checkpoint's args: those may come from another
    machine)."""
    if args.track and importlib.util.find_spec("wandb") is None:
        return (
            "--track needs Weights and Biases, which is not installed: pip install wandb, or "
            "drop --track"
        )
    missing = [
        name
        for name in re.split("[,:]", args.backend)
        if name in flags.BACKENDS and not flags.BACKENDS[name]()
    ]
    if missing:
        return (
            f"--backend {args.backend} needs {', '.join(missing)}, which this build of torch "
            "lacks: pass gloo"
        )
    return None


def check_agreement(when: str, must_agree: str, **pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Stop every rank unless each pair (the Agent's numbers, the rollout's) agrees on all ranks: a
    relative gap above 1e-3, far above float32 rounding (of small stds too), means the two compute
    different things."""
    tolerance = 1e-3
    with torch.no_grad():
        relative = [(mine - theirs).abs() / (1 + theirs.abs()) for mine, theirs in pairs.values()]
        gaps = torch.stack([gap.max() for gap in relative]).double()
    if collectives.group_size() > 1:
        collectives.reduce_to_all(gaps, "max")
    for name, gap in zip(pairs, gaps.tolist(), strict=True):
        if not gap <= tolerance:  # NaN too
            fail(
                f"{when}, the rollout's {name} differ from the Agent's by up to {gap:.3g} "
                f"(relative; tolerance {tolerance:g}): {must_agree} must compute the same "
                "distribution and value. The rollout is derived from the Agent, so either a numpy "
                "version in ddrl/rollout.py computes something else (--no-numpy-rollout runs the "
                "Agent's own code) or the Agent's numbers are not finite or not a function of its "
                "inputs alone"
            )


def check_one_per_row(log_probs, values, count: int, methods: str) -> None:
    """Stop unless a rollout's probe of `count` observations gave one log-probability and one value
    per observation, as GAE needs; `methods` names the Agent's methods that compute them."""
    for name, per_row in (("log-probabilities", log_probs), ("values", values)):
        if tuple(per_row.shape) != (count,):
            fail(
                f"the rollout's act gives {name} of shape {tuple(per_row.shape)} for {count} "
                f"observations: {methods} must give one per row"
            )


def check_minibatch_scores(log_probs: torch.Tensor, values: torch.Tensor, minibatch: dict) -> None:
    """Stop unless the Agent scored a minibatch with one log-probability and one value per row that
    the minibatch holds (an edit may change what a row is in one place and not the other)."""
    if log_probs.shape != minibatch["log_probs"].shape or values.shape != minibatch["values"].shape:
        fail(
            f"Agent.get_action_and_value gives {tuple(log_probs.shape)} log-probabilities and "
            f"{tuple(values.shape)} values for a minibatch of "
            f"{tuple(minibatch['log_probs'].shape)}: it and minibatches() must agree on what a "
            "minibatch holds"
        )


def check_minibatch_cut(local_sizes: list[int], order_length: int) -> None:
    """Stop unless this rank's minibatch sizes cut an epoch's order into non-empty pieces. The
    sizes may differ by rank, so the rank that meets it says so."""
    if sum(local_sizes) != order_length or min(local_sizes) < 1:
        fail(
            f"this rank's minibatch sizes {local_sizes} do not cut an epoch's order of "
            f"{order_length} into non-empty pieces: main's orders and minibatch_sizes must count "
            "the same things (samples, or whole envs for sequences), at least one per minibatch",
            any_rank=True,
        )


def digest(data: bytes) -> int:
    """A 63-bit digest of `data`, to compare across ranks in an int64 tensor."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


def check_in_sync(
    iteration: int, unit: str, module: nn.Module, *optimizers: torch.optim.Optimizer, args=None
) -> None:
    """Stop every rank unless all hold the same training state: the module's parameters and buffers,
    each optimizer's options (its learning rate, say), and the numbers among `args` (a coefficient
    an edit changes as it trains), by checksums of each, in one gather. The message names what
    differs and whether those parameters' gradients were averaged in the last step (then alike on
    every rank), so it blames the right thing."""
    state = dict(module.named_parameters()) | dict(module.named_buffers())
    gradients = {name: p.grad for name, p in module.named_parameters()}
    numbers = {
        "the optimizer's options": [
            value for optimizer in optimizers for group in optimizer.param_groups
            for value in group.values()
        ],
        "the numbers in args": list(vars(args).values()) if args is not None else [],
    }  # fmt: skip
    numbers = {
        what: torch.tensor(
            [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)],
            dtype=torch.float64,
        )
        for what, values in numbers.items()
    }
    checked = [*state.items(), *numbers.items()]
    checked += [(f"{name}.grad", gradient) for name, gradient in gradients.items()]
    checksums = collectives.gather_ints_to_all(
        [
            0 if t is None else digest(t.detach().double().cpu().numpy().tobytes())
            for _, t in checked
        ],
        next(module.parameters()).device,
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    same = checksums.eq(checksums[rank])
    # the state decides; the gradients only explain (with --sync gather rank 0 alone has them)
    differ = (~same[:, : len(state) + len(numbers)].all(1)).nonzero().flatten().tolist()
    if not differ:
        return
    names = [
        name for (name, _), alike in zip(checked, same.all(0).tolist(), strict=True) if not alike
    ]
    differing = [name for name in names if not name.endswith(".grad")]
    unaveraged = [name.removesuffix(".grad") for name in names if name.endswith(".grad")]
    averaged = [name for name in differing if name in gradients and gradients[name] is not None]
    shown_names = ", ".join(differing[:4]) + (
        f" and {len(differing) - 4} more" if len(differing) > 4 else ""
    )
    if unaveraged:
        blame = (
            f"the gradients of {', '.join(unaveraged[:4])} differed in the last step, so they were "
            "not averaged: an edit of the update that skips or changes the gradients' allreduce "
            "for some parameters"
        )
    elif averaged:
        blame = (
            "their gradients were averaged in the last step, so they diverged elsewhere: a "
            "number computed from this rank's data alone (a KL coefficient from the local KL), "
            "a per-rank optimizer option, a random draw in the update that differs by rank, or a "
            "faulty node"
        )
    else:
        blame = (
            "likely a number computed from this rank's data alone (a KL coefficient from the "
            "local KL), a per-rank option, or a faulty node"
        )
    fail(
        f"the training state of ranks {differ} differs from this rank's at {unit} {iteration} "
        f"({shown_names}): the ranks no longer train one model. Likely causes: {blame}. One "
        "launch trains one model, its gradients averaged; to sweep a number, start one launch "
        "per value. Undo that edit (python -m ddrl.verify checks a copy), then resume from the "
        "last checkpoint with --resume"
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
        fail(
            f"--capture-video cannot render a frame ({first_line(error)}): for MuJoCo without a "
            "display use MUJOCO_GL=egl (apt-get install libegl1) or MUJOCO_GL=osmesa (apt-get "
            "install libosmesa6); for classic-control envs pip install pygame; or drop "
            "--capture-video"
        )
