"""GuardCallback under real Slurm: the sbatch template, the shipped epilog, a bad GPU on node2.

`slurm-guard submit` renders the real template for 3 of the 4 nodes (CPU, one task per node)
with tests/lightning_slurm_train.py as the training command: the real Lightning Trainer with
its own SLURMEnvironment (auto-requeue on, as Lightning sets it under srun), the small MLP of
tests/lightning_workers.py, a `.ckpt` every 3 steps (ModelCheckpoint, `last.ckpt` too) and a
persistent gradient fault on node2 from step 4. The shipped EpilogSlurmctld is installed. The
test follows the whole loop (tests/framework_slurm.py): the alarm names node2, node2 is drained
with a readable reason, the job comes back without node2, `trainer.fit` resumes from the `.ckpt`
the guard trusts (the ones written after the fault, `last.ckpt` among them, are quarantined),
finishes, and its weights equal a clean run's bit for bit (`run_local`, 3 ranks, one thread
each).

Skipped without lightning, failed instead under SLURM_GUARD_REQUIRE_INTEGRATIONS=1
(test_integration_lightning's check); skipped without Slurm unless SLURM_GUARD_REQUIRE_SLURM=1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import framework_slurm as fs
import pytest
from support.local_cluster import LocalCluster
from test_epilog_slurm import install_epilog
from test_integration_lightning import HAVE, NODES

from slurm_guard.slurm.client import CommandSlurmClient

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE, reason="needs the [lightning] extra"),
]

SCRIPT = Path(__file__).resolve().parent / "lightning_slurm_train.py"


@pytest.fixture
def cluster(idle_slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield idle_slurm_cluster
    idle_slurm_cluster.write_epilog(None)


def ckpts(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.ckpt")}


def test_guard_callback_on_slurm_is_drained_requeued_and_resumed_bit_identically(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    import lightning_slurm_train

    client = CommandSlurmClient(env=cluster.env())
    reference = fs.clean_reference(
        lightning_slurm_train.clean, lightning_slurm_train.STEPS, tmp_path / "reference", NODES
    )
    runs = tmp_path / "runs"
    run, out, state = runs / "pl-run", runs / "pl-out", tmp_path / "state"
    log = install_epilog(cluster, tmp_path, runs)
    job = fs.submit(SCRIPT, run, out, state, "sg-lightning")

    alarm = fs.the_alarm(run, job, step=6, last_verified_step=3)  # replays at 0, 3 passed
    fs.drained_with_reason(client, job, alarm)
    result = fs.rerun_result(client, job, run, lightning_slurm_train.RESULT_FILE)
    assert result["global_step"] == lightning_slurm_train.STEPS

    # resumed from the .ckpt of step 3 (trust_replays=1: the passing replay at 3 vouches for
    # it); the ones saved after the faulty updates of steps 4 and 5 are in quarantine
    resumed = result["resumed_from"]
    assert resumed == lightning_slurm_train.TRUSTED_STEP
    quarantine = out / "slurm-guard-quarantine" / alarm.alarm_id
    assert ckpts(quarantine) == {"epoch=1-step=6.ckpt", "last.ckpt"}
    # the rerun's own; the one ModelCheckpoint saves inside step 3 after the resume (after its
    # first microbatch, without the accumulated gradient) is left unsealed
    folder = out / "checkpoints"
    assert ckpts(folder) == {
        "epoch=0-step=3.ckpt",
        "epoch=1-step=3.ckpt",
        "epoch=1-step=6.ckpt",
        "epoch=2-step=9.ckpt",
        "last.ckpt",
    }
    assert {p.name for p in folder.glob("*.slurm-guard.json")} == {
        f"{name}.slurm-guard.json" for name in ckpts(folder) - {"epoch=1-step=3.ckpt"}
    }

    assert result["sha"] == reference  # bit-identical to the clean run
    fs.status_tells_the_story(run, state, resumed)
    fs.epilog_ran_after_both_ends(log, job)
