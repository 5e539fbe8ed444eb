"""The update check: another node recomputes a shard's optimizer step (FSDP2, FSDP2 + TP).

Without replica groups no two ranks hold the same shard, so no vote compares the state after
the update: a wrong update, or a bit flipped in a shard after it, is all-gathered to every rank
alike, every later replay agrees with it, and conservation holds. On vote steps each rank
therefore sends what its shard's update depends on (its parameter shards, their gradients as
the optimizer sees them, the optimizer state for them, each param_group's hyperparameters and
the implementation the optimizer picks: foreach, fused or single-tensor) to its replay partner
on another node. After the step, that checker runs a shadow optimizer of the same class on
plain tensors and fingerprints the result exactly as the owner fingerprints its own shard;
one small all-gather compares them. A disagreement is settled as the replays settle theirs: a
third data-parallel index recomputes and the odd one out is named (`sdc`); with two indices it
is `ambiguous`.

Where this cannot recompute the update (an optimizer outside torch.optim's own, one with step
hooks, anything but plain values in its param_groups), the guard skips it with a named warning at
construction: every rank decides alike from its own optimizer, before any collective.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from slurm_guard.checks.verdicts import Finding, ReplayResult
from slurm_guard.comm.errors import RankFailed
from slurm_guard.fingerprint.tree import as_hex, lanes_to_int
from slurm_guard.protocol import Check
from slurm_guard.sharded.snapshot_state import flatten, unflatten
from slurm_guard.sharded.snapshots import exchange_flat
from slurm_guard.sharded.verdict import judge_by_tp
from slurm_guard.sharded.vote import optimizer_tensors, shard

if TYPE_CHECKING:
    from torch import nn

    from slurm_guard.checks.rows import LedgerFn
    from slurm_guard.comm.collective import Collective
    from slurm_guard.comm.topology import Topology
    from slurm_guard.config import GuardConfig
    from slurm_guard.fingerprint.tree import Fingerprinter
    from slurm_guard.sharded.layout import Layout

logger = logging.getLogger(__name__)

# torch.optim classes whose step is not a function of (parameters, gradients, state, groups)
NOT_REPLAYABLE = ("LBFGS", "SparseAdam")
Payload = tuple[bytes, torch.Tensor]


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why this optimizer's update cannot be recomputed on plain tensors, or None."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not cls.__module__.startswith("torch.optim.") or cls.__name__ in NOT_REPLAYABLE:
        return f"{name} (only torch.optim's own optimizers, not LBFGS or SparseAdam)"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return f"{name} with step hooks (a hook's effect is not recomputed)"
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            if not _plain(value):  # a callable, a tensor, an object the checker cannot load
                kind = type(value).__name__
                return f"{name} whose param_groups[{i}][{key!r}] is a {kind}, not a plain value"
            if key == "differentiable" and value:
                return f"{name} with differentiable=True"
    return None


def _plain(value: object) -> bool:
    """A number, string, bool or None, or a tuple or list of them (what travels as is)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def implementation(group: dict[str, Any]) -> dict[str, bool]:
    """The implementation the optimizer's step picks for `group`, decided as torch.optim's own
    default does (`_default_to_fused_or_foreach` on the parameters that have gradients), so
    that the shadow uses the same kernels and rounds alike."""
    fused = bool(group.get("fused"))
    foreach = group.get("foreach")
    if not fused and foreach is None:
        with_grad = [p for p in group["params"] if p.grad is not None]
        _, foreach = _default_to_fused_or_foreach(with_grad, False, use_fused=False)
    choice = {}
    if "foreach" in group:
        choice["foreach"] = bool(foreach) and not fused
    if "fused" in group:
        choice["fused"] = fused
    return choice


def update_inputs(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What this rank's update depends on, as plain local tensors viewing the live ones."""
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    groups: list[dict[str, Any]] = []
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in index]
        if missing:
            raise ValueError("the optimizer holds a parameter that is not the model's")
        hyper = {k: v for k, v in group.items() if k != "params"}
        members = [index[id(p)] for p in group["params"]]
        groups.append({"params": members, "hyper": {**hyper, **implementation(group)}})
        for i, p in zip(members, group["params"], strict=True):
            if p in optimizer.state:
                state[str(i)] = {
                    k: shard(v.detach()) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[p].items()
                }
    return {
        "class": type(optimizer).__qualname__,
        "params": [shard(p.detach()) for p in params],
        "grads": [None if p.grad is None else shard(p.grad.detach()) for p in params],
        "groups": groups,
        "state": state,
    }


def recompute(
    inputs: dict[str, Any], cls: type[torch.optim.Optimizer], fingerprinter: Fingerprinter
) -> torch.Tensor:
    """The owner's update, run by a shadow optimizer in place on `inputs` (the received
    buffer's views: no second copy); the result's fingerprint, as
    `ShardedGuard.shard_fingerprint` takes the owner's (parameters, then optimizer state)."""
    if inputs["class"] != cls.__qualname__:
        raise ValueError(f"the owner's optimizer is {inputs['class']}, this rank's {cls}")
    params = list(inputs["params"])
    for p, grad in zip(params, inputs["grads"], strict=True):
        p.grad = grad
    groups = [{**g["hyper"], "params": [params[i] for i in g["params"]]} for g in inputs["groups"]]
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in groups[0].items() if k in accepted and k != "params"}
    shadow = cls(groups, **defaults)
    for key, values in inputs["state"].items():
        shadow.state[params[int(key)]] = dict(values)
    shadow.step()
    for p in params:
        p.grad = None
    return fingerprinter.tensors([*params, *optimizer_tensors(shadow)])


class UpdateCheck:
    """The update check of one ShardedGuard (see the module docstring); every method is
    entered by every rank in the same order."""

    def __init__(
        self,
        *,
        comm: Collective,
        topology: Topology,
        layout: Layout,
        shifts: tuple[int | None, int | None],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        fingerprinter: Fingerprinter,
        ledger: LedgerFn,
        config: GuardConfig,
    ) -> None:
        self.comm, self.topology, self.layout = comm, topology, layout
        self.first, self.settling = shifts
        self.model, self.optimizer = model, optimizer
        self.fingerprinter, self.ledger, self.config = fingerprinter, ledger, config
        needed = config.update_check and layout.replicas == 1 and self.first is not None
        self.skipped = unsupported(optimizer) if needed else None
        self.active = needed and self.skipped is None
        if self.skipped is not None and comm.rank == 0:  # once, at construction
            logger.warning(
                "no update check (GuardConfig.update_check): it cannot recompute the update of "
                "%s, so the state after each update stays unchecked in this %s layout "
                "(docs/coverage.md)",
                self.skipped,
                layout.describe(),
            )
        self._sent: Payload | None = None  # this rank's inputs, kept for a settling round
        self._received: tuple[int, Payload] | None = None  # (owner, its inputs)
        self._problem: str | None = None

    def send(self, step: int) -> None:
        """Before the optimizer step of a vote step: this rank's inputs to its checker."""
        if not self.active or not self.config.is_vote_step(step):
            return
        device = self.comm.device
        sent: Payload = (b"", torch.empty(0, dtype=torch.uint8, device=device))
        self._problem = None
        try:  # a rank that cannot pack its inputs sends none; the check then fails on all
            sent = flatten(update_inputs(self.model, self.optimizer), device)
        except Exception as exc:
            logger.exception("rank %d: cannot pack its update's inputs", self.comm.rank)
            self._problem = f"rank {self.comm.rank} cannot send its update's inputs: {exc}"
        self._sent = sent
        self._received = self._exchange(self.first, sent, f"step {step}: update check")

    def _exchange(self, shift: int | None, sent: Payload, what: str) -> tuple[int, Payload]:
        pairs = self.layout.pairs(shift or 0)
        checker = next(r for o, r in pairs if o == self.comm.rank)
        owner = next(o for o, r in pairs if r == self.comm.rank)
        received = exchange_flat(self.comm, {checker: sent}, [owner], what)
        return owner, received[owner]

    @property
    def pending(self) -> bool:
        """Inputs were exchanged this step: `check` is due after the update (every rank)."""
        return self._received is not None

    def check(self, step: int, own: torch.Tensor) -> Finding | None:
        """After the update: compare each checker's recomputation with its owner's `own`
        shard fingerprint (every rank, on the step whose inputs `send` sent)."""
        if self._received is None or self._sent is None:
            return None
        received, sent, self._received, self._sent = self._received, self._sent, None, None
        try:
            first = self._round(step, received, own, "first")
            if all(r.matches for r in first) or self.settling is None:
                second = None
            else:
                again = self._exchange(self.settling, sent, f"step {step}: update check settling")
                second = self._round(step, again, own, "settling")
        finally:
            self._problem = None
        finding = judge_by_tp(first, second, self.topology, self.layout)
        detail: dict[str, object] = {"comparisons": len(first)}
        if self.comm.rank == 0:
            detail["fingerprint"] = as_hex(own)
        self.ledger(step, Check.UPDATE, finding is None, detail)
        if finding is None:
            return None
        return dataclasses.replace(
            finding,
            check=Check.UPDATE,
            message=f"the optimizer update recomputed on another rank: {finding.message}",
        )

    def _round(
        self, step: int, received: tuple[int, Payload], own: torch.Tensor, purpose: str
    ) -> list[ReplayResult]:
        """Recompute the owner's update, gather [own lanes, recomputed lanes, owner, failed]."""
        owner, (layout, flat) = received
        key = f"update-check/{step}/{purpose}"
        lanes = torch.zeros_like(own)
        problem = self._problem
        if problem is None:
            try:
                if not layout:
                    raise ValueError(f"rank {owner} sent no inputs")
                inputs = unflatten(layout, flat)
                lanes = recompute(inputs, type(self.optimizer), self.fingerprinter)
            except Exception as exc:
                logger.exception("rank %d: recomputing rank %d's update", self.comm.rank, owner)
                problem = f"recomputing rank {owner}'s update: {type(exc).__name__}: {exc}"
        if problem is not None:
            self.comm.post_cause(key, problem)
        device, n = self.comm.device, own.numel()
        mine = torch.tensor([owner, int(problem is not None)], dtype=torch.int64, device=device)
        lanes = lanes.reshape(-1).to(device=device, dtype=torch.int64)
        row = torch.cat([own.reshape(-1).to(device=device, dtype=torch.int64), lanes, mine])
        rows = self.comm.all_gather_rows(row, f"step {step}: update check ({purpose})")
        failed = [r for r, values in enumerate(rows) if values[2 * n + 1]]
        if failed:
            node, cause = self.comm.read_cause(key, failed[0])
            raise RankFailed(f"step {step}: the update check", failed, node, cause)
        return [
            ReplayResult(
                owner=values[2 * n],
                replayer=r,
                owner_loss=0,
                owner_grad=lanes_to_int(rows[values[2 * n]][:n]),
                replay_loss=0,
                replay_grad=lanes_to_int(values[n : 2 * n]),
            )
            for r, values in enumerate(rows)
        ]
