import pytest

from hvctr.distributed import init_comm


@pytest.fixture(scope="session")
def comm():
    c = init_comm()
    yield c
    c.barrier()
