"""A final-return cell as benchmark.plot writes it, from per-seed final returns (for results whose run folders are
gone): `python -m benchmark.interval 1801.9 1783.8 3455.1 --seeds 1 2 3`."""

from dataclasses import dataclass

import numpy as np
import tyro

from benchmark import common
from benchmark.plot import final_returns_cell


@dataclass
class Args:
    values: tyro.conf.Positional[tuple[float, ...]]
    """each seed's final return"""
    seeds: tuple[str, ...] = ()
    """the seeds the values belong to, in the same order (default 1, 2, ...)"""
    steps: str = "?"
    """the env steps of the runs, as the cell should say them (e.g. 1,000,000)"""


def main(argv: list[str] | None = None) -> str:
    """Print the cell and return it."""
    args, _, _ = common.cli(Args, argv)
    seeds = args.seeds or tuple(str(seed) for seed in range(1, len(args.values) + 1))
    if len(seeds) != len(args.values) or not args.values:
        raise SystemExit("benchmark.interval: error: give one or more values, and as many --seeds as values")
    cell = final_returns_cell(dict(zip(seeds, np.array(args.values), strict=True)), args.steps)
    print(cell)
    return cell


if __name__ == "__main__":
    main()
