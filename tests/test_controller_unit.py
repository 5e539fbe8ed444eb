"""Controller decisions and engine bookkeeping, against an in-memory SlurmClient.

The fake is only for decision logic and journal bookkeeping; everything that depends on how Slurm
really behaves is tested against the real local cluster in test_controller_slurm.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_guard.cli import main
from slurm_guard.controller.engine import Engine, EngineError
from slurm_guard.controller.policy import (
    REASON_PREFIX,
    JobFacts,
    Outcome,
    Policy,
    PolicyError,
    decide,
)
from slurm_guard.controller.state import StateStore
from slurm_guard.controller.watch import scan_once
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import Alarm
from slurm_guard.slurm.client import JobInfo, NodeInfo, SlurmUnavailable


class FakeSlurm:
    """Just enough Slurm: drain sets DRAIN + reason, requeuehold makes a held pending job."""

    def __init__(self, nodes: int = 4) -> None:
        self.nodes_state: dict[str, dict[str, Any]] = {
            f"node{i}": {"states": {"IDLE"}, "reason": None} for i in range(1, nodes + 1)
        }
        self.jobs: dict[str, JobInfo] = {}
        self.calls: list[tuple[str, ...]] = []
        self.unavailable = False
        self.drain_unavailable = False  # slurmctld goes away between planning and draining

    def add_job(
        self,
        job_id: str,
        nodes: tuple[str, ...],
        state: str = "FAILED",
        user_id: int = 0,
        comment: str = "",
    ) -> None:
        self.jobs[job_id] = JobInfo(
            job_id=job_id,
            state=state,
            reason="None",
            nodes=nodes,
            user="u",
            user_id=user_id,
            restart_count=0,
            exit_code=86,
            exit_signal=0,
            excluded_nodes=(),
            work_dir="/",
            name="train",
            requeue=True,
            held=False,
        )

    def _check(self) -> None:
        if self.unavailable:
            raise SlurmUnavailable(
                "slurmctld down", ["scontrol"], 1, "Unable to contact slurm controller"
            )

    def job(self, job_id: str) -> JobInfo | None:
        self._check()
        return self.jobs.get(job_id)

    def node(self, name: str) -> NodeInfo:
        self._check()
        s = self.nodes_state[name]
        return NodeInfo(
            name=name,
            states=frozenset(s["states"]),
            reason=s["reason"],
            reason_user="root" if s["reason"] else None,
            address="127.0.0.1",
            hostname="localhost",
        )

    def nodes(self) -> list[NodeInfo]:
        return [self.node(n) for n in self.nodes_state]

    def expand_hostlist(self, expr: str) -> list[str]:
        return expr.split(",")

    def drain(self, node: str, reason: str) -> None:
        self._check()
        if self.drain_unavailable:
            raise SlurmUnavailable("slurmctld down", ["scontrol"], 1, "Unable to contact")
        self.calls.append(("drain", node, reason))
        self.nodes_state[node] = {"states": {"IDLE", "DRAIN"}, "reason": reason}

    def resume(self, node: str) -> None:
        self._check()
        self.calls.append(("resume", node))
        self.nodes_state[node] = {"states": {"IDLE"}, "reason": None}

    def fail(self, node: str, reason: str) -> None:
        self._check()
        self.calls.append(("fail", node, reason))
        self.nodes_state[node] = {"states": {"IDLE", "DRAIN", "FAIL"}, "reason": reason}

    def _update(self, job_id: str, **changes: Any) -> None:
        self.jobs[job_id] = dataclasses.replace(self.jobs[job_id], **changes)

    def requeue_hold(self, job_id: str) -> None:
        self._check()
        self.calls.append(("requeue_hold", job_id))
        j = self.jobs[job_id]
        self._update(
            job_id, state="PENDING", held=True, nodes=(), restart_count=j.restart_count + 1
        )

    def set_excluded_nodes(self, job_id: str, nodes: Any) -> None:
        self._check()
        self.calls.append(("exclude", job_id, ",".join(nodes)))
        self._update(job_id, excluded_nodes=tuple(nodes))

    def release(self, job_id: str) -> None:
        self._check()
        self.calls.append(("release", job_id))
        self._update(job_id, held=False)

    def set_start_time(self, job_id: str, when: str) -> None:
        self._check()
        self.calls.append(("start", job_id, when))

    def submit(self, script: Path, args: Any = ()) -> str:
        raise NotImplementedError

    def count(self, op: str) -> int:
        return sum(1 for c in self.calls if c[0] == op)


def make_alarm(
    job_id: str | None = "100",
    alarm_id: str = "a1",
    verdict: str = "sdc",
    nodes: tuple[str, ...] = ("node2",),
    **kw: Any,
) -> Alarm:
    values: dict[str, Any] = dict(
        alarm_id=alarm_id,
        job_id=job_id,
        restart_count=0,
        step=340,
        check="replay",
        verdict=verdict,
        suspect_ranks=(1,),
        suspect_nodes=nodes,
        suspect_hosts=tuple("localhost" for _ in nodes),
        last_verified_step=330,
        trusted_checkpoint=None,
        update_applied=False,
        evidence={"loss": [1.0, 1.5]},
        message="replay mismatch",
        world_size=3,
        created=time.time(),
    )
    values.update(kw)
    return Alarm(**values)


def write_alarm(run_dir: Path, alarm: Alarm) -> Path:
    rd = RunDir(run_dir)
    rd.ensure()
    return rd.write_alarm(alarm)


# --------------------------------------------------------------------------- fixtures

ALLOC = ("node1", "node2", "node3")


@pytest.fixture
def slurm() -> FakeSlurm:
    fake = FakeSlurm()
    fake.add_job("100", ALLOC, user_id=os.getuid())
    return fake


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(tmp_path / "state")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runs" / "r1"
    RunDir(d).ensure()
    return d


def engine(slurm: FakeSlurm, store: StateStore, policy: Policy | None = None) -> Engine:
    return Engine(slurm, store, policy or Policy())


FACTS = JobFacts(exists=True, state="FAILED", nodes=frozenset(ALLOC), user_id=1000)


# --------------------------------------------------------------------------- pure decisions


def test_decide_sdc_acts_on_suspects() -> None:
    d = decide(make_alarm(), "100", FACTS, 1000, Policy(), drains_in_window=0)
    assert d.outcome is Outcome.ACT
    assert d.drain_nodes == ("node2",) and d.exclude_nodes == ("node2",)


@pytest.mark.parametrize(
    ("alarm", "facts", "uid", "expected"),
    [
        (make_alarm(), JobFacts(exists=False), 1000, "does not exist"),
        (make_alarm(nodes=("node4",)), FACTS, 1000, "not in job 100's allocation"),
        (make_alarm(), FACTS, 65534, "owned by uid 65534"),
        (make_alarm(job_id="7"), FACTS, 1000, "names job 7"),
        (make_alarm(nodes=()), FACTS, 1000, "without a suspect node"),
    ],
)
def test_decide_rejects_unsafe_alarms(
    alarm: Alarm, facts: JobFacts, uid: int, expected: str
) -> None:
    d = decide(alarm, "100", facts, uid, Policy(), drains_in_window=0)
    assert d.outcome is Outcome.REJECTED
    assert expected in d.reason


def test_decide_numerical_ambiguous_and_policies() -> None:
    num = decide(make_alarm(verdict="numerical"), "100", FACTS, 1000, Policy(), drains_in_window=0)
    assert num.outcome is Outcome.NO_ACTION and "numerical" in num.reason
    amb = decide(make_alarm(verdict="ambiguous"), "100", FACTS, 1000, Policy(), drains_in_window=0)
    assert amb.outcome is Outcome.HOLD and amb.drain_nodes == ()
    amb_drain = decide(
        make_alarm(verdict="ambiguous"),
        "100",
        FACTS,
        1000,
        Policy(ambiguous="drain"),
        drains_in_window=0,
    )
    assert amb_drain.outcome is Outcome.ACT
    appr = decide(make_alarm(), "100", FACTS, 1000, Policy(mode="approve"), drains_in_window=0)
    assert appr.outcome is Outcome.AWAIT_APPROVAL
    tripped = decide(make_alarm(), "100", FACTS, 1000, Policy(max_drains=2), drains_in_window=2)
    assert tripped.outcome is Outcome.AWAIT_APPROVAL and "circuit breaker" in tripped.reason


def test_decide_defers_running_job_unless_in_job() -> None:
    running = JobFacts(exists=True, state="RUNNING", nodes=frozenset(ALLOC), user_id=1000)
    assert decide(make_alarm(), "100", running, 1000, Policy(), drains_in_window=0).outcome is (
        Outcome.DEFER
    )
    in_job = decide(make_alarm(), "100", running, 1000, Policy(), drains_in_window=0, in_job=True)
    assert in_job.outcome is Outcome.ACT


def test_policy_file_round_trip_and_validation(tmp_path: Path) -> None:
    Policy(mode="approve", max_drains=5).save(tmp_path)
    assert Policy.load(tmp_path) == Policy(mode="approve", max_drains=5)
    (tmp_path / "policy.json").write_text(json.dumps({"mode": "yolo"}))
    with pytest.raises(PolicyError, match="yolo"):
        Policy.load(tmp_path)


# --------------------------------------------------------------------------- engine


def test_engine_drains_then_requeues_in_safe_order(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    write_alarm(run_dir, make_alarm())
    report = engine(slurm, store).process_job("100", run_dir)
    assert [c[0] for c in slurm.calls] == ["drain", "requeue_hold", "exclude", "release", "start"]
    reason = slurm.calls[0][2]
    assert reason.startswith(REASON_PREFIX)
    assert all(s in reason for s in ("job 100", "step 340", "replay", "a1"))
    assert slurm.jobs["100"].excluded_nodes == ("node2",)
    assert not report.pending


def test_engine_twice_and_concurrently_acts_once(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    write_alarm(run_dir, make_alarm())
    threads = [
        threading.Thread(target=engine(slurm, store).process_job, args=("100", run_dir))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine(slurm, store).process_job("100", run_dir)
    assert slurm.count("drain") == 1 and slurm.count("requeue_hold") == 1


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so nothing in the engine catches it."""


@pytest.mark.parametrize("after_command", [False, True])
def test_crash_after_intent_is_finished_by_next_run(
    slurm: FakeSlurm, store: StateStore, run_dir: Path, after_command: bool
) -> None:
    write_alarm(run_dir, make_alarm())
    real = slurm.requeue_hold

    def dying(job_id: str) -> None:
        if after_command:
            real(job_id)
        raise Crash

    slurm.requeue_hold = dying  # type: ignore[method-assign]
    with pytest.raises(Crash):
        engine(slurm, store).process_job("100", run_dir)
    assert slurm.count("drain") == 1 and slurm.count("exclude") == 0
    slurm.requeue_hold = real  # type: ignore[method-assign]
    engine(slurm, store).retry_pending()  # the unfinished plan is found without the run dir
    assert slurm.count("drain") == 1
    assert slurm.count("requeue_hold") == 1
    assert slurm.count("release") == 1 and slurm.jobs["100"].excluded_nodes == ("node2",)


def test_unreachable_slurm_leaves_job_pending_and_retry_acts(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    write_alarm(run_dir, make_alarm())
    slurm.unavailable = True
    report = engine(slurm, store).process_job("100", run_dir)
    assert report.pending and "unreachable" in report.pending_reason
    assert "100" in store.pending()
    slurm.unavailable = False
    engine(slurm, store).retry_pending()
    assert slurm.count("drain") == 1 and slurm.count("release") == 1
    assert store.pending() == {}


def test_foreign_drained_node_is_left_alone(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    slurm.nodes_state["node2"] = {"states": {"IDLE", "DRAIN"}, "reason": "bad DIMM (ops)"}
    write_alarm(run_dir, make_alarm())
    engine(slurm, store).process_job("100", run_dir)
    assert slurm.count("drain") == 0
    assert slurm.nodes_state["node2"]["reason"] == "bad DIMM (ops)"
    assert slurm.jobs["100"].excluded_nodes == ("node2",)  # still kept away from the job
    with pytest.raises(EngineError, match="not set by slurm-guard"):
        engine(slurm, store).return_node("node2", "looks fine", "admin")
    with pytest.raises(EngineError, match="not set by slurm-guard"):
        engine(slurm, store).retire_node("node2", "looks bad", "admin")
    assert slurm.count("resume") == 0 and slurm.count("fail") == 0


def test_circuit_breaker_counts_drains_across_jobs(
    slurm: FakeSlurm, store: StateStore, tmp_path: Path
) -> None:
    policy = Policy(max_drains=1)
    for i, node in ((1, "node1"), (2, "node2")):
        job = str(100 + i)
        slurm.add_job(job, ALLOC, user_id=os.getuid())
        d = tmp_path / f"run{i}"
        write_alarm(d, make_alarm(job_id=job, alarm_id=f"x{i}", nodes=(node,)))
        engine(slurm, store, policy).process_job(job, d)
    assert slurm.count("drain") == 1
    journal = store.read()
    assert journal.alarms["x2"]["outcome"] == "await_approval"
    engine(slurm, store, policy).approve("x2", "checked the evidence", "admin")
    assert slurm.count("drain") == 2 and slurm.jobs["102"].excluded_nodes == ("node2",)


def test_approve_policy_waits_for_admin(slurm: FakeSlurm, store: StateStore, run_dir: Path) -> None:
    write_alarm(run_dir, make_alarm())
    eng = engine(slurm, store, Policy(mode="approve"))
    eng.process_job("100", run_dir)
    eng.process_job("100", run_dir)
    # held in Slurm (a held job outlives MinJobAge), once, and nothing drained
    assert [c[0] for c in slurm.calls] == ["requeue_hold"] and slurm.jobs["100"].held
    with pytest.raises(EngineError, match="reason"):
        eng.approve("a1", "  ", "admin")
    eng.approve("a1", "evidence is convincing", "admin")
    assert slurm.count("drain") == 1 and slurm.count("release") == 1
    with pytest.raises(EngineError, match="already approved"):
        eng.approve("a1", "again", "admin")


def test_ambiguous_holds_job_and_numerical_does_nothing(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    write_alarm(run_dir, make_alarm(alarm_id="num", verdict="numerical"))
    engine(slurm, store).process_job("100", run_dir)
    assert slurm.calls == []
    assert "numerical" in store.read().alarms["num"]["reason"]
    write_alarm(run_dir, make_alarm(alarm_id="amb", verdict="ambiguous"))
    engine(slurm, store).process_job("100", run_dir)
    assert [c[0] for c in slurm.calls] == ["requeue_hold"]
    assert slurm.jobs["100"].held


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"schema": 1, "alarm_id": "bad", "job', "not valid JSON"),
        (b'["not", "an", "object"]', "expected a JSON object"),
        (b"{" + b" " * (2 << 20) + b"}", "larger than"),
        (b'{"schema": 99}', "newer than"),
    ],
)
def test_bad_alarm_files_are_rejected_once(
    slurm: FakeSlurm, store: StateStore, run_dir: Path, content: bytes, message: str
) -> None:
    (run_dir / "alarms" / "bad.json").write_bytes(content)
    report = engine(slurm, store).process_job("100", run_dir)
    assert any(message in p for p in report.problems)
    engine(slurm, store).process_job("100", run_dir)
    assert len([e for e in store.read().entries if e["type"] == "bad_file"]) == 1
    assert slurm.calls == []


def test_symlinked_alarm_is_rejected(
    slurm: FakeSlurm, store: StateStore, run_dir: Path, tmp_path: Path
) -> None:
    target = write_alarm(tmp_path / "elsewhere", make_alarm())
    (run_dir / "alarms" / "a1.json").symlink_to(target)
    report = engine(slurm, store).process_job("100", run_dir)
    assert any("symbolic link" in p for p in report.problems)
    assert slurm.calls == []


def test_dry_run_changes_nothing(slurm: FakeSlurm, store: StateStore, run_dir: Path) -> None:
    write_alarm(run_dir, make_alarm())
    report = Engine(slurm, store, Policy(), dry_run=True).process_job("100", run_dir)
    assert slurm.calls == [] and not store.journal_path.exists()
    assert any(a.startswith("would drain node2") for a in report.actions)


def test_watcher_finds_alarm_under_runs_root(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    write_alarm(run_dir, make_alarm())
    reports = scan_once(engine(slurm, store), run_dir.parent)
    assert [r.job_id for r in reports] == ["100"]
    assert scan_once(engine(slurm, store), run_dir.parent) == []
    assert slurm.count("drain") == 1


# --------------------------------------------------------------------------- CLI


def invoke(slurm: FakeSlurm, *args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, list(args), obj={"slurm_client": slurm}, env=env)


def test_cli_status_review_and_return(slurm: FakeSlurm, store: StateStore, run_dir: Path) -> None:
    write_alarm(run_dir, make_alarm())
    sd = str(store.root)
    result = invoke(
        slurm,
        "epilog",
        "--state-dir",
        sd,
        env={
            "SLURM_JOB_ID": "100",
            "SLURM_JOB_EXIT_CODE2": "86:0",
            "SLURM_JOB_COMMENT": f"slurm-guard:run_dir={run_dir}",
        },
    )
    assert result.exit_code == 0, result.output
    status = invoke(slurm, "status", "100", "--state-dir", sd, "--json")
    assert status.exit_code == 0, status.output
    view = json.loads(status.output)
    assert view["alarms"][0]["decision"] == "act"
    assert {a["op"] for a in view["controller_actions"]} >= {"drain", "release"}
    table = invoke(slurm, "status", str(run_dir), "--state-dir", sd)
    assert "a1" in table.output and "replay" in table.output
    review = invoke(slurm, "review", "--state-dir", sd, "--json")
    nodes = json.loads(review.output)["nodes"]
    assert [n["node"] for n in nodes] == ["node2"] and nodes[0]["jobs"] == ["100"]
    missing = invoke(slurm, "review", "--state-dir", sd, "return", "node2")
    assert missing.exit_code != 0 and "--reason" in missing.output
    back = invoke(slurm, "review", "--state-dir", sd, "return", "node2", "--reason", "diag ok")
    assert back.exit_code == 0, back.output
    assert slurm.nodes_state["node2"]["reason"] is None


def test_cli_errors_say_what_to_do(slurm: FakeSlurm, store: StateStore) -> None:
    result = invoke(
        slurm, "review", "--state-dir", str(store.root), "approve", "nope", "--reason", "x"
    )
    assert result.exit_code == 1 and "slurm-guard review" in result.output
    result = invoke(
        slurm,
        "recover",
        "--run-dir",
        "/tmp",
        "--state-dir",
        str(store.root),
        env={"SLURM_JOB_ID": ""},
    )
    assert result.exit_code == 1 and "inside the batch job" in result.output


def test_alarm_seen_while_the_job_completes_is_deferred_not_rejected(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    """During EpilogSlurmctld Slurm shows no node list: only the epilog knows the allocation."""
    completing = JobFacts(exists=True, state="COMPLETING", nodes=frozenset(), user_id=1000)
    d = decide(make_alarm(), "100", completing, 1000, Policy(), drains_in_window=0)
    assert d.outcome is Outcome.DEFER

    write_alarm(run_dir, make_alarm())
    slurm.jobs["100"] = dataclasses.replace(slurm.jobs["100"], state="COMPLETING", nodes=())
    report = engine(slurm, store).process_job("100", run_dir)  # the watcher: no allocation
    assert report.pending and slurm.count("drain") == 0
    assert "a1" not in store.read().alarms  # nothing decided for good
    slurm.jobs["100"] = dataclasses.replace(slurm.jobs["100"], state="FAILED", nodes=ALLOC)
    engine(slurm, store).retry_pending()
    assert slurm.count("drain") == 1


def test_pending_job_keeps_the_allocation_its_epilog_was_given(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    write_alarm(run_dir, make_alarm())
    slurm.jobs["100"] = dataclasses.replace(slurm.jobs["100"], state="COMPLETING", nodes=())
    with store.locked(1.0):  # another controller holds the lock: the epilog's job goes pending
        report = engine(slurm, store).process_job(
            "100", run_dir, allocation=ALLOC, lock_timeout_s=0.1
        )
    assert report.pending and store.pending()["100"]["allocation"] == list(ALLOC)
    engine(slurm, store).retry_pending()  # still COMPLETING, but the epilog's list is kept
    assert slurm.count("drain") == 1


def test_circuit_breaker_counts_a_planned_drain_that_an_outage_interrupted(
    slurm: FakeSlurm, store: StateStore, tmp_path: Path
) -> None:
    policy = Policy(max_drains=1)
    slurm.drain_unavailable = True
    slurm.add_job("101", ALLOC, user_id=os.getuid())
    first = tmp_path / "run1"
    write_alarm(first, make_alarm(job_id="101", alarm_id="x1", nodes=("node1",)))
    assert engine(slurm, store, policy).process_job("101", first).pending
    slurm.drain_unavailable = False
    slurm.add_job("102", ALLOC, user_id=os.getuid())
    second = tmp_path / "run2"
    write_alarm(second, make_alarm(job_id="102", alarm_id="x2", nodes=("node2",)))
    engine(slurm, store, policy).process_job("102", second)
    assert store.read().alarms["x2"]["outcome"] == "await_approval"
    engine(slurm, store, policy).retry_pending()  # the interrupted plan is finished
    assert slurm.count("drain") == 1  # the limit holds


def test_state_dir_is_accepted_on_the_subcommand_and_on_the_group(
    slurm: FakeSlurm, store: StateStore, run_dir: Path, tmp_path: Path
) -> None:
    write_alarm(run_dir, make_alarm())
    engine(slurm, store).process_job("100", run_dir)
    sd, elsewhere = str(store.root), str(tmp_path / "other-state")
    dry = invoke(
        slurm, "review", "return", "node2", "--state-dir", sd, "--reason", "ok", "--dry-run"
    )
    assert dry.exit_code == 0, dry.output
    assert dry.output.startswith("would resume node2") and slurm.count("resume") == 0
    # the subcommand's own value wins over the group's; the group's over the environment
    wrong = invoke(
        slurm, "review", "--state-dir", sd, "return", "node2", "--state-dir", elsewhere,
        "--reason", "ok",
    )  # fmt: skip
    assert wrong.exit_code == 0, wrong.output
    assert not any(e.get("type") == "admin" for e in store.read().entries)
    slurm.nodes_state["node2"]["reason"] = "slurm-guard: drained again"
    slurm.nodes_state["node2"]["states"] = {"IDLE", "DRAIN"}
    back = invoke(
        slurm, "review", "--state-dir", sd, "retire", "node2", "--reason", "RMA",
        env={"SLURM_GUARD_STATE_DIR": elsewhere},
    )  # fmt: skip
    assert back.exit_code == 0, back.output
    assert [e["op"] for e in store.read().entries if e.get("type") == "admin"] == ["retire"]


def _in_child_as_nobody(fn: Any) -> Any:
    """Run `fn` in a forked child that cannot read root's private files.

    As root (CI, this container) the child drops to uid/gid 65534; as another user it keeps its
    uid, and files made unreadable with chmod are unreadable to it anyway.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()

    def child() -> None:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        try:
            queue.put(("ok", fn()))
        except BaseException as exc:  # the parent re-raises it with its type and message
            queue.put(("error", f"{type(exc).__name__}: {exc}"))

    proc = ctx.Process(target=child)
    proc.start()
    status, value = queue.get()
    proc.join(30)
    assert status == "ok", value
    return value


def test_watcher_reports_unreadable_run_dirs_and_goes_on(slurm: FakeSlurm, tmp_path: Path) -> None:
    """A 0700 run dir of another user and an alarm written 0600 must not hide later runs."""
    base = tmp_path / "open"
    runs, state = base / "runs", base / "state"
    for d in (base, runs, state):
        d.mkdir(parents=True, exist_ok=True)
    for d in (tmp_path, *tmp_path.parents):  # let the child reach its files under tmp_path
        if d != d.parent:
            d.chmod(d.stat().st_mode | 0o011)
    os.chmod(base, 0o755)
    os.chmod(runs, 0o755)
    os.chmod(state, 0o777)
    private = runs / "a-private"
    write_alarm(private, make_alarm(job_id="101", alarm_id="p1"))
    private.chmod(0o700 if os.geteuid() == 0 else 0o000)
    locked = runs / "b-locked"
    path = write_alarm(locked, make_alarm(job_id="102", alarm_id="l1"))
    for d in (locked, locked / "alarms"):
        d.chmod(0o755)
    path.chmod(0o600 if os.geteuid() == 0 else 0o000)
    readable = runs / "c-readable"
    write_alarm(readable, make_alarm(job_id="100", alarm_id="r1"))
    for p in (readable, readable / "alarms"):
        p.chmod(0o755)
    (readable / "alarms" / "r1.json").chmod(0o644)

    def scan_twice() -> tuple[list[list[str]], list[list[str]], list[tuple[str, ...]]]:
        eng = Engine(slurm, StateStore(state), Policy())
        first = [r.lines() for r in scan_once(eng, runs)]
        again = [r.lines() for r in scan_once(eng, runs)]
        return first, again, slurm.calls

    try:
        first, again, calls = _in_child_as_nobody(scan_twice)
    finally:
        private.chmod(0o755)
        path.chmod(0o644)
    assert [c[0] for c in calls].count("drain") == 1  # the readable run was acted on
    text = "\n".join(line for lines in first for line in lines)
    assert "job 100" in text and "alarm r1: act" in text
    assert f"{private}: cannot read (Permission denied)" in text
    assert f"{path}" in text and "Permission denied" in text.split(f"{path}", 1)[1]
    assert again == []  # reported once, not on every pass


def test_recover_help_recovers_on_any_failure_like_the_launcher() -> None:
    """With --kill-on-bad-exit a guard stop often ends srun with 143: `-eq 86` would miss it."""
    from slurm_guard.slurm.launch import recovery_lines

    help_text = CliRunner().invoke(main, ["recover", "--help"]).output
    assert "-eq 86" not in help_text
    assert '[ $rc -ne 0 ] && slurm-guard recover --run-dir "$RUN_DIR"' in help_text
    assert any('[ "$sg_rc" -ne 0 ]' in line for line in recovery_lines(Path("/runs/r"), None))


@pytest.mark.parametrize(
    ("exit_code2", "failed"),
    [("86:0", True), ("143:0", True), ("0:15", True), ("1:0", True), ("0:0", False), ("", True)],
)
def test_epilog_counts_every_failed_end(exit_code2: str, failed: bool) -> None:
    from slurm_guard.controller.intake import job_failed

    assert job_failed(exit_code2) is failed


def test_dry_run_says_in_words_what_it_would_change(
    slurm: FakeSlurm, store: StateStore, run_dir: Path
) -> None:
    slurm.nodes_state["node3"] = {"states": {"IDLE", "DRAIN"}, "reason": "bad DIMM (ops)"}
    write_alarm(run_dir, make_alarm(nodes=("node2", "node3")))
    report = Engine(slurm, store, Policy(), dry_run=True).process_job("100", run_dir)
    reason = report.actions[0].split(": ", 1)[1]
    assert report.actions == [
        f"would drain node2: {reason}",
        "drain node3: skipped (left untouched: node has a reason not set by slurm-guard "
        "('bad DIMM (ops)'))",
        "would requeue job 100 and hold it",
        "would exclude node2, node3 from job 100",
        "would release job 100",
        "would let job 100 start 2 s from now (StartTime=now+2)",
    ]
    assert reason.startswith(f"{REASON_PREFIX} job 100 step 340")
    assert slurm.calls == [] and store.read().entries == []
