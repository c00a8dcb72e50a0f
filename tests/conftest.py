import os
import secrets

import pytest

from tests.rank_cases import shm_segments
from dcp.spawn import World

# Every segment this session's processes make (rank processes and commands started by tests inherit
# the environment) carries this tag in its name: the leak checks count those alone.
if not os.environ.get("DCP_A2A_SHM_TAG", "").startswith(f"test{os.getpid()}x"):
    os.environ["DCP_A2A_SHM_TAG"] = f"test{os.getpid()}x{secrets.token_hex(3)}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where there is none)")


def check_no_leaks() -> None:
    """Fail where this session's processes left host shared memory behind."""
    left = shm_segments()
    assert left == [], f"shared-memory segments left behind: {left}"


def fresh_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


_live_worlds: list = []  # the ``made`` dicts of the ``worlds`` fixtures in use


def pytest_runtest_makereport(item, call):
    """After a test fails, its module's worlds are closed: their ranks may be out of step (a pending
    collective, a killed peer), and each later test would fail on them, hiding its own result."""
    if call.when == "call" and call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
        for made in _live_worlds:
            for w in made.values():
                w.close(timeout=30.0)
            made.clear()


@pytest.fixture(scope="module")
def worlds():
    """Rank-process groups by size, kept for the module (a failed test's are replaced) and torn
    down with a leak check."""
    made: dict = {}
    _live_worlds.append(made)

    def get(n: int, device: str = "cpu") -> World:
        if (n, device) not in made:
            made[(n, device)] = World(n, device)
        return made[(n, device)]

    yield get
    _live_worlds.remove(made)
    for w in made.values():
        w.close()
    check_no_leaks()
