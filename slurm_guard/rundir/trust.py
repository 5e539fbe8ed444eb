"""What makes a checkpoint trusted: its sealed metadata and the resume rule over it.

A checkpoint is trusted only if its `meta.json` (written last, so its presence means the save
completed) records a clean weight vote, and, after an alarm, only if enough passing replays
followed it before the alarm. Everything here is pure: the readers live in `layout`, the
collective resume in `restore`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slurm_guard.protocol import CHECKPOINT_SCHEMA
from slurm_guard.rundir.records import Alarm, LedgerEntry, RecordError


@dataclass(frozen=True)
class CheckpointMeta:
    """What `meta.json` says about one checkpoint; written last, so its presence means complete."""

    step: int
    weight_fingerprint: str
    clean_vote: bool
    files: dict[str, str]  # file name -> sha256
    world_size: int
    restart_count: int
    created: float
    schema: int = CHECKPOINT_SCHEMA
    fingerprint_seed: int | None = None  # the seed weight_fingerprint was computed under
    run_id: str | None = None  # identity.json's run_id of the run that saved it
    # a sharded (DCP) checkpoint: each rank's shard fingerprint, in rank order; None for DDP
    shard_fingerprints: list[str] | None = None
    # a sharded checkpoint's mesh: its description ("HSDP 2x2 x TP 2") and every rank's
    # [replicate, shard, TP] coordinate in rank order; None where an older slurm-guard saved it
    layout: str | None = None
    coordinates: list[list[int]] | None = None


def parse_checkpoint_meta(obj: Any, source: str) -> CheckpointMeta:
    if not isinstance(obj, dict):
        raise RecordError(f"{source}: expected a JSON object")
    schema = obj.get("schema")
    if not isinstance(schema, int) or schema < 1 or schema > CHECKPOINT_SCHEMA:
        raise RecordError(f"{source}: unsupported checkpoint schema {schema!r}")
    try:
        files = obj["files"]
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "/" not in k for k, v in files.items()
        ):
            raise RecordError(f"{source}: 'files' must map plain file names to sha256 strings")
        return CheckpointMeta(
            step=int(obj["step"]),
            weight_fingerprint=str(obj["weight_fingerprint"]),
            clean_vote=obj["clean_vote"] is True,
            files=dict(files),
            world_size=int(obj["world_size"]),
            restart_count=int(obj["restart_count"]),
            created=float(obj["created"]),
            schema=schema,
            fingerprint_seed=(
                int(obj["fingerprint_seed"]) if obj.get("fingerprint_seed") is not None else None
            ),
            run_id=str(obj["run_id"]) if isinstance(obj.get("run_id"), str) else None,
            shard_fingerprints=_shard_fingerprints(obj.get("shard_fingerprints"), source),
            layout=_layout(obj.get("layout"), source),
            coordinates=_coordinates(obj.get("coordinates"), int(obj["world_size"]), source),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"{source}: malformed checkpoint metadata ({exc})") from None


def _shard_fingerprints(value: Any, source: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecordError(f"{source}: 'shard_fingerprints' must be a list of strings")
    return list(value)


def _layout(value: Any, source: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise RecordError(f"{source}: 'layout' must be a string")
    return value


def _coordinates(value: Any, world_size: int, source: str) -> list[list[int]] | None:
    """Each rank's [replicate, shard, TP] coordinate: one per rank, three naturals each."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != world_size:
        raise RecordError(f"{source}: 'coordinates' must list one coordinate per rank")
    for c in value:
        if not isinstance(c, list) or len(c) != 3:
            raise RecordError(f"{source}: each of 'coordinates' must be [replicate, shard, TP]")
        if not all(type(x) is int and x >= 0 for x in c):
            raise RecordError(f"{source}: 'coordinates' must hold natural numbers")
    return [list(c) for c in value]


TRUST_POINT = "trust_point"
"""Ledger detail key of a step that counts toward trust without a replay (pure FSDP2 + ABFT)."""


def counts_for_trust(entry: LedgerEntry) -> bool:
    """Whether a ledger entry is a verification a checkpoint's trust can rest on.

    A passing replay; or, where no replica exists to replay against (pure FSDP2 with
    `abft=True`), a step whose checked GEMMs, conservation and finite checks all passed, which
    ShardedGuard records with `TRUST_POINT` in its detail (docs/integrations/fsdp.md says what
    that covers and what it does not).
    """
    if not entry.passed:
        return False
    return entry.check == "replay" or (entry.check == "abft" and TRUST_POINT in entry.detail)


def trust_limit(
    last_verified: int | None, verified_steps: Iterable[int], trust_replays: int
) -> int | None:
    """The newest step a trusted checkpoint may have: `trust_replays` passing replays after it.

    With trust_replays=1 that is the last passing replay V itself (the published rule). A fault
    that only shows on some data (dropout zeroing the corrupted activation in both computations,
    say) can pass one replay after its onset; each further required pass makes that less likely.
    """
    if last_verified is None:
        return None
    passes = sorted({s for s in verified_steps if s <= last_verified} | {last_verified})
    return passes[-trust_replays] if len(passes) >= trust_replays else None


def choose_trusted_checkpoint(
    checkpoints: list[CheckpointMeta],
    alarm: Alarm | None,
    verified_steps: Iterable[int] = (),
    trust_replays: int = 1,
) -> CheckpointMeta | None:
    """The resume rule.

    Without an alarm: the newest checkpoint saved after a clean vote. After an alarm: the newest
    clean checkpoint whose step (= completed steps) is at most `trust_limit`, i.e. followed by
    `trust_replays` passing replays before the alarm. A persistent fault that began after those
    replays cannot have touched it. With too few verified steps nothing is trusted and training
    restarts from scratch.
    """
    if alarm is None:
        return newest_clean(checkpoints)
    limit = trust_limit(alarm.last_verified_step, verified_steps, trust_replays)
    return None if limit is None else newest_clean(checkpoints, limit)


def newest_clean(
    checkpoints: list[CheckpointMeta], up_to: int | None = None
) -> CheckpointMeta | None:
    """The newest checkpoint saved after a clean vote, at or before step `up_to` if given."""
    clean = [c for c in checkpoints if c.clean_vote and (up_to is None or c.step <= up_to)]
    return max(clean, key=lambda c: c.step, default=None)
