"""Verified snapshots in node-local memory: a fast cache of the state after a passing vote.

A checkpoint on the shared filesystem is slow to write, so sites save one every 30-60 minutes,
and an alarm costs up to that interval of every GPU's work. After a passing weight vote the
replicas are verified identical, so that state is worth keeping close: each rank writes it to
memory that outlives the training step but not the node (`/dev/shm/slurm-guard/<job>/` by
default). A snapshot is a cache, never the truth: one that is missing, damaged, or sealed by
another run is skipped, and the resume falls back to the next one or to a checkpoint.

Layout, per rank (ranks of one node share the job directory):

    <root>/<job>/rank-<r>/step-<N>/own.pt      the rank's RNG and stateful state, its peers' copies
    <root>/<job>/rank-<r>/step-<N>/weights.pt  model and optimizer (the node's first rank only)
    <root>/<job>/rank-<r>/step-<N>/seal.json   written last: step, run id, fingerprint, sha256s

The weights live in their own file so that the small files can be checked cheaply by every
rank of a node, and the large one only by the ranks that load it.

A snapshot directory is staged under a dot-name and renamed into place after its seal is
written, so a listed snapshot is always complete; the newest `keep` (2) are kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slurm_guard.protocol import SNAPSHOT_SCHEMA
from slurm_guard.rundir.checkpoint import sha256_file
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SNAPSHOT_ROOT",
    "SNAPSHOT_ROOT_ENV",
    "SnapshotSeal",
    "SnapshotStore",
    "ranks_on_node",
    "remove_job_snapshots",
    "snapshot_root",
]

DEFAULT_SNAPSHOT_ROOT = Path("/dev/shm/slurm-guard")
SNAPSHOT_ROOT_ENV = "SLURM_GUARD_SNAPSHOT_DIR"
OWN_FILE = "own.pt"
WEIGHTS_FILE = "weights.pt"
WEIGHT_KEYS = ("model", "optimizer")
SEAL_FILE = "seal.json"
STAGING_PREFIX = ".staging-"


def snapshot_root(configured: str | os.PathLike[str] | None = None, node: str = "") -> Path:
    """The configured directory, else $SLURM_GUARD_SNAPSHOT_DIR, else /dev/shm/slurm-guard.

    `{node}` in it becomes the node's name: nodes that share one machine (a test cluster, the
    local launcher) then keep apart what real nodes keep apart by having their own memory.
    """
    chosen = str(configured or os.environ.get(SNAPSHOT_ROOT_ENV) or DEFAULT_SNAPSHOT_ROOT)
    if "{node}" in chosen:
        if not node or "/" in node or node.startswith("."):
            raise ValueError(f"no usable node name for {chosen!r}: {node!r}")
        chosen = chosen.replace("{node}", node)
    return Path(chosen)


def _job_key(job_id: str) -> str:
    """A job id as a directory name; anything but a plain id would escape the root."""
    if not job_id or not all(c.isalnum() or c in "._-" for c in job_id) or job_id[0] == ".":
        raise ValueError(f"not a usable job id for a snapshot directory: {job_id!r}")
    return job_id


def ranks_on_node(root: Path, job_id: str) -> list[int]:
    """The ranks whose snapshot directories this node's memory holds for the job (any layout)."""
    directory = root / _job_key(job_id)
    try:
        names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    except OSError as exc:
        logger.warning("cannot list snapshots in %s (%s)", directory, exc.strerror)
        return []
    return sorted(int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit())


def remove_job_snapshots(root: Path, job_id: str) -> bool:
    """Free a finished job's node-local memory (the node's epilog calls this); True if removed."""
    directory = root / _job_key(job_id)
    if not directory.exists():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


@dataclass(frozen=True)
class SnapshotSeal:
    """What `seal.json` says about one snapshot: written last, so its presence means complete."""

    step: int  # completed steps the state stands for (the checkpoint numbering)
    run_id: str  # identity.json's run_id of the run that wrote it
    weight_fingerprint: str  # the vote's fingerprint of the state, under fingerprint_seed
    fingerprint_seed: int
    files: dict[str, str]  # file name -> sha256
    rank: int
    world_size: int
    created: float
    schema: int = SNAPSHOT_SCHEMA
    peers: tuple[int, ...] = ()  # ranks whose own state (RNG, stateful) this snapshot keeps

    @property
    def weights(self) -> bool:
        """Whether it holds the model and optimizer (the node's first rank's snapshot)."""
        return WEIGHTS_FILE in self.files

    @classmethod
    def parse(cls, obj: Any, source: str) -> SnapshotSeal:
        if not isinstance(obj, dict):
            raise RecordError(f"{source}: expected a JSON object")
        schema = obj.get("schema")
        if not isinstance(schema, int) or not 1 <= schema <= SNAPSHOT_SCHEMA:
            raise RecordError(f"{source}: unsupported snapshot schema {schema!r}")
        try:
            return cls(
                step=int(obj["step"]),
                run_id=str(obj["run_id"]),
                weight_fingerprint=str(obj["weight_fingerprint"]),
                fingerprint_seed=int(obj["fingerprint_seed"]),
                files=_files(obj["files"], source),
                rank=int(obj["rank"]),
                world_size=int(obj["world_size"]),
                created=float(obj["created"]),
                schema=schema,
                peers=_ranks(obj.get("peers", []), source),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise RecordError(f"{source}: malformed snapshot seal ({exc})") from None


def _ranks(value: Any, source: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(q, int) and not isinstance(q, bool) for q in value
    ):
        raise RecordError(f"{source}: 'peers' must be a list of ranks")
    return tuple(value)


def _files(value: Any, source: str) -> dict[str, str]:
    if (
        not isinstance(value, dict)
        or OWN_FILE not in value
        or not set(value) <= {OWN_FILE, WEIGHTS_FILE}
        or not all(isinstance(v, str) for v in value.values())
    ):
        raise RecordError(f"{source}: 'files' must map {OWN_FILE} (and {WEIGHTS_FILE}) to sha256")
    return dict(value)


class SnapshotStore:
    """One rank's snapshots of one job, in node-local memory (no collectives, no shared disk)."""

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
    ) -> SnapshotSeal:
        """Save host-side `state` and seal it; then drop all but the newest `keep` snapshots.

        Runs on the copier's background thread: `state` must already be a copy that the
        training step no longer writes to.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        stage = self.directory / f"{STAGING_PREFIX}{step:08d}-{os.getpid()}"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        try:
            parts = {OWN_FILE: {k: v for k, v in state.items() if k not in WEIGHT_KEYS}}
            if all(k in state for k in WEIGHT_KEYS):
                parts[WEIGHTS_FILE] = {k: state[k] for k in WEIGHT_KEYS}
            for name, part in parts.items():
                with open(stage / name, "wb") as f:
                    torch.save(part, f)
            seal = SnapshotSeal(
                step=step,
                run_id=run_id,
                weight_fingerprint=weight_fingerprint,
                fingerprint_seed=fingerprint_seed,
                files={name: sha256_file(stage / name) for name in parts},
                rank=self.rank,
                world_size=world_size,
                created=time.time(),
                peers=peers,
            )
            record = {**seal.__dict__, "peers": list(peers)}
            atomic_write_json(stage / SEAL_FILE, record)
            final = self.path(step)
            if final.exists():  # the same step again (a resumed run repeating it): replace
                shutil.rmtree(final)
            os.replace(stage, final)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        self.prune()
        return seal

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

    def seals(self) -> tuple[list[SnapshotSeal], dict[int, str]]:
        """The readable seals, newest first, and the snapshots whose seal is unusable (why).

        Never raises: node-local memory that cannot be listed holds no usable snapshot.
        """
        found: list[SnapshotSeal] = []
        unusable: dict[int, str] = {}
        try:
            steps = sorted(self._steps(), reverse=True) if self.directory.is_dir() else []
        except OSError as exc:
            logger.warning("cannot list snapshots in %s (%s)", self.directory, exc.strerror)
            return [], {}
        for step in steps:
            try:
                seal = SnapshotSeal.parse(
                    read_json_file(self.path(step) / SEAL_FILE), str(self.path(step))
                )
            except RecordError as exc:
                unusable[step] = str(exc)
                continue
            if seal.step != step or seal.rank != self.rank:
                unusable[step] = f"its seal says step {seal.step}, rank {seal.rank}"
                continue
            found.append(seal)
        return found, unusable

    def problem(
        self, seal: SnapshotSeal, run_id: str, files: tuple[str, ...] = (OWN_FILE, WEIGHTS_FILE)
    ) -> str | None:
        """Why these files of this snapshot must not be loaded, or None: another run, damage."""
        if seal.run_id != run_id:
            return f"sealed by another run ({seal.run_id}, this run is {run_id})"
        for name in (f for f in files if f in seal.files):
            try:
                if sha256_file(self.path(seal.step) / name) != seal.files[name]:
                    return f"{name} does not match its sealed sha256 (damaged)"
            except OSError as exc:
                return f"{name} cannot be read ({exc.strerror})"
        return None

    def load(
        self, seal: SnapshotSeal, files: tuple[str, ...] = (OWN_FILE, WEIGHTS_FILE)
    ) -> dict[str, Any]:
        """The sealed state of these files, on the CPU; the caller checks the fingerprint."""
        state: dict[str, Any] = {}
        for name in (f for f in files if f in seal.files):
            path = self.path(seal.step) / name
            part = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(part, dict):
                raise RecordError(f"{path}: not a snapshot (a {type(part).__name__})")
            state.update(part)
        return state
