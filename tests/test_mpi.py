"""Runs under mpirun: MPI carries the CPU collectives, the result is torchrun's, and failures end the job. (The
update-level equivalence under MPI lives beside the gloo one in each script's tests: run_ranks' `mpi_script`.)"""

import subprocess
import sys

import torch

from tests.helpers import (
    RANK_ENTRY,
    ROOT,
    WAIT,
    assert_ok,
    clean_env,
    edited_copy,
    mpirun,
    progress_lines,
    read_checkpoint,
    run_command,
    run_python,
    tiny_flags,
    train_ranks,
    world_batch,
)

CONTINUOUS = "ppo_continuous_mpi.py"


def test_nprocs_runs_mpirun_with_mpi_collectives_and_trains_gloos_weights(tmp_path):
    """--nprocs 2 re-launches under mpirun (mpi4py and mpirun are installed), whose ranks sum through MPI; two
    iterations give the model of the same run on gloo bit for bit (a sum of two numbers is the same in any order).
    (--nprocs with --collectives torch re-launches under torchrun: test_vpg.py.)"""
    flags = tiny_flags(CONTINUOUS, 2, "--save-model", ranks=2)
    result = run_python(ROOT / CONTINUOUS, [*flags, "--nprocs", "2", "--run-name", "mpi"], tmp_path)
    assert_ok(result)
    _, gloo = train_ranks(CONTINUOUS, [*flags, "--run-name", "gloo"], tmp_path)
    models = {}
    for name, output in (("mpi", result.stdout), ("gloo", gloo.stdout)):
        [row] = [line for line in output.splitlines() if line.startswith("collectives")]
        assert ("MPI (Open MPI" in row) == (name == "mpi") and progress_lines(output) == [1, 2], row
        models[name] = read_checkpoint(tmp_path / "runs" / name / "model.safetensors")["tensors"]
    for key, value in models["gloo"].items():
        assert torch.equal(models["mpi"][key], value), key


def test_collectives_mpi_without_an_mpi_launch_is_refused(tmp_path):
    result = run_python(ROOT / "vpg_mpi.py", ["--collectives", "mpi"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--collectives mpi needs ranks started by MPI (mpirun -np N python SCRIPT" in result.stderr
    assert "no MPI launch" in result.stderr


def test_a_killed_rank_ends_the_mpirun_job_and_one_rank_resumes_its_checkpoint(tmp_path):
    """Rank 1 dies by SIGKILL once checkpoint 2 is written: mpirun ends the job with a non-zero exit (no hang, which
    only --dist-timeout's 1800 s would end); mpirun -np 1 with --resume continues the two ranks' checkpoint at one
    rank, to the run's end."""
    iterations = 4  # at two ranks
    run_flags = tiny_flags(CONTINUOUS, iterations, "--checkpoint-every", "1", "--run-name", "killed", ranks=2)
    entry = [sys.executable, str(RANK_ENTRY), CONTINUOUS, *run_flags]
    job = subprocess.run(
        [*mpirun(2), "-x", "DDRL_TEST_KILL=1:2", *entry],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        timeout=WAIT,
    )
    assert job.returncode != 0, job.stdout[-3000:]
    assert sorted(path.name for path in (tmp_path / "runs/killed/checkpoints").iterdir()) == [
        "iter_000001.safetensors",
        "iter_000002.safetensors",
    ]

    resumed = run_command([*mpirun(1), sys.executable, str(ROOT / CONTINUOUS), *run_flags, "--resume"], tmp_path)
    assert_ok(resumed)
    said = "resuming from runs/killed/checkpoints/iter_000002.safetensors, written by 2 ranks and continued by 1: "
    assert said in resumed.stdout, resumed.stdout
    one_rank = (iterations - 2) * world_batch(CONTINUOUS, ranks=2) // world_batch(CONTINUOUS)  # iterations left
    assert progress_lines(resumed.stdout) == list(range(3, 3 + one_rank))
    total = iterations * world_batch(CONTINUOUS, ranks=2)
    assert resumed.stdout.splitlines()[-1].startswith(f"done: {total} env steps")


def test_an_exception_one_rank_raises_ends_the_mpirun_job_with_its_traceback(tmp_path):
    """A bug on rank 0 alone (an edit that raises after iteration 2's line) ends the job at once (MPI_Abort), where
    rank 0 waited in MPI_Finalize for rank 1, which waited in a collective for rank 0, until killed."""
    logged = "            run.log(iteration, global_step, totals, scalars)\n"
    bug = "            if run.rank == 0 and iteration == 2:\n                raise ValueError('a bug on rank 0')\n"
    copy = edited_copy(tmp_path, CONTINUOUS, [(logged, logged + bug)])
    job = run_command([*mpirun(2), sys.executable, str(copy), *tiny_flags(CONTINUOUS, 4, ranks=2)], tmp_path)
    assert job.returncode != 0, job.stdout[-3000:]
    assert "ValueError: a bug on rank 0" in job.stderr, job.stderr[-3000:]
    assert progress_lines(job.stdout) == [1, 2]
