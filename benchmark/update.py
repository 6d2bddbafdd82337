"""Seconds per update of the MLP scripts at their defaults, in one process, call by call: this checkout's `update`
eager, with its loss torch.compile'd and with the compiled step (its `--compile` on CPU) beside another checkout's, on
one rank with one torch thread.

    git worktree add ../before COMMIT
    taskset -c 0 python -m benchmark.update --compare-with ../before --rounds 10 --out benchmark/results/update

Each variant updates its own Agent (the script's, for its default env, the same initial weights) with the script's
optimizer on one random batch of the default size; the variants take turns within every round, so a slow spell of
the machine falls on all of them. A minibatch step is the update's time over its minibatch steps (PPO: epochs x
minibatches; VPG: one policy step and --train-v-iters value steps).
"""

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from annotated_types import Ge

from benchmark import common
from ddrl import compiled_step

SCRIPTS = ("ppo_continuous_mpi.py", "vpg_mpi.py")
"""the scripts whose update runs on CPU one minibatch at a time (Atari's CNN update: benchmark.atari_step)"""


@dataclass(kw_only=True)
class Args(common.TimingArgs):
    compare_with: Path | None = None
    """another checkout whose scripts' updates run beside this one's (`git worktree add ../before COMMIT`)"""
    rounds: Annotated[int, Ge(1)] = 10
    """rounds; in each, every variant runs one update"""
    scripts: tuple[str, ...] = SCRIPTS
    """which scripts' updates to time"""
    out: Path = Path("benchmark/results/update")


def random_batch(obs_space, action_space, size: int) -> dict[str, torch.Tensor]:
    """A batch of `size` rows as the scripts' rollouts store it (float32, by name)."""
    actions = torch.randn(size, *action_space.shape) if action_space.shape else torch.randint(action_space.n, (size,))
    return {
        "obs": torch.randn(size, *obs_space.shape),
        "actions": actions.float(),
        "log_probs": torch.randn(size) - 5.0,
        "values": torch.randn(size),
        "advantages": torch.randn(size),
        "returns": torch.randn(size),
    }


def one_update(script: str, root: Path, compiled: str = "") -> tuple[Callable[[], object], int]:
    """A call that runs the `root` checkout's update of `script` once on its defaults, and its minibatch steps;
    `compiled`: "loss" (torch.compile'd) or "step" (ddrl.compiled_step's, --compile on CPU)."""
    module = common.load_script(script, root)
    args = module.Args()
    module.derive_batch_sizes(args, 1)
    obs_space, action_space = common.env_spaces(script)
    torch.manual_seed(0)
    agent = common.agent_of(script, root)
    if "vpg" in script:
        policy = [p for name, p in agent.named_parameters() if not name.startswith("critic.")]
        groups = [{"params": policy, "lr": args.pi_lr}, {"params": list(agent.critic.parameters()), "lr": args.vf_lr}]
        optimizer = torch.optim.Adam(groups)
        batch = random_batch(obs_space, action_space, args.local_steps_per_epoch)
        return (lambda: module.update(agent, optimizer, batch, args)), 1 + args.train_v_iters
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    batch = random_batch(obs_space, action_space, args.local_batch_size)
    orders = torch.stack([torch.randperm(args.local_batch_size) for _ in range(args.update_epochs)])
    sizes = module.minibatch_sizes([args.local_batch_size], args.num_minibatches)
    loss_fn = torch.compile(module.minibatch_loss, fullgraph=True) if compiled == "loss" else module.minibatch_loss
    step = (
        compiled_step.CompiledStep(agent, optimizer, loss_fn, module.average_gradients, module.clip_gradients, args)
        if compiled == "step"
        else None
    )
    steps = args.update_epochs * args.num_minibatches
    extra = {"compiled": step} if step else {}  # another checkout's update may take no compiled step
    return (lambda: module.update(agent, optimizer, batch, args, orders, sizes, loss_fn, **extra)), steps


def step_parts(script: str, rounds: int) -> list[list[str]]:
    """Where one compiled minibatch step of `script` (continuous PPO, --compile on CPU) goes: the whole step and its
    compiled gradient alone, each timed over a whole epoch's minibatches, taking turns; the median microseconds of
    each, and both again on 8 rows, whose arithmetic is nil (the fixed cost per call)."""
    module = common.load_script(script)
    args = module.Args()
    module.derive_batch_sizes(args, 1)
    obs_space, action_space = common.env_spaces(script)
    torch.manual_seed(0)
    agent = common.agent_of(script)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    step = compiled_step.CompiledStep(
        agent, optimizer, module.minibatch_loss, module.average_gradients, module.clip_gradients, args
    )
    batch = random_batch(obs_space, action_space, args.local_batch_size)
    minibatches = module.minibatches(batch, torch.randperm(args.local_batch_size), [args.local_minibatch_size] * 32)
    tiny = module.minibatches(batch, torch.arange(8), [8])[0]
    moments = {id(mb): (mb["advantages"].mean(), mb["advantages"].std()) for mb in [*minibatches, tiny]}
    step(tiny, *moments[id(tiny)], 1.0)  # compiles (or loads) and checks it

    def whole(mb: dict) -> None:
        step(mb, *moments[id(mb)], 1.0)

    def gradient(mb: dict) -> None:
        step.run([step.flat, *step.buffers.values(), *mb.values(), *moments[id(mb)], torch.tensor(1.0)])

    rows = len(minibatches[0]["obs"])
    parts = {
        f"the whole step, {rows} rows": whole,
        f"its compiled gradient alone (AOTInductor's program), {rows} rows": gradient,
        "the whole step, 8 rows": lambda mb: whole(tiny),
        "its compiled gradient alone, 8 rows": lambda mb: gradient(tiny),
    }
    micros = {name: [] for name in parts}
    for _ in range(rounds):
        for name, part in parts.items():
            start = time.perf_counter()
            for minibatch in minibatches:
                part(minibatch)
            micros[name].append((time.perf_counter() - start) / len(minibatches) * 1e6)
    return [[name, f"{statistics.median(times):.0f}"] for name, times in micros.items()]


def vpg_value_step(rounds: int) -> list[list[str]]:
    """What one of VPG's value steps costs as its update runs it (the loss, its backward, the one-rank sync, Adam) on
    the default batch and on 8 rows, whose arithmetic is nil: the fixed cost per call, the most a step derived and
    compiled as continuous PPO's could remove; the median microseconds of each, the two taking turns."""
    module = common.load_script("vpg_mpi.py")
    args = module.Args()
    module.derive_batch_sizes(args, 1)
    obs_space, action_space = common.env_spaces("vpg_mpi.py")
    torch.manual_seed(0)
    agent = common.agent_of("vpg_mpi.py")
    optimizer = torch.optim.Adam(agent.critic.parameters(), lr=args.vf_lr)
    parameters = list(agent.critic.parameters())
    batch = random_batch(obs_space, action_space, args.local_steps_per_epoch)

    def value_step(rows: int) -> None:
        loss = ((agent.get_value(batch["obs"][:rows]).view(-1) - batch["returns"][:rows]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        module.average_gradients(parameters, loss.detach().reshape(1))
        optimizer.step()

    sizes = (args.local_steps_per_epoch, 8)
    micros = {rows: [] for rows in sizes}
    for _ in range(rounds):
        for rows in sizes:
            start = time.perf_counter()
            for _ in range(args.train_v_iters):
                value_step(rows)
            micros[rows].append((time.perf_counter() - start) / args.train_v_iters * 1e6)
    whole, fixed = (statistics.median(micros[rows]) for rows in sizes)
    return [[f"{sizes[0]:,} rows (the default)", f"{whole:.0f}"], ["8 rows", f"{fixed:.0f}"]] + [
        ["the fixed cost's share of a default step", f"{fixed / whole:.0%}"]
    ]


def main(argv: list[str] | None = None) -> Path:
    args, argv, _ = common.cli(Args, argv)
    load = common.check_load(args.max_load)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    roots = {"this": common.ROOT} | ({"other": args.compare_with.resolve()} if args.compare_with else {})
    rows = []
    for script in args.scripts:
        variants = {f"{name} eager": (root, "") for name, root in roots.items()}
        if "vpg" not in script:
            variants["this, loss torch.compile'd"] = (common.ROOT, "loss")
            variants["this, compiled step (--compile)"] = (common.ROOT, "step")
        calls = {name: one_update(script, root, compiled) for name, (root, compiled) in variants.items()}
        for call, _ in calls.values():  # the first calls compile and warm up
            call()
            call()
        seconds = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, (call, _) in calls.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        base = statistics.median(seconds["other eager" if args.compare_with else "this eager"])
        for name, times in seconds.items():
            median = statistics.median(times)
            per_step = median / calls[name][1] * 1e6
            rows.append([script, name, f"{median * 1e3:.1f}", f"{per_step:.0f}", f"{base / median:.2f}x"])
        print(*rows[-len(seconds) :], sep="\n", file=sys.stderr)
    other = f"other = {common.code_version(roots['other'])}" if args.compare_with else "no other checkout"
    facts = [f"{args.rounds} rounds, one torch thread; {other} (its scripts, beside this checkout's ddrl package)"]
    base = "other eager" if args.compare_with else "this eager"
    header = f"script | variant | ms per update (median) | us per minibatch step | speed-up over {base}"
    body = "\n" + common.markdown_table(header, rows)
    if "ppo_continuous_mpi.py" in args.scripts:
        body += (
            "\nWhere a compiled minibatch step of ppo_continuous_mpi.py goes (--compile on CPU; one rank, one thread), "
            "each part timed over an epoch's minibatches, the parts taking turns; the rest of a step (the one-rank "
            "sync, its finiteness check, the clip and the fused Adam kernel) is the whole less the gradient; on 8 "
            "rows, the fixed cost per call:\n\n"
        )
        body += common.markdown_table("part | us per minibatch step", step_parts("ppo_continuous_mpi.py", args.rounds))
    if "vpg_mpi.py" in args.scripts:
        body += "\nVPG's value step (one of its update's 80), as its update runs it, one rank, one thread:\n\n"
        body += common.markdown_table("batch | us per value step", vpg_value_step(args.rounds))
    torch.set_num_threads(threads)
    return common.write_results(args, argv, "Update time per iteration", facts, body, load)


if __name__ == "__main__":
    main()
