"""Holds a process right after it prints a line that matches DDRL_HOLD_AFTER (a regular expression), as its
interpreter starts (Python imports `sitecustomize` from its path):

    env PYTHONPATH=benchmark/hold_at_line DDRL_HOLD_AFTER='^iteration ' python -m torch.distributed.run ... SCRIPT

The process stops itself (SIGSTOP) once the line is flushed, so that whoever reads it acts at that very point of the
run (benchmark.faults sends its fault there) and then lets it go on with SIGCONT; nothing runs while the line is read.
"""

import builtins
import os
import re
import signal
import sys


def hold_after(print_, pattern: re.Pattern):
    """`print_` that stops this process after printing a line that matches `pattern` to stdout."""

    def printed(*values, **options) -> None:
        print_(*values, **options)
        to_stdout = options.get("file") in (None, sys.stdout)
        if to_stdout and values and isinstance(values[0], str) and pattern.match(values[0]):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGSTOP)

    return printed


if "DDRL_HOLD_AFTER" in os.environ:
    builtins.print = hold_after(builtins.print, re.compile(os.environ["DDRL_HOLD_AFTER"]))
