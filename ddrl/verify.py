"""Check that a ddrl script, or a copy of one, still updates as one process would, in one command:

    python -m ddrl.verify my_copy.py

It runs the script's own `main`, small, three ways, and stops each run at its first update: at one
rank, where the update takes the whole batch; then at two ranks with `--sync allreduce` and, where
the script has it, `--sync gather`, where rank 0 and rank 1 take two unequal shares of that same
batch (equal shares where the script splits its batch evenly, as VPG does) and its minibatches are
the one-rank run's, from the same weights. Each two-rank run must end with the one-rank weights on
every rank. Exit 0 when they match; else exit 1, in one line naming the mode, the parameters that
differ and by how much. The runs go in a temporary folder; nothing is written beside the script."""

import importlib.util
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from ddrl import one_learner

# float32 rounding after a few Adam steps stays far below it; a broken sync lands far above
TOLERANCE = 1e-5
# env steps per rank and iteration in every run: small, and enough for four minibatches
SAMPLES = 64
SHARE = 5 / 8  # rank 0's share of the batch, where the script takes unequal shares
SMALL = {  # flags every run takes, where the script has them
    "torch_threads": 1,
    "cuda": False,
    "compile": False,
    "check_sync_every": 0,
    "checkpoint_every": 0,
    "capture_video": False,
    "save_model": False,
    "track": False,
    "nprocs": 1,
    "preempt_fraction": 0.0,
    "env_threads": 1,
    "num_minibatches": 4,
    "update_epochs": 2,
    "steps_per_epoch": SAMPLES,
    "train_v_iters": 5,
}
WORKER_SECONDS = 300


class Stop(BaseException):
    """Ends a run's main once its first update is done (a BaseException: main's own handlers let it
    through)."""


def command_line(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(
            "usage: python -m ddrl.verify SCRIPT.py   (a ddrl script, or a copy of one)",
            file=sys.stderr,
        )
        return 2
    script = Path(argv[0]).resolve()
    if not script.is_file():
        print(f"verify: {argv[0]} is no file", file=sys.stderr)
        return 2
    start = time.time()
    module = load(script)
    missing = [name for name in ("Args", "main", "update") if not hasattr(module, name)]
    if missing:
        say(
            f"{script.name} defines no {', '.join(missing)}: verify runs a ddrl script's main and "
            "its update"
        )
        return 1
    with tempfile.TemporaryDirectory(prefix="ddrl-verify-") as folder:
        work = Path(folder)
        (work / "flags.json").write_text(json.dumps(small_flags(module.Args())))
        modes = (
            ["allreduce", "gather"] if "sync" in module.Args.__dataclass_fields__ else ["allreduce"]
        )
        # all at once: the two-rank runs start up and roll out while the reference does, then wait
        # for its batch
        reference = start_ranks(script, work, "reference", 1)
        launched = {mode: start_ranks(script, work, mode) for mode in modes}
        if problem := wait(reference, work, "reference"):
            for processes in launched.values():
                for process in processes:
                    process.kill()
            say(f"the one-rank run {problem}")
            return 1
        for mode, processes in launched.items():
            if problem := wait(processes, work, mode):
                say(f"the two-rank run ({mode}) {problem}")
                return 1
        reference = load_file(work / "reference.after.safetensors")
        shares = json.loads((work / "shares.json").read_text())
        worst = 0.0
        for mode in modes:
            for rank in (0, 1):
                after = load_file(work / f"{mode}.{rank}.after.safetensors")
                differing = {
                    name: (after[name].double() - value.double()).abs().max().item()
                    for name, value in reference.items()
                    if value.is_floating_point()
                }
                worst = max(worst, *differing.values())
                bad = sorted(
                    (gap, name) for name, gap in differing.items() if not gap <= TOLERANCE
                )[::-1]
                if bad:
                    names = ", ".join(name for _, name in bad[:3]) + (
                        f" and {len(bad) - 3} more" if len(bad) > 3 else ""
                    )
                    say(
                        f"at two ranks ({mode}, shares of {shares[0]} and {shares[1]} batch "
                        f"rows), rank {rank}'s {names} differ from the one-rank update on their "
                        f"union by up to {bad[0][0]:.3g} (tolerance {TOLERANCE:g}): the update no "
                        "longer equals one process's on the whole batch; see "
                        "docs/changing-a-script.md"
                    )
                    return 1
        print(
            f"verify: ok: {script.name}'s update at two ranks ({', '.join(modes)}; shares of "
            f"{shares[0]} and {shares[1]} batch rows) ends with the one-rank weights on their "
            f"union, within {TOLERANCE:g} (largest difference {worst:.2g}), in "
            f"{time.time() - start:.0f} s"
        )
    return 0


def say(message: str) -> None:
    print(f"verify: {message}", file=sys.stderr)


def load(script: Path):
    """The script as a module, without running its main (it runs only under `__main__`)."""
    name = f"ddrl_verify_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def small_flags(args) -> dict:
    """The flags of every run: SMALL where the script has them, the batch SAMPLES env steps per
    rank, one iteration of two ranks in all."""
    fields = args.__dataclass_fields__
    flags = {name: value for name, value in SMALL.items() if name in fields}
    if "num_steps" in fields and "steps_per_epoch" not in fields:
        flags["num_steps"] = max(1, SAMPLES // getattr(args, "local_num_envs", 1))
        flags["total_timesteps"] = 2 * flags["num_steps"] * getattr(args, "local_num_envs", 1)
    else:
        flags["total_timesteps"] = SAMPLES
    return flags


def start_ranks(script: Path, work: Path, mode: str, ranks: int = 2) -> list:
    """The workers of one run, as a launcher would start them (ranks and a free port in their
    environment): forked from this process, which imported the script and torch once."""
    port = free_port()
    processes = []
    for rank in range(ranks):
        launcher = {
            "RANK": rank,
            "WORLD_SIZE": ranks,
            "LOCAL_RANK": rank,
            "LOCAL_WORLD_SIZE": ranks,
        }
        launcher |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} if ranks > 1 else {}
        arguments = (mode, str(script), str(work), {k: str(v) for k, v in launcher.items()})
        process = multiprocessing.get_context("fork").Process(target=forked, args=arguments)
        process.start()
        processes.append(process)
    return processes


def forked(mode: str, script: str, work: str, launcher: dict[str, str]) -> None:
    """A worker's process: the launcher's variables in place of any it inherited, its output to
    its log, then the worker."""
    launched = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "PMIX_", "SLURM_")
    for key in [key for key in os.environ if key.startswith((*launched, "TORCHELASTIC"))]:
        del os.environ[key]
    os.environ.update(launcher)
    os.chdir(work)
    log = os.open(f"{mode}.{launcher['RANK']}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os._exit(worker(mode, script, work))


def wait(processes: list[multiprocessing.Process], work: Path, mode: str) -> str:
    """Wait for a run's workers; '' if each wrote its weights, else the run's last error line."""
    deadline = time.time() + WORKER_SECONDS
    for process in processes:
        process.join(max(1.0, deadline - time.time()))
        if process.is_alive():
            for other in processes:
                other.kill()
            return f"did not reach its update within {WORKER_SECONDS} s"
    written = [
        (work / f"{mode}.{rank}.after.safetensors").exists() for rank in range(len(processes))
    ]
    if mode == "reference":
        written = [(work / "reference.after.safetensors").exists()]
    if all(written):
        return ""
    lines = [
        line
        for rank in range(len(processes))
        for line in (work / f"{mode}.{rank}.log").read_text().splitlines()
    ]
    errors = [line for line in lines if ": error: " in line]
    # not what a peer's end caused
    causes = [line for line in errors if "lost contact with another rank" not in line]
    found = causes or errors or [line for line in lines if line.strip()][-1:]
    return f"stopped before its update ended: {found[0] if found else 'no output'}"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- inside a run ---------------------------------------------------------------------------------
def worker(mode: str, script: str, work: str) -> int:
    """One rank of one run: the script's main with the small flags (and `--sync mode`), its first
    update replaced by verify's: recorded and run on the whole batch (`reference`), or on this
    rank's share of the reference's batch from the reference's weights; the weights after it
    written, then main stopped."""
    work = Path(work)
    module = load(Path(script))
    flags = json.loads((work / "flags.json").read_text())
    if mode != "reference" and "sync" in module.Args.__dataclass_fields__:
        flags["sync"] = mode
    args = module.Args(**flags)
    if mode == "gather":
        one_learner.update_on_rank0 = gathered_update(
            one_learner.update_on_rank0, module.update, work
        )
    else:
        module.update = replaced_update(module.update, mode, work)
    try:
        module.main(args)
    except Stop:
        sys.stdout.flush()
        os._exit(0)  # at once: the process group's threads need no orderly teardown
    return 1


def replaced_update(update, mode: str, work: Path):
    """The script's update, called as main calls it, on verify's batch and minibatches (worker)."""

    def verify_update(*arguments, **options):
        bound = prepared(update, arguments, options, mode, work)
        result = update(*bound.args, **bound.kwargs)
        finish(bound, mode, work)
        return result

    return verify_update


def gathered_update(update_on_rank0, update, work: Path):
    """one_learner.update_on_rank0, called as main calls it, on verify's batch and minibatches (see
    worker)."""

    def verify_update_on_rank0(script_update, *arguments):
        bound = prepared(update, arguments, {}, "gather", work)
        result = update_on_rank0(script_update, *bound.args)
        finish(bound, "gather", work)
        return result

    return verify_update_on_rank0


def prepared(update, arguments: tuple, options: dict, mode: str, work: Path):
    """The update's arguments, bound to its signature, with verify's batch, orders and sizes and, at
    two ranks, the reference's weights and learning rates."""
    import inspect

    bound = inspect.signature(update).bind(*arguments, **options)
    called = bound.arguments
    batch = called["batch"]
    module = model_of(called)
    optimizers = [value for value in called.values() if isinstance(value, torch.optim.Optimizer)]
    takes_orders = "orders" in called
    rank = int(os.environ.get("RANK", "0"))
    if mode == "reference":
        count = len(batch["returns"])
        shares = [count // 2, count // 2]  # VPG splits its batch evenly
        # unequal, each at least one row a minibatch (rows: samples, or a recurrent copy's envs)
        if takes_orders:
            second = max(called["sizes"].shape[1], count - math.ceil(count * SHARE))
            shares = [count - second, second]
        batch = {key: value[: sum(shares)] for key, value in batch.items()}
        save_file(
            {key: value.contiguous().cpu() for key, value in batch.items()},
            work / "batch.safetensors",
        )
        save_file(state(module), work / "reference.before.safetensors")
        rates = [[group["lr"] for group in optimizer.param_groups] for optimizer in optimizers]
        (work / "shares.json").write_text(json.dumps(shares))
        (work / "rates.json").write_text(json.dumps(rates))
        if takes_orders:
            generator = torch.Generator().manual_seed(0)
            epochs = len(called["orders"])
            orders = [
                torch.stack([torch.randperm(n, generator=generator) for _ in range(epochs)])
                for n in shares
            ]
            save_file(
                {f"orders.{r}": order for r, order in enumerate(orders)},
                work / "orders.safetensors",
            )
        (work / "reference.ready").touch()
    deadline = time.time() + WORKER_SECONDS
    while not (work / "reference.ready").exists():  # the reference's batch, weights and minibatches
        if time.time() > deadline:
            raise Stop
        time.sleep(0.05)
    shares = json.loads((work / "shares.json").read_text())
    batch = {
        key: value.to(called["batch"][key].device)
        for key, value in load_file(work / "batch.safetensors").items()
    }
    if takes_orders:
        orders = load_file(work / "orders.safetensors")
        rank_orders = [orders[f"orders.{r}"] for r in range(2)]
        # the script's own
        sizes = sys.modules[update.__module__].minibatch_sizes(shares, called["sizes"].shape[1])
    if mode == "reference":
        called["batch"] = batch
        if takes_orders:
            called["orders"] = one_learner.union_orders(rank_orders, sizes).to(
                called["orders"].device
            )
            called["sizes"] = sizes.sum(0)[None]
        return bound
    start = sum(shares[:rank])
    called["batch"] = {key: value[start : start + shares[rank]] for key, value in batch.items()}
    if takes_orders:
        called["orders"] = rank_orders[rank].to(called["orders"].device)
        called["sizes"] = sizes
    module.load_state_dict(load_file(work / "reference.before.safetensors"))
    for optimizer, rates in zip(
        optimizers, json.loads((work / "rates.json").read_text()), strict=False
    ):
        for group, rate in zip(optimizer.param_groups, rates, strict=False):
            group["lr"] = rate
    return bound


def model_of(called: dict) -> nn.Module:
    """The module the update trains: the first among its arguments (DistributedDataParallel's: the
    Agent in it)."""
    module = next(value for value in called.values() if isinstance(value, nn.Module))
    return getattr(module, "module", module)


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: tensor.detach().cpu().clone().contiguous()
        for name, tensor in module.state_dict().items()
    }


def finish(bound, mode: str, work: Path) -> None:
    """Write the weights the update ended with, and end the run."""
    rank = int(os.environ.get("RANK", "0"))
    name = "reference.after" if mode == "reference" else f"{mode}.{rank}.after"
    save_file(state(model_of(bound.arguments)), work / f"{name}.safetensors")
    raise Stop


if __name__ == "__main__":
    raise SystemExit(command_line(sys.argv[1:]))
