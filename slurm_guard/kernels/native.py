"""Build, cache and load the C kernels shipped beside this module.

The sources are package data (`*.c` next to this file), read with importlib.resources so they
work from a wheel or a zip as well as from a checkout. Constants that Python also uses are
passed with -D, so each is defined once (in the Python module that owns it). The build uses the
system compiler ($CC, cc, gcc or clang), first with -march=native, then portably, into a cache
directory ($SLURM_GUARD_CACHE, else $XDG_CACHE_HOME/slurm-guard, else ~/.cache/slurm-guard). The
library's name is keyed by source, defines, compiler, flags and the CPU, so a shared home
directory never hands one node's -march=native build to a different CPU. SLURM_GUARD_NATIVE=0
disables every native kernel (callers then use their torch specification).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 120
# -fno-fast-math spelled out: the float64 kernels rely on IEEE addition in source order.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-std=c99", "-fno-fast-math", "-ffp-contract=off"]
NATIVE_FLAGS = [*BASE_FLAGS, "-march=native"]
WARNING_FLAGS = ["-Wall", "-Wextra", "-Werror"]

_lock = threading.Lock()
_loaded: dict[tuple[str, tuple[tuple[str, int], ...]], ctypes.CDLL | None] = {}
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def cache_dir() -> Path:
    """Where compiled kernels live ($SLURM_GUARD_CACHE, else the XDG cache directory)."""
    explicit = os.environ.get("SLURM_GUARD_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "slurm-guard"


def source(name: str) -> str:
    """The text of a C source shipped in this package (e.g. 'nh_fingerprint.c')."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def compiler() -> str | None:
    """The C compiler to use, or None when none is on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def define_flags(defines: Mapping[str, int]) -> list[str]:
    return [f"-D{key}={int(value)}" for key, value in sorted(defines.items())]


def _cpu_signature() -> str:
    """The host's CPU model and flags: a -march=native build must not be reused on another CPU
    (home directories are often shared across a cluster's nodes)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    text += line
                if line.strip() == "":
                    break  # the first processor is enough
    except OSError:
        pass
    return text


def compile_source(
    name: str, defines: Mapping[str, int], flags: list[str], out: Path, cc: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Compile one shipped source to `out` (no caching); the process result says how it went."""
    cc = cc or compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler found (set $CC or install cc, gcc or clang)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / name
        src.write_text(source(name), encoding="utf-8")
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run(
            [cc, *flags, *define_flags(defines), "-o", str(tmp_out), str(src)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        if proc.returncode == 0:
            os.replace(tmp_out, out)  # atomic: concurrent ranks never load a half-written library
    return proc


def _build_and_load(name: str, defines: Mapping[str, int]) -> ctypes.CDLL | None:
    if os.environ.get("SLURM_GUARD_NATIVE", "1") == "0" or sys.byteorder != "little":
        return None
    cc = compiler()
    if cc is None:
        logger.info("native kernels: no C compiler found; using the torch implementations")
        return None
    text = source(name)
    stem = name.rsplit(".", 1)[0]
    for flags in (NATIVE_FLAGS, BASE_FLAGS):
        key = hashlib.sha256(
            "\0".join([text, cc, *flags, *define_flags(defines), _cpu_signature()]).encode()
        ).hexdigest()[:20]
        target = cache_dir() / f"sg_{stem}-{key}.so"
        try:
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                proc = compile_source(name, defines, flags, target, cc)
                if proc.returncode != 0:
                    logger.warning(
                        "native kernels: compiling %s with %s %s failed: %s",
                        name,
                        cc,
                        " ".join(flags),
                        proc.stderr[-2000:],
                    )
                    continue
            return ctypes.CDLL(str(target))
        except (OSError, subprocess.TimeoutExpired) as exc:
            logger.warning("native kernels: cannot build or load %s: %s", target, exc)
    logger.warning("native kernels: no build of %s; using the torch implementation", name)
    return None


def load(name: str, defines: Mapping[str, int]) -> ctypes.CDLL | None:
    """The compiled library for a shipped source, built on first use; None if it cannot be."""
    key = (name, tuple(sorted((k, int(v)) for k, v in defines.items())))
    if key not in _loaded:
        with _lock:
            if key not in _loaded:
                _loaded[key] = _build_and_load(name, defines)
    return _loaded[key]


def thread_pool(workers: int) -> ThreadPoolExecutor:
    """A shared pool for splitting one kernel call over threads (ctypes releases the GIL)."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sg-kernel")
            _pool_size = workers
        return _pool


W = TypeVar("W")


class LazyKernel(Generic[W]):
    """A shipped kernel, compiled, loaded and wrapped (ctypes signatures) on the first call;
    later calls cost one attribute read. Calling it returns the wrapper, or None when the
    kernel cannot be built or SLURM_GUARD_NATIVE=0 (callers then use their torch spec)."""

    def __init__(
        self,
        name: str,
        defines: Callable[[], Mapping[str, int]],
        wrap: Callable[[ctypes.CDLL], W],
    ) -> None:
        self._name, self._defines, self._wrap = name, defines, wrap
        self._value: W | None = None
        self._tried = False
        self._lock = threading.Lock()  # not the module's: load() takes that one

    def __call__(self) -> W | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    lib = load(self._name, self._defines())
                    self._value = self._wrap(lib) if lib is not None else None
                    self._tried = True
        return self._value
