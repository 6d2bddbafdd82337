"""Stopping a run on purpose: SIGTERM (a scheduler's preemption), Ctrl-C and a console that went
away each ask every rank to stop after the current iteration, with a checkpoint; a second Ctrl-C
stops at once."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

from ddrl import failures

if TYPE_CHECKING:
    from ddrl.run import Run


def arm(run: Run) -> None:
    """From here on SIGTERM and Ctrl-C (SIGINT) set run.stop_requested, which the iteration's sum
    over ranks reads."""
    signal.signal(signal.SIGTERM, lambda signum, frame: request(run, "SIGTERM"))
    signal.signal(signal.SIGINT, lambda signum, frame: request(run, "Ctrl-C"))


def request(run: Run, reason: str) -> None:
    """Ask every rank to stop after this iteration; a second Ctrl-C stops this process at once, in
    one line."""
    if reason == "Ctrl-C" and run.stop_requested:
        failures.say(
            f"{failures.script}: stopped at once by a second Ctrl-C; continue from the run's last "
            f"checkpoint with --resume --run-name {run.name}"
        )
        os._exit(130)  # at once: no checkpoint, no teardown that could wait on other ranks
    run.stop_requested = run.stop_requested or reason


def disarm() -> None:
    """Once training has ended: SIGTERM as it was, and Ctrl-C stops at once, in one line (the run is
    saved or ends)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, stop_at_once)


def stop_at_once(signum: int, frame) -> None:
    """Ctrl-C while the run ends: one line, exit code 130."""
    failures.say(f"{failures.script}: stopped at once by Ctrl-C while the run was ending")
    os._exit(130)
