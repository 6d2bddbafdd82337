"""What every test module shares: launching a script's ranks for real and reading back what they wrote."""

import gc
import importlib
import importlib.util
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tyro
from safetensors import safe_open
from safetensors.torch import save_file

from benchmark import faults

ROOT = Path(__file__).resolve().parent.parent
RANK_ENTRY = Path(__file__).resolve().parent / "rank_entry.py"
MPI_RANK_ENTRY = Path(__file__).resolve().parent / "mpi_rank.py"
WAIT = 300
"""seconds a test waits for what a run will do (its first iteration, a checkpoint, a process holding), on a slow machine
with its cores busy: only a broken run takes that long"""


def mpirun(nprocs: int) -> list[str]:
    """Open MPI's mpirun for `nprocs` local ranks (as root too), with a free MASTER_PORT for the scripts' store."""
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nprocs), "-x", f"MASTER_PORT={free_port()}"]


def free_port() -> int:
    """A TCP port that nothing listens on right now (for MASTER_PORT / --master-port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any launcher variables, plus `extra`."""
    launcher_prefixes = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_",
        "MASTER_",
        "OMPI_",
        "PMI_",
        "MPI_LOCAL",
        "SLURM_",
        "TORCHELASTIC",
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(launcher_prefixes)}
    # the repository first, the caller's PYTHONPATH kept (packages installed with `pip --target` live there)
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update({"PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1", **extra})
    return env


def run_command(command: list[str], cwd: Path, timeout: float = WAIT, **env: str) -> subprocess.CompletedProcess:
    """Run `command` in `cwd`; a hang becomes a test failure after `timeout` seconds."""
    return subprocess.run(command, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)


def edited_copy(directory: Path, script: str, edits: list[tuple[str, str]] = (), name: str = "") -> Path:
    """`script` copied into `directory` (as `name`, by default its own) with every (old, new) edit applied; each `old`
    must occur exactly once, so an edit that no longer applies fails here instead of testing the unmodified script."""
    directory.mkdir(parents=True, exist_ok=True)
    source = (ROOT / script).read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"{script}: expected {old!r} once"
        source = source.replace(old, new)
    (directory / (name or script)).write_text(source)
    return directory / (name or script)


def verify(copy: Path, *flags: str) -> subprocess.CompletedProcess:
    """`python -m ddrl.verify COPY` from the copy's folder, as a user runs it after README's install."""
    return run_command([sys.executable, "-m", "ddrl.verify", *flags, copy.name], copy.parent)


def verified(copy: Path) -> str:
    """What `python -m ddrl.verify COPY` says of a copy it passes (exit 0, else the test fails with its stderr)."""
    result = verify(copy)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _inherit(environment: dict[str, str], cwd: str, output_stem: str | None) -> None:
    """What a process forked from the fork server takes from the test that started it (a spawned child would inherit
    these): its environment and folder, and with `output_stem` stdout and stderr to OUTPUT_STEM.out and .err."""
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    for fd, suffix in ((1, "out"), (2, "err")) if output_stem else ():
        os.dup2(os.open(f"{output_stem}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)


def _python_main(script: str, args: list[str], cwd: str, parent_env: dict[str, str], name: str = "python") -> None:
    """`python script args` in a process forked from run_ranks' server: its stdout and stderr to cwd/NAME.out and
    cwd/NAME.err, its exit code as python's (2 for the scripts' refusals, 1 for an uncaught exception)."""
    _inherit(parent_env, cwd, os.path.join(cwd, name))
    if "DDRL_HOLD_AFTER" in os.environ:  # hold_after's, as a new interpreter imports it
        runpy.run_path(str(faults.HOLD_AT_LINE / "sitecustomize.py"))
    code = 0
    try:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:  # as the interpreter handles it: a code that is no integer is a message, exit 1
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    gc.collect()
    os._exit(code)


def run_python(script: Path, args: list[str], cwd: Path, timeout: float = WAIT) -> subprocess.CompletedProcess:
    """What run_command([python, script, *args], cwd) returns, in a fraction of the time: the script runs in a process
    forked from run_ranks' server, which imported torch once. For a script's own code (its checks, its training); a
    test of how a process starts or exits launches a real one."""
    return finish_python(start_python(script, args, cwd), timeout)


def start_python(script: Path, args: list[str], cwd: Path, name: str = "python", **env: str):
    """run_python's process, started and left running (a test signals it, or starts another beside it), with `env`
    added to its environment: its stdout and stderr go to cwd/NAME.out and cwd/NAME.err, which `output` reads."""
    process = mp.get_context("forkserver").Process(
        target=_python_main, args=(str(script), list(args), str(cwd), clean_env(**env), name)
    )
    process.start()
    process.args = [sys.executable, str(script), *args]
    process.output_files = (cwd / f"{name}.out", cwd / f"{name}.err")
    return process


def finish_python(process, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a start_python process (killed after `timeout` s, failing the test) and return what it wrote."""
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise AssertionError(f"{process.args} still ran after {timeout} s")
    return subprocess.CompletedProcess(process.args, process.exitcode, *output(process))


def torchrun(
    script: str,
    args: list[str],
    cwd: Path,
    nprocs: int = 2,
    save_ranks: bool = False,
    timeout: float = WAIT,
    **env: str,
):
    """Launch `script` (a file in the repo root) with `nprocs` ranks under `torch.distributed.run --standalone`,
    with `env` added to the environment.

    With `save_ranks`, each rank runs the script's `main` through rank_entry.py and saves its trained
    agent's parameters to `cwd/rank{RANK}.pt`, so a test can compare the ranks' weights.
    """
    if save_ranks:
        script, args = str(RANK_ENTRY.relative_to(ROOT)), [script, *args]
    return run_command(torchrun_with(["--standalone"], script, args, nprocs), cwd, timeout, **env)


def read_checkpoint(path: Path) -> dict:
    """A checkpoint or model file as the scripts write it: its JSON header, with its tensors by name under "tensors"."""
    with safe_open(str(path), framework="pt") as opened:
        header = json.loads(opened.metadata()["ddrl"])
        return {**header, "tensors": {name: opened.get_tensor(name) for name in opened.keys()}}


def write_checkpoint(checkpoint: dict, path: Path) -> Path:
    """`checkpoint` (read_checkpoint's form, changed as a test likes) written at `path` as a safetensors file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {key: value for key, value in checkpoint.items() if key != "tensors"}
    save_file(checkpoint["tensors"], str(path), metadata={"ddrl": json.dumps(header)})
    return path


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a run folder's TensorBoard event files, as (step, value) pairs in logged order, as
    TensorBoard shows them (what a resumed run purged is gone)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def compiled_files() -> set[Path]:
    """The files in the suite's torch.compile cache (conftest.py): a `--compile` run that adds none compiled nothing,
    where the flag doing nothing would pass every other check."""
    return {path for path in Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*") if path.is_file()}


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    )


def evaluate_one_episode(script: str, model_path: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`python script --eval-checkpoint model_path --eval-episodes 1` in `cwd`, checked to end with its `eval:` line."""
    result = run_python(ROOT / script, ["--eval-checkpoint", str(model_path), "--eval-episodes", "1"], cwd)
    assert_ok(result)
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("eval: episodes=1 return_mean="), last_line
    return result


def assert_no_settotalmass_warning(output: str, cwd: Path) -> None:
    """gymnasium's HalfCheetah model makes MuJoCo 4 warn of its deprecated `settotalmass` for every model it compiles,
    on the console and in MUJOCO_LOG.TXT in the working folder; the MLP scripts drop that warning wherever they make
    an env."""
    assert "settotalmass" not in output, output[-3000:]
    assert not (cwd / "MUJOCO_LOG.TXT").exists()


def run_dirs(cwd: Path) -> list[Path]:
    """The run folders a launch in `cwd` wrote under runs/."""
    return sorted(path for path in (cwd / "runs").iterdir() if path.is_dir())


def rank_parameters(cwd: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    """The state dicts that rank_entry.py saved for ranks 0..world_size-1."""
    return [torch.load(cwd / f"rank{rank}.pt") for rank in range(world_size)]


def assert_same_parameters(states: list[dict[str, torch.Tensor]], atol: float = 0.0) -> None:
    for rank, state in enumerate(states[1:], start=1):
        assert state.keys() == states[0].keys()
        for key in state:
            assert torch.allclose(state[key], states[0][key], rtol=0, atol=atol), f"rank {rank} differs in {key}"


# run_ranks forks its ranks from a server that imported these once: a rank then starts in a fraction of a second,
# where a spawned one spends seconds importing torch; torch._dynamo (a second, which torch.optim imports on first use)
# and gymnasium's env modules are imported lazily by every run, so the server imports them too
RANK_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ale_py", "mujoco", "tyro", "torch.utils.tensorboard"]
RANK_PRELOAD += ["gymnasium", "gymnasium.envs.classic_control", "gymnasium.envs.mujoco.mujoco_env"]
mp.set_forkserver_preload([*RANK_PRELOAD, "vpg_mpi", "ppo_continuous_mpi", "ppo_atari_multigpu", "tests.helpers"])


def _rank_main(
    rank: int, worker, world_size: int, port: int, out_dir: str, worker_args: tuple, join_group: bool, parent: tuple
) -> None:
    """One rank: join a gloo group as the scripts would under torchrun, run `worker`, save its result."""
    environment, cwd, output = parent
    _inherit(environment, cwd, os.path.join(out_dir, f"rank{rank}") if output else None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if join_group:  # otherwise the worker forms (and destroys) the group itself, e.g. by calling a script's main
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.save(worker(rank, world_size, *worker_args), os.path.join(out_dir, f"result{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # as the scripts do: gloo threads left to interpreter shutdown can abort the process (SIGABRT)
    sys.stdout.flush()
    sys.stderr.flush()


def train_rank(rank: int, world_size: int, script: str, cwd: str, flags: list[str]) -> dict[str, torch.Tensor]:
    """One rank of a launch by run_ranks(..., join_group=False): the script's whole `main` on `flags` in `cwd`, as
    torchrun would run it (`script`: a file of the repository, or the path of a copy); returns the trained agent's
    state dict."""
    os.chdir(cwd)
    if Path(script).is_absolute():  # a copy, imported from its file under a name of its own
        spec = importlib.util.spec_from_file_location(f"copy_{rank}_{Path(script).stem}", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # as an import registers it: ddrl.launch finds the script by its Args' module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(Path(script).stem)
    return module.main(tyro.cli(module.Args, args=flags)).state_dict()


def train_ranks(
    script: str,
    flags: list[str],
    cwd: Path,
    nprocs: int = 2,
    timeout: float = WAIT,
    signal_rank: tuple[int, int, Callable[[], object]] | None = None,
    worker: Callable = train_rank,
    **env: str,
):
    """`script`'s main on `nprocs` ranks forked by run_ranks, with `env` added to the environment: every rank's
    trained state dict, and the run's output (rank 0's stdout; every rank's stderr). With `signal_rank` = (rank,
    signal, condition), that rank gets that signal once `condition()` holds. A `worker` with train_rank's
    signature may run main its own way and return more than the state dict."""
    ranks = fork_ranks(worker, nprocs, cwd, script, str(cwd), flags, join_group=False, output=True, env=env)
    if signal_rank is not None:
        rank, sig, condition = signal_rank
        deadline = time.monotonic() + timeout
        while not condition():
            assert all(p.is_alive() for p in ranks.processes) and time.monotonic() < deadline, "never signalled"
            time.sleep(0.05)
        os.kill(ranks.processes[rank].pid, sig)
    states = join_ranks(ranks, cwd, timeout, script)
    stderr = "".join((cwd / f"rank{rank}.err").read_text() for rank in range(nprocs))
    return states, subprocess.CompletedProcess(flags, 0, (cwd / "rank0.out").read_text(), stderr)


def run_ranks(
    worker,
    world_size: int,
    out_dir: Path,
    *worker_args,
    timeout: float = WAIT,
    join_group: bool = True,
    mpi_script: str | None = None,
    output: bool = False,
    env: dict[str, str] | None = None,
) -> list:
    """Run `worker(rank, world_size, *worker_args)` on `world_size` new processes joined in a gloo group.

    `worker` must be a module-level function (it is pickled by name); each rank's return value is
    saved with torch.save and the list of them, in rank order, is returned. A hang fails after `timeout`.
    With `join_group=False` the ranks only get the launcher variables (RANK, MASTER_PORT...) that torchrun
    would set, so the worker can run a script's whole `main`, which forms its own group.
    With `output`, each rank's stdout and stderr go to out_dir/rank{RANK}.out and .err; `env` is added to the ranks'
    environment.
    With `mpi_script` (a script's module name), mpirun starts the ranks instead and that script's CPU collectives go
    through MPI as `--collectives mpi` sets them up (mpi_rank.py); any that reaches torch.distributed fails the test.
    """
    if mpi_script is not None:
        job = out_dir / "mpi_job.pt"
        torch.save({"worker": (worker.__module__, worker.__name__), "args": worker_args, "script": mpi_script}, job)
        command = [*mpirun(world_size), sys.executable, str(MPI_RANK_ENTRY), str(job), str(out_dir)]
        assert_ok(run_command(command, out_dir, timeout))
        return [torch.load(out_dir / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]
    ranks = fork_ranks(worker, world_size, out_dir, *worker_args, join_group=join_group, output=output, env=env)
    return join_ranks(ranks, out_dir, timeout, worker.__name__)


def fork_ranks(worker, world_size: int, out_dir: Path, *worker_args, join_group: bool, output: bool, env: dict | None):
    """run_ranks' ranks, started: torch's ProcessContext, its `processes` in rank order."""
    parent = ({**os.environ, **(env or {})}, os.getcwd(), output)
    return mp.start_processes(
        _rank_main,
        args=(worker, world_size, free_port(), str(out_dir), worker_args, join_group, parent),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )


def join_ranks(ranks, out_dir: Path, timeout: float, what: str) -> list:
    """The results of fork_ranks' ranks, in rank order, once all have finished; a hang fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            raise TimeoutError(f"{len(ranks.processes)} ranks of {what} did not finish within {timeout} s")
    return [torch.load(out_dir / f"result{rank}.pt", weights_only=False) for rank in range(len(ranks.processes))]


# --- processes killed or signalled mid-run (reliability tests) --------------------------------------


def torchrun_with(launcher_flags: list[str], script: str, args: list[str], nprocs: int = 2) -> list[str]:
    """The command that launches `script` (a path relative to the repo root) under torch.distributed.run with
    `launcher_flags` (e.g. `--standalone --max-restarts 1`); every torchrun launch in the tests is built here."""
    run = [sys.executable, "-m", "torch.distributed.run", *launcher_flags, f"--nproc_per_node={nprocs}"]
    return [*run, str(ROOT / script), *args]


def start(command: list[str], cwd: Path, name: str = "launch", **env: str) -> subprocess.Popen:
    """Start `command` in `cwd`, its stdout and stderr going to `cwd/{name}.out` and `cwd/{name}.err`."""
    stdout, stderr = open(cwd / f"{name}.out", "w"), open(cwd / f"{name}.err", "w")
    process = subprocess.Popen(command, cwd=cwd, env=clean_env(**env), stdout=stdout, stderr=stderr, text=True)
    process.output_files = (cwd / f"{name}.out", cwd / f"{name}.err")
    stdout.close()
    stderr.close()
    return process


def output(process: subprocess.Popen) -> tuple[str, str]:
    """What a `start`ed (or start_python) process has written so far to stdout and stderr (nothing yet where a file
    is not made yet, or is a named pipe that the test reads itself)."""
    return tuple(path.read_text() if path.is_file() else "" for path in process.output_files)


def wait_for(condition, timeout: float, what: str, processes: tuple[subprocess.Popen, ...] = ()) -> None:
    """Poll `condition()` every 50 ms; fail the test after `timeout` s, or when a process (started by `start` or
    `start_python`) ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p for p in processes if (p.poll() if isinstance(p, subprocess.Popen) else p.exitcode) is not None]
        if ended or time.monotonic() > deadline:
            for process in processes:
                process.kill()
            logs = "\n".join(f"--- {p.args[-1]}\n{output(p)[0][-2000:]}\n{output(p)[1][-3000:]}" for p in processes)
            raise AssertionError(f"never saw {what} ({'a process ended' if ended else 'timeout'})\n{logs}")
        time.sleep(0.05)


def finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a `start`ed process (killed after `timeout` s, failing the test) and return what it wrote."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"{process.args} still ran after {timeout} s\n{output(process)[1][-3000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, *output(process))


def hold_after(pattern: str) -> dict[str, str]:
    """The environment (for `start` and `start_python`) in which a script's process stops itself (SIGSTOP) right after
    it prints a line that matches `pattern` (benchmark/hold_at_line): `signal_held` signals it at that very point."""
    return {"DDRL_HOLD_AFTER": pattern, "PYTHONPATH": f"{faults.HOLD_AT_LINE}{os.pathsep}{clean_env()['PYTHONPATH']}"}


def signal_held(pid: int, signals: list[int], what: str, processes: tuple = ()) -> None:
    """Once process `pid` holds itself after `what` (hold_after), send it `signals`, then let it go on (SIGCONT)."""
    wait_for(lambda: faults.state(pid) == "T", WAIT, f"process {pid} holding after {what}", processes)
    for sig in signals:
        os.kill(pid, sig)
    os.kill(pid, signal.SIGCONT)


def progress_lines(stdout: str) -> list[int]:
    """The iteration (epoch) numbers of the progress lines `{epoch|iteration} N/M step ...` in a script's stdout."""
    return [
        int(line.split()[1].split("/")[0]) for line in stdout.splitlines() if line.startswith(("epoch ", "iteration "))
    ]


# the TensorBoard keys docs/design.md ("What a user sees") fixes for the PPO scripts
# (vpg_mpi.py has no clipfrac or old_approx_kl)
LOG_KEYS = (
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/SPS",
    "charts/learning_rate",
    "losses/value_loss",
    "losses/policy_loss",
    "losses/entropy",
    "losses/old_approx_kl",
    "losses/approx_kl",
    "losses/clipfrac",
    "losses/explained_variance",
    "perf/rollout_time",
    "perf/update_time",
    "perf/sync_time",
)


def refuse(module, flags: list[str], monkeypatch, capsys, **env: str | None) -> str:
    """Run a script's `main` in-process on `flags` (launcher variables `env`, a world of one by default) and assert
    it stops as bad input must: exit 2, one stderr line `SCRIPT.py: error: ...`, no process group left behind.
    Returns that line."""
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # main sets them; undone after
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", **env}.items():  # None: unset
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        module.main(tyro.cli(module.Args, args=flags))
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"{Path(module.__file__).name}: error: ") and stderr.count("\n") == 1, stderr
    assert not dist.is_initialized()
    return stderr


# --- tiny runs, and ranks that stop on purpose (runtime tests) ---------------------------------------------

TINY_RUNS = {  # each script's smallest run: (flags, env steps of one iteration: the world's in VPG, a rank's in PPO)
    "vpg_mpi.py": (["--env-id", "CartPole-v1", "--steps-per-epoch", "200", "--train-v-iters", "2"], 200),
    "ppo_continuous_mpi.py": (
        ["--env-id", "InvertedPendulum-v5", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "1"]
        + ["--no-compile"],
        64,
    ),
    "ppo_atari_multigpu.py": (
        ["--env-id", "BreakoutNoFrameskip-v4", "--local-num-envs", "2", "--num-steps", "32"]
        + ["--num-minibatches", "2", "--update-epochs", "1"],
        64,
    ),
}


def world_batch(script: str, ranks: int = 1) -> int:
    """The world's env steps of one iteration of `script`'s tiny run at `ranks` ranks."""
    return TINY_RUNS[script][1] * (1 if script == "vpg_mpi.py" else ranks)


def tiny_flags(script: str, iterations: int, *extra: str, ranks: int = 1) -> list[str]:
    """The flags of `script`'s tiny run, with the env steps of `iterations` iterations at `ranks` ranks, and `extra`."""
    return [*TINY_RUNS[script][0], "--total-timesteps", str(iterations * world_batch(script, ranks)), *extra]


def train_rank_signalled(rank: int, world_size: int, script: str, cwd: str, flags: list[str]) -> dict:
    """train_rank, where the rank that DDRL_TEST_SIGTERM names ("RANK:ITERATION") sends itself a real SIGTERM once it
    has logged that iteration: a scheduler's notice at a moment a test can count on."""
    import ddrl.run

    target, iteration = (int(part) for part in os.environ["DDRL_TEST_SIGTERM"].split(":"))
    log = ddrl.run.Run.log

    def log_then_signal(run, logged: int, *arguments) -> None:
        log(run, logged, *arguments)
        if logged == iteration:
            os.kill(os.getpid(), signal.SIGTERM)

    if rank == target:
        ddrl.run.Run.log = log_then_signal
    return train_rank(rank, world_size, script, cwd, flags)


def exit_code_rank(rank: int, world_size: int, script: str, cwd: str, flags: list[str]) -> int | None:
    """train_rank for a run that may stop: its exit code (None if main returned)."""
    try:
        train_rank(rank, world_size, script, cwd, flags)
    except SystemExit as stop:
        return stop.code
    return None


def cleanrl_ppo_loss(
    newlogprob: torch.Tensor, entropy: torch.Tensor, newvalue: torch.Tensor, mb: dict[str, torch.Tensor], args
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """CleanRL's PPO loss written out from its formulas, independently of the scripts, given the new policy's
    log-probabilities and entropies and the new values: advantages normalised over the minibatch, clipped surrogate
    and (with `args.clip_vloss`) clipped value loss, entropy bonus. Returns the loss and the six logged statistics."""
    logratio = newlogprob - mb["log_probs"]
    ratio = logratio.exp()
    old_approx_kl, approx_kl = (-logratio).mean(), ((ratio - 1) - logratio).mean()
    clipfrac = ((ratio - 1.0).abs() > args.clip_coef).double().mean()
    advantages = (mb["advantages"] - mb["advantages"].mean()) / (mb["advantages"].std() + 1e-8)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
    if args.clip_vloss:
        v_loss_unclipped = (newvalue - mb["returns"]) ** 2
        v_clipped = mb["values"] + torch.clamp(newvalue - mb["values"], -args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max(v_loss_unclipped, (v_clipped - mb["returns"]) ** 2).mean()
    else:
        v_loss = 0.5 * ((newvalue - mb["returns"]) ** 2).mean()
    loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
    return loss, [pg_loss, v_loss, entropy.mean(), old_approx_kl, approx_kl, clipfrac]


def assert_same_loss_and_gradients(
    agent: torch.nn.Module, loss: torch.Tensor, stats: dict, expected_loss: torch.Tensor, expected_stats: list
) -> None:
    """A script's minibatch loss, its six logged statistics (by name, in cleanrl_ppo_loss's order) and its gradients
    on `agent` equal those of the written-out reference (cleanrl_ppo_loss), float64 to rounding."""
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-10)
    names = ["policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac"]
    assert list(stats) == names
    torch.testing.assert_close(
        torch.stack(list(stats.values())), torch.stack(expected_stats).detach(), rtol=0, atol=1e-10
    )
    gradients = torch.autograd.grad(loss, list(agent.parameters()))
    expected_gradients = torch.autograd.grad(expected_loss, list(agent.parameters()))
    for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(gradient, expected_gradient, rtol=0, atol=1e-10)


# --- the one-rank reference of a distributed update -----------------------------------------------------


def union_orders(orders: list[torch.Tensor], minibatch_sizes: torch.Tensor) -> torch.Tensor:
    """The one-rank reference's minibatch orders over the union of the ranks' batches (rank 0's samples first):
    given each rank's orders [epochs, its samples] and the scripts' minibatch_sizes [ranks, minibatches], its
    minibatch k is rank 0's k-th piece, then rank 1's, and so on, as the world's minibatch k is."""
    offsets = [sum(len(rank_orders[0]) for rank_orders in orders[:rank]) for rank in range(len(orders))]
    epochs = []
    for epoch in range(len(orders[0])):
        rank_pieces = [
            (rank_orders[epoch] + offset).split(rank_sizes.tolist())
            for rank_orders, offset, rank_sizes in zip(orders, offsets, minibatch_sizes, strict=True)
        ]
        epochs.append(torch.cat([piece[k] for k in range(minibatch_sizes.shape[1]) for piece in rank_pieces]))
    return torch.stack(epochs)


# --- algorithm tests ---


def vector_env_spaces(obs_dim: int, action_space):
    """What an Agent reads of the vector env it is built from: flat Box observations of `obs_dim` numbers and
    `action_space` for each env (no env is made)."""
    from types import SimpleNamespace

    import gymnasium as gym
    import numpy as np

    observation_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
    return SimpleNamespace(single_observation_space=observation_space, single_action_space=action_space)


def cleanrl_minibatch_step(agent: torch.nn.Module, mb: dict[str, torch.Tensor], args) -> tuple[torch.Tensor, list]:
    """CleanRL's PPO minibatch step, its loss written out independently of the scripts: the Agent's log-probabilities,
    entropies and values ([N, 1], viewed as [N]) for the minibatch's observations and actions, then cleanrl_ppo_loss."""
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(mb["obs"], mb["actions"])
    return cleanrl_ppo_loss(newlogprob, entropy, newvalue.view(-1), mb, args)


def assert_minibatch_loss_is_cleanrls(minibatch_loss: Callable, model, agent, batch: dict, args) -> None:
    """A PPO script's `minibatch_loss(model, batch, ...)` (advantages normalised with the batch's mean and std) gives
    the loss, logged numbers and gradients of CleanRL's step written out (cleanrl_minibatch_step on `agent`), on a
    batch where some ratios and some value changes clip and some do not, so that the other --clip-vloss setting gives
    another value loss: a script that ignores the flag fails here."""
    import dataclasses

    adv_mean, adv_std = batch["advantages"].mean(), batch["advantages"].std()
    loss, stats = minibatch_loss(model, batch, adv_mean, adv_std, args)
    expected_loss, expected_stats = cleanrl_minibatch_step(agent, batch, args)
    assert 0 < stats["clipfrac"] < 1  # some ratios clipped, some not
    with torch.no_grad():  # and some value errors beyond the clip range, some within
        value_change = (agent.get_value(batch["obs"]).view(-1) - batch["values"]).abs()
    assert (value_change > args.clip_coef).any() and (value_change < args.clip_coef).any()
    other_value_loss = cleanrl_minibatch_step(agent, batch, dataclasses.replace(args, clip_vloss=not args.clip_vloss))
    assert (other_value_loss[1][1] - expected_stats[1]).abs() > 1e-3
    assert_same_loss_and_gradients(agent, loss, stats, expected_loss, expected_stats)


class Recorder(gym.Wrapper):
    """One env as a script's main steps it (make_env wrapped by a test): its reset seeds; what a same-step-autoreset
    vector env shows the agent (reset observations, and the observations of steps that did not end an episode: a final
    observation is replaced by the next reset's); each step's reward and how it ended."""

    instances: list["Recorder"] = []  # filled in the rank's process only

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.seeds = []
        self.seen = []
        self.rewards = []
        self.terminated = []
        self.truncated = []
        Recorder.instances.append(self)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = super().reset(seed=seed, options=options)
        self.seen.append(obs)
        self.seeds += [] if seed is None else [seed]
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        self.rewards.append(float(reward))
        self.terminated.append(terminated)
        self.truncated.append(truncated)
        if not (terminated or truncated):
            self.seen.append(obs)
        return obs, reward, terminated, truncated, info

    @property
    def ends(self) -> list[bool]:
        return [terminated or truncated for terminated, truncated in zip(self.terminated, self.truncated, strict=True)]
