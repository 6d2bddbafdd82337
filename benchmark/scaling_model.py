"""A paper model of each sync mode's efficiency at more ranks than were measured, from benchmark.scaling's table.

    python -m benchmark.scaling_model --from benchmark/results/scaling.md --out benchmark/results/scaling_model

From rank 0's seconds per iteration at 1 and 2 ranks, for every script and mode: the efficiency at `--ranks` ranks
and the first rank count where it drops below 50%, on the assumptions that ASSUMPTIONS states (and the output repeats).
"""

import bisect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

from benchmark import common
from benchmark.scaling import TABLE_HEADERS

Variant = Literal["gloo", "NCCL", "MPI", "linear", "fitted"]
VARIANTS: dict[str, dict[Variant, str]] = {
    "allreduce": {"gloo": "gloo ring: latency x (N-1)", "NCCL": "NCCL tree: latency x log2 N"},
    "allreduce mpirun": {"MPI": "Open MPI, one node: latency x log2 N"},
    "gather": {
        "linear": "update x N; gather, broadcast x (N-1)",
        "fitted": "update fitted at 1, 2 ranks; gather, broadcast x (N-1)",
    },
}
"""per mode (DDP as allreduce, `gather mpirun` as gather): the model's variants, each saying how time grows"""
STOPS_PAYING = 0.5
"""the efficiency below which a mode no longer pays for its ranks"""
MAX_RANKS = 2**30
"""where the search for the 50% point gives up"""
INPUT_COLUMNS = (
    "script | mode | T(1) | u (update, 1 rank) | s (sync, 1 rank) | sync, 2 ranks | c (added by rank 2) | "
    "L(2) / L(1) (learner update)"
)
PREDICTION_COLUMNS = "script | mode | model: what grows with N | ranks | SPS relative to 1 rank | efficiency | measured"


@dataclass(kw_only=True)
class Args(common.ResultsArgs):
    source: Annotated[Path, tyro.conf.arg(name="from")] = Path("benchmark/results/scaling.md")
    """a results file of benchmark.scaling with 1- and 2-rank rows"""
    ranks: tuple[int, ...] = (8, 64, 512)
    """the rank counts to predict (2, the measured one, is shown beside its measurement)"""
    bandwidth_share: float = 0.0
    """the share of the communication measured at 2 ranks that is bandwidth (grows as 2(N-1)/N); the rest is latency"""
    out: Path = Path("benchmark_results/scaling_model")


@dataclass
class Seconds:
    """A mode's measured seconds per iteration (rank 0): the 1-rank iteration (global batch / SPS), update and sync
    (within the update; with DDP, the backward passes too), the 2-rank sync and update, and the 2-rank efficiency."""

    iteration: float
    update: float
    sync1: float
    sync2: float
    update2: float
    efficiency2: float

    @property
    def learner(self) -> float:
        """The 1-rank update without its sync (with gather: rank 0 learning on one rank's batch)."""
        return self.update - self.sync1

    @property
    def learner2(self) -> float:
        """The 2-rank update without its sync (with gather: rank 0 learning on two ranks' batches)."""
        return self.update2 - self.sync2

    @property
    def added(self) -> float:
        """c: the communication the second rank added to an iteration (never negative)."""
        return max(self.sync2 - self.sync1, 0.0)


def read_scaling(text: str) -> dict[tuple[str, str], Seconds]:
    """Every (script, mode) of a benchmark.scaling results file with both a 1- and a 2-rank row."""
    headers = TABLE_HEADERS.split(" | ")
    mode, ranks, batch, sps, _, _, efficiency_, _, update, sync = headers
    rows: dict[tuple[str, str], dict[int, dict[str, str]]] = {}
    for section in re.split("^## ", text, flags=re.MULTILINE)[1:]:  # `## SCRIPT on ENV`, then its table
        for row in (dict(zip(headers, cells, strict=True)) for cells in common.table_rows(section, mode)):
            rows.setdefault((section.split(" on ")[0], row[mode]), {})[int(row[ranks])] = row

    def number(row: dict[str, str], column: str) -> float:
        return float(row[column].replace(",", "").rstrip("%"))

    found = {}
    for (script, mode), by_ranks in rows.items():
        one = by_ranks.get(1) or rows.get((script, mode.split()[0]), {}).get(1)  # `MODE mpirun`: MODE's 1 rank
        if one and 2 in by_ranks:
            two = by_ranks[2]
            found[script, mode] = Seconds(
                iteration=number(one, batch) / number(one, sps),
                update=number(one, update),
                sync1=number(one, sync),
                sync2=number(two, sync),
                update2=number(two, update),
                efficiency2=number(two, efficiency_) / 100,
            )
    return found


def efficiency(seconds: Seconds, mode: str, ranks: int, variant: Variant, bandwidth_share: float) -> float:
    """T(1) / T(N), the predicted speedup over 1 rank divided by N, with T(N) as ASSUMPTIONS says."""
    outside_update = seconds.iteration - seconds.update
    if mode.split()[0] == "gather":
        per_rank = seconds.learner if variant == "linear" else max(seconds.learner2 - seconds.learner, 0.0)
        learner = seconds.learner + per_rank * (ranks - 1)
        return seconds.iteration / (outside_update + learner + seconds.sync1 + seconds.added * (ranks - 1))
    latency = ranks - 1 if variant == "gloo" else math.log2(ranks)  # g(N), an allreduce's time in units of N = 2's
    growth = (1 - bandwidth_share) * latency + bandwidth_share * 2 * (ranks - 1) / ranks
    return seconds.iteration / (outside_update + seconds.update + seconds.added * growth)


def stops_paying(seconds: Seconds, mode: str, variant: Variant, bandwidth_share: float) -> int | None:
    """The fewest ranks whose efficiency is below 50% (efficiency falls with N in every mode), None up to 2^30."""

    def stops(ranks: int) -> bool:
        return efficiency(seconds, mode, ranks, variant, bandwidth_share) < STOPS_PAYING

    first = bisect.bisect_left(range(MAX_RANKS + 1), True, lo=1, key=stops)  # a binary search: stops(N) rises with N
    return first if first <= MAX_RANKS else None


ASSUMPTIONS = """\
## Assumptions

Weak scaling (each rank keeps its batch), rank 0's seconds per iteration. T(1) is the measured 1-rank iteration
(global batch / SPS, iterations 2..); u and s are its update and the sync within it; c = sync(2 ranks) - sync(1 rank)
is the communication the second rank added (for DDP the sync also holds the backward passes, which the difference
removes). The efficiency at N ranks is T(1) / T(N), the SPS relative to 1 rank N x T(1) / T(N).

- **allreduce** (and DDP): T(N) = T(1) + c x g(N); rollout, GAE, logging and the local update stay as at 1 rank. A
  ring allreduce of B bytes takes 2(N-1) steps of B/N bytes: 2(N-1)/N x B / bandwidth + latency x 2(N-1). Gloo runs
  rings on CPU, so its latency term grows with N-1; NCCL switches small messages to trees, whose latency grows with
  log2 N. So g(N) = (1 - beta) x h(N) + beta x 2(N-1)/N with h(N) = N-1 (gloo) or log2 N (NCCL), and beta = {beta}
  the share of c that is bandwidth; every term is 1 at N = 2. The MLPs' flat gradients are tens of kB,
  latency-bound, hence beta = 0 by default; the bandwidth term at most doubles, gloo's latency term grows without
  bound. Under mpirun (`allreduce mpirun`) Open MPI's tuned allreduce takes recursive doubling for messages this
  small (log2 N rounds through shared memory), so h(N) = log2 N as for NCCL.
- **gather** (either launcher): T(N) = T(1) - u + L(N) + s + c x (N-1): rank 0 learns alone on the N ranks' rollouts
  in L(N) seconds, and receives N-1 rollouts and sends the weights to N-1 peers. *update x N*: L(N) = N x (u - s),
  linear in the world batch; pessimistic, as an update of a fixed number of minibatches (PPO) or steps (VPG) costs
  partly per step, whatever the batch. *fitted*: L(N) = (u - s) + (L(2) - (u - s)) x (N-1), its fixed and per-rank
  parts fitted at 1 and 2 ranks (the inputs give L(2) / L(1)); optimistic, as the per-sample share grows with N.

Not modelled: the network between nodes (c was measured on one machine), stragglers (the slowest of N rollouts sets
every iteration's pace; at 2 ranks the gather's wait for the slower rank is inside c), rank 0's memory for N
rollouts, contention between ranks for memory bandwidth, and hierarchical or asynchronous variants of either mode.
"""


def main(argv: list[str] | None = None) -> Path:
    """Write OUT.md: the inputs, the predictions, and where each mode stops paying; returns its path."""
    args, argv, _ = common.cli(Args, argv)
    if not 0 <= args.bandwidth_share <= 1 or not args.ranks or min(args.ranks) < 1:
        raise SystemExit("benchmark.scaling_model: error: --bandwidth-share must be in [0, 1], --ranks >= 1")
    text = args.source.read_text()
    measured = read_scaling(text)
    if not measured:
        raise SystemExit(f"benchmark.scaling_model: error: {args.source} has no script with both 1- and 2-rank rows")
    source_facts = [line[2:] for line in text.splitlines() if line.startswith(("- date:", "- machine:", "- checkout:"))]
    warning = f"THE INPUT WAS MEASURED UNDER LOAD ({args.source} says so): so are these predictions."
    warning = warning if "MEASURED UNDER LOAD" in text else None
    inputs, predictions, verdicts = [], [], []
    for (script, mode), seconds in measured.items():
        gather = mode.split()[0] == "gather"
        numbers = (seconds.iteration, seconds.update, seconds.sync1, seconds.sync2, seconds.added)
        learner_ratio = f"{seconds.learner2 / max(seconds.learner, 1e-9):.2f}" if gather else ""
        inputs.append([script, mode, *(f"{number:.3f}" for number in numbers), learner_ratio])
        kind = "gather" if gather else "allreduce mpirun" if mode.endswith("mpirun") else "allreduce"
        for variant, label in VARIANTS[kind].items():
            for ranks in sorted({2, *args.ranks}):
                eff = efficiency(seconds, mode, ranks, variant, args.bandwidth_share)
                shown = f"{seconds.efficiency2:.0%}" if ranks == 2 else ""
                predictions.append([script, mode, label, ranks, f"{ranks * eff:,.2f}", f"{eff:.0%}", shown])
            limit = stops_paying(seconds, mode, variant, args.bandwidth_share)
            where = f"below 50% from {limit:,} ranks" if limit else f"not below 50% up to {MAX_RANKS:,} ranks"
            verdicts.append(f"- {script} {mode} ({label}): {where}")
    body = "\n" + ASSUMPTIONS.format(beta=args.bandwidth_share) + "\n## Inputs (seconds per iteration, rank 0)\n\n"
    body += common.markdown_table(INPUT_COLUMNS, inputs) + "\n## Predictions\n\n"
    body += common.markdown_table(PREDICTION_COLUMNS, predictions)
    body += "\n## Where each mode stops paying (efficiency below 50%)\n\n" + "\n".join(verdicts) + "\n"
    title = "Scaling model: efficiency at more ranks, from the 1- and 2-rank measurements"
    facts = [f"input: {args.source}, measured with {'; '.join(source_facts)}"]
    return common.write_results(args, argv, title, facts, body, warning=warning)


if __name__ == "__main__":
    main()
