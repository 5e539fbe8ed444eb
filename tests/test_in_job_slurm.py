"""Recovery inside the allocation on the real local cluster (issue 31).

`submit --nodes 3 --spares 1` holds all 4 nodes and trains on 3. A persistent fault on node2:
the supervisor drains node2 and restarts the step on node4 (same job id, Restarts=0), and the
run ends bit-identical to a clean run. A second fault once the spare is spent takes the requeue
path (without spares). A fault that follows rank 1 from node to node holds the job after two
alarms, with at most one drain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.local_cluster import LocalCluster

from slurm_guard.cli import main
from slurm_guard.controller.state import StateStore
from slurm_guard.examples.train import read_events, read_result
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.slurm.client import CommandSlurmClient
from slurm_guard.slurm.launch import default_train_command
from slurm_guard.slurm.polling import poll

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 30
FAULT = "kind=grad-scale,node=node2,step=17,persistent=1,param=10"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def submit(
    run_dir: Path, state: Path, inject: str = "", spares: int = 1, extra: tuple[str, ...] = ()
) -> str:
    args = ["--run-dir", str(run_dir), "--steps", str(STEPS), *extra]
    if inject:
        args += ["--inject", inject]
    result = CliRunner().invoke(
        main,
        [
            "submit",
            "--run-dir",
            str(run_dir),
            "--nodes",
            "3",
            "--spares",
            str(spares),
            "--state-dir",
            str(state),
            "--sbatch",
            "time=20",
            "--",
            *default_train_command(args),
        ],
    )
    assert result.exit_code == 0, result.output
    return result.output.split()[0]


def job_fields(client: CommandSlurmClient, job_id: str) -> dict[str, str]:
    info = client.job(job_id)
    assert info is not None, f"job {job_id} is gone"
    return dict(info.fields)


def logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in run_dir.glob("slurm-*.out"))


def wait_ended(client: CommandSlurmClient, job_id: str, run_dir: Path, timeout: float) -> Any:
    def ended() -> Any:
        info = client.job(job_id)
        return info if info is not None and info.state in ENDED else None

    try:
        return poll(ended, timeout, f"job {job_id} to end")
    except TimeoutError:
        pytest.fail(f"job {job_id} did not end in {timeout} s\n{logs(run_dir)}")


def status_json(target: str, state: Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["status", target, "--state-dir", str(state), "--json"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output))


def restart_seconds(run_dir: Path) -> float:
    """Seconds from the alarm record to the first step completed after the in-job restart."""
    events = read_events(run_dir)
    alarm = next(e for e in events if e["event"] == "alarm")
    after = [e for e in events if e["event"] == "first_step" and e["time"] > alarm["time"]]
    (alarm_file,) = (run_dir / "alarms").glob("*.json")
    created = float(json.loads(alarm_file.read_text())["created"])
    return float(after[0]["time"]) - created


@pytest.fixture
def clean_weights(
    idle_slurm_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """A clean 3-node run with one spare: the weights every faulty run must end with."""
    work = tmp_path_factory.mktemp("clean")
    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    job = submit(work / "run", work / "state")
    info = wait_ended(client, job, work / "run", 240)
    result = read_result(work / "run")
    assert info.state == "COMPLETED" and result is not None, logs(work / "run")
    assert result["final_step"] == STEPS and len(result["nodes"]) == 3
    return str(result["weight_sha256"])


def test_fault_on_node2_restarts_on_the_spare_without_a_requeue(
    idle_slurm_cluster: LocalCluster, clean_weights: str, tmp_path: Path
) -> None:
    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    run_dir, state = tmp_path / "run", tmp_path / "state"
    job = submit(run_dir, state, FAULT)
    info = wait_ended(client, job, run_dir, 300)
    fields = job_fields(client, job)
    assert info.state == "COMPLETED", logs(run_dir)
    assert fields["Restarts"] == "0", fields
    reason = client.node("node2").reason or ""
    assert reason.startswith(REASON_PREFIX) and f"job {job}" in reason, reason
    assert not any(
        (client.node(n).reason or "").startswith(REASON_PREFIX) for n in ("node1", "node3")
    )
    result = read_result(run_dir)
    assert result is not None and result["job_id"] == job and result["restart_count"] == 0
    assert result["final_step"] == STEPS and result["resumed_from"] == 10
    assert sorted(result["nodes"]) == ["node1", "node3", "node4"]
    assert result["weight_sha256"] == clean_weights
    journal = StateStore(state).read()
    (restart,) = journal.in_job_restarts
    assert restart["left"] == ["node2"] and restart["joined"] == ["node4"]
    assert restart["resume_step"] == 10 and restart["resume_source"] == "checkpoint"
    assert not any(a.op == "requeue_hold" for p in journal.plans.values() for a in p.actions)
    seconds = restart_seconds(run_dir)
    print(f"\nalarm record -> first completed step after the restart: {seconds:.1f} s")
    view = status_json(str(run_dir), state)
    (row,) = view["in_job_restarts"]
    assert row["left"] == ["node2"] and row["joined"] == ["node4"] and row["resume_step"] == 10
    text = CliRunner().invoke(main, ["status", str(run_dir), "--state-dir", str(state)]).output
    assert "IN-JOB RESTART" in text and "node4" in text and "step 10 (checkpoint)" in text, text


def test_with_snapshots_the_restart_on_the_spare_resumes_from_node_memory(
    idle_slurm_cluster: LocalCluster,
    clean_weights: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 32's drill: a fault on node2 from step 12, votes every 5 steps, no checkpoint
    before step 30. The restart on the spare resumes from the snapshot of step 10 in the
    nodes' memory (one directory per node: they share this machine's /dev/shm); the spare
    (node4) gets its rank's state from the other nodes; the weights end bit-identical."""
    monkeypatch.setenv("SLURM_GUARD_SNAPSHOT_DIR", str(tmp_path / "shm" / "{node}"))
    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    run_dir, state = tmp_path / "run", tmp_path / "state"
    fault = FAULT.replace("step=17", "step=12")
    extra = ("--snapshots", "--checkpoint-every", "50", "--trust-replays", "1")
    job = submit(run_dir, state, fault, extra=extra)
    info = wait_ended(client, job, run_dir, 300)
    assert info.state == "COMPLETED", logs(run_dir)
    assert job_fields(client, job)["Restarts"] == "0"
    assert (client.node("node2").reason or "").startswith(REASON_PREFIX)
    result = read_result(run_dir)
    assert result is not None and result["final_step"] == STEPS, logs(run_dir)
    assert result["resumed_from"] == 10 and sorted(result["nodes"]) == ["node1", "node3", "node4"]
    assert result["weight_sha256"] == clean_weights
    events = read_events(run_dir)
    alarm = next(e for e in events if e["event"] == "alarm")
    starts = [e for e in events if e["event"] == "start"]
    assert starts[-1]["step"] == 10 and starts[-1]["from_snapshot"] is True
    assert not list(run_dir.glob("checkpoints/step-*0000010")), "10 came from no checkpoint"
    from_peers = [e for e in events if e["event"] == "state_from_peers"]
    assert [e["node"] for e in from_peers] == ["node4"], from_peers
    print(f"\nsteps lost to the alarm: {alarm['step'] - result['resumed_from']} (vote_every 5)")
    print(
        f"alarm record -> first completed step after the restart: {restart_seconds(run_dir):.1f} s"
    )


def test_second_fault_after_the_spare_takes_the_requeue_path(
    idle_slurm_cluster: LocalCluster, clean_weights: str, tmp_path: Path
) -> None:
    """rank 1's node (node2) from step 17 uses the spare; node3 from step 22 (after the resume
    from 10) finds no spare left: requeued on 3 nodes without node3. The 4-node cluster has no
    fifth node for the requeued run, so the admin returns node2 in between as repaired: the
    test takes node2's fault out of the run's resolved fault record, as a repair would."""
    from slurm_guard.examples.train import FAULT_FILE
    from slurm_guard.rundir.records import atomic_write_json, read_json_file

    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    run_dir, state = tmp_path / "run", tmp_path / "state"
    second = "kind=grad-scale,node=node3,step=22,persistent=1,param=10"
    job = submit(run_dir, state, f"{FAULT.replace('node=node2', 'node=@rank1')};{second}")
    store = StateStore(state)
    poll(lambda: store.read().in_job_restarts, 240, "the in-job restart")
    poll(
        lambda: (client.node("node2").reason or "").startswith(REASON_PREFIX),
        60,
        "node2 drained",
    )
    record = read_json_file(run_dir / FAULT_FILE)
    assert "node=node2" in record["spec"], record
    atomic_write_json(run_dir / FAULT_FILE, {**record, "spec": second})
    runner = CliRunner()
    back = runner.invoke(
        main,
        ["review", "return", "node2", "--reason", "test: repaired", "--state-dir", str(state)],
    )
    assert back.exit_code == 0, back.output

    def requeued() -> Any:
        i = client.job(job)
        return i if i is not None and i.restart_count >= 1 else None

    poll(requeued, 240, f"job {job} requeued")
    info = wait_ended(client, job, run_dir, 300)
    assert info.state == "COMPLETED", logs(run_dir)
    fields = job_fields(client, job)
    assert fields["Restarts"] == "1" and "node3" in info.excluded_nodes, fields
    assert (client.node("node3").reason or "").startswith(REASON_PREFIX)
    result = read_result(run_dir)
    assert result is not None and result["final_step"] == STEPS, logs(run_dir)
    assert "node3" not in result["nodes"] and len(result["nodes"]) == 3
    assert result["weight_sha256"] == clean_weights
    assert len(store.read().in_job_restarts) == 1


def test_fault_that_follows_rank1_holds_the_job(
    idle_slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    run_dir, state = tmp_path / "run", tmp_path / "state"
    job = submit(run_dir, state, "kind=grad-scale,rank=1,step=17,persistent=1,param=10")

    def held() -> Any:
        i = client.job(job)
        return i if i is not None and i.state == "PENDING" and i.held else None

    poll(held, 300, f"job {job} held")
    drained = [n.name for n in client.nodes() if (n.reason or "").startswith(REASON_PREFIX)]
    assert drained == ["node2"], drained  # the second alarm, on node3, drains nothing
    view = status_json(job, state)
    holds = [a for a in view["alarms"] if a["decision"] == "hold"]
    assert holds and "suspect software or data, not hardware" in holds[-1]["decision_reason"]
    review = CliRunner().invoke(main, ["review", "--state-dir", str(state), "--json"])
    assert review.exit_code == 0, review.output
    (row,) = json.loads(review.output)["held_jobs"]
    assert row["job_id"] == job and "not hardware" in row["reason"]
    client.run(["scancel", job])
    wait_ended(client, job, run_dir, 60)  # gone before the next test's cluster check


def test_supervisor_epilog_and_watcher_racing_act_once(
    idle_slurm_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Two supervisor engine calls, the watcher, the epilog and `recover`, all at once, on a
    running job with a spare: one decision, one drain, one restart on the spare, no requeue."""
    import os
    import subprocess
    import sys
    import threading

    from test_controller_unit import make_alarm

    from slurm_guard.controller.engine import Engine
    from slurm_guard.controller.in_job import Allocation
    from slurm_guard.controller.policy import Policy
    from slurm_guard.rundir.layout import RunDir

    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    store = StateStore(tmp_path / "state")
    store.ensure()
    run = tmp_path / "runs" / "run"
    RunDir(run).ensure()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsleep 120\n")
    job = client.submit(
        script,
        [
            "--nodes=4",
            "--ntasks-per-node=1",
            f"--output={tmp_path}/o-%j",
            f"--comment=slurm-guard:run_dir={run}",
        ],
    )
    poll(lambda: (i := client.job(job)) is not None and i.state == "RUNNING", 30, "job running")
    RunDir(run).write_alarm(make_alarm(job, "a1", "sdc", ("node2",), step=20))
    view = Allocation(("node1", "node2", "node3", "node4"), ("node1", "node2", "node3"), 3, 1)
    reports: list[Any] = []

    def supervisor() -> None:
        reports.append(
            Engine(client, store, Policy()).process_job(job, run, in_job=True, spares=view)
        )

    env = {**os.environ, "SLURM_GUARD_STATE_DIR": str(store.root), "SLURM_JOB_ID": job}
    entry = [sys.executable, "-c", "from slurm_guard.cli import main; main()"]
    others = [
        subprocess.Popen([*entry, "controller", "--runs-root", str(tmp_path / "runs")], env=env),
        subprocess.Popen(
            [*entry, "epilog", "--runs-root", str(tmp_path / "runs")],
            env={**env, "SLURM_JOB_EXIT_CODE2": "0:0", "SLURM_JOB_NODELIST": "node[1-4]"},
        ),
    ]
    engine = Engine(client, store, Policy())
    engine.record_step(job, event="start", attempt=0, nodes=list(view.active), run_dir=str(run))
    others.append(subprocess.Popen([*entry, "recover", "--run-dir", str(run)], env=env))
    threads = [threading.Thread(target=supervisor) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p.wait(timeout=60) == 0 for p in others)
    journal = store.read()
    assert [e["type"] for e in journal.entries].count("alarm") == 1, journal.entries
    done = [e["op"] for e in journal.entries if e["type"] == "done"]
    assert done == ["drain"], done
    (restart,) = journal.in_job_restarts
    assert restart["left"] == ["node2"] and restart["joined"] == ["node4"]
    assert sum(1 for r in reports if r.in_job is not None) == 1
    info = client.job(job)
    assert info is not None and info.state == "RUNNING" and info.restart_count == 0
    client.run(["scancel", job])
    wait_ended(client, job, run, 30)
    # the epilog of the ended job finds the alarm decided: nothing more
    after = subprocess.run(
        [*entry, "epilog", "--runs-root", str(tmp_path / "runs")],
        env={**env, "SLURM_JOB_EXIT_CODE2": "0:15", "SLURM_JOB_NODELIST": "node[1-4]"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert after.returncode == 0, after.stderr
    assert [e["op"] for e in store.read().entries if e["type"] == "done"] == ["drain"]
