"""`slurm-guard local -n N -- COMMAND`: a guarded training script on N local processes.

Each process gets what torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and poses as its own node (SLURMD_NODENAME=node<r+1>, as `run_local`
names them), so a script can be tried with fault injection on one machine before it is
submitted. Unlike torchrun, the guard's exit code survives: if any rank exits 86 the launcher
does too (torchrun reports every failure as 1), so the same script and check work locally.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence

from slurm_guard.protocol import EXIT_SDC

POLL_SECONDS = 0.1


def free_port() -> int:
    """A port free now on 127.0.0.1 (the OS picks it; the store binds it again soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(base: Mapping[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SLURMD_NODENAME=f"node{rank + 1}",
    )
    return env


def exit_code(codes: Sequence[int | None]) -> int:
    """86 if any rank was stopped by the guard, else the first failure's code (128+N for a
    signal, as a shell reports it), else 0."""
    done = [c for c in codes if c is not None]
    if EXIT_SDC in done:
        return EXIT_SDC
    for code in done:
        if code != 0:
            return 128 - code if code < 0 else code
    return 0


def run_script(
    command: Sequence[str],
    world_size: int,
    grace_seconds: float = 30.0,
    env: Mapping[str, str] | None = None,
) -> int:
    """Start `command` on `world_size` ranks, wait for all, return the launcher's exit code.

    Output goes straight to this process's stdout and stderr. When one rank fails, the others
    get `grace_seconds` to finish (they usually stop with the same error at their next
    collective, and an alarm's 86 must not be turned into a kill), then SIGTERM, then SIGKILL.
    """
    port = free_port()
    base = dict(os.environ if env is None else env)
    procs = [
        subprocess.Popen(list(command), env=rank_env(base, r, world_size, port))
        for r in range(world_size)
    ]
    failed_at: float | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return exit_code(codes)
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_seconds:
                _stop(procs)
                return exit_code([p.returncode for p in procs])
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        _stop(procs)
        return 128 + signal.SIGINT


def _stop(procs: Sequence[subprocess.Popen[bytes]], wait_seconds: float = 10.0) -> None:
    """SIGTERM the ranks still running, SIGKILL those that outlive `wait_seconds`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + wait_seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
