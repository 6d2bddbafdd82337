"""What this machine has for a run: its usable cores, how busy they are, and so how many threads a
rank takes; its memory, against what an iteration's data takes."""

import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

from ddrl import failures


def idle_cores(local_world_size: int) -> int:
    """The usable cores idle over 0.2 s, shared out among the ranks of this node (at least 1 each):
    the default torch and env threads, as a torch thread on a busy core stalls every op."""
    before = load_sample()
    time.sleep(0.2)
    busy, total, _, _ = load_sample() - before
    return max(
        1, round(len(os.sched_getaffinity(0)) * (1 - busy / max(total, 1))) // local_world_size
    )


def load_sample() -> np.ndarray:
    """Busy and all clock ticks of the usable cores since boot (Linux's /proc/stat), this process's
    CPU seconds, now."""
    usable = {f"cpu{core}" for core in os.sched_getaffinity(0)}
    # per core: user nice system idle iowait irq softirq steal (guest counted in user)
    with open("/proc/stat") as stat:
        ticks = np.array(
            [row[1:9] for row in map(str.split, stat) if row[0] in usable], dtype=float
        ).sum(0)
    return np.array(
        [ticks.sum() - ticks[3] - ticks[4], ticks.sum(), time.process_time(), time.time()]
    )


def memory_problem(bytes_per_rank: int, sized_by: str, ranks_here: int) -> str | None:
    """Whether `ranks_here` ranks, each holding `bytes_per_rank` for an iteration's data (whose size
    the flags `sized_by` set), outgrow the memory available: the message naming the fix, or None."""
    available = available_memory()
    if bytes_per_rank * ranks_here <= available:
        return None
    return (
        f"one iteration's data needs about {size(bytes_per_rank)} per rank, "
        f"{size(bytes_per_rank * ranks_here)} for this node's {ranks_here} rank(s), more than the "
        f"{size(available)} this machine has available: lower {sized_by}, or spread the ranks "
        "over more nodes"
    )


def available_memory() -> int:
    """Bytes a process can still take without swapping (Linux's MemAvailable), else all memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size(count: int) -> str:
    """A byte count as people read it: 812 MiB, 4.2 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} B"


def activation_bytes(agent_class: type, envs) -> int:
    """Bytes one sample's activations take in an update step: its layers' outputs for one
    observation of `envs`, and as much again for their gradients, found on no device (nothing
    allocated) so that an edited network counts as it is."""
    outputs = []

    def count(module, inputs, output) -> None:
        found = output if isinstance(output, tuple | list) else [output]
        outputs.extend(t.numel() * t.element_size() for t in found if isinstance(t, torch.Tensor))

    space = envs.single_observation_space
    with torch.device("meta"):
        agent = agent_class(envs)
        leaves = [module for module in agent.modules() if not list(module.children())]
        hooks = [leaf.register_forward_hook(count) for leaf in leaves]
        with torch.no_grad():
            agent.get_action_and_value(
                torch.zeros((1, *space.shape), dtype=torch.as_tensor(space.sample()).dtype)
            )
    for hook in hooks:
        hook.remove()
    return 2 * sum(outputs)


def has_native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 runs natively here (AVX512-BF16 or AMX CPUs, Ampere or newer GPUs)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


COMPILE_REPAYS_PAST = 50_000  # over twice the one-core, empty-cache figures of compile_decision.md


def compile_repays(minibatch_steps: int) -> bool:
    """--compile's default: whether this many minibatch steps per rank repay the compile's cost."""
    return minibatch_steps > COMPILE_REPAYS_PAST


def can_compile(device: torch.device) -> bool:
    """Whether torch.compile can build kernels here: on a GPU always, on CPU where the C++ compiler
    (CXX, else g++) is on PATH; else one line says the update runs eagerly."""
    compiler = os.environ.get("CXX", "g++")
    if device.type == "cuda" or shutil.which(compiler) is not None:
        return True
    if not dist.is_initialized() or dist.get_rank() == 0:
        failures.warn(
            f"no C++ compiler ({compiler!r} is not on PATH), so the update runs eagerly: install "
            "g++ for the compiled update, or pass --no-compile"
        )
    return False
