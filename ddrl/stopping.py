"""Stopping a run on purpose: SIGTERM (a scheduler's preemption), Ctrl-C and a console that went
away ask every rank to stop after this iteration, with a checkpoint; a second Ctrl-C, at once."""

import os
import signal
from dataclasses import dataclass

from ddrl import failures


@dataclass
class StopRequest:
    """Why this rank asks every rank to stop after this iteration ('' while nothing asks), which
    the iteration's sum over ranks reads; `run_name` is the folder a second Ctrl-C names."""

    run_name: str = ""
    reason: str = ""


def arm(stop: StopRequest) -> None:
    """From here on SIGTERM and Ctrl-C (SIGINT) set `stop`'s reason."""
    signal.signal(signal.SIGTERM, lambda signum, frame: request(stop, "SIGTERM"))
    signal.signal(signal.SIGINT, lambda signum, frame: request(stop, "Ctrl-C"))


def request(stop: StopRequest, reason: str) -> None:
    """Ask every rank to stop after this iteration; a second Ctrl-C stops this process at once."""
    if reason == "Ctrl-C" and stop.reason:
        failures.say(
            f"{failures.script}: stopped at once by a second Ctrl-C; continue from the run's last "
            f"checkpoint with --resume --run-name {stop.run_name}"
        )
        os._exit(130)  # at once: no checkpoint, no teardown that could wait on other ranks
    stop.reason = stop.reason or reason


def disarm() -> None:
    """Once training has ended: SIGTERM as it was, and Ctrl-C stops at once, in one line."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, stop_at_once)


def stop_at_once(signum: int, frame) -> None:
    """Ctrl-C while the run ends: one line, exit code 130."""
    failures.say(f"{failures.script}: stopped at once by Ctrl-C while the run was ending")
    os._exit(130)
