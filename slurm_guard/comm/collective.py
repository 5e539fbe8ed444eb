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
- Hangs (`Collective.arm`, `watchdog.HangWatch`): a step only records, in memory, which guard call
  this rank is in; a daemon thread talks to the store only when `watchdog_seconds` pass, and then
  every rank raises the same `RanksMissing` naming the ranks behind. A plain step makes no store
  request. Store rounds (`Collective.arrive`) remain for `Guard()`, `save_checkpoint()` and
  `resume()` only.
- Mismatched calls: every reduction and gather of a guard call carries the call's tag (a MAX
  all-reduce carries the tag and its complement: max == ~max(~tag) iff every rank sent the same
  one), so ranks at different guard calls raise `CollectiveMismatch` without a round trip of
  its own.

Tests switch on a stricter device check with `SLURM_GUARD_CHECK_DEVICE=cuda|cpu` (or the
`check_devices` context manager): every tensor handed to a collective must then be on that device
type, whatever the backend, so a wrong-device tensor fails loudly instead of working by accident.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from slurm_guard.comm.devices import backend_device, required_device_type
from slurm_guard.comm.errors import (
    CollectiveMismatch,
    DeviceCheckError,
    RankFailed,
    listed,
)
from slurm_guard.comm.torch_support import unsupported_torch
from slurm_guard.comm.watchdog import HangWatch, _is_timeout
from slurm_guard.errors import GuardError

# torch 2.13 renamed all_gather_into_tensor (now a deprecated alias that warns on every call);
# the oldest torch the project allows has only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CAUSE_CHARS = 600  # an exception's text as other ranks see it (the failing rank logs it whole)
_SLICE = datetime.timedelta(seconds=1)  # gloo waits this long between looks at the hang verdict
_VERDICT_GRACE = 15.0  # the declarer collects positions for up to 10 s, then posts the verdict


def _tag(text: str) -> int:
    """A 20-bit hash of a round's name, so a sum of them reveals ranks at different calls."""
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % ((1 << 20) - 1) + 1


class Collective:
    """The guard's collectives over one process group.

    Args:
        group: the process group (None: the default group).
        node: this rank's node name, for messages that name a failing rank.
        watchdog_seconds: how long a guard call may wait for a rank that is behind; 0 turns the
            hang watch off (then a missing rank waits for the backend's own timeout).
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
        self.seq = 0  # store rounds so far (equal on every rank while nothing went wrong)
        self.host_reads = 0  # device-to-host copies of gathered rows (tests count them)
        self.call = "(set-up)"  # the guard call this rank is in: its tag travels with each round
        self._agreements = 0
        self._mismatches = 0
        self._tag_buffer: torch.Tensor | None = None
        members = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        # Every Guard (and every sharded vote) on a group gets its own key space; ranks create
        # them in the same order, so the instance number agrees across ranks.
        instance = Collective._instances.get(members, 0)
        Collective._instances[members] = instance + 1
        space = hashlib.blake2b(repr(members).encode(), digest_size=6).hexdigest()
        self.store: Store | None
        self.watch: HangWatch | None = None
        try:
            # The store the process group was built from. torch has no public accessor (tested
            # on torch 2.13 and 2.14); without one the hang watch and the causes in RankFailed
            # are unavailable (logged). A torch that renamed it is refused by name below.
            base = dist.distributed_c10d._get_default_store()
            self.store = PrefixStore(f"slurm-guard/{space}/{instance}/", base)
        except AttributeError as exc:
            if self.watchdog_seconds > 0:
                raise unsupported_torch(
                    "The guard's hang watch (GuardConfig.watchdog_seconds > 0)",
                    "torch.distributed.distributed_c10d._get_default_store()",
                ) from exc
            logger.warning("no key-value store for the guard (%s): no causes in RankFailed", exc)
            self.store = None
            return
        except (RuntimeError, ValueError) as exc:
            logger.warning("no key-value store for the guard's watchdog (%s); it is off", exc)
            self.store = None
            self.watchdog_seconds = 0.0
            return
        if self.watchdog_seconds > 0:
            tcp = _tcp_store(base)
            if tcp is None:
                logger.warning("the process group's store is no TCPStore: the hang watch is off")
                self.watchdog_seconds = 0.0
            else:
                prefix = f"slurm-guard-watch/{space}/{instance}/"
                self.watch = HangWatch(
                    tcp, prefix, self.rank, self.world_size, node, self.watchdog_seconds,
                    on_stop=self._abort_backend,
                )  # fmt: skip

    # ------------------------------------------------------------------ hang watch

    def arm(self, what: str) -> None:
        """Enter guard call `what` (the same text on every rank: "step 12"). No store request:
        raises the hang verdict if one came meanwhile."""
        self.call = what
        if self.watch is not None:
            self.watch.arm(what)

    def disarm(self) -> None:
        """Leave the guard call: this rank is in user code until the next `arm`."""
        if self.watch is not None:
            self.watch.disarm()

    def raise_if_stopped(self, wait: float = 0.0) -> None:
        """Raise the hang verdict, if any (after a collective failed: waiting `wait` s for it)."""
        if self.watch is not None:
            self.watch.raise_if_stopped(wait)

    def raise_verdict_of_failure(self) -> None:
        """After a collective failed (a peer closed its connection): the hang verdict comes
        once this rank's deadline passes, so wait that long for it, then let the caller
        re-raise the failure itself. Every rank then stops with the verdict that names the
        missing rank, not with its own echo of the broken connection."""
        self.raise_if_stopped(wait=self.watchdog_seconds + _VERDICT_GRACE)

    def _abort_backend(self, error: GuardError) -> None:
        """NCCL: aborting fails every pending collective (DDP's too), so a blocked rank raises
        the verdict. gloo's abort does not unblock one: there the waits are sliced instead."""
        if self.device.type != "cpu":
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None
            group.abort()

    def _wait(self, work: dist.Work | None) -> None:
        """Wait for an async collective; on gloo, in slices, looking at the hang verdict."""
        assert work is not None
        if self.watch is None or self.device.type != "cpu":
            work.wait()
            return
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError as exc:
                if not _is_timeout(exc):
                    self.raise_verdict_of_failure()
                    raise
                self.watch.raise_if_stopped()

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

    def _tags(self) -> torch.Tensor:
        """This call's tag and its complement, for a MAX all-reduce: filled into a tensor kept on
        the device (a fill is a kernel with a scalar argument, not a blocking upload)."""
        if self._tag_buffer is None:
            self._tag_buffer = torch.zeros(2, dtype=torch.int64, device=self.device)
        tag = _tag(self.call)
        self._tag_buffer[0].fill_(tag)
        self._tag_buffer[1].fill_(~tag)
        return self._tag_buffer

    def _same_call(self, tag_max: int, complement_max: int) -> None:
        """max(tag) == ~max(~tag) iff every rank sent the same tag; otherwise find out who is where
        (the error path: one gather of the tags and a store read per distinct call)."""
        if tag_max == ~complement_max:
            return
        mine = torch.tensor([_tag(self.call)], dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self._wait(_all_gather_single(out, mine, group=self.group, async_op=True))
        self._mismatch([t for (t,) in self._read(out.view(-1, 1))])

    def _mismatch(self, tags: list[int]) -> None:
        """Every rank posts its call's text, then all read one text per distinct tag."""
        self._mismatches += 1
        key = f"call/{self._mismatches}"
        self.post_cause(key, self.call)
        self._wait(dist.barrier(group=self.group, async_op=True))
        calls: dict[int, list[int]] = {}
        for r, t in enumerate(tags):
            calls.setdefault(t, []).append(r)
        names = {t: self.read_cause(key, rs[0])[1] for t, rs in calls.items()}
        listing = "; ".join(f"rank(s) {listed(rs)} in '{names[t]}'" for t, rs in calls.items())
        raise CollectiveMismatch(
            f"ranks reached the same guard collective through different guard calls: {listing}. "
            "Every rank must call guard.step(), save_checkpoint() and resume() in the same order."
        )

    # ------------------------------------------------------------------ collectives

    def all_gather_rows(
        self, row: torch.Tensor | Sequence[int], what: str | None = None
    ) -> list[list[int]]:
        """Every rank's int64 row, in rank order, with the call's tag appended (and checked) so
        that ranks at different guard calls are named. `what` names the round in messages."""
        if isinstance(row, torch.Tensor):
            mine = row.reshape(-1).to(device=self.device, dtype=torch.int64)
        else:
            mine = torch.tensor(list(row), dtype=torch.int64, device=self.device)
        mine = torch.cat([mine, self._tags()[:1]])
        out = torch.empty(self.world_size * mine.numel(), dtype=torch.int64, device=self.device)
        self._check(what or "all-gather", mine, out)
        self._wait(_all_gather_single(out, mine, group=self.group, async_op=True))
        rows = self._read(out.view(self.world_size, -1))
        tags = [r.pop() for r in rows]
        if len(set(tags)) > 1:
            self._mismatch(tags)
        return rows

    def sum_and_max(
        self, sums: torch.Tensor, maxima: torch.Tensor, own: torch.Tensor
    ) -> tuple[list[int], list[int], list[int]]:
        """float64 sums and int64 maxima over every rank, read with this rank's `own` int64
        values in one device-to-host copy: the per-step fast path. Two all-reduces of a few
        values cost O(log W) latency on tree algorithms, where the row gather costs O(W); the
        maxima carry the call's tag and its complement. The sums come back as their float64 bit
        patterns (`verdicts.bits_to_float`)."""
        s = sums.reshape(-1).to(device=self.device, dtype=torch.float64)
        m = torch.cat([maxima.reshape(-1).to(device=self.device, dtype=torch.int64), self._tags()])
        mine = own.reshape(-1).to(device=self.device, dtype=torch.int64)
        self._check("step fast path", s, m)
        first = dist.all_reduce(s, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        second = dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._wait(first)
        self._wait(second)
        (values,) = self._read(torch.cat([s.view(torch.int64), m, mine]).view(1, -1))
        n, k = s.numel(), m.numel()
        self._same_call(values[n + k - 2], values[n + k - 1])
        return values[:n], values[n : n + k - 2], values[n + k :]

    def all_max(self, values: torch.Tensor, what: str) -> list[int]:
        """The int64 maximum over every rank of each of `values`, in one all-reduce and one
        device-to-host copy (the vote's fast path: O(log W) where the row gather is O(W))."""
        m = torch.cat([values.reshape(-1).to(device=self.device, dtype=torch.int64), self._tags()])
        self._check(what, m)
        self._wait(dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        out = self._read(m.view(1, -1))[0]
        self._same_call(out[-2], out[-1])
        return out[:-2]

    def broadcast_ints(self, values: Sequence[int], what: str | None = None) -> list[int]:
        """Rank 0's values on every rank."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        self._check(what or "broadcast", t)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._wait(dist.broadcast(t, src=src, group=self.group, async_op=True))
        return self._read(t.view(1, -1))[0]

    def failing_ranks(self, ok: bool, what: str | None = None) -> list[int]:
        """The ranks that report failure; every rank learns the same list."""
        return [r for r, (bad,) in enumerate(self.all_gather_rows([int(not ok)], what)) if bad]

    def all_ok(self, ok: bool, what: str | None = None) -> bool:
        return not self.failing_ranks(ok, what)

    def barrier(self, what: str) -> None:
        """A barrier that carries the call's tag (a gather of one int)."""
        self.all_gather_rows([0], what)

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
            self._wait(work)

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

    # ------------------------------------------------------------------ store rounds

    def arrive(self, what: str) -> None:
        """A store round, for `Guard()`, `save_checkpoint()` and `resume()` only: every rank
        checks in and waits for all, at most `watchdog_seconds` (`HangWatch.store_round`)."""
        self.arm(what)
        if self.watch is not None:
            self.seq += 1
            self.watch.store_round(self.seq, what, _tag(what))


def _tcp_store(store: Store) -> Store | None:
    """The store under the default store's prefixes, if it can open more clients (`clone`: a
    TCPStore, or a Python store that wraps one, as the test that counts requests does)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    tcp = dist.TCPStore  # type: ignore[attr-defined]
    return store if isinstance(store, tcp) or "clone" in type(store).__dict__ else None
