"""The ddrl package beside the scripts, where users run them: README's install command installs it, so a copy of a
script in any other folder imports it, under torchrun, mpirun and --nprocs, from any working directory; and the
gradient sync a researcher sees in a copy's update keeps CleanRL's idioms, or stops the run when an edit breaks it."""

import re
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    ROOT,
    assert_ok,
    assert_same_parameters,
    edited_copy,
    exit_code_rank,
    free_port,
    progress_lines,
    read_scalars,
    run_command,
    run_dirs,
    tiny_flags,
    train_ranks,
)

VPG = "vpg_mpi.py"


def run_outside(command: list[str], cwd: Path, timeout: float = 240):
    """`command` in `cwd` with no PYTHONPATH: ddrl comes from the installed package, as after README's install."""
    return run_command(command, cwd, timeout, PYTHONPATH="")


@pytest.fixture
def elsewhere(tmp_path) -> tuple[Path, Path]:
    """A copy of vpg_mpi.py as my_vpg.py in one folder, and another folder to run it from."""
    copy = edited_copy(tmp_path / "research", VPG, name="my_vpg.py")
    cwd = tmp_path / "work"
    cwd.mkdir()
    return copy, cwd


def assert_trained_two_epochs_of_two_ranks(result, cwd: Path) -> None:
    assert_ok(result)
    assert progress_lines(result.stdout) == [1, 2] and re.search(r"^ranks\s+2\s", result.stdout, re.M), result.stdout
    [run_dir] = run_dirs(cwd)
    assert run_dir.name.startswith("CartPole-v1__my_vpg__1__")  # the copy's name is its experiment's


def test_a_copy_in_another_folder_runs_under_torchrun(elsewhere):
    copy, cwd = elsewhere
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(copy)]
    assert_trained_two_epochs_of_two_ranks(run_outside([*command, *tiny_flags(VPG, 2)], cwd), cwd)


def test_a_copy_in_another_folder_runs_under_mpirun(elsewhere):
    copy, cwd = elsewhere
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", f"MASTER_PORT={free_port()}"]
    result = run_outside([*mpirun, sys.executable, str(copy), *tiny_flags(VPG, 2)], cwd)
    assert_trained_two_epochs_of_two_ranks(result, cwd)
    assert "MPI (Open MPI" in result.stdout  # the batch table's collectives row


def test_a_copy_in_another_folder_runs_with_nprocs_and_names_itself_in_its_errors(elsewhere):
    copy, cwd = elsewhere
    result = run_outside([sys.executable, str(copy), *tiny_flags(VPG, 2), "--nprocs", "2"], cwd)
    assert_trained_two_epochs_of_two_ranks(result, cwd)
    refused = run_outside([sys.executable, str(copy), "--gamma", "2"], cwd)
    assert refused.returncode == 2 and refused.stderr == "my_vpg.py: error: --gamma must be at most 1, got 2.0\n"


def test_a_copy_beside_the_original_runs_from_the_repository_root(tmp_path):
    copy = edited_copy(ROOT, VPG, name=f"vpg_copy_{tmp_path.name.replace('-', '_')}.py")
    try:
        cwd = tmp_path / "work"
        cwd.mkdir()
        result = run_outside([sys.executable, str(copy), *tiny_flags(VPG, 2)], cwd)
        assert_ok(result)
        assert progress_lines(result.stdout) == [1, 2]
    finally:
        copy.unlink()


# --- the gradient sync in a researcher's copy -------------------------------------------------------------------------

ZERO_GRAD_AGAIN = {  # CleanRL's reflex, once more after the step: the gradients of the sync are the optimizer's own
    "ppo_continuous_mpi.py": [
        ("            optimizer.step()\n", "            optimizer.step()\n            optimizer.zero_grad()\n")
    ],
    "vpg_mpi.py": [
        (
            "    optimizer.step()  # the value function's own parameters have no gradient: Adam leaves them\n",
            "    optimizer.step()  # the value function's own parameters have no gradient: Adam leaves them\n"
            "    optimizer.zero_grad()\n",
        )
    ],
}
NO_SYNC = {  # an edit that breaks the sync: each rank steps on its own gradients
    "ppo_continuous_mpi.py": [("    collectives.allreduce_mean(flat, group)\n", "")],
    "vpg_mpi.py": [("    collectives.allreduce_mean(flat, group)\n", "")],
    "ppo_atari_multigpu.py": [
        (
            "model = DDP(\n                model, device_ids=[device.index] if gpu else None, "
            "**collectives.KEEP_BUFFERS\n            )",
            "model = model",
        )
    ],
}


def logged(folder: Path) -> dict:
    """Every scalar of the run in `folder` but its timing."""
    [run_dir] = run_dirs(folder)
    return {tag: series for tag, series in read_scalars(run_dir).items() if not tag.startswith(("perf/", "charts/SPS"))}


@pytest.mark.parametrize("script", list(ZERO_GRAD_AGAIN))
def test_zero_grad_added_to_a_copys_update_keeps_the_ranks_in_sync_and_the_run_unchanged(script, tmp_path):
    original = edited_copy(tmp_path / "original", script)
    edited = edited_copy(tmp_path / "edited", script, ZERO_GRAD_AGAIN[script])
    flags = tiny_flags(script, 2, "--torch-threads", "1", "--check-sync-every", "1", ranks=2)  # compared each time
    for copy in (original, edited):
        states, _ = train_ranks(str(copy), flags, copy.parent)
        assert_same_parameters(states)
    assert logged(edited.parent) == logged(original.parent)


@pytest.mark.parametrize("script", list(NO_SYNC))
def test_an_edit_that_breaks_the_sync_stops_the_run_in_one_line_with_the_default_flags(script, tmp_path):
    copy = edited_copy(tmp_path, script, NO_SYNC[script])
    codes, result = train_ranks(str(copy), tiny_flags(script, 2, ranks=2), tmp_path, worker=exit_code_rank)
    assert codes == [2, 2], result.stderr[-3000:]
    unit = "epoch" if script == VPG else "iteration"
    [line] = result.stderr.splitlines()  # rank 0's, the only one to speak
    assert line.startswith(f"{script}: error: the training state of ranks [1] differs from this rank's at {unit} 1 ")
    assert "so they were not averaged: an edit of the update that skips or changes the gradients' allreduce" in line
    assert "One launch trains one model, its gradients averaged; to sweep a number, start one launch per value" in line
    assert progress_lines(result.stdout) == [1]  # stopped after the first iteration, before a second one


def test_a_logged_scalar_of_the_world_is_one_line(tmp_path):
    """The gradient's norm after the sync (the world's, the same on every rank): one line in update, logged as
    losses/grad_norm beside the others."""
    line = "        losses = dict(zip(names, flat[num_weights:], strict=True))  # the epoch's last minibatch\n"
    edit = (line, line + '        losses["grad_norm"] = flat[:num_weights].norm()\n')
    copy = edited_copy(tmp_path, "ppo_continuous_mpi.py", [edit])
    states, _ = train_ranks(str(copy), tiny_flags("ppo_continuous_mpi.py", 2, ranks=2), tmp_path)
    assert_same_parameters(states)
    norms = logged(tmp_path)["losses/grad_norm"]
    assert len(norms) == 2 and all(0 < norm <= 0.5 + 1e-6 for _, norm in norms)  # clipped to --max-grad-norm
