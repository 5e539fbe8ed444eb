"""A throw-away, real Slurm cluster on one machine, for the tests, CI and the benchmarks.

Mocked Slurm hides exactly the behaviour slurm-guard depends on (requeue timing, credential
expiry, EpilogSlurmctld environment, state strings), so tests run against real daemons:
a private munged, optionally MariaDB + slurmdbd (so ``sacct`` and submitit see job states),
one slurmctld and one ``slurmd -N nodeN`` per node (Debian builds slurmd with
MULTIPLE_SLURMD). Everything lives under one directory and a private port range, so several
clusters (several engineers, several CI jobs) coexist on one host.

Every daemon is started with the environment marker ``SLURM_GUARD_LOCAL_CLUSTER=<root>``.
``stop()`` only kills processes that carry this exact marker, so it can neither hit another
cluster's daemons nor a recycled PID, and it also finds the ``slurmstepd`` processes that
slurmd double-forks (they inherit slurmd's environment and outlive it).

Standard library only. It is test infrastructure, not part of the package users deploy: it runs
slurmctld as root with a private MariaDB, which no site wants installed beside its controller.
The database password is random per cluster (kept mode 600 under the cluster's root).

Shell use (daemons stay up after the Python process exits)::

    python tests/support/local_cluster.py start /tmp/c1 --nodes 4 --port-base 21000
    eval "$(python tests/support/local_cluster.py env /tmp/c1)"
    python tests/support/local_cluster.py stop /tmp/c1
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

#: Environment variable that marks every process belonging to one local cluster.
MARKER_ENV = "SLURM_GUARD_LOCAL_CLUSTER"
#: slurmctld port when none is given; far from Slurm's default 6817 so a real install is safe.
DEFAULT_PORT_BASE = 16817
#: Smallest credential lifetime Slurm accepts: a requeued job may restart after cred_expire+1 s.
MIN_CRED_EXPIRE_S = 5
#: How long start() waits for the whole cluster to come up (MariaDB init dominates).
DEFAULT_START_TIMEOUT_S = 60.0
#: How long stop() waits for SIGTERM before using SIGKILL.
STOP_GRACE_S = 5.0
#: How long stop() waits for cancelled jobs to end before killing daemons anyway.
JOB_DRAIN_TIMEOUT_S = 10.0
#: Timeout for one client command (sinfo, scancel, sacctmgr) issued while managing the cluster.
COMMAND_TIMEOUT_S = 15.0
#: Unix socket paths longer than this (sun_path is 108 bytes with the NUL) make slurmd fail
#: to launch job steps with cryptic errors.
MAX_SOCKET_PATH = 107
STATE_FILE = "cluster.json"
DB_NAME = "slurm_acct_db"
DB_USER = "slurm"

#: Binaries needed by a cluster; accounting adds the second group.
REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "scontrol", "sbatch", "scancel")
ACCOUNTING_BINARIES = ("mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "sacctmgr")

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LocalClusterError(RuntimeError):
    """The local cluster could not be started or managed; the message says which log to read."""


def missing_binaries(accounting: bool = True) -> list[str]:
    """Return the Slurm/MUNGE/MariaDB programs not on PATH (tests skip or fail on these)."""
    needed = REQUIRED_BINARIES + (ACCOUNTING_BINARIES if accounting else ())
    path = _client_path()
    return [name for name in needed if shutil.which(name, path=path) is None]


def port_span(nodes: int, accounting: bool = True) -> int:
    """Number of consecutive ports a cluster uses, starting at its port base."""
    return 1 + nodes + (2 if accounting else 0)


def find_free_port_base(
    nodes: int = 4, accounting: bool = True, low: int = 20000, high: int = 32000
) -> int:
    """Pick a random port base whose whole span is free right now.

    Random rather than sequential because concurrent test sessions on one host would otherwise
    all try the same first free range. Stays below Linux's ephemeral range (32768+) so outgoing
    connections cannot steal our ports between this check and the daemons binding them.
    """
    span = port_span(nodes, accounting)
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - span)
        if all(_port_is_free(base + i) for i in range(span)):
            return base
    raise LocalClusterError(f"no free range of {span} ports found in {low}..{high}")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_is_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _client_path() -> str:
    """PATH that surely contains the sbin directories (daemons live there on Debian)."""
    parts = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for extra in _DEFAULT_PATH.split(os.pathsep):
        if extra not in parts:
            parts.append(extra)
    return os.pathsep.join(parts)


def _poll(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll until predicate() is true or timeout; True on success. Backs off to 0.5 s."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
        interval = min(interval * 1.5, 0.5)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc.strerror}>"
    return "\n".join(text.splitlines()[-lines:])


def _pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (PID 1 here may never reap our orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the parenthesised command name, which may contain spaces.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


def _process_marker(pid: int) -> str | None:
    """The MARKER_ENV value in a process's environment, or None."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = MARKER_ENV.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


@dataclass(frozen=True)
class _Ports:
    slurmctld: int
    nodes: tuple[int, ...]
    slurmdbd: int
    mariadb: int


class LocalCluster:
    """A real Slurm cluster under ``root`` using ports ``port_base .. port_base+span-1``.

    Port layout: slurmctld = port_base, node i (1-based) = port_base + i, then slurmdbd and
    MariaDB (only used with accounting). Node names are ``node1..nodeN``.

    Args:
        root: Directory owned by this cluster (created). start() wipes its own subdirectories.
        nodes: Number of slurmd nodes.
        port_base: First port of the range; use find_free_port_base() for concurrent use.
        accounting: Start MariaDB + slurmdbd so sacct/submitit can see finished jobs (+~2 s).
        epilog_command: argv the EpilogSlurmctld script execs (PATH and SLURM_CONF are set
            for it, Slurm 22.05 gives it neither); None means a no-op.
        cred_expire: Credential lifetime; also the delay before a requeued job may restart.
        cpus_per_node: CPUs each node advertises (config_overrides ignores the real count).
        cluster_name: Slurm ClusterName.
    """

    def __init__(
        self,
        root: Path,
        nodes: int = 4,
        port_base: int = DEFAULT_PORT_BASE,
        accounting: bool = True,
        epilog_command: Sequence[str] | None = None,
        cred_expire: int = MIN_CRED_EXPIRE_S,
        cpus_per_node: int = 2,
        cluster_name: str = "ci",
    ) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if cred_expire < MIN_CRED_EXPIRE_S:
            raise ValueError(f"Slurm rejects cred_expire below {MIN_CRED_EXPIRE_S}")
        if not 1024 <= port_base <= 65535 - port_span(nodes, accounting):
            raise ValueError(f"port_base {port_base} out of range")
        self.root = Path(root).absolute()
        self.nodes = nodes
        self.port_base = port_base
        self.accounting = accounting
        self.epilog_command: tuple[str, ...] | None = (
            tuple(epilog_command) if epilog_command is not None else None
        )
        self.cred_expire = cred_expire
        self.cpus_per_node = cpus_per_node
        self.cluster_name = cluster_name
        self._popen: list[subprocess.Popen[bytes]] = []

    # ----------------------------------------------------------------- layout

    @property
    def conf_path(self) -> Path:
        """slurm.conf; clients need it as SLURM_CONF."""
        return self.root / "etc" / "slurm.conf"

    @property
    def epilog_path(self) -> Path:
        """The EpilogSlurmctld script slurm.conf points at."""
        return self.root / "etc" / "epilog_slurmctld.sh"

    @property
    def state_path(self) -> Path:
        """JSON state file that lets another process attach() or stop() this cluster."""
        return self.root / STATE_FILE

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def ports(self) -> _Ports:
        node_ports = tuple(self.port_base + i for i in range(1, self.nodes + 1))
        after = self.port_base + self.nodes + 1
        return _Ports(self.port_base, node_ports, after, after + 1)

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def _mysql_socket(self) -> Path:
        return self.root / "run" / "mysqld.sock"

    def env(self) -> dict[str, str]:
        """Environment variables a Slurm client (scontrol, sbatch, submitit) needs."""
        return {"SLURM_CONF": str(self.conf_path), "PATH": _client_path()}

    def _daemon_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env())
        env[MARKER_ENV] = str(self.root)
        # Client-side settings of the caller must not leak into daemons or our sinfo calls.
        for key in ("SLURM_TIME_FORMAT", "SQUEUE_FORMAT", "SINFO_FORMAT", "SLURM_CLUSTERS"):
            env.pop(key, None)
        return env

    # ----------------------------------------------------------- configuration

    def _slurm_conf(self) -> str:
        r = self.root
        p = self.ports
        lines = [
            f"ClusterName={self.cluster_name}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={p.slurmctld}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "MinJobAge=300",
            "KillWait=5",
            "Waittime=0",
            "JobRequeue=1",
            f"EpilogSlurmctld={self.epilog_path}",
        ]
        if self.accounting:
            lines += [
                "AccountingStorageType=accounting_storage/slurmdbd",
                "AccountingStorageHost=localhost",
                f"AccountingStoragePort={p.slurmdbd}",
                # Without this slurmctld/sacctmgr talk to the system munged and fail with
                # "Protocol authentication error".
                f"AccountingStoragePass={self.munge_socket}",
                "JobAcctGatherType=jobacct_gather/linux",
                "JobAcctGatherFrequency=30",
            ]
        else:
            lines += [
                "AccountingStorageType=accounting_storage/none",
                "JobAcctGatherType=jobacct_gather/none",
            ]
        lines.append(f"NodeName=DEFAULT CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN")
        for name, port in zip(self.node_names, p.nodes, strict=True):
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port}")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _slurmdbd_conf(self) -> str:
        r = self.root
        p = self.ports
        return (
            "AuthType=auth/munge\n"
            f"AuthInfo=socket={self.munge_socket}\n"
            "DbdHost=localhost\n"
            f"DbdPort={p.slurmdbd}\n"
            "SlurmUser=root\n"
            f"PidFile={r}/run/slurmdbd.pid\n"
            f"LogFile={r}/log/slurmdbd.log\n"
            "StorageType=accounting_storage/mysql\n"
            # 127.0.0.1, not localhost: "localhost" makes the MySQL client use the system
            # socket /run/mysqld/mysqld.sock instead of our private server.
            "StorageHost=127.0.0.1\n"
            f"StoragePort={p.mariadb}\n"
            f"StorageUser={DB_USER}\n"
            f"StoragePass={self._db_password()}\n"
            f"StorageLoc={DB_NAME}\n"
        )

    def _epilog_script(self) -> str:
        # 22.05 runs EpilogSlurmctld with an empty environment: provide PATH and SLURM_CONF.
        head = (
            "#!/bin/sh\n"
            "# Written by tests/support/local_cluster.py: EpilogSlurmctld of a test cluster.\n"
            f"export PATH={shlex.quote(_client_path())}\n"
            f"export SLURM_CONF={shlex.quote(str(self.conf_path))}\n"
        )
        if self.epilog_command is None:
            return head + "exit 0\n"
        return head + "exec " + shlex.join(self.epilog_command) + "\n"

    def _db_password(self) -> str:
        """The cluster's database password: made once, random, readable by root only."""
        path = self.root / "etc" / "db_password"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(16))
        return path.read_text().strip()

    def _write_configs(self) -> None:
        for sub in ("etc", "state", "spool", "run", "log", "munge"):
            path = self.root / sub
            if sub != "log":
                shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)
        for name in self.node_names:
            (self.root / "spool" / name).mkdir()
        # munged refuses a socket directory writable by others.
        (self.root / "munge").chmod(0o755)
        for old_log in self.log_dir.glob("*.log"):
            old_log.unlink()
        key = self.root / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        self.conf_path.write_text(self._slurm_conf())
        if self.accounting:
            dbd_conf = self.conf_path.with_name("slurmdbd.conf")
            fd = os.open(dbd_conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self._slurmdbd_conf())
        self.write_epilog(self.epilog_command)

    def write_epilog(self, command: Sequence[str] | None) -> None:
        """(Re)write the EpilogSlurmctld script; slurmctld reads it anew for every job."""
        self.epilog_command = tuple(command) if command is not None else None
        tmp = self.epilog_path.with_suffix(".tmp")
        tmp.write_text(self._epilog_script())
        tmp.chmod(0o755)
        tmp.replace(self.epilog_path)

    # ----------------------------------------------------------------- running

    def _spawn(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start a daemon detached from us: own session, no tty, output to a log file."""
        log = self.log_dir / log_name
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                list(argv),
                env=self._daemon_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
            )
        self._popen.append(proc)
        return proc

    def _run_forking(self, argv: Sequence[str], log_name: str, what: str) -> None:
        """Run a daemon that forks itself into the background; fail if the parent fails."""
        proc = self._spawn(argv, log_name)
        try:
            rc = proc.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        if rc not in (0, None):
            raise self._error(f"{what} exited with status {rc}", self.log_dir / log_name)

    def _error(self, message: str, *logs: Path) -> LocalClusterError:
        parts = [f"local Slurm cluster at {self.root}: {message}"]
        for log in logs:
            parts.append(f"--- last lines of {log} ---\n{_tail(log)}")
        return LocalClusterError("\n".join(parts))

    def _read_pid(self, pid_file: Path) -> int | None:
        try:
            return int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _wait_pid_file(self, pid_file: Path, what: str, log: Path, timeout: float) -> int:
        def ready() -> bool:
            pid = self._read_pid(pid_file)
            return pid is not None and _pid_alive(pid)

        if not _poll(ready, timeout):
            raise self._error(f"{what} did not start within {timeout:.0f} s", log)
        pid = self._read_pid(pid_file)
        assert pid is not None
        return pid

    def _check_preconditions(self) -> None:
        missing = missing_binaries(self.accounting)
        if missing:
            raise LocalClusterError(
                f"missing programs {', '.join(missing)}: run .ci/install_slurm.sh (as root)"
            )
        if self.running_pids():
            raise LocalClusterError(
                f"a cluster is already running in {self.root}; stop it first "
                f"(python tests/support/local_cluster.py stop {self.root})"
            )
        # slurmd's per-step socket is the longest path: spool/nodeN/nodeN_<job>.<step>, where
        # the batch step id is 4294967291. Allow for job ids up to 6 digits.
        node = f"node{self.nodes}"
        longest = self.root / "spool" / node / f"{node}_999999.4294967291"
        if len(str(longest)) > MAX_SOCKET_PATH:
            raise LocalClusterError(
                f"cluster directory {self.root} is too long for Unix socket paths "
                f"(limit ~{MAX_SOCKET_PATH} chars): use a shorter directory"
            )
        p = self.ports
        used = [
            port
            for port in (
                p.slurmctld,
                *p.nodes,
                *((p.slurmdbd, p.mariadb) if self.accounting else ()),
            )
            if not _port_is_free(port)
        ]
        if used:
            raise LocalClusterError(
                f"ports {used} are in use; choose another port base "
                f"(find_free_port_base() or --port-base)"
            )

    def start(self, timeout: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Start all daemons and wait until every node is idle.

        Raises:
            LocalClusterError: a daemon failed or the cluster was not ready in time; the
                message carries the tail of the relevant log. Already-started daemons are
                stopped before raising so a failed start leaves nothing behind.
        """
        started = time.monotonic()
        deadline = started + timeout
        self.root.mkdir(parents=True, exist_ok=True)
        self._check_preconditions()
        self._write_configs()
        self._save_state({})
        try:
            pids = self._start_daemons(deadline)
            self._save_state(pids)
            self.wait_nodes_idle(max(deadline - time.monotonic(), 1.0))
        except BaseException:
            self.stop()
            raise
        logger.info(
            "local Slurm cluster up in %.1f s at %s (port base %d)",
            time.monotonic() - started,
            self.root,
            self.port_base,
        )

    def _start_daemons(self, deadline: float) -> dict[str, int]:
        def left() -> float:
            return max(deadline - time.monotonic(), 1.0)

        t0 = time.monotonic()
        r = self.root
        pids: dict[str, int] = {}
        munge_log = self.log_dir / "munged.log"
        self._run_forking(
            [
                "munged",
                f"--socket={self.munge_socket}",
                f"--key-file={r}/munge/munge.key",
                f"--pid-file={r}/run/munged.pid",
                f"--log-file={munge_log}",
                f"--seed-file={r}/munge/munged.seed",
                "--num-threads=4",
                # pytest's tmp dirs are mode 700; munged refuses a socket below a directory
                # that not everybody may traverse. Our clients run as the same user anyway.
                "--force",
            ],
            "munged.out",
            "munged",
        )
        pids["munged"] = self._wait_pid_file(r / "run" / "munged.pid", "munged", munge_log, left())
        if not _poll(self.munge_socket.exists, left()):
            raise self._error("munged socket did not appear", munge_log)
        logger.debug("munged up after %.2f s", time.monotonic() - t0)

        if self.accounting:
            pids["mariadbd"] = self._start_mariadb(left())
            self._save_state(pids)
            logger.debug("MariaDB up after %.2f s", time.monotonic() - t0)
            dbd_log = self.log_dir / "slurmdbd.log"
            self._run_forking(["slurmdbd"], "slurmdbd.out", "slurmdbd")
            pids["slurmdbd"] = self._wait_pid_file(
                r / "run" / "slurmdbd.pid", "slurmdbd", dbd_log, left()
            )
            self._save_state(pids)
            if not _poll(lambda: _port_is_open(self.ports.slurmdbd), left()):
                raise self._error("slurmdbd is not listening", dbd_log)
            self._run_client(
                ["sacctmgr", "-i", "add", "cluster", self.cluster_name], "register cluster"
            )
            logger.debug("slurmdbd up after %.2f s", time.monotonic() - t0)

        ctld_log = self.log_dir / "slurmctld.log"
        self._run_forking(["slurmctld", "-f", str(self.conf_path)], "slurmctld.out", "slurmctld")
        pids["slurmctld"] = self._wait_pid_file(
            r / "run" / "slurmctld.pid", "slurmctld", ctld_log, left()
        )
        self._save_state(pids)
        for name in self.node_names:
            self._run_forking(
                ["slurmd", "-f", str(self.conf_path), "-N", name], f"slurmd-{name}.out", "slurmd"
            )
        for name in self.node_names:
            pids[f"slurmd-{name}"] = self._wait_pid_file(
                r / "run" / f"slurmd-{name}.pid",
                f"slurmd {name}",
                self.log_dir / f"slurmd-{name}.log",
                left(),
            )
        return pids

    def _start_mariadb(self, timeout: float) -> int:
        r = self.root
        datadir = r / "mysql"
        shutil.rmtree(datadir, ignore_errors=True)
        log = self.log_dir / "mariadb.log"
        install = subprocess.run(
            [
                "mariadb-install-db",
                "--no-defaults",
                f"--datadir={datadir}",
                "--user=root",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ],
            env=self._daemon_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=max(timeout, 5.0),
            check=False,
        )
        if install.returncode != 0:
            raise LocalClusterError(
                f"mariadb-install-db failed ({install.returncode}):\n{install.stdout[-2000:]}"
                f"\n{install.stderr[-2000:]}"
            )
        logger.debug("mariadb-install-db done")
        proc = self._spawn(
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={datadir}",
                f"--socket={self._mysql_socket}",
                f"--port={self.ports.mariadb}",
                "--bind-address=127.0.0.1",
                f"--pid-file={r}/run/mariadbd.pid",
                f"--log-error={log}",
                "--user=root",  # MariaDB refuses to run as root without this.
                "--skip-log-bin",
                "--innodb-buffer-pool-size=32M",
                "--innodb-log-file-size=16M",
                # Throw-away data: durability is not worth the fsyncs on a 2-core CI box.
                "--innodb-flush-log-at-trx-commit=0",
                "--skip-name-resolve",
            ],
            "mariadbd.out",
        )

        def up() -> bool:
            if proc.poll() is not None:
                return True
            return self._mysql_socket.exists() and _port_is_open(self.ports.mariadb)

        if not _poll(up, timeout) or proc.poll() is not None:
            raise self._error("MariaDB did not start", log)
        password = self._db_password()
        sql = (
            f"CREATE DATABASE IF NOT EXISTS {DB_NAME};"
            # skip-name-resolve: the TCP client shows up as 127.0.0.1; keep localhost too.
            + "".join(
                f"CREATE USER IF NOT EXISTS '{DB_USER}'@'{host}' IDENTIFIED BY '{password}';"
                f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'{host}';"
                for host in ("localhost", "127.0.0.1")
            )
            + "FLUSH PRIVILEGES;"
        )
        self._run_client(
            ["mariadb", "--no-defaults", f"--socket={self._mysql_socket}", "-uroot", "-e", sql],
            "create accounting database",
        )
        return proc.pid

    def _run_client(
        self, argv: Sequence[str], what: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        env = self._daemon_env()
        del env[MARKER_ENV]  # short-lived clients must never look like our daemons
        try:
            result = subprocess.run(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise self._error(f"{what}: {shlex.join(argv)} timed out") from exc
        if check and result.returncode != 0:
            raise self._error(
                f"{what}: {shlex.join(argv)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def node_states(self) -> dict[str, str]:
        """Map node name to sinfo's compact state (``idle``, ``drain``, ``idle*`` ...)."""
        result = self._run_client(
            ["sinfo", "--noheader", "--Node", "--format=%N %t"], "sinfo", check=False
        )
        if result.returncode != 0:
            return {}
        states: dict[str, str] = {}
        for line in result.stdout.splitlines():
            fields = line.split()
            if len(fields) == 2:
                states[fields[0]] = fields[1]
        return states

    def wait_nodes_idle(self, timeout: float = 30.0) -> None:
        """Poll sinfo until every node is idle; raise with the controller log tail if not."""
        expected = set(self.node_names)
        last: dict[str, str] = {}

        def all_idle() -> bool:
            nonlocal last
            last = self.node_states()
            return set(last) == expected and all(s == "idle" for s in last.values())

        if not _poll(all_idle, timeout):
            not_idle = sorted(n for n in expected if last.get(n) != "idle")
            logs = [self.log_dir / "slurmctld.log"]
            logs += [self.log_dir / f"slurmd-{n}.log" for n in not_idle[:2]]
            raise self._error(
                f"nodes not idle after {timeout:.0f} s: "
                + ", ".join(f"{n}={last.get(n, '?')}" for n in not_idle),
                *logs,
            )

    def job_ids(self) -> list[str]:
        """Ids of jobs slurmctld still tracks as pending/running/completing."""
        result = self._run_client(["squeue", "--noheader", "--format=%i"], "squeue", check=False)
        if result.returncode != 0:
            return []
        return result.stdout.split()

    def _cancel_all_jobs(self, timeout: float) -> bool:
        """scancel every job and poll until none is left; False if some outlived timeout."""
        jobs = self.job_ids()
        if not jobs:
            return True
        self._run_client(["scancel", "--full", *jobs], "scancel", check=False)
        return _poll(lambda: not self.job_ids(), timeout)

    def reset(self, timeout: float = 30.0) -> None:
        """Cancel all jobs and resume every node, so the next test starts from idle nodes.

        A shared session cluster would otherwise leak drained nodes between tests.
        """
        if not self._cancel_all_jobs(timeout):
            raise self._error(f"jobs {self.job_ids()} still there after scancel")
        for name, state in self.node_states().items():
            if state.rstrip("*~#!%$@^-") != "idle":
                self._run_client(
                    ["scontrol", "update", f"NodeName={name}", "State=RESUME"],
                    "resume node",
                    check=False,
                )
        self.wait_nodes_idle(timeout)

    # ------------------------------------------------------------------ state

    def _save_state(self, pids: Mapping[str, int]) -> None:
        state = {
            "root": str(self.root),
            "nodes": self.nodes,
            "port_base": self.port_base,
            "accounting": self.accounting,
            "cred_expire": self.cred_expire,
            "cpus_per_node": self.cpus_per_node,
            "cluster_name": self.cluster_name,
            "epilog_command": list(self.epilog_command) if self.epilog_command else None,
            "pids": dict(pids),
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_path)

    @classmethod
    def attach(cls, root: Path) -> LocalCluster:
        """Rebuild a LocalCluster object for a cluster started by another process."""
        root = Path(root).absolute()
        try:
            state = json.loads((root / STATE_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise LocalClusterError(
                f"no local cluster state in {root} ({exc}); was it started with "
                f"`python tests/support/local_cluster.py start {root}`?"
            ) from exc
        return cls(
            root,
            nodes=int(state["nodes"]),
            port_base=int(state["port_base"]),
            accounting=bool(state["accounting"]),
            epilog_command=state.get("epilog_command"),
            cred_expire=int(state.get("cred_expire", MIN_CRED_EXPIRE_S)),
            cpus_per_node=int(state.get("cpus_per_node", 2)),
            cluster_name=str(state.get("cluster_name", "ci")),
        )

    def _state_pids(self) -> dict[str, int]:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): int(v) for k, v in state.get("pids", {}).items()}

    def running_pids(self) -> list[int]:
        """PIDs of live processes carrying this cluster's marker (daemons and slurmstepd)."""
        me = str(self.root)
        own = os.getpid()
        return [
            pid
            for pid in _all_pids()
            if pid != own and _process_marker(pid) == me and _pid_alive(pid)
        ]

    def is_running(self) -> bool:
        """True when slurmctld of this cluster is alive."""
        pid = self._state_pids().get("slurmctld")
        return pid is not None and _pid_alive(pid) and _process_marker(pid) == str(self.root)

    def stop(self) -> None:
        """Cancel jobs and kill every process of this cluster; safe to call repeatedly.

        Only processes whose environment carries this cluster's marker are signalled, so a
        stale state file with recycled PIDs cannot hurt anybody.
        """
        if self.is_running():
            # Cancel and wait for the jobs to end, so slurmstepd kills the job's tasks and
            # exits by itself: killed daemons leave slurmstepd blocked for 10+ s.
            self._cancel_all_jobs(JOB_DRAIN_TIMEOUT_S)
        order = ["slurmctld", *[f"slurmd-{n}" for n in self.node_names], "slurmdbd", "mariadbd"]
        state_pids = self._state_pids()
        me = str(self.root)
        first = [
            state_pids[name]
            for name in order
            if name in state_pids and _process_marker(state_pids[name]) == me
        ]
        self._terminate(first)
        # Leftovers: slurmstepd (double-forked by slurmd), and anything missing from a
        # state file that a crashed start() could not complete. munged goes last: the
        # others may need it while shutting down.
        rest = self.running_pids()
        munged = state_pids.get("munged")
        self._terminate([p for p in rest if p != munged])
        self._terminate(self.running_pids())
        for proc in self._popen:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0)  # reap our own children: no zombies in long test runs
        self._popen = [p for p in self._popen if p.returncode is None]
        leftover = self.running_pids()
        if leftover:
            raise self._error(f"processes {leftover} survived SIGKILL")

    def _terminate(self, pids: Sequence[int]) -> None:
        """SIGTERM, poll until gone, then SIGKILL survivors."""
        pids = [p for p in pids if _pid_alive(p)]
        if not pids:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError as exc:
                    if exc.errno != errno.ESRCH:
                        raise
            grace = STOP_GRACE_S if sig == signal.SIGTERM else 5.0
            if _poll(lambda: not any(_pid_alive(p) for p in pids), grace, interval=0.02):
                return
            for proc in self._popen:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0)
        logger.warning("local cluster %s: processes %s did not exit", self.root, pids)

    # --------------------------------------------------------- context manager

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"LocalCluster(root={str(self.root)!r}, nodes={self.nodes}, "
            f"port_base={self.port_base}, accounting={self.accounting})"
        )


# --------------------------------------------------------------------- CLI


def _env_lines(cluster: LocalCluster) -> Iterator[str]:
    for key, value in cluster.env().items():
        yield f"export {key}={shlex.quote(value)}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/support/local_cluster.py start|stop|env|status DIR``."""
    parser = argparse.ArgumentParser(
        prog="python tests/support/local_cluster.py",
        description="Run a throw-away local Slurm cluster (daemons survive this command).",
        epilog='Example: start /tmp/c1 --port-base 21000 && eval "$(... env /tmp/c1)"',
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a cluster in DIR and wait until nodes are idle")
    start.add_argument("dir", type=Path)
    start.add_argument("--nodes", type=int, default=4)
    start.add_argument(
        "--port-base", type=int, default=None, help="first port (default: a random free range)"
    )
    start.add_argument("--no-accounting", action="store_true", help="no MariaDB/slurmdbd")
    start.add_argument("--cred-expire", type=int, default=MIN_CRED_EXPIRE_S)
    start.add_argument(
        "--epilog-command", default=None, help="command line EpilogSlurmctld execs (shell words)"
    )
    start.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    for name, text in (
        ("stop", "stop the cluster in DIR (safe if already stopped)"),
        ("env", "print export lines for SLURM_CONF and PATH (use with eval)"),
        ("status", "exit 0 if the cluster in DIR is running"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("dir", type=Path)
    args = parser.parse_args(argv)

    try:
        if args.command == "start":
            accounting = not args.no_accounting
            port_base = args.port_base
            if port_base is None:
                port_base = find_free_port_base(args.nodes, accounting)
            cluster = LocalCluster(
                args.dir,
                nodes=args.nodes,
                port_base=port_base,
                accounting=accounting,
                epilog_command=shlex.split(args.epilog_command)
                if args.epilog_command is not None
                else None,
                cred_expire=args.cred_expire,
            )
            began = time.monotonic()
            cluster.start(timeout=args.timeout)
            print(
                f"local Slurm cluster running in {cluster.root} "
                f"(port base {cluster.port_base}, {time.monotonic() - began:.1f} s)",
                file=sys.stderr,
            )
            for line in _env_lines(cluster):
                print(line)
        elif args.command == "stop":
            if (Path(args.dir) / STATE_FILE).exists():
                LocalCluster.attach(args.dir).stop()
        elif args.command == "env":
            for line in _env_lines(LocalCluster.attach(args.dir)):
                print(line)
        elif args.command == "status":
            cluster = LocalCluster.attach(args.dir)
            running = cluster.is_running()
            print("running" if running else "stopped")
            return 0 if running else 1
    except (LocalClusterError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
