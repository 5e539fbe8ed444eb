"""GuardedTrainer under real Slurm: the sbatch template, the shipped epilog, a bad GPU on node2.

`slurm-guard submit` renders the real template for 3 of the 4 nodes (CPU, one task per node)
with tests/hf_slurm_train.py as the training command: the real HF Trainer, a tiny GPT-2, a
`checkpoint-N` after every step and a persistent gradient fault on node2 from step 5. The
shipped EpilogSlurmctld is installed, as a site installs it; the template's in-job `recover`
step shares its journal, so whichever comes first acts and nothing is done twice. The test
follows the whole loop: the alarm names node2, node2 is drained with a readable reason, the job
comes back without node2, the Trainer resumes from the newest checkpoint the guard trusts (the
ones written after the fault are quarantined), finishes, and its weights equal a clean run's
bit for bit (computed here with `run_local`, 3 ranks of the same function, one thread each).

Skipped without transformers/accelerate, failed instead under SLURM_GUARD_REQUIRE_INTEGRATIONS=1
(test_integration_hf's check); skipped without Slurm unless SLURM_GUARD_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from slurm_utils import wait_for
from support.local_cluster import LocalCluster
from test_controller_slurm import FINISHED, wait_running_without
from test_epilog_slurm import install_epilog
from test_integration_hf import HAVE, NODES

from slurm_guard.cli import main
from slurm_guard.local import run_local
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.rundir.layout import RunDir
from slurm_guard.slurm.client import CommandSlurmClient
from slurm_guard.slurm.parsers import expand_hostlist

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE, reason="needs the [hf] extra (transformers, accelerate)"),
]

SCRIPT = Path(__file__).resolve().parent / "hf_slurm_train.py"
#: Generous: three ranks importing transformers and training on two shared cores, twice.
JOB_TIMEOUT_S = 600


@pytest.fixture
def cluster(idle_slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield idle_slurm_cluster
    idle_slurm_cluster.write_epilog(None)


@pytest.fixture
def client(cluster: LocalCluster) -> CommandSlurmClient:
    return CommandSlurmClient(env=cluster.env())


def clean_reference(root: Path) -> str:
    """The clean run's weights sha: 3 local gloo ranks posing as node1..node3."""
    import hf_slurm_train

    outs = run_local(hf_slurm_train.clean, 3, (str(root),), nodes=NODES, timeout=900)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    assert outs[0].value["global_step"] == hf_slurm_train.STEPS
    return str(outs[0].value["sha"])


def submit(run: Path, out: Path, state: Path) -> str:
    """`slurm-guard submit` through the real template; the job id it prints."""
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--fault-node", "node2"]
    options = ["--run-dir", str(run), "--nodes", "3", "--state-dir", str(state)]
    options += ["--job-name", "sg-hf", "--sbatch", "time=30"]
    result = CliRunner().invoke(main, ["submit", *options, "--", *command])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()  # the "submitted job ..." note goes to stderr


def checkpoints(folder: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*") if p.is_dir()}


def test_guarded_trainer_on_slurm_is_drained_requeued_and_resumed_bit_identically(
    cluster: LocalCluster, client: CommandSlurmClient, tmp_path: Path
) -> None:
    import hf_slurm_train

    reference = clean_reference(tmp_path / "reference")
    runs = tmp_path / "runs"
    run, out, state = runs / "hf-run", runs / "hf-out", tmp_path / "state"
    log = install_epilog(cluster, tmp_path, runs)
    job = submit(run, out, state)

    # the guard stops the run and names node2
    rd = RunDir(run)
    wait_for(lambda: list(rd.alarms_dir.glob("*.json")), JOB_TIMEOUT_S, f"job {job}'s alarm")
    alarms, errors = rd.alarms()
    assert not errors and len(alarms) == 1, (alarms, errors)
    (alarm,) = alarms
    assert alarm.verdict == "sdc" and list(alarm.suspect_nodes) == ["node2"]
    assert alarm.job_id == job and alarm.restart_count == 0
    assert (alarm.step, alarm.last_verified_step) == (6, 4)  # replays at 0, 2, 4 passed

    # node2 drained, with a reason an admin can read
    reason = wait_for(
        lambda: (
            (client.node("node2").reason or "").startswith(REASON_PREFIX)
            and client.node("node2").reason
        ),
        60,
        "node2 drained by slurm-guard",
    )
    for part in (f"job {job}", f"step {alarm.step}", f"check {alarm.check}"):
        assert part in reason, reason
    assert f"alarm {alarm.alarm_id}" in reason, reason
    drained = {n.name for n in client.nodes() if (n.reason or "").startswith(REASON_PREFIX)}
    assert drained == {"node2"}

    # requeued without node2, resumed, finished
    wait_running_without(client, job, "node2")
    info = wait_for(
        lambda: (i := client.job(job)) is not None and i.state in FINISHED and i,
        JOB_TIMEOUT_S,
        f"job {job} to end",
    )
    logs = "\n".join(p.read_text(errors="replace") for p in run.glob("slurm-*.out"))
    assert info.state == "COMPLETED", logs[-4000:]
    result = json.loads((run / hf_slurm_train.RESULT_FILE).read_text())
    assert result["restart_count"] == 1 and "node2" not in result["nodes"]
    assert result["global_step"] == hf_slurm_train.STEPS

    # resumed from checkpoint-2, which the passing replays at 2 and 4 vouch for (the default
    # trust_replays=2); every newer one is in quarantine, never loaded, among them
    # checkpoint-6, written after the faulty update of step 5
    resumed = result["resumed_from"]
    assert resumed == hf_slurm_train.TRUSTED_STEP, logs[-4000:]
    quarantine = out / "slurm-guard-quarantine" / alarm.alarm_id
    assert checkpoints(quarantine) == set(range(resumed + 1, alarm.step + 1))
    assert checkpoints(out) == set(range(1, hf_slurm_train.STEPS + 1))  # the rerun's own

    # bit-identical to the clean run
    assert result["sha"] == reference

    # `slurm-guard status --json` tells the story
    status = CliRunner().invoke(main, ["status", str(run), "--state-dir", str(state), "--json"])
    assert status.exit_code == 0, status.output
    view = json.loads(status.output)
    (seen,) = view["alarms"]
    assert seen["suspect_nodes"] == ["node2"] and seen["decision"] == "act"
    done = Counter(a["op"] for a in view["controller_actions"] if a["result"] == "done")
    for op in ("drain", "requeue_hold", "exclude", "release"):
        assert done[op] == 1, view["controller_actions"]  # epilog and in-job step: once
    assert view["job"]["restart_count"] == 1 and "node2" in view["job"]["excluded_nodes"]
    (resume,) = view["resumes"]
    assert resume["resumed_from_step"] == resumed and resume["restart_count"] == 1

    # the epilog ran after both ends of the job: on node1-3, then without node2
    def ends() -> list[list[str]] | None:
        line = rf"^\S+ \S+ job={job} restart=\d+ exit=\S+ nodes=(\S+)$"
        found = re.findall(line, log.read_text(), re.M)
        return [sorted(expand_hostlist(n)) for n in found] if len(found) >= 2 else None

    seen_ends = wait_for(ends, 60, "the epilog after the rerun")
    assert seen_ends == [["node1", "node2", "node3"], ["node1", "node3", "node4"]], seen_ends
