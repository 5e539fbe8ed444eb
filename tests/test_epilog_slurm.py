"""The EpilogSlurmctld on the real local cluster, for jobs found only through the runs root.

A job without the slurm-guard comment (launched by a site's own script) is found by searching
the runs root, which the epilog does only for jobs that failed. A guard stop under
`srun --kill-on-bad-exit=1` usually ends the job with 143 or a signal, not with 86, so every
failed end must count.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_utils import wait_for
from support.local_cluster import LocalCluster
from test_controller_slurm import (
    EPILOG_SCRIPT,
    JOB_SCRIPT,
    WRITE_ALARM,
    reasons,
    wait_finished,
    wait_running_without,
)

from slurm_guard.rundir.layout import RunDir
from slurm_guard.slurm.client import CommandSlurmClient

pytestmark = pytest.mark.slurm


@pytest.fixture
def cluster(idle_slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield idle_slurm_cluster
    idle_slurm_cluster.write_epilog(None)


@pytest.fixture
def client(cluster: LocalCluster) -> CommandSlurmClient:
    return CommandSlurmClient(env=cluster.env())


def install_epilog(cluster: LocalCluster, tmp_path: Path, runs_root: Path) -> Path:
    """The shipped epilog script, with a runs root and this test's state dir and log."""
    defaults, log = tmp_path / "defaults", tmp_path / "epilog.log"
    entry = Path(sys.prefix) / "bin" / "slurm-guard"
    defaults.write_text(
        f"SLURM_GUARD={shlex.quote(str(entry))}\n"
        f"SLURM_GUARD_STATE_DIR={shlex.quote(str(tmp_path / 'state'))}\n"
        f"SLURM_GUARD_RUNS_ROOT={shlex.quote(str(runs_root))}\n"
        f"SLURM_GUARD_LOG={shlex.quote(str(log))}\n"
    )
    # PYTHONPATH: the epilog runs this tree's slurm_guard, whatever the environment installed.
    repo = Path(__file__).resolve().parent.parent
    cluster.write_epilog(
        [
            "env",
            f"PYTHONPATH={repo}",
            f"SLURM_GUARD_DEFAULTS={defaults}",
            "bash",
            str(EPILOG_SCRIPT),
        ]
    )
    return log


def submit_without_comment(
    client: CommandSlurmClient, tmp_path: Path, run: Path, exit_code: int
) -> str:
    """A 3-node job whose first run writes an alarm on node2 and exits with `exit_code`."""
    RunDir(run).ensure()
    helper = tmp_path / "write_alarm.py"
    helper.write_text(WRITE_ALARM)
    write = shlex.join([sys.executable, str(helper), str(run), "$SLURM_JOB_ID", "node2"])
    write = write.replace("'$SLURM_JOB_ID'", '"$SLURM_JOB_ID"')
    script = tmp_path / "job.sh"
    script.write_text(
        JOB_SCRIPT.format(run=shlex.quote(str(run)), write_alarm=write, exit_code=exit_code)
    )
    return client.submit(
        script,
        ["--requeue", "--nodes=3", "--ntasks-per-node=1", f"--output={tmp_path}/slurm-%j.out"],
    )


@pytest.mark.parametrize("exit_code", [143, 1])
def test_epilog_searches_the_runs_root_for_any_failed_job(
    cluster: LocalCluster, client: CommandSlurmClient, tmp_path: Path, exit_code: int
) -> None:
    """Exit 143 is what a guard stop under --kill-on-bad-exit usually looks like."""
    runs_root = tmp_path / "runs"
    log = install_epilog(cluster, tmp_path, runs_root)
    job_id = submit_without_comment(client, tmp_path, runs_root / "team" / "run", exit_code)
    info = wait_running_without(client, job_id, "node2")
    assert info.restart_count == 1
    assert (reasons(client)["node2"] or "").startswith(f"slurm-guard: job {job_id}")
    text = log.read_text()
    assert f"from runs root {runs_root}" in text, text


def test_epilog_does_not_search_for_a_job_that_succeeded(
    cluster: LocalCluster, client: CommandSlurmClient, tmp_path: Path
) -> None:
    """The runs-root scan costs file reads on every job end: only failed jobs pay for it."""
    runs_root = tmp_path / "runs"
    log = install_epilog(cluster, tmp_path, runs_root)
    job_id = submit_without_comment(client, tmp_path, runs_root / "run", 0)
    wait_finished(client, job_id)

    def logged() -> str | None:
        text = log.read_text() if log.exists() else ""
        return text if "not a slurm-guard run" in text else None

    text = wait_for(logged, 20, "the epilog's log line")
    assert f"job {job_id}: not a slurm-guard run" in text
    assert not (reasons(client).get("node2") or "").startswith("slurm-guard:")
