"""What this machine has for a run: its usable cores, how busy they are, and so how many threads a rank takes."""

import os
import time

import numpy as np


def load_sample() -> np.ndarray:
    """Busy and all clock ticks of the usable cores since boot (Linux's /proc/stat), this process's CPU seconds, now."""
    usable = {f"cpu{core}" for core in os.sched_getaffinity(0)}
    with open("/proc/stat") as stat:  # per core: user nice system idle iowait irq softirq steal (guest counted in user)
        ticks = np.array([row[1:9] for row in map(str.split, stat) if row[0] in usable], dtype=float).sum(0)
    return np.array([ticks.sum() - ticks[3] - ticks[4], ticks.sum(), time.process_time(), time.time()])


def idle_cores(local_world_size: int) -> int:
    """The usable cores idle over 0.2 s, shared out among the ranks of this node (at least 1 each): the default torch
    and env threads, as a torch thread on a busy core stalls every op."""
    before = load_sample()
    time.sleep(0.2)
    busy, total, _, _ = load_sample() - before
    return max(1, round(len(os.sched_getaffinity(0)) * (1 - busy / max(total, 1))) // local_world_size)
