"""A guarded script for the one-line-per-event tests: `python events_script.py RUN_DIR MODE`,
MODE `train` (a save every 2 steps) or `rank0-save` (the porting mistake: rank 0 saves alone)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import slurm_guard as sg


def main() -> None:
    run_dir, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = sg.GuardConfig(replay_every=2, vote_every=2, trust_replays=1, triage_seconds=1.0)
    guard = sg.Guard(model, opt, lambda m, b: m(b).pow(2).mean(), run_dir, config=config)
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with sg.exit_on_alarm():
        for step, batch in sg.resumable(batches, guard.resume(), steps=8):
            guard.step(batch)
            if (step + 1) % 2 == 0 and (mode == "train" or dist.get_rank() == 0):
                guard.save_checkpoint()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
