"""The fused bucket check: sketch, L1 norm and finite flag of a gradient bucket in one read.

Why fused: the hook needs, per bucket and per step, S = <g, r> with a shared random +-1 vector r
and A = ||g||_1 (which bounds S's rounding), both in float64. As separate torch ops that is a
stored sign vector, a temporary `g * r` and two float64-accumulating reductions, which on CPU run
at a tenth of a float32 `sum`. Here the signs come from a counter-based hash of (seed, element
index), so nothing is stored, and one pass forms both sums.

Definition (every implementation returns these bits; tested):
- Signs: element e gets -1 iff bit (e mod 32) of H(e >> 5) is set, where, on 32-bit words,
  H(w) = mix(mix(w ^ s0) ^ s1), mix(x) = the finaliser x ^= x >> 16; x *= MIX_M1; x ^= x >> 15;
  x *= MIX_M2; x ^= x >> 16 (mod 2^32), w taken mod 2^32, and (s0, s1) derived from the run seed.
- Values: each element converted exactly to float64; the input is padded with +0.0 to whole
  chunks of CHUNK = 2^CHUNK_LOG2 elements (at least one chunk) and signed (a sign-bit flip,
  exact) over the padded length.
- Order: each chunk is summed by the halving tree (v_i <- v_i + v_{i+h} for h = CHUNK/2, ..., 1),
  separately for the signed values (S) and the absolute values (A); the chunk sums, padded with
  +0.0 to a power of two, by the same tree. Output: float64 [S, A, nonfinite], nonfinite = 1.0
  when A is NaN or infinite (for float32/float16/bfloat16 inputs: iff some element is, since
  a float64 sum of their magnitudes cannot overflow), else 0.0.
Sketch only (`l1=False`, for the averaged bucket, whose rounding the local buckets' L1 norms
already bound): A is not formed (a quarter of the arithmetic), S has the same bits, and the
output is [S, 0.0, nonfinite] with nonfinite = 1.0 when S is NaN or infinite (for
float32/float16/bfloat16 inputs again iff some element is: signing is exact and the float64 sum
cannot overflow).
Divided (`divide_by` = the world size, for the averaged float32/float64 bucket): the bucket is
first divided in place by IEEE division (`divide`), then checked as above; the C and Triton
kernels divide each chunk and check it in one read of the bucket.
The order does not depend on threads or devices, so the averaged bucket's sketch has the same
bits on every rank that holds the same averaged bucket, whichever implementation each rank runs
(C, torch, Triton) and however many threads it uses: the cross-rank comparison is safe.

Rounding (for `verdicts.conservation_bound`): a halving tree over N leaves has depth
ceil(log2 N); adding an exact zero is exact, so a leaf meets at most ceil(log2 n) + 1 rounded
additions for an n-element bucket (the padded zeros and empty subtrees add none), and
|S - <x, r>| <= d u64 A (1 + O(u64)), d = bit_length(n) + 1 >= ceil(log2 n) + 1, u64 = 2^-53.

Implementations (`kernels.bucket.bucket_check` picks one): `reference_check` (torch ops, any
device; the specification), `native_check` (`bucket_check.c`, CPU, split over
`torch.get_num_threads()` threads by whole chunks) and
`slurm_guard.kernels.triton_kernels.triton_check` (CUDA, and CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import ctypes
import hashlib

import torch

from slurm_guard.kernels import native as _kernels
from slurm_guard.kernels.inputs import plain

CHUNK_LOG2 = 12
CHUNK = 1 << CHUNK_LOG2  # elements per chunk: 16 KiB of float32
MIX_M1 = 0x7FEB352D
MIX_M2 = 0x846CA68B
C_SOURCE = "bucket_check.c"
_PARALLEL_MIN_ELEMENTS = 2 << 20  # below this, one thread (pool dispatch costs ~0.1 ms)
_SEED_TAG = b"slurm-guard sketch signs v1"
DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
DIVIDABLE = (torch.float32, torch.float64)  # 16-bit buckets are divided before the reduction
MAX_DIVISOR = 1 << 24  # exact in float32: the in-place division is one IEEE operation
_MASK32 = 0xFFFFFFFF
_SIGN_SLAB_WORDS = 1 << 16  # 2M signs per slab: 16 MiB of int64 temporaries


def kernel_defines() -> dict[str, int]:
    return {"CHUNK_LOG2": CHUNK_LOG2, "MIX_M1": MIX_M1, "MIX_M2": MIX_M2}


def seed_words(seed: int) -> tuple[int, int]:
    """(s0, s1): the two 32-bit words of the sign hash, derived from the run's seed."""
    digest = hashlib.sha256(_SEED_TAG + int(seed).to_bytes(16, "little", signed=True)).digest()
    return int.from_bytes(digest[0:4], "little"), int.from_bytes(digest[4:8], "little")


def padded_chunks(n: int) -> tuple[int, int]:
    """(chunks, chunks padded to a power of two) for an n-element bucket."""
    chunks = max(1, -(-n // CHUNK))
    return chunks, 1 << (chunks - 1).bit_length()


# ---------------------------------------------------------------------------- the specification


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) held in int64, without int64 overflow."""
    low = x * (c & 0xFFFF)  # < 2^48
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_M2)
    return x ^ (x >> 16)


def sign_bits(n: int, words: tuple[int, int], device: torch.device) -> torch.Tensor:
    """bool [n]: True where element e of a bucket is multiplied by -1."""
    s0, s1 = words
    nwords = -(-n // 32)
    shifts = torch.arange(32, dtype=torch.int64, device=device)
    out = torch.empty(nwords * 32, dtype=torch.bool, device=device)
    for start in range(0, nwords, _SIGN_SLAB_WORDS):  # bound the int64 temporaries
        stop = min(start + _SIGN_SLAB_WORDS, nwords)
        w = torch.arange(start, stop, dtype=torch.int64, device=device) & _MASK32
        h = _mix32(_mix32(w ^ s0) ^ s1)
        out[start * 32 : stop * 32] = ((h.unsqueeze(1) >> shifts) & 1).reshape(-1).bool()
    return out[:n]


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Halving-tree sum over the last dimension (a power of two), in the definition's order."""
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


def reference_check(
    bucket: torch.Tensor, words: tuple[int, int], *, l1: bool = True
) -> torch.Tensor:
    """float64 [S, A, nonfinite] on the bucket's device, in torch ops: the specification.

    l1=False: [S, 0.0, nonfinite of S] (the sketch-only variant defined above).
    """
    flat = bucket.detach().reshape(-1)
    chunks, padded = padded_chunks(flat.numel())
    v = torch.nn.functional.pad(flat.double(), (0, chunks * CHUNK - flat.numel()))
    signed = torch.where(sign_bits(v.numel(), words, v.device), -v, v)
    parts = torch.stack([signed, v.abs()] if l1 else [signed]).view(-1, chunks, CHUNK)
    parts = tree_sum(parts)  # [2 or 1, chunks]
    totals = tree_sum(torch.nn.functional.pad(parts, (0, padded - chunks)))
    if not l1:
        totals = torch.cat([totals, totals.new_zeros(1)])
    nonfinite = (~torch.isfinite(totals[1:2] if l1 else totals[0:1])).double()
    return torch.cat([totals, nonfinite])


def check_divisor(divisor: int, bucket: torch.Tensor | None = None) -> None:
    """Refuse what the in-place division cannot do exactly; with `bucket`, also what the fused
    kernels cannot divide in place (they write the quotient back where they read)."""
    if not 1 <= divisor <= MAX_DIVISOR:
        raise ValueError(f"divisor {divisor} is outside [1, {MAX_DIVISOR}]")
    in_place = bucket is None or (bucket.is_contiguous() and bucket.dtype in DIVIDABLE)
    if divisor > 1 and not in_place:
        raise ValueError("in-place division needs a contiguous float32 or float64 bucket")


def divide(bucket: torch.Tensor, divisor: int) -> None:
    """bucket /= divisor in place, IEEE division on every device: by a 0-dim tensor of the
    bucket's dtype on its device (no host sync), because a Python scalar divisor lets CUDA
    multiply by a rounded reciprocal instead."""
    check_divisor(divisor)
    if divisor > 1:
        bucket.div_(torch.full((), divisor, dtype=bucket.dtype, device=bucket.device))


# ---------------------------------------------------------------------------- native kernel


class _Native:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, u32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int
        self.check = lib.sg_check
        self.check.argtypes = [p, i32, i64, u32, u32, p, i64, p, i32, i64]
        self.check.restype = ctypes.c_int
        self.chunks = lib.sg_check_chunks
        self.chunks.argtypes = [p, i32, i64, i64, i64, u32, u32, p, p, i32, i64]
        self.chunks.restype = ctypes.c_int
        self.finish = lib.sg_check_finish
        self.finish.argtypes = [p, p, i64, p, i32]
        self.finish.restype = None


native = _kernels.LazyKernel(C_SOURCE, kernel_defines, _Native)
"""The compiled kernel, built on first use (cached on disk); None if it cannot be built."""


def native_check(
    kernel: _Native,
    bucket: torch.Tensor,
    words: tuple[int, int],
    threads: int | None = None,
    *,
    l1: bool = True,
    divide_by: int = 1,
) -> torch.Tensor:
    """The C kernel on a CPU tensor of a supported dtype; same bits as `reference_check`.

    divide_by > 1: divides the bucket in place first (float32/float64, contiguous), in the same
    read; the bits of `divide(bucket, divide_by)` followed by `reference_check`.
    """
    plain("sketch.native_check", bucket, cpu=True)
    data = bucket.detach()
    check_divisor(divide_by, data)
    if not data.is_contiguous():
        data = data.contiguous()
    n = data.numel()
    chunks, padded = padded_chunks(n)
    dtype = DTYPES[data.dtype]
    ptr = data.data_ptr() if n else 0
    out = torch.empty(3, dtype=torch.float64)
    workers = min(threads or torch.get_num_threads(), chunks)
    rows = 2 if l1 else 1
    s0, s1 = words
    if n < _PARALLEL_MIN_ELEMENTS or workers <= 1:
        scratch = (ctypes.c_double * (rows * padded))()
        rc = kernel.check(
            ptr, dtype, n, s0, s1, scratch, padded, out.data_ptr(), int(l1), divide_by
        )
    else:
        partials = torch.zeros(rows, padded, dtype=torch.float64)
        ps, pa = partials[0].data_ptr(), (partials[1].data_ptr() if l1 else None)
        bounds = [chunks * i // workers for i in range(workers + 1)]

        def part(i: int) -> int:
            lo, hi = bounds[i], bounds[i + 1]
            return int(kernel.chunks(ptr, dtype, n, lo, hi, s0, s1, ps, pa, int(l1), divide_by))

        rc = max(_kernels.thread_pool(workers).map(part, range(workers)))
        kernel.finish(ps, pa, padded, out.data_ptr(), int(l1))
    if rc != 0:
        raise RuntimeError(f"native bucket-check kernel failed with code {rc}")
    return out
