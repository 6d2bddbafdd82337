"""What a script, or a researcher's copy of it, must keep true of its Agent; each check ends in one
line that names the fix."""

import torch

from ddrl import collectives
from ddrl.failures import fail


def check_agreement(when: str, must_agree: str, **pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Stop every rank unless each pair (the Agent's numbers, the rollout's) agrees on all ranks
    within a relative 1e-3, far above float32 rounding."""
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
                "distribution and value. The rollout is derived from the Agent, so either a "
                "numpy version in ddrl/numpy_versions.py computes something else "
                "(--no-numpy-rollout runs the Agent's own code) or the Agent's numbers are not "
                "finite or not a function of its inputs alone"
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
    """Stop unless the Agent scored a minibatch with one log-probability and one value per row."""
    if log_probs.shape != minibatch["log_probs"].shape or values.shape != minibatch["values"].shape:
        fail(
            f"Agent.get_action_and_value gives {tuple(log_probs.shape)} log-probabilities and "
            f"{tuple(values.shape)} values for a minibatch of "
            f"{tuple(minibatch['log_probs'].shape)}: it and minibatches() must agree on what a "
            "minibatch holds"
        )


def check_minibatch_cut(local_sizes: list[int], order_length: int) -> None:
    """Stop unless this rank's sizes cut an epoch's order into non-empty pieces (this rank says)."""
    if sum(local_sizes) != order_length or min(local_sizes) < 1:
        fail(
            f"this rank's minibatch sizes {local_sizes} do not cut an epoch's order of "
            f"{order_length} into non-empty pieces: main's orders and minibatch_sizes must count "
            "the same things (samples, or whole envs for sequences), at least one per minibatch",
            any_rank=True,
        )
