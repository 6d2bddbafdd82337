"""What a resumed run takes from its checkpoint, checked as its consumers would take it, and where a run writes, checked
before its first iteration: random streams in a state no generator leaves (a key of zeros, on which numpy's next
gaussian hangs; a NaN cached; a position outside the key), counters whose env seeds would pass the int32 seeds ale-py
takes, and links planted where a run writes. Each is refused in one line (exit 2, no traceback, no file changed) on
every rank; a count at its bound resumes, and what that run writes resumes again. The streams are ddrl's, the same for
every script: exercised through VPG's files."""

import hashlib
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import vpg_mpi
from ddrl import checkpoint_files, checkpoints
from tests.helpers import (
    exit_code_rank,
    progress_lines,
    read_checkpoint,
    tiny_flags,
    train_ranks,
    world_batch,
    write_checkpoint,
)
from tests.test_checkpoints import changed, with_tensors
from tests.test_hostile_input import refused

VPG = "vpg_mpi.py"
RESUMED = "runs/old/checkpoints/iter_000002.safetensors"


def resume_argv(checkpoint: dict, cwd: Path, *extra: str) -> list[str]:
    """`checkpoint` as the newest of runs/old, and the flags that resume it (to iteration 4), with `extra`."""
    write_checkpoint(checkpoint, cwd / RESUMED)
    return tiny_flags(VPG, 4, "--resume", "--run-name", "old", "--torch-threads", "1", *extra)


# --- random streams: each as its generator would take it ------------------------------------------------------------


def torch_state(row: torch.Tensor, **fields: float) -> torch.Tensor:
    """A copy of torch's CPU generator state `row` with the named fields (checkpoint_files.TORCH_STATE) set: the key's
    624 words to one value."""
    raw = row.numpy().copy()
    for name, value in fields.items():
        raw.view(checkpoint_files.TORCH_STATE)[name] = value
    return torch.from_numpy(raw)


def damaged(checkpoint: dict, name: str, rank: int, change) -> dict:
    """`checkpoint` with rank `rank`'s row of the random stream `name` replaced by `change(row)`."""
    rows = checkpoint["tensors"][name].clone()
    rows[rank] = change(rows[rank].clone())
    return with_tensors(checkpoint, **{name: rows})


def numpy_state(position: float, has_gauss: float, cached: float):
    return lambda row: torch.tensor([position, has_gauss, cached], dtype=torch.float64)


def python_words(**words: int):
    """Python's row with words (w0, w623, position) set."""

    def change(row: torch.Tensor) -> torch.Tensor:
        for place, value in words.items():
            row[int(place[1:]) if place != "position" else checkpoint_files.MT_WORDS] = value
        return row

    return change


STREAMS = {  # a state no generator leaves: (stream, its change, what the line says)
    "numpy key of zeros": ("rng.numpy", torch.zeros_like, "numpy's key is zeros, from which it would draw nothing"),
    "numpy NaN gaussian": ("rng.numpy_state", numpy_state(624, 1, math.nan), "numpy's cached gaussian is no draw's"),
    "numpy huge gaussian": ("rng.numpy_state", numpy_state(624, 1, 1e300), "numpy's cached gaussian is no draw's"),
    "numpy position": ("rng.numpy_state", numpy_state(10**6, 0, 0.0), "numpy's position lies outside [0, 624]"),
    "numpy half position": ("rng.numpy_state", numpy_state(3.5, 0, 0.0), "numpy's position lies outside [0, 624]"),
    "numpy has_gauss": ("rng.numpy_state", numpy_state(624, 2, 0.0), "numpy's has_gauss is neither 0 nor 1"),
    "python key of zeros": (
        "rng.python",
        lambda row: torch.cat([torch.zeros(624, dtype=row.dtype), row[624:]]),
        "Python's key is zeros",
    ),
    "python position": ("rng.python", python_words(position=625), "Python's position lies outside [0, 624]"),
    "python word": ("rng.python", python_words(w0=2**32), "Python's key holds numbers outside [0, 2**32)"),
    "python gaussian": ("rng.python_gauss", lambda row: torch.tensor(math.inf).double(), "Python's cached gaussian"),
    "torch key of zeros": ("rng.torch", lambda row: torch_state(row, key=0), "torch's key is zeros"),
    "torch word": ("rng.torch", lambda row: torch_state(row, key=2**32), "torch's key holds numbers outside"),
    "torch position": (
        "rng.torch",
        lambda row: torch_state(row, left=624, next=624),
        "torch's position lies outside its key",
    ),
    "torch unseeded": ("rng.torch", lambda row: torch_state(row, seeded=0), "torch's generator was never seeded"),
    "torch NaN normal": (
        "rng.torch",
        lambda row: torch_state(row, normal=math.nan, normal_valid=1),
        "torch's cached normal is no draw's",
    ),
    "torch NaN float normal": (
        "rng.torch",
        lambda row: torch_state(row, float_normal=math.nan, float_valid=1),
        "torch's cached float normal is no draw's",
    ),
}


@pytest.mark.parametrize("case", list(STREAMS))
def test_a_random_stream_no_generator_leaves_is_one_line_naming_the_file_and_the_stream(
    case, saved, tmp_path, monkeypatch, capsys
):
    """Refused at start, before any process group, env or file: a key of zeros would hang numpy's next gaussian (no
    signal stops it), a NaN cached would reach the first actions and stop the run blaming the Agent."""
    name, change, fault = STREAMS[case]
    argv = resume_argv(damaged(saved(VPG)[0], name, 0, change), tmp_path)
    line = refused(VPG, argv, tmp_path, monkeypatch, capsys)
    assert line.startswith(f"{VPG}: error: {RESUMED}: its random streams of rank 0 do not fit this run ({fault}"), line
    assert "a state no generator leaves: it is damaged; delete it to resume from the one before" in line, line


def test_every_ranks_streams_are_checked_whatever_the_world_resuming(saved, tmp_path, monkeypatch, capsys):
    """A file of two ranks, resumed by one: rank 1's streams, which this run would never load, are checked too."""
    training = saved(VPG)[0]
    two = {name: torch.cat([tensor, tensor]) for name, tensor in training["tensors"].items() if name.startswith("rng.")}
    checkpoint = with_tensors(changed(training, world_size=2), **two)
    checkpoint = damaged(checkpoint, "rng.numpy", 1, torch.zeros_like)
    line = refused(VPG, resume_argv(checkpoint, tmp_path), tmp_path, monkeypatch, capsys)
    assert f"{RESUMED}: its random streams of rank 1 do not fit this run (numpy's key is zeros" in line, line


@pytest.mark.parametrize(("offset", "size"), [(3, 16), (-4, 16), (0, 15)], ids=["odd", "negative", "short"])
def test_cuda_streams_are_checked_without_cuda(offset, size, saved, tmp_path, monkeypatch, capsys):
    """CUDA's Philox states (seed, offset), one per device: an offset torch refuses or never reaches, or a state of
    another size, is one line on a machine without CUDA too."""
    state = np.zeros((1, 1, 16), dtype=np.uint8)
    state[0, 0, 8:16] = np.array([offset], dtype="<i8").view(np.uint8)
    checkpoint = with_tensors(saved(VPG)[0], **{"rng.cuda": torch.from_numpy(state[..., :size].copy())})
    line = refused(VPG, resume_argv(checkpoint, tmp_path), tmp_path, monkeypatch, capsys)
    fault = "CUDA's offset is negative or no multiple of 4" if size == 16 else "rng.cuda (1, 1, 15) 'U8', not (1, dev"
    assert fault in line, line


def test_torch_generator_fields_are_where_ddrl_reads_them():
    """The layout ddrl reads torch's CPU generator state by is torch's own: a seeded generator's `left`, `next`,
    `seeded` and first key word, the position after draws, and the cached normal that the next draw returns."""
    generator = torch.Generator().manual_seed(7)

    def field(name: str) -> float:
        return generator.get_state().numpy().view(checkpoint_files.TORCH_STATE)[name][0].item()

    assert generator.get_state().numel() == checkpoint_files.TORCH_STATE.itemsize
    key = generator.get_state().numpy().view(checkpoint_files.TORCH_STATE)["key"][0]
    assert (field("left"), field("next"), field("seeded"), key[0]) == (1, 0, 1, 7)
    torch.rand(5, generator=generator)
    assert field("left") + field("next") == checkpoint_files.MT_WORDS + 1
    torch.randn(1, dtype=torch.float64, generator=generator)
    cached = field("normal")
    assert field("normal_valid") == 1 and torch.randn(1, dtype=torch.float64, generator=generator).item() == cached
    first = checkpoint_files.random_streams()
    random.gauss(0, 1)  # a gaussian cached in Python's and numpy's streams too
    np.random.standard_normal()
    second = checkpoint_files.random_streams()
    rows = {name: torch.stack([first[name], second[name]]).numpy() for name in first}
    assert not [fault for ranks, fault in checkpoint_files.stream_faults(rows) if ranks.any()]


# --- counters: what they seed must fit, and what a run writes it reads again -------------------------------------


def test_the_env_seed_limit_is_ale_pys():
    """ale-py takes an env seed below 2**31, and the largest seed the check lets a run use."""
    import ale_py

    envs = ale_py.AtariVectorEnv("breakout", num_envs=1)
    try:
        envs.reset(seed=np.array([checkpoints.SEED_LIMIT - 1]))
        with pytest.raises(TypeError):
            envs.reset(seed=np.array([checkpoints.SEED_LIMIT]))
    finally:
        envs.close()


@pytest.mark.parametrize(
    ("seed", "ranks", "envs", "seeded", "fault"),
    [
        (2**31 - 1, 1, 1, 0, ""),  # one env, seeded with --seed itself
        (2**31 - 10_001, 1, 2, 0, ""),
        (2**31 - 10_000, 1, 2, 0, "--seed 2147473648 cannot seed 2 env(s), 1 rank(s) x --local-num-envs 2 (seed"),
        (0, 4, 2**16, 0, "up to 2621430000, where envs take seeds below 2**31): use 214749 envs or fewer"),
        (1, 1, 1, 214748, ""),
        (1, 2, 4, 214740, ""),  # 8 of the 9 env seeds --seed 1 leaves after 214740
        (1, 2, 5, 214740, "earlier attempts seeded 214740 envs, and --seed 1 cannot seed 10 env(s), 2 rank(s)"),
        (1, 2, 5, 214740, "resume with 9 envs or fewer, or start a new run"),
        (1, 1, 1, checkpoints.MAX_ENVS_SEEDED, "no env seed is left to it: start a new run"),
    ],
)
def test_env_seeds_past_what_envs_take_are_one_line(seed, ranks, envs, seeded, fault):
    args = vpg_mpi.Args(seed=seed, local_num_envs=envs)
    problem = checkpoints.env_seeds_problem(args, ranks, seeded, "r")
    assert fault in problem and bool(problem) == bool(fault), problem
    last = seed + checkpoints.SEED_STRIDE * (seeded + ranks * envs - 1)
    assert (last < 2**31) == (problem == "")


def test_a_seed_whose_env_seeds_overflow_is_one_line_before_anything_is_launched(tmp_path, monkeypatch, capsys):
    """The largest --seed the flag's rule allows, with more envs than fit above it: the last env's seed is past 2**31,
    refused before --nprocs launches any rank."""
    argv = tiny_flags(VPG, 2, "--seed", str(2**30 - 1), "--local-num-envs", "65536", "--nprocs", "2")
    line = refused(VPG, argv, tmp_path, monkeypatch, capsys)
    expected = f"{VPG}: error: --seed 1073741823 cannot seed 131072 env(s), 2 rank(s) x --local-num-envs 65536"
    assert expected in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("seeded", "fault"),
    [
        (2**53, "holds 9007199254740992 as its 'envs_seeded', where ddrl writes an int in [0, 214749]: it is damaged"),
        (214749, "runs/old's earlier attempts seeded 214749 envs, and --seed 1 cannot seed 1 env(s), 1 rank(s)"),
    ],
    ids=["beyond-any-run", "no-seed-left"],
)
def test_envs_seeded_whose_seeds_overflow_is_one_line_at_start(seeded, fault, saved, tmp_path, monkeypatch, capsys):
    argv = resume_argv(changed(saved(VPG)[0], envs_seeded=seeded), tmp_path)
    line = refused(VPG, argv, tmp_path, monkeypatch, capsys)
    assert fault in line, line


def test_a_file_written_at_the_restarts_bound_resumes_again(saved, tmp_path):
    """A run resumed from a file counting the most restarts a file may count writes that count again (not one more,
    which its next resume would refuse): it resumes again and trains on."""
    write_checkpoint(changed(saved(VPG)[0], restarts=checkpoints.MAX_RESTARTS), tmp_path / RESUMED)
    for iterations in (3, 4):
        flags = tiny_flags(VPG, iterations, "--resume", "--run-name", "old", "--checkpoint-every", "1")
        output = train_ranks(VPG, flags, tmp_path, nprocs=1)[1].stdout
        assert progress_lines(output) == [iterations], output
        written = read_checkpoint(tmp_path / f"runs/old/checkpoints/iter_{iterations:06d}.safetensors")
        assert written["restarts"] == checkpoints.MAX_RESTARTS
        assert written["envs_seeded"] == saved(VPG)[0]["envs_seeded"] + iterations - 2
    assert f"done: {4 * world_batch(VPG)} env steps" in output


# --- links where a run writes: found before the first iteration, and every rank stops ------------------------------


def digest(folder: Path) -> dict[str, str]:
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.rglob("*") if path.is_file()}


def assert_every_rank_stopped_in_one_line(codes: list, result, start: str) -> None:
    """Every rank exited 2, and their output holds one error line (`start`...) and nothing else on stderr."""
    assert codes == [2] * len(codes), (codes, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{VPG}: error: {start}"), line


def test_a_link_planted_in_checkpoints_stops_every_rank_at_start(saved, tmp_path):
    """Two ranks resume a run whose checkpoints/ holds a link: rank 0 finds it before the first iteration and every rank
    stops with its one line, where rank 1 was once left to a lost-contact stack at the first checkpoint."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"a file of someone else's")
    argv = resume_argv(saved(VPG)[0], tmp_path, "--checkpoint-every", "1")
    (tmp_path / "runs/old/checkpoints/notes").symlink_to(outside / "target")
    before = digest(tmp_path)
    codes, result = train_ranks(VPG, argv, tmp_path, nprocs=2, worker=exit_code_rank)
    link = "runs/old/checkpoints/notes is a symbolic link, which a run never reads or writes through"
    assert_every_rank_stopped_in_one_line(codes, result, link)
    assert progress_lines(result.stdout) == [] and "run folder" not in result.stdout  # no batch table: at start
    after = {path: value for path, value in digest(tmp_path).items() if not path.endswith((".out", ".err", ".pt"))}
    assert after == before and not (tmp_path / "runs/old/run.lock").exists()


def train_rank_planting_a_link(rank: int, world_size: int, script: str, cwd: str, flags: list[str]) -> int | None:
    """exit_code_rank, where rank 0 plants a link in the run's checkpoints/ once it has logged iteration 2: a link
    that appears while the run trains, which rank 0 alone meets when it writes that iteration's checkpoint."""
    import ddrl.run

    log = ddrl.run.Run.log

    def log_then_plant(run, iteration: int, *arguments) -> None:
        log(run, iteration, *arguments)
        if iteration == 2:
            os.symlink(os.path.join(cwd, "outside"), f"runs/{run.name}/checkpoints/notes")

    if rank == 0:
        ddrl.run.Run.log = log_then_plant
    return exit_code_rank(rank, world_size, script, cwd, flags)


def test_a_link_planted_while_the_run_trains_stops_every_rank_in_one_line(tmp_path):
    (tmp_path / "outside").mkdir()
    flags = tiny_flags(VPG, 3, "--run-name", "r", "--checkpoint-every", "1", "--torch-threads", "1")
    codes, result = train_ranks(VPG, flags, tmp_path, nprocs=2, worker=train_rank_planting_a_link)
    link = "runs/r/checkpoints/notes is a symbolic link, which a run never reads or writes through"
    assert_every_rank_stopped_in_one_line(codes, result, "could not write runs/r/checkpoints/iter_000002.safetensors: ")
    assert link in result.stderr and "the last good checkpoint is runs/r/checkpoints/iter_000001.safetensors" in (
        result.stderr
    )
    assert list((tmp_path / "outside").iterdir()) == [] and progress_lines(result.stdout) == [1, 2]
