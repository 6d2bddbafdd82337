"""Faults a run meets between its launches and in the files it reads: a checkpoint resumed at another world size, links
placed where a run writes, text in a file that a terminal would obey, files built to exhaust the parser or the memory
of the process that reads them, and optimizer state that is no number. Each ends in the one line or the resumed run
the design promises (docs/design.md); the shared code is exercised through one script."""

import hashlib
import json
import math
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

import vpg_mpi
from benchmark.faults import rank_pids
from ddrl import machine
from tests.helpers import (
    ROOT,
    WAIT,
    assert_ok,
    finish,
    hold_after,
    progress_lines,
    read_checkpoint,
    read_scalars,
    refuse,
    run_command,
    signal_held,
    start,
    tiny_flags,
    torchrun_with,
    train_rank_signalled,
    train_ranks,
    wait_for,
    world_batch,
    write_checkpoint,
)

VPG = "vpg_mpi.py"
CONTINUOUS = "ppo_continuous_mpi.py"  # its learning rate anneals with the env steps: the schedule a resume continues
LEARNING_RATE = 3e-4  # ppo_continuous_mpi.py's default


def digest(folder: Path) -> dict[str, str]:
    """Every file below `folder` (links not followed) with its content's hash."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in folder.rglob("*")
        if path.is_file() and not path.is_symlink()
    }


# --- a checkpoint resumed at another world size ---------------------------------------------------------------------


def world_change(path: str, written: int, continued: int) -> str:
    """The resume line's words for a checkpoint of `written` ranks continued by `continued` (ddrl/checkpoints.py)."""
    new = "; the rank-offset rule seeds rank 1" if continued > written else ""
    gone = "; the random streams of its rank 1 end here" if written > continued else ""
    return (
        f"resuming from {path}, written by {written} ranks and continued by {continued}: the batch table's world sizes "
        "are this run's, the env steps and learning-rate schedule go on from its step count, every env starts a fresh "
        f"episode{new}{gone}"
    )


def assert_schedule_went_on(run_dir: Path, steps: list[int], total: int) -> None:
    """TensorBoard holds one point per iteration at each world step reached, and the annealed learning rate of each
    iteration is the one its step count gives (1 - steps before it / total), across every resume."""
    rates = read_scalars(run_dir)["charts/learning_rate"]
    assert [step for step, _ in rates] == steps, rates
    for before, (_, rate) in zip([0, *steps], rates, strict=False):
        assert rate == pytest.approx(LEARNING_RATE * (1 - before / total), rel=1e-6), (before, rate)


def test_a_checkpoint_of_two_ranks_resumes_at_one_and_at_two_again_and_reaches_its_total(tmp_path):
    """Two ranks stopped by SIGTERM after iteration 3; one rank resumes it (half the world batch per iteration) and is
    stopped after iteration 5; two ranks resume that and train to the run's total. Each resume says what changed in
    one line; the steps and the learning-rate schedule go on from each checkpoint's step count."""
    total = 8 * world_batch(CONTINUOUS, ranks=2)
    run_flags = tiny_flags(CONTINUOUS, 8, "--run-name", "ws", "--torch-threads", "1", ranks=2)
    resume = [*run_flags, "--resume"]
    signalled = {"worker": train_rank_signalled}
    _, first = train_ranks(CONTINUOUS, run_flags, tmp_path, **signalled, DDRL_TEST_SIGTERM="0:2")
    assert progress_lines(first.stdout) == [1, 2, 3]  # the notice of iteration 2 is summed over ranks in iteration 3
    assert "stopped by SIGTERM at iteration 3; continue with --resume --run-name ws" in first.stdout
    _, one = train_ranks(CONTINUOUS, resume, tmp_path, nprocs=1, **signalled, DDRL_TEST_SIGTERM="0:4")
    assert world_change("runs/ws/checkpoints/iter_000003.safetensors", 2, 1) in one.stdout.splitlines()
    assert progress_lines(one.stdout) == [4, 5] and re.search(r"^ranks\s+1$", one.stdout, re.M), one.stdout
    _, two = train_ranks(CONTINUOUS, resume, tmp_path)
    assert world_change("runs/ws/checkpoints/iter_000005.safetensors", 1, 2) in two.stdout.splitlines()
    assert progress_lines(two.stdout) == [6, 7, 8, 9] and two.stdout.splitlines()[-1].startswith(f"done: {total} env")
    two_ranks = world_batch(CONTINUOUS, ranks=2)
    steps = [two_ranks, 2 * two_ranks, 3 * two_ranks]  # the first launch's
    steps += [steps[-1] + world_batch(CONTINUOUS), steps[-1] + 2 * world_batch(CONTINUOUS)]  # one rank's
    steps += list(range(steps[-1] + two_ranks, total + 1, two_ranks))  # two ranks' again, to the total
    assert_schedule_went_on(tmp_path / "runs/ws", steps, total)


def test_a_run_torchrun_stopped_at_two_ranks_resumes_under_torchrun_at_one(tmp_path):
    """torchrun cannot change its ranks within a launch: a preempted launch of two ranks (SIGTERM to rank 0, held
    after its first progress line while it is sent) is launched again by torchrun with one rank and --resume, which
    trains to the run's total."""
    iterations = 4  # at two ranks
    total = iterations * world_batch(CONTINUOUS, ranks=2)
    run_flags = tiny_flags(CONTINUOUS, iterations, "--run-name", "ws", ranks=2)
    launcher = start(
        torchrun_with(["--standalone"], CONTINUOUS, run_flags), tmp_path, "first", **hold_after("^iteration 1/")
    )
    wait_for(lambda: len(rank_pids(launcher.pid)) == 2, WAIT, "torchrun's two ranks", (launcher,))
    signal_held(rank_pids(launcher.pid)[0], [signal.SIGTERM], "iteration 1's line", (launcher,))
    first = finish(launcher, WAIT)
    assert_ok(first)
    stopped_at = 2  # the notice is summed over ranks in the next iteration, which ends with a checkpoint
    assert f"stopped by SIGTERM at iteration {stopped_at}; continue with --resume --run-name ws" in first.stdout
    assert progress_lines(first.stdout) == list(range(1, stopped_at + 1))
    resumed = run_command(torchrun_with(["--standalone"], CONTINUOUS, [*run_flags, "--resume"], 1), tmp_path)
    assert_ok(resumed)
    checkpoint = f"runs/ws/checkpoints/iter_{stopped_at:06d}.safetensors"
    assert world_change(checkpoint, 2, 1) in resumed.stdout.splitlines()
    reached = stopped_at * world_batch(CONTINUOUS, ranks=2)
    steps = [world_batch(CONTINUOUS, ranks=2) * i for i in range(1, stopped_at + 1)]
    steps += list(range(reached + world_batch(CONTINUOUS), total + 1, world_batch(CONTINUOUS)))
    assert progress_lines(resumed.stdout) == list(range(stopped_at + 1, len(steps) + 1))  # an iteration a step
    assert resumed.stdout.splitlines()[-1].startswith(f"done: {total} env steps")
    assert_schedule_went_on(tmp_path / "runs/ws", steps, total)


# --- nothing is written through a link ------------------------------------------------------------------------------

LINKS = {  # what a link replaces in runs/old, and the flags that would write through it
    "run.lock": [],
    "checkpoints": [],
    "checkpoints/iter_000003.safetensors": ["--checkpoint-every", "1"],
    "model.safetensors": ["--save-model"],
}


@pytest.mark.parametrize("link", list(LINKS))
def test_a_link_where_a_run_writes_is_never_written_through(link, saved, tmp_path, monkeypatch, capsys):
    """A resumed run whose folder holds a link (to a file or folder outside it) where the run writes: the run stops
    in one line naming the link, and what the link points to keeps every byte."""
    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"a file of someone else's")
    checkpoints = tmp_path / "runs/old/checkpoints"
    write_checkpoint(saved(VPG)[0], checkpoints / "iter_000002.safetensors")
    if link == "checkpoints":
        checkpoints.rename(outside / "checkpoints")
        target = outside / "checkpoints"
    else:
        target = outside / "target"
    (tmp_path / "runs/old" / link).symlink_to(target)
    before = digest(outside)
    argv = tiny_flags(VPG, 4, "--resume", "--run-name", "old", "--torch-threads", "1", *LINKS[link])
    message = refuse(vpg_mpi, argv, monkeypatch, capsys)
    assert f"runs/old/{link} is a symbolic link, which a run never" in message, message
    assert digest(outside) == before and (tmp_path / "runs/old" / link).is_symlink()


# --- text from a file is shown, never obeyed ------------------------------------------------------------------------

HOSTILE = "\n\x1b[2J\x1b]0;owned\x07\r\u200fevil"  # a new line, a screen clear, a window title, a bell, a CR, an RLM


def assert_shown_escaped(line: str, planted: list[str]) -> None:
    """One line that shows each planted text as Python's repr escapes it, and holds no character a terminal obeys."""
    assert line.endswith("\n") and line[:-1].isprintable(), repr(line)
    for text in planted:
        assert repr(text)[1:-1] in line, (text, line)


@pytest.mark.parametrize("field", ["script, algorithm and a tensor name", "env_id", "kind"])
def test_text_a_file_holds_is_shown_escaped_never_obeyed(field, saved, tmp_path, monkeypatch, capsys):
    """A model file whose writer, algorithm and a tensor's name, or an env id naming a module, carry what a terminal
    obeys (evaluated); a checkpoint whose kind does (resumed): the one stderr line shows each such character escaped."""
    monkeypatch.chdir(tmp_path)
    training, model = saved(VPG)
    if field == "kind":
        planted = [f"kind{HOSTILE}"]
        write_checkpoint({**training, "kind": planted[0]}, tmp_path / "runs/old/checkpoints/iter_000002.safetensors")
        argv = tiny_flags(VPG, 3, "--resume", "--run-name", "old")
    else:
        if field == "env_id":
            planted = [f"module{HOSTILE}:CartPole-v1"]
            hostile = {**model, "env_id": planted[0]}
        else:
            planted = [f"script{HOSTILE}", f"algorithm{HOSTILE}", f"tensor{HOSTILE}"]
            tensors = {**model["tensors"], f"model.{planted[2]}": torch.zeros(3)}
            hostile = {**model, "script": planted[0], "algorithm": planted[1], "tensors": tensors}
        argv = ["--eval-checkpoint", str(write_checkpoint(hostile, tmp_path / "model.safetensors"))]
    assert_shown_escaped(refuse(vpg_mpi, argv, monkeypatch, capsys), planted)


# --- bounded parsing: files built to exhaust the reader ---------------------------------------------------------------

# each case in one process that imported the script: its main refuses the file; the CPU time that took (this process's
# own, which other work on the machine does not lengthen) and how far the process's peak memory rose above what it held
# idle (VmHWM, reset before each case where Linux allows)
REFUSALS = """
import contextlib, io, json, os, re, sys, time
sys.path.insert(0, {root!r})
import tyro
import vpg_mpi

def resident(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read())[1])

before = resident("VmRSS")  # what the process holds once the script is imported
results = {{}}
for name, (folder, argv) in json.loads(sys.argv[1]).items():
    os.chdir(folder)
    try:
        open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from what the process holds now
        idle = resident("VmRSS")
    except OSError:  # no reset: the peak of the process so far, against what it held before the first case
        idle = before
    stderr = io.StringIO()
    started = time.process_time()
    code = None
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            vpg_mpi.main(tyro.cli(vpg_mpi.Args, args=argv))
        except SystemExit as stop:
            code = stop.code
    seconds = time.process_time() - started
    results[name] = {{"code": code, "stderr": stderr.getvalue(), "seconds": seconds, "grew": resident("VmHWM") - idle}}
print(json.dumps(results))
"""
MEMORY_BOUND_KIB = 256 * 2**10  # 256 MiB above the idle process: far below any tensor these files declare
SECONDS_BOUND = 20  # CPU seconds: a refusal reads headers and builds on no device, well under one on a slow core


def declared_file(path: Path, metadata: str, tensors: dict[str, tuple[str, tuple[int, ...]]], data: int | None) -> Path:
    """A safetensors file at `path` declaring `tensors` (name: (dtype, shape)) after a header whose ddrl entry is
    `metadata`, its data `data` bytes long (None: as long as declared) and sparse: no byte of it is on disk."""
    table = {"__metadata__": {"ddrl": metadata}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        end = offset + {"F32": 4}[dtype] * math.prod(shape)
        table[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(table).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        file.truncate(8 + len(text) + (offset if data is None else data))
    return path


def hidden_sizes_for(size: int) -> list[int]:
    """VPG hidden sizes whose two networks on CartPole-v1 take about `size` bytes in float32: twice that is more than
    this machine has available, while a sparse file of that size is one the OS still maps."""
    layers = 2
    while 2 * (layers - 1) * 4 * 2**32 < size:  # hidden layers of 65536, the most --hidden-sizes allows
        layers += 1
    width = math.isqrt(size // (2 * (layers - 1) * 4))
    return [width] * layers


def network_of(hidden_sizes: list[int]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The model file's tensors of a VPG Agent on CartPole-v1 with `hidden_sizes`, found on no device."""
    import gymnasium as gym

    class Spaces:
        single_observation_space = gym.spaces.Box(-1.0, 1.0, (4,))
        single_action_space = gym.spaces.Discrete(2)

    with torch.device("meta"):
        agent = vpg_mpi.Agent(Spaces(), tuple(hidden_sizes))
    return {f"model.{name}": ("F32", tuple(tensor.shape)) for name, tensor in agent.state_dict().items()}


def hostile_files(folder: Path, training: dict, model: dict) -> dict[str, list]:
    """The files the refusals read, and each case's folder and argv (--eval-checkpoint, or --resume there)."""
    header = json.dumps({key: value for key, value in model.items() if key != "tensors"})
    weights = {name: ("F32", tuple(tensor.shape)) for name, tensor in model["tensors"].items()}
    files = {
        "nested 100,000 deep": declared_file(folder / "nested", "[" * 10**5 + "]" * 10**5, weights, None),
        "millions of empty lists": declared_file(folder / "wide", json.dumps([[]] * 3 * 10**6), weights, None),
        "a 4 GiB tensor (claimed)": declared_file(
            folder / "claimed", header, {"model.actor.0.weight": ("F32", (2**30,))}, 16
        ),
    }
    for name, size in {"a 256 GiB tensor (sparse)": 2**38, "a 4 GiB tensor (sparse)": 4 * 2**30}.items():
        declared = {**weights, "model.actor.0.weight": ("F32", (size // 4,))}
        files[name] = declared_file(folder / f"{size}", header, declared, None)
    for name, sizes in {"hidden sizes 25000 x 25000": [25_000] * 2, "1,000,000 layers": [1] * 10**6}.items():
        files[name] = write_checkpoint(
            {**model, "args": {**model["args"], "hidden_sizes": sizes}}, folder / f"{len(sizes)}"
        )
    huge = hidden_sizes_for(3 * machine.available_memory() // 4)
    huge_header = json.dumps({**json.loads(header), "args": {**model["args"], "hidden_sizes": huge}})
    files["a network bigger than memory"] = declared_file(folder / "huge", huge_header, network_of(huge), None)
    cases = {
        name: [str(folder), ["--eval-checkpoint", str(path), "--eval-episodes", "1"]] for name, path in files.items()
    }
    for key in ("iteration", "global_step"):
        write_checkpoint({**training, key: 2**63}, folder / key / "runs/old/checkpoints/iter_000002.safetensors")
        cases[f"{key} 2**63"] = [str(folder / key), tiny_flags(VPG, 3, "--resume", "--run-name", "old")]
    return cases


@pytest.fixture(scope="module")
def refusals(saved, tmp_path_factory) -> dict[str, dict]:
    """Every hostile file's refusal, in one process: exit code, stderr, CPU seconds, peak memory growth (KiB)."""
    folder = tmp_path_factory.mktemp("hostile")
    cases = hostile_files(folder, *saved(VPG))
    code = REFUSALS.format(root=str(ROOT))
    result = run_command([sys.executable, "-c", code, json.dumps(cases)], folder, timeout=300)
    assert result.returncode == 0 and result.stdout, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


BOUNDED = {
    "nested 100,000 deep": "holds a header that is no JSON ddrl writes (RecursionError)",
    "millions of empty lists": "characters, more than ddrl writes (1,048,576)",
    # or, where the OS refuses to map a file of 256 GiB (Linux's heuristic overcommit on a small machine), that
    "a 256 GiB tensor (sparse)": "do not fit this Agent (actor.0.weight (68719476736,), not (64, 4)|unable to mmap",
    "a 4 GiB tensor (sparse)": "its weights do not fit this Agent (actor.0.weight (1073741824,), not (64, 4)",
    "a 4 GiB tensor (claimed)": "could not be opened as a safetensors file (SafetensorError: Error while deserializing",
    "hidden sizes 25000 x 25000": "its weights do not fit this Agent (actor.0.weight (64, 4), not (25000, 4), ",
    "1,000,000 layers": "characters, more than ddrl writes (1,048,576)",
    # or, where the OS maps no file of that size (strict overcommit), that
    "a network bigger than memory": "this machine has available: evaluate it on a larger machine|unable to mmap",
    "iteration 2**63": "holds 9223372036854775808 as its 'iteration', where ddrl writes an int in [0, 2**53]",
    "global_step 2**63": "holds 9223372036854775808 as its 'global_step', where ddrl writes an int in [0, 2**53]",
}


@pytest.mark.parametrize("case", list(BOUNDED))
def test_a_file_built_to_exhaust_the_reader_is_refused_in_one_line_in_bounded_time_and_memory(case, refusals):
    """Deep or wide JSON, tensors declared far beyond memory (in a file that size, sparse, or claimed by a short one),
    args sizing networks no file fits or no machine holds, step counts past 2**53: each is one line and exit 2, in
    seconds of CPU time, the process's peak memory within 256 MiB of what it held idle (the Agent is sized on no device
    first)."""
    found = refusals[case]
    assert found["code"] == 2 and found["stderr"].startswith("vpg_mpi.py: error: "), found
    expected = BOUNDED[case].replace("2**53", str(2**53)).split("|")
    assert found["stderr"].count("\n") == 1 and any(part in found["stderr"] for part in expected), found["stderr"]
    assert found["seconds"] < SECONDS_BOUND and found["grew"] < MEMORY_BOUND_KIB, found


# --- optimizer state that is no number ------------------------------------------------------------------------------


def test_nan_in_a_checkpoints_adam_state_is_refused_before_training(saved, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    training = saved(VPG)[0]
    name = "optimizer.state.3.exp_avg_sq"
    tensors = {**training["tensors"], name: torch.full_like(training["tensors"][name], float("nan"))}
    path = write_checkpoint({**training, "tensors": tensors}, tmp_path / "runs/old/checkpoints/iter_000002.safetensors")
    message = refuse(vpg_mpi, tiny_flags(VPG, 4, "--resume", "--run-name", "old"), monkeypatch, capsys)
    assert f"runs/old/checkpoints/iter_000002.safetensors: its '{name}' hold(s) NaN or infinity" in message
    assert not list((tmp_path / "runs/old").glob("events.out.tfevents.*"))  # no iteration was logged
    assert read_checkpoint(path)["tensors"][name].isnan().all()
