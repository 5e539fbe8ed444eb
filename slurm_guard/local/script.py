"""`slurm-guard local -n N -- COMMAND`: a guarded training script on N local processes.

Each process gets what torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and poses as its own node (SLURMD_NODENAME=node<r+1>, as `run_local`
names them), so a script can be tried with fault injection on one machine before it is
submitted. Unlike torchrun, the guard's exit code survives: if any rank exits 86 the launcher
does too (torchrun reports every failure as 1), so the same script and check work locally.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

from slurm_guard.config import GuardConfig
from slurm_guard.errors import GuardError
from slurm_guard.protocol import EXIT_SDC

POLL_SECONDS = 0.1
# After one rank fails, the others are blocked in a collective with it until the guard's
# watchdog names the missing rank (`RanksMissing`); then rank 0 lingers up to 30 s so that the
# others read why, and every rank exits. The default grace waits that long, so that the ranks
# stop on the guard's named error rather than on the launcher's SIGTERM.
DEFAULT_GRACE_SECONDS = GuardConfig.watchdog_seconds + 60.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class LaunchError(GuardError):
    """The ranks could not be started (the command is missing or not executable)."""


class _Stopped(Exception):
    """The launcher itself got SIGTERM or SIGHUP."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


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


def exit_code(failures: Sequence[int]) -> int:
    """The launcher's code from the ranks' failure codes, in the order they failed.

    86 if any rank was stopped by the guard, else the first failure's own code (128+N for a
    signal, as a shell reports it), else 0. Codes of ranks the launcher stopped itself are
    not failures: leave them out.
    """
    if EXIT_SDC in failures:
        return EXIT_SDC
    for code in failures:
        if code != 0:
            return 128 - code if code < 0 else code
    return 0


def _die_with_parent() -> None:
    """In each rank before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _start(
    command: Sequence[str],
    world_size: int,
    base: Mapping[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Start the ranks into `procs` (the caller's list, so a signal meanwhile stops them)."""
    port = free_port()
    for rank in range(world_size):
        try:
            procs.append(
                subprocess.Popen(
                    list(command),
                    env=rank_env(base, rank, world_size, port),
                    preexec_fn=_die_with_parent,
                )
            )
        except OSError as exc:
            _stop(procs)
            raise LaunchError(
                f"cannot run {command[0]!r}: {exc.strerror or exc}; check the command after "
                "`--` (a path, or a program on PATH)"
            ) from None


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def run_script(
    command: Sequence[str],
    world_size: int,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    env: Mapping[str, str] | None = None,
) -> int:
    """Start `command` on `world_size` ranks, wait for all, return the launcher's exit code.

    Output goes straight to this process's stdout and stderr. When one rank fails, the others
    get `grace_seconds` to finish (they stop with the guard's named error at their next
    collective or at the watchdog, and an alarm's 86 must not be turned into a kill), then
    SIGTERM, then SIGKILL. SIGTERM or SIGHUP to the launcher, like Ctrl-C, stops every rank
    first (as torchrun does), so none outlives it. Raises `LaunchError` if the command cannot
    be started.
    """
    base = dict(os.environ if env is None else env)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, *STOP_SIGNALS)}
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _start(command, world_size, base, procs)
        return _wait(procs, grace_seconds)
    except KeyboardInterrupt:
        _stop_undisturbed(procs)
        return 128 + signal.SIGINT
    except _Stopped as stopped:
        _stop_undisturbed(procs)
        return 128 + stopped.signum
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: set outside Python, nothing to put back
                signal.signal(signum, handler)


def _wait(procs: Sequence[subprocess.Popen[bytes]], grace_seconds: float) -> int:
    """Poll the ranks; stop the rest `grace_seconds` after the first failure."""
    failures: list[int] = []  # the ranks' own non-zero codes, in the order they came
    seen: set[int] = set()
    failed_at: float | None = None
    while True:
        for rank, p in enumerate(procs):
            code = p.poll()
            if code is not None and rank not in seen:
                seen.add(rank)
                if code != 0:
                    failures.append(code)
        if len(seen) == len(procs):
            return exit_code(failures)
        if failed_at is None and failures:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_seconds:
            _stop(procs)  # what the stopped ranks exit with is the launcher's signal
            return exit_code(failures)
        time.sleep(POLL_SECONDS)


def _stop_undisturbed(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """`_stop`, with a second Ctrl-C, SIGTERM or SIGHUP ignored until the ranks are gone
    (`run_script` restores the handlers): cutting the stop short would leave ranks running."""
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
    _stop(procs)


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
