"""The shared-memory path of the CPU collectives (ddrl/collectives.py) on real process groups: where every rank is on
one node it carries the world's collectives that fit a slot, each rank ends with the same bits as every other (and
gloo's at two ranks), a dead peer ends every other rank in one line, and ranks that outnumber the cores still train."""

import os
import signal
import time
import types

import pytest
import torch
import torch.distributed as dist

import vpg_mpi
from ddrl import collectives, launching, shared_memory
from tests.helpers import (
    RANK_ENTRY,
    ROOT,
    WAIT,
    assert_ok,
    assert_same_parameters,
    finish_python,
    free_port,
    output,
    progress_lines,
    read_checkpoint,
    refuse,
    run_ranks,
    start_python,
    tiny_flags,
    torchrun,
    train_ranks,
    wait_for,
)

VPG = "vpg_mpi.py"
CONTINUOUS = "ppo_continuous_mpi.py"
SHARED = "shared memory + gloo"  # the batch table's collectives row where the segment carries them
DTYPES = (torch.float32, torch.float64, torch.int64)


def inputs_of(rank: int) -> dict[torch.dtype, torch.Tensor]:
    """What rank `rank` of joined_rank moves, by dtype: 12 x 5 numbers whose float sums round differently in another
    order (magnitudes apart by rank), and int64s beyond float64's exact integers."""
    generator = torch.Generator().manual_seed(rank)
    inputs = {}
    for dtype in DTYPES:
        numbers = torch.randn(12, 5, generator=generator, dtype=torch.float64) * 10.0 ** (rank % 3)
        inputs[dtype] = (numbers * 2**50).to(dtype) if dtype == torch.int64 else numbers.to(dtype)
    return inputs


def joined_rank(rank: int, world_size: int, choices: tuple[str, ...]) -> dict:
    """One rank that joins the world as a script's Run.start does (`choices`: each rank's --collectives), then moves
    inputs_of(rank) through ddrl's collectives, and through torch.distributed's (gloo) for reference: every result by
    name, and how many collectives the segment carried."""
    args = types.SimpleNamespace(backend="", cuda=False, dist_timeout=60.0, torch_threads=1, collectives=choices[rank])
    world = launching.World(rank, world_size, rank, world_size)
    results = {"row": launching.join_process_group(args, world)}
    for dtype, mine in inputs_of(rank).items():
        for op in ("sum", "max"):
            gloo = mine.clone()
            dist.all_reduce(gloo, op=getattr(dist.ReduceOp, op.upper()))
            results[f"{op} {dtype}"] = (collectives.reduce_to_all(mine.clone(), op), gloo)
        results[f"gather_to_all {dtype}"] = collectives.gather_to_all(mine)
        results[f"gather_to_rank0 {dtype}"] = collectives.gather_to_rank0(mine)
        results[f"broadcast_from_rank0 {dtype}"] = collectives.broadcast_from_rank0(mine.clone())
    results["carried"] = getattr(collectives.world_transport, "carried", 0)
    # a tensor larger than a slot goes through gloo, as does a subgroup's collective
    large = torch.full((shared_memory.slot_bytes(world_size) // 4 + 1,), rank + 1.0)
    results["larger than a slot"] = collectives.reduce_to_all(large).unique()
    results["subgroup"] = collectives.reduce_to_all(torch.ones(3), group=dist.new_group(list(range(world_size))))
    results["carried after"] = getattr(collectives.world_transport, "carried", 0)
    return results


@pytest.mark.parametrize(
    "world_size, choices, row",
    [
        (2, ("auto", "auto"), SHARED),
        (3, ("auto", "auto", "auto"), SHARED),
        (2, ("shm", "shm"), SHARED),
        (2, ("torch", "torch"), "torch gloo"),
        (2, ("torch", "auto"), "torch gloo"),  # ranks that disagree take gloo together (check_same_command stops them)
    ],
    ids=["auto-2", "auto-3", "shm", "torch", "disagree"],
)
def test_every_rank_gets_the_same_bits_which_are_gloos_at_two_ranks(world_size, choices, row, tmp_path):
    """Every rank combines every rank's input in rank order itself, so all hold the same bits; at two ranks a + b =
    b + a, gloo's bits; at three gloo's ring adds in another order, so float sums agree within rounding. Maxima,
    gathers and the broadcast are exact. The segment carries each of these, and nothing that is a subgroup's or too
    large for a slot; where --collectives torch (or one rank's) says so, gloo carries everything."""
    ranks = run_ranks(joined_rank, world_size, tmp_path, choices, join_group=False)
    inputs = [inputs_of(rank) for rank in range(world_size)]
    for rank, results in enumerate(ranks):
        assert results["row"] == row
        assert results["carried"] == results["carried after"] == (5 * len(DTYPES) if row == SHARED else 0)
        assert results["larger than a slot"].tolist() == [sum(range(1, world_size + 1))]
        assert results["subgroup"].tolist() == [world_size] * 3
        for dtype in DTYPES:
            stacked = torch.stack([rank_inputs[dtype] for rank_inputs in inputs])
            in_rank_order = stacked[0].clone()
            for other in stacked[1:]:
                in_rank_order += other
            for op in ("sum", "max"):
                result, gloo = results[f"{op} {dtype}"]
                assert result.dtype == dtype and torch.equal(result, ranks[0][f"{op} {dtype}"][0]), (rank, op, dtype)
                if op == "max" or dtype == torch.int64 or world_size == 2:
                    assert torch.equal(result, gloo), (rank, op, dtype)
                else:
                    torch.testing.assert_close(result, gloo)
                    assert torch.equal(result, in_rank_order) or row != SHARED, dtype
            assert torch.equal(results[f"gather_to_all {dtype}"], stacked)
            to_rank0 = results[f"gather_to_rank0 {dtype}"]
            assert torch.equal(to_rank0, stacked) if rank == 0 else to_rank0 is None
            assert torch.equal(results[f"broadcast_from_rank0 {dtype}"], inputs[0][dtype])


def collectives_row(stdout: str) -> str:
    """What the batch table says carries the collectives."""
    [row] = [line for line in stdout.splitlines() if line.startswith("collectives")]
    return row.removeprefix("collectives").strip()


def test_a_torchrun_launch_takes_shared_memory_and_trains_gloos_model(tmp_path):
    """Under torchrun on one node the batch table names the segment, and two iterations of two ranks end with the model
    that the same run through gloo alone (--collectives torch) ends with, bit for bit."""
    flags = tiny_flags(CONTINUOUS, 2, "--save-model", ranks=2)
    shared = torchrun(CONTINUOUS, [*flags, "--run-name", "shared"], tmp_path)
    assert_ok(shared)
    _, gloo = train_ranks(CONTINUOUS, [*flags, "--collectives", "torch", "--run-name", "gloo"], tmp_path)
    models = {}
    for name, result, row in (("shared", shared, SHARED), ("gloo", gloo, "torch gloo")):
        assert collectives_row(result.stdout) == row and progress_lines(result.stdout) == [1, 2]
        models[name] = read_checkpoint(tmp_path / "runs" / name / "model.safetensors")["tensors"]
    for key, value in models["gloo"].items():
        assert torch.equal(models["shared"][key], value), key


def test_sixteen_ranks_on_two_cores_train(tmp_path):
    """Ranks that outnumber the cores sleep while they wait for their peers rather than yield a core that a peer needs:
    16 ranks (forked with torchrun's variables, which torchrun itself would take half a minute to start) train two
    epochs together in seconds; gloo took two to three times as long per epoch."""
    flags = ["--env-id", "CartPole-v1", "--steps-per-epoch", "320", "--train-v-iters", "2", "--total-timesteps", "640"]
    started = time.monotonic()
    states, result = train_ranks(VPG, flags, tmp_path, nprocs=16, timeout=120)
    assert progress_lines(result.stdout) == [1, 2] and collectives_row(result.stdout) == SHARED
    assert_same_parameters(states)
    assert time.monotonic() - started < 90, result.stdout


def test_a_killed_rank_ends_every_other_rank_in_one_line_at_once(tmp_path):
    """Rank 1 of three dies by SIGKILL once training runs: ranks 0 and 2 find it gone through its pidfd in their next
    collective and each stops in one line saying so, long before --dist-timeout (1800 s by default) would."""
    port = str(free_port())
    flags = ["--env-id", "CartPole-v1", "--steps-per-epoch", "300", "--total-timesteps", "300000"]
    ranks = []
    for rank in range(3):
        env = {"RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        ranks.append(start_python(ROOT / VPG, flags, tmp_path, f"rank{rank}", **env))
    try:
        wait_for(lambda: progress_lines(output(ranks[0])[0]), WAIT, "the first epoch", tuple(ranks))
        os.kill(ranks[1].pid, signal.SIGKILL)
        survivors = [finish_python(ranks[rank], WAIT) for rank in (0, 2)]
    finally:
        for process in ranks:
            process.kill()
            process.join()
    for rank, result in zip((0, 2), survivors, strict=True):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        [message] = [line for line in result.stderr.splitlines() if "error" in line]
        # rank 0 stops once it finds rank 1 gone: a rank 2 that a busy machine slowed may find rank 0 gone first
        gone = (1, 0) if rank == 2 else (1,)
        assert any(
            message.startswith(
                f"{VPG}: error: rank {rank}: lost contact with another rank (rank {lost} exited during a "
                "shared-memory collective): it died, or stalled longer than --dist-timeout 1800 s"
            )
            for lost in gone
        ), message


@pytest.mark.parametrize(
    "signalled, name", [(0, "SIGKILL"), (0, "SIGINT"), (1, "SIGKILL")], ids=["rank 0 killed", "Ctrl-C", "rank 1 killed"]
)
def test_a_rank_killed_or_interrupted_in_the_join_leaves_no_segment_and_one_line_per_rank(signalled, name, tmp_path):
    """A rank killed (or given Ctrl-C) right after it mapped the segment, in the join, before training: nothing of
    the segment stays in /dev/shm (what the signalled rank had mapped there is gone once the ranks are), the
    survivor ends in the one lost-contact line, and no rank prints a traceback."""
    port = str(free_port())
    flags = [VPG, "--env-id", "CartPole-v1", "--steps-per-epoch", "200", "--total-timesteps", "400"]
    ranks = []
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env["DDRL_TEST_JOIN_SIGNAL"] = f"{signalled}:{name}"
        ranks.append(start_python(RANK_ENTRY, flags, tmp_path, f"rank{rank}", **env))
    try:
        results = [finish_python(process, 120) for process in ranks]
    finally:
        for process in ranks:
            process.kill()
            process.join()
    mapped = (tmp_path / f"maps{signalled}.txt").read_text().splitlines()
    assert mapped, "the signalled rank had mapped no segment"  # it was signalled where the test means
    paths = [line.split(maxsplit=5)[5] for line in mapped]
    assert not [path for path in paths if path.startswith("/dev/shm/") and os.path.exists(path)], paths
    survivor = 1 - signalled
    assert all("Traceback" not in result.stderr for result in results), [result.stderr for result in results]
    assert results[survivor].returncode == 2 and not progress_lines(results[0].stdout)
    [message] = [line for line in results[survivor].stderr.splitlines() if ": error: " in line]
    assert message.startswith(f"{VPG}: error: rank {survivor}: lost contact with another rank ("), message
    assert message.endswith("; see its log, then launch it again: nothing was written"), message
    if name == "SIGINT":
        assert results[signalled].returncode == 130
        assert results[signalled].stderr == f"{VPG}: stopped by Ctrl-C before training began; nothing was written\n"
    else:
        assert results[signalled].returncode == -signal.SIGKILL


def test_collectives_shm_is_refused_where_no_segment_can_carry_them(monkeypatch, capsys):
    message = refuse(vpg_mpi, ["--collectives", "shm", *tiny_flags(VPG, 2)], monkeypatch, capsys)
    assert message == (
        f"{VPG}: error: --collectives shm needs 2 or more ranks on one node; pass --collectives auto, which falls back "
        "to gloo\n"
    )
