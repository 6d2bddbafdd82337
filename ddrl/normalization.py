"""Running statistics of every rank's data, as buffers of the Agent that normalises with them (so
they are checkpointed, resumed and checked in sync with its weights): CleanRL's observation
normalisation and reward scaling, merged from the world's moments rather than one env's."""

import torch
import torch.nn as nn

NORM_CLIP = 10.0  # clipped to +-10, as CleanRL's wrappers clip
NORM_EPS = 1e-8


class RunningMeanStd(nn.Module):
    """Running mean and population variance in float64 buffers, empty at first (no pseudo-count);
    data is normalised with float32 copies of the mean and the std, kept up to date."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("shift", torch.zeros(shape), persistent=False)
        self.register_buffer("scale", torch.ones(shape), persistent=False)
        self.register_load_state_dict_pre_hook(refuse_impossible_statistics)
        self.register_load_state_dict_post_hook(lambda module, keys: module.refresh())

    @torch.no_grad()
    def update(self, count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Merge a batch's moments (parallel variance update) into the statistics of all data."""
        total = self.count + count
        delta = mean - self.mean
        self.var.copy_((self.var * self.count + m2 + delta**2 * self.count * count / total) / total)
        self.mean += delta * count / total
        self.count.copy_(total)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        self.shift.copy_(self.mean)
        self.scale.copy_(torch.sqrt(self.var + NORM_EPS))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """`x` standardised with these statistics, clipped."""
        return torch.clamp((x - self.shift) / self.scale, -NORM_CLIP, NORM_CLIP)


def refuse_impossible_statistics(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """Refuse what no data gives: a count below 1 (but an untrained Agent's), a variance below 0."""
    count = state_dict.get(f"{prefix}count")
    mean = state_dict.get(f"{prefix}mean")
    var = state_dict.get(f"{prefix}var")
    if count is None or mean is None or var is None:  # load_state_dict names what is missing
        return
    empty = count == 0 and bool((mean == 0).all() and (var == 1).all())
    if not (count >= 1 or empty):
        raise ValueError(
            f"its {prefix}count is {count.item():g}, where data counts at least 1 sample"
        )
    if not (var >= 0).all():
        raise ValueError(f"its {prefix}var holds negative numbers, where a variance is at least 0")
