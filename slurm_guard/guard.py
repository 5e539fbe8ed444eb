"""The Guard: a DDP training step with silent-data-corruption checks around it.

One `guard.step(batch)` is forward, backward, the checks, and the optimizer step only if every
check passed. The checks themselves, the set-up and the checkpoints live in `slurm_guard.core`,
which every entry point shares; this class only owns the loop of one step.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from slurm_guard.checks.replay import Microbatches
from slurm_guard.checks.verdicts import bits_to_float
from slurm_guard.comm.errors import CollectiveError, say_once
from slurm_guard.core import checkpoints, decide
from slurm_guard.core.base import live_guards
from slurm_guard.core.calls import NO_SYNC
from slurm_guard.core.session import GuardCore
from slurm_guard.errors import EXIT_SDC, GuardError, SilentDataCorruption
from slurm_guard.fingerprint import as_int

logger = logging.getLogger(__name__)


class Guard(GuardCore):
    """Guarded DDP training. See the README for the five lines a training loop needs.

    Args:
        model: the DDP-wrapped model; the guard registers its communication hook on it.
        optimizer: the optimizer over the model's parameters; the guard steps and zeroes it.
        loss_fn: `loss_fn(model, batch) -> scalar tensor`, called with the DDP model for the
            step and with the plain module for replays.
        run_dir: a directory on a filesystem shared by every node and by the controller.
        config: what to check and how often.
        scaler: the GradScaler for mixed precision, if any. The guard scales the loss, steps
            through the scaler, and treats its overflow skips (non-finite gradients that a
            replay on another node reproduces) as expected, not as alarms. An enabled
            scaler's state is saved in every checkpoint and restored by `resume`.
        stateful: more state a resume must restore, by name: `{"lr_scheduler": sched,
            "data": loader}`, anything with `state_dict()` / `load_state_dict()`. Saved per
            rank in every checkpoint under its seal; the names must be the same on every rank.
    """

    def step(self, batch: Any) -> float:
        """Forward, backward, checks and, only if they pass, the optimizer step.

        Returns:
            The step's loss as a Python float (the mean over microbatches for `Microbatches`).
            It is taken from the verdict row every rank gathers anyway, so returning it costs
            no device-to-host copy of its own (on CUDA, one copy per step in all).

        Raises:
            SilentDataCorruption: on every rank, after the alarm record is written; the update
                of this step is not applied (a vote alarm judges an update already applied).
        """
        if not self.ddp.require_backward_grad_sync:  # the same on every rank: before any collective
            raise GuardError(NO_SYNC.format(call="guard.step()"))
        plan = self.begin_step(batch)
        micro = list(batch) if isinstance(batch, Microbatches) else [batch]
        losses = []
        try:
            for i, microbatch in enumerate(micro):
                # accumulate locally, reduce once: DDP's hook (and ours) runs on the last backward
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else self.ddp.no_sync():
                    loss = self.loss(microbatch)
                    self.scaled(loss).backward()  # type: ignore[no-untyped-call]
                losses.append(loss.detach())
        except RuntimeError:
            # a DDP all-reduce failed (a peer gone, or stopped by the hang watch's verdict):
            # raise the verdict, not this rank's echo of it ("Unable to cast ..."), and not
            # chained to it: the named error is the first and only one the user sees
            try:
                self.comm.raise_verdict_of_failure()
            except GuardError as verdict:
                raise verdict from None
            raise
        result = self.finish_step(plan, losses)
        self.apply_update(plan, result)
        # OWN_LOSS of this rank's gathered row: `combined_loss` in float64 (the sum over
        # microbatches), read with the verdicts instead of a float(loss) sync per step
        return bits_to_float(self.verifier.last_loss_bits) / len(losses)

    def save_checkpoint(self, if_: bool | None = None) -> Path | None:
        """Vote, then save atomically into run_dir/checkpoints/step-N (N = completed steps).

        With `if_`, rank 0's flag decides on every rank (`agree_on`): pass "validation
        improved" as rank 0 computed it, and every rank saves or none does. Returns the path,
        or None when nothing was saved.
        """
        if if_ is not None and not self.agree_on(bool(if_), src=0):
            return None
        return checkpoints.save_checkpoint(self)

    def agree_on(self, value: Any, src: int = 0) -> Any:
        """Rank `src`'s value (JSON-able: a bool, a number, a small dict) on every rank.

        Every rank must call it, with the same `src`; use it for decisions one rank makes
        (stop early, save now), so no rank takes a branch with collectives the others skip.
        """
        return decide.agree_on(self.comm, value, src)

    def resume(self) -> int:
        """Load the trusted checkpoint; return the step to start from (0 on a fresh run).

        After an alarm, the trusted checkpoint is the newest clean one that `trust_replays`
        passing replays followed before the alarm; newer checkpoints are moved to
        quarantine/<alarm_id>/ and the alarm is marked handled, so a later restart does not roll
        back again. A checkpoint that fails to load on any rank (hash, fingerprint, unreadable
        file) is skipped for the next older one. Raises GuardError on every rank when what the
        rule needs cannot be read, or when every allowed checkpoint is damaged; the message
        names the override (`SLURM_GUARD_RESUME=fresh`).
        """
        return checkpoints.resume(self)


@contextlib.contextmanager
def exit_on_alarm() -> Iterator[None]:
    """Turn an alarm into the guard's exit code, which the sbatch template and controller read.

    The guard's collective stops (`CollectiveMismatch`, `RankFailed`, `RanksMissing`) exit
    with status 1 and one line from rank 0, their message, instead of a traceback per rank.
    A block that ends without an error is the end of the run for every guard of this process:
    each records what its injected faults changed, and rank 0 warns about a fault that changed
    no value (`GuardBase.end_run`). Every rank must leave the block the same way.
    """
    try:
        yield
        if dist.is_initialized():
            for guard in live_guards():
                guard.end_run()
    except SilentDataCorruption as exc:
        # every rank raises the same alarm: rank 0 says it once (the record names every rank)
        _stop(f"stopped by slurm-guard: {exc}", EXIT_SDC)
    except CollectiveError as exc:
        # a named stop every rank reached together (a porting mistake, a rank gone, a hang):
        # its message says what to do; one line from rank 0 instead of a traceback per rank
        say_once(dist.get_rank() if dist.is_initialized() else 0, exc)
        _stop(None, 1)


def _stop(message: str | None, code: int) -> NoReturn:
    if message is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.error("%s", message)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)


__all__ = ["Guard", "as_int", "exit_on_alarm"]
