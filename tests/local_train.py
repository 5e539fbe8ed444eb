"""A guarded training script as a user writes one, for `slurm-guard local` (test_local_cli.py):
gloo from env://, the device from LOCAL_RANK, faults only from SLURM_GUARD_INJECT.

A third argument names a rank whose interpreter is slow to finalize (4 s in a `__del__` at
module teardown), so that rank 0, the store's host, exits while that rank is finalizing. A
fourth, `slow-exit`, makes that rank sleep 2 s before it exits instead; `raise-at-3` makes it
raise at step 3 instead, under the watchdog (seconds) given fifth."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss


class _SlowToFinalize:
    def __del__(self) -> None:
        time.sleep(4.0)


def main(run_dir: str, steps: int, raise_on: int | None = None, watchdog: float = 300.0) -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank = int(os.environ["RANK"])
    assert int(os.environ["LOCAL_RANK"]) == rank % int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    config = TinyGPTConfig(vocab=32, context=8, width=16, heads=2, layers=1, dropout=0.0)
    ddp = DDP(TinyGPT(config))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    guard = sg.Guard(
        ddp, opt, lm_loss, run_dir, config=sg.GuardConfig(replay_every=2, watchdog_seconds=watchdog)
    )
    gen = torch.Generator().manual_seed(rank)
    with sg.exit_on_alarm():
        for step in range(guard.resume(), steps):
            if rank == raise_on and step == 3:
                raise RuntimeError(f"rank {rank}: the user's code failed at step 3")
            seq = torch.randint(0, config.vocab, (4, config.context + 1), generator=gen)
            guard.step({"tokens": seq[:, :-1], "targets": seq[:, 1:]})
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[4] == "raise-at-3":
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[5]))
        sys.exit(0)
    main(sys.argv[1], int(sys.argv[2]))
    if len(sys.argv) > 4 and sys.argv[4] == "slow-exit":
        if int(os.environ["RANK"]) == int(sys.argv[3]):
            time.sleep(2.0)
    elif len(sys.argv) > 3 and int(os.environ["RANK"]) == int(sys.argv[3]):
        slow = _SlowToFinalize()  # a module global: collected while the interpreter finalizes
