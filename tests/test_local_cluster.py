"""The throw-away local Slurm cluster itself: jobs land on the right nodes, accounting works,
two clusters coexist, and stop() leaves nothing behind; a cluster run from a Slurm root (24.11)
gives jobs and clients that root's version, and the EpilogSlurmctld runs as SlurmUser.

Extra clusters started here have the session cluster's version and SlurmUser, so the run
against each version tests that version's cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_utils import wait_for
from support.local_cluster import (
    REPO_ROOT,
    WRAPPER_MARKER,
    LocalCluster,
    _outermost,
    find_free_port_base,
    main,
    python_binds,
)


def run(cluster: LocalCluster, *argv: str) -> str:
    env = {**os.environ, **cluster.env()}
    return subprocess.run(
        list(argv), env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout


def job_state(cluster: LocalCluster, job_id: str) -> str:
    out = run(cluster, "scontrol", "show", "-o", "job", job_id)
    return out.split("JobState=", 1)[1].split()[0]


def covered(path: Path, binds: list[str]) -> bool:
    return any(path == Path(b) or Path(b) in path.parents for b in binds)


def test_python_binds_cover_the_interpreter_and_the_project() -> None:
    binds = python_binds()
    for path in (Path(sys.executable), Path(sys.prefix), REPO_ROOT):
        assert covered(path.resolve(), [*binds, "/tmp"]), (path, binds)
    # Never over the root's own programs and libraries.
    assert not {"/", "/usr", "/usr/lib", "/etc", "/root"} & set(binds)


def test_python_binds_cover_editable_installs() -> None:
    """setuptools' editable finder maps packages to a project that is not on sys.path."""
    binds = python_binds()
    for name, module in sys.modules.items():
        mapping = getattr(module, "MAPPING", None) if name.startswith("__editable__") else None
        for package_dir in (mapping or {}).values():
            assert covered(Path(package_dir).resolve(), [*binds, "/tmp"]), (package_dir, binds)


def test_outermost_keeps_only_the_outer_paths() -> None:
    paths = [Path("/a/b/c"), Path("/a/b"), Path("/x/y"), Path("/tmp/z"), Path("/a/bc")]
    assert _outermost(paths, [Path("/tmp")]) == ["/a/b", "/a/bc", "/x/y"]


def test_env_path_has_only_this_clusters_wrappers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client of another cluster's version first on PATH would talk to the wrong version."""
    other = tmp_path / "other-bin"
    other.mkdir()
    (other / WRAPPER_MARKER).write_text("/elsewhere\n")
    monkeypatch.setenv("PATH", f"{other}:/usr/bin:/bin")
    host = LocalCluster(tmp_path / "h", nodes=1, accounting=False)
    assert str(other) not in host.env()["PATH"].split(os.pathsep)
    rooted = LocalCluster(tmp_path / "r", nodes=1, accounting=False, chroot=tmp_path / "root")
    parts = rooted.env()["PATH"].split(os.pathsep)
    assert parts[0] == str(rooted.bin_dir)
    assert str(other) not in parts


def like_session(slurm_cluster: LocalCluster, root: Path, nodes: int) -> LocalCluster:
    """A second cluster with the session cluster's Slurm (root) and SlurmUser, no accounting."""
    return LocalCluster(
        root,
        nodes=nodes,
        port_base=find_free_port_base(nodes, accounting=False),
        accounting=False,
        chroot=slurm_cluster.chroot,
        slurm_user=slurm_cluster.slurm_user,
    )


@pytest.mark.slurm
def test_three_node_job_runs_on_node1_to_3(
    idle_slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\nsrun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME $SLURM_NODEID'\n"
    )
    job_id = run(
        idle_slurm_cluster,
        "sbatch",
        "--parsable",
        "--nodes=3",
        "--ntasks-per-node=1",
        f"--output={out}",
        str(script),
    ).strip()
    wait_for(lambda: job_state(idle_slurm_cluster, job_id) == "COMPLETED", 30, f"job {job_id}")
    lines = sorted(out.read_text().split("\n"))
    assert [line for line in lines if line] == ["0 node1 0", "1 node2 1", "2 node3 2"]

    # Accounting: sacct (what submitit uses) knows the job and its final state. Records reach
    # slurmdbd asynchronously: for a second or two sacct shows the job as COMPLETED on node1
    # only, so poll for the final record.
    seen: list[str] = []

    def sacct_record() -> bool:
        out = run(
            idle_slurm_cluster, "sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,NodeList"
        ).strip()
        seen.append(out)
        return out == "COMPLETED|node[1-3]"

    wait_for(sacct_record, 30, f"sacct to record the job (seen: {seen})")


@pytest.mark.slurm
def test_jobs_and_clients_use_the_clusters_own_slurm(
    idle_slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Client, controller and the clients a job calls all have one version."""
    cluster = idle_slurm_cluster
    version = cluster.slurm_version()  # "slurm 22.05.8" / "slurm-wlm 24.11.5"
    config = run(cluster, "scontrol", "show", "config")
    ctld = [
        line.split("=", 1)[1].strip() for line in config.splitlines() if "SLURM_VERSION" in line
    ]
    assert ctld == [version.split()[-1]]
    out = tmp_path / "out.txt"
    job_id = run(
        cluster, "sbatch", "--parsable", f"--output={out}", "--wrap=sinfo --version"
    ).strip()
    wait_for(lambda: job_state(cluster, job_id) == "COMPLETED", 30, f"job {job_id}")
    assert out.read_text().strip() == version
    if cluster.chroot is not None:
        assert run(cluster, "sh", "-c", "command -v sbatch").strip() == str(
            cluster.bin_dir / "sbatch"
        )


@pytest.mark.slurm
def test_epilog_slurmctld_runs_configured_command_as_slurm_user(
    slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    """A second cluster (no accounting: faster) coexists and runs the plugged-in epilog,
    as SlurmUser (a site's controller is not root)."""
    marker = tmp_path / "epilog.out"
    epilog = ["/bin/sh", "-c", f'echo "$SLURM_JOB_ID $SLURM_CONF $(id -un)" >> {marker}']
    cluster = like_session(slurm_cluster, tmp_path / "c2", nodes=2)
    cluster.epilog_command = tuple(epilog)
    with cluster:
        assert cluster.is_running()
        job_id = run(cluster, "sbatch", "--parsable", "--wrap=true", "--output=/dev/null").strip()
        text = wait_for(lambda: marker.exists() and marker.read_text(), 30, "epilog output")
        assert text == f"{job_id} {cluster.conf_path} {cluster.slurm_user}\n"
        assert cluster.epilog_path.read_text().startswith("#!/bin/sh")
    assert not cluster.is_running()


@pytest.mark.slurm
def test_two_clusters_coexist_and_stop_leaves_nothing(
    slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    root = tmp_path / "c3"
    port_base = find_free_port_base(2, accounting=False)
    # Through the CLI: start must leave the daemons running after it returns.
    argv = ["start", str(root), "--nodes", "2", "--port-base", str(port_base), "--no-accounting"]
    if slurm_cluster.chroot is not None:
        argv += ["--chroot", str(slurm_cluster.chroot)]
    argv += ["--slurm-user", slurm_cluster.slurm_user]
    assert main(argv) == 0
    second = LocalCluster.attach(root)
    try:
        assert second.port_base == port_base != slurm_cluster.port_base
        assert (second.chroot, second.slurm_user) == (
            slurm_cluster.chroot,
            slurm_cluster.slurm_user,
        )
        assert sorted(second.node_states()) == ["node1", "node2"]
        assert set(slurm_cluster.node_states()) == {"node1", "node2", "node3", "node4"}
        job_id = run(second, "sbatch", "--parsable", "--wrap=sleep 300", "--output=/dev/null")
        wait_for(lambda: job_state(second, job_id.strip()) == "RUNNING", 30, "job running")
        assert second.running_pids()
    finally:
        assert main(["stop", str(root)]) == 0
    assert second.running_pids() == []  # includes slurmstepd and the job's sleep
    assert not second.is_running()
    assert main(["stop", str(root)]) == 0  # stopping twice is fine
    second.stop()
    # The first cluster did not notice.
    assert set(slurm_cluster.node_states().values()) <= {"idle", "mix", "alloc"}


@pytest.mark.slurm
def test_env_cli_prints_exports(
    slurm_cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["env", str(slurm_cluster.root)]) == 0
    out = capsys.readouterr().out
    assert f"export SLURM_CONF={slurm_cluster.conf_path}" in out
    assert "export PATH=" in out
    if slurm_cluster.chroot is not None:
        assert f"export PATH={slurm_cluster.bin_dir}:" in out
