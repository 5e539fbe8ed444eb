"""The controller against the real local Slurm cluster: drain, requeue, and every safety rule.

Each safety test is built so that it fails if its rule is removed: the alarm is otherwise
valid, so without the rule the controller would drain node2 / requeue the job.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from slurm_utils import wait_for
from support.local_cluster import LocalCluster
from test_controller_unit import make_alarm

from slurm_guard.cli import main
from slurm_guard.controller.engine import Engine
from slurm_guard.controller.policy import Policy
from slurm_guard.controller.state import StateStore
from slurm_guard.errors import EXIT_SDC
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import Alarm
from slurm_guard.slurm.client import CommandSlurmClient, JobInfo

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
EPILOG_SCRIPT = REPO / "epilog" / "slurm-guard-epilog.sh"
FINISHED = {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED"}

# First run: (optionally) write the alarm, note the end time, exit with the guard's code.
# Rerun: note the start time and the nodes, then stay running until the test cancels it.
JOB_SCRIPT = """#!/bin/bash
RUN={run}
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
    {write_alarm}
    date +%s.%N > "$RUN/end-0"
    exit {exit_code}
fi
echo "$SLURM_JOB_NODELIST" > "$RUN/nodes-$SLURM_RESTART_COUNT"
date +%s.%N > "$RUN/start-$SLURM_RESTART_COUNT"
sleep 120
"""

WRITE_ALARM = """
import sys, time
from slurm_guard.rundir.records import Alarm
from slurm_guard.rundir.layout import RunDir
run, job, node = sys.argv[1:4]
rd = RunDir(run); rd.ensure()
rd.write_alarm(Alarm(alarm_id="a-" + job, job_id=job, restart_count=0, step=340, check="replay",
    verdict="sdc", suspect_ranks=(1,), suspect_nodes=(node,), suspect_hosts=("localhost",),
    last_verified_step=330, trusted_checkpoint=None, update_applied=False,
    evidence={"loss_owner": 2.25, "loss_replay": 2.5}, message="replay mismatch on node2",
    world_size=3))
"""


@pytest.fixture
def cluster(idle_slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield idle_slurm_cluster
    idle_slurm_cluster.write_epilog(None)


@pytest.fixture
def client(cluster: LocalCluster) -> CommandSlurmClient:
    return CommandSlurmClient(env=cluster.env())


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    s = StateStore(tmp_path / "state")
    s.ensure()
    return s


def submit(
    client: CommandSlurmClient,
    tmp_path: Path,
    *,
    alarm_in_job: bool = False,
    exit_code: int = EXIT_SDC,
    layout: tuple[str, ...] = ("--ntasks-per-node=1",),
) -> tuple[str, Path]:
    run = tmp_path / "run"
    RunDir(run).ensure()
    write = ":"
    if alarm_in_job:
        helper = tmp_path / "write_alarm.py"
        helper.write_text(WRITE_ALARM)
        write = shlex.join([sys.executable, str(helper), str(run), "$SLURM_JOB_ID", "node2"])
        write = write.replace("'$SLURM_JOB_ID'", '"$SLURM_JOB_ID"')
    script = tmp_path / "job.sh"
    script.write_text(
        JOB_SCRIPT.format(run=shlex.quote(str(run)), write_alarm=write, exit_code=exit_code)
    )
    job_id = client.submit(
        script,
        [
            "--requeue",
            "--nodes=3",
            *layout,
            f"--output={tmp_path}/slurm-%j.out",
            f"--comment=slurm-guard:run_dir={run}",
        ],
    )
    return job_id, run


def wait_finished(client: CommandSlurmClient, job_id: str) -> JobInfo:
    def finished() -> JobInfo | None:
        info = client.job(job_id)
        return info if info is not None and info.state in FINISHED else None

    return wait_for(finished, 20, f"job {job_id} to end")


def alarm(
    job_id: str, *, node: str = "node2", verdict: str = "sdc", alarm_id: str = "a1", **kw: Any
) -> Alarm:
    """One suspect node, with evidence that `review` must show back."""
    kw.setdefault("evidence", {"loss_owner": 2.25, "loss_replay": 2.5})
    return make_alarm(job_id, alarm_id, verdict, (node,), **kw)


def finished_job_with_alarm(
    client: CommandSlurmClient,
    tmp_path: Path,
    layout: tuple[str, ...] = ("--ntasks-per-node=1",),
    **kw: Any,
) -> tuple[str, Path]:
    """A 3-node job that exited 86, and its alarm (written after the end: no epilog runs)."""
    job_id, run = submit(client, tmp_path, layout=layout)
    wait_finished(client, job_id)
    RunDir(run).write_alarm(alarm(job_id, **kw))
    return job_id, run


def reasons(client: CommandSlurmClient) -> dict[str, str | None]:
    return {n.name: n.reason for n in client.nodes() if n.reason}


def assert_untouched(client: CommandSlurmClient, job_id: str) -> None:
    info = client.job(job_id)
    assert info is not None
    assert info.restart_count == 0 and info.state in FINISHED and not info.held
    assert not any((r or "").startswith("slurm-guard:") for r in reasons(client).values())


def assert_held_without_drains(client: CommandSlurmClient, job_id: str) -> None:
    """Waiting for approval: the job is held in Slurm (it outlives MinJobAge), nothing drained."""
    info = client.job(job_id)
    assert info is not None and info.held and info.state == "PENDING", info
    assert not any((r or "").startswith("slurm-guard:") for r in reasons(client).values())


def wait_running_without(client: CommandSlurmClient, job_id: str, node: str) -> JobInfo:
    def rerunning() -> JobInfo | None:
        info = client.job(job_id)
        if info is not None and info.state == "RUNNING" and info.restart_count >= 1:
            return info
        return None

    info = wait_for(rerunning, 20, f"job {job_id} running again")
    assert node not in info.nodes and node in info.excluded_nodes
    assert info.restart_count == 1
    return info


def cli(client: CommandSlurmClient, *args: str, env: dict[str, str] | None = None) -> Any:
    result = CliRunner().invoke(main, list(args), obj={"slurm_client": client}, env=env)
    return result


# --------------------------------------------------------------------------- the whole loop


def test_epilog_drains_requeues_and_restarts_without_the_node(
    cluster: LocalCluster, client: CommandSlurmClient, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    defaults = tmp_path / "defaults"
    log = tmp_path / "epilog.log"
    entry = Path(sys.prefix) / "bin" / "slurm-guard"
    defaults.write_text(
        f"SLURM_GUARD={shlex.quote(str(entry))}\nSLURM_GUARD_STATE_DIR={shlex.quote(str(state))}\n"
        f"SLURM_GUARD_LOG={shlex.quote(str(log))}\n"
    )
    cluster.write_epilog(["env", f"SLURM_GUARD_DEFAULTS={defaults}", "bash", str(EPILOG_SCRIPT)])
    job_id, run = submit(client, tmp_path, alarm_in_job=True)

    info = wait_running_without(client, job_id, "node2")
    # RUNNING comes before the rerun's script has written its start time: wait for the file.
    start_file = run / "start-1"
    started = wait_for(
        lambda: start_file.is_file() and start_file.read_text().strip(), 60, "the rerun's start"
    )
    gap = float(started) - float((run / "end-0").read_text())
    assert gap < 15, f"rerun started {gap:.1f} s after the first run ended"
    assert (run / "nodes-1").read_text().strip() != ""

    reason = reasons(client)["node2"]
    assert reason is not None
    assert reason.startswith("slurm-guard:")
    for part in (f"job {job_id}", "step 340", "check replay", f"alarm a-{job_id}"):
        assert part in reason
    sinfo = subprocess.run(
        ["sinfo", "-R", "-h", "-o", "%N|%E"],
        env={**os.environ, **cluster.env()},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"node2|slurm-guard: job {job_id}" in sinfo

    status = cli(client, "status", job_id, "--state-dir", str(state), "--json")
    assert status.exit_code == 0, status.output
    view = json.loads(status.output)
    assert view["alarms"][0]["decision"] == "act"
    assert view["job"]["state"] == "RUNNING" and "node2" in view["job"]["excluded_nodes"]
    done = {a["op"] for a in view["controller_actions"] if a["result"] == "done"}
    assert done == {"drain", "requeue_hold", "exclude", "release", "start"}
    table = cli(client, "status", job_id, "--state-dir", str(state))
    assert f"a-{job_id}" in table.output and "RUNNING" in table.output

    review = cli(client, "review", "--state-dir", str(state), "--json")
    nodes = json.loads(review.output)["nodes"]
    assert [n["node"] for n in nodes] == ["node2"] and nodes[0]["jobs"] == [job_id]
    assert nodes[0]["alarms"][0]["evidence"]["loss_replay"] == 2.5
    assert info.restart_count == 1
    assert "run dir" in log.read_text()


# --------------------------------------------------------------------------- safety rules


def test_alarm_for_a_job_that_does_not_exist_is_rejected(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    RunDir(run).ensure()
    RunDir(run).write_alarm(alarm("999999"))
    report = Engine(client, store, Policy()).process_job("999999", run)
    assert "does not exist" in report.decisions["a1"][1]
    assert reasons(client) == {}


def test_suspect_node_outside_the_allocation_is_rejected(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path, node="node4")
    report = Engine(client, store, Policy()).process_job(job_id, run)
    assert report.decisions["a1"][0] == "rejected"
    assert "not in job" in report.decisions["a1"][1]
    assert_untouched(client, job_id)


def test_alarm_file_of_another_user_is_rejected(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path)
    os.chown(RunDir(run).alarm_path("a1"), 65534, 65534)
    report = Engine(client, store, Policy()).process_job(job_id, run)
    assert "owned by uid 65534" in report.decisions["a1"][1]
    assert_untouched(client, job_id)


def test_node_drained_by_someone_else_is_never_changed(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path)
    client.drain("node2", "memory errors, ticket 77")
    Engine(client, store, Policy()).process_job(job_id, run)
    assert reasons(client)["node2"] == "memory errors, ticket 77"
    wait_running_without(client, job_id, "node2")  # still kept away from the job
    result = cli(
        client, "review", "--state-dir", str(store.root), "return", "node2", "--reason", "fine now"
    )
    assert result.exit_code == 1 and "not set by slurm-guard" in result.output
    assert client.node("node2").drained
    assert reasons(client)["node2"] == "memory errors, ticket 77"


def test_circuit_breaker_stops_draining_and_holds_until_approved(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path)
    report = Engine(client, store, Policy(max_drains=0)).process_job(job_id, run)
    assert "circuit breaker" in report.decisions["a1"][1]
    assert_held_without_drains(client, job_id)
    review = json.loads(cli(client, "review", "--state-dir", str(store.root), "--json").output)
    assert [w["alarm_id"] for w in review["awaiting_approval"]] == ["a1"]


def test_policy_approve_holds_the_job_until_review_approve(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    Policy(mode="approve").save(store.root)
    job_id, run = finished_job_with_alarm(client, tmp_path)
    Engine(client, store).process_job(job_id, run)
    assert_held_without_drains(client, job_id)
    dry = cli(
        client,
        "review",
        "--state-dir",
        str(store.root),
        "approve",
        "a1",
        "--reason",
        "ok",
        "--dry-run",
    )
    assert dry.exit_code == 0, dry.output
    assert_held_without_drains(client, job_id)
    result = cli(
        client,
        "review",
        "--state-dir",
        str(store.root),
        "approve",
        "a1",
        "--reason",
        "replay evidence is clear",
    )
    assert result.exit_code == 0, result.output
    assert (reasons(client)["node2"] or "").startswith("slurm-guard:")
    wait_running_without(client, job_id, "node2")
    back = cli(
        client, "review", "--state-dir", str(store.root), "retire", "node2", "--reason", "RMA 1234"
    )
    assert back.exit_code == 0, back.output
    assert client.node("node2").failed


def test_engine_and_watcher_at_once_act_once(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path)
    engines = [Engine(client, store, Policy()) for _ in range(3)]
    threads = [threading.Thread(target=e.process_job, args=(job_id, run)) for e in engines]
    env = {**os.environ, "SLURM_GUARD_STATE_DIR": str(store.root)}
    watcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from slurm_guard.cli import main; main()",
            "controller",
            "--runs-root",
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert watcher.wait(timeout=60) == 0
    wait_running_without(client, job_id, "node2")
    Engine(client, store, Policy()).process_job(job_id, run)
    journal = store.read()
    ops = [e["op"] for e in journal.entries if e["type"] == "done"]
    assert ops.count("drain") == 1 and ops.count("requeue_hold") == 1
    assert client.job(job_id).restart_count == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "layout", [("--ntasks=4",), ("--ntasks=4", "--ntasks-per-node=2")], ids=["total", "per-node"]
)
def test_the_requeue_keeps_a_total_task_count_and_records_any_change(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    # 4 tasks on 3 nodes. Slurm 24.11 shows 4 for the second layout, then recomputes it as
    # 3 x 2 = 6 when the exclusion is set; 22.05 shows 6 from the start (seen in CI). The
    # first layout keeps 4 on both.
    job_id, run = finished_job_with_alarm(client, tmp_path, layout=layout)
    before = client.job(job_id).fields["NumTasks"]  # type: ignore[union-attr]
    Engine(client, store, Policy()).process_job(job_id, run)
    after = wait_running_without(client, job_id, "node2").fields["NumTasks"]
    (detail,) = [
        e["detail"] for e in store.read().entries if e["type"] == "done" and e["op"] == "exclude"
    ]
    if layout == ("--ntasks=4",):
        assert before == after == "4"
    if before == after:
        assert "task count" not in detail, detail
    else:
        assert f"task count from {before} to {after}" in detail, detail


class Crash(BaseException):
    """The controller process dying between its intent record and its result record."""


def test_crash_after_intent_is_finished_by_the_next_run(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path)

    class DiesAfterRequeue(CommandSlurmClient):
        def requeue_hold(self, job_id: str) -> None:
            super().requeue_hold(job_id)
            raise Crash

    with pytest.raises(Crash):
        Engine(DiesAfterRequeue(env=client._env), store, Policy()).process_job(job_id, run)
    info = client.job(job_id)
    assert info is not None and info.held and "node2" not in info.excluded_nodes
    Engine(client, store, Policy()).retry_pending()
    wait_running_without(client, job_id, "node2")
    done = [e["op"] for e in store.read().entries if e["type"] == "done"]
    assert done.count("requeue_hold") == 1 and done.count("drain") == 1


def test_unreachable_slurmctld_leaves_the_job_pending_then_retries(
    cluster: LocalCluster, client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path)
    # A slurm.conf naming a port nobody listens on: scontrol gets "connection refused".
    conf = tmp_path / "unreachable.conf"
    text = cluster.conf_path.read_text()
    port = next(x for x in text.splitlines() if x.startswith("SlurmctldPort="))
    conf.write_text(text.replace(port, "SlurmctldPort=1"))
    # scontrol itself retries a refused connection for ~18 s; a short client timeout turns
    # that into the same SlurmUnavailable a hung slurmctld gives.
    down = CommandSlurmClient(env={**cluster.env(), "SLURM_CONF": str(conf)}, timeout=2)
    started = time.monotonic()
    report = Engine(down, store, Policy()).process_job(job_id, run)
    assert report.pending and "unreachable" in report.pending_reason, report.lines()
    assert time.monotonic() - started < 10
    assert job_id in store.pending()
    assert_untouched(client, job_id)
    Engine(client, store, Policy()).retry_pending()
    wait_running_without(client, job_id, "node2")
    assert store.pending() == {}


# --------------------------------------------------------------------------- verdicts and input


def test_numerical_verdict_drains_and_requeues_nothing(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path, verdict="numerical")
    report = Engine(client, store, Policy()).process_job(job_id, run)
    assert report.decisions["a1"][0] == "no_action" and "numerical" in report.decisions["a1"][1]
    assert_untouched(client, job_id)


def test_ambiguous_verdict_holds_the_job_and_drains_nothing(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = finished_job_with_alarm(client, tmp_path, verdict="ambiguous")
    Engine(client, store, Policy()).process_job(job_id, run)
    info = client.job(job_id)
    assert info is not None and info.held and info.state == "PENDING"
    assert not any((r or "").startswith("slurm-guard:") for r in reasons(client).values())


def test_bad_alarm_files_are_rejected_without_a_crash(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    job_id, run = submit(client, tmp_path)
    wait_finished(client, job_id)
    alarms = RunDir(run).alarms_dir
    good = json.dumps(alarm(job_id).to_json())
    (alarms / "truncated.json").write_text(good[: len(good) // 2])
    (alarms / "malformed.json").write_text(json.dumps({"schema": 1, "alarm_id": "malformed"}))
    (alarms / "oversized.json").write_text(good + " " * (2 << 20))
    (alarms / "future.json").write_text(json.dumps({**alarm(job_id).to_json(), "schema": 99}))
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(good)
    (alarms / "a1.json").symlink_to(elsewhere)
    report = Engine(client, store, Policy()).process_job(job_id, run)
    text = "\n".join(report.problems)
    for expected in (
        "not valid JSON",
        "missing field",
        "larger than",
        "newer than",
        "symbolic link",
    ):
        assert expected in text
    assert report.decisions == {}
    assert_untouched(client, job_id)
    status = cli(client, "status", str(run), "--state-dir", str(store.root))
    assert status.exit_code == 0 and "rejected file" in status.output


def test_in_job_recover_requeues_its_own_job(
    client: CommandSlurmClient, store: StateStore, tmp_path: Path
) -> None:
    """`slurm-guard recover` as the batch script's last step (it must survive its own requeue)."""
    run = tmp_path / "run"
    RunDir(run).ensure()
    helper = tmp_path / "write_alarm.py"
    helper.write_text(WRITE_ALARM)
    entry = Path(sys.prefix) / "bin" / "slurm-guard"
    recover = (
        f'{shlex.quote(sys.executable)} {shlex.quote(str(helper))} "$RUN" "$SLURM_JOB_ID" node2\n'
        f'    {shlex.quote(str(entry))} recover --run-dir "$RUN" '
        f'--state-dir {shlex.quote(str(store.root))} > "$RUN/recover.log" 2>&1'
    )
    script = tmp_path / "job.sh"
    script.write_text(
        JOB_SCRIPT.format(run=shlex.quote(str(run)), write_alarm=recover, exit_code=EXIT_SDC)
    )
    job_id = client.submit(
        script, ["--requeue", "--nodes=3", "--ntasks-per-node=1", f"--output={tmp_path}/o-%j"]
    )
    wait_for(
        lambda: (reasons(client).get("node2") or "").startswith("slurm-guard:"),
        20,
        "node2 drained by the in-job recovery",
    )

    # Slurm accepts the exclusion and the release while the requeued batch script is still
    # being killed, so the job restarts without help; the watcher pass must then do nothing.
    wait_running_without(client, job_id, "node2")
    result = cli(client, "controller", "--runs-root", str(tmp_path), "--state-dir", str(store.root))
    assert result.exit_code == 0, result.output
    done = [e["op"] for e in store.read().entries if e["type"] == "done"]
    assert done == ["drain", "requeue_hold", "exclude", "release", "start"]
