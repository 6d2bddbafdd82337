"""What every test shares without asking: one torch.compile cache for the whole suite, and the machine, two tests at a
time (pyproject's `-n 2`), but a test marked `alone` by itself."""

import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def inductor_cache(tmp_path_factory):
    """An empty TORCHINDUCTOR_CACHE_DIR for the suite, as a user's machine keeps one across runs: each compiling
    process then skips the seconds of checks and headers that a fresh cache costs, and still compiles its own graphs."""
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("inductor")
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        yield cache


@contextmanager
def machine_share(alone: bool):
    """Under pytest-xdist: a test marked `alone` (what it checks depends on idle cores) waits for the other worker's
    test to end and holds the machine; the others share it. A turnstile lets no new test start while one waits."""
    folder = os.environ.get("DDRL_TEST_LOCKS")
    if "PYTEST_XDIST_WORKER" not in os.environ or folder is None:  # one test at a time
        yield
        return
    with open(Path(folder, "turnstile"), "w") as turnstile, open(Path(folder, "machine"), "w") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the file releases the machine


def pytest_configure(config):
    """The controller makes a folder for machine_share's locks (its workers inherit the environment that names it);
    each of two workers on two cores computes in-process with one torch thread, as the ranks it forks do."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        torch.set_num_threads(1)
    else:
        config.machine_locks = tempfile.mkdtemp(prefix="ddrl-test-locks-")
        os.environ["DDRL_TEST_LOCKS"] = config.machine_locks


def pytest_unconfigure(config):
    if hasattr(config, "machine_locks"):
        shutil.rmtree(config.machine_locks, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's setup (module fixtures too), call and teardown inside machine_share."""
    with machine_share(item.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """script -> (its training checkpoint of iteration 2, its model file) from a real one-rank run of its tiny flags,
    each as tests.helpers.read_checkpoint reads it: the header, its tensors under "tensors"; made once per test run."""
    from tests.helpers import read_checkpoint, tiny_flags, train_ranks

    made = {}

    def checkpoints(script: str) -> tuple[dict, dict]:
        if script not in made:
            cwd = tmp_path_factory.mktemp("saved")
            train_ranks(script, tiny_flags(script, 2, "--checkpoint-every", "1", "--save-model"), cwd, nprocs=1)
            [run_dir] = (cwd / "runs").iterdir()
            made[script] = tuple(
                read_checkpoint(path)
                for path in (run_dir / "checkpoints/iter_000002.safetensors", run_dir / "model.safetensors")
            )
        return made[script]

    return checkpoints
