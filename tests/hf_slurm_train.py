"""GuardedTrainer as a Slurm job: the training command tests/test_integration_hf_slurm.py submits.

    slurm-guard submit --run-dir RUN --nodes 3 -- python tests/hf_slurm_train.py --out OUT \\
        --fault-node node2 --fault-step 4

The script is written as for torchrun: it never joins the process group itself; the Trainer
(Accelerate) does, from the torchrun variables that the sbatch template's `slurm-guard task`
exports from Slurm's (`framework_results.slurm_task_main(join=False)`). It runs
`hf_workers.train`, the very run tests/test_integration_hf.py uses, on `$SLURM_GUARD_RUN_DIR`.
The alarm is left to GuardedTrainer's default under Slurm: exit 86, which the epilog reads. A
requeued job runs the same command, and the Trainer resumes from the `checkpoint-N` the guard
trusts. Rank 0 writes `hf-result.json` into the run directory.

`clean(root)` is the same run without the fault, for `run_local`: the reference the resumed job's
weights must equal bit for bit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from framework_results import slurm_task_main

import slurm_guard as sg

STEPS = 8
FAULT_STEP = 5
TRUSTED_STEP = 2
"""The checkpoint-N the requeued job must resume from, by the resume rule (see `run`)."""
RESULT_FILE = "hf-result.json"


def run(
    run_dir: str,
    out: str,
    fault_node: str | None = None,
    fault_step: int = FAULT_STEP,
    exit_on_alarm: bool | None = None,
) -> dict[str, Any]:
    """8 Trainer steps, a replay every 2, a checkpoint-N after every step; optionally a
    persistent gradient fault on `fault_node` from `fault_step` (it stays with the node, as a
    broken GPU does, so the requeued job without that node runs clean).

    With the fault from step 5 the replays at 0, 2 and 4 pass and the one at 6 raises the
    alarm; the default `trust_replays=2` then trusts `checkpoint-2`, the newest one two passing
    replays vouch for, a real checkpoint to resume from rather than step 0."""
    import hf_workers

    # One thread per rank under srun as under run_local: Accelerate otherwise picks
    # cores / LOCAL_WORLD_SIZE threads, and a different thread count adds in a different order.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    faults: tuple[sg.Fault, ...] = ()
    if fault_node:
        faults = (sg.Fault(kind="grad-scale", node=fault_node, step=fault_step, persistent=True),)
    config = sg.GuardConfig(replay_every=2, schedule="fixed", faults=faults)
    return hf_workers.train(out, run_dir, STEPS, config, save_steps=1, exit_on_alarm=exit_on_alarm)


def clean(root: str) -> dict[str, Any]:
    """The reference: the same run, no fault, uninterrupted (for `run_local`)."""
    return run(f"{root}/clean-run", f"{root}/clean-out", exit_on_alarm=False)


def main(argv: Sequence[str] | None = None) -> int:
    return slurm_task_main(__doc__, run, RESULT_FILE, FAULT_STEP, argv, join=False)


if __name__ == "__main__":
    sys.exit(main())
