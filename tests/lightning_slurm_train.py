"""GuardCallback as a Slurm job: the training command tests/test_integration_lightning_slurm.py
submits.

    slurm-guard submit --run-dir RUN --nodes 3 -- python tests/lightning_slurm_train.py \\
        --out OUT --fault-node node2

The script never joins the process group itself: Lightning does, at the MASTER_ADDR and
MASTER_PORT that the sbatch template's `slurm-guard task` exports from Slurm's
(`framework_results.slurm_task_main(join=False)`). It runs `lightning_workers.train`, the very run
tests/test_integration_lightning.py uses, with Lightning's own `SLURMEnvironment` (detected
under srun: one device a node, `num_nodes` from the exported `LOCAL_WORLD_SIZE`). The alarm is
left to GuardCallback's default under Slurm: exit 86, which the epilog reads. A requeued job
runs the same command, and `trainer.fit` resumes from the `.ckpt` the guard trusts. Rank 0
writes `lightning-result.json` into the run directory.

`clean(root)` is the same run without the fault, for `run_local`: the reference the resumed
job's weights must equal bit for bit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from framework_results import slurm_task_main

import slurm_guard as sg

STEPS = 9
FAULT_STEP = 4
TRUSTED_STEP = 3
"""The `.ckpt` the requeued job must resume from, by the resume rule (see `run`)."""
RESULT_FILE = "lightning-result.json"


def run(
    run_dir: str,
    out: str,
    fault_node: str | None = None,
    fault_step: int = FAULT_STEP,
    exit_on_alarm: bool | None = None,
) -> dict[str, Any]:
    """9 steps (3 epochs of 3), a replay every 3, a `.ckpt` every 3 steps (at epoch ends, where
    Lightning resumes a DataLoader exactly); optionally a persistent gradient fault on
    `fault_node` from `fault_step` (it stays with the node, as a broken GPU does).

    With the fault from step 4 the replays at 0 and 3 pass and the one at 6 raises the alarm
    (`epoch=1-step=6.ckpt`, saved after the faulty updates, must never be loaded).
    `trust_replays=1` trusts the `.ckpt` of step 3, which the passing replay at 3 vouches for:
    a real checkpoint to resume from (the default 2 would trust only a start from step 0)."""
    import lightning_workers

    # One thread per rank under srun as under run_local: a different thread count adds in a
    # different order, and the resumed weights must equal the reference's bit for bit.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    faults: tuple[sg.Fault, ...] = ()
    if fault_node:
        faults = (sg.Fault(kind="grad-scale", node=fault_node, step=fault_step, persistent=True),)
    config = sg.GuardConfig(replay_every=3, schedule="fixed", trust_replays=1, faults=faults)
    return lightning_workers.train(
        out, run_dir, STEPS, config, save_every=3, exit_on_alarm=exit_on_alarm
    )


def clean(root: str) -> dict[str, Any]:
    """The reference: the same run, no fault, uninterrupted (for `run_local`)."""
    return run(f"{root}/clean-run", f"{root}/clean-out", exit_on_alarm=False)


def main(argv: Sequence[str] | None = None) -> int:
    return slurm_task_main(__doc__, run, RESULT_FILE, FAULT_STEP, argv, join=False)


if __name__ == "__main__":
    sys.exit(main())
