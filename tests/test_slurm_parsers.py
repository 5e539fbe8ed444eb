"""Parser tests on output recorded from a real Slurm 22.05 cluster (tests/data/slurm-22.05).

The 24.11 cases are synthesised from Slurm's printing code (src/api/node_info.c), not
recorded: they pin the format differences the parser must tolerate.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_guard.slurm.parsers import (
    SlurmParseError,
    expand_hostlist,
    parse_hostnames,
    parse_job,
    parse_key_values,
    parse_node,
    parse_node_states,
    parse_nodes,
    parse_sbatch_parsable,
    parse_slurm_version,
)

DATA = Path(__file__).parent / "data" / "slurm-22.05"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_job_completed_three_nodes() -> None:
    job = parse_job(read("job_completed.txt"))
    assert job.job_id == "1"
    assert job.state == "COMPLETED"
    assert job.nodes == ("node1", "node2", "node3")
    assert (job.user, job.user_id) == ("root", 0)
    assert (job.exit_code, job.exit_signal, job.restart_count) == (0, 0, 0)
    assert job.requeue and not job.held
    assert job.excluded_nodes == ()
    assert job.work_dir == "/tmp"
    assert job.fields["StdOut"] == "/tmp/lcjobs/1.out"
    assert job.fields["TRES"] == "cpu=3,node=3,billing=3"


def test_job_running_name_with_spaces() -> None:
    job = parse_job(read("job_running.txt"))
    assert job.state == "RUNNING"
    assert job.name == "my run name"
    assert job.nodes == ("node1", "node2")


def test_job_failed_exit_code() -> None:
    job = parse_job(read("job_failed.txt"))
    assert (job.state, job.reason) == ("FAILED", "NonZeroExitCode")
    assert (job.exit_code, job.exit_signal) == (3, 0)


def test_job_pending_held_with_exclusions() -> None:
    job = parse_job(read("job_pending_held_excluded.txt"))
    assert job.state == "PENDING"
    assert job.held
    assert job.reason == "job_requeued_in_held_state"
    assert job.restart_count == 1
    assert job.excluded_nodes == ("node2", "node3", "node1")
    assert job.nodes == ()  # "NodeList=" is empty while pending


def test_job_pending_not_held() -> None:
    job = parse_job(read("job_pending_reqnodes_unavailable.txt"))
    assert job.state == "PENDING" and not job.held
    assert job.reason.startswith("ReqNodeNotAvail")


def test_job_rerun_after_requeue_on_other_node() -> None:
    job = parse_job(read("job_completed_after_requeue_excluded.txt"))
    assert (job.state, job.restart_count) == ("COMPLETED", 1)
    assert job.excluded_nodes == ("node1",)
    assert job.nodes == ("node2",)


def test_job_credential_revoked_looks_like_plain_failure() -> None:
    # Restarting a requeued job on its old node within the same second: Slurm kills it with
    # "Job credential revoked" (only in slurmctld.log); the record shows just exit 1.
    job = parse_job(read("job_failed_credential_revoked.txt"))
    assert (job.state, job.exit_code, job.restart_count) == ("FAILED", 1, 1)


def test_node_idle() -> None:
    node = parse_node(read("node_idle.txt"))
    assert node.name == "node3"
    assert node.states == {"IDLE"}
    assert node.reason is None and node.reason_user is None
    assert (node.address, node.hostname) == ("127.0.0.1", "localhost")
    assert not node.drained and not node.failed
    assert node.fields["OS"].startswith("Linux ")  # value with spaces and '#'
    assert node.fields["CfgTRES"] == "cpu=2,mem=1000M,billing=2"
    assert node.fields["AllocTRES"] == ""


def test_node_drained_reason_with_spaces() -> None:
    node = parse_node(read("node_drained_reason_spaces.txt"))
    assert node.states == {"IDLE", "DRAIN"}
    assert node.drained
    assert node.reason == "gpu ECC errors on bus 3"
    assert node.reason_user == "root"
    assert node.reason_time is not None and node.reason_time.startswith("20")


def test_node_reason_with_key_value_words() -> None:
    node = parse_node(read("node_draining_or_mixed_drain.txt"))
    assert node.states == {"MIXED", "DRAIN"}
    assert node.drained
    assert node.reason == "slurm-guard: sdc rank=3 step=120 checksum mismatch"


def test_node_failed() -> None:
    assert parse_node(read("node_mixed_fail.txt")).states == {"MIXED", "FAIL"}
    idle_fail = parse_node(read("node_idle_fail.txt"))
    assert idle_fail.failed and not idle_fail.drained
    assert idle_fail.reason == "fail idle"


def test_node_down_not_responding() -> None:
    node = parse_node(read("node_down_not_responding.txt"))
    assert node.states == {"DOWN", "NOT_RESPONDING"}
    assert node.down and not node.responding
    assert node.reason == "slurmd killed for test"


def test_all_nodes() -> None:
    nodes = parse_nodes(read("nodes_all.txt"))
    assert [n.name for n in nodes] == ["node1", "node2", "node3", "node4"]
    assert [n.drained for n in nodes] == [False, True, False, True]


def test_hostnames() -> None:
    assert parse_hostnames(read("hostnames.txt")) == [
        "node1",
        "node2",
        "node3",
        "gpu-01",
        "gpu-02",
    ]


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("node[1-3],gpu-[01-02]", ["node1", "node2", "node3", "gpu-01", "gpu-02"]),
        ("node[2-3],node1", ["node2", "node3", "node1"]),
        ("node[1-2,4]", ["node1", "node2", "node4"]),
        ("node7", ["node7"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("(null)", []),
        ("", []),
    ],
)
def test_expand_hostlist(expr: str, expected: list[str]) -> None:
    assert expand_hostlist(expr) == expected


def test_expand_hostlist_matches_scontrol() -> None:
    # hostnames.txt is scontrol's expansion of this very expression.
    assert expand_hostlist("node[1-3],gpu-[01-02]") == parse_hostnames(read("hostnames.txt"))


@pytest.mark.parametrize("bad", ["node[1-", "node]1[", "node[a-b]", "node[3-1]"])
def test_expand_hostlist_rejects(bad: str) -> None:
    with pytest.raises(SlurmParseError):
        expand_hostlist(bad)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("IDLE+DRAIN", {"IDLE", "DRAIN"}),
        ("MIXED+DRAIN", {"MIXED", "DRAIN"}),
        ("DOWN*", {"DOWN", "NOT_RESPONDING"}),
        ("down*", {"DOWN", "NOT_RESPONDING"}),
        ("drng", {"DRAINING"}),
        ("idle~", {"IDLE", "POWERED_DOWN"}),
        ("IDLE+CLOUD+POWERED_DOWN", {"IDLE", "CLOUD", "POWERED_DOWN"}),
    ],
)
def test_node_states(state: str, expected: set[str]) -> None:
    assert parse_node_states(state) == expected


# Synthesised from Slurm 24.11's slurm_sprint_node_table(): no CapWatts/ExtSensors, new
# ResumeAfterTime, optional Comment/Extra/Instance*/ReservationName after Reason.
NODE_2411 = (
    "NodeName=node2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=2 CPUTot=2 "
    "CPULoad=0.00 AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) "
    "NodeAddr=127.0.0.1 NodeHostName=localhost Port=6819 Version=24.11.5 "
    "OS=Linux 6.12.0 #1 SMP PREEMPT_DYNAMIC Debian 6.12.1 (2025-01-01)  RealMemory=1000 "
    "AllocMem=0 FreeMem=N/A Sockets=2 Boards=1 State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 "
    "Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  BootTime=2025-01-01T00:00:00 "
    "SlurmdStartTime=2025-01-01T00:00:01 LastBusyTime=2025-01-01T00:00:02 "
    "ResumeAfterTime=None CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES= CurrentWatts=n/a "
    "AveWatts=n/a Reason=slurm-guard: SDC Rank=3 Step=7 [slurm@2025-01-01T00:00:03] "
    "Comment=rack 4 Extra=x=1 InstanceId=i-1 InstanceType=big"
)


def test_node_2411_reason_and_trailing_fields() -> None:
    node = parse_node(NODE_2411)
    assert node.states == {"IDLE", "DRAIN"}
    assert node.reason == "slurm-guard: SDC Rank=3 Step=7"
    assert node.reason_user == "slurm"
    assert node.fields["Comment"] == "rack 4"
    assert node.fields["Extra"] == "x=1"
    assert node.fields["InstanceType"] == "big"
    assert node.fields["ResumeAfterTime"] == "None"


def test_node_reason_without_timestamp_stops_at_next_known_key() -> None:
    line = "NodeName=n1 State=DOWN Reason=Not responding Comment=hot aisle"
    node = parse_node(line)
    assert node.reason == "Not responding" and node.reason_user is None
    assert node.fields["Comment"] == "hot aisle"


def test_job_2411_without_power_and_with_unknown_fields() -> None:
    line = read("job_completed.txt").replace(" Power=", " MailUser=root MailType=END")
    job = parse_job(line + " SegmentSize=4 NewThing=a b c")
    assert job.state == "COMPLETED"
    assert job.fields["MailType"] == "END"
    assert job.fields["NewThing"] == "a b c"


def test_key_values_rejects_garbage() -> None:
    with pytest.raises(SlurmParseError):
        parse_key_values("slurm_load_jobs error: Invalid job id specified")
    with pytest.raises(SlurmParseError, match="UserId"):
        parse_job("JobId=1 JobState=RUNNING")


def test_sbatch_parsable() -> None:
    assert parse_sbatch_parsable("42\n") == "42"
    assert parse_sbatch_parsable("42;cluster\n") == "42"
    with pytest.raises(SlurmParseError, match="expected a job id"):
        parse_sbatch_parsable("Submitted batch job 42\n")


def test_slurm_version() -> None:
    assert parse_slurm_version("slurm-wlm 22.05.8\n") == (22, 5, 8)
    assert parse_slurm_version("slurm 24.11.5") == (24, 11, 5)


# 24.11 after `scontrol update State=RESUME` of NODE_2411: the state is back to IDLE but the
# reason stays, as seen on a real 24.11.5 cluster (22.05 clears it).
NODE_2411_RESUMED = NODE_2411.replace("State=IDLE+DRAIN", "State=IDLE")


def test_node_2411_resumed_keeps_reason_that_means_nothing() -> None:
    node = parse_node(NODE_2411_RESUMED)
    assert node.states == {"IDLE"}
    assert node.reason == "slurm-guard: SDC Rank=3 Step=7"  # still printed by 24.11
    assert not node.out_of_service
    assert node.effective_reason is None


@pytest.mark.parametrize(
    "state", ["IDLE+DRAIN", "MIXED+DRAIN", "ALLOCATED+DRAIN", "IDLE+FAIL", "DOWN", "DOWN*"]
)
def test_node_2411_reason_in_force_while_out_of_service(state: str) -> None:
    node = parse_node(NODE_2411.replace("State=IDLE+DRAIN", f"State={state}"))
    assert node.out_of_service
    assert node.effective_reason == "slurm-guard: SDC Rank=3 Step=7"


@pytest.mark.parametrize("state", ["IDLE", "MIXED", "ALLOCATED", "IDLE+COMPLETING", "IDLE+CLOUD"])
def test_node_reason_ignored_in_service(state: str) -> None:
    node = parse_node(NODE_2411.replace("State=IDLE+DRAIN", f"State={state}"))
    assert node.effective_reason is None


def test_recorded_22_05_reasons_are_in_force() -> None:
    for name in (
        "node_drained_reason_spaces.txt",
        "node_draining_or_mixed_drain.txt",
        "node_idle_fail.txt",
        "node_down_not_responding.txt",
    ):
        node = parse_node(read(name))
        assert node.effective_reason == node.reason and node.reason, name
    assert parse_node(read("node_idle.txt")).effective_reason is None
