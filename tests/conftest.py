"""Shared fixtures: a real local Slurm cluster for tests marked ``slurm``.

One cluster per test session (start takes ~2.5 s with accounting). CI starts a cluster once
with ``python tests/support/local_cluster.py start DIR`` and sets ``SLURM_GUARD_TEST_CLUSTER=DIR``
so the session reuses it (and leaves it running). ``SLURM_GUARD_REQUIRE_SLURM=1`` turns
"Slurm not installed" from a skip into a failure, so CI cannot silently skip the Slurm tests.

CI runs the Slurm tests twice, against Slurm 22.05 (the host's packages) and Slurm 24.11 (a
Debian 13 root, ``SlurmUser=slurm``). The header and the end of the report name the version
and the SlurmUser the Slurm tests ran against, and ``SLURM_GUARD_TEST_RECORD=FILE`` writes the
counts as JSON, so CI can check that each version's tests ran and none was skipped.

Without a reused cluster, ``SLURM_GUARD_TEST_CHROOT=DIR`` (a root built by
``.ci/install_slurm_chroot.sh``) and ``SLURM_GUARD_TEST_SLURM_USER=slurm`` make the session's
own cluster a 24.11 one and/or one whose controller runs as that user.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from slurm_utils import wait_for as _wait_for

if not torch.cuda.is_available():
    # Triton decides interpreted or compiled when it is first imported, and test_abft.py's
    # collection imports it (through transformers) before test_kernels_triton.py could set this:
    # its tl.sum would then be a compiled-only function inside interpreted kernels. Set it
    # before any test module is imported. CPU code never runs Triton (kernels/bucket.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")
from support.local_cluster import (
    LocalCluster,
    LocalClusterError,
    find_free_port_base,
    missing_binaries,
)

from slurm_guard.slurm.client import CommandSlurmClient

REUSE_ENV = "SLURM_GUARD_TEST_CLUSTER"
REQUIRE_ENV = "SLURM_GUARD_REQUIRE_SLURM"
CHROOT_ENV = "SLURM_GUARD_TEST_CHROOT"
USER_ENV = "SLURM_GUARD_TEST_SLURM_USER"
RECORD_ENV = "SLURM_GUARD_TEST_RECORD"

#: Outcomes of the tests marked ``slurm`` in this session, for the summary and the record.
_slurm_outcomes: Counter[str] = Counter()
#: Slurm version, SlurmUser and root of the cluster the session's Slurm tests used.
_slurm_used: dict[str, str] = {}


def _session_slurm_user() -> str:
    """SlurmUser of the cluster this session uses (read without starting anything)."""
    reuse = os.environ.get(REUSE_ENV)
    if reuse:
        try:
            return LocalCluster.attach(Path(reuse)).slurm_user
        except LocalClusterError:
            return "root"
    return os.environ.get(USER_ENV, "root")


def _describe(cluster: LocalCluster) -> dict[str, str]:
    try:
        version = cluster.slurm_version()
    except LocalClusterError as exc:
        version = f"unknown ({exc})"
    return {
        "slurm_version": version,
        "slurm_user": cluster.slurm_user,
        "root": str(cluster.chroot) if cluster.chroot is not None else "/",
        "cluster": str(cluster.root),
    }


def _open_for(path: Path, stop_at: Path, mode: int) -> None:
    """Give ``path`` ``mode`` and let everybody traverse its parents up to ``stop_at``."""
    path.chmod(mode)
    for parent in path.parents:
        if parent == stop_at.parent or parent == parent.parent:
            break
        current = parent.stat().st_mode & 0o7777
        if not current & 0o001:
            parent.chmod(current | 0o011)


def pytest_report_header(config: pytest.Config) -> list[str]:
    reuse = os.environ.get(REUSE_ENV)
    if not reuse:
        return []
    try:
        described = _describe(LocalCluster.attach(Path(reuse)))
    except LocalClusterError as exc:
        return [f"slurm-guard: {REUSE_ENV}={reuse}: {exc}"]
    return [
        "slurm-guard: Slurm tests use {slurm_version}, SlurmUser={slurm_user}, root {root}, "
        "cluster {cluster}".format(**described)
    ]


CLUSTER_FIXTURES = frozenset({"slurm_cluster", "idle_slurm_cluster", "slurm_client"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the cluster is a Slurm test, marked or not: CI runs the Slurm tests in
    their own stream (`-m slurm`) and every other test beside them (`-m "not slurm"`), so an
    unmarked one would start a second cluster there, or be counted as no Slurm test."""
    for item in items:
        uses_cluster = CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses_cluster and item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.slurm)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slurm" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _slurm_outcomes[report.outcome] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _slurm_outcomes and not _slurm_used:
        return
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(_slurm_outcomes.items()))
    used = _slurm_used or {"slurm_version": "no cluster", "slurm_user": "-", "root": "-"}
    terminalreporter.write_line(
        "slurm-guard: tests marked slurm against {slurm_version} (SlurmUser={slurm_user}, "
        "root {root}): ".format(**used)
        + (counts or "none ran")
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    record = os.environ.get(RECORD_ENV)
    if not record:
        return
    data = {
        **_slurm_used,
        "passed": _slurm_outcomes["passed"],
        "failed": _slurm_outcomes["failed"],
        "skipped": _slurm_outcomes["skipped"],
        "exitstatus": int(exitstatus),
    }
    tmp = Path(record).with_name(Path(record).name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(record)


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
        chroot = Path(os.environ[CHROOT_ENV]) if os.environ.get(CHROOT_ENV) else None
        missing = missing_binaries(accounting=True, chroot=chroot)
        if missing:
            script = "install_slurm.sh" if chroot is None else f"install_slurm_chroot.sh {chroot}"
            slurm_unavailable(
                f"Slurm not installed (missing {', '.join(missing)}); run .ci/{script}"
            )
        # Short base directory: Unix socket paths are limited to ~108 bytes.
        root = tmp_path_factory.mktemp("slurm")
        slurm_user = os.environ.get(USER_ENV, "root")
        if slurm_user != "root":
            _open_for(root, tmp_path_factory.getbasetemp().parent, 0o755)
        cluster = LocalCluster(
            root,
            nodes=4,
            port_base=find_free_port_base(4),
            chroot=chroot,
            slurm_user=slurm_user,
        )
        cluster.start()
        owned = True
    _slurm_used.update(_describe(cluster))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in cluster.env().items():
            mp.setenv(key, value)
        try:
            yield cluster
        finally:
            if owned:
                cluster.stop()


@pytest.fixture(autouse=True)
def _slurm_user_can_reach_tmp_path(request: pytest.FixtureRequest) -> None:
    """With a non-root SlurmUser, let it into the test's tmp_path, as a site's users must.

    pytest makes tmp_path mode 700 under mode-700 parents; a site's run directory is on a
    shared filesystem the controller (SlurmUser) can read. Only tmp_path itself is opened
    (sticky, world-writable: the epilog may write its log there); what slurm-guard creates
    inside keeps its own modes, so a file the controller cannot read still fails the test.
    """
    if request.node.get_closest_marker("slurm") is None or _session_slurm_user() == "root":
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    _open_for(tmp_path, factory.getbasetemp().parent, 0o1777)


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
