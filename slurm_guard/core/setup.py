"""What the Guard agrees on once, at construction, before the first step.

The run directory must be reachable from every rank, the fingerprint seed must be the run's (not
the job start's), and every rank must run with the same settings.

Why here and not per step: settings that differ between ranks do not fail at once, they make the
ranks take different collective paths later (rank 1 replays every 6th step, the others every
10th), which hangs the job until the backend's timeout with an error that names no one. One
all-gather of digests at start turns that into an error naming the ranks and the fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology
from slurm_guard.config import ConfigError, GuardConfig
from slurm_guard.errors import GuardError
from slurm_guard.faults.injection import Fault
from slurm_guard.kernels.warm import WarmUpReport, warm_up
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import RecordError, read_json_file

logger = logging.getLogger(__name__)

_SHOWN = 4  # differing ranks described field by field; the rest are counted


def _version() -> str:
    try:
        return metadata.version("slurm-guard")
    except metadata.PackageNotFoundError:
        return "unknown"


def setup_fields(
    config: GuardConfig,
    params: Sequence[torch.Tensor],
    comm: Collective,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Everything that must be identical on every rank, each as text."""
    fields = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)}
    fields.update(extra or {})
    fields["parameters (shapes and dtypes)"] = repr(
        [(tuple(p.shape), str(p.dtype)) for p in params]
    )
    fields["world (size, backend)"] = repr((comm.world_size, comm.backend))
    fields["slurm-guard version"] = _version()
    return fields


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def check_same_setup(
    comm: Collective,
    config: GuardConfig,
    params: Sequence[torch.Tensor],
    extra: Mapping[str, str] | None = None,
) -> None:
    """Raise ConfigError on every rank if any rank's settings, model or version differ.

    `extra`: more fields by name (the stateful names: every rank saves and loads the same
    files). The error names each differing rank and field, with both values where they are short.
    """
    fields = setup_fields(config, params, comm, extra)
    names = sorted(fields)
    key = "setup-fields"
    short = {n: v for n, v in fields.items() if len(v) <= 120}
    comm.post_cause(key, json.dumps(short), limit=8000)
    rows = comm.all_gather_rows([_digest(fields[n]) for n in names])
    reference = rows[0]
    differing = {
        r: [n for i, n in enumerate(names) if row[i] != reference[i]]
        for r, row in enumerate(rows)
        if row != reference
    }
    if not differing:
        return
    _, ref_text = comm.read_cause(key, 0)
    ref_values = _loads(ref_text)
    parts = []
    for r, changed in list(differing.items())[:_SHOWN]:
        _, text = comm.read_cause(key, r)
        mine = _loads(text)
        shown = [
            f"{n}={mine[n]} (rank 0: {ref_values[n]})" if n in mine and n in ref_values else n
            for n in changed
        ]
        parts.append(f"rank {r}: " + ", ".join(shown))
    if len(differing) > _SHOWN:
        parts.append(f"and {len(differing) - _SHOWN} more rank(s)")
    raise ConfigError(
        "the ranks were started with different guard settings, models or slurm-guard versions "
        "(they would take different collective paths and hang): "
        + "; ".join(parts)
        + ". Build the same GuardConfig and model on every rank."
    )


def _loads(text: str) -> dict[str, str]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def warn_small_world(topology: Topology, rank: int) -> None:
    """Say once what cannot be checked at world size 1 or 2 (rank 0 only)."""
    if rank != 0:
        return
    world = topology.world_size
    if world == 1:
        _warn_once(
            "world1",
            "slurm-guard at world size 1: no other rank can replay this rank's steps or vote "
            "against its weights, so only the NaN/Inf and all-reduce checks run; a NaN gets "
            "verdict 'ambiguous' (no replay can tell hardware from data). Run on 3 or more "
            "ranks on 3 or more nodes for attributed verdicts.",
        )
    elif world == 2:
        _warn_once(
            "world2",
            "slurm-guard at world size 2: replays and votes detect a fault but cannot say which "
            "of the two ranks computed wrong (no third rank, no strict majority): such alarms "
            "get verdict 'ambiguous' and the controller drains no node. Run on 3 or more ranks "
            "on 3 or more nodes for attributed verdicts.",
        )


def announce_faults(faults: Sequence[Fault], topology: Topology, rank: int, from_env: int) -> None:
    """Rank 0 logs the faults this run injects (every rank knows the same agreed list, so one
    line says it for all), so that no injected alarm looks real."""
    if not faults or rank != 0:
        return
    source = f"{from_env} from SLURM_GUARD_INJECT, {len(faults) - from_env} from GuardConfig.faults"
    logger.warning(
        "fault injection is ON (%s): %s; alarms raised while a fault is active are "
        "marked injected=true",
        source,
        "; ".join(f.describe() for f in faults),
    )
    nodes = topology.nodes
    for fault in faults:
        if fault.node is not None and nodes == [fault.node]:
            logger.warning(
                "injected fault '%s' targets node %s, which hosts every rank of this job "
                "(a single-host run): it corrupts every replica alike, so no replay or vote can "
                "see it. Use rank=N, or run on several nodes (SLURMD_NODENAME per rank).",
                fault.describe(),
                fault.node,
            )


def prepare_run_dir(comm: Collective, path: Path) -> None:
    """Rank 0 creates the run directory when only its last part is missing, as training
    scripts create their output directory on rank 0 alone (nanoGPT's `out_dir`), with no
    barrier before the Guard; then every rank checks it (`check_run_dir`). A missing parent is
    still an error (a typo), and a directory that rank 0 made on its own node's disk fails the
    check on every other node."""

    def create() -> None:
        if comm.rank == 0 and not path.exists() and path.parent.is_dir():
            with contextlib.suppress(FileExistsError):
                path.mkdir()

    comm.agree(create, "run directory creation")
    comm.agree(lambda: check_run_dir(path), "run directory check")


def check_run_dir(path: Path) -> None:
    """Raises GuardError when `path` is not a writable directory (run on every rank)."""
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:
        raise GuardError(
            f"run directory {path} cannot be accessed ({exc.strerror}); every rank and the "
            "controller must be able to read and write it"
        ) from None
    if not exists:
        raise GuardError(
            f"run directory {path} does not exist; create it on a filesystem shared by all "
            "nodes (not node-local disk) and pass its path (the guard creates only its last "
            "part, on rank 0)"
        )
    if not is_dir:
        raise GuardError(f"run directory {path} is not a directory")
    probe = path / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise GuardError(
            f"run directory {path} is not writable ({exc.strerror}); alarms and checkpoints go "
            "there: fix its permissions or choose another directory"
        ) from None


def agree_on_seed(comm: Collective, config: GuardConfig, run_dir: RunDir) -> int:
    """The fingerprint seed: per run (not per job start), so checkpoints stay verifiable."""
    seed = 0
    if comm.rank == 0:
        seed = config.seed if config.seed is not None else secrets.randbits(62)
        with contextlib.suppress(RecordError, KeyError, TypeError, ValueError):
            seed = int(read_json_file(run_dir.run_file)["seed"])
    return comm.broadcast_ints([seed])[0]


def bucket_numels(ddp: DistributedDataParallel | None, params: Sequence[torch.Tensor]) -> list[int]:
    """Element counts of what the kernels will check: DDP's buckets (from its logging data,
    in bytes; absent, or with mixed dtypes, the whole gradient as one bucket instead) and
    each gradient on its own (the replay's finite check), so that Triton compiles each size's
    specialization at set-up and not inside the comm hook at step 0."""
    numels = [p.numel() for p in params]
    dtypes = {p.dtype for p in params}
    sizes = ""
    if ddp is not None and len(dtypes) == 1:
        # A private API (tested on torch 2.13 and 2.14): any failure means the fallback, which
        # only moves a Triton compile from set-up to the first step, never changes a check.
        with contextlib.suppress(Exception):
            data = ddp._get_ddp_logging_data()  # type: ignore[no-untyped-call]
            sizes = str(data.get("bucket_sizes", ""))
    try:
        size = torch.empty(0, dtype=next(iter(dtypes))).element_size()
        buckets = [int(b) // size for b in sizes.split(",") if b.strip()]
    except (ValueError, StopIteration):
        buckets = []
    return [*(buckets or [sum(numels)]), *numels]


def warm_kernels(
    comm: Collective, ddp: DistributedDataParallel | None, params: Sequence[torch.Tensor]
) -> WarmUpReport:
    """Load the C kernels and compile the Triton ones at `Guard()`, never at step 9.

    Why here: a kernel built at its first use compiles inside the comm hook or the first vote,
    on every rank at once, and a compiler missing on one node would fail there. `warm_up`
    builds each library once per node (the others wait on its lock) and falls back to the
    torch version with one warning when a compile fails; anything else it raises reaches every
    rank through the agreement, so all stop with the same named error.
    """
    device = params[0].device if params else None
    numels = bucket_numels(ddp, params)
    dtypes = sorted({p.dtype for p in params}, key=str) or [torch.float32]
    return comm.agree(
        lambda: warm_up(device, bucket_numels=numels, dtypes=dtypes, world_size=comm.world_size),
        "kernel warm-up (slurm_guard.kernels)",
    )
