"""The one module through which the guard talks to torch.distributed.

Why one module: a collective that one rank enters and another does not is a hang, and on a
1,000-GPU job a hang costs more than a crash (every GPU idles until the backend's 10- or 30-minute
timeout, and the error names no one). Keeping every guard collective here makes three promises
checkable in one place:

- Device: every tensor handed to a collective lives on the device the group's backend needs (CUDA
  for NCCL, CPU for gloo), and a round's gathered rows come back with one device-to-host copy.
- Agreement (`Collective.agree`): a step that can fail on one rank runs, its failure flag is
  gathered, and every rank raises the same `RankFailed` naming the failing rank, its node and the
  cause, instead of the others waiting in the next collective.
- Arrival (`Collective.arrive`, the watchdog): before a round, each rank checks in through the
  process group's key-value store (the TCPStore on rank 0, not the backend), with a deadline. A rank
  that does not arrive becomes `RanksMissing` naming it; ranks that arrive at different guard calls
  (`if rank == 0: guard.save_checkpoint()`) become `CollectiveMismatch` at once. The backend's
  collective itself only starts once every rank is known to be there.

Tests switch on a stricter device check with `SLURM_GUARD_CHECK_DEVICE=cuda|cpu` (or the
`check_devices` context manager): every tensor handed to a collective must then be on that device
type, whatever the backend, so a wrong-device tensor fails loudly instead of working by accident.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from slurm_guard.comm.devices import backend_device, required_device_type
from slurm_guard.comm.errors import (
    LISTED,
    CollectiveError,
    CollectiveMismatch,
    DeviceCheckError,
    RankFailed,
    RanksMissing,
    listed,
)
from slurm_guard.errors import GuardError

# torch 2.13 renamed all_gather_into_tensor (now a deprecated alias that warns on every call);
# the oldest torch the project allows has only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CAUSE_CHARS = 600  # an exception's text as other ranks see it (the failing rank logs it whole)
LINGER_SECONDS = 30.0  # rank 0 (the store's host) waits this long for late ranks to read why


def _tag(text: str) -> int:
    """A 20-bit hash of a round's name, so a sum of them reveals ranks at different calls."""
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % ((1 << 20) - 1) + 1


_COUNT = 1 << 40  # the arrival counter adds COUNT + tag: arrivals above, tag sum below
_EMPTY = ""


class Collective:
    """The guard's collectives over one process group.

    Args:
        group: the process group (None: the default group).
        node: this rank's node name, for messages that name a failing rank.
        watchdog_seconds: how long a round waits for every rank to arrive; 0 turns the arrival
            check off (then a missing rank waits for the backend's own timeout).
    """

    _instances: ClassVar[dict[tuple[int, ...], int]] = {}

    def __init__(
        self, group: dist.ProcessGroup | None, node: str, watchdog_seconds: float = 0.0
    ) -> None:
        self.group = group
        self.node = node
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = backend_device(self.backend)
        self.watchdog_seconds = float(watchdog_seconds)
        self.seq = 0  # arrival rounds so far (equal on every rank while nothing went wrong)
        self.host_reads = 0  # device-to-host copies of gathered rows (tests count them)
        self._agreements = 0
        members = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        # Every Guard (and every sharded vote) on a group gets its own key space; ranks create
        # them in the same order, so the instance number agrees across ranks.
        instance = Collective._instances.get(members, 0)
        Collective._instances[members] = instance + 1
        space = hashlib.blake2b(repr(members).encode(), digest_size=6).hexdigest()
        self.store: Store | None
        try:
            # The store the process group was built from. torch has no public accessor; without
            # it the arrival check and the causes in RankFailed are unavailable (logged).
            base = dist.distributed_c10d._get_default_store()
            self.store = PrefixStore(f"slurm-guard/{space}/{instance}/", base)
        except (RuntimeError, ValueError, AttributeError) as exc:
            logger.warning("no key-value store for the guard's watchdog (%s); it is off", exc)
            self.store = None
            self.watchdog_seconds = 0.0

    # ------------------------------------------------------------------ devices

    def _check(self, what: str, *tensors: torch.Tensor) -> None:
        required = required_device_type(self.device.type)
        for t in tensors:
            if t.device.type != required:
                raise DeviceCheckError(
                    f"{what}: a tensor on {t.device} was about to be handed to a "
                    f"{self.backend} collective, which needs {required} tensors; create it on "
                    "Collective.device"
                )

    def _read(self, t: torch.Tensor) -> list[list[int]]:
        """The one device-to-host copy of a round's result."""
        self.host_reads += 1
        rows: list[list[int]] = t.cpu().tolist()
        return rows

    # ------------------------------------------------------------------ collectives

    def all_gather_rows(
        self, row: torch.Tensor | Sequence[int], what: str | None = None
    ) -> list[list[int]]:
        """Every rank's int64 row, in rank order. `what` names the round for the watchdog (None:
        no arrival check, for rounds that follow another without user code in between)."""
        if what is not None:
            self.arrive(what)
        if isinstance(row, torch.Tensor):
            mine = row.reshape(-1).to(device=self.device, dtype=torch.int64)
        else:
            mine = torch.tensor(list(row), dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * mine.numel(), dtype=torch.int64, device=self.device)
        self._check(what or "all-gather", mine, out)
        _all_gather_single(out, mine, group=self.group)
        return self._read(out.view(self.world_size, -1))

    def sum_and_max(
        self, sums: torch.Tensor, maxima: torch.Tensor, own: torch.Tensor
    ) -> tuple[list[int], list[int], list[int]]:
        """float64 sums and int64 maxima over every rank, read with this rank's `own` int64
        values in one device-to-host copy: the per-step fast path. Two all-reduces of a few
        values cost O(log W) latency on tree algorithms, where the row gather costs O(W).
        The sums come back as their float64 bit patterns (`verdicts.bits_to_float`)."""
        s = sums.reshape(-1).to(device=self.device, dtype=torch.float64)
        m = maxima.reshape(-1).to(device=self.device, dtype=torch.int64)
        mine = own.reshape(-1).to(device=self.device, dtype=torch.int64)
        self._check("step fast path", s, m)
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=self.group)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
        (values,) = self._read(torch.cat([s.view(torch.int64), m, mine]).view(1, -1))
        n, k = s.numel(), m.numel()
        return values[:n], values[n : n + k], values[n + k :]

    def all_max(self, values: torch.Tensor, what: str) -> list[int]:
        """The int64 maximum over every rank of each of `values`, in one all-reduce and one
        device-to-host copy (the vote's fast path: O(log W) where the row gather is O(W))."""
        m = values.reshape(-1).to(device=self.device, dtype=torch.int64)
        self._check(what, m)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
        return self._read(m.view(1, -1))[0]

    def broadcast_ints(self, values: Sequence[int], what: str | None = None) -> list[int]:
        """Rank 0's values on every rank."""
        if what is not None:
            self.arrive(what)
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        self._check(what or "broadcast", t)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(t, src=src, group=self.group)
        return self._read(t.view(1, -1))[0]

    def failing_ranks(self, ok: bool, what: str | None = None) -> list[int]:
        """The ranks that report failure; every rank learns the same list."""
        return [r for r, (bad,) in enumerate(self.all_gather_rows([int(not ok)], what)) if bad]

    def all_ok(self, ok: bool, what: str | None = None) -> bool:
        return not self.failing_ranks(ok, what)

    def barrier(self, what: str) -> None:
        """With the watchdog on, the arrival check is itself the barrier."""
        if self.watchdog_seconds > 0:
            self.arrive(what)
        else:
            dist.barrier(group=self.group)

    def send(self, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        """A send to `peer`, a rank of this collective's group, for `p2p`."""
        return dist.P2POp(dist.isend, tensor, self._global(peer), self.group)

    def recv(self, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        """A receive from `peer`, a rank of this collective's group, for `p2p`."""
        return dist.P2POp(dist.irecv, tensor, self._global(peer), self.group)

    def _global(self, peer: int) -> int:
        # P2POp takes global ranks even with a group: on a subgroup, group rank 1 is not rank 1
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def p2p(self, ops: list[dist.P2POp], what: str) -> None:
        """Batched point-to-point sends and receives (the replay exchange)."""
        if not ops:
            return
        self._check(what, *(op.tensor for op in ops))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    # ------------------------------------------------------------------ agreement

    def share_problem(self, problem: str | None, what: str) -> None:
        """Every rank raises the same error if `problem` is set on any rank (all must call):
        a file one rank cannot read or write stops them all, with that rank's words."""

        def check() -> None:
            if problem is not None:
                raise GuardError(problem)

        self.agree(check, what)

    def agree(self, fn: Callable[[], T], what: str) -> T:
        """Run `fn` on this rank; if it raised on any rank, raise `RankFailed` on every rank.

        `fn` may be rank-0-only work (pass a function that does nothing elsewhere). The cause
        travels through the store, so the failure costs one extra all-gather of one int.
        """
        self._agreements += 1
        key = f"cause/{self._agreements}"
        value: T | None = None
        cause: BaseException | None = None
        try:
            value = fn()
        except Exception as exc:  # every failure, not only OSError: none may strand the others
            cause = exc
            logger.exception("rank %d (%s): %s failed", self.rank, self.node, what)
            self.post_cause(key, f"{type(exc).__name__}: {exc}")
        failing = self.failing_ranks(cause is None, what)
        if not failing:
            return value  # type: ignore[return-value]
        node, text = self.read_cause(key, failing[0])
        raise RankFailed(what, failing, node, text) from cause

    def post_cause(self, key: str, text: str, limit: int = _CAUSE_CHARS) -> None:
        """Leave this rank's text (a failure's cause) where the other ranks can read it."""
        if self.store is None:
            return
        with contextlib.suppress(RuntimeError):
            self.store.set(f"{key}/{self.rank}", f"{self.node}\t{text[:limit]}")

    def read_cause(self, key: str, rank: int) -> tuple[str, str]:
        """(node, cause) that `rank` posted under `key` before the round that reported it."""
        if self.store is not None:
            with contextlib.suppress(RuntimeError):
                if self.store.check([f"{key}/{rank}"]):
                    node, _, text = self.store.get(f"{key}/{rank}").decode().partition("\t")
                    return node, text
        return "node unknown", "no cause recorded"

    # ------------------------------------------------------------------ watchdog

    def arrive(self, what: str) -> None:
        """Check in at a guard round and wait (at most `watchdog_seconds`) for every rank.

        `what` must be the same text on every rank for the same call ("step 12"): ranks that
        arrive with different texts are reported as a mismatch at once. Per round and rank:
        one store write, one counter increment, one wait and one read.
        """
        if self.watchdog_seconds <= 0 or self.store is None:
            return
        self.seq += 1
        seq, world, store = self.seq, self.world_size, self.store
        go = f"{seq}/go"
        try:
            store.set(f"at/{self.rank}", f"{seq}\t{self.node}\t{what}")
            tag = _tag(what)
            total = store.add(f"{seq}/n", _COUNT + tag)
            if total // _COUNT == world:
                # the last to arrive decides for everyone
                if total % _COUNT == world * tag:
                    store.compare_set(go, _EMPTY, "ok")
                else:
                    store.compare_set(go, _EMPTY, "mismatch\t" + self._mismatch(seq))
                if seq > 1:  # every rank has read the previous round's answer by now
                    store.delete_key(f"{seq - 1}/n")
                    store.delete_key(f"{seq - 1}/go")
            try:
                store.wait([go], datetime.timedelta(seconds=self.watchdog_seconds))
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc).lower():
                    raise
                store.compare_set(go, _EMPTY, "missing\t" + self._missing(seq, what))
            answer = store.get(go).decode()
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveError(
                f"rank {self.rank} ({self.node}) lost contact with the guard's key-value store "
                f"(hosted by rank 0) at '{what}': the other ranks have most likely stopped; see "
                f"rank 0's log ({exc})"
            ) from None
        kind, _, message = answer.partition("\t")
        if kind == "ok":
            return
        self._linger(seq)
        if kind == "mismatch":
            raise CollectiveMismatch(message)
        raise RanksMissing(message)

    def _linger(self, seq: int) -> None:
        """Rank 0 hosts the store: it stays a while so that late ranks can read why it stopped."""
        store = self.store
        assert store is not None
        with contextlib.suppress(RuntimeError):
            store.add(f"{seq}/ack", 1)
            if self.rank != 0:
                return
            deadline = time.monotonic() + max(self.watchdog_seconds, LINGER_SECONDS)
            while store.add(f"{seq}/ack", 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)

    def _positions(self) -> dict[int, tuple[int, str, str]]:
        """Where each rank last checked in: {rank: (round, node, what)}; error paths only."""
        assert self.store is not None
        out = {}
        for r in range(self.world_size):
            key = f"at/{r}"
            if self.store.check([key]):
                seq, node, what = self.store.get(key).decode().split("\t", 2)
                out[r] = (int(seq), node, what)
        return out

    def _missing(self, seq: int, what: str) -> str:
        positions = self._positions()
        missing = [r for r in range(self.world_size) if positions.get(r, (0,))[0] < seq]
        if not missing:  # everyone arrived meanwhile, but with different calls
            return self._mismatch(seq)
        where = "; ".join(
            f"rank {r} ({positions[r][1]}) last at '{positions[r][2]}'"
            if r in positions
            else f"rank {r} never reached a guard round"
            for r in missing[:LISTED]
        )
        return (
            f"rank(s) {listed(missing)} did not reach '{what}' (guard round {seq}) within "
            f"{self.watchdog_seconds:g} s ({where}). A rank stuck in data loading, user code or "
            "I/O holds up every other; if a step can legitimately take longer, raise "
            "GuardConfig.watchdog_seconds."
        )

    def _mismatch(self, seq: int) -> str:
        positions = self._positions()
        calls: dict[str, list[int]] = {}
        for r, (s, _node, what) in sorted(positions.items()):
            calls.setdefault(what if s == seq else f"(round {s}) {what}", []).append(r)
        listing = "; ".join(f"rank(s) {listed(rs)} in '{w}'" for w, rs in calls.items())
        return (
            f"ranks reached guard round {seq} through different guard calls: {listing}. Every "
            "rank must call guard.step(), save_checkpoint() and resume() in the same order "
            "(never e.g. `if rank == 0: guard.save_checkpoint()`)."
        )
