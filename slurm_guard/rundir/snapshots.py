"""Verified snapshots in node-local memory: a fast cache of the state after a passing vote.

A checkpoint on the shared filesystem is slow to write, so sites save one every 30-60 minutes,
and an alarm costs up to that interval of every GPU's work. After a passing weight vote the
replicas are verified identical, so that state is worth keeping close: each rank writes it to
memory that outlives the training step but not the node (`/dev/shm/slurm-guard-<uid>/` by
default). A snapshot is a cache, never the truth: one that is missing, damaged, sealed by another
run or not proven by the run's ledger is skipped, and the resume falls back to the next one or
to a checkpoint.

Layout, per rank (ranks of one node share the job directory; `<key>` is `<job>-<run id>`, or
`run-<run id>` outside Slurm, so two runs in one job never share a directory):

    <root>/<key>/rank-<r>/step-<N>/own.pt      the rank's RNG and stateful state, its peers' copies
    <root>/<key>/rank-<r>/step-<N>/weights.pt  model and optimizer (the node's first rank only)
    <root>/<key>/rank-<r>/step-<N>/seal.json   written last: step, run id, fingerprint, sha256

The root belongs to the job's user alone (0700, checked from `/` down, `rundir.private_dir`);
directories below it are 0700, files 0600, and nothing is opened through a link.

The weights live in their own file so that the small file can be checked cheaply by every rank
of a node. The weights are not hashed: the loaded state must reproduce the sealed fingerprint
(the vote's), which catches any damage a hash would.

A snapshot directory is staged under a dot-name and renamed into place after its seal is
written, so a listed snapshot is always complete; the newest `keep` (2) are kept. When the next
one does not fit, the oldest go first (`SnapshotStore.write`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from slurm_guard.rundir import private_dir as private
from slurm_guard.rundir.records import RecordError
from slurm_guard.rundir.snapshot_seal import (
    OWN_FILE,
    SEAL_FILE,
    WEIGHTS_FILE,
    Hashing,
    SnapshotSeal,
    sha256_fd,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SNAPSHOT_ROOT",
    "OWN_FILE",
    "SEAL_FILE",
    "SNAPSHOT_ROOT_ENV",
    "WEIGHTS_FILE",
    "SnapshotSeal",
    "SnapshotStore",
    "SnapshotsUnavailable",
    "ranks_on_node",
    "remove_job_snapshots",
    "snapshot_key",
    "snapshot_root",
]

DEFAULT_SNAPSHOT_ROOT = "/dev/shm/slurm-guard-{uid}"
SNAPSHOT_ROOT_ENV = "SLURM_GUARD_SNAPSHOT_DIR"
WEIGHT_KEYS = ("model", "optimizer")
STAGING_PREFIX = ".staging-"
_warned: set[str] = set()  # roots already named in a warning by this process


class SnapshotsUnavailable(OSError):
    """This node's snapshot root failed its checks: no snapshot is written or read there."""


def snapshot_root(
    configured: str | os.PathLike[str] | None = None, node: str = "", uid: int | None = None
) -> Path:
    """The configured directory, else $SLURM_GUARD_SNAPSHOT_DIR, else /dev/shm/slurm-guard-{uid}.

    `{uid}` becomes the user's id, so each user has a root of their own. `{node}` becomes the
    node's name: nodes that share one machine (a test cluster, the local launcher) then keep
    apart what real nodes keep apart by having their own memory.
    """
    chosen = str(configured or os.environ.get(SNAPSHOT_ROOT_ENV) or DEFAULT_SNAPSHOT_ROOT)
    if "{node}" in chosen:
        if not node or "/" in node or node.startswith("."):
            raise ValueError(f"no usable node name for {chosen!r}: {node!r}")
        chosen = chosen.replace("{node}", node)
    chosen = chosen.replace("{uid}", str(os.geteuid() if uid is None else uid))
    return Path(chosen)


def snapshot_key(job_id: str | None, run_id: str) -> str:
    """The directory of one run's snapshots: job and run id (`run-<id>` outside Slurm).

    The job id lets the node epilog find a finished job's directories; the run id keeps two
    runs of one job (two trainings in one allocation) apart.
    """
    return f"{job_id}-{run_id[:16]}" if job_id else f"run-{run_id[:16]}"


def _job_key(job_id: str) -> str:
    """A job id as a directory name; anything but a plain id would escape the root."""
    if not job_id or not all(c.isalnum() or c in "._-" for c in job_id) or job_id[0] == ".":
        raise ValueError(f"not a usable job id for a snapshot directory: {job_id!r}")
    return job_id


def _root_ok(root: Path, *, create: bool) -> bool:
    """Whether `root` is this user's private directory (made so when `create`); one warning
    per root that is not, naming it and the fix."""
    if not create and not os.path.lexists(root):
        return False
    try:
        private.ensure_private_root(root)
        return True
    except OSError as exc:
        if str(root) not in _warned:
            _warned.add(str(root))
            where = exc.filename or root
            logger.warning(
                "node-local snapshots are off on this node: %s %s", where, exc.strerror or exc
            )
        return False


def ranks_on_node(root: Path, job_id: str) -> list[int]:
    """The ranks whose snapshot directories this node's memory holds for the job (any layout)."""
    directory = root / _job_key(job_id)
    try:
        if not _root_ok(root, create=False) or not os.path.isdir(directory):
            return []
        private.check_private_dir(directory)
        names = private.list_private_dirs(directory)
    except OSError as exc:
        logger.warning("cannot list snapshots in %s (%s)", directory, exc.strerror)
        return []
    return sorted(int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit())


def remove_job_snapshots(root: Path, job_id: str) -> bool:
    """Free a finished job's node-local memory: its directories (`<job>`, `<job>-<run id>`)
    that this user owns, never through a link (the node epilog does the same as root)."""
    if not os.path.isdir(root):
        return False
    removed, _ = private.remove_owned_dirs(root, os.geteuid(), _job_key(job_id))
    return bool(removed)


def _state_bytes(obj: Any) -> tuple[int, int]:
    """(bytes, tensors) of the tensors in `obj`: what a file of it needs, nearly."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), 1
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    total, count = 0, 0
    for item in items:
        b, n = _state_bytes(item)
        total, count = total + b, count + n
    return total, count


def _is_full(exc: BaseException) -> bool:
    """Whether a failed write ran out of space (torch words it as `unexpected pos`)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class SnapshotStore:
    """One rank's snapshots of one run, in node-local memory (no collectives, no shared disk).

    `job_id` is the run's directory key (`snapshot_key`): a plain name, never a path.
    """

    def __init__(self, root: Path, job_id: str, rank: int, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("a snapshot store keeps at least one snapshot")
        self.root = root
        self.job_id = job_id
        self.directory = root / _job_key(job_id) / f"rank-{rank}"
        self.rank = rank
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def _make_directory(self) -> None:
        if not _root_ok(self.root, create=True):
            raise SnapshotsUnavailable(errno.EPERM, "the snapshot root failed its checks")
        job = private.private_subdir(self.root, self.job_id, create=True)
        private.private_subdir(job, self.directory.name, create=True)

    def write(
        self,
        state: dict[str, Any],
        *,
        step: int,
        run_id: str,
        weight_fingerprint: str,
        fingerprint_seed: int,
        world_size: int,
        peers: tuple[int, ...] = (),
        buffer_fingerprint: str | None = None,
    ) -> SnapshotSeal:
        """Save host-side `state` and seal it; then drop all but the newest `keep` snapshots.

        Room first: when the free space is less than the state needs, the oldest snapshots go
        before the write (the newest one last), so a node keeps its newest `keep`, or its
        newest one where only one fits. A write that still runs out of space raises OSError
        ENOSPC saying so ("no space left in <dir>"). Runs on the copier's background thread:
        `state` must already be a copy that the training step no longer writes to.
        """
        fields = {
            "step": step,
            "run_id": run_id,
            "weight_fingerprint": weight_fingerprint,
            "fingerprint_seed": fingerprint_seed,
            "world_size": world_size,
            "peers": peers,
            "buffer_fingerprint": buffer_fingerprint,
        }
        self._make_directory()
        parts = {OWN_FILE: {k: v for k, v in state.items() if k not in WEIGHT_KEYS}}
        if all(k in state for k in WEIGHT_KEYS):
            parts[WEIGHTS_FILE] = {k: state[k] for k in WEIGHT_KEYS}
        nbytes, tensors = _state_bytes(state)
        needed = nbytes + nbytes // 64 + 1024 * tensors + (64 << 10)
        older = sorted(s for s in self._steps() if s != step)
        while older and self._free() < needed:
            removed = older.pop(0)
            logger.info("snapshot step-%08d removed to make room in %s", removed, self.directory)
            self.remove(removed)
        while True:
            try:
                seal = self._write(parts, fields)
                break
            except Exception as exc:
                if not (_is_full(exc) or self._free() < needed):
                    raise
                if older:  # another writer took the room meanwhile: one more goes
                    self.remove(older.pop(0))
                    continue
                raise OSError(
                    errno.ENOSPC,
                    f"no space left in {self.directory} for the snapshot of step {step} (about "
                    f"{needed / 2**20:.1f} MiB needed, {self._free() / 2**20:.1f} MiB free): "
                    "give the node more memory for /dev/shm or point snapshot_dir at a larger "
                    "node-local disk",
                ) from None
        self.prune()
        return seal

    def _write(self, parts: dict[str, dict[str, Any]], fields: dict[str, Any]) -> SnapshotSeal:
        step = fields["step"]
        stage = self.directory / f"{STAGING_PREFIX}{step:08d}-{os.getpid()}"
        shutil.rmtree(stage, ignore_errors=True)
        os.mkdir(stage, private.DIR_MODE)
        try:
            hashes = {}
            for name, part in parts.items():
                fd = private.create_private_file(stage / name)
                with os.fdopen(fd, "wb") as f:
                    if name == WEIGHTS_FILE:  # proven by the fingerprint at load: no hash
                        torch.save(part, f)
                        hashes[name] = ""
                    else:
                        hashing = Hashing(f)
                        torch.save(part, hashing)  # type: ignore[arg-type]
                        hashes[name] = hashing.digest.hexdigest()
            seal = SnapshotSeal(files=hashes, rank=self.rank, created=time.time(), **fields)
            fd = private.create_private_file(stage / SEAL_FILE)
            with os.fdopen(fd, "w") as f:
                json.dump(seal.record(), f, indent=2, sort_keys=True)
            final = self.path(step)
            if os.path.lexists(final):  # the same step again (a resumed run repeating it)
                shutil.rmtree(final)
            os.replace(stage, final)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        return seal

    def _free(self) -> int:
        """Bytes free where the snapshots are (unknown counts as plenty: nothing removed)."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return 1 << 62
        return st.f_bavail * st.f_frsize

    def remove(self, step: int) -> None:
        shutil.rmtree(self.path(step), ignore_errors=True)

    def prune(self) -> None:
        """Keep the newest `keep` sealed snapshots; remove older ones and stale staging dirs."""
        if not self.directory.is_dir():
            return
        steps = sorted(self._steps(), reverse=True)
        for step in steps[self.keep :]:
            self.remove(step)
        for entry in self.directory.iterdir():
            if entry.name.startswith(STAGING_PREFIX) and not entry.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(entry, ignore_errors=True)

    def _steps(self) -> list[int]:
        steps = []
        for entry in self.directory.iterdir():
            if entry.name.startswith("step-") and entry.name[5:].isdigit():
                steps.append(int(entry.name[5:]))
        return steps

    def _readable(self) -> bool:
        """The root, the run's and this rank's directories pass their checks (nothing made)."""
        if not _root_ok(self.root, create=False) or not os.path.isdir(self.directory):
            return False
        private.check_private_dir(self.directory.parent)
        private.check_private_dir(self.directory)
        return True

    def seals(self) -> tuple[list[SnapshotSeal], dict[int, str]]:
        """The readable seals, newest first, and the snapshots whose seal is unusable (why).

        Never raises: node-local memory that cannot be listed holds no usable snapshot.
        """
        found: list[SnapshotSeal] = []
        unusable: dict[int, str] = {}
        try:
            steps = sorted(self._steps(), reverse=True) if self._readable() else []
        except OSError as exc:
            logger.warning("cannot list snapshots in %s (%s)", self.directory, exc.strerror)
            return [], {}
        for step in steps:
            try:
                seal = SnapshotSeal.parse(self._read_seal(step), str(self.path(step)))
            except RecordError as exc:
                unusable[step] = str(exc)
                continue
            if seal.step != step or seal.rank != self.rank:
                unusable[step] = f"its seal says step {seal.step}, rank {seal.rank}"
                continue
            found.append(seal)
        return found, unusable

    def _read_seal(self, step: int) -> Any:
        path = self.path(step) / SEAL_FILE
        try:
            private.check_private_dir(self.path(step))
            with private.open_private_file(path) as fd, os.fdopen(os.dup(fd), "rb") as f:
                return json.loads(f.read(1 << 20))
        except OSError as exc:
            raise RecordError(f"{path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise RecordError(f"{path}: not JSON ({exc})") from None

    def problem(
        self, seal: SnapshotSeal, run_id: str, files: tuple[str, ...] = (OWN_FILE, WEIGHTS_FILE)
    ) -> str | None:
        """Why these files of this snapshot must not be loaded, or None: another run, damage.

        A file sealed without a hash (weights.pt) is proven by the fingerprint once loaded.
        """
        if seal.run_id != run_id:
            return f"sealed by another run ({seal.run_id}, this run is {run_id})"
        for name in (f for f in files if seal.files.get(f)):
            try:
                with private.open_private_file(self.path(seal.step) / name) as fd:
                    if sha256_fd(fd) != seal.files[name]:
                        return f"{name} does not match its sealed sha256 (damaged)"
            except OSError as exc:
                return f"{name} cannot be read ({exc.strerror or exc})"
        return None

    def load(
        self, seal: SnapshotSeal, files: tuple[str, ...] = (OWN_FILE, WEIGHTS_FILE)
    ) -> dict[str, Any]:
        """The sealed state of these files, on the CPU; the caller checks the fingerprint."""
        state: dict[str, Any] = {}
        for name in (f for f in files if f in seal.files):
            path = self.path(seal.step) / name
            with private.open_private_file(path) as fd, os.fdopen(os.dup(fd), "rb") as f:
                part = torch.load(f, map_location="cpu", weights_only=True)
            if not isinstance(part, dict):
                raise RecordError(f"{path}: not a snapshot (a {type(part).__name__})")
            state.update(part)
        return state
