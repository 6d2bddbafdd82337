"""Where ppo_continuous_mpi.py's compiled update repays its compile: the compile's one-off cost and the time a
minibatch step takes eager and compiled (--compile's step on CPU, ddrl.compiled_step), at the script's defaults, on one
core (one thread: a rank of the quick start's two on two cores) and on two (two threads: one rank alone on them).

    python -m benchmark.compile_cost --out benchmark/results/compile_decision

Each measurement runs in a fresh process pinned to its cores, with an empty Inductor cache (a user's first
compiled run; a later run loads the compiled step from it), then once more on the cache it left. The one-off cost is
the first compiled update less a steady compiled one, after the eager update has warmed up; the compile repays past
that cost over the time a compiled step saves. On one core the seconds are CPU seconds of the process and of the C++
compilers it waits for: what a quiet core would take, however busy the machine; on two, wall seconds. `--compile`'s
default compiles past `ddrl.machine.COMPILE_REPAYS_PAST` minibatch steps per rank, set above the one-core, empty-cache
figure here.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from annotated_types import Ge

from benchmark import common, update
from ddrl import machine

SCRIPT = "ppo_continuous_mpi.py"


@dataclass(kw_only=True)
class Args(common.TimingArgs):
    rounds: Annotated[int, Ge(1)] = 10
    """steady updates timed per variant, eager and compiled taking turns"""
    out: Path = Path("benchmark/results/compile_decision")


def measure(threads: int, rounds: int) -> dict[str, float]:
    """In this process: the compile's one-off seconds and the microseconds of an eager and a compiled minibatch step
    (CPU time on one thread, else wall time)."""
    clock = (lambda: common.cpu_clock()[2]) if threads == 1 else time.perf_counter
    torch.set_num_threads(threads)
    eager, steps = update.one_update(SCRIPT, common.ROOT)
    compiled, _ = update.one_update(SCRIPT, common.ROOT, compiled="step")
    eager()
    eager()
    start = clock()
    compiled()
    first = clock() - start
    seconds = {eager: [], compiled: []}
    for _ in range(rounds):
        for call, times in seconds.items():
            start = clock()
            call()
            times.append(clock() - start)
    eager_update, compiled_update = (statistics.median(times) for times in seconds.values())
    step = 1e6 / steps
    return {"compile": first - compiled_update, "eager": eager_update * step, "compiled": compiled_update * step}


def measured(cores: list[int], rounds: int, cache: str) -> dict[str, float]:
    """measure() in a fresh process pinned to `cores`, one thread per core, with `cache` as its torch.compile cache."""
    code = f"import json, benchmark.compile_cost as c; print(json.dumps(c.measure({len(cores)}, {rounds})))"
    command = ["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-c", code]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    output = subprocess.run(command, cwd=common.ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(output.splitlines()[-1])


def main(argv: list[str] | None = None) -> Path:
    args, argv, _ = common.cli(Args, argv)
    load = common.check_load(args.max_load)
    rows = []
    for cores in (common.usable_cores()[:1], common.usable_cores()[:2]):
        with tempfile.TemporaryDirectory(prefix="compile_cache_") as cache:
            for state in ("empty", "warm"):
                result = measured(cores, args.rounds, cache)
                saved = result["eager"] - result["compiled"]
                repays = f"{result['compile'] / saved * 1e6:,.0f}" if saved > 0 else "never"
                timings = [f"{result['compile']:.1f}", f"{result['eager']:.0f}", f"{result['compiled']:.0f}"]
                clock = "CPU" if len(cores) == 1 else "wall"
                rows.append([f"{len(cores)} ({len(cores)} threads, {clock} time)", state, *timings, repays])
                print(rows[-1], file=sys.stderr)
    threshold = machine.COMPILE_REPAYS_PAST
    facts = [f"{args.rounds} steady updates per variant, {SCRIPT}'s defaults (320 minibatch steps of 64 rows)"]
    header = "cores | compile cache | compile (s) | eager (us/step) | compiled (us/step) | repays past (steps)"
    body = "\n" + common.markdown_table(header, rows)
    body += (
        f"\n`--compile`'s default compiles past {threshold:,} minibatch steps per rank (`ddrl.machine."
        "COMPILE_REPAYS_PAST`): the quick start (2 ranks, 1M steps) takes 78,080 per rank and compiles; a 20,480-step "
        "run takes 1,600 (2 ranks) or 3,200 (1 rank) and runs eagerly.\n"
    )
    return common.write_results(args, argv, "Where the compiled update repays its compile", facts, body, load)


if __name__ == "__main__":
    main()
