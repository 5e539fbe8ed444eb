"""Compile the shipped C kernels once per node: where the cache lives, the cross-process lock,
the atomic publish.

Every rank of a job loads the same kernels at the same moment. Without coordination each one
ran the compiler into the same directory (O(ranks) compiles per node, again on every requeue).
Here a library is built by at most one process at a time:

- Cache: $SLURM_GUARD_CACHE when set (kept as given: a site may point it at a shared or scratch
  directory), else ``<tmp>/slurm-guard-<uid>`` where <tmp> is Python's temporary directory
  ($TMPDIR, else /tmp). That default is node-local on Slurm nodes, which is what a lock wants:
  ``flock`` on a shared home (NFS, Lustre, GPFS) may be slow, refused or node-local anyway, and a
  -march=native build belongs to one CPU. A per-job $TMPDIR (or Slurm's job_container/tmpfs) makes
  it one build per node per job, still shared by the job's steps. The directory is created 0700
  and used only if it is ours and nobody else can write to it (/tmp is shared by every user).
  Library names stay keyed by source, defines, compiler, flags and CPU, so a cache shared across
  nodes is safe too.
- Lock: ``fcntl.flock`` on ``<library>.lock`` beside the library. The kernel drops a flock when
  its holder dies, so a killed rank never leaves a lock behind; a holder that hangs is waited
  for at most LOCK_TIMEOUT_S (longer than the compiler's own timeout), after which the waiter
  builds anyway. Where the filesystem refuses flock, every process builds (once warned).
- Publish: the compiler writes into a temporary directory beside the target and the library is
  renamed into place, so a waiter that sees the file sees all of it.
- A failed compile leaves ``<library>.failed`` with the compiler's message; the processes waiting
  on the lock read it instead of running the same failing compile again, and it is retried after
  FAILED_RETRY_S.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 120
LOCK_TIMEOUT_S = 2 * COMPILE_TIMEOUT_S + 60  # a holder tries two flag sets
FAILED_RETRY_S = 600
_LOCK_POLL_S = 0.05
# -fno-fast-math spelled out: the float64 kernels rely on IEEE addition in source order.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-std=c99", "-fno-fast-math", "-ffp-contract=off"]
NATIVE_FLAGS = [*BASE_FLAGS, "-march=native"]
WARNING_FLAGS = ["-Wall", "-Wextra", "-Werror"]

_warned: set[str] = set()
_warned_lock = threading.Lock()


class BuildFailed(Exception):
    """The compiler ran and refused (recorded, so that waiting processes do not repeat it)."""


def warn_once(key: str, message: str, *args: object) -> None:
    """logger.warning, at most once per process for `key`."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message, *args)


def cache_dir() -> Path:
    """Where compiled kernels live: $SLURM_GUARD_CACHE, else <tmp>/slurm-guard-<uid>."""
    explicit = os.environ.get("SLURM_GUARD_CACHE")
    if explicit:
        return Path(explicit)
    return Path(tempfile.gettempdir()) / f"slurm-guard-{os.getuid()}"


def ensure_cache_dir() -> Path:
    """The cache directory, created if needed.

    Raises:
        PermissionError: the default directory exists but is not ours alone (/tmp is shared:
            another user could otherwise hand us a library to load).
    """
    path = cache_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.environ.get("SLURM_GUARD_CACHE"):
        return path
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"{path} is not a directory that only this user can write; "
            "set SLURM_GUARD_CACHE to a private directory"
        )
    return path


def source(name: str) -> str:
    """The text of a C source shipped in this package (e.g. 'nh_fingerprint.c')."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def compiler() -> str | None:
    """The C compiler for the guard's kernels ($CC, else cc, gcc or clang), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def define_flags(defines: Mapping[str, int]) -> list[str]:
    return [f"-D{key}={int(value)}" for key, value in sorted(defines.items())]


def run_compiler(
    argv: list[str], out: Path, src_name: str, text: str
) -> subprocess.CompletedProcess[str]:
    """Run `argv` + ["-o", tmp, src] on `text` (saved as `src_name`) in a temporary directory
    beside `out`, and on success rename the result to `out` (atomic: a concurrent process never
    loads a half-written library). OSError and TimeoutExpired propagate."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        src = Path(tmp) / src_name
        src.write_text(text, encoding="utf-8")
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run(
            [*argv, "-o", str(tmp_out), str(src)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        if proc.returncode == 0:
            os.replace(tmp_out, out)
    return proc


def compile_source(
    name: str, defines: Mapping[str, int], flags: list[str], out: Path, cc: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Compile one shipped source to `out` (no cache, no lock); the process result says how it
    went (what `python -m slurm_guard.kernels --check` and the tests run)."""
    cc = cc or compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler found (set $CC or install cc, gcc or clang)")
    return run_compiler([cc, *flags, *define_flags(defines)], out, name, source(name))


@contextlib.contextmanager
def file_lock(path: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[bool]:
    """Hold an exclusive flock on `path` (created if needed, never removed: removing a lock file
    races with the next holder). Yields True when held, False when it could not be had (timed
    out, or a filesystem without flock); the caller then goes ahead unlocked."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    held = False
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("kernels: %s held for over %.0f s; going ahead", path, timeout)
                    break
                time.sleep(_LOCK_POLL_S)
            except OSError as exc:  # ENOLCK, EOPNOTSUPP, ENOSYS: a filesystem without flock
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                warn_once(
                    "no-flock",
                    "kernels: cannot lock in %s (%s); every process builds for itself "
                    "(set SLURM_GUARD_CACHE to a node-local directory)",
                    path.parent,
                    exc,
                )
                break
        yield held
    finally:
        if held:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _recent_failure(marker: Path) -> str | None:
    try:
        if time.time() - marker.stat().st_mtime < FAILED_RETRY_S:
            return marker.read_text(encoding="utf-8", errors="replace")
    except OSError:
        pass
    return None


def build_once(target: Path, build: Callable[[Path], None]) -> str:
    """Make `target` exist, built by `build(target)` in at most one process at a time.

    Returns "built" when this call built it, "cached" when it was there already or another
    process built it while this one waited. `build` must publish atomically (`run_compiler`) and
    raise BuildFailed when the compiler refuses.

    Raises:
        BuildFailed: this call's build failed, or one less than FAILED_RETRY_S ago did (its
            message is in `<target>.failed`, so waiting processes do not repeat it).
        OSError, subprocess.TimeoutExpired: from the build.
    """
    if target.exists():
        return "cached"
    marker = target.with_name(target.name + ".failed")
    with file_lock(target.with_name(target.name + ".lock")):
        if target.exists():  # built by the process we waited for
            return "cached"
        failure = _recent_failure(marker)
        if failure is not None:
            raise BuildFailed(failure)
        try:
            build(target)
            if not target.exists():
                raise BuildFailed(f"the build left no {target.name}")
        except BuildFailed as exc:
            with contextlib.suppress(OSError):
                tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
                tmp.write_text(str(exc), encoding="utf-8")
                os.replace(tmp, marker)
            raise
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
    return "built"
