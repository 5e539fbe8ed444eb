"""A fast exact fingerprint: one pass over the tensor's bytes, at memory bandwidth on CPU.

`fingerprint.Fingerprinter` hashes 16-bit words widened to int64 in separate torch ops; it reads
and writes several times the tensor's size and reaches about 0.3 GB/s. This module keeps its
guarantees (exact, order-sensitive, seeded per run, a stated false-match bound, the same output
format: an int64 [2] of two 31-bit lanes) with a first level that reads every byte once.

Construction (the numbers are module constants):
- Level 1, NH (the first level of UMAC; Black et al., CRYPTO 1999). The bytes, zero-padded, are cut
  into blocks of NH_WORDS = 1024 little-endian uint32 words (4 KiB). For each block and each of
  two lanes with independent uniform keys k in [0, 2^32)^1024:
      NH_k(m) = sum_i ((m_2i + k_2i) mod 2^32) * ((m_2i+1 + k_2i+1) mod 2^32)  mod 2^64.
  NH is 2^-32-almost-universal on equal-length inputs, so two differing blocks give equal outputs
  in both lanes with probability <= 2^-64. An empty tensor is one all-zero block.
- Level 2 onwards: the 64-bit NH outputs, as 16-bit words (4 per lane value, lane-interleaved,
  block by block), go through exactly `Fingerprinter._reduce`: the tree of multilinear hashes
  modulo P = 2^31 - 1 with the run's coefficients, the byte length, dtype and shape mixed in last.

False-match bound, for two different inputs (bytes, dtype or shape): if the byte lengths are equal,
some block differs and both NH lanes collide with probability <= 2^-64; otherwise (or if NH
separated them) the tree's inputs differ and it collides with probability <= (d/P)^2 for d tree
levels, d <= 5 up to 2^43 bytes (8 TiB). Total: Pr[false match] <= 2^-64 + (5/P)^2 < 6e-18 per
comparison, the bound `fingerprint.py` states. The keys come from the per-run seed.

Implementations, bit-identical by construction (integer arithmetic only; tested):
- native: a small C kernel (AVX-512 or AVX2 when the compiler targets them, scalar otherwise)
  built once with the system C compiler ($CC, cc, gcc or clang) into a cache directory
  ($SLURM_GUARD_CACHE, else $XDG_CACHE_HOME/slurm-guard, else ~/.cache/slurm-guard) and loaded
  with ctypes. The build is keyed by source, flags and CPU, so a shared home directory never
  hands one node's -march=native build to a different CPU. It runs on
  contiguous CPU tensors; large tensors are split across `torch.get_num_threads()` threads
  (ctypes releases the GIL during the call).
- torch: the same function in torch integer ops, used for tensors on other devices (CUDA), when no
  compiler is available or the build fails, and when SLURM_GUARD_NATIVE=0. Slow (~0.1-0.5 GB/s)
  but correct everywhere, and since the values are identical, ranks with and without the native
  kernel still agree.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from slurm_guard.fingerprint import _DTYPE_CODES, LANES, ROW, Fingerprinter

logger = logging.getLogger(__name__)

NH_WORDS = 1024  # uint32 words per NH block
BLOCK_BYTES = 4 * NH_WORDS
BLOCKS_PER_ROW = ROW // (4 * LANES)  # each block yields LANES x 4 sixteen-bit words: 128 blocks
ROW_BYTES = BLOCKS_PER_ROW * BLOCK_BYTES  # 512 KiB of input per level-0 tree row
_PARALLEL_MIN_BYTES = 8 << 20  # below this, one thread (pool dispatch costs ~0.1 ms)
_COMPILE_TIMEOUT_S = 120
_NH_SEED_TAG = b"slurm-guard NH keys v1"

_C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NH_WORDS 1024
#define BLOCK_BYTES (4 * NH_WORDS)
#define ROW 1024
#define LANES 2
#define BLOCKS_PER_ROW (ROW / (4 * LANES))
#define PRIME 2147483647ULL
#define MAX_LEVELS 8

/* NH of one full 4 KiB block in both lanes. Unaligned loads: a byte tensor may start anywhere. */
static void nh_block(const uint8_t *p, const uint32_t *k0, const uint32_t *k1, uint64_t out[2]) {
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    for (int i = 0; i < NH_WORDS; i += 32) {
        __m512i m = _mm512_loadu_si512((const void *)(p + 4 * i));
        __m512i n = _mm512_loadu_si512((const void *)(p + 4 * i + 64));
        __m512i x = _mm512_add_epi32(m, _mm512_loadu_si512((const void *)(k0 + i)));
        __m512i y = _mm512_add_epi32(m, _mm512_loadu_si512((const void *)(k1 + i)));
        __m512i u = _mm512_add_epi32(n, _mm512_loadu_si512((const void *)(k0 + i + 16)));
        __m512i v = _mm512_add_epi32(n, _mm512_loadu_si512((const void *)(k1 + i + 16)));
        a0 = _mm512_add_epi64(a0, _mm512_mul_epu32(x, _mm512_srli_epi64(x, 32)));
        a1 = _mm512_add_epi64(a1, _mm512_mul_epu32(y, _mm512_srli_epi64(y, 32)));
        b0 = _mm512_add_epi64(b0, _mm512_mul_epu32(u, _mm512_srli_epi64(u, 32)));
        b1 = _mm512_add_epi64(b1, _mm512_mul_epu32(v, _mm512_srli_epi64(v, 32)));
    }
    out[0] = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, b0));
    out[1] = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a1, b1));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_setzero_si256();
    for (int i = 0; i < NH_WORDS; i += 16) {
        __m256i m = _mm256_loadu_si256((const __m256i *)(p + 4 * i));
        __m256i n = _mm256_loadu_si256((const __m256i *)(p + 4 * i + 32));
        __m256i x = _mm256_add_epi32(m, _mm256_loadu_si256((const __m256i *)(k0 + i)));
        __m256i y = _mm256_add_epi32(m, _mm256_loadu_si256((const __m256i *)(k1 + i)));
        __m256i u = _mm256_add_epi32(n, _mm256_loadu_si256((const __m256i *)(k0 + i + 8)));
        __m256i v = _mm256_add_epi32(n, _mm256_loadu_si256((const __m256i *)(k1 + i + 8)));
        a0 = _mm256_add_epi64(a0, _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32)));
        a1 = _mm256_add_epi64(a1, _mm256_mul_epu32(y, _mm256_srli_epi64(y, 32)));
        b0 = _mm256_add_epi64(b0, _mm256_mul_epu32(u, _mm256_srli_epi64(u, 32)));
        b1 = _mm256_add_epi64(b1, _mm256_mul_epu32(v, _mm256_srli_epi64(v, 32)));
    }
    uint64_t s[4], t[4];
    _mm256_storeu_si256((__m256i *)s, _mm256_add_epi64(a0, b0));
    _mm256_storeu_si256((__m256i *)t, _mm256_add_epi64(a1, b1));
    out[0] = s[0] + s[1] + s[2] + s[3];
    out[1] = t[0] + t[1] + t[2] + t[3];
#else
    uint64_t s0 = 0, s1 = 0;
    for (int i = 0; i < NH_WORDS; i += 2) {
        uint32_t m0, m1;
        memcpy(&m0, p + 4 * i, 4);
        memcpy(&m1, p + 4 * i + 4, 4);
        s0 += (uint64_t)(uint32_t)(m0 + k0[i]) * (uint64_t)(uint32_t)(m1 + k0[i + 1]);
        s1 += (uint64_t)(uint32_t)(m0 + k1[i]) * (uint64_t)(uint32_t)(m1 + k1[i + 1]);
    }
    out[0] = s0;
    out[1] = s1;
#endif
}

/* Level-0 tree rows [row_begin, row_end): NH of the row's blocks, split into 16-bit words,
   hashed with level-0 coefficients. Blocks past the end contribute zero words (tree padding). */
int sg_rows(const uint8_t *data, int64_t nbytes, int64_t row_begin, int64_t row_end,
            const uint32_t *keys, const int64_t *coeffs, int64_t *rows) {
    int64_t nblocks = nbytes > 0 ? (nbytes + BLOCK_BYTES - 1) / BLOCK_BYTES : 1;
    const uint32_t *k0 = keys, *k1 = keys + NH_WORDS;
    uint8_t tail[BLOCK_BYTES];
    for (int64_t r = row_begin; r < row_end; r++) {
        uint64_t acc0 = 0, acc1 = 0;
        int64_t first = r * BLOCKS_PER_ROW;
        int64_t last = first + BLOCKS_PER_ROW < nblocks ? first + BLOCKS_PER_ROW : nblocks;
        for (int64_t b = first; b < last; b++) {
            uint64_t h[2];
            int64_t off = b * BLOCK_BYTES;
            if (off + BLOCK_BYTES <= nbytes) {
                nh_block(data + off, k0, k1, h);
            } else {
                memset(tail, 0, BLOCK_BYTES);
                if (nbytes > off) memcpy(tail, data + off, (size_t)(nbytes - off));
                nh_block(tail, k0, k1, h);
            }
            const int64_t *c = coeffs + (b - first) * 4 * LANES * LANES;
            for (int lane = 0; lane < LANES; lane++) {
                for (int w = 0; w < 4; w++) {
                    uint64_t word = (h[lane] >> (16 * w)) & 0xFFFF;
                    acc0 += word * (uint64_t)c[0];
                    acc1 += word * (uint64_t)c[1];
                    c += LANES;
                }
            }
        }
        rows[2 * r] = (int64_t)(acc0 % PRIME);
        rows[2 * r + 1] = (int64_t)(acc1 % PRIME);
    }
    return 0;
}

/* One tree level over 16-bit words: words[i] for i < n, zero after; out gets ceil(n/ROW) rows. */
static int64_t compress(const int64_t *words, int64_t n, const int64_t *c, int64_t *out) {
    int64_t nrows = (n + ROW - 1) / ROW;
    if (nrows == 0) nrows = 1;
    for (int64_t r = 0; r < nrows; r++) {
        uint64_t acc0 = 0, acc1 = 0;
        for (int64_t j = 0; j < ROW && r * ROW + j < n; j++) {
            uint64_t w = (uint64_t)words[r * ROW + j];
            acc0 += w * (uint64_t)c[2 * j];
            acc1 += w * (uint64_t)c[2 * j + 1];
        }
        out[2 * r] = (int64_t)(acc0 % PRIME);
        out[2 * r + 1] = (int64_t)(acc1 % PRIME);
    }
    return nrows;
}

/* Levels 1.. of the tree over the level-0 rows, then the tail level: out[2]. 0 ok, -1 no memory,
   -2 more levels than coefficients. */
int sg_finish(const int64_t *rows, int64_t nrows, const int64_t *coeffs, const int64_t *tailv,
              int64_t ntail, int64_t *out) {
    int64_t cap = 2 * LANES * nrows + 3 * ntail + LANES * 2 + 8;
    int64_t *words = malloc(sizeof(int64_t) * cap);
    int64_t *vals = malloc(sizeof(int64_t) * (LANES * nrows + LANES));
    if (!words || !vals) { free(words); free(vals); return -1; }
    memcpy(vals, rows, sizeof(int64_t) * LANES * nrows);
    int level = 0;
    while (nrows > 1) {
        level++;
        if (level >= MAX_LEVELS) { free(words); free(vals); return -2; }
        int64_t n = 0;
        for (int64_t i = 0; i < LANES * nrows; i++) {
            words[n++] = vals[i] & 0xFFFF;
            words[n++] = vals[i] >> 16;
        }
        nrows = compress(words, n, coeffs + (int64_t)level * ROW * LANES, vals);
    }
    int64_t n = 0;
    for (int i = 0; i < LANES; i++) {
        words[n++] = vals[i] & 0xFFFF;
        words[n++] = vals[i] >> 16;
    }
    for (int64_t i = 0; i < ntail; i++) {
        uint64_t v = (uint64_t)tailv[i];
        words[n++] = (int64_t)(v & 0xFFFF);
        words[n++] = (int64_t)((v >> 16) & 0xFFFF);
        words[n++] = (int64_t)((v >> 32) & 0xFFFF);
    }
    compress(words, n, coeffs + (int64_t)(MAX_LEVELS - 1) * ROW * LANES, out);
    free(words);
    free(vals);
    return 0;
}

/* The whole fingerprint in one call (small and medium tensors). */
int sg_fingerprint(const uint8_t *data, int64_t nbytes, const uint32_t *keys,
                   const int64_t *coeffs, const int64_t *tailv, int64_t ntail, int64_t *out) {
    int64_t nblocks = nbytes > 0 ? (nbytes + BLOCK_BYTES - 1) / BLOCK_BYTES : 1;
    int64_t nrows = (nblocks + BLOCKS_PER_ROW - 1) / BLOCKS_PER_ROW;
    int64_t local[2 * 16];
    int64_t *rows = nrows <= 16 ? local : malloc(sizeof(int64_t) * 2 * nrows);
    if (!rows) return -1;
    sg_rows(data, nbytes, 0, nrows, keys, coeffs, rows);
    int rc = sg_finish(rows, nrows, coeffs, tailv, ntail, out);
    if (rows != local) free(rows);
    return rc;
}
"""

_CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c99"]
_CFLAGS_PORTABLE = ["-O3", "-fPIC", "-shared", "-std=c99"]


# ---------------------------------------------------------------------------- native kernel


class _Native:
    """The compiled kernel's entry points."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fingerprint = lib.sg_fingerprint
        self.fingerprint.argtypes = [p, i64, p, p, p, i64, p]
        self.fingerprint.restype = ctypes.c_int
        self.rows = lib.sg_rows
        self.rows.argtypes = [p, i64, i64, i64, p, p, p]
        self.rows.restype = ctypes.c_int
        self.finish = lib.sg_finish
        self.finish.argtypes = [p, i64, p, p, i64, p]
        self.finish.restype = ctypes.c_int


_native_lock = threading.Lock()
_native: _Native | None = None
_native_tried = False
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def cache_dir() -> Path:
    """Where the compiled kernel lives ($SLURM_GUARD_CACHE, else the XDG cache directory)."""
    explicit = os.environ.get("SLURM_GUARD_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "slurm-guard"


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


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str, flags: list[str], target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "sg_fingerprint.c"
        src.write_text(_C_SOURCE)
        out = Path(tmp) / target.name
        try:
            proc = subprocess.run(
                [compiler, *flags, "-o", str(out), str(src)],
                capture_output=True,
                text=True,
                timeout=_COMPILE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            logger.warning("fast fingerprint: %s failed to run: %s", compiler, exc)
            return False
        if proc.returncode != 0:
            logger.warning(
                "fast fingerprint: compiling with %s %s failed: %s",
                compiler,
                " ".join(flags),
                proc.stderr[-2000:],
            )
            return False
        os.replace(out, target)  # atomic: concurrent ranks never load a half-written library
    return True


def _load_native() -> _Native | None:
    if os.environ.get("SLURM_GUARD_NATIVE", "1") == "0" or sys.byteorder != "little":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("fast fingerprint: no C compiler found; using the torch implementation")
        return None
    for flags in (_CFLAGS, _CFLAGS_PORTABLE):
        key = hashlib.sha256(
            "\0".join([_C_SOURCE, compiler, *flags, _cpu_signature()]).encode()
        ).hexdigest()[:20]
        target = cache_dir() / f"sg_fingerprint-{key}.so"
        try:
            if not target.exists() and not _build(compiler, flags, target):
                continue
            return _Native(ctypes.CDLL(str(target)), target)
        except OSError as exc:
            logger.warning("fast fingerprint: cannot build or load %s: %s", target, exc)
    logger.warning("fast fingerprint: no native kernel; using the torch implementation")
    return None


def native() -> _Native | None:
    """The compiled kernel, built on first use (cached on disk); None if it cannot be built."""
    global _native, _native_tried
    if not _native_tried:
        with _native_lock:
            if not _native_tried:
                _native = _load_native()
                _native_tried = True
    return _native


def backend() -> str:
    """'native' or 'torch': what `fast_fingerprint` uses for a contiguous CPU tensor here."""
    return "native" if native() is not None else "torch"


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _native_lock:
        if _pool is None or _pool_size < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sg-fingerprint")
            _pool_size = workers
        return _pool


# ---------------------------------------------------------------------------- keys and inputs


def nh_keys(seed: int) -> torch.Tensor:
    """[LANES, NH_WORDS] int32 NH keys (read as uint32), derived from the run's seed.

    Drawn from a generator seeded by a hash of the seed, so they are independent of the tree's
    coefficients (which `Fingerprinter` draws from the seed itself).
    """
    digest = hashlib.sha256(_NH_SEED_TAG + int(seed).to_bytes(16, "little", signed=True)).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randint(-(2**31), 2**31, (LANES, NH_WORDS), dtype=torch.int32, generator=gen)


def _shape_code(shape: torch.Size) -> int:
    code = 0
    for dim in shape:
        code = (code * 1_000_003 + int(dim)) % ((1 << 31) - 1)
    return code


def _tail(t: torch.Tensor, nbytes: int) -> list[int]:
    return [nbytes, _DTYPE_CODES.get(t.dtype, 99), _shape_code(t.shape)]


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    data = t.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    if data.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if data.dtype == torch.bool:
        data = data.view(torch.uint8)
    return data.reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------- implementations


def reference_fingerprint(
    t: torch.Tensor, fingerprinter: Fingerprinter, keys: torch.Tensor
) -> torch.Tensor:
    """The fast fingerprint in torch integer ops, on t's device: the specification and fallback.

    Products are formed from 16-bit halves so that every intermediate stays exact in int64.
    """
    raw = _raw_bytes(t)
    nbytes = raw.numel()
    device = raw.device
    nblocks = max(1, -(-nbytes // BLOCK_BYTES))
    padded = torch.nn.functional.pad(raw, (0, nblocks * BLOCK_BYTES - nbytes))
    m = padded.view(torch.int32).to(torch.int64).view(nblocks, NH_WORDS // 2, 2) & 0xFFFFFFFF
    k = keys.to(device=device, dtype=torch.int64) & 0xFFFFFFFF  # [LANES, NH_WORDS]
    words = []
    for lane in range(LANES):
        kl = k[lane].view(NH_WORDS // 2, 2)
        x = (m + kl) & 0xFFFFFFFF  # [nblocks, 512, 2], each < 2^32
        a, b = x[..., 0], x[..., 1]
        a1, a0, b1, b0 = a >> 16, a & 0xFFFF, b >> 16, b & 0xFFFF
        s0 = (a0 * b0).sum(dim=1)  # each term < 2^32, 512 terms: < 2^41
        s1 = (a1 * b0 + a0 * b1).sum(dim=1)
        s2 = (a1 * b1).sum(dim=1)
        low = s0 + ((s1 & 0xFFFF) << 16)
        lo32 = low & 0xFFFFFFFF
        hi32 = ((low >> 32) + (s1 >> 16) + s2) & 0xFFFFFFFF  # NH mod 2^64 = hi32:lo32
        words.append(torch.stack([lo32 & 0xFFFF, lo32 >> 16, hi32 & 0xFFFF, hi32 >> 16], dim=1))
    flat = torch.stack(words, dim=1).reshape(-1)  # block-major, then lane, then word
    return fingerprinter._reduce(flat, _tail(t, nbytes))


def _native_fingerprint(
    t: torch.Tensor, kernel: _Native, coeffs_ptr: int, keys_ptr: int
) -> torch.Tensor:
    data = t.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    nbytes = data.numel() * data.element_size()
    ptr = data.data_ptr() if nbytes else 0
    tail = (ctypes.c_int64 * 3)(*_tail(t, nbytes))
    out = (ctypes.c_int64 * LANES)()
    workers = torch.get_num_threads()
    if nbytes < _PARALLEL_MIN_BYTES or workers <= 1:
        rc = kernel.fingerprint(ptr, nbytes, keys_ptr, coeffs_ptr, tail, 3, out)
    else:
        nrows = -(-nbytes // ROW_BYTES)
        rows = (ctypes.c_int64 * (LANES * nrows))()
        bounds = [nrows * i // workers for i in range(workers + 1)]

        def part(i: int) -> int:
            return int(
                kernel.rows(ptr, nbytes, bounds[i], bounds[i + 1], keys_ptr, coeffs_ptr, rows)
            )

        list(_thread_pool(workers).map(part, range(workers)))
        rc = kernel.finish(rows, nrows, coeffs_ptr, tail, 3, out)
    if rc != 0:
        raise RuntimeError(f"native fingerprint kernel failed with code {rc}")
    return torch.frombuffer(out, dtype=torch.int64)  # owns `out`: fresh per call


def fast_fingerprint(
    t: torch.Tensor,
    fingerprinter: Fingerprinter,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fingerprint of t's bits, shape and dtype: an int64 [LANES] of 31-bit lanes on t's device.

    Uses the native kernel for CPU tensors when it is available, the torch implementation
    otherwise; both give the same value. `keys` defaults to `nh_keys(fingerprinter.seed)`; pass
    them in to avoid regenerating them (FastFingerprinter caches them).
    """
    if keys is None:
        keys = nh_keys(fingerprinter.seed)
    kernel = native() if t.device.type == "cpu" else None
    if kernel is None:
        return reference_fingerprint(t, fingerprinter, keys)
    keys = keys.contiguous()
    coeffs = fingerprinter._coeffs(torch.device("cpu"))
    return _native_fingerprint(t, kernel, coeffs.data_ptr(), keys.data_ptr())


class FastFingerprinter(Fingerprinter):
    """`Fingerprinter` with `tensor()` replaced by the fast fingerprint (same output format).

    `combine()` and `tensors()` are inherited: a combination of fast fingerprints is still exact
    and order-sensitive with the bound above.
    """

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self._keys = nh_keys(self.seed)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        kernel = native() if t.device.type == "cpu" else None
        if kernel is None:
            return reference_fingerprint(t, self, self._keys)
        coeffs = self._coeffs(t.device)  # cached; the tensor outlives the call
        return _native_fingerprint(t, kernel, coeffs.data_ptr(), self._keys.data_ptr())


__all__ = [
    "BLOCK_BYTES",
    "FastFingerprinter",
    "backend",
    "cache_dir",
    "fast_fingerprint",
    "native",
    "nh_keys",
    "reference_fingerprint",
]
