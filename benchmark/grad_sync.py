"""Time per gradient sync of each script's model on N ranks, through the scripts' own sync functions.

    python -m benchmark.grad_sync --nprocs 2 --repeats 50 --out benchmark/results/grad_sync

Each script's Agent for its default env, with a local batch of the script's default size, on ranks mpirun starts.
Methods: per-parameter (SpinningUp's mpi_avg_grads), flat (the MLP scripts' `average_gradients`), DDP (the Atari
script's, as forward+backward through DDP minus the same without), gather+broadcast (--sync gather's traffic); the
scripts' methods again through MPI. Every method's result is checked against an all_gather reference.
"""

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from annotated_types import Ge

from benchmark import common
from ddrl import collectives, one_learner

SCRIPT_OF = {"vpg": "vpg_mpi.py", "ppo_continuous": "ppo_continuous_mpi.py", "atari": common.ATARI}
"""the models: each script's Agent"""
MPI = None  # mpi4py's MPI module, imported in a rank that mpirun started


@dataclass(kw_only=True)
class Args(common.TimingArgs):
    nprocs: Annotated[int, Ge(2)] = 2
    """ranks (started by mpirun, joined in a gloo group and MPI's world)"""
    models: tuple[Literal["vpg", "ppo_continuous", "atari"], ...] = ("vpg", "ppo_continuous", "atari")
    """which scripts' models (SCRIPT_OF)"""
    repeats: Annotated[int, Ge(1)] = 50
    """timed repetitions per method"""
    warmup: int = 5
    """untimed repetitions before them"""
    out: Path = Path("benchmark_results/grad_sync")


class LossOf(nn.Module):
    """A script's Agent behind one `forward` returning a PPO/VPG-like scalar loss, so DDP can wrap it."""

    def __init__(self, agent: nn.Module):
        super().__init__()
        self.agent = agent

    def forward(self, obs: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor):
        _, log_prob, _, value = self.agent.get_action_and_value(obs, actions)
        return -(log_prob * advantages).mean() + 0.5 * ((value.view(-1) - returns) ** 2).mean()


def build(name: str, rank: int) -> tuple[LossOf, tuple[torch.Tensor, ...], int]:
    """The script's Agent (same weights on every rank) in a LossOf, a random local batch of the script's size (vpg:
    its epoch's share; PPO: its minibatch), and that size."""
    defaults = common.defaults(SCRIPT_OF[name])
    torch.manual_seed(0)
    agent = common.agent_of(SCRIPT_OF[name])
    obs_space, action_space = common.env_spaces(SCRIPT_OF[name])
    if name == "vpg":
        batch = defaults.steps_per_epoch // dist.get_world_size()
    else:
        batch = defaults.local_num_envs * defaults.num_steps // defaults.num_minibatches
    generator = torch.Generator().manual_seed(1 + rank)
    if name == "atari":
        obs = torch.randint(0, 256, (batch, 4, 84, 84), dtype=torch.uint8, generator=generator)
        actions = torch.randint(0, action_space.n, (batch,), generator=generator)
    else:
        obs = torch.randn(batch, *obs_space.shape, generator=generator)
        actions = torch.randn(batch, *action_space.shape, generator=generator)
    advantages, returns = torch.randn(2, batch, generator=generator)
    return LossOf(agent), (obs, actions, advantages, returns), batch


def backward(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Zero the gradients, then forward and backward through `module`."""
    module.zero_grad()
    module(*inputs).backward()


def gradients(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient, in one flat tensor."""
    return torch.cat([parameter.grad.reshape(-1) for parameter in parameters])


def world_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor` via all_gather (a reference independent of the methods under test)."""
    return list(collectives.gather_to_all(tensor).unbind(0))


def timed(function: Callable[[], object], mpi_barrier: bool = False) -> float:
    """Seconds `function` takes, started after a barrier (MPI's for an MPI method: gloo's barrier wakes its waiters
    late and unevenly, a skew that the MPI method would then time as its own waiting)."""
    MPI.COMM_WORLD.Barrier() if mpi_barrier else dist.barrier()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def summary(times: list[float]) -> dict[str, float]:
    """Median, 10th/90th percentiles and mean (what many syncs cost) in ms of each repetition on the slowest rank."""
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    p10, median, p90 = np.percentile(slowest.numpy(), [10, 50, 90])
    return {"median_ms": 1e3 * median, "p10_ms": 1e3 * p10, "p90_ms": 1e3 * p90, "mean_ms": 1e3 * slowest.mean().item()}


def gather_method(rank: int, agent: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple:
    """vpg's --sync gather traffic (what it times, the sync, its check): a rollout batch of its layout gathered to
    rank 0 as one_learner.update_on_rank0 gathers it, rank 0's weights broadcast (the check first makes the other
    ranks' weights differ)."""
    n = common.defaults("vpg_mpi.py").steps_per_epoch // dist.get_world_size()
    generator = torch.Generator().manual_seed(100 + rank)
    widths = dict(obs=inputs[0].shape[1], actions=inputs[1].shape[1], log_probs=1, values=1, advantages=1, returns=1)
    batch = {key: torch.randn(n, width, generator=generator).squeeze(1) for key, width in widths.items()}
    expected = {key: torch.cat(world_gather(value)) for key, value in batch.items()}

    def check() -> bool:
        with torch.no_grad():
            for parameter in agent.parameters():
                parameter.add_(float(rank))
        union = one_learner.gather_union(batch, None, None)
        collectives.broadcast_parameters(agent)
        weights = torch.cat([parameter.detach().reshape(-1) for parameter in agent.parameters()])
        broadcast = all(torch.equal(piece, weights) for piece in world_gather(weights))
        return broadcast and (union is None or all(torch.equal(union[0][k], v) for k, v in expected.items()))

    what = f"one_learner.gather_union of {n}x{sum(widths.values())} floats per rank + broadcast_parameters"
    return what, lambda: (one_learner.gather_union(batch, None, None), collectives.broadcast_parameters(agent)), check


def measure_model(name: str, args: Args, rank: int) -> list[dict]:
    """Check, then time, every method that applies to model `name`; one dict per method (rank 0's copy counts)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    module, inputs, batch = build(name, rank)
    repeats = args.warmup + args.repeats  # the warm-up ones first
    parameters = list(module.parameters())
    script = common.load_script(SCRIPT_OF[name])
    if not hasattr(script, "average_gradients"):  # the Atari script: the MLP scripts' flat allreduce on its model
        script = common.load_script("ppo_continuous_mpi.py")
    logged = torch.zeros(6)  # the numbers PPO's minibatch_loss logs, which ride in the same allreduce
    ddp = DDP(module, broadcast_buffers=False)
    backward(module, inputs)
    local = [parameter.grad.clone() for parameter in parameters]
    reference = torch.stack(world_gather(gradients(parameters))).double().mean(0).float()

    def restore() -> None:
        """This rank's own gradients again (the methods average them in place)."""
        for parameter, gradient in zip(parameters, local, strict=True):
            parameter.grad = gradient.clone()

    def averages(function: Callable[[], object]) -> bool:
        """Whether `function` turns every rank's gradients into their average (the reference)."""
        restore()
        function()
        return torch.allclose(gradients(parameters), reference, rtol=1e-4, atol=1e-6)

    def per_parameter() -> None:  # SpinningUp's mpi_avg_grads: one all_reduce per tensor
        for parameter in parameters:
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()

    average = f"{Path(script.__file__).stem}.average_gradients: the gradients flattened, one allreduce, written back"
    methods = {  # method: (what is timed, the sync, whether its MPI row routes the scripts' collectives through MPI)
        "per-parameter": (f"{len(parameters)} all_reduce calls", per_parameter, False),
        "flat": (average, lambda: script.average_gradients(parameters, logged), True),
    }
    if name == "vpg":
        what, function, gather_works = gather_method(rank, module.agent, inputs)
        methods["gather+broadcast"] = (what, function, True)
    backward(ddp, inputs)
    checks = {"DDP": torch.allclose(gradients(parameters), reference, rtol=1e-4, atol=1e-6)}
    rows = []
    for method, (what, function, routed) in methods.items():
        for mpi in (False, True) if routed else (False,):
            label = method + ", MPI" * mpi
            times = []
            if routed:  # the MPI row: the scripts' CPU collectives through MPI, as --collectives mpi routes them
                collectives.carry_with(collectives.MPICommWorld(MPI) if mpi else None)
            checks[label] = gather_works() if method == "gather+broadcast" else averages(function)
            for _ in range(repeats):
                restore()  # keep the gradients' values bounded and realistic between repetitions
                times.append(timed(function, mpi))
            what = "the same through MPI (mpi4py, in place on numpy views), as --collectives mpi" if mpi else what
            rows.append({"method": label, "what": what, **summary(times[args.warmup :])})
        collectives.carry_with(None)
    # DDP: forward+backward with and without it, interleaved so that both see the same machine
    pairs = [(timed(lambda: backward(module, inputs)), timed(lambda: backward(ddp, inputs))) for _ in range(repeats)]
    plain = summary([pair[0] for pair in pairs[args.warmup :]])
    wrapped = summary([pair[1] for pair in pairs[args.warmup :]])
    what = f"forward+backward of a {batch}-sample minibatch through DDP ({wrapped['median_ms']:.2f} ms) minus without"
    difference = {key: wrapped[key] - plain[key] for key in ("median_ms", "mean_ms")}
    rows.append({"method": "DDP", "what": f"{what} DDP ({plain['median_ms']:.2f} ms)", **difference})
    ok = torch.tensor([all(checks.values())], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    facts = {"model": name, "parameters": sum(p.numel() for p in parameters), "tensors": len(parameters)}
    defaults = common.defaults(SCRIPT_OF[name])  # syncs per iteration: vpg's policy and value steps, PPO's minibatches
    syncs = 1 + defaults.train_v_iters if name == "vpg" else defaults.num_minibatches * defaults.update_epochs
    for row in rows:
        row.update(facts, checked=bool(ok.item()), syncs=1 if row["method"].startswith("gather") else syncs)
    return rows


def worker(init_file: str, args_dict: dict, result_path: str) -> None:
    """One rank of mpirun's: join the gloo group, measure every model, rank 0 writes the rows as JSON."""
    global MPI
    from mpi4py import MPI

    args = Args(**args_dict)
    rank = MPI.COMM_WORLD.Get_rank()
    world_size = MPI.COMM_WORLD.Get_size()
    torch.set_num_threads(max(1, len(common.usable_cores()) // world_size))  # as the scripts share the cores
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
    table = []
    for r in rows:
        agent = f"{Path(SCRIPT_OF[r['model']]).stem}.Agent ({'Nature CNN' if r['model'] == 'atari' else '64-64 MLPs'})"
        spread = f" ({r['p10_ms']:.2f}-{r['p90_ms']:.2f})" if "p10_ms" in r else ""
        times = [f"{r['median_ms']:.2f}{spread}", f"{r['mean_ms']:.2f}", r["syncs"], f"{r['mean_ms'] * r['syncs']:.1f}"]
        size = f"{r['parameters']:,} in {r['tensors']} tensors"
        table.append([agent, size, r["method"], *times, "yes" if r["checked"] else "NO", r["what"]])
    headers = (
        "model | parameters | method | ms per sync, median (p10-p90) | ms per sync, mean | syncs per iteration | "
        "ms per iteration (mean x syncs) | result checked | what is timed"
    )
    return common.markdown_table(headers, table)


def main(argv: list[str] | None = None) -> Path:
    """Start the ranks, measure, write OUT.md; returns its path."""
    args, argv, _ = common.cli(Args, argv)
    load = common.check_load(args.max_load)
    with tempfile.TemporaryDirectory(prefix="ddrl_grad_sync_") as tmp:
        result_path = Path(tmp) / "rows.json"
        plain_args = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(args).items()}
        worker_args = (str(Path(tmp) / "store"), plain_args, str(result_path))
        code = f"from benchmark.grad_sync import worker; worker(*{worker_args!r})"  # ranks that run worker(), no script
        as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        mpirun = ["mpirun", *as_root, "--bind-to", "none", "-np", str(args.nprocs), sys.executable, "-c", code]
        subprocess.run(mpirun, cwd=common.ROOT, check=True)
        rows = json.loads(result_path.read_text())
    if not all(row["checked"] for row in rows):
        print("benchmark.grad_sync: warning: a method's result did not match the all_gather reference", file=sys.stderr)
    threads = max(1, len(common.usable_cores()) // args.nprocs)
    facts = [
        f"{args.nprocs} ranks (by mpirun; gloo, and MPI where a method says so), {threads} torch thread(s) each; "
        f"{args.repeats} timed repetitions after {args.warmup} warm-up ones, each after a barrier, each counted on the "
        "slowest rank",
        "syncs per iteration at the scripts' defaults: vpg_mpi.py's 1 policy + train_v_iters value steps, or one "
        "gather+broadcast, the PPO scripts' minibatches x epochs (a sync here covers the whole model, vpg_mpi.py's "
        "about half of it, so its per-iteration figures are an upper bound)",
        "DDP rows for the MLPs show what DDP would cost there; only ppo_atari_multigpu.py uses DDP",
    ]
    return common.write_results(args, argv, "Gradient sync: time per sync", facts, "\n" + format_table(rows), load)


if __name__ == "__main__":
    main()
