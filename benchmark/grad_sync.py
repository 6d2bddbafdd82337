"""Time per gradient sync of each script's model on N ranks (gloo process groups on this machine).

    python -m benchmark.grad_sync --nprocs 2 --repeats 50 --out benchmark/results/grad_sync

The models are the scripts' own: `vpg_mpi.Agent` and `ppo_continuous_mpi.Agent` (64-64 tanh MLPs, HalfCheetah's
17-dim observations and 6-dim actions) and `ppo_atari_multigpu.Agent` (Nature CNN, 4 actions). Methods:

- per-parameter: one `all_reduce` per gradient tensor, then divide (SpinningUp's mpi_avg_grads pattern);
- flat: concatenate the gradients, one `all_reduce`, copy back (what vpg_mpi.py and ppo_continuous_mpi.py do);
- DDP: median time of forward+backward through DistributedDataParallel minus the median of the same
  forward+backward on the unwrapped model, on each script's local minibatch (what ppo_atari_multigpu.py does;
  DDP overlaps its bucketed allreduce with backward, so this is the sync time that backward does not hide);
- gather+broadcast (vpg only, `--sync gather`): `vpg_mpi.gather_to_learner` of a rollout batch of 4000/N samples
  to rank 0 plus `vpg_mpi.broadcast_parameters` of the weights, once per epoch.

Each repetition starts after a barrier; a repetition's time is the slowest rank's. The table gives the median,
the 10th-90th percentiles and the mean over repetitions, and the cost per iteration at the scripts' defaults (mean
times syncs: time adds up, so a minority of slow syncs counts in full). Before
timing, every method's result is checked against an all_gather reference (the averaged gradient; the gathered
batch and broadcast weights).
"""

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import tyro

from benchmark.common import (
    ROOT,
    check_load,
    markdown_table,
    mpirun_launcher,
    output_paths,
    results_header,
)

MODELS = ("vpg", "ppo_continuous", "atari")
MPI = None  # mpi4py's MPI module in a rank that mpirun started (--mpi)
OBS_DIM, ACTION_DIM, ATARI_ACTIONS = 17, 6, 4  # HalfCheetah; Breakout
VPG_STEPS_PER_EPOCH = 4000  # vpg_mpi.py's global default, split over the ranks
# gradient syncs per iteration (epoch) at the scripts' defaults
SYNCS_PER_ITERATION = {"vpg": 1 + 80, "ppo_continuous": 32 * 10, "atari": 4 * 4}


@dataclass
class Args:
    nprocs: int = 2
    """ranks (spawned processes joined in a gloo group)"""
    models: tuple[str, ...] = MODELS
    """which models: vpg, ppo_continuous, atari"""
    repeats: int = 50
    """timed repetitions per method"""
    warmup: int = 5
    """untimed repetitions before them"""
    mlp_batch: int = 64
    """local minibatch of ppo_continuous_mpi.py for the DDP timing (its default: 2048 steps / 32 minibatches)"""
    cnn_batch: int = 256
    """local minibatch of ppo_atari_multigpu.py for the DDP timing (its default: 8 envs x 128 steps / 4)"""
    mpi: bool = True
    """start the ranks with mpirun and add MPI rows (mpi4py) beside gloo's; --no-mpi spawns them, gloo only"""
    threads: int = 0
    """torch threads per rank; 0 = usable cores / nprocs, as the scripts do"""
    out: Path = Path("benchmark_results/grad_sync")
    """output stem: writes OUT.md"""
    notes: tuple[str, ...] = ()
    """paragraphs of prose under the header of the markdown file (what was run, how and why); the command shown there
    leaves them out"""
    max_load: float = 1.0
    """above this 1-minute load average at the start, the results file opens with a MEASURED UNDER LOAD warning"""


class LossOf(nn.Module):
    """A script's Agent behind one `forward` returning a PPO/VPG-like scalar loss, so DDP can wrap it."""

    def __init__(self, name: str, agent: nn.Module):
        super().__init__()
        self.name, self.agent = name, agent

    def forward(self, obs: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor):
        if self.name == "vpg":
            log_prob, _ = self.agent.log_prob_entropy(obs, actions)
            value = self.agent.value(obs)
        elif self.name == "ppo_continuous":
            log_prob, _, value = self.agent.log_prob_entropy_value(obs, actions)
        else:
            log_prob, _, value = self.agent(obs, actions)
        return -(log_prob * advantages).mean() + 0.5 * ((value - returns) ** 2).mean()


def build(name: str, batch: int, rank: int) -> tuple[LossOf, tuple[torch.Tensor, ...]]:
    """The script's Agent (same initial weights on every rank) wrapped in LossOf, and a random local batch."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    torch.manual_seed(0)
    if name == "vpg":
        import gymnasium as gym

        import vpg_mpi

        agent = vpg_mpi.Agent(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32), (64, 64))
    elif name == "ppo_continuous":
        import ppo_continuous_mpi

        agent = ppo_continuous_mpi.Agent(OBS_DIM, ACTION_DIM)
    else:
        import ppo_atari_multigpu

        agent = ppo_atari_multigpu.Agent(ATARI_ACTIONS)
    generator = torch.Generator().manual_seed(1 + rank)
    if name == "atari":
        obs = torch.randint(0, 256, (batch, 4, 84, 84), dtype=torch.uint8, generator=generator)
        actions = torch.randint(0, ATARI_ACTIONS, (batch,), generator=generator)
    else:
        obs = torch.randn(batch, OBS_DIM, generator=generator)
        actions = torch.randn(batch, ACTION_DIM, generator=generator)
    advantages, returns = torch.randn(2, batch, generator=generator)
    return LossOf(name, agent), (obs, actions, advantages, returns)


def allreduce_per_parameter(parameters: list[nn.Parameter]) -> None:
    """Average the gradients with one all_reduce per tensor."""
    for parameter in parameters:
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()


def allreduce_flat(parameters: list[nn.Parameter], mpi=None) -> None:
    """Average the gradients with one all_reduce of one flat buffer, copied back; with `mpi` (mpi4py's MPI module),
    MPI's in-place Allreduce on a numpy view of the buffer instead of gloo's."""
    flat = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
    if mpi is not None:
        mpi.COMM_WORLD.Allreduce(mpi.IN_PLACE, flat.numpy(), op=mpi.SUM)
    else:
        dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for parameter in parameters:
        parameter.grad.copy_(flat[offset : offset + parameter.numel()].view_as(parameter))
        offset += parameter.numel()


def backward(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Zero the gradients, then forward and backward through `module` (a LossOf, plain or DDP-wrapped)."""
    module.zero_grad(set_to_none=False)
    module(*inputs).backward()


def flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([parameter.grad.reshape(-1) for parameter in module.parameters()])


def world_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Reference mean over ranks via all_gather (no all_reduce: independent of the methods under test)."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor)
    return torch.stack(pieces).double().mean(0).float()


def timed(function: Callable[[], None], mpi_barrier: bool = False) -> float:
    """Seconds `function` takes, started after a barrier (MPI's for an MPI method: gloo's barrier wakes its waiters
    late and unevenly, a skew that the MPI method would then time as its own waiting)."""
    MPI.COMM_WORLD.Barrier() if mpi_barrier else dist.barrier()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def slowest(times: list[float]) -> list[float]:
    """Each repetition's time on the slowest rank."""
    tensor = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def summary(times: list[float]) -> dict[str, float]:
    """Median, 10th/90th percentiles and mean in milliseconds (the mean is what a run of many syncs pays: a few
    slow ones among fast ones move it and not the median)."""
    p10, p90 = np.percentile(times, [10, 90])
    return {
        "median_ms": 1e3 * statistics.median(times),
        "p10_ms": 1e3 * p10,
        "p90_ms": 1e3 * p90,
        "mean_ms": 1e3 * statistics.fmean(times),
    }


def vpg_gather_batch(rank: int) -> dict[str, torch.Tensor]:
    """A rollout batch of one rank in vpg_mpi.py's layout (HalfCheetah sizes, 4000/N samples)."""
    n = VPG_STEPS_PER_EPOCH // dist.get_world_size()
    generator = torch.Generator().manual_seed(100 + rank)
    return {
        "obs": torch.randn(n, OBS_DIM, generator=generator),
        "actions": torch.randn(n, ACTION_DIM, generator=generator),
        **{key: torch.randn(n, generator=generator) for key in ("log_probs", "values", "advantages", "returns")},
    }


def measure_model(name: str, args: Args, rank: int) -> list[dict]:
    """Check, then time, every method that applies to model `name`; one dict per method (rank 0's copy counts)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batch = {"vpg": VPG_STEPS_PER_EPOCH // dist.get_world_size(), "ppo_continuous": args.mlp_batch}.get(
        name, args.cnn_batch
    )
    module, inputs = build(name, batch, rank)
    ddp = DDP(module, broadcast_buffers=False)
    parameters = list(module.parameters())
    backward(module, inputs)
    local = flat_grads(module).clone()
    reference = world_mean(local)

    def grads_match() -> bool:
        return torch.allclose(flat_grads(module), reference, rtol=1e-4, atol=1e-6)

    checks = {}
    allreduce_per_parameter(parameters)
    checks["per-parameter"] = grads_match()
    backward(module, inputs)
    allreduce_flat(parameters)
    checks["flat"] = grads_match()
    if MPI is not None:
        backward(module, inputs)
        allreduce_flat(parameters, MPI)
        checks["flat, MPI"] = grads_match()
    backward(ddp, inputs)
    checks["DDP"] = grads_match()

    def restore_local() -> None:  # keep the buffers' values bounded and realistic between repetitions
        offset = 0
        for parameter in parameters:
            parameter.grad.copy_(local[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()

    methods: dict[str, tuple[str, Callable[[], None]]] = {
        "per-parameter": (
            f"{len(parameters)} all_reduce calls on the gradients",
            lambda: allreduce_per_parameter(parameters),
        ),
        "flat": ("cat + one all_reduce + copy back", lambda: allreduce_flat(parameters)),
    }
    if MPI is not None:
        methods["flat, MPI"] = (
            "cat + one MPI Allreduce (mpi4py, in place on a numpy view) + copy back",
            lambda: allreduce_flat(parameters, MPI),
        )
    if name == "vpg":
        import vpg_mpi

        rollout = vpg_gather_batch(rank)
        expected = {key: torch.cat(world_gather(value)) for key, value in rollout.items()}

        def is_union(union: dict[str, torch.Tensor] | None) -> bool:  # None: not the learner
            return union is None or all(torch.equal(union[key], value) for key, value in expected.items())

        checks["gather+broadcast"] = is_union(vpg_mpi.gather_to_learner(rollout))
        agent = module.agent
        if rank:
            with torch.no_grad():
                for parameter in agent.parameters():
                    parameter.add_(1.0)
        vpg_mpi.broadcast_parameters(agent)
        weights = torch.cat([parameter.detach().reshape(-1) for parameter in agent.parameters()])
        checks["gather+broadcast"] &= all(torch.equal(piece, weights) for piece in world_gather(weights))
        methods["gather+broadcast"] = (
            f"gather_to_learner of {sum(value.numel() for value in rollout.values())} numbers per rank (as float64) + "
            "broadcast_parameters",
            lambda: (vpg_mpi.gather_to_learner(rollout), vpg_mpi.broadcast_parameters(agent)),
        )
        if MPI is not None:  # the script's own functions, with its collectives routed as --collectives mpi does
            methods["gather+broadcast, MPI"] = (
                "the same through MPI (vpg_mpi.MPIWorld set, as under mpirun)",
                lambda: through_script_mpi(
                    vpg_mpi, lambda: (vpg_mpi.gather_to_learner(rollout), vpg_mpi.broadcast_parameters(agent))
                ),
            )
            checks["gather+broadcast, MPI"] = is_union(
                through_script_mpi(vpg_mpi, lambda: vpg_mpi.gather_to_learner(rollout))
            )

    rows = []
    for method, (what, function) in methods.items():
        for _ in range(args.warmup):
            restore_local()
            timed(function, method.endswith("MPI"))
        times = []
        for _ in range(args.repeats):
            restore_local()
            times.append(timed(function, method.endswith("MPI")))
        rows.append({"method": method, "what": what, **summary(slowest(times))})

    # DDP: forward+backward with and without it, interleaved so that both see the same machine
    plain_times, ddp_times = [], []
    for repeat in range(args.warmup + args.repeats):
        plain = timed(lambda: backward(module, inputs))
        wrapped = timed(lambda: backward(ddp, inputs))
        if repeat >= args.warmup:
            plain_times.append(plain)
            ddp_times.append(wrapped)
    plain_summary, ddp_summary = summary(slowest(plain_times)), summary(slowest(ddp_times))
    rows.append(
        {
            "method": "DDP",
            "what": f"forward+backward of a {batch}-sample minibatch through DDP ({ddp_summary['median_ms']:.2f} ms) "
            f"minus without DDP ({plain_summary['median_ms']:.2f} ms)",
            "median_ms": ddp_summary["median_ms"] - plain_summary["median_ms"],
            "p10_ms": float("nan"),
            "p90_ms": float("nan"),
            "mean_ms": ddp_summary["mean_ms"] - plain_summary["mean_ms"],
        }
    )
    ok = torch.tensor([all(checks.values())], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    numel = sum(parameter.numel() for parameter in parameters)
    for row in rows:
        row.update(model=name, parameters=numel, tensors=len(parameters), checked=bool(ok.item()))
    return rows


def through_script_mpi(script, function: Callable[[], object]) -> object:
    """Call `function` with `script`'s CPU collectives routed through MPI, as `--collectives mpi` routes them."""
    script.MPIWorld.mpi, script.MPIWorld.comm = MPI, MPI.COMM_WORLD
    try:
        return function()
    finally:
        script.MPIWorld.mpi = script.MPIWorld.comm = None


def world_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor)
    return pieces


def worker(rank: int, world_size: int, init_file: str, args_dict: dict, result_path: str) -> None:
    """One rank: join the gloo group, measure every model, rank 0 writes the rows as JSON. Under mpirun (--mpi) MPI
    is initialised too, for the MPI rows."""
    global MPI
    args = Args(**args_dict)
    if args.mpi:
        from mpi4py import MPI
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(args.threads or max(1, usable // world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        rows = [row for name in args.models for row in measure_model(name, args, rank)]
        if rank == 0:
            Path(result_path).write_text(json.dumps(rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()  # as the scripts do: DDP's gloo threads left to interpreter shutdown can abort the rank (SIGABRT)


def format_table(rows: list[dict]) -> str:
    """The results table: one row per (model, method)."""
    labels = {
        "vpg": "vpg_mpi.Agent (64-64 MLPs)",
        "ppo_continuous": "ppo_continuous_mpi.Agent (64-64 MLPs)",
        "atari": "ppo_atari_multigpu.Agent (Nature CNN)",
    }
    table = []
    for row in rows:
        syncs = 1 if row["method"].startswith("gather+broadcast") else SYNCS_PER_ITERATION[row["model"]]
        spread = "" if np.isnan(row["p10_ms"]) else f" ({row['p10_ms']:.2f}-{row['p90_ms']:.2f})"
        table.append(
            [
                labels[row["model"]],
                f"{row['parameters']:,} in {row['tensors']} tensors",
                row["method"],
                f"{row['median_ms']:.2f}{spread}",
                f"{row['mean_ms']:.2f}",
                syncs,
                f"{row['mean_ms'] * syncs:.1f}",
                "yes" if row["checked"] else "NO",
                row["what"],
            ]
        )
    headers = [
        "model",
        "parameters",
        "method",
        "ms per sync, median (p10-p90)",
        "ms per sync, mean",
        "syncs per iteration",
        "ms per iteration (mean x syncs)",
        "result checked",
        "what is timed",
    ]
    return markdown_table(headers, table)


def main(argv: list[str] | None = None) -> Path:
    """Spawn the ranks, measure, write OUT.md; returns its path."""
    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv, description=__doc__)
    if args.nprocs < 2 or args.repeats < 1 or any(name not in MODELS for name in args.models):
        raise SystemExit(f"benchmark.grad_sync: error: need --nprocs >= 2, --repeats >= 1, models among {MODELS}")
    load_before, warning = check_load(args.max_load)
    with tempfile.TemporaryDirectory(prefix="ddrl_grad_sync_") as tmp:
        result_path = Path(tmp) / "rows.json"
        plain_args = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(args).items()}
        worker_args = (str(Path(tmp) / "store"), plain_args, str(result_path))
        if args.mpi:  # each rank calls worker() with its MPI rank
            rank = "int(os.environ['OMPI_COMM_WORLD_RANK'])"
            code = f"import os; from benchmark.grad_sync import worker; worker({rank}, {args.nprocs}, *{worker_args!r})"
            command = [*mpirun_launcher(args.nprocs), "-c", code]
            subprocess.run(command, cwd=ROOT, check=True)
        else:
            mp.start_processes(worker, args=(args.nprocs, *worker_args), nprocs=args.nprocs, start_method="spawn")
        rows = json.loads(result_path.read_text())
    if not all(row["checked"] for row in rows):
        print("benchmark.grad_sync: warning: a method's result did not match the all_gather reference", file=sys.stderr)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    facts = [
        f"{args.nprocs} ranks ({'by mpirun' if args.mpi else 'spawned'}; gloo, and MPI where a method says so), "
        f"{args.threads or max(1, usable // args.nprocs)} torch "
        f"thread(s) each; {args.repeats} timed repetitions after {args.warmup} warm-up ones, each after a barrier, "
        "each counted on the slowest rank",
        "syncs per iteration at the scripts' defaults: vpg_mpi.py 1 policy + 80 value steps per epoch with "
        "--sync allreduce, one gather+broadcast per epoch with --sync gather; ppo_continuous_mpi.py 32 "
        "minibatches x 10 epochs; ppo_atari_multigpu.py 4 minibatches x 4 epochs (each sync here covers the "
        "whole model; vpg_mpi.py's policy step syncs only the policy's gradient and its value steps only the "
        "critic's, about half the floats, so its per-iteration figures are an upper bound)",
        "DDP rows for the MLPs show what DDP would cost there; only ppo_atari_multigpu.py uses DDP",
        f"load average (1, 5, 15 min) before the measurement: {load_before}",
    ]
    table_path, _ = output_paths(args.out)
    text = results_header("Gradient sync: time per sync", "benchmark.grad_sync", argv, facts, args.notes, warning)
    table_path.write_text(text + "\n" + format_table(rows))
    print(table_path.read_text())
    return table_path


if __name__ == "__main__":
    main()
