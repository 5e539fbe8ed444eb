"""Inside a Slurm task: where it sits in the job, and joining the job's process group.

`init_distributed_from_slurm()` runs in every task and builds `torch.distributed` from what
Slurm says: rank and world size from `SLURM_PROCID`/`SLURM_NTASKS`, the rendezvous host from
the first node's `NodeAddr` (node names need not resolve as host names; on many clusters and
on the local test cluster they do not), a port derived from the job id, NCCL on GPUs, gloo on
CPUs. Only rank 0 asks Slurm for that `NodeAddr` (one `scontrol show node` per job step, not
one per task: thousands of tasks querying slurmctld at once load it for every job on the
cluster) and hands it to the others through a file in the run directory; node lists are
expanded without Slurm (`parsers.expand_hostlist`).

The pure parts (environment -> task, job id -> port) are separate functions so that they are
tested without Slurm. Submitting the job is `slurm_guard.slurm.launch`'s business.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from slurm_guard.errors import GuardError
from slurm_guard.slurm.parsers import SlurmParseError, expand_hostlist, parse_tasks_per_node
from slurm_guard.slurm.polling import poll

if TYPE_CHECKING:
    from slurm_guard.slurm.client import SlurmClient

logger = logging.getLogger(__name__)

RUN_DIR_ENV = "SLURM_GUARD_RUN_DIR"
"""Exported into every task by `launch()` and the sbatch template: the run directory."""
PORT_ENV = "SLURM_GUARD_MASTER_PORT"
"""Overrides the derived rendezvous port (a site with a firewall-approved range sets it)."""
ADDR_ENV = "SLURM_GUARD_MASTER_ADDR"
"""The rendezvous address, when something outside the tasks already knows it (the batch script,
a site's prolog): then no task asks Slurm. It must be the step's first node's address."""
RENDEZVOUS_DIR = ".rendezvous"
"""Under the run directory: rank 0's `<job>.<step>.<restart>.json` with the first node's
address, read by the other ranks (a requeued run or a later step writes a file of its own)."""
ATTEMPT_ENV = "SLURM_GUARD_ATTEMPT"
"""The in-job supervisor's step attempt (0, then 1 after a restart on a spare): moves the port,
as the restart count does for a requeue."""
PORT_BASE = 15000
PORT_SPAN = 5000
"""Derived ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's ephemeral range
(32768+), so an outgoing connection of another process cannot be holding the port."""
DEFAULT_INIT_TIMEOUT = datetime.timedelta(minutes=10)


class LaunchError(GuardError):
    """The job cannot be launched or the task cannot join the process group; says what to do."""


@dataclass(frozen=True)
class SlurmTask:
    """One Slurm task's place in the job, as Slurm's environment describes it.

    Attributes:
        rank: global rank (`SLURM_PROCID`).
        world_size: number of tasks in the step (`SLURM_NTASKS`).
        local_rank: rank on this node (`SLURM_LOCALID`): the GPU index to use.
        node_rank: index of this node in the step (`SLURM_NODEID`).
        nodes: the step's node names, in Slurm's order; rank 0 runs on `nodes[0]`.
        job_id: `SLURM_JOB_ID`.
        restart_count: `SLURM_RESTART_COUNT` (unset, so 0, on a job's first run).
        node: this task's node name (`SLURMD_NODENAME`).
        local_world_size: tasks of the step on this node (`SLURM_STEP_TASKS_PER_NODE`, the
            `SLURM_NODEID`-th count).
    """

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    nodes: tuple[str, ...]
    job_id: str
    restart_count: int
    node: str
    local_world_size: int

    @property
    def first_node(self) -> str:
        return self.nodes[0]


def _env_int(env: Mapping[str, str], names: Sequence[str], what: str) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(str(value))
            except ValueError:
                raise LaunchError(f"{name}={value!r} is not an integer ({what})") from None
    raise LaunchError(
        f"{names[0]} is not set: this is not a Slurm task. Run the script under `srun` (or "
        "through slurm_guard.slurm.launch), or start it with torchrun outside Slurm"
    )


def task_from_env(env: Mapping[str, str] | None = None) -> SlurmTask:
    """Read this task's place in the job from Slurm's environment variables.

    Step variables (`SLURM_STEP_*`) win over job variables: inside `srun` they describe the
    step, which may use fewer nodes than the allocation.
    """
    e = os.environ if env is None else env
    rank = _env_int(e, ("SLURM_PROCID",), "global rank")
    world = _env_int(e, ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS"), "world size")
    local = _env_int(e, ("SLURM_LOCALID",), "rank on the node")
    node_rank = _env_int(e, ("SLURM_NODEID",), "node index")
    nodelist = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST") or ""
    nodes = tuple(expand_hostlist(nodelist))
    if not nodes:
        raise LaunchError(
            "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set: cannot find the first "
            "node for the rendezvous; run under srun"
        )
    if not 0 <= rank < world:
        raise LaunchError(f"SLURM_PROCID={rank} outside 0..SLURM_NTASKS-1 ({world - 1})")
    job_id = e.get("SLURM_JOB_ID") or e.get("SLURM_JOBID") or ""
    if not job_id:
        raise LaunchError("SLURM_JOB_ID is not set: run inside a Slurm job")
    restart = int(e.get("SLURM_RESTART_COUNT") or 0)
    node = e.get("SLURMD_NODENAME") or (nodes[node_rank] if node_rank < len(nodes) else "")
    local_world = _tasks_on_node(e, node_rank)
    if not 0 <= local < local_world:
        raise LaunchError(f"SLURM_LOCALID={local} outside 0..{local_world - 1} (tasks per node)")
    return SlurmTask(rank, world, local, node_rank, nodes, job_id, restart, node, local_world)


def _tasks_on_node(env: Mapping[str, str], node_rank: int) -> int:
    """This node's task count: the step's (srun) over the job's (sbatch), as for the nodes."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value = env.get(name)
        if not value:
            continue
        try:
            counts = parse_tasks_per_node(value)
        except SlurmParseError as exc:
            raise LaunchError(f"{name}: {exc}") from None
        if not 0 <= node_rank < len(counts):
            raise LaunchError(f"SLURM_NODEID={node_rank} outside {name}={value!r}")
        return counts[node_rank]
    raise LaunchError(
        "neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set: cannot tell how "
        "many tasks share this node; run under srun"
    )


def torchrun_environment(task: SlurmTask, address: str, port: int) -> dict[str, str]:
    """The variables torchrun gives each worker, from the Slurm task (what frameworks read).

    Accelerate sizes its CPU thread pool by LOCAL_WORLD_SIZE, Lightning's and HF's launch
    checks read RANK/LOCAL_RANK/WORLD_SIZE, torchelastic-aware code reads GROUP_RANK (the node's
    index) and the ROLE_* pair. The TORCHELASTIC_* variables are left out on purpose: they
    claim an elastic agent that restarts workers, and frameworks that see them
    (`torch.distributed.is_torchelastic_launched()`) pick torchrun's environment over Slurm's.
    """
    return {
        "RANK": str(task.rank),
        "WORLD_SIZE": str(task.world_size),
        "LOCAL_RANK": str(task.local_rank),
        "LOCAL_WORLD_SIZE": str(task.local_world_size),
        "GROUP_RANK": str(task.node_rank),
        "GROUP_WORLD_SIZE": str(len(task.nodes)),
        "ROLE_RANK": str(task.rank),
        "ROLE_WORLD_SIZE": str(task.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": address,
        "MASTER_PORT": str(port),
    }


def port_for_job(job_id: str, restart_count: int = 0, attempt: int = 0) -> int:
    """The rendezvous port of a job: the same on every task, different between jobs.

    The restart count and the in-job attempt move it too, so a requeued run or a step
    restarted on a spare never waits for the previous run's listening socket to be released.
    """
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        raise LaunchError(f"job id {job_id!r} has no digits to derive a port from")
    return PORT_BASE + (int(digits) * 7 + restart_count + 101 * attempt) % PORT_SPAN


def rendezvous_address(node: str, client: SlurmClient) -> str:
    """The first node's `NodeAddr` as Slurm knows it (`scontrol show -o node`).

    Never resolve the node name: Slurm node names are labels, and `NodeAddr` is what slurmd
    itself is reached at.
    """
    address = client.node(node).address
    if not address or address in ("(null)", "N/A"):
        raise LaunchError(
            f"Slurm reports no NodeAddr for {node}; export {ADDR_ENV} (and {PORT_ENV} if "
            "needed) before srun, or fix the node's NodeAddr in slurm.conf"
        )
    return address


def rendezvous_file(run_dir: str | os.PathLike[str], task: SlurmTask, step_id: str = "") -> Path:
    """Where rank 0 publishes the address for this run of this step of the job."""
    step = re.sub(r"[^0-9A-Za-z_-]", "_", step_id) or "nostep"
    job = re.sub(r"[^0-9A-Za-z_-]", "_", task.job_id)
    return Path(run_dir) / RENDEZVOUS_DIR / f"{job}.{step}.{task.restart_count}.json"


def _publish(path: Path, task: SlurmTask, address: str | None, error: str | None) -> None:
    from slurm_guard.rundir.records import atomic_write_json

    record = {"job": task.job_id, "node": task.first_node, "address": address, "error": error}
    atomic_write_json(path, record)  # readers see the whole record or none


def _read_published(path: Path, task: SlurmTask) -> str | None:
    """The published address; None while there is none yet. Raises rank 0's error."""
    import json

    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LaunchError(f"cannot read the rendezvous record {path}: {exc}") from exc
    if not isinstance(record, dict) or record.get("node") != task.first_node:
        raise LaunchError(
            f"the rendezvous record {path} names node {record.get('node')!r} where this step's "
            f"first node is {task.first_node!r}; remove {path.parent} and rerun"
            if isinstance(record, dict)
            else f"the rendezvous record {path} is not a JSON object; remove it and rerun"
        )
    if record.get("error"):
        raise LaunchError(f"rank 0 could not find the rendezvous address: {record['error']}")
    address = record.get("address")
    if not isinstance(address, str) or not address:
        raise LaunchError(f"the rendezvous record {path} has no address; remove it and rerun")
    return address


def wait_for_address(
    path: Path, task: SlurmTask, timeout: datetime.timedelta, poll_s: float = 0.05
) -> str:
    """Rank > 0: wait (up to `timeout`, never longer) for rank 0's record at `path`."""
    try:
        return poll(
            lambda: _read_published(path, task),
            timeout.total_seconds(),
            f"rank 0's rendezvous record {path}",
            interval=poll_s,
            max_interval=1.0,
        )
    except TimeoutError:
        raise LaunchError(
            f"rank {task.rank}: rank 0 did not publish the rendezvous address in {path} "
            f"within {timeout.total_seconds():g} s. Look at rank 0's output (did it start? "
            f"can it reach slurmctld and write the run directory, which must be on storage "
            f"shared by all nodes?), or export {ADDR_ENV} before srun"
        ) from None


def step_rendezvous_address(
    task: SlurmTask,
    client: SlurmClient | Callable[[], SlurmClient] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: datetime.timedelta = DEFAULT_INIT_TIMEOUT,
) -> str:
    """The first node's address, asking Slurm at most once per job step (from rank 0).

    In order: `SLURM_GUARD_MASTER_ADDR` if set (nobody asks Slurm); else, with a run directory
    (`SLURM_GUARD_RUN_DIR`, set by `launch()` and the sbatch template), rank 0 asks Slurm and
    writes the answer (or its error) atomically to `rendezvous_file`, and the other ranks wait
    for it up to `timeout`; without a run directory every task asks Slurm itself (logged as a
    warning: that is the per-task load this avoids). `client` may be a factory, called by the
    tasks that ask only (building a client may itself run a Slurm command).
    """
    e = os.environ if env is None else env
    preset = e.get(ADDR_ENV)
    if preset:
        return preset
    run_dir = e.get(RUN_DIR_ENV)

    def ask() -> str:
        if client is None:
            from slurm_guard.slurm.client import default_client

            made = default_client()
        elif hasattr(client, "node"):  # a client, not a factory
            made = cast("SlurmClient", client)
        else:
            made = client()
        return rendezvous_address(task.first_node, made)

    if not run_dir:
        logger.warning(
            "%s is not set: every task asks Slurm for the rendezvous address; set it (or %s) "
            "so that only rank 0 does",
            RUN_DIR_ENV,
            ADDR_ENV,
        )
        return ask()
    path = rendezvous_file(run_dir, task, e.get("SLURM_STEP_ID", ""))
    if task.rank != 0:
        return wait_for_address(path, task, timeout)
    try:
        address = ask()
    except Exception as exc:
        # the other ranks fail with this cause at once instead of waiting out the timeout
        with contextlib.suppress(OSError):
            _publish(path, task, None, f"{type(exc).__name__}: {exc}")
        raise
    try:
        _publish(path, task, address, None)
    except OSError as exc:
        raise LaunchError(
            f"cannot write the rendezvous record {path} ({exc}): the run directory must be "
            f"writable and shared by all nodes; or export {ADDR_ENV} before srun"
        ) from exc
    _forget_earlier_runs(path, task)
    return address


def _forget_earlier_runs(path: Path, task: SlurmTask) -> None:
    """Remove this job step's records from before a requeue (lower restart counts): every task
    of those runs has ended, so nothing reads them, and a long run requeued many times would
    otherwise leave one file per restart. Best effort: a record left behind is harmless."""
    stem = path.name.rsplit(".", 2)[0]  # "<job>.<step>"
    for old in path.parent.glob(f"{stem}.*.json"):
        restart = old.name[len(stem) + 1 : -len(".json")]
        if restart.isdigit() and int(restart) < task.restart_count:
            with contextlib.suppress(OSError):
                old.unlink()


def task_environment(
    client: SlurmClient | Callable[[], SlurmClient] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: datetime.timedelta = DEFAULT_INIT_TIMEOUT,
) -> tuple[SlurmTask, dict[str, str]]:
    """This Slurm task and what torchrun would have given it (`torchrun_environment`).

    Never `ADDR_ENV` / `PORT_ENV`: exported into a process, they would pin the address and port
    of every job it submits (seen in tests: two jobs submitted from one process met on one
    port). Both are derived again, identically, wherever they are needed."""
    task = task_from_env(env)
    e = os.environ if env is None else env
    attempt = int(e.get(ATTEMPT_ENV) or 0)
    port = int(e.get(PORT_ENV) or port_for_job(task.job_id, task.restart_count, attempt))
    address = step_rendezvous_address(task, client, e, timeout)
    return task, torchrun_environment(task, address, port)


def init_distributed_from_slurm(
    client: SlurmClient | Callable[[], SlurmClient] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: datetime.timedelta = DEFAULT_INIT_TIMEOUT,
) -> SlurmTask:
    """Join the job's process group from inside a Slurm task; return the task's description.

    Backend `nccl` (and this task's GPU, by local rank) when CUDA is available, else `gloo`.
    Also exports what torchrun sets (`torchrun_environment`: RANK, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR...), so frameworks see under srun what they see under
    torchrun. The address comes from `step_rendezvous_address` (Slurm asked by rank 0 only);
    `timeout` bounds both the wait for it and the process-group set-up. Raises LaunchError with
    the fix when Slurm's environment is incomplete or rank 0 never published the address.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return task_from_env(env)
    task, exported = task_environment(client, env, timeout)
    address, port = exported["MASTER_ADDR"], int(exported["MASTER_PORT"])
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(task.local_rank % torch.cuda.device_count())
    backend = "nccl" if use_cuda else "gloo"
    os.environ.update(exported)
    logger.info(
        "rank %d/%d on %s joins %s at %s:%d",
        task.rank,
        task.world_size,
        task.node,
        backend,
        address,
        port,
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=task.rank,
        world_size=task.world_size,
        timeout=timeout,
    )
    return task


__all__ = [
    "ADDR_ENV",
    "ATTEMPT_ENV",
    "PORT_ENV",
    "RUN_DIR_ENV",
    "LaunchError",
    "SlurmTask",
    "init_distributed_from_slurm",
    "port_for_job",
    "rendezvous_address",
    "rendezvous_file",
    "step_rendezvous_address",
    "task_environment",
    "task_from_env",
    "torchrun_environment",
    "wait_for_address",
]
