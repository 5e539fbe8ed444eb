"""Training runs whose `Guard(stateful=...)` state holds numpy (spawned processes import this).

The usual resumable sampler draws its order from a numpy RNG and saves that RNG's state. A
resume loads stateful files with `torch.load(weights_only=True)`, which refuses numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import SMALL, weights

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss


class NumpySampler:
    """Batches drawn from a numpy RNG (per rank), its state saved as `get_state()` gives it."""

    def __init__(self, rank: int) -> None:
        self.rng = np.random.RandomState(100 + rank)
        self.drawn = np.int64(0)

    def next_batch(self) -> dict[str, torch.Tensor]:
        start = torch.from_numpy(self.rng.randint(0, SMALL.vocab, (4, 1)))
        self.drawn += 1
        seq = (start + 3 * torch.arange(SMALL.context + 1)) % SMALL.vocab
        return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.set_state(state["rng"])
        self.drawn = state["drawn"]


class GeneratorInside:
    """A state no weights_only load accepts: the numpy Generator object itself."""

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": 1, "order": {"rng": np.random.default_rng(0)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def sampled_loop(run_dir: str, steps: int, save_at: int) -> dict[str, Any]:
    """Resume, train to `steps` with a checkpoint after `save_at` steps; the final weights and
    the sampler's next draw."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sampler = NumpySampler(dist.get_rank())
    config = sg.GuardConfig(replay_every=2, schedule="fixed")
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=config, stateful={"sampler": sampler})
    try:
        start = guard.resume()
    except sg.GuardError as exc:
        return {"resume_error": f"{type(exc).__name__}: {exc}"}
    for step in range(start, steps):
        if step == save_at:
            guard.save_checkpoint()
        guard.step(sampler.next_batch())
    return {
        "start": start,
        "final": weights(model),
        "drawn": int(sampler.drawn),
        "next": sampler.rng.randint(0, 1 << 30),
    }


def unloadable_state(run_dir: str) -> dict[str, Any]:
    """A save whose stateful state a resume could not load: the error, on every rank."""
    torch.manual_seed(0)
    ddp = DDP(TinyGPT(SMALL))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sampler = NumpySampler(dist.get_rank())
    stateful = {"sampler": GeneratorInside()}
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, stateful=stateful)
    guard.step(sampler.next_batch())
    try:
        guard.save_checkpoint()
    except sg.GuardError as exc:
        return {"error": str(exc)}
    return {"error": None}
