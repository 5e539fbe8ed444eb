"""Launch on the real local Slurm cluster: node lists expand as scontrol expands them, a
3-node step asks Slurm for the rendezvous address once (rank 0), not once per task, and the
sbatch template's job ends soon after a rank fails, not at the guard's watchdog."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from slurm_utils import wait_for
from support.local_cluster import LocalCluster

from slurm_guard.cli import main
from slurm_guard.slurm.client import CommandSlurmClient
from slurm_guard.slurm.parsers import expand_hostlist
from slurm_guard.slurm.task import RUN_DIR_ENV

TESTS = Path(__file__).resolve().parent
FORMS = json.loads((TESTS / "data" / "hostnames_forms.json").read_text())["expansions"]


@pytest.mark.slurm
def test_expand_hostlist_agrees_with_this_clusters_scontrol(
    slurm_client: CommandSlurmClient,
) -> None:
    """The recorded forms, re-asked of the running Slurm (whatever its version)."""
    for expr in FORMS:
        assert expand_hostlist(expr) == slurm_client.expand_hostlist(expr), expr


@pytest.mark.slurm
def test_a_three_node_step_asks_slurm_once_for_the_rendezvous(
    idle_slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.sh"
    task = [sys.executable, str(TESTS / "launch_task.py"), str(out)]
    script.write_text(
        "#!/bin/bash\n"
        f"export {RUN_DIR_ENV}={shlex.quote(str(run_dir))}\n"
        f"export PYTHONPATH={shlex.quote(str(TESTS))}\n"
        f"srun --kill-on-bad-exit=1 {shlex.join(task)}\n"
    )
    env = {**os.environ, **idle_slurm_cluster.env()}
    job_id = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=3",
            "--ntasks-per-node=1",
            "--time=5",
            f"--output={tmp_path / 'slurm.out'}",
            str(script),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    client = CommandSlurmClient(env=idle_slurm_cluster.env())

    def finished() -> str | None:
        info = client.job(job_id)
        state = info.state if info is not None else "GONE"
        return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE") else None

    state = wait_for(finished, 180, f"job {job_id} to finish")
    log = (tmp_path / "slurm.out").read_text() if (tmp_path / "slurm.out").exists() else ""
    assert state == "COMPLETED", log
    results = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank-*.json"))}
    assert sorted(results) == [0, 1, 2], log
    first = client.node("node1").address
    for rank, r in results.items():
        assert r["world"] == 3 and r["master_addr"] == first
        # rank 0: one `scontrol show -o node node1`; the others: no Slurm command at all
        expected = [["scontrol", "show", "-o", "node", "node1"]] if rank == 0 else []
        assert r["commands"] == expected, (rank, r["commands"])
    records = list((run_dir / ".rendezvous").glob(f"{job_id}.*.0.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["address"] == first


@pytest.mark.slurm
def test_a_rank_that_raises_ends_the_template_s_job_soon_not_at_the_watchdog(
    idle_slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    # rank 1 raises at step 3; ranks 0 and 2 would wait in the step's all-reduce until the
    # guard's watchdog (300 s) names it, and end about 330 s after it. srun's
    # --kill-on-bad-exit ends the step when rank 1 exits: the job must end well before that.
    run_dir = tmp_path / "run"
    train = [sys.executable, str(TESTS / "local_train.py"), str(run_dir), "6", "1", "raise-at-3"]
    args = ["submit", "--run-dir", str(run_dir), "--nodes", "3", "--state-dir"]
    args += [str(tmp_path / "state"), "--sbatch", "time=10", "--", *train, "300"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    job_id = result.output.split()[0]
    began = time.monotonic()
    client = CommandSlurmClient(env=idle_slurm_cluster.env())

    def ended() -> tuple[str, str] | None:
        info = client.job(job_id)
        if info is None or info.state in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            return None
        return info.state, dict(info.fields).get("ExitCode", "")

    state, exit_code = wait_for(ended, 200, f"job {job_id} to end (before the watchdog)")
    print(f"job {job_id} ended {time.monotonic() - began:.1f} s after submission: {exit_code}")
    log = "\n".join(p.read_text(errors="replace") for p in run_dir.glob("slurm-*.out"))
    assert state == "FAILED", log[-3000:]
    # srun returns the highest code of any task: the others' SIGTERM (143), not rank 1's 1;
    # srun's log names rank 1 and its code, and `recover` runs on any non-zero status
    assert exit_code not in ("", "0:0"), log[-3000:]
    assert "task 1: Exited with exit code 1" in log, log[-3000:]
    assert "RuntimeError: rank 1: the user's code failed at step 3" in log
    assert "RanksMissing" not in log, log[-3000:]
