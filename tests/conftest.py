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


@pytest.fixture(scope="module")
def worlds():
    """Rank-process groups by size, kept for the module and torn down with a leak check."""
    made: dict = {}

    def get(n: int, device: str = "cpu") -> World:
        if (n, device) not in made:
            made[(n, device)] = World(n, device)
        return made[(n, device)]

    yield get
    for w in made.values():
        w.close()
    check_no_leaks()
