"""Each script at 1 rank, quiet and beside a busy core, at its default threads, at one thread and at one per usable
core (issue 37).

    python -m benchmark.under_load --out benchmark/results/under_load [-- SCRIPT ARGS]

A script runs as a new user starts it, `python SCRIPT` at its defaults (not under torchrun, whose OMP_NUM_THREADS=1
would also set numpy's BLAS threads). "busy core": another process spins on the last usable core for the whole run, as
a second job on a shared machine would. `--torch-threads N` with N the usable cores is what the default was before
issue 37. A script's SPS comes from its TensorBoard events, iterations 2.. (as in benchmark.scaling); each cell is the
median over --repeats rounds. CleanRL's figures stand beside them as the issue's author measured them on a 2-core
Intel Xeon (issue 37), not on this machine.
"""

import contextlib
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

from benchmark.common import (
    ROOT,
    check_load,
    cpu_model,
    last_lines,
    markdown_table,
    results_header,
    run_streaming,
    split_script_args,
)
from benchmark.scaling import SCRIPT_DEFAULTS, budget_args, measure, script_modes
from benchmark.stragglers import cpu_hog

CORES = len(os.sched_getaffinity(0))
THREADS = ("default", "1", str(CORES))
"""the --torch-threads of a script's runs: its default, one, and one per usable core"""
CLEANRL = {"ppo_continuous_mpi.py": "ppo_continuous_action.py: 65 default, 867-893 with OMP_NUM_THREADS=1"}
"""CleanRL's figures from issue 37 (SPS, HalfCheetah-v5, 1 process beside a busy core), measured by the issue's
author on a 2-core Intel Xeon"""


@dataclass
class Args:
    scripts: tuple[str, ...] = ("ppo_continuous_mpi.py", "vpg_mpi.py", "ppo_atari_multigpu.py")
    """the scripts to measure"""
    iterations: int = 3
    """iterations (epochs) per run; at least 2 (the first is left out of SPS)"""
    steps: int = 0
    """env steps per iteration (per rank); 0 = each script's default batch"""
    env_id: str = ""
    """the env id of the MLP scripts; empty = each script's default (HalfCheetah-v5)"""
    nprocs: int = 1
    """ranks per run (--nprocs N); the busy process still takes one core"""
    repeats: int = 1
    """rounds; each cell is the median over them"""
    out: Path = Path("benchmark_results/under_load")
    """output stem: writes OUT.md"""
    out_dir: Path | None = None
    """where the runs are launched (runs/ and logs/ land there, and are kept); default: a temporary folder"""
    notes: tuple[str, ...] = ()
    """paragraphs of prose under the header of the markdown file; the command shown there leaves them out"""
    max_load: float = 1.2
    """above this 1-minute load average at the start, the results file opens with a MEASURED UNDER LOAD warning"""


def cpu_flags() -> str:
    """The CPU's vector-instruction flags that decide torch's kernels (AVX2, AVX-512, AMX), from /proc/cpuinfo."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = [flag for flag in line.split(":", 1)[1].split() if flag.startswith(("avx2", "avx512", "amx"))]
                return " ".join(flags) or "no AVX2"
    return "unknown"


def run_sps(script: str, threads: str, args: Args, extra: list[str], work_dir: Path, name: str) -> float:
    """SPS (iterations 2..) of one plain `python SCRIPT` run at its defaults, `threads` torch threads and `extra`."""
    default_env, default_steps = SCRIPT_DEFAULTS[script]
    script_args = [] if threads == "default" else ["--torch-threads", threads]
    script_args += ["--nprocs", str(args.nprocs), "--run-name", name, "--env-id", args.env_id or default_env]
    script_args += [*budget_args(script, args.nprocs, args.steps or default_steps, args.iterations), *extra]
    log_path = work_dir / "logs" / f"{name}.log"
    if run_streaming([sys.executable, str(ROOT / script), *script_args], work_dir, log_path):
        raise SystemExit(f"benchmark.under_load: error: {name} failed; {log_path}:\n{last_lines(log_path)}")
    return measure(work_dir / "runs" / name, script, script_modes(script, ("allreduce",))[0], args.nprocs).sps


def main(argv: list[str] | None = None) -> Path:
    """Run every script quiet and beside a busy core at each thread count, write OUT.md; returns its path."""
    argv = sys.argv[1:] if argv is None else argv
    own, extra = split_script_args(argv)
    args = tyro.cli(Args, args=own, description=__doc__)
    if any(script not in SCRIPT_DEFAULTS for script in args.scripts) or args.iterations < 2 or args.repeats < 1:
        raise SystemExit(f"benchmark.under_load: error: scripts must be in {tuple(SCRIPT_DEFAULTS)}, iterations >= 2")
    if args.env_id and "ppo_atari_multigpu.py" in args.scripts:
        raise SystemExit("benchmark.under_load: error: --env-id names an MLP env; measure Atari in a run of its own")
    load_before, warning = check_load(args.max_load)
    work_dir = args.out_dir.resolve() if args.out_dir else Path(tempfile.mkdtemp(prefix="ddrl_under_load_"))
    sps: dict[tuple[str, str, str], list[float]] = {}
    try:
        for round_index in range(args.repeats):
            for script in args.scripts:
                for load in ("quiet", "busy core"):
                    with cpu_hog(max(os.sched_getaffinity(0))) if load == "busy core" else contextlib.nullcontext():
                        for threads in THREADS:
                            name = f"{Path(script).stem}__{load.replace(' ', '_')}__{threads}__{round_index}"
                            sps.setdefault((script, load, threads), []).append(
                                run_sps(script, threads, args, extra, work_dir, name)
                            )
                            print(f"{script} {load} {threads} threads: SPS {sps[script, load, threads][-1]:,.0f}")
    finally:
        if args.out_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)

    rows = []
    for script in args.scripts:
        env = args.env_id or SCRIPT_DEFAULTS[script][0]
        for load in ("quiet", "busy core"):
            cells = [statistics.median(sps[script, load, threads]) for threads in THREADS]
            cleanrl = CLEANRL.get(script, "") if load == "busy core" else ""
            rows.append([script, env, load, *(f"{cell:,.0f}" for cell in cells), f"{cells[0] / cells[1]:.2f}", cleanrl])
    headers = ["script", "env", "load", "default", "--torch-threads 1", f"--torch-threads {CORES} (every core)"]
    headers += ["default / 1 thread", "CleanRL beside a busy core (issue 37, 2-core Intel Xeon)"]
    facts = [
        f"CPU: {cpu_model()}; vector flags: {cpu_flags()}",
        f"{args.nprocs} rank(s) per run, {args.iterations} iterations of {args.steps or 'the default'} env steps per "
        f"rank, {args.repeats} round(s); SPS over iterations 2..; load average before the runs: {load_before}",
    ]
    text = results_header("Throughput beside a busy core", "benchmark.under_load", argv, facts, args.notes, warning)
    text += "\n" + markdown_table(headers, rows)
    path = args.out.with_name(args.out.name + ".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
