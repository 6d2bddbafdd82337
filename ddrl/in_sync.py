"""Whether every rank holds the same, by checksums in one gather: the command at start, and the
training state every --check-sync-every iterations; a rank that differs stops every rank."""

import hashlib
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ddrl import collectives, failures, training_state
from ddrl.failures import fail


def check_in_sync(iteration: int, unit: str, frame, args, device: torch.device) -> None:
    """Stop every rank unless all hold the same training state as `frame` (main's) finds it, naming
    what differs and whether its gradients were averaged in the last step."""
    state = training_state.found(frame, args)
    checked = [*state.tensors.items(), *state.numbers.items()]
    gradients = list(state.gradients.items())
    table = collectives.gather_ints_to_all(
        [checksum(value) for _, value in checked + gradients], device
    )
    same = table.eq(table[collectives.rank_in()])
    # the state decides; the gradients only explain (with --sync gather rank 0 alone has them)
    differ = (~same[:, : len(checked)].all(1)).nonzero().flatten().tolist()
    if not differ:
        return
    alike = same.all(0).tolist()
    names = [name for name, _ in checked + gradients]
    differing = [names[i] for i in range(len(checked)) if not alike[i]]
    # a gradient tells only where every rank holds one (under --sync gather rank 0 alone does)
    held = table.ne(0).all(0).tolist()
    gradients_apart = [
        names[i] for i in range(len(checked), len(names)) if held[i] and not alike[i]
    ]
    unaveraged = [name for name in gradients_apart if name in differing]
    averaged = [name for name in differing if state.gradients.get(name) is not None]
    shown_names = ", ".join(differing[:4]) + (
        f" and {len(differing) - 4} more" if len(differing) > 4 else ""
    )
    if unaveraged:
        blame = (
            f"the gradients of {', '.join(unaveraged[:4])} differed in the last step, so they were "
            "not averaged: an edit of the update that skips or changes the gradients' allreduce "
            "for some parameters (every parameter an optimizer steps belongs in it; under DDP, "
            "every module run through the model DDP wraps)"
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
            "a number computed from this rank's data alone (a KL coefficient from the local KL, "
            "statistics of this rank's observations: take the world's, collectives.allreduce_mean "
            "or moments_over_ranks), a per-rank option, or a faulty node"
        )
    fail(
        f"the training state of ranks {differ} differs from this rank's at {unit} {iteration} "
        f"({shown_names}): the ranks no longer train one model. Likely causes: {blame}. One "
        "launch trains one model, its gradients averaged; to sweep a number, start one launch "
        "per value. Mend the copy (docs/changing-a-script.md), then resume from the last "
        "checkpoint with --resume"
    )


def checksum(value: torch.Tensor | float | None) -> int:
    """A 63-bit checksum of a tensor's bytes, a number's float64 bits, or 0 for None."""
    if value is None:
        return 0
    if isinstance(value, float):
        return int(np.float64(value).view(np.int64))
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return digest(data)


def check_same_command(script: str, args, resumed_iteration: int, device: torch.device) -> None:
    """Stop every rank unless all run the same script, ddrl, arguments and `resumed_iteration`."""
    arguments = digest(repr(sorted(asdict(args).items())).encode())
    table = collectives.gather_ints_to_all(
        [*source_digests(script), arguments, resumed_iteration], device
    )
    problems = (
        (
            f"run a different copy of {failures.script} than rank 0",
            "copy the same script to every node",
        ),
        ("run a different version of ddrl than rank 0", "install the same ddrl on every node"),
        (
            "were given different arguments than rank 0",
            "launch every rank with the same command line",
        ),
        (
            "resume from a different checkpoint than rank 0",
            "put runs/ on a filesystem every node shares",
        ),
    )
    for column, (problem, fix) in enumerate(problems):
        if differ := (table[:, column] != table[0, column]).nonzero().flatten().tolist():
            fail(f"ranks {differ} {problem}; {fix}")


def source_digests(script: str) -> list[int]:
    """Digests of the script's text and of ddrl's, which every rank must share."""
    package = b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py")))
    return [digest(Path(script).read_bytes()), digest(package)]


def digest(data) -> int:
    """A 63-bit digest of `data`, to compare across ranks in an int64 tensor."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1
