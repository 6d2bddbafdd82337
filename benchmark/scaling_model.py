"""A paper model of each sync mode's efficiency at more ranks than were measured, from benchmark.scaling's table.

    python -m benchmark.scaling_model --from benchmark/results/scaling.md --out benchmark/results/scaling_model

From the seconds per iteration benchmark.scaling measured at 1 and 2 ranks (rank 0's: the whole iteration, the
update, the sync within it), for every script and mode in the file, it predicts the SPS relative to 1 rank and the
efficiency at `--ranks` ranks, and the first rank count where the efficiency drops below 50%, on the assumptions
that ASSUMPTIONS states (and the output repeats).
"""

import math
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
"""per mode (DDP is modelled as allreduce, `gather mpirun` as gather): the variants of the model, and how each says
that time grows"""
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
    """A mode's measured seconds per iteration (rank 0) at 1 and 2 ranks."""

    iteration: float
    """the 1-rank iteration: global batch / SPS"""
    update: float
    """the 1-rank update, its sync included"""
    sync1: float
    """the 1-rank sync (collectives on a world of one; with DDP, the backward passes too)"""
    sync2: float
    """the 2-rank sync"""
    update2: float
    """the 2-rank update, its sync included"""
    efficiency2: float
    """the measured 2-rank efficiency"""

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
    mode, ranks, batch, sps, _, _, efficiency_, _, update, sync = TABLE_HEADERS.split(" | ")
    rows: dict[tuple[str, str], dict[int, dict[str, str]]] = {}
    script, headers = "", None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("## "):
            script = line[3:].split(" on ")[0]
        elif not line.startswith("|"):
            headers = None  # a table ends at the first line that is not a row
        elif cells[0] == mode:
            headers = cells
        elif headers and not set(line) <= set("|:- "):  # a body row, not the alignment line
            row = dict(zip(headers, cells, strict=True))
            rows.setdefault((script, row[mode]), {})[int(row[ranks])] = row

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


def sync_growth(ranks: int, law: Variant, bandwidth_share: float) -> float:
    """g(N): an allreduce's time at N ranks in units of its time at 2 (g(2) = 1), as ASSUMPTIONS derives it."""
    latency = ranks - 1 if law == "gloo" else math.log2(ranks)
    return (1 - bandwidth_share) * latency + bandwidth_share * 2 * (ranks - 1) / ranks


def iteration_seconds(seconds: Seconds, mode: str, ranks: int, variant: Variant, bandwidth_share: float) -> float:
    """T(N), rank 0's predicted seconds per iteration at `ranks` ranks (weak scaling), as ASSUMPTIONS says: in
    allreduce (and DDP) the communication the second rank added grows by `sync_growth`; in gather rank 0's update
    grows with the world batch and the gather and broadcast by one peer's share per rank."""
    outside_update = seconds.iteration - seconds.update
    if mode.split()[0] == "gather":
        per_rank = seconds.learner if variant == "linear" else max(seconds.learner2 - seconds.learner, 0.0)
        learner = seconds.learner + per_rank * (ranks - 1)
        return outside_update + learner + seconds.sync1 + seconds.added * (ranks - 1)
    return outside_update + seconds.update + seconds.added * sync_growth(ranks, variant, bandwidth_share)


def efficiency(seconds: Seconds, mode: str, ranks: int, variant: Variant, bandwidth_share: float) -> float:
    """T(1) / T(N): the predicted speedup over 1 rank divided by N."""
    return seconds.iteration / iteration_seconds(seconds, mode, ranks, variant, bandwidth_share)


def stops_paying(seconds: Seconds, mode: str, variant: Variant, bandwidth_share: float) -> int | None:
    """The fewest ranks whose efficiency is below 50% (efficiency falls with N in every mode), None up to 2^30."""

    def pays(ranks: int) -> bool:
        return efficiency(seconds, mode, ranks, variant, bandwidth_share) >= STOPS_PAYING

    if pays(MAX_RANKS):
        return None
    low, high = 1, 2
    while pays(high):
        low, high = high, high * 2
    while high - low > 1:  # pays(low), not pays(high)
        middle = (low + high) // 2
        low, high = (middle, high) if pays(middle) else (low, middle)
    return high


ASSUMPTIONS = """\
## Assumptions

Weak scaling (each rank keeps its batch), rank 0's seconds per iteration. T(1) is the measured 1-rank iteration
(global batch / SPS, iterations 2..); u and s are its update and the sync within it; c = sync(2 ranks) - sync(1 rank)
is the communication the second rank added (at 1 rank the sync is collectives on a world of one; for DDP it also
holds the backward passes, which the difference removes). The prediction at N ranks is T(N); the efficiency
T(1) / T(N) and the SPS relative to 1 rank N x T(1) / T(N), as in the measured table.

- **allreduce** (and DDP): T(N) = T(1) + c x g(N). Rollout, GAE, logging and the local update stay as at 1 rank. A
  ring allreduce of B bytes takes 2(N-1) steps of B/N bytes each: 2(N-1)/N x B / bandwidth + latency x 2(N-1).
  Gloo runs rings on CPU, so its latency term grows with N-1; NCCL switches small messages to (double binary)
  trees, whose latency grows with log2 N. So g(N) = (1 - beta) x h(N) + beta x 2(N-1)/N with h(N) = N-1 (gloo) or
  log2 N (NCCL), and beta = {beta} the share of c that is bandwidth. Every term is 1 at N = 2, so the model
  reproduces the measured 2-rank sync. The MLPs' flat gradients are tens of kB, latency-bound, hence beta = 0 by
  default; whatever the share, the bandwidth term at most doubles (2(N-1)/N < 2), while gloo's latency term grows
  without bound. Under mpirun (`allreduce mpirun`) the flat gradient allreduce is Open MPI's on one node: its tuned
  component takes recursive doubling for messages this small, log2 N rounds of the whole buffer through shared
  memory, so h(N) = log2 N as for NCCL; were it to pick a ring, it would grow as gloo's (N-1), from a c several
  times smaller.
- **gather** (either launcher): T(N) = T(1) - u + L(N) + s + c x (N-1). Rollout, GAE and logging stay as at 1 rank;
  rank 0 learns alone on the N ranks' rollouts, in L(N) seconds. Two variants. *update x N*: the learner's update
  grows linearly with the world batch, L(N) = N x (u - s), the 1-rank learner update per rank. That is the
  pessimistic case: an update of a fixed number of minibatches (PPO) or full-batch steps (VPG) costs partly per
  step, whatever the batch, until the batches grow large. *fitted*: L(N) = (u - s) + (L(2) - (u - s)) x (N-1), the
  fixed and the per-rank part fitted to the learner update measured at 1 and 2 ranks (the inputs give L(2) / L(1)):
  the optimistic case, as the per-sample cost only grows in share with the batch. Rank 0 receives N-1 rollouts and
  the weights' broadcast is taken to cost one send per peer (gloo), so the gather and broadcast grow with N-1; a
  tree broadcast would grow with log2 N, which changes little where the learner's update dominates.

Not modelled: the network between nodes (c was measured between ranks on one machine; across nodes gloo over TCP
has more latency and less bandwidth, NCCL over InfiniBand less latency), stragglers (the slowest of N rollouts sets
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
    warning = (
        "MEASURED UNDER LOAD" in text
        and f"THE INPUT WAS MEASURED UNDER LOAD ({args.source} says so): so are these predictions."
    )

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
    return common.write_results(args, argv, title, facts, body, warning=warning or None)


if __name__ == "__main__":
    main()
