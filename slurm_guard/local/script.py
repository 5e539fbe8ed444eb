"""`slurm-guard local -- COMMAND`: a guarded training script on local processes posing as nodes.

`-n N`: N ranks, each its own pose node (SLURMD_NODENAME=node<r+1>, as `run_local` names them).
`--nodes N --ranks-per-node G`: N x G ranks, G to a pose node in srun's block layout (ranks
0..G-1 on node1, ...), with the variables srun and torchrun give a task there (`pose_env`).
So a script can be tried with fault injection on one machine before it is submitted.

Like torchrun, the launcher fails fast: a rank that exits with an error is named at once, the
others are stopped within seconds, and the launcher exits with that rank's code. Unlike
torchrun, the guard's exit code survives: if a rank exits 86 (an alarm) the others get time to
exit 86 too, and the launcher exits 86 (torchrun reports every failure as 1), so the same
script and check work locally.
"""

from __future__ import annotations

import ctypes
import math
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
from slurm_guard.slurm.task import SlurmTask, torchrun_environment

POLL_SECONDS = 0.1
# After one rank exits 86, every other rank is on its way to 86 too: the alarm is agreed by
# all ranks and written before any of them raises. A rank that is slow to get there (blocked
# until the guard's watchdog names a missing rank, then rank 0 lingers up to 30 s so that the
# others read why) still gets there within this grace, so its exit is the guard's and not the
# launcher's SIGTERM.
DEFAULT_GRACE_SECONDS = GuardConfig.watchdog_seconds + 60.0
# After a rank exits with any other error, the others get this long to exit on their own (an
# alarm's 86 that raced the failure still wins), then SIGTERM, then SIGKILL after
# STOP_SECONDS: torchrun's behaviour, rather than leaving them blocked in a collective with the
# dead rank until the watchdog (minutes) names it.
FAIL_FAST_SECONDS = 2.0
STOP_SECONDS = 5.0
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


def node_name(rank: int, ranks_per_node: int | None = None) -> str:
    """The pose node of `rank`: node<k+1> for the k-th block of `ranks_per_node` ranks (one
    rank per node without it), as srun's block layout places tasks."""
    return f"node{rank // (ranks_per_node or 1) + 1}"


def pose_env(
    rank: int, world_size: int, port: int, ranks_per_node: int | None = None
) -> dict[str, str]:
    """What rank `rank` gets: torchrun's variables, and the node it poses as.

    With `ranks_per_node` G, exactly what `srun --ntasks-per-node=G` and `slurm-guard task`
    give a task (`torchrun_environment`: LOCAL_RANK and LOCAL_WORLD_SIZE on its node,
    GROUP_RANK the node's index...) plus Slurm's SLURMD_NODENAME, SLURM_NODEID and
    SLURM_LOCALID. Not SLURM_PROCID, SLURM_NTASKS or SLURM_JOB_ID: frameworks (Lightning)
    take those for a Slurm job and would look for one. Without it (`-n`), each rank is its own
    node and LOCAL_RANK is the rank, so that the ranks of a one-machine GPU run get a device
    each, as before.
    """
    if ranks_per_node is None:
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SLURMD_NODENAME": node_name(rank),
        }
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"{world_size} ranks do not fill nodes of {ranks_per_node}")
    nodes = tuple(node_name(r, ranks_per_node) for r in range(0, world_size, ranks_per_node))
    node_rank, local_rank = divmod(rank, ranks_per_node)
    task = SlurmTask(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        node_rank=node_rank,
        nodes=nodes,
        job_id="",
        restart_count=0,
        node=nodes[node_rank],
        local_world_size=ranks_per_node,
    )
    return {
        **torchrun_environment(task, "127.0.0.1", port),
        "SLURMD_NODENAME": task.node,
        "SLURM_NODEID": str(node_rank),
        "SLURM_LOCALID": str(local_rank),
    }


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
    ranks_per_node: int | None,
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
                    env={**base, **pose_env(rank, world_size, port, ranks_per_node)},
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
    ranks_per_node: int | None = None,
) -> int:
    """Start `command` on `world_size` ranks, wait for all, return the launcher's exit code.

    `ranks_per_node` G places G ranks on each pose node (`pose_env`); without it each rank is
    its own node. Output goes straight to this process's stdout and stderr. When a rank fails,
    the launcher says so at once on stderr (which rank, which pose node, which code); after an
    error other than the guard's 86 the others are stopped within seconds (`FAIL_FAST_SECONDS`,
    then SIGTERM, then SIGKILL); after an 86 they get `grace_seconds` to exit 86 too. SIGTERM
    or SIGHUP to the launcher, like Ctrl-C, stops every rank first (as torchrun does), so none
    outlives it. Raises `LaunchError` if the command cannot be started.
    """
    base = dict(os.environ if env is None else env)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, *STOP_SIGNALS)}
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _start(command, world_size, ranks_per_node, base, procs)
        return _wait(procs, ranks_per_node, grace_seconds)
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


def describe_exit(code: int) -> str:
    """A rank's exit status in words: "exited with code 3", "was killed by SIGSEGV"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == EXIT_SDC:
        return f"stopped on the guard's alarm (exit {EXIT_SDC})"
    return f"exited with code {code}"


def _say(text: str) -> None:
    print(f"slurm-guard local: {text}", file=sys.stderr, flush=True)


def _wait(
    procs: Sequence[subprocess.Popen[bytes]], ranks_per_node: int | None, grace_seconds: float
) -> int:
    """Poll the ranks until all have exited, or stop the rest once the first failure's time is
    up: `FAIL_FAST_SECONDS` after an error, `grace_seconds` after an alarm (86 wins)."""
    failures: list[int] = []  # the ranks' own non-zero codes, in the order they came
    seen: set[int] = set()
    began = time.monotonic()
    stop_at = math.inf
    while True:
        for rank, p in enumerate(procs):
            code = p.poll()
            if code is None or rank in seen:
                continue
            seen.add(rank)
            if code == 0:
                continue
            first = not failures
            failures.append(code)
            if code == EXIT_SDC and EXIT_SDC not in failures[:-1]:
                stop_at = time.monotonic() + grace_seconds  # the alarm's time, even after an error
            elif first:
                stop_at = time.monotonic() + FAIL_FAST_SECONDS
            else:
                continue  # the first failure was named: one line per event
            left = len(procs) - len(seen)
            then = (
                f"the other {left} rank(s) get {grace_seconds:g} s to exit {EXIT_SDC} too"
                if code == EXIT_SDC
                else f"stopping the other {left} rank(s)"
            )
            _say(
                f"rank {rank} ({node_name(rank, ranks_per_node)}) {describe_exit(code)} after "
                f"{time.monotonic() - began:.1f} s" + (f"; {then}" if left else "")
            )
        if len(seen) == len(procs):
            return exit_code(failures)
        if time.monotonic() > stop_at:
            running = [r for r, p in enumerate(procs) if p.poll() is None]
            _say(f"stopping rank(s) {', '.join(map(str, running))} (SIGTERM, then SIGKILL)")
            _stop(procs)  # what the stopped ranks exit with is the launcher's signal
            return exit_code(failures)
        time.sleep(POLL_SECONDS)


def _stop_undisturbed(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """`_stop`, with a second Ctrl-C, SIGTERM or SIGHUP ignored until the ranks are gone
    (`run_script` restores the handlers): cutting the stop short would leave ranks running."""
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
    _stop(procs)


def _stop(procs: Sequence[subprocess.Popen[bytes]], wait_seconds: float = STOP_SECONDS) -> None:
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
