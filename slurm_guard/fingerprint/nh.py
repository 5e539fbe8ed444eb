"""A fast exact fingerprint: one pass over the tensor's bytes, near memory bandwidth on CPU.

Tensors in DRAM hash at 0.7-1.0x of a float32 `sum()` over the same bytes; cache-resident ones
(~4 MB) at most ~0.7x, bound by the vector ALU work two NH lanes need (16 ops per 64 bytes with
AVX2; the analysis and figures are in the header of kernels/nh_fingerprint.c).

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
- native: the C kernel `slurm_guard/kernels/nh_fingerprint.c` (AVX-512 or AVX2 when the compiler
  targets them, scalar otherwise), built and cached by `slurm_guard.kernels.native` and loaded
  with ctypes. It runs on contiguous CPU tensors; large tensors are split across
  `torch.get_num_threads()` threads (ctypes releases the GIL during the call).
- triton: the NH level in `slurm_guard.kernels.triton_kernels.nh_blocks`, then the same torch-op
  tree, for CUDA tensors when Triton is installed (the `gpu` extra; CUDA torch brings it).
- torch: the same function in torch integer ops, used for tensors on other devices without
  Triton, when no compiler is available or the build fails, and when SLURM_GUARD_NATIVE=0. Slow
  (~0.1-0.5 GB/s) but correct everywhere, and since the values are identical, ranks with and
  without the native kernel still agree.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch

from slurm_guard.fingerprint.tree import _DTYPE_CODES, LANES, MAX_LEVELS, PRIME, ROW, Fingerprinter
from slurm_guard.kernels import native as _kernels
from slurm_guard.kernels.native import cache_dir

NH_WORDS = 1024  # uint32 words per NH block
BLOCK_BYTES = 4 * NH_WORDS
BLOCKS_PER_ROW = ROW // (4 * LANES)  # each block yields LANES x 4 sixteen-bit words: 128 blocks
ROW_BYTES = BLOCKS_PER_ROW * BLOCK_BYTES  # 512 KiB of input per level-0 tree row
_PARALLEL_MIN_BYTES = 8 << 20  # below this, one thread (pool dispatch costs ~0.1 ms)
# From this size on the kernel assumes the tensor streams from DRAM and uses the loop form that
# is faster there (half of a 32 MB L3; see kernels/nh_fingerprint.c). Same output either way.
STREAM_MIN_BYTES = 16 << 20
C_SOURCE = "nh_fingerprint.c"  # in slurm_guard/kernels/, shipped as package data
_NH_SEED_TAG = b"slurm-guard NH keys v1"


def kernel_defines() -> dict[str, int]:
    """The constants the C source needs, passed with -D (defined once, here and in fingerprint)."""
    return {
        "NH_WORDS": NH_WORDS,
        "ROW": ROW,
        "LANES": LANES,
        "PRIME": PRIME,
        "MAX_LEVELS": MAX_LEVELS,
        "STREAM_MIN_BYTES": STREAM_MIN_BYTES,
    }


# ---------------------------------------------------------------------------- native kernel


class _Native:
    """The compiled kernel's entry points."""

    def __init__(self, lib: ctypes.CDLL) -> None:
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


native = _kernels.LazyKernel(C_SOURCE, kernel_defines, _Native)
"""The compiled kernel, built on first use (cached on disk); None if it cannot be built."""


def backend() -> str:
    """'native' or 'torch': what `fast_fingerprint` uses for a contiguous CPU tensor here."""
    return "native" if native() is not None else "torch"


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


_Tail = ctypes.c_int64 * 3
_tail_cache: dict[tuple[torch.dtype, torch.Size], ctypes.Array[ctypes.c_int64]] = {}
_TAIL_CACHE_MAX = 4096  # distinct (dtype, shape) pairs; a model has a few hundred


def _native_tail(t: torch.Tensor) -> ctypes.Array[ctypes.c_int64]:
    """`_tail` as the C array the kernel reads, cached per (dtype, shape): the guard hashes the
    same parameters every step, and building it costs a few microseconds (a tenth of a 1 MB
    tensor's kernel time). The arrays are never written, so sharing them is safe."""
    key = (t.dtype, t.shape)
    tail = _tail_cache.get(key)
    if tail is None:
        if len(_tail_cache) >= _TAIL_CACHE_MAX:
            _tail_cache.clear()
        tail = _tail_cache.setdefault(key, _Tail(*_tail(t, t.numel() * t.element_size())))
    return tail


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


def nh_words(nh: torch.Tensor) -> torch.Tensor:
    """int64 [nblocks, LANES] NH values (bits of uint64) -> the tree's 16-bit words, in the
    reference's order (block-major, then lane, then low to high)."""
    lo32 = nh & 0xFFFFFFFF
    hi32 = (nh >> 32) & 0xFFFFFFFF
    return torch.stack([lo32 & 0xFFFF, lo32 >> 16, hi32 & 0xFFFF, hi32 >> 16], dim=2).reshape(-1)


def triton_fingerprint(
    t: torch.Tensor, fingerprinter: Fingerprinter, keys: torch.Tensor
) -> torch.Tensor:
    """The fast fingerprint with the NH level in Triton (CUDA, or CPU under the interpreter)."""
    from slurm_guard.kernels.triton_kernels import nh_blocks

    raw = _raw_bytes(t)
    nh = nh_blocks(raw, keys, NH_WORDS)
    return fingerprinter._reduce(nh_words(nh), _tail(t, raw.numel()))


def _use_triton(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    from slurm_guard.kernels import triton_kernels

    return triton_kernels.available(t.device)


def _native_fingerprint(
    t: torch.Tensor, kernel: _Native, coeffs_ptr: int, keys_ptr: int
) -> torch.Tensor:
    # No detach(): only the pointer is read, and detach() alone costs about a microsecond.
    data = t if t.is_contiguous() else t.detach().contiguous()
    nbytes = data.nbytes
    ptr = data.data_ptr() if nbytes else 0
    tail = _native_tail(t)
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

        list(_kernels.thread_pool(workers).map(part, range(workers)))
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
    if _use_triton(t):
        return triton_fingerprint(t, fingerprinter, keys)
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
        self._device_keys: dict[torch.device, torch.Tensor] = {}
        self._cpu_coeffs: torch.Tensor | None = None  # held here: the kernel gets its pointer

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        # The CPU path first, with no torch.device objects built per call: at 1 MB the Python
        # around the kernel call was ~10% of its time.
        if t.is_cpu:
            kernel = native()
            if kernel is None:
                return reference_fingerprint(t, self, self._keys)
            coeffs = self._cpu_coeffs
            if coeffs is None:
                coeffs = self._cpu_coeffs = self._coeffs(torch.device("cpu"))
            return _native_fingerprint(t, kernel, coeffs.data_ptr(), self._keys.data_ptr())
        if _use_triton(t):
            keys = self._device_keys.get(t.device)
            if keys is None:
                keys = self._device_keys.setdefault(t.device, self._keys.to(t.device))
            return triton_fingerprint(t, self, keys)
        return reference_fingerprint(t, self, self._keys)


__all__ = [
    "BLOCK_BYTES",
    "FastFingerprinter",
    "backend",
    "cache_dir",
    "fast_fingerprint",
    "native",
    "nh_keys",
    "reference_fingerprint",
    "triton_fingerprint",
]
