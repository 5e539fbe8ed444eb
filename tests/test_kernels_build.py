"""Kernels are built once per node (kernels/build.py, kernels/warm.py), with real processes and
the real compiler behind a logging wrapper ($CC: a script that appends its arguments to a log
and execs gcc), so a compile is a line in the log.

- 8 processes that load the kernels at the same moment into an empty cache: one compile per
  library, and every process gets a library whose results are the torch reference's.
- warm_up loads every C kernel; later calls, in that process and in a new one, compile nothing.
- No working compiler ($CC=/bin/false, PATH without one) or SLURM_GUARD_NATIVE=0: the torch
  versions, the reference's results, at most one warning per library, no exception.
- triton_kernels.available() is False, with one warning, without a C compiler for Triton's
  launcher (checked on CPU: the GPU is patched in, the compiler check is real).
- A lock held by a process that died does not block; a live holder is waited for at most the
  timeout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from warm_workers import GCC, logging_compiler

from slurm_guard.kernels import build, warm
from slurm_guard.kernels import triton_kernels as tk

REPO = Path(__file__).resolve().parents[1]
needs_gcc = pytest.mark.skipif(GCC is None, reason="needs gcc for the logging compiler wrapper")
SOURCES = ("bucket_check.c", "nh_fingerprint.c", "abft_check.c")

# One process of the job: wait for the start signal (so that all of them race), warm up, run
# each kernel through its public path, compare with the torch reference, print a JSON line.
WORKER = r"""
import json, logging, os, sys, time
logging.basicConfig(level=logging.WARNING, format="WARN %(name)s: %(message)s")
import torch
from slurm_guard.fingerprint import nh as ff
from slurm_guard.kernels import abft_native, bucket, sketch, warm

go = sys.argv[1]
while go != "-" and not os.path.exists(go):
    time.sleep(0.005)
report = warm.warm_up(None)
x = torch.randn(70_001, generator=torch.Generator().manual_seed(3))
words = sketch.seed_words(7)
check = bucket.bucket_check(x.clone(), words)
same_check = check.view(torch.int64).tolist() == sketch.reference_check(x, words).view(
    torch.int64).tolist()
fp = ff.FastFingerprinter(11)
same_fp = fp.tensor(x).tolist() == ff.reference_fingerprint(x, fp, ff.nh_keys(11)).tolist()
w = torch.randn(33, 17, generator=torch.Generator().manual_seed(4))
kernel = abft_native.native()
if kernel is not None:
    rows, cols = abft_native.weight_norms(kernel, w)
    same_abft = bool(torch.allclose(rows, w.double().square().sum(1))
                     and torch.allclose(cols, w.double().square().sum(0)))
else:
    same_abft = True
print(json.dumps({"native": report.native, "backend": bucket.backend(torch.device("cpu")),
                  "check": same_check, "fingerprint": same_fp, "abft": same_abft}))
"""


def _compiles(log: Path) -> Counter[str]:
    """Compiles per shipped source (the probe of Triton's launcher compiles probe.c)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return Counter(next((s for s in (*SOURCES, "probe.c") if s in line), "other") for line in lines)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "SLURM_GUARD_NATIVE")}
    env.update(
        PYTHONPATH=str(REPO),
        SLURM_GUARD_CACHE=str(tmp_path / "cache"),
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def _workers(env: dict[str, str], n: int, tmp_path: Path) -> list[tuple[dict[str, object], str]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(go) if n > 1 else "-"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    time.sleep(0.5 if n > 1 else 0)
    go.touch()  # workers still importing torch start as soon as they are done
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


def _all_right(result: dict[str, object]) -> bool:
    return result["check"] is True and result["fingerprint"] is True and result["abft"] is True


@needs_gcc
def test_eight_concurrent_processes_compile_each_library_once(tmp_path: Path) -> None:
    cc, log = logging_compiler(tmp_path)
    results = _workers(_env(tmp_path, CC=str(cc)), 8, tmp_path)
    assert _compiles(log) == Counter(dict.fromkeys(SOURCES, 1)), log.read_text()
    for result, stderr in results:
        assert _all_right(result), result
        assert result["backend"] == "native"
        assert set(result["native"].values()) <= {"built", "cached"}, result  # type: ignore[attr-defined]
        assert "WARN" not in stderr, stderr
    built = Counter(how for r, _ in results for how in r["native"].values())  # type: ignore[attr-defined]
    assert built == {"built": 3, "cached": 21}  # one builder per library, 7 waiters each


@needs_gcc
def test_warm_up_loads_every_kernel_and_later_calls_compile_nothing(tmp_path: Path) -> None:
    cc, log = logging_compiler(tmp_path)
    env = _env(tmp_path, CC=str(cc))
    [(first, _)] = _workers(env, 1, tmp_path)
    assert first["native"] == dict.fromkeys(SOURCES, "built")
    # the worker ran every kernel after warm_up: still one compile each
    assert _compiles(log) == Counter(dict.fromkeys(SOURCES, 1))
    [(second, _)] = _workers(env, 1, tmp_path)  # a requeued rank on the same node
    assert second["native"] == dict.fromkeys(SOURCES, "cached")
    assert _compiles(log) == Counter(dict.fromkeys(SOURCES, 1))
    assert _all_right(first) and _all_right(second)


@needs_gcc
def test_prebuild_command_builds_once_and_reports(tmp_path: Path) -> None:
    cc, log = logging_compiler(tmp_path)
    env = _env(tmp_path, CC=str(cc))
    cmd = [sys.executable, "-m", "slurm_guard.kernels"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert all(f"{s}: built" in first.stdout for s in SOURCES), first.stdout
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert all(f"{s}: cached" in second.stdout for s in SOURCES), second.stdout
    [(rank, _)] = _workers(env, 1, tmp_path)  # the training step after the pre-build
    assert rank["native"] == dict.fromkeys(SOURCES, "cached")
    assert _compiles(log) == Counter(dict.fromkeys(SOURCES, 1))


@pytest.mark.parametrize("how", ["CC=/bin/false", "no compiler on PATH", "SLURM_GUARD_NATIVE=0"])
def test_without_a_working_compiler_the_torch_versions_run(tmp_path: Path, how: str) -> None:
    if how == "CC=/bin/false":
        env = _env(tmp_path, CC="/bin/false")
    elif how == "no compiler on PATH":
        env = _env(tmp_path, PATH=str(tmp_path / "empty"))
    else:
        env = _env(tmp_path, SLURM_GUARD_NATIVE="0")
    results = _workers(env, 2, tmp_path)
    for result, stderr in results:
        assert _all_right(result), result  # the reference's results, no exception
        assert result["backend"] == "torch"
        expected = "off" if how == "SLURM_GUARD_NATIVE=0" else "torch"
        assert result["native"] == dict.fromkeys(SOURCES, expected)
        warnings = [line for line in stderr.splitlines() if line.startswith("WARN")]
        if how == "CC=/bin/false":  # one per library, naming it and the compiler
            assert len(warnings) == 3, stderr
            assert all(any(s in w and "/bin/false" in w for w in warnings) for s in SOURCES)
        elif how == "no compiler on PATH":
            assert len(warnings) == 1 and "no C compiler" in warnings[0], stderr
        else:
            assert warnings == [], stderr


# ------------------------------------------------------------------ Triton's launcher compiler


@pytest.fixture
def cuda_without_interpreter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What available() sees on a GPU node (compiled Triton, CUDA there), on this CPU."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("SLURM_GUARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tk, "_launcher", None)


@pytest.mark.usefixtures("cuda_without_interpreter")
@pytest.mark.parametrize("how", ["CC=/bin/false", "no compiler on PATH"])
def test_triton_is_unavailable_without_a_c_compiler_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path, how: str
) -> None:
    if how == "CC=/bin/false":
        monkeypatch.setenv("CC", "/bin/false")
    else:
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        assert tk.launcher_compiler() is None
    with caplog.at_level(logging.WARNING, logger=tk.__name__):
        assert not tk.available(torch.device("cuda"))
        assert not tk.available()  # asked again (every bucket): no second check, no warning
    warnings = [r for r in caplog.records if r.name == tk.__name__]
    assert len(warnings) == 1 and "torch implementations" in warnings[0].getMessage()


@needs_gcc
@pytest.mark.usefixtures("cuda_without_interpreter")
def test_triton_launcher_check_compiles_once_per_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cc, log = logging_compiler(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    assert tk.launcher_compiler() == str(cc)  # $CC as Triton takes it
    assert tk.launcher_problem() is None
    assert tk.launcher_problem() is None  # another rank of the node: the probe is cached
    assert tk.available(torch.device("cuda"))
    assert _compiles(log) == Counter({"probe.c": 1})


def test_triton_lookup_mirrors_the_installed_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """launcher_compiler() resolves what triton.runtime.build._find_compiler('c') returns."""
    tbuild = pytest.importorskip("triton.runtime.build")
    for cc in ("/bin/false", None):
        if cc is None:
            monkeypatch.delenv("CC", raising=False)
        else:
            monkeypatch.setenv("CC", cc)
        tbuild._find_compiler.cache_clear()
        try:
            theirs = shutil.which(tbuild._find_compiler("c"))
        except RuntimeError:
            theirs = None
        assert tk.launcher_compiler() == theirs
    tbuild._find_compiler.cache_clear()


def test_warm_triton_launches_every_kernel_under_the_interpreter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("triton")
    if not tk.interpreting():
        pytest.skip("CUDA here: the gpu tests compile these")
    monkeypatch.setenv("SLURM_GUARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tk, "_launcher", None)
    done = warm.warm_triton(torch.device("cpu"), [5, 100_003], (torch.float32,), world_size=4)
    assert "nh_blocks" in done and "abft compare_transposed" in done
    assert sum("bucket_check" in v for v in done) == 9  # 3 sizes x (local, sketch, divided)
    assert tk._launcher is None  # nothing failed, nothing disabled


def test_a_failed_triton_warm_up_turns_triton_off_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("SLURM_GUARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tk, "_launcher", None)

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(tk, "triton_check", broken)
    with caplog.at_level(logging.WARNING, logger=tk.__name__):
        assert warm.warm_triton(torch.device("cpu")) == ()
        tk.disable("again")
    assert tk._launcher is False
    assert len([r for r in caplog.records if r.name == tk.__name__]) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not tk.available(torch.device("cuda"))


# ------------------------------------------------------------------ the lock and the cache


def test_a_lock_whose_holder_died_does_not_block(tmp_path: Path) -> None:
    lock = tmp_path / "k.so.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    with build.file_lock(lock, timeout=0.3) as held:
        assert not held  # a live holder: waited for, then the caller goes ahead
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with build.file_lock(lock, timeout=30) as held:
        assert held
    assert time.monotonic() - start < 5


def test_a_failed_build_is_not_repeated_by_the_waiters(tmp_path: Path) -> None:
    target = tmp_path / "k.so"
    calls = []

    def failing(out: Path) -> None:
        calls.append(out)
        raise build.BuildFailed("error: no")

    for _ in range(3):
        with pytest.raises(build.BuildFailed, match="error: no"):
            build.build_once(target, failing)
    assert len(calls) == 1 and not target.exists()


def test_default_cache_is_private_and_in_the_temporary_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SLURM_GUARD_CACHE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = build.ensure_cache_dir()
    assert path == tmp_path / f"slurm-guard-{os.getuid()}"
    assert path.stat().st_mode & 0o777 == 0o700
    path.chmod(0o777)  # as if another user had made it first, open to all
    with pytest.raises(PermissionError, match="SLURM_GUARD_CACHE"):
        build.ensure_cache_dir()
