"""CommandSlurmClient: argument handling and error classification with a recording Runner,
then the real thing against the local cluster (tests marked ``slurm``)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from slurm_utils import wait_for
from support.local_cluster import LocalCluster, find_free_port_base

from slurm_guard.slurm.client import (
    CommandSlurmClient,
    JobInfo,
    SlurmClient,
    SlurmCommandError,
    SlurmNotFound,
    SlurmUnavailable,
    default_client,
)

DATA = Path(__file__).parent / "data" / "slurm-22.05"


@dataclass
class Result:
    returncode: int = 0
    stdout: str = ""
    stderr: str = ""


@dataclass
class RecordingRunner:
    """Replays canned results and records every call (argv, env, timeout)."""

    results: list[Result | BaseException] = field(default_factory=list)
    calls: list[tuple[list[str], dict[str, str], float]] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], env: Mapping[str, str], timeout: float) -> Result:
        self.calls.append((list(argv), dict(env), timeout))
        outcome = self.results.pop(0) if self.results else Result()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    path = tmp_path / "slurm.conf"
    path.write_text("ClusterName=fake\n")
    return path


def make(
    conf: Path, *results: Result | BaseException
) -> tuple[CommandSlurmClient, RecordingRunner]:
    runner = RecordingRunner(list(results))
    return CommandSlurmClient(env={"SLURM_CONF": str(conf)}, runner=runner, timeout=7), runner


def test_drain_passes_reason_as_one_argument(conf: Path) -> None:
    client, runner = make(conf)
    client.drain("node2", "slurm-guard: sdc rank=3 'quoted' $(not a shell)")
    argv, env, timeout = runner.calls[0]
    assert argv == [
        "scontrol",
        "update",
        "NodeName=node2",
        "State=DRAIN",
        "Reason=slurm-guard: sdc rank=3 'quoted' $(not a shell)",
    ]
    assert env["SLURM_CONF"] == str(conf)
    assert env["SLURM_TIME_FORMAT"] == "standard"
    assert timeout == 7


def test_job_actions_argv(conf: Path) -> None:
    client, runner = make(conf, Result(stdout="17\n"))
    assert client.submit(Path("/x/job.sh"), ["--nodes=3", "--requeue"]) == "17"
    client.requeue_hold("17")
    client.set_excluded_nodes("17", ["node2", "node3"])
    client.set_excluded_nodes("17", [])
    client.release("17")
    client.set_start_time("17", "now+2")
    client.resume("node2")
    client.fail("node2", "bad gpu")
    assert [c[0] for c in runner.calls] == [
        ["sbatch", "--parsable", "--nodes=3", "--requeue", "/x/job.sh"],
        ["scontrol", "requeuehold", "17"],
        ["scontrol", "update", "JobId=17", "ExcNodeList=node2,node3"],
        ["scontrol", "update", "JobId=17", "ExcNodeList="],
        ["scontrol", "release", "17"],
        ["scontrol", "update", "JobId=17", "StartTime=now+2"],
        ["scontrol", "update", "NodeName=node2", "State=RESUME"],
        ["scontrol", "update", "NodeName=node2", "State=FAIL", "Reason=bad gpu"],
    ]


@pytest.mark.parametrize("bad", ["", "node 1", "node=1", "node1;rm", "$(x)", "node[1-2]", "-n"])
def test_rejects_bad_node_names(conf: Path, bad: str) -> None:
    client, runner = make(conf)
    with pytest.raises(ValueError, match="invalid node name"):
        client.drain(bad, "x")
    with pytest.raises(ValueError, match="invalid node name"):
        client.set_excluded_nodes("1", ["node1", bad])
    assert runner.calls == []


@pytest.mark.parametrize("bad", ["", "1 2", "JobId=1", "1;x", "abc", "-1"])
def test_rejects_bad_job_ids(conf: Path, bad: str) -> None:
    client, runner = make(conf)
    with pytest.raises(ValueError, match="invalid Slurm job id"):
        client.requeue_hold(bad)
    assert runner.calls == []


def test_rejects_bad_reason_and_start_time(conf: Path) -> None:
    client, _ = make(conf)
    with pytest.raises(ValueError, match="reason is required"):
        client.drain("node1", " ")
    with pytest.raises(ValueError, match="single line"):
        client.drain("node1", "a\nb")
    with pytest.raises(ValueError, match="StartTime"):
        client.set_start_time("1", "now +2")
    with pytest.raises(TypeError):
        client.set_excluded_nodes("1", "node1")


def test_job_parses_recorded_output(conf: Path) -> None:
    client, _ = make(conf, Result(stdout=(DATA / "job_pending_held_excluded.txt").read_text()))
    job = client.job("3")
    assert job is not None and job.held and job.excluded_nodes == ("node2", "node3", "node1")


def test_unknown_job_is_none(conf: Path) -> None:
    stderr = (DATA / "job_unknown.stderr").read_text()
    client, _ = make(conf, Result(returncode=1, stderr=stderr))
    assert client.job("999999") is None


def test_unknown_node_raises_not_found(conf: Path) -> None:
    # scontrol prints this on stdout, not stderr.
    stdout = (DATA / "node_unknown.stdout").read_text()
    client, _ = make(conf, Result(returncode=1, stdout=stdout))
    with pytest.raises(SlurmNotFound, match="nodeX"):
        client.node("nodeX")


@pytest.mark.parametrize("name", ["job_unreachable.stderr", "update_unreachable.stderr"])
def test_unreachable_controller_is_unavailable(conf: Path, name: str) -> None:
    stderr = (DATA / name).read_text()
    client, _ = make(conf, Result(returncode=1, stderr=stderr), Result(returncode=1, stderr=stderr))
    with pytest.raises(SlurmUnavailable, match="retry later"):
        client.job("1")
    with pytest.raises(SlurmUnavailable) as info:
        client.drain("node1", "x")
    assert info.value.returncode == 1 and "Unable to contact" in info.value.stderr


def test_timeout_is_unavailable(conf: Path) -> None:
    client, _ = make(conf, subprocess.TimeoutExpired(["scontrol"], 7))
    with pytest.raises(SlurmUnavailable, match="did not answer within 7 s") as info:
        client.nodes()
    assert info.value.returncode is None


def test_other_failures_are_command_errors(conf: Path) -> None:
    client, _ = make(conf, Result(returncode=1, stderr="slurm_update error: Invalid node name"))
    with pytest.raises(SlurmCommandError, match="exit status 1") as info:
        client.drain("node9", "x")
    assert not isinstance(info.value, SlurmUnavailable)
    assert info.value.argv[:2] == ["scontrol", "update"]


def test_missing_slurm_conf_fails_fast(tmp_path: Path) -> None:
    # Real scontrol would retry for 60 s before saying the same.
    runner = RecordingRunner()
    client = CommandSlurmClient(env={"SLURM_CONF": str(tmp_path / "nope")}, runner=runner)
    with pytest.raises(SlurmCommandError, match="is not a file"):
        client.nodes()
    assert runner.calls == []


def test_missing_binary(conf: Path) -> None:
    client, _ = make(conf, FileNotFoundError("scontrol"))
    with pytest.raises(SlurmCommandError, match="not found on PATH"):
        client.nodes()


def test_default_client_is_command_client(conf: Path) -> None:
    client: SlurmClient = default_client({"SLURM_CONF": str(conf)})
    assert isinstance(client, CommandSlurmClient)


# ---------------------------------------------------------------- real cluster


@pytest.mark.slurm
def test_drain_fail_resume_roundtrip(
    idle_slurm_cluster: LocalCluster, slurm_client: CommandSlurmClient
) -> None:
    reason = "slurm-guard: sdc Rank=3 step=120 checksum mismatch"
    slurm_client.drain("node2", reason)
    node = slurm_client.node("node2")
    assert node.drained and node.reason == reason and node.reason_user == "root"
    assert node.address == "127.0.0.1"

    slurm_client.fail("node3", "gpu ECC errors")
    node3 = slurm_client.node("node3")
    assert node3.failed and node3.reason == "gpu ECC errors"

    by_name = {n.name: n for n in slurm_client.nodes()}
    assert by_name["node2"].drained and by_name["node3"].failed
    assert not by_name["node1"].drained

    slurm_client.resume("node2")
    slurm_client.resume("node3")
    wait_for(
        lambda: (
            not slurm_client.node("node2").states - {"IDLE"}
            and not slurm_client.node("node3").states - {"IDLE"}
        ),
        10,
        "node2 and node3 back to IDLE",
    )
    assert slurm_client.node("node2").reason is None


@pytest.mark.slurm
def test_requeue_finished_job_excluding_nodes(
    idle_slurm_cluster: LocalCluster, slurm_client: CommandSlurmClient, tmp_path: Path
) -> None:
    out = tmp_path / "runs.txt"
    script = tmp_path / "job.sh"
    script.write_text(
        f'#!/bin/bash\necho "${{SLURM_RESTART_COUNT:-0}} $SLURM_JOB_NODELIST" >> {out}\nexit 3\n'
    )
    job_id = slurm_client.submit(script, ["--nodes=2", "--requeue", "--output=/dev/null"])

    def finished() -> JobInfo | None:
        job = slurm_client.job(job_id)
        return job if job is not None and job.state == "FAILED" else None

    first = wait_for(finished, 30, f"job {job_id} to fail")
    assert first.nodes == ("node1", "node2") and first.exit_code == 3

    slurm_client.requeue_hold(job_id)
    slurm_client.set_excluded_nodes(job_id, ["node1", "node2"])
    held = slurm_client.job(job_id)
    assert held is not None and held.held and held.state == "PENDING"
    assert held.excluded_nodes == ("node1", "node2")
    slurm_client.release(job_id)
    slurm_client.set_start_time(job_id, "now+2")

    def rerun_done() -> JobInfo | None:
        job = slurm_client.job(job_id)
        return job if job is not None and job.restart_count == 1 and job.state == "FAILED" else None

    second = wait_for(rerun_done, 30, f"job {job_id} to run again")
    assert second.nodes == ("node3", "node4")
    assert out.read_text().splitlines() == ["0 node[1-2]", "1 node[3-4]"]


@pytest.mark.slurm
def test_unknown_job_and_node(slurm_client: CommandSlurmClient) -> None:
    assert slurm_client.job("987654") is None
    with pytest.raises(SlurmNotFound):
        slurm_client.node("node99")
    assert slurm_client.expand_hostlist("node[1-3],gpu-[01-02]") == [
        "node1",
        "node2",
        "node3",
        "gpu-01",
        "gpu-02",
    ]
    assert slurm_client.version()[0] >= 22


@pytest.mark.slurm
def test_stopped_controller_is_unavailable(slurm_cluster: LocalCluster, tmp_path: Path) -> None:
    # A copy of the live cluster's config whose slurmctld port nobody listens on: scontrol
    # would retry for 9-18 s, so the client's own timeout turns that into SlurmUnavailable.
    dead_port = find_free_port_base(1, accounting=False)
    lines = [
        f"SlurmctldPort={dead_port}" if line.startswith("SlurmctldPort=") else line
        for line in slurm_cluster.conf_path.read_text().splitlines()
    ]
    conf = tmp_path / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    client = CommandSlurmClient(env={"SLURM_CONF": str(conf)}, timeout=1)
    with pytest.raises(SlurmUnavailable):
        client.job("1")
    with pytest.raises(SlurmUnavailable):
        client.drain("node1", "never applied")
