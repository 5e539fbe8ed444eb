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
a private MariaDB beside the controller, which no site wants. The database password is random
per cluster (kept mode 600 under the cluster's root).

Two Slurm versions: by default the host's packages (Slurm 22.05 on Debian 12). With
``chroot=DIR`` (a Debian 13 root built by ``.ci/install_slurm_chroot.sh``, Slurm 24.11) every
daemon and client runs inside that root, each in a private mount namespace that bind-mounts
/proc, /dev, /sys, /tmp, the project and the host's Python at the same paths: jobs and the
EpilogSlurmctld then run the project's code with the host's Python, and nothing stays mounted
once the cluster's processes are gone. ``env()`` puts small client wrappers (``sbatch``,
``scontrol``, ``sacct`` ... that enter the root) first on PATH, so every client talking to the
cluster has the cluster's own version: a 22.05 client does not talk reliably to a 24.11
controller.

``slurm_user="slurm"`` runs slurmctld, slurmdbd and the EpilogSlurmctld as that user, as a site
does (state, log and pid directories are given to it), so a controller that cannot read what a
job's user wrote fails here instead of at a site.

Shell use (daemons stay up after the Python process exits)::

    python tests/support/local_cluster.py start /tmp/c1 --nodes 4 --port-base 21000
    eval "$(python tests/support/local_cluster.py env /tmp/c1)"
    python tests/support/local_cluster.py stop /tmp/c1
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import json
import logging
import os
import pwd
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
DEFAULT_MIN_JOB_AGE_S = 300
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

#: File at the top of a Slurm root that .ci/install_slurm_chroot.sh finished building.
ROOT_MARKER = ".slurm-guard-root"
#: File in a cluster's directory of client wrappers: other clusters drop that directory from
#: the PATH they build, so a client never talks to a cluster of another Slurm version.
WRAPPER_MARKER = ".slurm-guard-wrappers"
#: Client programs a chroot cluster wraps (the ones slurm-guard, submitit and the tests call).
CLIENT_COMMANDS = (
    "sbatch",
    "srun",
    "salloc",
    "scontrol",
    "squeue",
    "sinfo",
    "sacct",
    "scancel",
    "sacctmgr",
    "sstat",
    "sattach",
    "sdiag",
    "sprio",
    "sshare",
)
#: The repository this file belongs to: jobs run its code, so a chroot cluster mounts it.
REPO_ROOT = Path(__file__).resolve().parents[2]
#: Directories never bind-mounted over a Slurm root's own (its programs live there).
_SYSTEM_DIRS = frozenset(
    {
        "/",
        "/bin",
        "/boot",
        "/etc",
        "/home",
        "/lib",
        "/lib64",
        "/opt",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/usr",
        "/usr/bin",
        "/usr/lib",
        "/usr/lib64",
        "/usr/local",
        "/usr/local/bin",
        "/usr/local/lib",
        "/usr/sbin",
        "/var",
    }
)
#: Mounted first, recursively, at the same paths inside a Slurm root.
_BASE_BINDS = ("/proc", "/dev", "/sys", "/tmp")
#: Host files a job needs for name resolution (gloo resolves the host name).
_FILE_BINDS = ("/etc/hosts", "/etc/resolv.conf", "/etc/hostname")


class LocalClusterError(RuntimeError):
    """The local cluster could not be started or managed; the message says which log to read."""


def missing_binaries(accounting: bool = True, chroot: Path | None = None) -> list[str]:
    """Return the Slurm/MUNGE/MariaDB programs missing (tests skip or fail on these).

    With ``chroot`` the programs are looked up inside that Slurm root (and ``unshare`` and
    ``chroot`` on the host, which enter it).
    """
    needed = REQUIRED_BINARIES + (ACCOUNTING_BINARIES if accounting else ())
    path = _client_path()
    if chroot is None:
        return [name for name in needed if shutil.which(name, path=path) is None]
    missing = [name for name in ("unshare", "chroot") if shutil.which(name, path=path) is None]
    if not (Path(chroot) / ROOT_MARKER).exists():
        missing.append(f"{chroot}/{ROOT_MARKER} (run .ci/install_slurm_chroot.sh {chroot})")
    return missing + [name for name in needed if _find_in_root(Path(chroot), name) is None]


def _find_in_root(root: Path, name: str) -> str | None:
    """Absolute path (as seen inside ``root``) of program ``name`` in a Slurm root, or None."""
    for directory in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        candidate = root / directory.lstrip("/") / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return f"{directory}/{name}"
    return None


def python_binds() -> list[str]:
    """Host paths that jobs inside a Slurm root need at the same paths: the project and Python.

    Jobs and the EpilogSlurmctld run ``sys.executable`` and the project's code, so the
    interpreter's prefix (and a venv's), every import path, the repository and the projects
    that editable installs map packages to (setuptools' import hooks, not on sys.path) are
    mounted.
    A pyenv installation is mounted whole (its shims call the ``pyenv`` program). System
    directories are never mounted over the root's own: for a Debian system Python only its
    own subdirectories and the interpreter file are.
    """
    candidates = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        str(REPO_ROOT),
        *(p for p in sys.path if p),
    ]
    for name, module in list(sys.modules.items()):
        mapping = getattr(module, "MAPPING", None) if name.startswith("__editable__") else None
        if isinstance(mapping, dict):
            for package_dir in mapping.values():
                # The project holding the package: its data files live beside it.
                candidates += [str(package_dir), str(Path(package_dir).parent)]
    base = Path(sys.base_prefix)
    if base.parent.name == "versions" and (base.parent.parent / "shims").is_dir():
        candidates.append(str(base.parent.parent))
    paths: list[Path] = []
    for candidate in candidates:
        path = Path(candidate).resolve()
        if path.is_dir() and str(path) not in _SYSTEM_DIRS:
            paths.append(path)
    exe = Path(sys.executable)
    for path in (exe, exe.resolve()):
        if path.exists():
            paths.append(path)
    return _outermost(paths, already=[Path(p) for p in _BASE_BINDS])


def _outermost(paths: Sequence[Path], already: Sequence[Path] = ()) -> list[str]:
    """Sorted unique paths, dropping any that lies inside another one (or inside ``already``)."""
    kept: list[Path] = []
    for path in sorted(set(paths), key=lambda p: (len(p.parts), str(p))):
        if any(path == k or k in path.parents for k in [*already, *kept]):
            continue
        kept.append(path)
    return [str(p) for p in kept]


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
    """PATH that surely contains the sbin directories (daemons live there on Debian).

    Client wrappers of chroot clusters are left out: each cluster puts its own first.
    """
    parts = [
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and not os.path.exists(os.path.join(p, WRAPPER_MARKER))
    ]
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


def _write_script(path: Path, text: str) -> None:
    """Atomically write an executable script (slurmctld may be running the old one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)


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
        chroot: A Slurm root built by ``.ci/install_slurm_chroot.sh`` (Slurm 24.11) to run
            every daemon, job and client in; None uses the host's Slurm.
        slurm_user: SlurmUser: the account slurmctld, slurmdbd and the EpilogSlurmctld run
            as. ``root`` hides permission problems a site has; a missing user is created.
        min_job_age: MinJobAge, seconds a finished job stays known to slurmctld before it is
            purged (a test of what outlives the purge sets a few seconds).
        first_job_id: FirstJobId. A second cluster beside the session's starts elsewhere: job
            ids pick the rendezvous port (`port_for_job`), and two job 1s on one host collide.
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
        chroot: Path | None = None,
        slurm_user: str = "root",
        min_job_age: int = DEFAULT_MIN_JOB_AGE_S,
        first_job_id: int = 1,
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
        self.chroot: Path | None = Path(chroot).absolute() if chroot is not None else None
        if not slurm_user or not slurm_user.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"invalid slurm_user {slurm_user!r}")
        self.slurm_user = slurm_user
        if min_job_age < 2:
            raise ValueError(f"min_job_age {min_job_age}: Slurm needs at least 2 s")
        self.min_job_age = min_job_age
        if first_job_id < 1:
            raise ValueError(f"first_job_id {first_job_id}: must be >= 1")
        self.first_job_id = first_job_id
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

    @property
    def bin_dir(self) -> Path:
        """Client wrappers of a chroot cluster (first on the PATH env() gives)."""
        return self.root / "bin"

    @property
    def _enter_script(self) -> Path:
        return self.bin_dir / "in-root"

    def env(self) -> dict[str, str]:
        """Environment variables a Slurm client (scontrol, sbatch, submitit) needs."""
        path = _client_path()
        if self.chroot is not None:
            path = os.pathsep.join([str(self.bin_dir), path])
        return {"SLURM_CONF": str(self.conf_path), "PATH": path}

    def _cmd(self, argv: Sequence[str]) -> list[str]:
        """argv as run for this cluster: unchanged on the host, else entered into the root."""
        if self.chroot is None:
            return list(argv)
        program = _find_in_root(self.chroot, argv[0]) if "/" not in argv[0] else argv[0]
        if program is None:
            raise LocalClusterError(f"{argv[0]} is not installed in {self.chroot}")
        return [str(self._enter_script), program, *argv[1:]]

    def slurm_version(self) -> str:
        """The cluster's Slurm version as its clients report it (``slurm 24.11.5``)."""
        return self._run_client(["sinfo", "--version"], "sinfo --version").stdout.strip()

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
            f"SlurmUser={self.slurm_user}",
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
            f"MinJobAge={self.min_job_age}",
            f"FirstJobId={self.first_job_id}",
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
            f"SlurmUser={self.slurm_user}\n"
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
        uid, gid = self._slurm_ids()
        if self.accounting:
            dbd_conf = self.conf_path.with_name("slurmdbd.conf")
            fd = os.open(dbd_conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self._slurmdbd_conf())
            os.chown(dbd_conf, uid, gid)  # slurmdbd insists on mode 600 owned by SlurmUser
        # slurmctld writes state, its log and its pid file as SlurmUser.
        for sub in ("state", "log", "run"):
            os.chown(self.root / sub, uid, gid)
        self.write_epilog(self.epilog_command)
        if self.chroot is not None:
            self._write_wrappers()

    def _slurm_ids(self) -> tuple[int, int]:
        """uid and gid of SlurmUser where the daemons run (the root's passwd for a chroot)."""
        if self.slurm_user == "root":
            return 0, 0
        ids = self._lookup_user()
        if ids is None:
            # A site's packages create this user; a bare CI machine may not have it.
            self._run_client(
                [
                    "useradd",
                    "--system",
                    "--no-create-home",
                    "--home-dir",
                    "/nonexistent",
                    "--shell",
                    "/usr/sbin/nologin",
                    self.slurm_user,
                ],
                f"create user {self.slurm_user}",
            )
            ids = self._lookup_user()
        if ids is None:
            raise LocalClusterError(f"user {self.slurm_user} missing after useradd")
        return ids

    def _lookup_user(self) -> tuple[int, int] | None:
        if self.chroot is None:
            try:
                entry = pwd.getpwnam(self.slurm_user)
            except KeyError:
                return None
            return entry.pw_uid, entry.pw_gid
        for line in (self.chroot / "etc" / "passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) >= 4 and fields[0] == self.slurm_user:
                return int(fields[2]), int(fields[3])
        return None

    def _write_wrappers(self) -> None:
        """The script that enters the Slurm root, and one client wrapper per Slurm command."""
        assert self.chroot is not None
        root = str(self.chroot)
        q = shlex.quote
        binds = _outermost(
            [*(Path(b) for b in python_binds()), self.root], [Path(b) for b in _BASE_BINDS]
        )
        mounts = [f"mount --rbind {q(b)} {q(root + b)}" for b in (*_BASE_BINDS, *binds)]
        for path in (*_BASE_BINDS, *binds):
            self._make_mount_point(Path(path), file=Path(path).is_file())
        for path in _FILE_BINDS:
            if Path(path).is_file():
                self._make_mount_point(Path(path), file=True)
                mounts.append(f"mount --bind {q(path)} {q(root + path)}")
        # Inside the root: back to the caller's directory (sbatch takes it as the job's).
        inner = 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"'
        namespace = (
            "\n".join(mounts)
            + f'\nwd=$(pwd)\nexec chroot {q(root)} /bin/sh -c {q(inner)} in-root "$wd" "$@"\n'
        )
        self.bin_dir.mkdir(exist_ok=True)
        self.bin_dir.chmod(0o755)
        (self.bin_dir / WRAPPER_MARKER).write_text(f"{root}\n")
        _write_script(
            self._enter_script,
            "#!/bin/sh\n"
            "# Written by tests/support/local_cluster.py: run a program of the Slurm root\n"
            f"# {root} with the host's /proc, /dev, /sys, /tmp, project and Python at the same\n"
            "# paths, in a private mount namespace (the mounts go away with the last process).\n"
            # Already inside (a job, the EpilogSlurmctld): just run it.
            f'if [ -e /{ROOT_MARKER} ]; then exec "$@"; fi\n'
            "exec unshare --mount --propagation private -- "
            f'/bin/sh -e -c {q(namespace)} in-root "$@"\n',
        )
        for name in CLIENT_COMMANDS:
            program = _find_in_root(self.chroot, name)
            if program is not None:
                _write_script(
                    self.bin_dir / name,
                    f'#!/bin/sh\nexec {q(str(self._enter_script))} {q(program)} "$@"\n',
                )

    def _make_mount_point(self, path: Path, file: bool) -> None:
        """Create ``path`` inside the root (a bind mount needs a target of the same kind)."""
        assert self.chroot is not None
        target = self.chroot / path.relative_to("/")
        real = Path(os.path.realpath(target))
        if real != self.chroot and self.chroot not in real.parents:
            raise LocalClusterError(f"{target} leads out of the Slurm root (to {real})")
        if file:
            real.parent.mkdir(parents=True, exist_ok=True)
            real.touch(exist_ok=True)
        else:
            real.mkdir(parents=True, exist_ok=True)

    def write_epilog(self, command: Sequence[str] | None) -> None:
        """(Re)write the EpilogSlurmctld script; slurmctld reads it anew for every job."""
        self.epilog_command = tuple(command) if command is not None else None
        _write_script(self.epilog_path, self._epilog_script())

    # ----------------------------------------------------------------- running

    def _spawn(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start a daemon detached from us: own session, no tty, output to a log file."""
        log = self.log_dir / log_name
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self._cmd(argv),
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
        missing = missing_binaries(self.accounting, self.chroot)
        if missing:
            script = "install_slurm.sh" if self.chroot is None else "install_slurm_chroot.sh"
            raise LocalClusterError(
                f"missing programs {', '.join(missing)}: run .ci/{script} (as root)"
            )
        if self.slurm_user != "root":
            # SlurmUser must reach the cluster's files and run the EpilogSlurmctld.
            self.root.chmod(0o755)
            for parent in self.root.parents:
                if not parent.stat().st_mode & 0o001:
                    raise LocalClusterError(
                        f"SlurmUser={self.slurm_user} cannot enter {parent} (mode "
                        f"{parent.stat().st_mode & 0o777:o}), on the way to {self.root}: "
                        "put the cluster elsewhere or run chmod o+x on it"
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
        self._check_python()
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

    def _check_python(self) -> None:
        """Fail early, with the reason, when jobs or the epilog could not run this Python.

        Inside a Slurm root the host's Python loads the root's shared libraries; with a
        non-root SlurmUser the EpilogSlurmctld must be able to reach the interpreter and the
        project (a Python under a mode-700 /root cannot be).
        """
        check = "import ctypes, ssl, sqlite3, lzma, bz2, zlib, json"
        if importlib.util.find_spec("slurm_guard") is not None:
            # The project as jobs import it (an editable install may point anywhere).
            check += "; import slurm_guard.protocol"
        argv = [sys.executable, "-c", check]
        if self.slurm_user != "root":
            uid, gid = self._slurm_ids()
            probe = f"{check}; import os; os.listdir({str(REPO_ROOT)!r})"
            argv = [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={gid}",
                "--clear-groups",
                sys.executable,
                "-c",
                probe,
            ]
        result = self._run_client(argv, "check Python", check=False)
        if result.returncode != 0:
            where = f" inside {self.chroot}" if self.chroot is not None else ""
            raise LocalClusterError(
                f"{sys.executable} cannot run as {self.slurm_user}{where}, so jobs or the "
                f"EpilogSlurmctld would fail: {result.stderr.strip()[-1500:]}"
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
            self._cmd(
                [
                    "mariadb-install-db",
                    "--no-defaults",
                    f"--datadir={datadir}",
                    "--user=root",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ]
            ),
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
                self._cmd(argv),
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
            "chroot": str(self.chroot) if self.chroot is not None else None,
            "slurm_user": self.slurm_user,
            "min_job_age": self.min_job_age,
            "first_job_id": self.first_job_id,
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
            chroot=Path(state["chroot"]) if state.get("chroot") else None,
            slurm_user=str(state.get("slurm_user", "root")),
            min_job_age=int(state.get("min_job_age", DEFAULT_MIN_JOB_AGE_S)),
            first_job_id=int(state.get("first_job_id", 1)),
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
            f"port_base={self.port_base}, accounting={self.accounting}, "
            f"chroot={str(self.chroot) if self.chroot else None!r}, "
            f"slurm_user={self.slurm_user!r})"
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
    start.add_argument(
        "--chroot",
        type=Path,
        default=None,
        help="run Slurm from this root (.ci/install_slurm_chroot.sh builds one with 24.11)",
    )
    start.add_argument(
        "--slurm-user", default="root", help="SlurmUser (slurmctld and its epilog run as it)"
    )
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
            chroot = args.chroot.absolute() if args.chroot is not None else None
            cluster = LocalCluster(
                args.dir,
                nodes=args.nodes,
                port_base=port_base,
                accounting=accounting,
                epilog_command=shlex.split(args.epilog_command)
                if args.epilog_command is not None
                else None,
                cred_expire=args.cred_expire,
                chroot=chroot,
                slurm_user=args.slurm_user,
            )
            began = time.monotonic()
            cluster.start(timeout=args.timeout)
            print(
                f"local Slurm cluster running in {cluster.root} "
                f"(port base {cluster.port_base}, {time.monotonic() - began:.1f} s, "
                f"{cluster.slurm_version()}, SlurmUser={cluster.slurm_user}"
                + (f", root {cluster.chroot}" if cluster.chroot else "")
                + ")",
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
