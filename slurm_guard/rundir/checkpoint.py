"""Checkpoints that are complete or absent, and never trusted without proof.

Every rank writes its RNG state (`rng-rank-<r>.pt`) into a staging directory, and its
`stateful-rank-<r>.pt` when the run has state beyond the model (`Guard(stateful=...)`, an
enabled GradScaler: per rank, since a data loader's position differs per rank); rank 0 adds
`model.pt` and `optimizer.pt` and, last of all, `meta.json` with a sha256 per file and the
weight fingerprint the vote agreed on; then the directory is renamed into place. A
checkpoint without meta.json, with a file whose hash differs, or whose loaded state does not
reproduce the fingerprint, is never loaded.

Staging directories are named per attempt (`.staging-<step>-r<restart>-<attempt>`): a save that
was killed half-way leaves its directory to the next start, which deletes it, and can never mix
its files (a sealed meta.json above all) into a later save of the same step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from slurm_guard.errors import GuardError
from slurm_guard.rundir.layout import STAGING_PREFIX, RunDir
from slurm_guard.rundir.records import atomic_write_json, fsync_dir
from slurm_guard.rundir.trust import CheckpointMeta

logger = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
DCP_METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's index of a sharded save


def rng_file(rank: int) -> str:
    return f"rng-rank-{rank}.pt"


def stateful_file(rank: int) -> str:
    return f"stateful-rank-{rank}.pt"


def has_stateful(meta: CheckpointMeta) -> bool:
    """Whether the seal lists any rank's stateful file (not so before stateful= existed)."""
    return any(name.startswith("stateful-rank-") for name in meta.files)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def staging_dir(run_dir: RunDir, step: int, restart_count: int, attempt: str = "") -> Path:
    suffix = f"-{attempt}" if attempt else ""
    return run_dir.checkpoints_dir / f"{STAGING_PREFIX}{step:08d}-r{restart_count}{suffix}"


def discard(stage: Path) -> None:
    """Remove a staging directory after a failed save (best effort: the next start retries)."""
    shutil.rmtree(stage, ignore_errors=True)


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states (CPU, and CUDA where there is one): host copies, no sync."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def object_collectives_problem() -> str | None:
    """Why torch's object collectives cannot run on this rank, or None.

    A DCP save exchanges its plans with them (`gather_object`, `scatter_object`), and they turn
    received bytes back into objects with numpy. Without numpy the coordinator fails inside
    that exchange after the other ranks entered it; DCP does not carry that failure to them,
    so they would wait in its next collective until the backend's timeout. Asked on every rank
    before the save, through the agreement, so every rank stops at once with this text."""
    try:
        torch.zeros(1, dtype=torch.uint8).numpy()
    except RuntimeError as exc:
        return (
            f"torch's object collectives, which the DCP save needs, cannot run here ({exc}): "
            "install numpy into this environment (pip install numpy; slurm-guard declares it)"
        )
    return None


def failure_text(exc: BaseException) -> str:
    """What a failed save says to every rank: for DCP's CheckpointException (a BaseException,
    whose text is every failing rank's whole traceback) one line per failing rank, so the cause
    survives the agreement's cut to a few hundred characters; else the exception's text."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(exc)
    lines = []
    for rank, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        lines.append(f"rank {rank}: {type(error).__name__}: {error}")
    return "; ".join(lines)


def write_rank_files(
    stage: Path,
    rank: int,
    model_state: Any,
    optim_state: Any,
    rng: dict[str, torch.Tensor] | None = None,
    stateful: Any = None,
) -> None:
    """Called on every rank; only rank 0 passes model and optimizer state.

    `stateful` is this rank's `Guard(stateful=...)` state (None: none, no file); `publish`
    seals it with the rest.

    `rng` is the RNG state as the last completed step left it (None: now). A loop that draws
    from the RNG between steps (an eval before the save) does so again after a resume, so the
    state to restore is the one before it, not the one at save time.

    checkpoints/ must exist: it is never recreated here, so a run directory that vanished
    mid-run (or a shared filesystem that went away) fails the save instead of receiving it.
    """
    stage.mkdir(exist_ok=True)
    if rng is None:
        rng = rng_state()
    _save(rng, stage / rng_file(rank))
    if stateful is not None:
        _save(stateful, stage / stateful_file(rank))
    if model_state is not None:
        _save(model_state, stage / MODEL_FILE)
        _save(optim_state, stage / OPTIMIZER_FILE)


def publish(
    run_dir: RunDir,
    stage: Path,
    *,
    step: int,
    weight_fingerprint: str,
    fingerprint_seed: int,
    world_size: int,
    restart_count: int,
    run_id: str | None = None,
    shard_fingerprints: list[str] | None = None,
    layout: str | None = None,
    coordinates: list[list[int]] | None = None,
) -> Path:
    """Rank 0, after every rank wrote its files: seal with meta.json and rename into place.

    `shard_fingerprints`: a sharded checkpoint (DCP files, `slurm_guard.sharded.checkpoint`)
    records each rank's shard fingerprint, which that rank verifies on resume, and its mesh
    (`layout`, each rank's `coordinates`), which a resume on another mesh is refused by."""
    files = {
        p.name: sha256_file(p)
        for p in sorted(stage.iterdir())
        if p.is_file() and p.name != "meta.json"
    }
    meta = CheckpointMeta(
        step=step,
        weight_fingerprint=weight_fingerprint,
        fingerprint_seed=fingerprint_seed,
        clean_vote=True,
        files=files,
        world_size=world_size,
        restart_count=restart_count,
        created=time.time(),
        run_id=run_id,
        shard_fingerprints=shard_fingerprints,
        layout=layout,
        coordinates=coordinates,
    )
    atomic_write_json(stage / "meta.json", meta.__dict__)
    final = run_dir.checkpoint_path(step)
    if final.exists():
        # A checkpoint of the same step from an earlier incarnation: keep it, aside.
        os.replace(final, final.with_name(f".replaced-{final.name}-{int(time.time() * 1e3)}"))
    os.replace(stage, final)
    fsync_dir(run_dir.checkpoints_dir)
    return final


def verify_files(run_dir: RunDir, meta: CheckpointMeta) -> str | None:
    """None when every listed file is present with its recorded hash; else what is wrong.

    Never raises: an unreadable file is as unusable as a corrupt one.
    """
    directory = run_dir.checkpoint_path(meta.step)
    sharded = meta.shard_fingerprints is not None
    for required in (DCP_METADATA_FILE,) if sharded else (MODEL_FILE, OPTIMIZER_FILE):
        if required not in meta.files:
            return f"meta.json lists no {required}"
    for name, expected in meta.files.items():
        path = directory / name
        try:
            if not path.is_file():
                return f"{name} is missing"
            if sha256_file(path) != expected:
                return f"{name} does not match its recorded sha256 (corrupt or partial)"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
    return None


def load(
    run_dir: RunDir, meta: CheckpointMeta, rank: int, stateful: bool = False
) -> dict[str, Any]:
    """This rank's part of a checkpoint; raises where it is unusable.

    With `stateful`, the rank's stateful file is loaded when the seal lists it, and must match
    its sha256 (else the checkpoint is damaged, and skipped). `out["stateful"]` is None when
    the seal lists no stateful file at all (sealed before the objects were given, or by a
    version without them) or when this rank is beyond the ranks that saved it: what to do
    then is the caller's rule (`core.checkpoints.resume`), not damage. A seal that lists
    other ranks' files but not this rank's, within the saved world size, is damaged.
    """
    directory = run_dir.checkpoint_path(meta.step)
    out: dict[str, Any] = {
        "model": torch.load(directory / MODEL_FILE, map_location="cpu", weights_only=True),
        "optimizer": torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True),
        "rng": None,
        "stateful": None,
    }
    name = stateful_file(rank)
    if stateful and name in meta.files:
        path = directory / name
        if sha256_file(path) != meta.files[name]:  # rank 0 checked it; this is the bytes read
            raise GuardError(f"{name} does not match its recorded sha256")
        out["stateful"] = torch.load(path, map_location="cpu", weights_only=True)
    elif stateful and rank < meta.world_size and has_stateful(meta):
        raise GuardError(f"{directory.name} has no {name}, but other ranks' stateful files")
    rng_path = directory / rng_file(rank)
    if rank < meta.world_size and rng_path.is_file():
        out["rng"] = torch.load(rng_path, map_location="cpu", weights_only=True)
    else:
        logger.warning("checkpoint %s has no RNG state for rank %d", directory, rank)
    return out
