"""Load the C kernels shipped beside this module, each built once per node (`build`).

The sources are package data (`*.c` next to this file), read with importlib.resources so they
work from a wheel or a zip as well as from a checkout. Constants that Python also uses are
passed with -D, so each is defined once (in the Python module that owns it). The build uses the
system compiler ($CC, cc, gcc or clang), first with -march=native, then portably, into the cache
directory of `build.cache_dir` ($SLURM_GUARD_CACHE, else node-local <tmp>/slurm-guard-<uid>),
under a per-library file lock: of the ranks that start together on a node one compiles, the
others wait and load its library. The library's name is keyed by source, defines, compiler,
flags and the CPU, so a cache shared by several nodes never hands one node's -march=native build
to a different CPU. SLURM_GUARD_NATIVE=0 disables every native kernel (callers then use their
torch specification); so does a missing or failing compiler, with one warning.

`kernels.warm.warm_up` (called at the guard's set-up) and `python -m slurm_guard.kernels` (the
pre-build step of the sbatch template) load every kernel here ahead of the first step.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Generic, TypeVar

from slurm_guard.kernels.build import (
    BASE_FLAGS,
    COMPILE_TIMEOUT_S,
    NATIVE_FLAGS,
    WARNING_FLAGS,
    BuildFailed,
    build_once,
    cache_dir,
    compile_source,
    compiler,
    define_flags,
    ensure_cache_dir,
    source,
    warn_once,
)

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[tuple[str, tuple[tuple[str, int], ...]], ctypes.CDLL | None] = {}
_how: dict[str, str] = {}  # library path -> "built" (by this process) or "cached"
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def enabled() -> bool:
    """False when SLURM_GUARD_NATIVE=0 or on a big-endian host (the kernels read little-endian)."""
    return os.environ.get("SLURM_GUARD_NATIVE", "1") != "0" and sys.byteorder == "little"


def _cpu_signature() -> str:
    """The host's CPU model and flags: a -march=native build must not be reused on another CPU
    (a cache directory may be shared across a cluster's nodes)."""
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


def library_name(name: str, defines: Mapping[str, int], cc: str, flags: list[str]) -> str:
    """The cache file name of one build: keyed by everything that changes the library."""
    key = hashlib.sha256(
        "\0".join([source(name), cc, *flags, *define_flags(defines), _cpu_signature()]).encode()
    ).hexdigest()[:20]
    return f"sg_{name.rsplit('.', 1)[0]}-{key}.so"


def _build_and_load(name: str, defines: Mapping[str, int]) -> ctypes.CDLL | None:
    if not enabled():
        return None
    cc = compiler()
    if cc is None:
        warn_once(
            "no-cc",
            "native kernels: no C compiler found (set $CC or install cc, gcc or clang); "
            "the guard uses its torch implementations (same results, slower)",
        )
        return None
    try:
        directory = ensure_cache_dir()
    except OSError as exc:
        warn_once("cache", "native kernels: no cache directory (%s); using torch", exc)
        return None
    problems = []
    for flags in (NATIVE_FLAGS, BASE_FLAGS):
        target = directory / library_name(name, defines, cc, flags)

        def build(out: Path, flags: list[str] = flags) -> None:
            proc = compile_source(name, defines, flags, out, cc)
            if proc.returncode != 0:
                raise BuildFailed(proc.stderr.strip() or f"exit status {proc.returncode}")

        try:
            how = build_once(target, build)
            lib = ctypes.CDLL(str(target))
        except BuildFailed as exc:
            problems.append(f"{' '.join(flags)}: {str(exc)[-1000:]}")
            continue
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"{target}: {exc}")
            continue
        _how[str(target)] = how
        logger.debug("native kernels: %s %s", how, target)
        return lib
    logger.warning(
        "native kernels: cannot build %s with %s; using the torch implementation. %s",
        name,
        cc,
        " | ".join(problems),
    )
    return None


def load(name: str, defines: Mapping[str, int]) -> ctypes.CDLL | None:
    """The compiled library for a shipped source, built on first use; None if it cannot be."""
    key = (name, tuple(sorted((k, int(v)) for k, v in defines.items())))
    if key not in _loaded:
        with _lock:
            if key not in _loaded:
                _loaded[key] = _build_and_load(name, defines)
    return _loaded[key]


def how_loaded(lib: ctypes.CDLL) -> str:
    """'built' (compiled by this process) or 'cached' (found built, or built by another)."""
    return _how.get(str(lib._name), "cached")


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
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()  # not the module's: load() takes that one

    @property
    def source(self) -> str:
        """The shipped C source this kernel is built from."""
        return self._name

    @property
    def library(self) -> ctypes.CDLL | None:
        """The loaded library once called (None before, or when it could not be built)."""
        return self._lib

    def __call__(self) -> W | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    lib = self._lib = load(self._name, self._defines())
                    self._value = self._wrap(lib) if lib is not None else None
                    self._tried = True
        return self._value


__all__ = [
    "BASE_FLAGS",
    "COMPILE_TIMEOUT_S",
    "NATIVE_FLAGS",
    "WARNING_FLAGS",
    "LazyKernel",
    "cache_dir",
    "compile_source",
    "compiler",
    "define_flags",
    "enabled",
    "how_loaded",
    "library_name",
    "load",
    "source",
    "thread_pool",
]
