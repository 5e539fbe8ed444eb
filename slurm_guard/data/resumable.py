"""`sg.resumable(loader, start_step)`: the epoch loop over a DataLoader, re-entered mid-epoch.

The most common loop is epochs over a `DataLoader` with a `DistributedSampler`. A resume hands
back a step, not an epoch and a batch offset, and a resumed run is bit-identical to the run
that was not interrupted only if it sees the same batches with the same random state. So:

- the step is global: epoch = step // len(loader), offset = step % len(loader);
- `set_epoch(epoch)` is called on the sampler (a `DistributedSampler`, or any sampler, batch
  sampler or dataset that has it) before each epoch's iterator is made;
- on a resume the first epoch starts at the offset by skipping *indices*, not batches: the
  loader's batch sampler (or sampler) is iterated and the first `offset` index lists dropped,
  so the skipped samples are never loaded, with workers or without;
- each epoch's indices are drawn when its iterator is made (not lazily at the first batch), so
  an unseeded `RandomSampler`'s shuffle is drawn under the seeded RNG below as well;
- making a DataLoader iterator draws a seed from the global RNG (its workers' base seed, and
  a `RandomSampler`'s permutation seed when it has no generator). That draw would shift the
  training RNG (dropout) by where the iterator is made, which differs between a run and its
  resume. `resumable` makes every epoch's iterator with the global RNG forked and seeded from
  `(seed, epoch)`, so the draw depends on the epoch alone and the training RNG is untouched.

Anything that is not a `DataLoader` over a map-style dataset (a list of batches, an iterable
dataset) is skipped by iterating it: those skipped batches are loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from slurm_guard.errors import GuardError

_SEED_MIX = 0x9E3779B97F4A7C15  # a fixed odd constant: (seed, epoch) -> one 63-bit seed


class _Indices:
    """An epoch's index lists (or indices), drawn up front: the sampler's random draws happen
    when `resumable` makes the iterator, under its seeded RNG, not at the first batch."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def _set_epoch(loader: Iterable[Any], epoch: int) -> None:
    """`set_epoch` on every part of the loader that has one (each object once)."""
    parts = [
        getattr(loader, "sampler", None),
        getattr(loader, "batch_sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
        getattr(loader, "dataset", None),
    ]
    done: set[int] = set()
    for part in parts:
        set_epoch = getattr(part, "set_epoch", None)
        if part is not None and id(part) not in done and callable(set_epoch):
            done.add(id(part))
            set_epoch(epoch)


def _epoch_seed(seed: int, epoch: int) -> int:
    return ((seed * _SEED_MIX) ^ (epoch * 0x2545F4914F6CDD1D + 1)) % (2**63 - 1)


def _iterator(loader: Iterable[Any], skip: int, seed: int, epoch: int) -> Iterator[Any]:
    """The epoch's iterator, made under a forked global RNG seeded from (seed, epoch), with
    the first `skip` batches dropped by index where the loader allows it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_epoch_seed(seed, epoch))
        generator = getattr(loader, "generator", None)
        if isinstance(generator, torch.Generator):
            generator.manual_seed(_epoch_seed(seed, epoch))
        if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
            # DataLoader forbids setting its sampler after construction; the iterator reads it
            # once when it is made (`_index_sampler`), so the real one is back right after.
            name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
            real = getattr(loader, name)
            object.__setattr__(loader, name, _Indices(list(real)[skip:]))
            try:
                return iter(loader)
            finally:
                object.__setattr__(loader, name, real)
        it = iter(loader)
    for _ in range(skip):  # not a DataLoader over indices: the skipped batches are loaded
        next(it, None)
    return it


def resumable(
    loader: Iterable[Any], start_step: int = 0, *, steps: int | None = None, seed: int = 0
) -> Iterator[tuple[int, Any]]:
    """Yield `(step, batch)` from `start_step` on, across epochs, until `steps` (or forever).

    Args:
        loader: a DataLoader (any sampler; `set_epoch` is called where it exists) or any
            sized iterable of batches. Its length is the number of batches per epoch.
        start_step: `guard.resume()`'s answer: 0 on a fresh run.
        steps: stop before this step (None: run until the caller breaks).
        seed: the seed of each epoch's iterator (workers' base seed, an unseeded
            `RandomSampler`'s shuffle): derived from `(seed, epoch)`, the same in a resume.

    Raises:
        GuardError: a loader without a length, an empty loader, or a negative start.
    """
    if not isinstance(loader, Sized):
        raise GuardError(
            f"sg.resumable needs a loader with a length (batches per epoch), got "
            f"{type(loader).__name__}; give a DataLoader over a map-style dataset or a list"
        )
    per_epoch = len(loader)
    if per_epoch <= 0:
        raise GuardError("sg.resumable: the loader is empty (0 batches per epoch)")
    if not isinstance(start_step, int) or isinstance(start_step, bool) or start_step < 0:
        raise GuardError(f"sg.resumable: start_step must be an int >= 0, got {start_step!r}")
    step = start_step
    epoch, offset = divmod(step, per_epoch)
    while steps is None or step < steps:
        _set_epoch(loader, epoch)
        it = _iterator(loader, offset, seed, epoch)
        whole = False
        try:
            for batch in it:
                yield step, batch
                step += 1
                if steps is not None and step >= steps:
                    return  # before the next batch is loaded
            whole = True
        finally:
            if not whole and not getattr(loader, "persistent_workers", False):
                _close(it)  # stopped mid-epoch: its workers end now, not at collection
        epoch, offset = epoch + 1, 0


def _close(it: Iterator[Any]) -> None:
    """Shut a worker pool down now (not at garbage collection) when the loop stops early."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
