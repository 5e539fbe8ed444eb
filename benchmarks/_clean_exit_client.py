"""A small guarded epoch-loop client for `clean_exit.py`: what a user ports first.

gloo from env:// (as `slurm-guard local` sets it up), a `DataLoader` over a seeded dataset with
a `DistributedSampler`, `set_epoch` at each epoch, `guard.step` per batch, a checkpoint at
each epoch's end, a result file at the end. Arguments: RUN_DIR EPOCHS [WORKERS].
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import slurm_guard as sg


def main(run_dir: str, epochs: int, workers: int) -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(m: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    guard = sg.Guard(model, opt, loss_fn, run_dir, config=sg.GuardConfig(replay_every=4))
    per_epoch = len(loader)
    step = guard.resume()
    with sg.exit_on_alarm():
        for epoch in range(step // per_epoch, epochs):
            sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                if epoch * per_epoch + i < step:
                    continue
                guard.step(batch)
            guard.save_checkpoint()
    if rank == 0:
        with open(os.path.join(run_dir, "result.txt"), "w") as f:
            f.write("done\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
