"""What every test shares without asking: one torch.compile cache for the whole suite, and the machine, two tests at a
time (pyproject's `-n 2`), but a test marked `alone` by itself."""

import fcntl
import os
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
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one test at a time
        yield
        return
    folder = Path(tempfile.gettempdir())
    with open(folder / f"ddrl-{run}.turnstile", "w") as turnstile, open(folder / f"ddrl-{run}.machine", "w") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the file releases the machine


def pytest_configure(config):
    """Two workers on two cores: each computes in-process with one torch thread, as the ranks it forks do."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's setup (module fixtures too), call and teardown inside machine_share."""
    with machine_share(item.get_closest_marker("alone") is not None):
        yield
