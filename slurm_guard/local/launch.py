"""Run a function on N local processes as a real torch.distributed (gloo) job.

Each process may pose as its own Slurm node (`SLURMD_NODENAME`), so the demo and the tests can
run a 3- or 4-node job on one machine. Outcomes come back per rank: the function's return value,
the alarm that stopped it, or the error that killed it.

Ranks are spawned: a fresh interpreter each, so no thread or CUDA state of the caller leaks
into them. `SLURM_GUARD_LOCAL_START=forkserver` forks them instead from a server process that
imported torch and slurm-guard once and did nothing else (no thread, no CUDA): a 4-rank launch
then starts in a tenth of a second instead of seconds of imports per rank. Not yet the test
suite's default: a full run with it, before each rank got the caller's stdout and stderr,
failed one test in an order-dependent way (a rank read "no cause recorded" for another's
failure in tests/test_failsafe_hangs.py); with the handover that file passes, but the whole
suite has not run under it yet.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist

from slurm_guard.errors import SilentDataCorruption
from slurm_guard.local.script import pose_env

START_ENV = "SLURM_GUARD_LOCAL_START"
PRELOAD = ["torch", "torch.distributed", "slurm_guard", "slurm_guard.local.launch"]


def _context() -> Any:
    """The multiprocessing context the ranks start from: spawn, or forkserver on request."""
    method = os.environ.get(START_ENV, "spawn")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_ENV}={method!r}: use spawn (the default) or forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


@dataclass
class RankOutcome:
    rank: int
    status: str  # "ok" | "alarm" | "error" | "lost"
    value: Any = None  # return value, the Alarm's JSON, or a traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _CallersFd:
    """One of the caller's file descriptors, handed to a rank as multiprocessing hands a pipe:
    a forked rank's stdout and stderr would otherwise be the server's, from when it started,
    not where the caller's go now (a terminal, a log, pytest's capture)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(duplicate: Any) -> int:
    fd: int = duplicate.detach()
    return fd


def _worker(
    rank: int,
    world: int,
    port: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    stdio: tuple[int, int],
) -> None:
    for mine, callers in zip((1, 2), stdio, strict=True):
        if callers != mine:  # a spawned rank gets the caller's fds under their own numbers
            os.dup2(callers, mine)
            os.close(callers)
    # The caller's environment as it is now (a forked rank would otherwise see the server's,
    # from when it started), then the rank's own variables.
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)  # bitwise-reproducible CPU results across processes
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        outcome = RankOutcome(rank, "ok", fn(*args))
    except SilentDataCorruption as exc:
        outcome = RankOutcome(rank, "alarm", exc.alarm.to_json())
    except BaseException:
        outcome = RankOutcome(rank, "error", traceback.format_exc())
    finally:
        # The function may have torn the group down itself (exit_on_alarm's caller, a
        # training script's own cleanup); a second destroy would raise and lose the outcome.
        if dist.is_initialized():
            dist.destroy_process_group()
    # Tensors go through the queue as bytes: torch's shared-memory handles would die with us.
    buffer = io.BytesIO()
    torch.save(outcome, buffer)
    results.put(buffer.getvalue())


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    nodes: Sequence[str] | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = 300.0,
    ranks_per_node: int | None = None,
) -> list[RankOutcome]:
    """Run `fn(*args)` on `world_size` processes; `nodes[r]` becomes rank r's SLURMD_NODENAME.

    `ranks_per_node` G places the ranks as `slurm-guard local --ranks-per-node G` does: G to a
    node in srun's block layout, node<k+1> unless `nodes` names them, with srun's and
    torchrun's variables for that place (`pose_env`: LOCAL_RANK on the node, GROUP_RANK...).
    Without it LOCAL_RANK is the rank and LOCAL_WORLD_SIZE the world size.

    `fn` must be importable (a module-level function): processes are spawned (or forked from a
    clean server, `SLURM_GUARD_LOCAL_START`), never from the caller, so no thread or CUDA state
    leaks from it; each rank gets the caller's environment as it is at the call.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        # torchrun's variables too: frameworks (Accelerate) read them even when the process
        # group already exists
        pose = pose_env(rank, world_size, port, ranks_per_node)
        if ranks_per_node is None:
            del pose["SLURMD_NODENAME"]  # the host name, unless `nodes` names one
        env = {**os.environ, **pose, **(extra_env or {})}
        if nodes is not None:
            env["SLURMD_NODENAME"] = nodes[rank]
        stdio = (_CallersFd(1), _CallersFd(2))
        p = ctx.Process(
            target=_worker, args=(rank, world_size, port, env, fn, args, results, stdio)
        )
        p.start()
        procs.append(p)
    outcomes: dict[int, RankOutcome] = {}
    try:
        while len(outcomes) < world_size:
            try:
                raw = results.get(timeout=timeout)
            except queue.Empty:
                break
            out = torch.load(io.BytesIO(raw), weights_only=False)
            outcomes[out.rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [outcomes.get(r, RankOutcome(r, "lost", None)) for r in range(world_size)]
