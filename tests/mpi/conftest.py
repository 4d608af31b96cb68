import pytest

from hvctr.dist import init_comm


@pytest.fixture(scope="session")
def comm():
    c = init_comm()
    yield c
    c.barrier()
