"""Whether every rank holds the same: the command (the script, ddrl and the arguments, from the
same checkpoint) once at start, and the training state (weights, statistics, optimizer options,
numbers in args) every --check-sync-every iterations; each by checksums in one gather, and a rank
that differs stops every rank in one line naming what differs and the likely cause."""

import hashlib
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

from ddrl import collectives, failures
from ddrl.failures import fail


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
    rank = collectives.rank_in()
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


def check_same_command(script: str, args, resumed_iteration: int, device: torch.device) -> None:
    """Stop every rank unless all run the same script and ddrl with the same arguments from the same
    checkpoint (`resumed_iteration`: its iteration, 0 for none)."""
    arguments = digest(repr(sorted(asdict(args).items())).encode())
    table = collectives.gather_ints_to_all(
        [*source_digests(script), arguments, resumed_iteration], device
    )
    for column, problem, fix in (
        (
            0,
            f"run a different copy of {failures.script} than rank 0",
            "copy the same script to every node",
        ),
        (1, "run a different version of ddrl than rank 0", "install the same ddrl on every node"),
        (
            2,
            "were given different arguments than rank 0",
            "launch every rank with the same command line",
        ),
        (
            3,
            "resume from a different checkpoint than rank 0",
            "put runs/ on a filesystem every node shares",
        ),
    ):
        if differ := (table[:, column] != table[0, column]).nonzero().flatten().tolist():
            fail(f"ranks {differ} {problem}; {fix}")


def source_digests(script: str) -> list[int]:
    """Digests of the script's text and of ddrl's, which every rank must share."""
    package = b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py")))
    return [digest(Path(script).read_bytes()), digest(package)]


def digest(data: bytes) -> int:
    """A 63-bit digest of `data`, to compare across ranks in an int64 tensor."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1
