"""Failures: one line that names the fix and exit code 2, never a traceback; warnings alike; and the
console lines of a run, which a reader that went away never turns into a traceback."""

import gc
import os
import re
import sys
from typing import NoReturn

import torch.distributed as dist

script = os.path.basename(sys.argv[0]) or "ddrl"
"""the running script's file name, which starts every message (launching.launch sets it)"""

MAX_VALUE_CHARS = 200  # a value quoted in a message longer than this is cut, its length said


class NonFiniteError(Exception):
    """A non-finite loss or gradient, found alike on every rank before it is applied."""


def fail_all(messages: list[str]) -> NoReturn:
    """Stop as fail() does, with one line per message (every flag that breaks its rule, say)."""
    for message in messages[:-1]:
        if this_rank() == 0:
            say(f"{script}: error: {message}")
    fail(messages[-1])


def fail(message: str, every_rank: bool = False, any_rank: bool = False) -> NoReturn:
    """Stop with one line naming the fix, exit code 2, printed by rank 0; with `every_rank` (a lost
    peer) by each rank, saying its rank; with `any_rank` by this process whatever its rank."""
    rank = this_rank()
    # said first: a launcher may end the job once another rank has left
    if every_rank or any_rank or rank == 0:
        who = f"rank {rank}: " if every_rank and dist_world_size() > 1 else ""
        say(f"{script}: error: {who}{message}")
    # every rank stops here together: leave the group cleanly
    if dist.is_initialized() and not every_rank:
        dist.destroy_process_group()
        gc.collect()
    if every_rank:
        quietly(sys.stdout.flush)
        # at once: the broken group's threads can abort an orderly interpreter exit (SIGABRT)
        os._exit(2)
    raise SystemExit(2)


def warn(message: str) -> None:
    """One warning line on stderr, `SCRIPT: warning: MESSAGE`."""
    say(f"{script}: warning: {message}")


def say(line: str) -> None:
    """`line` on stderr as one line: long words cut, characters a terminal would obey escaped."""
    line = re.sub(rf"\S{{{MAX_VALUE_CHARS + 1},}}", lambda word: cut(word[0]), line)
    line = "".join(char if char.isprintable() else repr(char)[1:-1] for char in line)
    # one write: lines of ranks sharing a console (torchrun's run unbuffered) never run together
    quietly(lambda: print(line + "\n", end="", file=sys.stderr, flush=True))


def tell(line: str) -> bool:
    """`line` on stdout, at once; False if its reader went away (`| head -1`): stdout then goes to
    /dev/null, so the run ends quietly instead of in a BrokenPipeError."""
    try:
        print(line, flush=True)
        return True
    except (OSError, ValueError):
        quiet = os.open(os.devnull, os.O_WRONLY)
        # the interpreter's last flush at exit finds nowhere to fail
        os.dup2(quiet, sys.stdout.fileno())
        os.close(quiet)
        return False


def quietly(write) -> None:
    """Call `write`, which prints or flushes, ignoring an output whose reader went away."""
    try:
        write()
    except (OSError, ValueError):  # BrokenPipeError; ValueError: the stream was closed
        pass


def shown(value: object) -> str:
    """`value` as a message quotes it (repr), cut to MAX_VALUE_CHARS with its length said."""
    return cut(repr(value))


def first_line(error: BaseException) -> str:
    """The first line of what `error` says (else its type's name), escaped and cut."""
    said = str(error).strip() or type(error).__name__
    return cut(repr(said.splitlines()[0])[1:-1])


def cut(text: str) -> str:
    """`text`, or its first MAX_VALUE_CHARS characters and how many there were."""
    if len(text) <= MAX_VALUE_CHARS:
        return text
    return f"{text[:MAX_VALUE_CHARS]}... ({len(text)} characters)"


def this_rank() -> int:
    """This process's rank as the process group or the launcher has it (else 0)."""
    if dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def dist_world_size() -> int:
    """The process group's size, else the launcher's WORLD_SIZE (1 when neither says)."""
    if dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
