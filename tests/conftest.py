"""What every test shares without asking: one torch.compile cache for the whole suite."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def inductor_cache(tmp_path_factory):
    """An empty TORCHINDUCTOR_CACHE_DIR for the suite, as a user's machine keeps one across runs: each compiling
    process then skips the seconds of checks and headers that a fresh cache costs, and still compiles its own graphs."""
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("inductor")
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        yield cache
