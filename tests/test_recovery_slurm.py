"""Recoveries that never lose a job, on the real local cluster (issue 42, findings 7-11).

* A faulty spare is drained: faults on node2 and on node4 (the first spare) from step 17; the
  triage of the second alarm reproduces the fault on node4, so node4 is convicted although the
  same check fails at the same step again (the loop rule holds a job only when the evidence
  names no node). The in-job restart's row in `status` names what the guard really resumed
  from (snapshot 15, not checkpoint 10).
* A supervisor SIGKILLed while it restarts the step: the epilog finds the restart planned and
  never run, and completes the decision with a requeue without the convicted node, once.
* A job waiting for approval is held in Slurm, outlives MinJobAge, and resumes when approved.
* The restart budget counts the run directory across job ids, until an admin resets it.
"""

from __future__ import annotations

import json
import os
import pwd
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import CHROOT_ENV, USER_ENV, _open_for
from support.local_cluster import LocalCluster, find_free_port_base
from test_controller_unit import make_alarm
from test_epilog_slurm import install_epilog
from test_in_job_slurm import ENDED, FAULT, logs, status_json, submit, wait_ended

from slurm_guard.cli import main
from slurm_guard.controller.engine import Engine
from slurm_guard.controller.in_job import Allocation
from slurm_guard.controller.policy import Policy
from slurm_guard.controller.state import StateStore
from slurm_guard.examples.train import read_result
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.rundir.layout import RunDir
from slurm_guard.slurm.client import CommandSlurmClient
from slurm_guard.slurm.polling import poll

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def ours(client: CommandSlurmClient, node: str) -> bool:
    return (client.node(node).reason or "").startswith(REASON_PREFIX)


def test_a_faulty_spare_is_drained_and_status_names_the_real_resume_point(
    idle_slurm_cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Findings 7 and 9: the docs' settings with snapshots, faults on node2 and node4."""
    monkeypatch.setenv("SLURM_GUARD_SNAPSHOT_DIR", str(tmp_path / "shm" / "{node}"))
    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    run_dir, state = tmp_path / "run", tmp_path / "state"
    spare = FAULT.replace("node=node2", "node=node4")
    job = submit(run_dir, state, f"{FAULT};{spare}", extra=("--snapshots", "--trust-replays", "1"))

    def requeued() -> Any:  # without node4 (node2, drained, is out of service anyway)
        i = client.job(job)
        done = i is not None and i.restart_count >= 1 and i.state == "PENDING"
        return i if done and "node4" in i.excluded_nodes else None

    def held() -> Any:
        i = client.job(job)
        return i if i is not None and i.held and i.state == "PENDING" else None

    try:
        poll(lambda: requeued() or held(), 300, f"job {job} requeued or held")
    except TimeoutError:
        pytest.fail(f"job {job} neither requeued nor held\n{logs(run_dir)}")
    info = client.job(job)
    assert info is not None
    journal = StateStore(state).read()
    decisions = [(e["suspect_nodes"], e["outcome"]) for e in journal.alarms.values()]
    assert decisions == [(["node2"], "act"), (["node4"], "act")], journal.alarms
    assert ours(client, "node2") and ours(client, "node4"), "the faulty spare stays in service"
    assert not info.held and "node4" in info.excluded_nodes, info.fields
    # the restart on the spare ran, from what the guard recorded: snapshot 15, not checkpoint 10
    (row,) = status_json(job, state)["in_job_restarts"]
    assert row["state"] == "done" and row["joined"] == ["node4"], row
    assert (row["resume_source"], row["resume_step"]) == ("snapshot", 15), row
    assert row["planned_resume_step"] == 15 and row["seconds"] is not None
    (done,) = [e for e in journal.entries if e["type"] == "restart_done"]
    assert (done["resume_source"], done["resume_step"]) == ("snapshot", 15)
    text = CliRunner().invoke(main, ["status", str(run_dir), "--state-dir", str(state)]).output
    assert "step 15 (snapshot)" in text and "step 10 (checkpoint)" not in text, text
    client.run(["scancel", job])
    wait_ended(client, job, run_dir, 60)


@pytest.fixture
def epilog_state(idle_slurm_cluster: LocalCluster, tmp_path: Path) -> Iterator[Path]:
    """The shipped EpilogSlurmctld with a state dir the job (root) and SlurmUser both write."""
    state = tmp_path / "state"
    (state / "pending").mkdir(parents=True)
    (state / "journal.jsonl").touch()
    (state / "lock").touch()
    user = pwd.getpwnam(idle_slurm_cluster.slurm_user)
    for path in (state, state / "pending", state / "journal.jsonl", state / "lock"):
        os.chown(path, user.pw_uid, user.pw_gid)
    install_epilog(idle_slurm_cluster, tmp_path, tmp_path / "runs")
    yield state
    idle_slurm_cluster.write_epilog(None)


def test_a_supervisor_killed_while_it_restarts_the_step_is_requeued_by_the_epilog(
    idle_slurm_cluster: LocalCluster, epilog_state: Path, tmp_path: Path
) -> None:
    """Finding 8: SIGKILL to the batch step (the supervisor) right after the restart is
    journaled, before the restarted step can run a step; the epilog completes the decision."""
    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    run_dir, state = tmp_path / "runs" / "run", epilog_state
    job = submit(run_dir, state, FAULT)
    store = StateStore(state)
    poll(lambda: store.read().in_job_restarts, 240, "the in-job restart")
    client.run(["scancel", "--batch", "--signal=KILL", job])
    info = wait_ended(client, job, run_dir, 400)
    assert info.state == "COMPLETED", logs(run_dir)
    fields = dict(info.fields)
    assert fields["Restarts"] == "1" and "node2" in info.excluded_nodes, fields
    result = read_result(run_dir)
    assert result is not None and result["final_step"] == 30, logs(run_dir)
    assert "node2" not in result["nodes"] and result["restart_count"] == 1
    journal = store.read()
    (failed,) = [e for e in journal.entries if e["type"] == "restart_failed"]
    requeues = [p for p in journal.plans.values() if any(a.op == "release" for a in p.actions)]
    assert [p.plan_id for p in requeues] == [failed["completed_by"]], journal.entries
    (row,) = status_json(job, state)["in_job_restarts"]
    assert row["state"] == "failed" and row["seconds"] is None and row["resume_step"] is None
    # the resumed requeue is the run's real resume point
    records = status_json(str(run_dir), state)["resumed_from"]
    assert [(r["restart_count"], r["source"], r["step"]) for r in records][-1] == (
        1,
        "checkpoint",
        10,
    )


@pytest.fixture
def quick_purge_cluster(
    slurm_cluster: LocalCluster,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[LocalCluster]:
    """A second cluster (same Slurm as the session's) whose MinJobAge is 5 s."""
    root = tmp_path_factory.mktemp("purge")
    user = os.environ.get(USER_ENV, "root")
    if user != "root":
        _open_for(root, tmp_path_factory.getbasetemp().parent, 0o755)
    chroot = os.environ.get(CHROOT_ENV)
    cluster = LocalCluster(
        root,
        nodes=4,
        port_base=find_free_port_base(4, accounting=False),
        accounting=False,
        chroot=Path(chroot) if chroot else None,
        slurm_user=user,
        min_job_age=5,
        first_job_id=random.randrange(10_000, 60_000),  # not the session cluster's job ids
    )
    cluster.start()
    try:
        for key, value in cluster.env().items():
            monkeypatch.setenv(key, value)
        yield cluster
    finally:
        cluster.stop()


def test_a_job_waiting_for_approval_is_held_past_min_job_age_and_resumes_when_approved(
    quick_purge_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Finding 10: policy `approve`; the in-job `recover` holds the job in Slurm."""
    client = CommandSlurmClient(env=quick_purge_cluster.env())
    run_dir, state = tmp_path / "run", tmp_path / "state"
    state.mkdir()
    (state / "policy.json").write_text(json.dumps({"mode": "approve"}))
    job = submit(run_dir, state, FAULT, spares=0)

    def held() -> Any:
        i = client.job(job)
        return i if i is not None and i.held and i.state == "PENDING" else None

    def gone(job_id: str) -> bool:
        return client.job(job_id) is None

    def ended() -> bool:
        i = client.job(job)
        return i is None or i.state in ENDED

    try:
        poll(lambda: held() or ended(), 300, f"job {job} held or ended")
    except TimeoutError:
        pytest.fail(f"job {job} neither held nor ended\n{logs(run_dir)}")
    assert held() is not None, f"job {job} not held: {client.job(job)}\n{logs(run_dir)}"
    true = tmp_path / "true.sh"
    true.write_text("#!/bin/bash\ntrue\n")
    marker = client.submit(true, ["--nodes=1", f"--output={tmp_path}/true-%j"])
    poll(lambda: gone(marker), 240, "a finished job purged after MinJobAge")
    assert held() is not None, "the held job was purged with the finished one"
    assert not any(ours(client, n) for n in ("node1", "node2", "node3", "node4"))
    (alarm_id,) = StateStore(state).read().alarms
    approve = CliRunner().invoke(
        main, ["review", "approve", alarm_id, "--reason", "test", "--state-dir", str(state)]
    )
    assert approve.exit_code == 0, approve.output
    info = wait_ended(client, job, run_dir, 300)
    assert info.state == "COMPLETED" and "node2" in info.excluded_nodes, logs(run_dir)
    assert ours(client, "node2")
    result = read_result(run_dir)
    assert result is not None and result["final_step"] == 30 and result["resumed_from"] == 10


def test_the_restart_budget_counts_the_run_across_job_ids_until_reset(
    idle_slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Finding 11: restart_budget 1; job A restarts on its spare, job B (resubmitted on the
    same run directory) is held for the spent budget; after `review reset-budget` job C's
    alarm restarts it again. Real jobs, the real engine, alarm files written as the guard does."""
    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    store = StateStore(tmp_path / "state")
    store.ensure()
    Policy(restart_budget=1).save(store.root)
    run = tmp_path / "run"
    RunDir(run).ensure()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsleep 120\n")

    def running_job(nodes: tuple[str, ...]) -> str:
        job = client.submit(
            script,
            [
                f"--nodes={len(nodes)}",
                f"--nodelist={','.join(nodes)}",
                "--requeue",
                f"--output={tmp_path}/o-%j",
                f"--comment=slurm-guard:run_dir={run}",
            ],
        )
        poll(lambda: (i := client.job(job)) is not None and i.state == "RUNNING", 30, "running")
        return job

    def alarm_on(job: str, name: str, node: str, step: int, nodes: tuple[str, ...]) -> Any:
        RunDir(run).write_alarm(make_alarm(job, name, "sdc", (node,), step=step))
        view = Allocation(nodes, nodes[:-1], len(nodes) - 1, 1)
        return Engine(client, store).process_job(job, run, in_job=True, spares=view)

    a = running_job(("node1", "node2", "node3", "node4"))
    first = alarm_on(a, "a1", "node2", 20, ("node1", "node2", "node3", "node4"))
    assert first.in_job is not None and first.in_job.restart_on == ("node1", "node3", "node4")
    client.run(["scancel", a])
    b = running_job(("node1", "node3", "node4"))
    second = alarm_on(b, "b1", "node3", 40, ("node1", "node3", "node4"))
    assert second.in_job is None and "restart budget spent" in second.held, second.lines()

    def held_b() -> Any:
        i = client.job(b)
        return i if i is not None and i.held and i.state == "PENDING" else None

    poll(held_b, 30, f"job {b} held")
    assert ours(client, "node3")  # the evidence stands: the node is drained, the job held
    client.run(["scancel", b])
    reset = CliRunner().invoke(
        main,
        [
            "review",
            "reset-budget",
            str(run),
            "--reason",
            "data fixed",
            "--state-dir",
            str(store.root),
        ],
    )
    assert reset.exit_code == 0 and "was 1 used" in reset.output, reset.output
    c = running_job(("node1", "node4"))
    third = alarm_on(c, "c1", "node1", 60, ("node1", "node4"))
    assert third.in_job is not None and third.in_job.restart_on == ("node4",), third.lines()
    client.run(["scancel", c])
    wait_ended(client, c, run, 30)
