"""The loop a framework test on real Slurm follows, the same for the HF Trainer and Lightning.

A training script (tests/hf_slurm_train.py, tests/lightning_slurm_train.py) is submitted through
the real sbatch template for 3 of the 4 nodes with a persistent fault on node2; the shipped
EpilogSlurmctld is installed (tests/test_epilog_slurm.py). Each step below waits for one part
of the loop and asserts it: the alarm names node2, node2 is drained with a readable reason, the
job comes back without node2 and finishes, `slurm-guard status --json` tells the story (every
controller action once, though the epilog and the template's in-job `recover` step both ran),
and the epilog ran after both ends of the job.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from slurm_utils import wait_for
from test_controller_slurm import FINISHED, wait_running_without

from slurm_guard.cli import main
from slurm_guard.local import run_local
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import Alarm
from slurm_guard.slurm.client import CommandSlurmClient
from slurm_guard.slurm.parsers import expand_hostlist

FAULT_NODE = "node2"
#: Generous: three ranks importing a framework and training on two shared cores, twice.
JOB_TIMEOUT_S = 600


def clean_reference(
    clean: Callable[[str], dict[str, Any]], steps: int, root: Path, nodes: Sequence[str]
) -> str:
    """The clean run's weights sha: `clean(root)` on 3 local gloo ranks posing as `nodes`,
    the reference the resumed Slurm job's weights must equal bit for bit."""
    outs = run_local(clean, 3, (str(root),), nodes=list(nodes), timeout=900)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    assert outs[0].value["global_step"] == steps
    return str(outs[0].value["sha"])


def submit(script: Path, run: Path, out: Path, state: Path, job_name: str) -> str:
    """`slurm-guard submit` through the real template; the job id it prints."""
    command = [sys.executable, str(script), "--out", str(out), "--fault-node", FAULT_NODE]
    options = ["--run-dir", str(run), "--nodes", "3", "--state-dir", str(state)]
    options += ["--job-name", job_name, "--sbatch", "time=30"]
    result = CliRunner().invoke(main, ["submit", *options, "--", *command])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()  # the "submitted job ..." note goes to stderr


def the_alarm(run: Path, job: str, step: int, last_verified_step: int) -> Alarm:
    """The one alarm of the job's first run: sdc on node2 at `step`."""
    rd = RunDir(run)
    wait_for(lambda: list(rd.alarms_dir.glob("*.json")), JOB_TIMEOUT_S, f"job {job}'s alarm")
    alarms, errors = rd.alarms()
    assert not errors and len(alarms) == 1, (alarms, errors)
    (alarm,) = alarms
    assert alarm.verdict == "sdc" and list(alarm.suspect_nodes) == [FAULT_NODE]
    assert alarm.job_id == job and alarm.restart_count == 0
    assert (alarm.step, alarm.last_verified_step) == (step, last_verified_step)
    return alarm


def drained_with_reason(client: CommandSlurmClient, job: str, alarm: Alarm) -> None:
    """node2, and only node2, drained by slurm-guard, with a reason an admin can read."""
    reason = wait_for(
        lambda: (
            (client.node(FAULT_NODE).reason or "").startswith(REASON_PREFIX)
            and client.node(FAULT_NODE).reason
        ),
        60,
        f"{FAULT_NODE} drained by slurm-guard",
    )
    for part in (f"job {job}", f"step {alarm.step}", f"check {alarm.check}"):
        assert part in reason, reason
    assert f"alarm {alarm.alarm_id}" in reason, reason
    drained = {n.name for n in client.nodes() if (n.reason or "").startswith(REASON_PREFIX)}
    assert drained == {FAULT_NODE}


def rerun_result(client: CommandSlurmClient, job: str, run: Path, result_file: str) -> Any:
    """The requeued job runs without node2 and completes; rank 0's result file."""
    wait_running_without(client, job, FAULT_NODE)
    info = wait_for(
        lambda: (i := client.job(job)) is not None and i.state in FINISHED and i,
        JOB_TIMEOUT_S,
        f"job {job} to end",
    )
    logs = "\n".join(p.read_text(errors="replace") for p in run.glob("slurm-*.out"))
    assert info.state == "COMPLETED", logs[-4000:]
    result = json.loads((run / result_file).read_text())
    assert result["restart_count"] == 1 and FAULT_NODE not in result["nodes"]
    return result


def status_tells_the_story(run: Path, state: Path, resumed_from: int) -> None:
    """`slurm-guard status --json`: the alarm, each controller action once, the resume."""
    status = CliRunner().invoke(main, ["status", str(run), "--state-dir", str(state), "--json"])
    assert status.exit_code == 0, status.output
    view = json.loads(status.output)
    (seen,) = view["alarms"]
    assert seen["suspect_nodes"] == [FAULT_NODE] and seen["decision"] == "act"
    done = Counter(a["op"] for a in view["controller_actions"] if a["result"] == "done")
    for op in ("drain", "requeue_hold", "exclude", "release"):
        assert done[op] == 1, view["controller_actions"]  # epilog and in-job step: once
    assert view["job"]["restart_count"] == 1 and FAULT_NODE in view["job"]["excluded_nodes"]
    (resume,) = view["resumes"]
    assert resume["resumed_from_step"] == resumed_from and resume["restart_count"] == 1


def epilog_ran_after_both_ends(log: Path, job: str) -> None:
    """On node1-3, then without node2."""

    def ends() -> list[list[str]] | None:
        if not log.exists():  # the epilog has not written its first line yet
            return None
        line = rf"^\S+ \S+ job={job} restart=\d+ exit=\S+ nodes=(\S+)$"
        found = re.findall(line, log.read_text(), re.M)
        return [sorted(expand_hostlist(n)) for n in found] if len(found) >= 2 else None

    seen_ends = wait_for(ends, 60, "the epilog after the rerun")
    assert seen_ends == [["node1", "node2", "node3"], ["node1", "node3", "node4"]], seen_ends
