"""Sharded checkpoints through torch.distributed.checkpoint (DCP), sealed like the DDP guard's.

A save is the DDP guard's save with DCP files in place of model.pt and optimizer.pt: the shard
vote first, then every rank's RNG file and DCP's `.metadata` plus one `__<rank>_0.distcp` per
rank (what torchtitan writes) into the staging directory, then rank 0 seals `meta.json` with a
sha256 per file and every rank's shard fingerprint, and renames the directory into place. The
trust rule, the quarantine and the resume plan are the DDP guard's (`rundir.recovery`,
`rundir.restore`): only the load differs. Each rank reads its own shards without collectives
(`no_dist=True`), so a checkpoint damaged on one rank is skipped by every rank together, and
must reproduce the shard fingerprint it was sealed with before training goes on.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from slurm_guard.core.checkpoints import begin_save, record_resume
from slurm_guard.errors import GuardError
from slurm_guard.fingerprint.tree import as_hex, lanes_to_int
from slurm_guard.rundir import checkpoint as ckpt
from slurm_guard.rundir.records import read_json_file
from slurm_guard.rundir.restore import SnapshotSource, resume_collectively
from slurm_guard.rundir.resumes import ResumeNote
from slurm_guard.rundir.trust import CheckpointMeta, parse_checkpoint_meta

if TYPE_CHECKING:
    from torch import nn

    from slurm_guard.comm.collective import Collective
    from slurm_guard.config import GuardConfig
    from slurm_guard.fingerprint.tree import Fingerprinter
    from slurm_guard.rundir.layout import RunDir
    from slurm_guard.sharded.layout import Layout


class GuardState(Protocol):
    """What a save and a resume read and set of `sharded.guard.ShardedGuard` (a protocol, so
    the guard can import this module without a cycle)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: GuardConfig
    comm: Collective
    run_dir: RunDir
    fingerprinter: Fingerprinter
    layout: Layout
    rank: int
    world_size: int
    job_id: str | None
    restart_count: int
    attempt: str
    run_id: str
    resume_note: ResumeNote | None
    step_count: int
    voted_at: int
    last_verified_step: int | None
    verified_steps: list[int]
    rng_after_step: dict[str, torch.Tensor] | None

    @property
    def snapshots(self) -> SnapshotSource | None: ...

    def vote(self, step: int) -> None: ...

    def shard_fingerprint(self) -> torch.Tensor: ...


logger = logging.getLogger(__name__)


# Path parts that wrappers insert (torch.compile, activation checkpointing, FSDP1): dropped
# from the saved names, as DCP's own state-dict helpers drop them, so a checkpoint keeps its
# keys when a wrapper is added or removed between runs.
WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _saved_name(path: str) -> str:
    return ".".join(part for part in path.split(".") if part not in WRAPPER_PARTS)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of `model`, keyed by its module path.

    Not `model.state_dict()` nor DCP's `get_model_state_dict`: a module's state-dict hooks may
    rename keys (torchtitan's fused QKV splits `wqkv` into `wq`/`wk`/`wv`, which
    `get_model_state_dict` cannot map back to a parameter) and may gather shards to do it,
    a collective that a per-rank load must not run. The tensors themselves are what a resume
    restores; DCP reads into them in place (the local shard of each DTensor).
    """
    state: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
            raise GuardError(
                f"module {path or '(root)'} ({type(module).__name__}) keeps extra state "
                "(get_extra_state), which a sharded checkpoint does not save yet: use a "
                "model without it, or sg.Guard"
            )
    for name, param in model.named_parameters():
        state[_saved_name(name)] = param.detach()
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            state[_saved_name(name)] = buffer.detach()
    return state


def _state(guard: GuardState) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter path, as DCP saves it."""
    return {
        "model": model_tensors(guard.model),
        "optimizer": get_optimizer_state_dict(guard.model, guard.optimizer),
    }


def save_checkpoint(guard: GuardState) -> Path:
    """Vote, then save atomically into run_dir/checkpoints/step-N (all ranks must call)."""
    step = begin_save(guard)
    comm, rank = guard.comm, guard.rank
    lanes = guard.shard_fingerprint()
    rows = comm.all_gather_rows(lanes)  # every rank's shard fingerprint, for the seal
    shards = [f"{lanes_to_int(r):016x}" for r in rows]
    combined = as_hex(guard.fingerprinter.combine(torch.tensor(r) for r in rows))
    stage = ckpt.staging_dir(guard.run_dir, step, guard.restart_count, guard.attempt)
    problem = None
    try:
        ckpt.write_rank_files(stage, rank, None, None, guard.rng_after_step)
    except Exception as exc:  # any failure must reach every rank, not hang them
        logger.exception("rank %d could not write its RNG file", rank)
        problem = f"checkpoint at step {step}: could not write rank {rank}'s files ({exc})"
    # what DCP would fail on inside its own exchange, stranding the others: asked first
    problem = problem or ckpt.object_collectives_problem()
    comm.share_problem(problem, "checkpoint files")
    try:
        # DCP's own collectives carry a failure of one rank's planning or writing to every rank
        # (CheckpointException); one inside its exchange would not (`object_collectives_problem`)
        state_dict_saver.save(_state(guard), checkpoint_id=stage)
    except (Exception, CheckpointException) as exc:  # (DCP's own is a BaseException)
        logger.exception("rank %d: the DCP save failed", rank)
        problem = f"checkpoint at step {step}: the DCP save failed ({ckpt.failure_text(exc)})"
    try:
        comm.share_problem(problem, "checkpoint DCP save")
    except GuardError:
        if rank == 0:
            ckpt.discard(stage)
        raise
    path = guard.run_dir.checkpoint_path(step)
    if rank == 0:
        try:
            path = ckpt.publish(
                guard.run_dir,
                stage,
                step=step,
                weight_fingerprint=combined,
                fingerprint_seed=guard.fingerprinter.seed,
                world_size=guard.world_size,
                restart_count=guard.restart_count,
                run_id=guard.run_id,
                shard_fingerprints=shards,
                layout=guard.layout.describe(),
                coordinates=guard.layout.coordinates(),
            )
        except Exception as exc:
            logger.exception("could not publish checkpoint %s", path)
            problem = f"checkpoint at step {step} could not be published ({exc})"
            ckpt.discard(stage)
    comm.share_problem(problem, "checkpoint publish")
    return path


def load_shards(guard: GuardState, step: int) -> None:
    """Load checkpoint `step` into this rank's shards; raise where it is unusable here.

    No collectives: DCP reads this rank's pieces alone (`no_dist=True`) straight into the
    model's own tensors (the module's state-dict hooks never run, `model_tensors`), and the
    optimizer helper copies into the local shards.
    """
    directory = guard.run_dir.checkpoint_path(step)
    meta = parse_checkpoint_meta(read_json_file(directory / "meta.json"), str(directory))
    sealed = meta.shard_fingerprints
    if sealed is None:
        raise GuardError(f"{directory.name} is not a sharded checkpoint (saved by the DDP Guard)")
    if meta.world_size != guard.world_size or len(sealed) != guard.world_size:
        raise GuardError(
            f"{directory.name} was saved on {meta.world_size} ranks and this run has "
            f"{guard.world_size}: each rank's shard fingerprint can only be verified on the "
            "same mesh"
        )
    if meta.fingerprint_seed not in (None, guard.fingerprinter.seed):
        raise GuardError(f"{directory.name} was sealed under another fingerprint seed")
    state = _state(guard)
    with warnings.catch_warnings():
        # no_dist=True is the point (no collective inside the per-rank load); DCP warns that
        # it "assumes a single process", which is true of each rank's own shards
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        state_dict_loader.load(state, checkpoint_id=directory, no_dist=True)
    set_optimizer_state_dict(guard.model, guard.optimizer, state["optimizer"])
    rng_path = directory / ckpt.rng_file(guard.rank)
    if ckpt.rng_file(guard.rank) in meta.files:
        rng = torch.load(rng_path, map_location="cpu", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    mine = f"{lanes_to_int(guard.shard_fingerprint().tolist()):016x}"
    if mine != sealed[guard.rank]:
        raise GuardError(
            f"rank {guard.rank}'s loaded shards do not reproduce the sealed fingerprint "
            f"({mine} != {sealed[guard.rank]})"
        )


def other_mesh(meta: CheckpointMeta, world_size: int, layout: Layout | None = None) -> str | None:
    """Why a sharded checkpoint of another world size or layout stops the resume, or None.

    Each rank's shards are verified against the fingerprint that rank sealed, so only the same
    mesh can load it: the same number of ranks, each at the (replicate, shard, TP) coordinate
    it was saved at (`meta.coordinates`; a checkpoint of an older slurm-guard records none, and
    its shard fingerprints alone prove it). An older checkpoint would be the same, so this is
    not damage to skip past but a setting to change.
    """
    if meta.shard_fingerprints is None:
        return None
    saved, at = f"checkpoint step-{meta.step:08d} was saved", meta.coordinates
    if meta.world_size != world_size:
        why = f"{saved} on {meta.world_size} ranks and this run has {world_size}"
        where = f"on {meta.world_size} ranks (the same mesh)"
    elif layout is None or at is None or at == layout.coordinates():
        return None
    else:
        here = layout.coordinates()
        rank = next(r for r, c in enumerate(at) if c != here[r])
        what = meta.layout or "another mesh"
        why = (
            f"{saved} on {what} and this run is {layout.describe()} (rank {rank} at "
            f"[replicate, shard, TP] {at[rank]} there, {here[rank]} here)"
        )
        where = f"on the saved layout ({what}, on {meta.world_size} ranks)"
    return (
        f"{why}: a sharded checkpoint is verified shard by shard on the mesh that saved it. "
        f"Resume {where}, or start fresh (SLURM_GUARD_RESUME=fresh, which moves the "
        "checkpoints to quarantine/)"
    )


def resume(guard: GuardState) -> int:
    """Load the trusted checkpoint (the DDP guard's rule); return the step to start from."""
    comm = guard.comm
    comm.arrive("resume()")
    resumed = resume_collectively(
        comm,
        guard.run_dir,
        guard.rank,
        guard.config.trust_replays,
        lambda step: load_shards(guard, step),
        run_id=guard.run_id,
        refuse=lambda meta: other_mesh(meta, guard.world_size, guard.layout),
        snapshots=guard.snapshots,
    )
    guard.verified_steps = resumed.verified_steps
    if resumed.step < 0:
        guard.step_count = 0
        guard.last_verified_step = None
    else:
        guard.step_count = resumed.step
        guard.last_verified_step = resumed.last_verified_step
        guard.voted_at = resumed.step
        guard.rng_after_step = ckpt.rng_state()
    record_resume(guard, resumed)  # and rank 0's resume line, as the DDP guard's
    return guard.step_count
