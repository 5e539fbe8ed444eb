"""The hang detector: a per-rank daemon thread, off the step path.

Why not a store round per step: checking in at rank 0's TCPStore before every step cost 4 round
trips per rank per step, serially on rank 0's store thread (about 0.55 s of server CPU per step
at 8,192 ranks). The anchors detect hangs off the step path instead (torchelastic's node-local
`FileTimerServer`, NVRx's rank monitors, torchft's heartbeats) and name the missing rank after the
fact (NCCL's flight recorder). So does this module:

- Each rank keeps its position in memory: the guard call it is in ("step 12") and a count of the
  calls so far. Arming it is an assignment; a plain step sends nothing to any store.
- A timer thread watches the deadline (`watchdog_seconds` after the call was armed). Only when it
  passes does the rank talk to the store: it declares a hang under one key, `hang/<epoch>`.
- A listener thread on every rank holds one blocking `wait` on a key of its own,
  `wake/<epoch>/<rank>` (one outstanding request, no polling, on its own connection); the
  declarer sets every rank's key in one `multi_set`. The key is per rank so that a rank can wake
  its own listener when it exits (`close`, at exit): a thread still in a C++ store call (this
  wait, or a hang probe's verdict) when the interpreter finalizes aborts the process on its
  return (exit 134 after a clean run), so `close` waits until both threads have left.
- When it fires, every rank posts its position; the declarer judges them (`judge`) and posts one
  verdict, which every listener reads: every rank then raises the same `RanksMissing` or
  `CollectiveMismatch`, naming the ranks behind and where each was.
- The main thread may be blocked in a collective when the verdict comes. Guard collectives on
  gloo wait with a timeout and look at the verdict between waits; the DDP bucket all-reduce's
  future (the comm hook's) is failed with the verdict's text (`track`); on NCCL the backend is
  aborted, which fails every pending collective (`on_stop`). A rank in user code (a stuck data
  loader) raises the same error when it next enters the guard.

A verdict of "continue" (every rank answered and none is behind: a long step, not a hang) starts
the next epoch; the declarer's deadline starts again.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from slurm_guard.comm.errors import (
    LISTED,
    CollectiveError,
    CollectiveMismatch,
    RanksMissing,
    listed,
    say_once,
)
from slurm_guard.comm.torch_support import unsupported_torch
from slurm_guard.errors import GuardError

logger = logging.getLogger(__name__)

LINGER_SECONDS = 30.0  # rank 0 (the store's host) waits this long for late ranks to read why
COLLECT_SECONDS = 10.0  # the declarer waits this long for every rank's position
PROBE_SECONDS = 5.0  # a store round this slow asks every rank where it is (a mismatch stops it)
_COUNT = 1 << 40  # a store round's counter adds COUNT + tag: arrivals above, tag sum below
_FOREVER = datetime.timedelta(hours=24)  # the listener's wait, renewed when it runs out
CLOSE_SECONDS = 5.0  # at exit, rank 0 waits this long for the others' listeners to leave
VERDICT_SECONDS = COLLECT_SECONDS + 60  # a listener's wait for a declared hang's verdict
_EXIT = "exit"  # the value a rank sets on its own wake key to end its listener


class Position(NamedTuple):
    """Where a rank was when a hang was declared."""

    seq: int  # guard calls armed so far (equal on every rank while nothing went wrong)
    armed: bool  # inside the call (False: it finished it and is in user code)
    node: str
    what: str


def encode(p: Position) -> str:
    return f"{p.seq}\t{int(p.armed)}\t{p.node}\t{p.what}"


def decode(text: str) -> Position:
    seq, armed, node, what = text.split("\t", 3)
    return Position(int(seq), armed == "1", node, what)


def judge(
    kind: str, ref: Position, positions: dict[int, Position], world: int, seconds: float
) -> str:
    """The verdict on a declared hang, from every rank's position: "continue", "missing\\t..."
    or "mismatch\\t...". `ref` is the declarer's position; `kind` is "deadline" (its deadline
    passed), "probe" (a store round is slow: only a mismatch stops it) or "mismatch" (ranks met
    at a store round through different calls)."""
    mismatched = [
        r for r, p in positions.items() if p.armed and p.seq == ref.seq and p.what != ref.what
    ]
    if mismatched or kind == "mismatch":
        calls: dict[str, list[int]] = {}
        for r, p in sorted(positions.items()):
            calls.setdefault(
                p.what if p.seq == ref.seq else f"(round {p.seq}) {p.what}", []
            ).append(r)
        listing = "; ".join(f"rank(s) {listed(rs)} in '{w}'" for w, rs in calls.items())
        return (
            f"mismatch\tranks reached guard round {ref.seq} through different guard calls: "
            f"{listing}. Every rank must call guard.step(), save_checkpoint() and resume() in "
            "the same order (never e.g. `if rank == 0: guard.save_checkpoint()`)."
        )
    behind = [r for r in range(world) if r not in positions or positions[r].seq < ref.seq]
    if not behind or kind == "probe":
        return "continue"
    where = "; ".join(
        f"rank {r} ({positions[r].node}) last at '{positions[r].what}'"
        if r in positions
        else f"rank {r} did not answer (its process is gone or cannot reach rank 0's store)"
        for r in behind[:LISTED]
    )
    return (
        f"missing\trank(s) {listed(behind)} did not reach '{ref.what}' (guard round {ref.seq}) "
        f"within {seconds:g} s ({where}). A rank stuck in data loading, user code or I/O holds up "
        "every other; if a step can legitimately take longer, raise "
        "GuardConfig.watchdog_seconds."
    )


def _is_timeout(exc: BaseException) -> bool:
    return "timeout" in str(exc).lower() or "timed out" in str(exc).lower()


class HangWatch:
    """One rank's hang detector (see the module docstring).

    Args:
        base: the TCPStore the process group was built from; the watch opens two connections of
            its own to its server (`clone`), so that its blocking wait holds up no other request.
        prefix: this collective's key space.
        on_stop: called once with the verdict (aborts an NCCL backend).
    """

    def __init__(
        self,
        base: Store,
        prefix: str,
        rank: int,
        world: int,
        node: str,
        seconds: float,
        on_stop: Callable[[GuardError], None] | None = None,
    ) -> None:
        if not callable(getattr(base, "clone", None)):
            # Store.clone() gives each thread its own connection (tested on torch 2.13, 2.14).
            raise unsupported_torch(
                "The guard's hang watch (GuardConfig.watchdog_seconds > 0)", "Store.clone()"
            )
        self._listen = PrefixStore(prefix, base.clone())  # type: ignore[attr-defined]
        self._talk = PrefixStore(prefix, base.clone())  # type: ignore[attr-defined]
        # store rounds (`Collective.arrive`): main thread's connection; a verdict wakes `waiting_on`
        self.rounds = PrefixStore(prefix + "rounds/", base)
        self.waiting_on: str | None = None
        self.rank, self.world, self.node, self.seconds = rank, world, node, seconds
        self._on_stop = on_stop
        self._cv = threading.Condition()
        self.seq = 0
        self.what = "(before the guard's set-up)"
        self.armed = False
        self._deadline = math.inf
        self._epoch = 0
        self.error: GuardError | None = None
        self._verdict_epoch = -1
        self._futures: list[torch.futures.Future[torch.Tensor]] = []
        self._closing = False
        self._threads = [
            threading.Thread(target=target, name=f"slurm-guard-{target.__name__}", daemon=True)
            for target in (self._listener, self._timer)
        ]
        for thread in self._threads:
            thread.start()
        # atexit runs while threads still run, before the interpreter starts finalizing
        atexit.register(self.close)

    def close(self) -> None:
        """End both threads (at exit, or when the group is done with): the timer at once, the
        listener by waking it through its own key. Waits until both have left, not 5 s: one
        answering a hang probe cannot be woken (module docstring; tests/exit_race.py)."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            epoch = self._epoch
            self._cv.notify_all()
        listener = self._threads[0]
        if listener.is_alive():
            with contextlib.suppress(RuntimeError, dist.DistError):
                self._talk.set(f"wake/{epoch}/{self.rank}", _EXIT)
        leave_by = time.monotonic() + VERDICT_SECONDS + CLOSE_SECONDS  # the longest call
        for thread in self._threads:
            thread.join(max(leave_by - time.monotonic(), 0.0))
            if thread.is_alive():  # every store call it makes is bounded: a bug
                logger.warning("rank %d: %s did not stop at exit", self.rank, thread.name)
        self._leave_last(time.monotonic() + CLOSE_SECONDS)
        atexit.unregister(self.close)

    def _leave_last(self, deadline: float) -> None:
        """Rank 0 (the store's host) leaves after the others' listeners say so with one key, or
        at `deadline`: leaving first makes torch print a C++ stack trace on a clean exit."""
        with contextlib.suppress(RuntimeError, dist.DistError):
            if self.rank != 0:
                self._talk.set(f"closed/{self.rank}", _EXIT)
            elif self.world > 1:
                left = max(deadline - time.monotonic(), 0.0)
                others = [f"closed/{r}" for r in range(1, self.world)]
                self._talk.wait(others, datetime.timedelta(seconds=left))

    # ------------------------------------------------------------------ main thread

    def arm(self, what: str) -> None:
        """Enter guard call `what`: no store request, only the position and the deadline."""
        self.raise_if_stopped()
        with self._cv:
            self.seq += 1
            self.what, self.armed = what, True
            self._deadline = time.monotonic() + self.seconds
            self._futures.clear()
            self._cv.notify_all()

    def disarm(self) -> None:
        with self._cv:
            self.armed = False
            self._deadline = math.inf
            self._futures.clear()

    def track(self, future: torch.futures.Future[torch.Tensor]) -> None:
        """A future the main thread will wait on (the DDP bucket's): a verdict fails it."""
        with self._cv:
            if self.error is None:
                self._futures.append(future)
                return
        with contextlib.suppress(RuntimeError):
            future.set_exception(RuntimeError(str(self.error)))  # type: ignore[arg-type]

    def raise_if_stopped(self, wait: float = 0.0) -> None:
        """Raise the verdict, if there is one (waiting up to `wait` s for it to arrive)."""
        with self._cv:
            if self.error is None and wait > 0:
                self._cv.wait_for(lambda: self.error is not None, wait)
            error = self.error
        if error is None:
            return
        self._linger()
        raise type(error)(str(error))

    def declare(self, kind: str) -> None:
        """Declare a hang (or a probe) at this rank's position and, if this rank is the first
        of its epoch, judge every rank's position and post the verdict. Returns once this rank's
        listener has the verdict (a "continue" leaves `error` None)."""
        with self._cv:
            epoch = self._epoch
            ref = Position(self.seq, self.armed, self.node, self.what)
        mine = f"{kind}\t{self.rank}\t{encode(ref)}"
        talk = self._talk
        try:
            won = talk.compare_set(f"hang/{epoch}", "", mine).decode() == mine
            if won:
                wake = [f"wake/{epoch}/{r}" for r in range(self.world)]
                talk.multi_set(wake, [mine] * self.world)  # type: ignore[attr-defined]
                # Posted here, not by this rank's listener: a TCPStore client serves one request
                # at a time, so the listener's `set` on `_talk` would queue behind the `wait`
                # below until it times out, and this rank would be judged as not answering.
                talk.set(f"pos/{epoch}/{self.rank}", encode(ref))
                keys = [f"pos/{epoch}/{r}" for r in range(self.world)]
                with contextlib.suppress(dist.DistStoreError):
                    talk.wait(keys, datetime.timedelta(seconds=COLLECT_SECONDS))
                positions = {
                    r: decode(talk.get(k).decode()) for r, k in enumerate(keys) if talk.check([k])
                }
                verdict = judge(kind, ref, positions, self.world, self.seconds)
                talk.set(f"verdict/{epoch}", verdict)
        except (RuntimeError, dist.DistError) as exc:
            logger.warning("rank %d: could not declare a hang (%s)", self.rank, exc)
            return
        with self._cv:
            self._cv.wait_for(
                lambda: self._epoch > epoch or self.error is not None, COLLECT_SECONDS + 30
            )

    def store_round(self, seq: int, what: str, tag: int) -> None:
        """Round `seq` of the store rounds (`Collective.arrive`): per rank one counter increment
        and one wait; the last to arrive writes the answer. A round slower than `PROBE_SECONDS`
        asks every rank where it is: ranks at different guard calls (`if rank == 0:
        guard.save_checkpoint()`) stop at once, late ranks are waited for until the deadline."""
        store, world = self.rounds, self.world
        go = self.waiting_on = f"{seq}/go"
        try:
            total = store.add(f"{seq}/n", _COUNT + tag)
            if total // _COUNT == world:  # the last to arrive decides for everyone
                if total % _COUNT == world * tag:
                    store.set(go, "ok")
                else:
                    self.declare("mismatch")
                if seq > 1:  # every rank has read the previous round's answer by now
                    with contextlib.suppress(RuntimeError):  # tidying only (not every store can)
                        store.delete_key(f"{seq - 1}/n")
                        store.delete_key(f"{seq - 1}/go")
            self.raise_if_stopped()
            start = time.monotonic()
            for kind, until in (("probe", PROBE_SECONDS), ("deadline", self.seconds)):
                left = min(until, self.seconds) - (time.monotonic() - start)
                try:
                    store.wait([go], datetime.timedelta(seconds=max(left, 0.001)))
                    break
                except dist.DistStoreError as exc:
                    if not _is_timeout(exc):
                        raise
                self.raise_if_stopped()
                self.declare(kind)
                self.raise_if_stopped()
            else:  # every rank is in this call, yet the round did not complete
                store.wait([go], datetime.timedelta(seconds=self.seconds))
            if store.get(go) != b"ok":  # woken by a verdict: raise it (fail closed without one)
                self.raise_if_stopped(wait=30.0)
                raise CollectiveError(f"'{what}' was stopped by the hang watch without a verdict")
        except GuardError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            self.raise_if_stopped(wait=5.0)
            raise CollectiveError(
                f"rank {self.rank} ({self.node}) lost contact with the guard's key-value store "
                f"(hosted by rank 0) at '{what}': the other ranks have most likely stopped; see "
                f"rank 0's log ({exc})"
            ) from None
        finally:
            self.waiting_on = None

    # ------------------------------------------------------------------ threads

    def _timer(self) -> None:
        while True:
            with self._cv:
                while (
                    self.error is None and not self._closing and time.monotonic() < self._deadline
                ):
                    left = self._deadline - time.monotonic()
                    self._cv.wait(min(left, 3600.0))
                if self.error is not None or self._closing:
                    return
                self._deadline = math.inf
            self.declare("deadline")
            with self._cv:  # after a "continue", the same call gets another deadline
                if self.error is None and self.armed:
                    self._deadline = time.monotonic() + self.seconds

    def _listener(self) -> None:
        epoch = 0
        try:
            while True:
                try:
                    self._listen.wait([f"wake/{epoch}/{self.rank}"], _FOREVER)
                except dist.DistStoreError as exc:
                    if _is_timeout(exc):
                        continue
                    raise
                with self._cv:
                    if self._closing:
                        return
                    here = Position(self.seq, self.armed, self.node, self.what)
                self._talk.set(f"pos/{epoch}/{self.rank}", encode(here))
                key = f"verdict/{epoch}"
                self._listen.wait([key], datetime.timedelta(seconds=VERDICT_SECONDS))
                kind, _, message = self._listen.get(key).decode().partition("\t")
                if kind == "continue":
                    epoch += 1
                    with self._cv:
                        self._epoch = epoch
                        self._cv.notify_all()
                        if self._closing:  # `close` woke the previous epoch's key: too late
                            return
                    continue
                error: GuardError = (
                    CollectiveMismatch(message) if kind == "mismatch" else RanksMissing(message)
                )
                self._stop(error, epoch)
                return
        except (RuntimeError, dist.DistError) as exc:
            # the store's host (rank 0) is gone: the job is ending; nothing left to watch
            logger.debug("rank %d: hang watch stopped (%s)", self.rank, exc)

    def _stop(self, error: GuardError, epoch: int) -> None:
        with self._cv:
            self.error = error
            self._verdict_epoch = epoch
            futures, self._futures = self._futures, []
            self._cv.notify_all()
        say_once(self.rank, error)  # every rank raises the same verdict: rank 0 says it
        for future in futures:
            with contextlib.suppress(RuntimeError):
                future.set_exception(RuntimeError(str(error)))  # type: ignore[arg-type]
        waiting = self.waiting_on
        if waiting is not None:
            with contextlib.suppress(RuntimeError, dist.DistError):
                self._talk.compare_set("rounds/" + waiting, "", "stop")
        if self._on_stop is not None:
            try:
                self._on_stop(error)
            except Exception:  # aborting is best effort: the error is raised either way
                logger.exception("rank %d: could not abort the backend", self.rank)
        with contextlib.suppress(RuntimeError, dist.DistError):
            self._talk.add(f"ack/{epoch}", 1)

    def _linger(self) -> None:
        """Rank 0 hosts the store: it waits until every rank has read the verdict (dead ranks
        excepted: at most `LINGER_SECONDS`)."""
        if self.rank != 0:
            return
        deadline = time.monotonic() + LINGER_SECONDS
        key = f"ack/{self._verdict_epoch}"
        with contextlib.suppress(RuntimeError, dist.DistError):
            while self._talk.add(key, 0) < self.world and time.monotonic() < deadline:
                time.sleep(0.05)
