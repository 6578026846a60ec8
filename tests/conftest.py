from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import Cluster, run_cli  # noqa: E402

from unbroken.plumbing import procs  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every end-to-end test (tests/integration) is ``slow``: ``-m "not slow"`` runs the fast part alone."""
    integration = Path(__file__).parent / "integration"
    for item in items:
        if integration in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator:
    """Start real local clusters; on teardown bring them down and prove no process is left."""
    started: list[Cluster] = []

    def start(*args: str, name: str = "cluster") -> Cluster:
        cluster = Cluster(tmp_path / name)
        run_cli("cluster", "up", *args, cluster_dir=cluster.dir, timeout=120)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        run_cli("cluster", "down", cluster_dir=cluster.dir, check=False)
        left = procs.cluster_processes(cluster.dir)
        assert not left, f"processes left behind by {cluster.dir}: {[(p.pid, p.cmdline()) for p in left]}"


@pytest.fixture
def cluster3(make_cluster) -> Cluster:
    return make_cluster("--nodes", "3")



@pytest.fixture(scope="session")
def kjv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The King James Bible as a .txt corpus, a verse per line (Debian's bible-kjv prints it)."""
    from corpus import write_kjv

    return write_kjv(tmp_path_factory.mktemp("corpus") / "kjv.txt")
