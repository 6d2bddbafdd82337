"""Input a careless or hostile user hands the scripts: flags, run names, folders and checkpoints. Nothing of it runs
code, writes outside runs/, overwrites a run or ends in a traceback: each refusal is one line and exit code 2, before
anything is written where it names a flag, and every file that was there before is as it was (compared by hash). A
flag's rule is the script's own (its Args); what a rule, a run folder or a file is checked by is ddrl's, exercised
through one script where the scripts share it."""

import hashlib
import importlib
import importlib.util
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import tyro
from safetensors.torch import save_file

from benchmark import faults
from ddrl import failures
from tests.helpers import (
    ROOT,
    WAIT,
    assert_ok,
    finish_python,
    free_port,
    hold_after,
    output,
    progress_lines,
    refuse,
    run_command,
    run_dirs,
    run_python,
    signal_held,
    start_python,
    tiny_flags,
    train_ranks,
    wait_for,
    world_batch,
    write_checkpoint,
)
from tests.test_checkpoints import changed

CONTINUOUS, ATARI, VPG = "ppo_continuous_mpi.py", "ppo_atari_multigpu.py", "vpg_mpi.py"
RESUMED = "runs/old/checkpoints/iter_000002.safetensors"


def module(script: str):
    return importlib.import_module(script.removesuffix(".py"))


def tree(folder: Path) -> dict[str, str]:
    """Every path below `folder`, relative, with its content's digest (folders: "folder")."""
    return {
        str(path.relative_to(folder)): "folder" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in folder.rglob("*")
        if not path.is_symlink() and (path.is_dir() or path.is_file())
    }


def refused(
    script: str, argv: list[str], cwd: Path, monkeypatch, capsys, nothing_new: bool = True, taken: str = "", **env
) -> str:
    """`script`'s main on `argv` in `cwd` refuses as bad input must (exit 2, one stderr line, no traceback), leaving
    every file and folder of `cwd` as it was (but `taken`, the lock file of a run it resumed); new paths only under
    runs/, or (`nothing_new`) none. Returns the line."""
    monkeypatch.chdir(cwd)
    before = tree(cwd)
    message = refuse(module(script), argv, monkeypatch, capsys, **env)
    after = tree(cwd)
    before.pop(taken, None)
    assert {path: after.get(path) for path in before} == before, "a file that was there changed or went"
    created = sorted(after.keys() - before.keys())
    assert created == [] if nothing_new else all(path.startswith("runs") for path in created), created
    return message


# --- flags: each checked before anything is launched or written ------------------------------------------------------

TOO_MANY_RANKS = str(len(os.sched_getaffinity(0)) + 1)
HUGE = "--total-timesteps 100000000000000"  # a budget that lets any batch size train one iteration
NOT_ONE_FOLDER = "is not one folder name below runs/: use printable characters without '/' or '\\', not '.' or '..'"
NOT_A_BACKEND = "is not a torch.distributed backend: pass one of gloo, nccl, mpi, ucc, or DEVICE:BACKEND pairs"
FLAGS = [
    (CONTINUOUS, "--learning-rate nan", "--learning-rate must be finite, got nan"),
    (CONTINUOUS, "--learning-rate -1", "--learning-rate must be greater than 0, got -1.0"),
    (ATARI, "--learning-rate inf", "--learning-rate must be finite, got inf"),
    (VPG, "--pi-lr nan", "--pi-lr must be finite, got nan"),
    (VPG, "--vf-lr -1", "--vf-lr must be greater than 0, got -1.0"),
    (CONTINUOUS, "--dist-timeout nan", "--dist-timeout must be at most 10000000, got nan"),
    (ATARI, "--dist-timeout inf", "--dist-timeout must be at most 10000000, got inf"),
    (VPG, "--backend junk", f"--backend 'junk' {NOT_A_BACKEND}"),
    (CONTINUOUS, "--backend cpu:gloo,cuda:junk", f"--backend 'cpu:gloo,cuda:junk' {NOT_A_BACKEND}"),
    (VPG, "--hidden-sizes -5", "--hidden-sizes[0] must be at least 1, got -5"),
    (VPG, "--hidden-sizes 1000000", "--hidden-sizes[0] must be at most 65536, got 1000000"),
    (VPG, "--hidden-sizes 65536 65536", "one iteration's data needs about"),  # networks no memory holds
    (VPG, "--max-ep-len -1", "--max-ep-len must be at least 1, got -1"),
    (VPG, "--lam nan", "--lam must be at most 1, got nan"),
    (CONTINUOUS, "--gamma 1.5", "--gamma must be at most 1, got 1.5"),
    (ATARI, "--clip-coef nan", "--clip-coef must be finite, got nan"),
    (CONTINUOUS, "--max-grad-norm 0", "--max-grad-norm must be greater than 0, got 0.0"),
    (ATARI, "--target-kl nan", "--target-kl must be finite, got nan"),
    (ATARI, "--env-threads -1", "--env-threads must be at least 0, got -1"),
    (ATARI, "--env-groups 3", "--local-num-envs 2 does not split into --env-groups 3"),
    (VPG, "--seed -1", "--seed must be at least 0, got -1"),
    (CONTINUOUS, "--torch-threads -2", "--torch-threads must be at least 0, got -2"),
    (ATARI, f"--nprocs {TOO_MANY_RANKS}", f"--nprocs {TOO_MANY_RANKS} asks for more ranks than the"),
    (CONTINUOUS, "--run-name ../x", f"--run-name '../x' {NOT_ONE_FOLDER}"),
    (VPG, "--run-name /tmp/elsewhere", f"--run-name '/tmp/elsewhere' {NOT_ONE_FOLDER}"),
    (ATARI, "--run-name a/b", f"--run-name 'a/b' {NOT_ONE_FOLDER}"),
    (VPG, "--run-name ..", f"--run-name '..' {NOT_ONE_FOLDER}"),
    (CONTINUOUS, "--exp-name ../../x", f"--exp-name '../../x' {NOT_ONE_FOLDER}"),
    # sizes beyond any machine, and flags that contradict each other
    (CONTINUOUS, "--num-steps 1000000000", "--num-steps must be at most 10000000, got 1000000000"),
    (ATARI, "--local-num-envs 1000000", "--local-num-envs must be at most 65536, got 1000000"),
    (CONTINUOUS, "--update-epochs 1000000000", "--update-epochs must be at most 10000, got 1000000000"),
    (VPG, "--train-v-iters 1000000000", "--train-v-iters must be at most 100000, got 1000000000"),
    (ATARI, "--env-threads 1000000", "--env-threads must be at most 65536, got 1000000"),
    (CONTINUOUS, f"--num-steps 10000000 --local-num-envs 4096 {HUGE}", "one iteration's data needs about"),
    (ATARI, f"--num-steps 1000000 --local-num-envs 4096 {HUGE}", "one iteration's data needs about"),
    (VPG, f"--steps-per-epoch 1000000000 {HUGE}", "one iteration's data needs about"),
    (CONTINUOUS, "--dist-timeout 1e-9", "--dist-timeout must be at least 5, got 1e-09"),
    (VPG, "--eval-checkpoint ''", "--eval-checkpoint '' names no file: pass the path of a model file"),
    (ATARI, "--eval-checkpoint x.safetensors --resume", "--eval-checkpoint evaluates a model on one process, where"),
    (VPG, "--eval-checkpoint x.safetensors --save-model --checkpoint-every 2", "--checkpoint-every, --save-model"),
    (CONTINUOUS, "--track", "--track needs Weights and Biases, which is not installed: pip install wandb"),
    (CONTINUOUS, "--backend cpu:gloo,tpu:gloo", f"--backend 'cpu:gloo,tpu:gloo' {NOT_A_BACKEND}"),
]


@pytest.mark.parametrize(("script", "argv", "message"), FLAGS, ids=[f"{s[:-3]} {a[:40]}" for s, a, _ in FLAGS])
def test_a_flag_that_cannot_run_is_one_line_before_anything_is_written(
    script, argv, message, tmp_path, monkeypatch, capsys
):
    if "--track" in argv and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    assert message in refused(script, tiny_flags(script, 2, *shlex.split(argv)), tmp_path, monkeypatch, capsys)
    assert list(tmp_path.iterdir()) == []  # no runs/, no ../x, nothing


# --- run folders: one name below runs/, created once, never shared ---------------------------------------------------


def test_a_run_name_that_exists_is_refused_and_the_run_in_it_is_kept(tmp_path, monkeypatch, capsys):
    """Without checkpoints too: the first run's events and model file stay as they were."""
    train_ranks(VPG, tiny_flags(VPG, 2, "--run-name", "same", "--save-model"), tmp_path, nprocs=1)
    assert (tmp_path / "runs/same/model.safetensors").is_file()
    message = refused(VPG, tiny_flags(VPG, 2, "--run-name", "same"), tmp_path, monkeypatch, capsys)
    assert "runs/same already exists: pass --resume to continue it, or choose another --run-name" in message


def test_a_default_name_taken_in_the_same_second_gains_a_suffix(tmp_path):
    """The default name has the second the run starts in; runs that start in one second (a sweep launched at once)
    must not share a folder. Those names taken for the next minutes, the run takes the first free suffix."""
    taken = [tmp_path / "runs" / f"CartPole-v1__vpg_mpi__1__{int(time.time()) + second}" for second in range(-1, 300)]
    for folder in taken:
        folder.mkdir(parents=True)
    train_ranks(VPG, tiny_flags(VPG, 2), tmp_path, nprocs=1)
    new = [folder for folder in run_dirs(tmp_path) if folder not in taken]
    assert len(new) == 1 and new[0].name.endswith("-2") and new[0].name[:-2] in {f.name for f in taken}, new
    assert list(new[0].glob("events.out.tfevents.*")) and all(list(folder.iterdir()) == [] for folder in taken)


def test_two_runs_started_at_once_with_one_default_name_write_two_folders(tmp_path):
    runs = [start_python(ROOT / VPG, tiny_flags(VPG, 2), tmp_path, name) for name in ("first", "second")]
    for run in runs:
        assert_ok(finish_python(run, timeout=WAIT))
    folders = run_dirs(tmp_path)
    assert len(folders) == 2 and all(len(list(folder.glob("events.out.tfevents.*"))) == 1 for folder in folders)


def test_a_runs_folder_that_cannot_be_made_is_one_line_at_start(tmp_path, monkeypatch, capsys):
    (tmp_path / "runs").write_text("a file where runs/ goes")
    message = refused(VPG, tiny_flags(VPG, 2), tmp_path, monkeypatch, capsys)
    assert "cannot create the folder runs/ here" in message


FILE_SIZE_LIMIT = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))  # a VPG checkpoint is twice that
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_checkpoint_write_that_fails_later_stops_in_one_line_naming_the_last_good_one(tmp_path):
    """A file system that takes no more (here: a file size limit) when the fourth checkpoint is written: one line
    names the last good checkpoint and --resume; no part of the fourth is left behind."""
    train_ranks(VPG, tiny_flags(VPG, 3, "--run-name", "r", "--checkpoint-every", "1"), tmp_path, nprocs=1)
    (tmp_path / "limited.py").write_text(FILE_SIZE_LIMIT)
    # one torch thread: a busy machine would otherwise add the oversubscription warning's line before the error
    argv = tiny_flags(VPG, 5, "--run-name", "r", "--checkpoint-every", "1", "--resume", "--torch-threads", "1")
    result = run_python(tmp_path / "limited.py", [str(ROOT / VPG), *argv], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [message] = result.stderr.splitlines()
    assert message.startswith(f"{VPG}: error: could not write runs/r/checkpoints/iter_000004.safetensors ("), message
    last = "runs/r/checkpoints/iter_000003.safetensors"
    assert f"the last good checkpoint is {last}" in message and "--resume --run-name r" in message
    assert progress_lines(result.stdout) == [4]
    assert sorted(path.name for path in (tmp_path / "runs/r/checkpoints").iterdir()) == [
        f"iter_00000{iteration}.safetensors" for iteration in (1, 2, 3)
    ]


# --- checkpoints: read like a command line, never running code ------------------------------------------------------

MARK_MODULE = '''"""A module that leaves a mark when it is imported: the tests' proof that nothing imported it."""
from pathlib import Path

Path(__file__).with_suffix(".imported").touch()
'''


def mark_module(tmp_path, monkeypatch) -> tuple[str, Path]:
    """A module of this test's own, importable by a name no other test uses, and the mark its import leaves."""
    name = f"mark_{tmp_path.name.replace('-', '_')}"
    folder = tmp_path / "modules"
    folder.mkdir()
    (folder / f"{name}.py").write_text(MARK_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return name, folder / f"{name}.imported"


def resume_argv(script: str, checkpoint: dict, cwd: Path) -> list[str]:
    """`checkpoint` as the newest of runs/old, and the flags that resume it."""
    write_checkpoint(checkpoint, cwd / RESUMED)
    return tiny_flags(script, 3, "--resume", "--run-name", "old")


def evaluate_argv(checkpoint: dict, cwd: Path) -> list[str]:
    return ["--eval-checkpoint", str(write_checkpoint(checkpoint, cwd / "model.safetensors")), "--eval-episodes", "1"]


def written_by(script: str, file: dict, env_id: str, **args) -> dict:
    """`file` (VPG's) as `script` would have written it for `env_id`, with `args`: what a file claims is all that is
    read before the env and the args are refused."""
    return {**file, "script": script, "env_id": env_id, "args": {"env_id": env_id, **args}}


@pytest.mark.parametrize("how", ["evaluate", "evaluate its args", "resume"])
def test_a_checkpoint_naming_a_module_never_imports_it(how, saved, tmp_path, monkeypatch, capsys):
    """An env id of the `module:EnvId` form in a file, as its env or (evaluated, where the args' env is played) only
    in its args: refused unimported; a user who trusts the module passes it with --env-id."""
    name, mark = mark_module(tmp_path, monkeypatch)
    training, model = saved(VPG)
    env_id = f"{name}:CartPole-v1"
    expected = [f"names its env '{env_id}', whose module gymnasium would import", f"pass --env-id {env_id} yourself"]
    if how == "evaluate":
        argv = evaluate_argv(written_by(VPG, model, env_id), tmp_path)
    elif how == "evaluate its args":
        argv = evaluate_argv(changed(model, args={**model["args"], "env_id": env_id}), tmp_path)
        expected = [f"holds args of env '{env_id}', not its 'CartPole-v1': it is damaged"]
    else:
        argv = resume_argv(VPG, changed(training, env_id=env_id), tmp_path)
    message = refused(VPG, argv, tmp_path, monkeypatch, capsys)
    assert all(part in message for part in expected), message
    assert not mark.exists()


def test_a_module_the_user_names_with_env_id_is_imported(saved, tmp_path, monkeypatch, capsys):
    """The refusal above is the only thing between the file and the import: given by the user, it happens."""
    name, mark = mark_module(tmp_path, monkeypatch)
    env_id = f"{name}:CartPole-v1"
    argv = evaluate_argv(written_by(VPG, saved(VPG)[1], env_id), tmp_path)
    monkeypatch.chdir(tmp_path)
    module(VPG).main(tyro.cli(module(VPG).Args, args=[*argv, "--env-id", env_id]))
    assert mark.exists() and capsys.readouterr().out.strip().splitlines()[-1].startswith("eval: episodes=1")


ANOTHER_KIND = [  # the env a file names, which the script cannot play: refused in one line naming the file
    (ATARI, "Hopper-v5", "unknown or unusable the env_id of {path}, 'Hopper-v5', (TypeError: "),
    (ATARI, "ALE/Breakout-ram-v5", "unknown or unusable the env_id of {path}, 'ALE/Breakout-ram-v5', ("),
    (CONTINUOUS, "ALE/Breakout-v5", "{path}"),  # unknown, or pixels that fit no weights of InvertedPendulum's
    (CONTINUOUS, "CartPole-v1", "the env_id of {path}, 'CartPole-v1', has Discrete actions"),  # its weights fit
    (VPG, "ALE/Pong-v5", "{path}"),  # unknown, or pixels that fit no weights of CartPole's
]


@pytest.mark.parametrize(
    ("script", "env_id", "message"),
    ANOTHER_KIND,
    ids=["atari Hopper", "atari RAM", "continuous Atari", "continuous CartPole", "vpg Atari"],
)
def test_a_checkpoint_of_another_kind_of_env_is_one_line(script, env_id, message, saved, tmp_path, monkeypatch, capsys):
    model = saved(VPG if script == ATARI else script)[1]  # Atari's is refused before its weights are read
    argv = evaluate_argv(written_by(script, model, env_id, **changed(model["args"], env_id=None)), tmp_path)
    line = refused(script, argv, tmp_path, monkeypatch, capsys)
    assert message.format(path=tmp_path / "model.safetensors") in line, line


SAVED_ARGS = [
    (VPG, "evaluate", {"hidden_sizes": [10**6, 10**6]}, "--hidden-sizes[0] must be at most 65536, got 1000000"),
    (VPG, "evaluate", {"hidden_sizes": [1] * 65}, "--hidden-sizes must be at most 64 long, got [1, 1, 1,"),
    (VPG, "evaluate", {"hidden_sizes": [-5]}, "--hidden-sizes[0] must be at least 1, got -5"),
    (VPG, "evaluate", {"max_ep_len": -1}, "--max-ep-len must be at least 1, got -1"),
    (VPG, "resume", {"pi_lr": float("nan")}, "--pi-lr must be finite, got nan"),
    (CONTINUOUS, "resume", {"learning_rate": -1.0}, "--learning-rate must be greater than 0, got -1.0"),
    (CONTINUOUS, "evaluate", {"num_steps": "many"}, "--num-steps holds 'many', which is no int"),
    (ATARI, "evaluate", {"gamma": float("inf")}, "--gamma must be at most 1, got inf"),
    (ATARI, "resume", {"dist_timeout": float("nan")}, "--dist-timeout must be at most 10000000, got nan"),
]


@pytest.mark.parametrize(
    ("script", "how", "args", "message"), SAVED_ARGS, ids=[f"{s[:-3]} {h} {list(a)[0]}" for s, h, a, _ in SAVED_ARGS]
)
def test_a_checkpoint_whose_args_no_command_line_gives_is_one_line(
    script, how, args, message, saved, tmp_path, monkeypatch, capsys
):
    """A file's args are read by the script's own rules (VPG's args given to PPO are dropped, the rest defaults)."""
    training, model = saved(VPG)
    env_id = module(script).Args().env_id if script != VPG else "CartPole-v1"
    if how == "evaluate":
        argv = evaluate_argv(written_by(script, model, env_id, **args), tmp_path)
    else:
        argv = resume_argv(script, written_by(script, training, env_id, **args), tmp_path)
        argv = [*argv, "--env-id", env_id]
    line = refused(script, argv, tmp_path, monkeypatch, capsys)
    assert "holds args that no command line gives (" in line and message in line, line


@pytest.mark.parametrize("how", ["evaluate", "resume"])
@pytest.mark.parametrize(
    ("entry", "value", "message"),
    [
        ("obs_rms.var", -1.0, "its obs_rms.var holds negative numbers, where a variance is at least 0"),
        ("obs_rms.count", -1.0, "its obs_rms.count is -1, where data counts at least 1 sample"),
        ("return_rms.count", 0.5, "its return_rms.count is 0.5, where data counts at least 1 sample"),
    ],
)
def test_normalisation_statistics_no_data_gives_are_one_line(
    how, entry, value, message, saved, tmp_path, monkeypatch, capsys
):
    checkpoint = saved(CONTINUOUS)[0 if how == "resume" else 1]
    name = f"model.{entry}"
    tensors = {**checkpoint["tensors"], name: torch.full_like(checkpoint["tensors"][name], value)}
    if how == "evaluate":
        argv = evaluate_argv({**checkpoint, "tensors": tensors}, tmp_path)
    else:
        argv = resume_argv(CONTINUOUS, {**checkpoint, "tensors": tensors}, tmp_path)
    # the tensors are read once the run folder is locked: its run.lock is all that is new
    assert message in refused(CONTINUOUS, argv, tmp_path, monkeypatch, capsys, nothing_new=how == "evaluate")


@pytest.mark.parametrize(
    ("progress", "message"),
    [
        ({"iteration": -5, "global_step": -1000}, "holds -5 as its 'iteration', where ddrl writes an int in [0, "),
        ({"iteration": 5, "global_step": 4}, "says 4 env steps in 5 iterations by 1 ranks, of --total-timesteps "),
        ({"global_step": 10**9}, "says 1000000000 env steps in 2 iterations by 1 ranks, of --total-timesteps "),
        ({"restarts": -1}, "holds -1 as its 'restarts', where ddrl writes an int in [0, 1000000]"),
        ({"world_size": 0}, "says 400 env steps in 2 iterations by 0 ranks, of --total-timesteps "),
    ],
    ids=["negative", "fewer-steps-than-iterations", "more-steps-than-its-total", "negative-restarts", "no-ranks"],
)
def test_a_resumed_progress_no_run_reaches_is_one_line(progress, message, saved, tmp_path, monkeypatch, capsys):
    argv = resume_argv(VPG, changed(saved(VPG)[0], **progress), tmp_path)
    line = refused(VPG, argv, tmp_path, monkeypatch, capsys)
    assert message.replace("400", str(2 * world_batch(VPG))) in line and "it is damaged" in line, line


def test_optimizer_state_whose_tensors_do_not_fit_is_one_line_never_a_crash(saved, tmp_path, monkeypatch, capsys):
    training = saved(VPG)[0]
    name = "optimizer.state.3.exp_avg"
    tensors = {**training["tensors"], name: training["tensors"][name][..., :1].clone()}
    argv = resume_argv(VPG, {**training, "tensors": tensors}, tmp_path)
    message = refused(VPG, argv, tmp_path, monkeypatch, capsys, nothing_new=False)  # a run.lock, once locked
    assert "its 'optimizer' holds the state of a 'Adam' (3.exp_avg (1,), not (64,))" in message, message
    assert "which does not fit this run's Adam" in message


# --- reading a file: nothing it claims is allocated, nothing it names is built ----------------------------------------


class Mark:
    """A pickled call of os.mkdir(path): a file that carries code, which leaves a folder behind if it ever runs."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


FILE_KINDS = {
    "folder": "is a folder",
    "named-pipe": "is a named pipe, not a file: refused, unread",
    "dev-zero": "is a character device, not a file: refused, unread",  # resumed: is a symbolic link (test_faults.py)
    "truncated": "could not be opened as a safetensors file (SafetensorError: Error while deserializing header",
    "huge-header": "declares a header of 4,294,967,296 bytes, more than the 16,777,216 bytes ddrl writes",
    "pickle": "is a pickle, which can run code: refused, unread",
    "earlier-version": "is a zip archive, as torch.save wrote an earlier version's checkpoints (.pt)",
    "zip-bomb": "is a zip archive, as torch.save wrote an earlier version's checkpoints (.pt)",
    "numpy-pickle": "is a pickle, which can run code: refused, unread",
    "no-header": "is a safetensors file without ddrl's header",
}


def hand_in(fault: str, saved_file: Path, path: Path, mark: Path) -> None:
    """Put at `path` what a careless or hostile user hands in as a checkpoint: `fault` of FILE_KINDS."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fault == "folder":
        path.mkdir()
    elif fault == "named-pipe":
        os.mkfifo(path)
    elif fault == "dev-zero":
        path.symlink_to("/dev/zero")
    elif fault == "truncated":
        path.write_bytes(saved_file.read_bytes()[: saved_file.stat().st_size // 2])
    elif fault == "huge-header":
        path.write_bytes((2**32).to_bytes(8, "little") + b"{}")
    elif fault == "pickle":
        path.write_bytes(pickle.dumps({"model": Mark(mark)}))
    elif fault == "earlier-version":
        torch.save({"script": "ppo_continuous_mpi.py", "model": {"x": torch.zeros(3)}, "mark": Mark(mark)}, path)
    elif fault == "zip-bomb":
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("model/data.pkl", b"\0" * 10**8)
    elif fault == "numpy-pickle":
        path.write_bytes(pickle.dumps(np.zeros(3)))
    else:
        save_file({"x": torch.zeros(3)}, str(path))


@pytest.mark.parametrize("how", ["evaluate", "resume"])
@pytest.mark.parametrize("fault", list(FILE_KINDS))
def test_a_file_that_is_no_checkpoint_is_refused_in_one_line_and_nothing_in_it_runs(
    how, fault, saved, tmp_path, monkeypatch, capsys
):
    source = write_checkpoint(saved(VPG)[0 if how == "resume" else 1], tmp_path / "source" / "file.safetensors")
    mark = tmp_path / "mark"
    if how == "evaluate":
        path = tmp_path / "model.safetensors"
        argv = ["--eval-checkpoint", str(path), "--eval-episodes", "1"]
        shown = str(path)
    else:
        path = tmp_path / RESUMED
        argv = tiny_flags(VPG, 3, "--resume", "--run-name", "old")
        shown = RESUMED
    hand_in(fault, source, path, mark)
    message = refused(VPG, argv, tmp_path, monkeypatch, capsys)
    expected = "is a symbolic link, which a run never" if (how, fault) == ("resume", "dev-zero") else FILE_KINDS[fault]
    assert message.startswith(f"{VPG}: error: {shown} ") and expected in message, message
    assert not mark.exists()


def test_an_earlier_versions_checkpoint_in_a_run_folder_says_so_on_resume(tmp_path, monkeypatch, capsys):
    """A run trained by an earlier version has iter_N.pt files: --resume finds the newest and says what it is."""
    (tmp_path / "runs/old/checkpoints").mkdir(parents=True)
    torch.save({"script": VPG, "iteration": 2}, tmp_path / "runs/old/checkpoints/iter_000002.pt")
    message = refused(VPG, tiny_flags(VPG, 3, "--resume", "--run-name", "old"), tmp_path, monkeypatch, capsys)
    assert "runs/old/checkpoints/iter_000002.pt is a zip archive, as torch.save wrote an earlier version's" in message
    assert "resume or evaluate it with the version that wrote it" in message


# --- long values, launcher variables, one launch per run, signals ----------------------------------------------------


def test_a_long_value_is_cut_in_the_error_line(tmp_path, monkeypatch, capsys):
    """A 1 MiB --env-id comes back as its first 200 characters and its length, not as a 2 MB line."""
    env_id = "x" * 2**20
    line = refused(CONTINUOUS, ["--env-id", env_id], tmp_path, monkeypatch, capsys)
    assert len(line) < 2000 and f"... ({2**20 + 2} characters)" in line, line[:300]


def test_what_an_error_says_is_quoted_by_its_first_line_escaped_and_cut():
    """An exception's message in a refusal (a renderer's, the OS's, safetensors'): its first line only, a terminal's
    control bytes visible, and past 200 characters cut with its length said whole."""
    assert failures.first_line(ValueError("bad\x1b[2J\nforged: error: line")) == "bad\\x1b[2J"
    assert failures.first_line(OSError("")) == "OSError"
    assert failures.first_line(RuntimeError("x" * 300)).endswith("x... (300 characters)")


LAUNCHER_VARIABLES = [
    ({"RANK": "5", "WORLD_SIZE": "2"}, "the launcher's variable RANK=5 lies outside [0, 1] (with WORLD_SIZE=2)"),
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "the launcher's variable RANK='abc' is no integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "the launcher's variable WORLD_SIZE=0 lies outside [1, 1048576]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 lies outside [1, 2]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 lies outside [1, 65535]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a b"}, "MASTER_ADDR='a b' is no host name"),
    ({"TORCHELASTIC_RESTART_COUNT": "abc"}, "TORCHELASTIC_RESTART_COUNT='abc' is no integer"),
    (
        {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RUN_ID": "../../../elsewhere"},
        "TORCHELASTIC_RUN_ID='../../../elsewhere' makes no folder name below runs/",
    ),
    (
        {"RANK": None, "WORLD_SIZE": None, "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"},
        "OMPI_COMM_WORLD_RANK=2 lies outside [0, 1]",
    ),
]


@pytest.mark.parametrize(
    ("env", "message"),
    LAUNCHER_VARIABLES,
    ids=[next(iter(env)) + f"-{i}" for i, (env, _) in enumerate(LAUNCHER_VARIABLES)],
)
def test_a_launcher_variable_that_cannot_be_is_one_line_naming_it(env, message, tmp_path, monkeypatch, capsys):
    if "RANK" not in env:  # a world of one, as refuse() sets by default
        env = {"RANK": "0", "WORLD_SIZE": "1", **env}
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        env.setdefault(key, None)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        env.setdefault(key, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}[key])
    assert message in refused(VPG, tiny_flags(VPG, 2), tmp_path, monkeypatch, capsys, **env)


def test_mujoco_gl_naming_no_renderer_is_one_line(tmp_path):
    """A real process: MuJoCo reads MUJOCO_GL when it is first imported."""
    command = [sys.executable, str(ROOT / CONTINUOUS), *tiny_flags(CONTINUOUS, 2)]
    result = run_command(command, tmp_path, MUJOCO_GL="garbage")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{CONTINUOUS}: error: MUJOCO_GL='garbage' names no renderer MuJoCo can load")
    assert not (tmp_path / "runs").exists()


def test_a_rank_waiting_for_its_peers_says_so_and_keeps_waiting(tmp_path):
    """RANK=0 WORLD_SIZE=2 and no rank 1: within seconds one line says whom it waits for, where and until when;
    then --dist-timeout ends the wait in one line."""
    (tmp_path / "alone.py").write_text(
        "import os, runpy, sys\n"
        "os.environ.update(RANK='0', WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1])\n"
        "sys.argv = sys.argv[2:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    port = str(free_port())
    argv = [port, str(ROOT / VPG), *tiny_flags(VPG, 2, "--dist-timeout", "20")]  # the notice after half: 10 s to spare
    result = run_python(tmp_path / "alone.py", argv, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{VPG}: ")]
    waited = rf"{VPG}: warning: rank 0 of 2 has waited \d+ s for its 1 peer\(s\) at 127\.0\.0\.1:{port} "
    assert re.match(waited, lines[0]), lines
    assert "and waits until" in lines[0] and "(--dist-timeout 20 s)" in lines[0]
    assert lines[1].startswith(f"{VPG}: error: could not form a process group of 2 ranks"), lines
    assert not (tmp_path / "runs").exists()


def test_a_hand_set_restart_count_never_writes_into_a_finished_run(tmp_path, monkeypatch, capsys):
    train_ranks(VPG, tiny_flags(VPG, 2, "--run-name", "done", "--save-model"), tmp_path, nprocs=1)
    argv = tiny_flags(VPG, 2, "--run-name", "done", "--save-model")
    message = refused(VPG, argv, tmp_path, monkeypatch, capsys, nothing_new=True, TORCHELASTIC_RESTART_COUNT="1")
    assert (
        "runs/done already exists, and TORCHELASTIC_RESTART_COUNT=1 is no restart of the launch that made it" in message
    )


def test_a_run_in_use_refuses_a_second_launch_of_it(tmp_path):
    """One process group per run folder: while a run trains, --resume of it is refused in one line naming who holds
    it; the lock goes with the process, so once the first has died the same --resume continues the run."""
    argv = tiny_flags(VPG, 10**6, "--run-name", "busy", "--checkpoint-every", "1")  # it ends only as killed
    first = start_python(ROOT / VPG, argv, tmp_path, "first")  # its output apart from the second's
    try:
        checkpoints = tmp_path / "runs/busy/checkpoints"
        wait_for(lambda: list(checkpoints.glob("iter_*")), WAIT, "a first checkpoint", (first,))
        second = run_python(ROOT / VPG, tiny_flags(VPG, 10**6, "--run-name", "busy", "--resume"), tmp_path)
    finally:
        first.kill()
        first.join()
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
    [line] = second.stderr.splitlines()
    assert line.startswith(f"{VPG}: error: runs/busy is in use by another run (process {first.pid} on ")
    written = (tmp_path / "runs/busy/checkpoints").glob("iter_*.safetensors")
    reached = max(int(path.name.split(".")[0].removeprefix("iter_")) for path in written)
    resumed = tiny_flags(VPG, reached + 2, "--run-name", "busy", "--resume")  # two epochs on from the last checkpoint
    again = run_python(ROOT / VPG, resumed, tmp_path)
    assert again.returncode == 0 and "resuming from runs/busy/checkpoints/" in again.stdout, again.stderr[-2000:]
    assert progress_lines(again.stdout) == [reached + 1, reached + 2]
    assert f"done: {(reached + 2) * world_batch(VPG)} env steps" in again.stdout


def interrupted(tmp_path: Path, signals: int) -> subprocess.CompletedProcess:
    """A long VPG run sent Ctrl-C (SIGINT) after each of its first `signals` epochs, held at each epoch's line while
    it is sent; what it wrote."""
    # one torch thread: a busy machine would otherwise add the oversubscription warning's line to stderr
    argv = tiny_flags(VPG, 10**6, "--run-name", "ctrl-c", "--torch-threads", "1")  # it ends only as stopped
    run = start_python(ROOT / VPG, argv, tmp_path, **hold_after(f"^epoch [1-{signals}]/"))
    for epoch in range(1, signals + 1):
        signal_held(run.pid, [signal.SIGINT], f"epoch {epoch}'s line", (run,))
    return finish_python(run, WAIT)


def test_a_run_folder_removed_while_training_ends_the_run_in_one_line(tmp_path):
    """`rm -rf runs/NAME` while the run trains (held after epoch 1's line): the next epoch's log says so in one line,
    exit 2, where TensorBoard's writer thread printed a traceback and the rank raised another."""
    argv = tiny_flags(VPG, 10**6, "--run-name", "gone", "--torch-threads", "1")  # it ends only as stopped
    run = start_python(ROOT / VPG, argv, tmp_path, **hold_after("^epoch 1/"))
    wait_for(lambda: faults.state(run.pid) == "T", WAIT, "the run holding after epoch 1's line", (run,))
    shutil.rmtree(tmp_path / "runs/gone")
    os.kill(run.pid, signal.SIGCONT)
    result = finish_python(run, WAIT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        f"{VPG}: error: could not write TensorBoard's events in runs/gone (no folder runs/gone): keep the run folder "
        "in place while it trains and free disk space; no checkpoint was written"
    ]
    assert progress_lines(result.stdout) == [1]


def test_ctrl_c_stops_every_rank_after_the_epoch_with_a_checkpoint(tmp_path):
    result = interrupted(tmp_path, 1)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [stopped] = [line for line in result.stdout.splitlines() if line.startswith("stopped by Ctrl-C at epoch")]
    assert stopped.startswith("stopped by Ctrl-C at epoch 2;")  # the notice is summed over ranks in the next epoch
    assert "continue with --resume --run-name ctrl-c" in stopped
    assert progress_lines(result.stdout) == [1, 2]
    assert (tmp_path / "runs/ctrl-c/checkpoints/iter_000002.safetensors").is_file()


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
    result = interrupted(tmp_path, 2)  # the second after epoch 2's line, before its checkpoint
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"{VPG}: stopped at once by a second Ctrl-C; continue from the run's last checkpoint"), line
    assert not list((tmp_path / "runs/ctrl-c/checkpoints").glob("iter_*"))


def test_a_closed_output_ends_the_run_quietly_with_its_checkpoint(tmp_path):
    """`| head -1`: the reader goes away; the run stops after the iteration it noticed, with a checkpoint, and says
    nothing of a broken pipe. (Its stdout is a named pipe this test reads, then closes.)"""
    os.mkfifo(tmp_path / "piped.out")
    argv = tiny_flags(VPG, 10**6, "--run-name", "piped", "--torch-threads", "1")  # no oversubscription warning
    run = start_python(ROOT / VPG, argv, tmp_path, "piped")
    with open(tmp_path / "piped.out", "rb") as reader:  # opened once the run opens its end
        while not reader.readline().startswith(b"epoch 1/"):
            assert run.exitcode is None, output(run)[1][-2000:]
    result = finish_python(run, WAIT)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    assert list((tmp_path / "runs/piped/checkpoints").glob("iter_*.safetensors"))


def test_evaluating_with_another_env_id_than_the_checkpoints_is_one_line(saved, tmp_path, monkeypatch, capsys):
    argv = [*evaluate_argv(saved(VPG)[1], tmp_path), "--env-id", "Acrobot-v1"]
    message = refused(VPG, argv, tmp_path, monkeypatch, capsys)
    assert "--env-id 'Acrobot-v1' is not the env of" in message and "which it plays: drop --env-id" in message
