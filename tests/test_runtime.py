"""The runtime block every script shares, where a run needs more than CPU to exercise it or shares a busy machine,
and the project's promises about its own files (requirement bounds, test markers)."""

import importlib
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from ddrl import env_support, launching
from tests.helpers import ROOT, assert_no_settotalmass_warning, refuse, run_python

SCRIPTS = ("ppo_continuous_mpi.py", "ppo_atari_multigpu.py", "vpg_mpi.py")


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(("gpus", "backend"), [(2, "cpu:gloo,cuda:nccl"), (1, "gloo")])
def test_a_gpu_run_forms_a_group_that_serves_both_cpu_and_cuda_tensors(script, gpus, backend, monkeypatch, capsys):
    """With --cuda and a GPU per rank, NCCL carries the CUDA tensors and gloo the CPU ones (NCCL alone has no CPU
    collectives, so the same-command check or a CPU scalar would fail); ranks sharing a GPU use gloo alone."""
    module = importlib.import_module(script[:-3])
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "rendezvous", lambda *args, **kwargs: iter([(dist.HashStore(), 0, 2)]))
    formed = []

    def init_process_group(backend: str, **kwargs) -> None:
        formed.append(backend)
        raise RuntimeError("no network in this test")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    run = launching.launch(module.Args(cuda=True), module.__file__, "iteration", module.args_problem)
    with pytest.raises(SystemExit):
        launching.join_process_group(run)
    assert formed == [backend]
    assert run.device == torch.device("cuda", 0)
    assert f"with {backend}:" in capsys.readouterr().err


def test_requirements_ask_for_what_the_scripts_call():
    """gymnasium 1.1 introduced AutoresetMode.SAME_STEP, which every script's vector env uses."""
    bounds = dict(re.findall(r"^([\w\-]+)(?:\[\w+\])?>=([\d.]+)", (ROOT / "requirements.txt").read_text(), re.M))
    assert all("AutoresetMode.SAME_STEP" in (ROOT / script).read_text() for script in SCRIPTS)
    assert tuple(int(part) for part in bounds["gymnasium"].split(".")) >= (1, 1)


def test_every_declared_pytest_marker_is_used():
    declared = re.search(r"^markers = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    tests = "".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py"))
    for name in re.findall(r'"(\w+):', declared[1]) if declared else []:
        assert f"pytest.mark.{name}" in tests, f"marker {name!r} is declared in pyproject.toml but used nowhere"


@pytest.mark.parametrize(
    ("script", "env_id"),
    [("ppo_continuous_mpi.py", "InvertedPendulum-v5"), ("vpg_mpi.py", "CartPole-v1"), ("ppo_atari_multigpu.py", "")],
)
def test_capture_video_that_cannot_render_stops_before_training(script, env_id, monkeypatch, capsys, tmp_path):
    """A machine without a working renderer: one line naming the fix, before any env steps (the scripts used to
    train to the end and then die in a traceback)."""
    module = importlib.import_module(script[:-3])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MUJOCO_GL", "egl")
    monkeypatch.setitem(sys.modules, "moviepy", types.ModuleType("moviepy"))  # present, as on a user's machine

    def no_opengl(env_id: str) -> None:
        raise RuntimeError("an OpenGL platform library has not been loaded into this process")

    monkeypatch.setattr(env_support, "render_one_frame", no_opengl)
    flags = ["--capture-video", *(["--env-id", env_id] if env_id else [])]
    message = refuse(module, flags, monkeypatch, capsys)
    assert "--capture-video cannot render a frame (an OpenGL platform library has not been loaded" in message
    assert "MUJOCO_GL=egl (apt-get install libegl1) or MUJOCO_GL=osmesa" in message
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("display", "chosen"), [("", "egl"), (":0", None)])
def test_capture_video_on_a_headless_machine_renders_with_egl(display, chosen, monkeypatch):
    import ppo_continuous_mpi

    monkeypatch.setenv("MUJOCO_GL", "unset below")  # so that monkeypatch restores the variable afterwards
    monkeypatch.delenv("MUJOCO_GL")
    monkeypatch.setenv("DISPLAY", display)
    args = ppo_continuous_mpi.Args(capture_video=True)
    launching.launch(args, ppo_continuous_mpi.__file__, "iteration", ppo_continuous_mpi.args_problem)
    assert os.environ.get("MUJOCO_GL") == chosen


@pytest.mark.parametrize("script", ["ppo_continuous_mpi.py", "vpg_mpi.py"])
def test_mujoco_warns_of_everything_but_settotalmass(script, tmp_path, monkeypatch, capfd):
    """gymnasium's HalfCheetah model file makes MuJoCo 4 warn of the deprecated `settotalmass` for every env of every
    rank; the scripts drop that warning alone: an unstable simulation is still reported."""
    import mujoco

    monkeypatch.chdir(tmp_path)  # MuJoCo's own handler would also write MUJOCO_LOG.TXT here
    previous = mujoco.get_mju_user_warning()
    try:
        make_env = importlib.import_module(script[:-3]).make_env
        (make_env("HalfCheetah-v5", 1000) if script == "vpg_mpi.py" else make_env("HalfCheetah-v5"))().close()
        model = mujoco.MjModel.from_xml_string(
            "<mujoco><worldbody><body><freejoint/><geom size='0.1'/></body></worldbody></mujoco>"
        )
        data = mujoco.MjData(model)
        data.qvel[0] = float("nan")
        mujoco.mj_step(model, data)
    finally:
        mujoco.set_mju_user_warning(previous)
    output = capfd.readouterr()
    assert_no_settotalmass_warning(output.out + output.err, tmp_path)
    assert "WARNING: Nan, Inf or huge value in QVEL at DOF 0" in output.err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
@pytest.mark.alone
def test_a_run_with_more_threads_than_idle_cores_says_so_once_and_the_default_does_not(tmp_path):
    """The oversubscription warning: with another process busy on one usable core, a thread on every core leaves the
    others waiting at every op; such a run says so in one line naming the fix, once however many epochs it trains.
    The default counts only the idle cores, so a default run beside the same busy process has nothing to say."""
    cores = os.sched_getaffinity(0)
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{max(cores)}}})\nwhile 1: pass"]
    )
    vpg = ["--env-id", "CartPole-v1", "--steps-per-epoch", "200", "--total-timesteps", "600", "--train-v-iters", "2"]
    for folder in ("too_many", "default"):
        (tmp_path / folder).mkdir()
    try:
        too_many = run_python(ROOT / "vpg_mpi.py", [*vpg, "--torch-threads", str(len(cores))], tmp_path / "too_many")
        default = run_python(ROOT / "vpg_mpi.py", vpg, tmp_path / "default")
    finally:
        busy.kill()
        busy.wait()
    for result in (too_many, default):
        assert result.returncode == 0 and "epoch 3/3 step 600" in result.stdout, result.stderr
    warnings = [line for line in too_many.stderr.splitlines() if "oversubscribe" in line]
    assert len(warnings) == 1, too_many.stderr
    threads = len(cores)
    assert warnings[0].startswith(f"vpg_mpi.py: warning: {threads} torch threads per rank oversubscribe the {threads} ")
    assert warnings[0].endswith("every op waits for threads not running; pass --torch-threads 1")
    assert "oversubscribe" not in default.stderr
