"""Runs under mpirun: MPI carries the CPU collectives, the result is torchrun's, and failures end the job. (The
update-level equivalence under MPI lives beside the gloo one in each script's tests: run_ranks' `mpi_script`.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.helpers import ROOT, assert_ok, clean_env, mpirun, read_checkpoint, run_command, run_python, train_ranks

PENDULUM = ["--env-id", "InvertedPendulum-v5", "--num-steps", "128", "--seed", "1"]


def test_nprocs_runs_mpirun_with_mpi_collectives_and_trains_gloos_weights(tmp_path):
    """--nprocs 2 re-launches under mpirun (mpi4py and mpirun are installed), whose ranks sum through MPI; two
    iterations give the model of the same run on gloo bit for bit (a sum of two numbers is the same in any order).
    (--nprocs with --collectives torch re-launches under torchrun: test_vpg.py.)"""
    flags = [*PENDULUM, "--total-timesteps", "512", "--save-model"]
    result = run_python(ROOT / "ppo_continuous_mpi.py", [*flags, "--nprocs", "2", "--run-name", "mpi"], tmp_path)
    assert_ok(result)
    _, gloo = train_ranks("ppo_continuous_mpi.py", [*flags, "--run-name", "gloo"], tmp_path)
    models = {}
    for name, output in (("mpi", result.stdout), ("gloo", gloo.stdout)):
        [row] = [line for line in output.splitlines() if line.startswith("collectives")]
        assert ("MPI (Open MPI" in row) == (name == "mpi") and "iteration 2/2" in output, row
        models[name] = read_checkpoint(tmp_path / "runs" / name / "model.safetensors")["tensors"]
    for key, value in models["gloo"].items():
        assert torch.equal(models["mpi"][key], value), key


def test_collectives_mpi_without_an_mpi_launch_is_refused(tmp_path):
    result = run_python(ROOT / "vpg_mpi.py", ["--collectives", "mpi"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--collectives mpi needs ranks started by MPI (mpirun -np N python SCRIPT" in result.stderr
    assert "no MPI launch" in result.stderr


def mpi_rank_pid(rank: int, cwd: Path) -> int | None:
    """The pid of the Python process that this test's mpirun started in `cwd` as `rank` (its environment names it);
    never a rank of another MPI job on the machine, such as a user's training run."""
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            command, folder = (entry / "cmdline").read_bytes(), os.readlink(entry / "cwd")
        except (OSError, ValueError):
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ and b"ppo_continuous_mpi.py" in command:
            if folder == str(cwd):
                return int(entry.name)
    return None


def test_a_killed_rank_ends_the_mpirun_job_and_resume_continues_from_its_checkpoint(tmp_path):
    """SIGKILL one rank mid-run: mpirun ends the job with a non-zero exit within seconds (no hang); the same
    command with --resume continues from the last checkpoint to the end."""
    command = [*mpirun(2), sys.executable, str(ROOT / "ppo_continuous_mpi.py"), *PENDULUM]
    command += ["--total-timesteps", "2048", "--checkpoint-every", "1", "--run-name", "killed"]  # 8 iterations
    log = open(tmp_path / "first.out", "w")
    job = subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "iteration 3/" not in (tmp_path / "first.out").read_text():
        assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "first.out").read_text()[-3000:]
        time.sleep(0.1)
    os.kill(mpi_rank_pid(1, tmp_path), signal.SIGKILL)
    killed = time.monotonic()
    try:
        job.wait(timeout=60)
    finally:
        job.kill()
        log.close()
    assert job.returncode != 0 and time.monotonic() - killed < 30
    assert sorted(os.listdir(tmp_path / "runs" / "killed" / "checkpoints"))  # at least one was written

    resumed = run_command([*command, "--resume"], tmp_path, timeout=300)
    assert_ok(resumed)
    assert "resuming from runs/killed/checkpoints/iter_" in resumed.stdout
    assert "iteration 8/8" in resumed.stdout
