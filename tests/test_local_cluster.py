"""The throw-away local Slurm cluster itself: jobs land on the right nodes, accounting works,
two clusters coexist, and stop() leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from slurm_utils import wait_for
from support.local_cluster import (
    LocalCluster,
    find_free_port_base,
    main,
    missing_binaries,
)

pytestmark = pytest.mark.slurm


def run(cluster: LocalCluster, *argv: str) -> str:
    env = {**os.environ, **cluster.env()}
    return subprocess.run(
        list(argv), env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout


def job_state(cluster: LocalCluster, job_id: str) -> str:
    out = run(cluster, "scontrol", "show", "-o", "job", job_id)
    return out.split("JobState=", 1)[1].split()[0]


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


def test_epilog_slurmctld_runs_configured_command(tmp_path: Path) -> None:
    """A second cluster (no accounting: faster) coexists and runs the plugged-in epilog."""
    if missing_binaries(accounting=False):
        pytest.skip("Slurm not installed")
    marker = tmp_path / "epilog.out"
    epilog = ["/bin/sh", "-c", f'echo "$SLURM_JOB_ID $SLURM_CONF" >> {marker}']
    cluster = LocalCluster(
        tmp_path / "c2",
        nodes=2,
        port_base=find_free_port_base(2, accounting=False),
        accounting=False,
        epilog_command=epilog,
    )
    with cluster:
        assert cluster.is_running()
        job_id = run(cluster, "sbatch", "--parsable", "--wrap=true", "--output=/dev/null").strip()
        text = wait_for(lambda: marker.exists() and marker.read_text(), 30, "epilog output")
        assert text == f"{job_id} {cluster.conf_path}\n"
        assert cluster.epilog_path.read_text().startswith("#!/bin/sh")
    assert not cluster.is_running()


def test_two_clusters_coexist_and_stop_leaves_nothing(
    slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    root = tmp_path / "c3"
    port_base = find_free_port_base(2, accounting=False)
    # Through the CLI: start must leave the daemons running after it returns.
    assert (
        main(["start", str(root), "--nodes", "2", "--port-base", str(port_base), "--no-accounting"])
        == 0
    )
    second = LocalCluster.attach(root)
    try:
        assert second.port_base == port_base != slurm_cluster.port_base
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


def test_env_cli_prints_exports(
    slurm_cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["env", str(slurm_cluster.root)]) == 0
    out = capsys.readouterr().out
    assert f"export SLURM_CONF={slurm_cluster.conf_path}" in out
    assert "export PATH=" in out
