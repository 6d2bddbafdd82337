"""The weight check's cost beside an iteration's, at each script's defaults, measured in one run.

    python -m benchmark.weight_check --out benchmark/results/weight_check

The check (ddrl.checks.check_weights_in_sync, which every script runs every --check-sync-every iterations, 10 by
default, from the first) hashes a rank's weights and gathers the digests. Here it runs on 2 spawned ranks in a gloo
group, on each script's Agent for its default env, --repeats times after a barrier (the slowest rank counts); the
iteration is each script's own at its defaults on one rank (perf/rollout_time + perf/update_time, medians over
iterations 2..). The cost of one check is their ratio; at the default interval it is a tenth of that per iteration.
"""

import gc
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmark import common
from ddrl import checks


@dataclass(kw_only=True)
class Args(common.RunsArgs):
    scripts: tuple[common.Script, ...] = common.SCRIPTS
    """the scripts whose Agent and iteration are measured"""
    repeats: int = 50
    """timed checks per script"""
    iterations: int = 3
    out: Path = Path("benchmark_results/weight_check")


def agent_of(script: str) -> torch.nn.Module:
    """The script's Agent for its default env, at its default sizes."""
    module = common.load_script(script)
    observations, actions = common.env_spaces(script)
    if script == common.ATARI:
        return module.Agent(int(actions.n))
    if script == "vpg_mpi.py":
        return module.Agent(observations.shape[0], actions, module.Args().hidden_sizes)
    return module.Agent(observations.shape[0], actions.shape[0])


def check_rank(rank: int, world_size: int, init_file: str, scripts: list[str], repeats: int, result: str) -> None:
    """One rank: the check's seconds per script, the slowest rank's median over `repeats` (rank 0 writes them)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        medians = {}
        for script in scripts:
            torch.manual_seed(0)
            agent = agent_of(script)
            times = []
            for _ in range(repeats + 3):  # three to warm up
                dist.barrier()
                start = time.perf_counter()
                checks.check_weights_in_sync(agent, 1)
                times.append(time.perf_counter() - start)
            slowest = torch.tensor(times[3:], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            medians[script] = (statistics.median(slowest.tolist()), sum(p.numel() for p in agent.parameters()))
        if rank == 0:
            Path(result).write_text(json.dumps(medians))
        dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()


def main(argv: list[str] | None = None) -> Path:
    """Time the check on 2 ranks and each script's iteration, write OUT.md; returns its path."""
    args, argv, _ = common.cli(Args, argv)
    load = common.check_load(args.max_load)
    with tempfile.TemporaryDirectory(prefix="ddrl_weight_check_") as tmp:
        result = Path(tmp) / "checks.json"
        worker_args = (2, str(Path(tmp) / "store"), list(args.scripts), args.repeats, str(result))
        mp.start_processes(check_rank, args=worker_args, nprocs=2, start_method="spawn")
        checked = json.loads(result.read_text())
    rows = []
    with common.work_folder(args.out_dir, "ddrl_weight_check_runs_") as work_dir:
        for script in args.scripts:
            name = f"weight_check__{Path(script).stem}"
            run_args = ["--run-name", name, *common.budget_args(script, 1, args.local_steps, args.iterations)]
            [run_dir] = common.run_logged({name: common.script_command(common.ROOT / script, run_args)}, work_dir)
            measured = common.measure(run_dir, script, "default", 1)
            iteration = measured.rollout + measured.update
            seconds, parameters = checked[script]
            rows.append([script, f"{parameters:,}", f"{1e3 * seconds:.2f}", f"{iteration:.3f}"])
            rows[-1] += [f"{seconds / iteration:.3%}", f"{seconds / iteration / 10:.3%}"]
    headers = (
        "script | parameters | one check, ms (2 ranks, median) | one iteration, s (1 rank, defaults) | "
        "one check / one iteration | per iteration at --check-sync-every 10"
    )
    facts = [
        f"the check: {args.repeats} timed calls of ddrl.checks.check_weights_in_sync on 2 spawned gloo ranks, one "
        "torch thread each, each call after a barrier, the slowest rank's median",
        f"the iteration: each script at its defaults, one rank, {args.iterations} iterations, the medians of "
        "perf/rollout_time + perf/update_time over iterations 2..",
    ]
    body = "\n" + common.markdown_table(headers, rows)
    return common.write_results(args, argv, "The weight check beside an iteration", facts, body, *load)


if __name__ == "__main__":
    main()
