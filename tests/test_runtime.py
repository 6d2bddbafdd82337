"""The runtime block every script shares, where a run needs more than CPU to exercise it or shares a busy machine,
and the project's promises about its own files (requirement bounds, test markers)."""

import ast
import importlib
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import types

import pytest
import torch

import ddrl
from ddrl import env_support
from tests.helpers import (
    ROOT,
    assert_no_settotalmass_warning,
    assert_same_parameters,
    progress_lines,
    refuse,
    run_python,
    tiny_flags,
    train_ranks,
)

SCRIPTS = ("ppo_continuous_mpi.py", "ppo_atari_multigpu.py", "vpg_mpi.py")
VPG = "vpg_mpi.py"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_gpu_run_forms_a_group_that_serves_both_cpu_and_cuda_tensors(ranks, tmp_path):
    """With --cuda and a GPU per rank, NCCL carries the CUDA tensors and gloo the CPU ones (NCCL alone has no CPU
    collectives, so the same-command check or a CPU scalar would fail); ranks that share a GPU use gloo alone and say
    so once. The group is the runtime's, the same in every script: VPG's run shows it."""
    states, result = train_ranks(VPG, tiny_flags(VPG, 2, "--cuda"), tmp_path, nprocs=ranks)
    assert progress_lines(result.stdout) == [1, 2], result.stderr[-3000:]
    assert_same_parameters(states)
    [row] = [line for line in result.stdout.splitlines() if line.startswith("collectives")]
    shared = torch.cuda.device_count() < ranks
    assert ("nccl" in row) != shared, row
    warnings = [line for line in result.stderr.splitlines() if "share" in line and "GPU(s)" in line]
    assert len(warnings) == shared, result.stderr[-3000:]
    if shared:
        assert warnings[0].startswith(f"{VPG}: warning: {ranks} ranks share {torch.cuda.device_count()} GPU(s)")
        assert "so they talk over gloo instead of NCCL (slower); launch one rank per GPU for NCCL" in warnings[0]


def third_party_imports() -> set[str]:
    """The modules the scripts and ddrl import when they load (not the optional ones a function imports where a
    flag asks for it: moviepy, wandb) that are neither the standard library's nor ddrl."""
    found = set()
    for path in [*(ROOT / script for script in SCRIPTS), *(ROOT / "ddrl").glob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"ddrl"}


def requirement_name(text: str) -> str:
    return re.split(r"[\s<>=!~;\[]", text.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_requirements_ask_for_what_the_scripts_import():
    """Every package the scripts and ddrl import is one requirements.txt names, or one a named package itself
    requires (annotated-types, pydantic's own, whose markers the scripts write their rules in); gymnasium 1.1
    introduced AutoresetMode.SAME_STEP, which every script's vector env uses; pydantic enforces the flags' rules."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    named = {requirement_name(line) for line in lines if line and not line.startswith("-")}
    brought = set()
    for name in named:
        try:
            needs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        brought |= {requirement_name(need) for need in needs if "extra ==" not in need}
    distributions = importlib.metadata.packages_distributions()
    for module in sorted(third_party_imports()):
        providers = {requirement_name(name) for name in distributions.get(module, [module])}
        assert providers & (named | brought), f"{module} ({providers}) is imported but not in requirements.txt"
    assert "pydantic" in named and "annotated-types" in brought
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
    train to the end and then die in a traceback). Each script asks for its frame at its own place in main."""
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
    interrupt = signal.getsignal(signal.SIGINT)
    try:
        ddrl.launch(ppo_continuous_mpi.Args(capture_video=True))
    finally:
        signal.signal(signal.SIGINT, interrupt)  # launch's handler is for a script's process, not this one
    assert os.environ.get("MUJOCO_GL") == chosen


@pytest.mark.parametrize("script", ["ppo_continuous_mpi.py", "vpg_mpi.py"])
def test_mujoco_warns_of_everything_but_settotalmass(script, tmp_path, monkeypatch, capfd):
    """gymnasium's HalfCheetah model file makes MuJoCo 4 warn of the deprecated `settotalmass` for every env of every
    rank; the scripts drop that warning alone: an unstable simulation is still reported."""
    import mujoco

    monkeypatch.chdir(tmp_path)  # MuJoCo's own handler would also write MUJOCO_LOG.TXT here
    previous = mujoco.get_mju_user_warning()
    try:
        module = importlib.import_module(script[:-3])
        module.make_env(module.Args(env_id="HalfCheetah-v5"))().close()
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
    vpg = tiny_flags(VPG, 3)
    for folder in ("too_many", "default"):
        (tmp_path / folder).mkdir()
    try:
        too_many = run_python(ROOT / VPG, [*vpg, "--torch-threads", str(len(cores))], tmp_path / "too_many")
        default = run_python(ROOT / VPG, vpg, tmp_path / "default")
    finally:
        busy.kill()
        busy.wait()
    for result in (too_many, default):
        assert result.returncode == 0 and progress_lines(result.stdout) == [1, 2, 3], result.stderr
    warnings = [line for line in too_many.stderr.splitlines() if "oversubscribe" in line]
    assert len(warnings) == 1, too_many.stderr
    threads = len(cores)
    assert warnings[0].startswith(f"{VPG}: warning: {threads} torch threads per rank oversubscribe the {threads} ")
    assert warnings[0].endswith("every op waits for threads not running; pass --torch-threads 1")
    assert "oversubscribe" not in default.stderr
