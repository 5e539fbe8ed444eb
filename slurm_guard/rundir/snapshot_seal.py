"""The seal of one node-local snapshot (`seal.json`): what it claims, and how it is read back.

Schema 2 (this version): `weight_fingerprint` is the fingerprint the passing vote computed
(parameters and optimizer state, combined with `buffer_fingerprint`, the buffers as the vote saw
them, when the vote took them in), so a resume can find that very value in the run's ledger; and
`weights.pt` carries no sha256 (an empty string): the loaded state must reproduce the
fingerprint, which catches what a hash would. Schema 1 seals are read, and fail that proof.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from slurm_guard.protocol import SNAPSHOT_SCHEMA
from slurm_guard.rundir.records import RecordError

__all__ = ["OWN_FILE", "SEAL_FILE", "WEIGHTS_FILE", "Hashing", "SnapshotSeal", "sha256_fd"]

OWN_FILE = "own.pt"
WEIGHTS_FILE = "weights.pt"
SEAL_FILE = "seal.json"


@dataclass(frozen=True)
class SnapshotSeal:
    """What `seal.json` says about one snapshot: written last, so its presence means complete."""

    step: int  # completed steps the state stands for (the checkpoint numbering)
    run_id: str  # identity.json's run_id of the run that wrote it
    weight_fingerprint: str  # the vote's fingerprint of the state, under fingerprint_seed
    fingerprint_seed: int
    files: dict[str, str]  # file name -> sha256 ("" for weights.pt: proven by the fingerprint)
    rank: int
    world_size: int
    created: float
    schema: int = SNAPSHOT_SCHEMA
    peers: tuple[int, ...] = ()  # ranks whose own state (RNG, stateful) this snapshot keeps
    buffer_fingerprint: str | None = None  # the buffers' part of the vote's fingerprint

    @property
    def weights(self) -> bool:
        """Whether it holds the model and optimizer (the node's first rank's snapshot)."""
        return WEIGHTS_FILE in self.files

    def record(self) -> dict[str, Any]:
        return {**self.__dict__, "peers": list(self.peers)}

    @classmethod
    def parse(cls, obj: Any, source: str) -> SnapshotSeal:
        if not isinstance(obj, dict):
            raise RecordError(f"{source}: expected a JSON object")
        schema = obj.get("schema")
        if not isinstance(schema, int) or not 1 <= schema <= SNAPSHOT_SCHEMA:
            raise RecordError(f"{source}: unsupported snapshot schema {schema!r}")
        buffers = obj.get("buffer_fingerprint")
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
                buffer_fingerprint=None if buffers is None else str(buffers),
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


def sha256_fd(fd: int) -> str:
    digest = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


class Hashing:
    """A write-only file that hashes what passes through it (one pass, not a second read)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        written: int = self.f.write(data)
        return written

    def flush(self) -> None:
        self.f.flush()
