"""Shared fixtures: a real local Slurm cluster for tests marked ``slurm``.

One cluster per test session (start takes ~2.5 s with accounting). CI starts a cluster once
with ``python tests/support/local_cluster.py start DIR`` and sets ``SLURM_GUARD_TEST_CLUSTER=DIR``
so the session reuses it (and leaves it running). ``SLURM_GUARD_REQUIRE_SLURM=1`` turns
"Slurm not installed" from a skip into a failure, so CI cannot silently skip the Slurm tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from slurm_utils import wait_for as _wait_for
from support.local_cluster import (
    LocalCluster,
    LocalClusterError,
    find_free_port_base,
    missing_binaries,
)

from slurm_guard.slurm.client import CommandSlurmClient

REUSE_ENV = "SLURM_GUARD_TEST_CLUSTER"
REQUIRE_ENV = "SLURM_GUARD_REQUIRE_SLURM"


def slurm_unavailable(reason: str) -> None:
    """Skip, or fail when CI demands Slurm (a skipped Slurm suite would look green)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1, so this is an error, not a skip)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A running 4-node cluster with accounting, its env exported for the whole session.

    Shared by all tests: leave nodes idle and jobs finished (or use ``idle_slurm_cluster``).
    """
    reuse = os.environ.get(REUSE_ENV)
    if reuse:
        try:
            cluster = LocalCluster.attach(Path(reuse))
        except LocalClusterError as exc:
            pytest.fail(f"{REUSE_ENV}={reuse}: {exc}", pytrace=False)
        if not cluster.is_running():
            pytest.fail(f"{REUSE_ENV}={reuse}: that cluster is not running", pytrace=False)
        owned = False
    else:
        missing = missing_binaries(accounting=True)
        if missing:
            slurm_unavailable(
                f"Slurm not installed (missing {', '.join(missing)}); run .ci/install_slurm.sh"
            )
        # Short base directory: Unix socket paths are limited to ~108 bytes.
        cluster = LocalCluster(
            tmp_path_factory.mktemp("slurm"), nodes=4, port_base=find_free_port_base(4)
        )
        cluster.start()
        owned = True
    with pytest.MonkeyPatch.context() as mp:
        for key, value in cluster.env().items():
            mp.setenv(key, value)
        try:
            yield cluster
        finally:
            if owned:
                cluster.stop()


@pytest.fixture
def idle_slurm_cluster(slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The session cluster with no jobs and all nodes idle, before and after the test."""
    slurm_cluster.reset()
    yield slurm_cluster
    slurm_cluster.reset()


@pytest.fixture
def slurm_client(slurm_cluster: LocalCluster) -> CommandSlurmClient:
    """A CommandSlurmClient bound to the session cluster."""
    return CommandSlurmClient(env=slurm_cluster.env())


@pytest.fixture
def wait_for() -> Callable[..., object]:
    """The polling helper ``slurm_utils.wait_for(predicate, timeout, what)``."""
    return _wait_for
