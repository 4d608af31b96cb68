import os

import pytest

from tests.e2e.slurm_cluster import ClusterUnavailable, NotRoot, SlurmCluster, check_prerequisites


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real Slurm cluster on this machine (munged, slurmctld, slurmd), for the whole session.

    Skipped when not root. Skipped where Slurm/munge are missing, unless HVCTR_REQUIRE_SLURM=1
    (`make test` sets it, after `make setup` installed them): then that is a failure.
    """
    try:
        check_prerequisites()
    except ClusterUnavailable as e:
        if os.environ.get("HVCTR_REQUIRE_SLURM") == "1" and not isinstance(e, NotRoot):
            pytest.fail(f"{e} (HVCTR_REQUIRE_SLURM=1)")
        pytest.skip(str(e))
    # 4 CPUs on a 2-core machine: 2-3 tasks of a job, or two small jobs, fit at once.
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=4)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
