"""GuardedTrainer under real Slurm: the sbatch template, the shipped epilog, a bad GPU on node2.

`slurm-guard submit` renders the real template for 3 of the 4 nodes (CPU, one task per node)
with tests/hf_slurm_train.py as the training command: the real HF Trainer, a tiny GPT-2, a
`checkpoint-N` after every step and a persistent gradient fault on node2 from step 5. The
shipped EpilogSlurmctld is installed, as a site installs it; the template's in-job `recover`
step shares its journal, so whichever comes first acts and nothing is done twice. The test
follows the whole loop (tests/framework_slurm.py): the alarm names node2, node2 is drained with
a readable reason, the job comes back without node2, the Trainer resumes from the newest
checkpoint the guard trusts (the ones written after the fault are quarantined), finishes, and
its weights equal a clean run's bit for bit (computed here with `run_local`, 3 ranks of the
same function, one thread each).

Skipped without transformers/accelerate, failed instead under SLURM_GUARD_REQUIRE_INTEGRATIONS=1
(test_integration_hf's check); skipped without Slurm unless SLURM_GUARD_REQUIRE_SLURM=1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import framework_slurm as fs
import pytest
from support.local_cluster import LocalCluster
from test_epilog_slurm import install_epilog
from test_integration_hf import HAVE, NODES

from slurm_guard.slurm.client import CommandSlurmClient

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE, reason="needs the [hf] extra (transformers, accelerate)"),
]

SCRIPT = Path(__file__).resolve().parent / "hf_slurm_train.py"


@pytest.fixture
def cluster(idle_slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield idle_slurm_cluster
    idle_slurm_cluster.write_epilog(None)


def checkpoints(folder: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*") if p.is_dir()}


def test_guarded_trainer_on_slurm_is_drained_requeued_and_resumed_bit_identically(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    import hf_slurm_train

    client = CommandSlurmClient(env=cluster.env())
    reference = fs.clean_reference(
        hf_slurm_train.clean, hf_slurm_train.STEPS, tmp_path / "reference", NODES
    )
    runs = tmp_path / "runs"
    run, out, state = runs / "hf-run", runs / "hf-out", tmp_path / "state"
    log = install_epilog(cluster, tmp_path, runs)
    job = fs.submit(SCRIPT, run, out, state, "sg-hf")

    alarm = fs.the_alarm(run, job, step=6, last_verified_step=4)  # replays at 0, 2, 4 passed
    fs.drained_with_reason(client, job, alarm)
    result = fs.rerun_result(client, job, run, hf_slurm_train.RESULT_FILE)
    assert result["global_step"] == hf_slurm_train.STEPS

    # resumed from checkpoint-2, which the passing replays at 2 and 4 vouch for (the default
    # trust_replays=2); every newer one is in quarantine, never loaded, among them
    # checkpoint-6, written after the faulty update of step 5
    resumed = result["resumed_from"]
    assert resumed == hf_slurm_train.TRUSTED_STEP
    quarantine = out / "slurm-guard-quarantine" / alarm.alarm_id
    assert checkpoints(quarantine) == set(range(resumed + 1, alarm.step + 1))
    assert checkpoints(out) == set(range(1, hf_slurm_train.STEPS + 1))  # the rerun's own

    assert result["sha"] == reference  # bit-identical to the clean run
    fs.status_tells_the_story(run, state, resumed)
    fs.epilog_ran_after_both_ends(log, job)
