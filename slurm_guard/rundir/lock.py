"""One job per run directory: `guard.lock`, held by rank 0 and kept alive by a heartbeat.

Two jobs on one run directory would resume each other's checkpoints and collide on saves. The
lock names its holder (job, restart, attempt, host, pid); its mtime is the heartbeat. A live
holder is refused with `RunDirError`; a dead one (`stale_reason`) is taken over with a warning.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_guard.rundir.layout import LOCK_FILE, RunDir, RunDirError
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file

logger = logging.getLogger(__name__)

HEARTBEAT_S = 15.0
"""Rank 0 refreshes the lock's mtime this often."""
STALE_AFTER_S = 120.0
"""A lock whose mtime is older than this (by the file server's clock) belongs to a dead job.

Longer than NFS attribute caching (acregmax, 60 s by default) plus a few heartbeats, so a live
job on another node is never taken for dead.
"""


@dataclass(frozen=True)
class LockHolder:
    job_id: str | None
    restart_count: int
    attempt: str
    host: str
    pid: int


def _fs_now(directory: Path) -> float:
    """The file server's clock: the mtime of a file created now (node clocks may differ)."""
    probe = directory / f".clock-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        os.unlink(probe)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def stale_reason(holder: LockHolder | None, age: float, me: LockHolder) -> str | None:
    """Why the lock's holder is dead (so the lock may be taken over), or None if it may live.

    The rule, in order: the same process (an earlier Guard object) or a process of this host
    that no longer exists; an earlier incarnation (lower restart count) of this very Slurm job,
    which Slurm ended before the requeue; a heartbeat older than STALE_AFTER_S. A lock file that
    cannot be parsed is judged by its heartbeat alone.
    """
    if holder is not None:
        if holder.host == me.host and holder.pid == me.pid:
            return "an earlier Guard of this process"
        if holder.host == me.host and not _pid_alive(holder.pid):
            return f"process {holder.pid} on this host has exited"
        if (
            holder.job_id is not None
            and holder.job_id == me.job_id
            and holder.restart_count < me.restart_count
        ):
            return f"restart {holder.restart_count} of this job ended before this restart"
    if age > STALE_AFTER_S:
        return f"no heartbeat for {age:.0f} s"
    return None


class RunLock:
    """One job per run directory: `guard.lock`, held by rank 0, refreshed by a heartbeat.

    The file holds the holder's job id, restart count, attempt, host and pid; its mtime is the
    heartbeat, refreshed every HEARTBEAT_S by a daemon thread. See `stale_reason` for when a
    lock is taken over.
    """

    def __init__(self, rd: RunDir, me: LockHolder) -> None:
        self.rd = rd
        self.me = me
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(
        cls, rd: RunDir, *, job_id: str | None, restart_count: int, attempt: str
    ) -> RunLock:
        me = LockHolder(job_id, restart_count, attempt, socket.gethostname(), os.getpid())
        lock = cls(rd, me)
        for _ in range(5):
            try:
                atomic_write_json(rd.lock_file, me.__dict__, overwrite=False)
            except FileExistsError:
                pass
            else:
                lock._start_heartbeat()
                return lock
            holder, age = lock._read_holder()
            if holder is not None and holder.attempt == attempt:
                lock._start_heartbeat()
                return lock
            reason = stale_reason(holder, age, me)
            if reason is None:
                who = (
                    f"job {holder.job_id or '(none)'} restart {holder.restart_count}, host "
                    f"{holder.host}, pid {holder.pid}"
                    if holder is not None
                    else "an unreadable lock"
                )
                raise RunDirError(
                    f"run directory {rd.root} is in use by {who} (heartbeat {age:.0f} s ago): "
                    "one job per run directory. Give this job its own, or stop the other. A "
                    f"dead job's lock is taken over after {STALE_AFTER_S:.0f} s without "
                    f"heartbeat; to take it now, delete {rd.lock_file}."
                )
            aside = rd.root / f".{LOCK_FILE}.stale-{attempt}"
            try:
                os.replace(rd.lock_file, aside)  # one contender wins; the other retries
                os.unlink(aside)
            except FileNotFoundError:
                continue
            logger.warning(
                "run directory %s: taking over the lock of %s: %s",
                rd.root,
                holder or "an unreadable lock file",
                reason,
            )
        raise RunDirError(f"could not take the lock {rd.lock_file}: other jobs keep taking it")

    def _read_holder(self, *, with_age: bool = True) -> tuple[LockHolder | None, float]:
        """The holder (None if unreadable) and its heartbeat's age (0 unless `with_age`)."""
        try:
            mtime = os.lstat(self.rd.lock_file).st_mtime
            age = _fs_now(self.rd.root) - mtime if with_age else 0.0
        except FileNotFoundError:
            return None, math.inf
        try:
            obj = read_json_file(self.rd.lock_file)
            holder = LockHolder(
                job_id=obj["job_id"] if isinstance(obj["job_id"], str) else None,
                restart_count=int(obj["restart_count"]),
                attempt=str(obj["attempt"]),
                host=str(obj["host"]),
                pid=int(obj["pid"]),
            )
        except (RecordError, KeyError, TypeError, ValueError, OverflowError):
            return None, age
        return holder, age

    def held(self) -> bool:
        """Whether the lock file still names this attempt (another job may have taken it)."""
        holder, _ = self._read_holder(with_age=False)
        return holder is not None and holder.attempt == self.me.attempt

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(
            target=self._beat, name=f"slurm-guard-lock-{self.me.attempt}", daemon=True
        )
        self._thread.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.held():
                    logger.error("run directory %s: the lock was taken over", self.rd.root)
                    return
                os.utime(self.rd.lock_file)
            except OSError as exc:
                logger.warning("lock heartbeat failed: %s", exc)

    def release(self) -> None:
        """Remove the lock if it is still ours (at exit; a crash leaves it to go stale)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            if self.held():
                os.unlink(self.rd.lock_file)
