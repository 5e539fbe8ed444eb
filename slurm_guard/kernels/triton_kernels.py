"""Triton versions of the guard's kernels, for CUDA tensors (and CPU tensors under the
interpreter, TRITON_INTERPRET=1, which is how CI tests them without a GPU).

- `nh_blocks`: the NH first level of `fingerprint.nh` (integer arithmetic, so its output,
  after the same torch-op tree, is bit-identical to the C kernel and the torch specification).
- `triton_check`: the fused sketch / L1 / finite pass of `kernels.sketch`, one program per chunk,
  the chunk summed in registers by the definition's halving tree; the per-chunk partials go to
  a buffer and one more program (torch elementwise ops for huge buckets) finishes them by the
  same fixed-order tree. No atomics, so every run and every rank gets the same bits, and they
  equal the C kernel's and the spec's.

Triton is optional (`pip install slurm-guard[gpu]`; CUDA builds of torch bring it): importing
this module without it works, `available()` says False and the callers use the torch versions.
Compiled Triton also needs a C compiler, for the launcher it builds the first time each kernel
runs: `available()` checks for one (Triton's own lookup, `launcher_compiler`, and a trial
compile cached once per node) and otherwise says False with one warning, so that the torch
versions run instead of Triton's "Failed to find C compiler" inside the DDP comm hook.
`kernels.warm.warm_up` compiles the kernels at the guard's set-up, not at step 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sysconfig
import threading
from pathlib import Path
from typing import Any

import torch

from slurm_guard.kernels import build as _build
from slurm_guard.kernels import sketch as _sketch
from slurm_guard.kernels.inputs import plain

logger = logging.getLogger(__name__)

triton: Any = None  # imported on first use: importing Triton costs a second or two
tl: Any = None
_import_tried = False


def _import_triton() -> bool:
    global triton, tl, _import_tried
    if not _import_tried:
        _import_tried = True
        try:
            import triton as triton_module
            import triton.language as language
        except ImportError:  # the optional `gpu` extra is not installed
            return False
        triton, tl = triton_module, language
    return triton is not None


_NH_BLOCKS_PER_PROGRAM = 4
_FINISH_MAX = 1 << 13  # chunk partials one program trees in registers (a 32M-element bucket)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | None = None) -> bool:
    """Whether the Triton kernels can run on tensors of `device` (default: CUDA) here: Triton
    imports, and either it interprets (TRITON_INTERPRET=1) or CUDA is there and Triton can build
    its launchers (`launcher_ok`)."""
    if not _import_triton():
        return False
    if device is not None and device.type == "cpu":
        return interpreting()
    return interpreting() or (torch.cuda.is_available() and launcher_ok())


_launcher: bool | None = None  # launcher_ok()'s answer, decided once per process
_launcher_lock = threading.Lock()
_PROBE = "#include <Python.h>\nint sg_launcher_probe(void) { return 0; }\n"


def launcher_compiler() -> str | None:
    """The C compiler Triton would build its launchers with, resolved on PATH, or None.

    Mirrors `triton.runtime.build._find_compiler("c")` (Triton 3.x): $CC as given (even when it
    is not on PATH: Triton then fails at the build), else gcc, else clang. Unlike the guard's
    own C kernels (`build.compiler`), `cc` is not looked for.
    """
    cc = os.environ.get("CC")
    if cc is not None:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("clang")


def launcher_problem() -> str | None:
    """Why Triton could not build a launcher here, or None when it can.

    A launcher includes Python.h and is built with `cc src -O3 -shared -fPIC -Wno-psabi
    -I<python include>` (`triton.runtime.build._build`); the same compile of a two-line file
    proves the compiler and the headers. Its result is cached in the kernel cache, keyed by the
    compiler's path and file, so the ranks of a node run it once. A build hook of Triton's own
    (`triton.knobs.build.impl`) needs no compiler of ours.
    """
    knobs = getattr(triton, "knobs", None)
    if getattr(getattr(knobs, "build", None), "impl", None) is not None:
        return None
    cc = launcher_compiler()
    if cc is None:
        given = os.environ.get("CC")
        if given is not None:
            return f"$CC={given!r} is not an executable"
        return "no C compiler for Triton's launchers (set $CC or install gcc or clang)"
    include = sysconfig.get_paths()["include"]
    try:
        st = os.stat(cc)
        key = hashlib.sha256(
            "\0".join([_PROBE, cc, str(st.st_size), str(st.st_mtime_ns), include]).encode()
        ).hexdigest()[:20]
        target = _build.ensure_cache_dir() / f"triton-launcher-probe-{key}.so"
        argv = [cc, "-O3", "-shared", "-fPIC", "-Wno-psabi", f"-I{include}"]

        def probe(out: Path) -> None:
            proc = _build.run_compiler(argv, out, "probe.c", _PROBE)
            if proc.returncode != 0:
                raise _build.BuildFailed(proc.stderr.strip() or f"exit {proc.returncode}")

        _build.build_once(target, probe)
    except _build.BuildFailed as exc:
        return f"{cc} cannot build Triton's launchers: {str(exc)[-500:]}"
    except Exception as exc:  # OSError, a timeout: the compiler is unusable either way
        return f"{cc} cannot build Triton's launchers: {exc}"
    return None


def launcher_ok() -> bool:
    """Whether compiled Triton kernels can be launched here: `launcher_problem` once per
    process; when there is one, a warning (once) and False from then on."""
    global _launcher
    if _launcher is None:
        with _launcher_lock:
            if _launcher is None:
                problem = launcher_problem()
                if problem is not None:
                    _warn_off(problem)
                _launcher = problem is None
    return _launcher


def disable(reason: str) -> None:
    """Turn the Triton kernels off for this process (with one warning): what warm-up does when
    a kernel fails to compile, so that the comm hook runs the torch versions instead."""
    global _launcher
    with _launcher_lock:
        if _launcher is not False:
            _warn_off(reason)
        _launcher = False


def _warn_off(reason: str) -> None:
    logger.warning(
        "Triton kernels off: %s; on CUDA the guard uses its torch implementations "
        "(same results, slower)",
        reason,
    )


_compiled: dict[str, Any] = {}
_mix32: Any = None  # a jitted helper; kernels find helpers among the module's globals


def _kernels() -> dict[str, Any]:
    """The jitted kernels, defined on first use (after TRITON_INTERPRET has been read)."""
    global _mix32
    if _compiled:
        return _compiled
    if not _import_triton():
        raise RuntimeError("Triton is not installed: pip install 'slurm-guard[gpu]'")

    @triton.jit
    def mix32(x, m1, m2):  # type: ignore[no-untyped-def]
        x = x ^ (x >> 16)
        x = x * m1
        x = x ^ (x >> 15)
        x = x * m2
        return x ^ (x >> 16)

    _mix32 = mix32

    @triton.jit  # type: ignore[untyped-decorator]
    def check_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        n,
        s0_arg,
        s1_arg,
        m1_arg,
        m2_arg,
        ps_ptr,
        pa_ptr,
        divisor,
        SPAN: tl.constexpr,
        LOG2_SPAN: tl.constexpr,
        IS_F64: tl.constexpr,
        WITH_L1: tl.constexpr,
        DIVIDE: tl.constexpr,
    ):
        c = tl.program_id(0).to(tl.int64)
        s0 = s0_arg.to(tl.uint32)
        s1 = s1_arg.to(tl.uint32)
        m1 = m1_arg.to(tl.uint32)
        m2 = m2_arg.to(tl.uint32)
        k = tl.arange(0, 8)[:, None].to(tl.int64)
        i = tl.arange(0, SPAN)[None, :].to(tl.int64)
        e = c * (8 * SPAN) + k * SPAN + i  # [8, SPAN] element indices of this chunk
        raw = tl.load(x_ptr + e, mask=e < n, other=0.0)
        if DIVIDE:  # in place, IEEE division: float32 `/` may be approximate on GPUs
            if IS_F64:
                raw = raw / divisor.to(tl.float64)  # float64 division is always div.rn
            else:
                raw = tl.math.div_rn(raw, divisor.to(tl.float32))
            tl.store(x_ptr + e, raw, mask=e < n)
        if IS_F64:  # noqa: SIM108  (an if statement on a constexpr: what Triton compiles)
            v = raw
        else:  # via float32: exact for fp16/bf16, and every backend converts those to fp32
            v = raw.to(tl.float32).to(tl.float64)
        h = _mix32(_mix32((e >> 5).to(tl.uint32) ^ s0, m1, m2) ^ s1, m1, m2)
        negative = ((h >> (e & 31).to(tl.uint32)) & 1) == 1
        s = tl.where(negative, -v, v)
        # the halving tree: streams k and k+4, then k and k+2, then k and k+1 ...
        s = tl.sum(tl.reshape(s, (2, 4, SPAN)), axis=0)
        s = tl.sum(tl.reshape(s, (2, 2, SPAN)), axis=0)
        s = tl.sum(s, axis=0)  # two rows: exactly row0 + row1
        # ... then within the span, i and i + h for h = SPAN/2, ..., 1
        for level in tl.static_range(LOG2_SPAN):
            s = tl.sum(tl.reshape(s, (2, SPAN >> (level + 1))), axis=0)
        tl.store(ps_ptr + c, tl.sum(tl.reshape(s, (1,)), axis=0))
        if WITH_L1:  # the same tree over |v|; skipped for the averaged bucket
            a = tl.abs(v)
            a = tl.sum(tl.reshape(a, (2, 4, SPAN)), axis=0)
            a = tl.sum(tl.reshape(a, (2, 2, SPAN)), axis=0)
            a = tl.sum(a, axis=0)
            for level in tl.static_range(LOG2_SPAN):
                a = tl.sum(tl.reshape(a, (2, SPAN >> (level + 1))), axis=0)
            tl.store(pa_ptr + c, tl.sum(tl.reshape(a, (1,)), axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def nh_kernel(  # type: ignore[no-untyped-def]
        words_ptr,
        nblocks,
        keys_ptr,
        out_ptr,
        NH_WORDS: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        b = pid * BLOCKS + tl.arange(0, BLOCKS)[:, None].to(tl.int64)  # [BLOCKS, 1]
        j = tl.arange(0, NH_WORDS // 2)[None, :].to(tl.int64)  # [1, NH_WORDS/2]
        live = b < nblocks
        base = b * NH_WORDS + 2 * j
        m0 = tl.load(words_ptr + base, mask=live, other=0).to(tl.uint32, bitcast=True)
        m1 = tl.load(words_ptr + base + 1, mask=live, other=0).to(tl.uint32, bitcast=True)
        rows = tl.arange(0, BLOCKS).to(tl.int64) + pid * BLOCKS
        for lane in tl.static_range(2):
            k0 = tl.load(keys_ptr + lane * NH_WORDS + 2 * j).to(tl.uint32, bitcast=True)
            k1 = tl.load(keys_ptr + lane * NH_WORDS + 2 * j + 1).to(tl.uint32, bitcast=True)
            x = (m0 + k0).to(tl.uint64)  # uint32 additions wrap mod 2^32
            y = (m1 + k1).to(tl.uint64)
            total = tl.sum(x * y, axis=1)  # uint64: exact products, sums mod 2^64 in any order
            tl.store(
                out_ptr + rows * 2 + lane, total.to(tl.int64, bitcast=True), mask=rows < nblocks
            )

    @triton.jit  # type: ignore[untyped-decorator]
    def finish_kernel(  # type: ignore[no-untyped-def]
        ps_ptr,
        pa_ptr,
        chunks,
        out_ptr,
        PADDED: tl.constexpr,
        LOG2_PADDED: tl.constexpr,
        WITH_L1: tl.constexpr,
    ):
        i = tl.arange(0, PADDED)
        s = tl.load(ps_ptr + i, mask=i < chunks, other=0.0)  # +0.0 padding, as defined
        for level in tl.static_range(LOG2_PADDED):
            s = tl.sum(tl.reshape(s, (2, PADDED >> (level + 1))), axis=0)
        total_s = tl.sum(tl.reshape(s, (1,)), axis=0)
        tl.store(out_ptr, total_s)
        if WITH_L1:
            a = tl.load(pa_ptr + i, mask=i < chunks, other=0.0)
            for level in tl.static_range(LOG2_PADDED):
                a = tl.sum(tl.reshape(a, (2, PADDED >> (level + 1))), axis=0)
            total_a = tl.sum(tl.reshape(a, (1,)), axis=0)
            tl.store(out_ptr + 1, total_a)
            tl.store(out_ptr + 2, tl.where(total_a <= 1.7976931348623157e308, 0.0, 1.0))
        else:  # sketch only: A not formed, the flag from S (NaN fails both comparisons)
            finite = (total_s <= 1.7976931348623157e308) & (total_s >= -1.7976931348623157e308)
            tl.store(out_ptr + 1, 0.0)
            tl.store(out_ptr + 2, tl.where(finite, 0.0, 1.0))

    _compiled.update(check=check_kernel, nh=nh_kernel, finish=finish_kernel)
    return _compiled


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launch on the tensor's GPU: DDP runs the hook's callbacks on threads whose current device
    is not necessarily the rank's, and Triton launches on the current device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_check(
    bucket: torch.Tensor, words: tuple[int, int], *, l1: bool = True, divide_by: int = 1
) -> torch.Tensor:
    """float64 [S, A, nonfinite] of a bucket on its device: the bits of `sketch.reference_check`
    (l1=False: its sketch-only variant). divide_by > 1: the bucket (float32/float64, contiguous)
    is divided in place first, in the same read, as `sketch.divide` would."""
    plain("triton_kernels.triton_check", bucket)
    with _on(bucket.device):
        return _triton_check(bucket, words, l1, divide_by)


def _triton_check(
    bucket: torch.Tensor, words: tuple[int, int], l1: bool, divide_by: int
) -> torch.Tensor:
    _sketch.check_divisor(divide_by, bucket)
    x = bucket.detach().reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    chunks, padded = _sketch.padded_chunks(n)
    fused_finish = padded <= _FINISH_MAX
    alloc = torch.empty if fused_finish else torch.zeros
    partials = alloc(2 if l1 else 1, padded, dtype=torch.float64, device=x.device)
    pa = partials[1 if l1 else 0]  # not written without l1
    span = _sketch.CHUNK // 8
    _kernels()["check"][(chunks,)](
        x,
        n,
        words[0],
        words[1],
        _sketch.MIX_M1,
        _sketch.MIX_M2,
        partials[0],
        pa,
        divide_by,
        SPAN=span,
        LOG2_SPAN=span.bit_length() - 1,
        IS_F64=x.dtype == torch.float64,
        WITH_L1=l1,
        DIVIDE=divide_by > 1,
    )
    if fused_finish:  # one more launch instead of ~log2(chunks) elementwise torch ops
        out = torch.empty(3, dtype=torch.float64, device=x.device)
        _kernels()["finish"][(1,)](
            partials[0],
            pa,
            chunks,
            out,
            PADDED=padded,
            LOG2_PADDED=padded.bit_length() - 1,
            WITH_L1=l1,
        )
        return out
    totals = _sketch.tree_sum(partials)
    if not l1:
        totals = torch.cat([totals, totals.new_zeros(1)])
    return torch.cat([totals, (~torch.isfinite(totals[1:2] if l1 else totals[0:1])).double()])


def nh_blocks(raw: torch.Tensor, keys: torch.Tensor, nh_words: int) -> torch.Tensor:
    """int64 [nblocks, 2]: the NH value (mod 2^64, as bits) of each zero-padded block of `raw`
    (a flat uint8 tensor) under the two lanes' keys (int32 [2, nh_words])."""
    plain("triton_kernels.nh_blocks", raw, keys)
    with _on(raw.device):
        return _nh_blocks(raw, keys, nh_words)


def _nh_blocks(raw: torch.Tensor, keys: torch.Tensor, nh_words: int) -> torch.Tensor:
    block_bytes = 4 * nh_words
    nbytes = raw.numel()
    full = nbytes // block_bytes
    keys = keys.to(device=raw.device, dtype=torch.int32).contiguous()
    parts = []
    kernel = _kernels()["nh"]
    if full:
        main = raw[: full * block_bytes]
        if main.data_ptr() % 4:
            main = main.clone()  # a fresh allocation is aligned
        out = torch.empty(full, 2, dtype=torch.int64, device=raw.device)
        grid = (-(-full // _NH_BLOCKS_PER_PROGRAM),)
        kernel[grid](
            main.view(torch.int32),
            full,
            keys,
            out,
            NH_WORDS=nh_words,
            BLOCKS=_NH_BLOCKS_PER_PROGRAM,
        )
        parts.append(out)
    if nbytes % block_bytes or nbytes == 0:
        tail = torch.nn.functional.pad(
            raw[full * block_bytes :], (0, block_bytes - nbytes % block_bytes)
        )
        out = torch.empty(1, 2, dtype=torch.int64, device=raw.device)
        kernel[(1,)](
            tail.view(torch.int32), 1, keys, out, NH_WORDS=nh_words, BLOCKS=_NH_BLOCKS_PER_PROGRAM
        )
        parts.append(out)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
