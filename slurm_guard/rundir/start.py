"""Claiming the run directory at job start, and the run.json that describes this start.

Rank 0 takes the lock (a second job on the directory is refused) and checks the run's identity;
then the first rank of each node leaves a marker and must see every other node's (one per node:
O(nodes^2) directory entries on the shared file server, not O(W^2)), which catches a node-local
directory at start, not at the first resume. Kept apart from the Guard: it needs only the
collective, the topology and the job's identity, and every failure reaches every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import shutil
from dataclasses import dataclass

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology
from slurm_guard.config import GuardConfig
from slurm_guard.errors import GuardError
from slurm_guard.faults.injection import Fault
from slurm_guard.fingerprint.nh import backend
from slurm_guard.protocol import RUN_SCHEMA
from slurm_guard.rundir.identity import (
    establish_identity,
    identity_stamp,
    markers_problem,
    markers_seen,
    prepare_markers,
    write_marker,
)
from slurm_guard.rundir.layout import RunDir, fresh_start_requested
from slurm_guard.rundir.lock import RunLock
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenedRun:
    """What a start holds on to so each save can check the directory is still its own."""

    attempt: str  # random per start, shared by every rank
    lock: RunLock | None  # rank 0 only
    run_id: str  # from identity.json
    stamp: tuple[int, int, int, int]  # identity_stamp at start


def open_run_dir(
    comm: Collective,
    run_dir: RunDir,
    rank: int,
    world_size: int,
    topology: Topology,
    *,
    job_id: str | None,
    restart_count: int,
) -> OpenedRun:
    """Make sure the run directory is this run's, one directory for all ranks, one job's."""
    attempt = f"{comm.broadcast_ints([secrets.randbits(48)])[0]:012x}"
    lock: RunLock | None = None
    problem = None
    if rank == 0:
        try:
            lock = RunLock.acquire(
                run_dir, job_id=job_id, restart_count=restart_count, attempt=attempt
            )
            run_dir.ensure()
            establish_identity(run_dir, job_id=job_id, fresh=fresh_start_requested())
            for name in run_dir.remove_stale_staging():
                logger.info("removed %s, left by a save that did not finish", name)
            prepare_markers(run_dir, attempt)
        except (GuardError, RecordError, OSError) as exc:
            problem = str(exc)
    comm.share_problem(problem, "run directory lock and identity")
    run_id = ""
    problem = None
    names = topology.nodes
    node_index = names.index(topology.node_of(rank))
    first_on_node = rank == min(
        r for r in range(world_size) if topology.node_of(r) == names[node_index]
    )
    try:
        identity = read_json_file(run_dir.identity_file)
        run_id = str(identity["run_id"])
        if first_on_node:
            problem = write_marker(run_dir, attempt, node_index, run_id)
    except (RecordError, KeyError, TypeError) as exc:
        problem = f"cannot read the run directory's identity ({exc})"
    if problem is not None:
        problem += (
            f"; {run_dir.root} must be one directory on a filesystem that every node "
            "mounts at the same path"
        )
    comm.share_problem(problem, "run directory markers")
    # one marker per node, listed by one rank per node: O(nodes^2) directory entries, not O(W^2)
    seen = markers_seen(run_dir, attempt, len(names)) if first_on_node else len(names)
    digest = int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:7], "big")
    rows = comm.all_gather_rows([seen, digest])
    seen_by = [int(r[0]) for r in rows]
    nodes = [topology.node_of(r) for r in range(world_size)]
    problem = markers_problem(seen_by, nodes, run_dir.root, expected=len(names))
    if problem is None and len({int(r[1]) for r in rows}) > 1:
        problem = (
            f"the ranks read different identity.json files under {run_dir.root}: the "
            "path names different directories on different nodes"
        )
    if problem is not None:
        raise GuardError(problem)
    if rank == 0:
        shutil.rmtree(run_dir.markers_dir / attempt, ignore_errors=True)
    return OpenedRun(attempt, lock, run_id, identity_stamp(run_dir))


def write_run_file(
    run_dir: RunDir,
    opened: OpenedRun,
    *,
    seed: int,
    job_id: str | None,
    restart_count: int,
    world_size: int,
    topology: Topology,
    config: GuardConfig,
    faults: tuple[Fault, ...],
    abft_coverage: dict[str, object] | None,
    started: float,
    replayer: list[int] | None = None,
    layout: dict[str, object] | None = None,
) -> None:
    """Rank 0: run.json, what the controller and a later start read about this one.

    `replayer` and `layout`: ShardedGuard's own (its replays pair data-parallel indices, not
    the DDP ring of `topology`); a DDP run leaves them to the topology and records no layout.
    """
    atomic_write_json(
        run_dir.run_file,
        {
            "schema": RUN_SCHEMA,
            "run_id": opened.run_id,
            "attempt": opened.attempt,
            "seed": seed,
            "fingerprint": {"scheme": "nh1", "rank0_backend": backend()},
            "job_id": job_id,
            "restart_count": restart_count,
            "world_size": world_size,
            "ranks": [dataclasses.asdict(r) for r in topology.ranks],  # gpu: null on CPU
            "replayer": list(topology.replayer) if replayer is None else replayer,
            "layout": layout,
            "config": config.summary(),
            # every fault this run injects, from GuardConfig.faults and SLURM_GUARD_INJECT
            "injected_faults": [f.describe() for f in faults],
            # share of the model's matmul FLOPs the checked GEMMs cover (abft=True)
            "abft_coverage": abft_coverage,
            "started": started,
        },
    )
