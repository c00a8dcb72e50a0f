import os

import pytest

from tests.rank_cases import shm_segments
from dcp.spawn import World


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where there is none)")


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
    assert shm_segments() == [], f"shared-memory segments left behind: {shm_segments()}"
