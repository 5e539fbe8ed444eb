"""Load every C kernel and compile every Triton kernel the guard uses, at set-up, not at step 0.

`warm_up(device)` is called once per process by the guard's set-up (and, for the C kernels, by
`python -m slurm_guard.kernels`, the sbatch template's pre-build step). What it loads is what
every later call uses: the C libraries are held by their `native.LazyKernel` (no second load,
no second compile), and Triton keeps the kernels it compiled in its in-process cache.

- C (CPU): the bucket check (`sketch.native`), the NH fingerprint level (`fingerprint.nh`)
  and the checked-GEMM passes (`abft_native.native`), each built once per node (`build`).
- Triton (CUDA, when `triton_kernels.available`): the bucket check in the three forms the hook
  and the replay launch (local bucket; averaged bucket divided by the world size; sketch only),
  the NH level (whole blocks and a ragged tail), and the checked-GEMM passes (operand passes and
  both comparisons). Triton compiles per specialization (dtype, constexprs, integers equal to 1
  or divisible by 16, the padded chunk count), so the bucket sizes, dtypes and world size passed
  in are warmed exactly; an unlisted size may still compile once on first use. The ranks of a
  node take turns under a lock: the first compiles into Triton's cache, the others load from it.
  A compile that fails turns Triton off for the process (`triton_kernels.disable`, one warning):
  the torch versions run instead, never an exception inside the comm hook.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slurm_guard.fingerprint import nh as _ff
from slurm_guard.kernels import abft_native as _abft_native
from slurm_guard.kernels import abft_triton as at
from slurm_guard.kernels import build as _build
from slurm_guard.kernels import native as _native
from slurm_guard.kernels import sketch as _sketch
from slurm_guard.kernels import triton_kernels as _tk

logger = logging.getLogger(__name__)

KERNELS: tuple[_native.LazyKernel[Any], ...] = (_sketch.native, _ff.native, _abft_native.native)
"""The guard's C kernels (what `warm_up` loads)."""

_ABFT_BLOCK = 64  # `checked.Abft.block`'s default


@dataclass(frozen=True)
class WarmUpReport:
    """What `warm_up` loaded, for one log line (`summary()`).

    native: C source -> 'built' (compiled by this process), 'cached' (built before, on this
    node or by a rank it waited for), 'torch' (could not be built: the torch version runs) or
    'off' (SLURM_GUARD_NATIVE=0). triton: 'compiled', 'interpreted' (TRITON_INTERPRET=1),
    'not used' (not a CUDA device) or 'off: <why>' (the torch version runs on CUDA).
    triton_variants: the kernel variants compiled. seconds: the warm-up's wall time.
    """

    device: str
    native: dict[str, str] = field(default_factory=dict)
    triton: str = "not used"
    triton_variants: tuple[str, ...] = ()
    seconds: float = 0.0

    def summary(self) -> str:
        c = ", ".join(f"{name} {how}" for name, how in self.native.items())
        t = self.triton
        if self.triton_variants:
            t += f" ({len(self.triton_variants)} variants)"
        return f"kernels on {self.device}: C: {c}; Triton: {t}; {self.seconds:.2f} s"


def warm_up(
    device: torch.device | None = None,
    *,
    bucket_numels: Sequence[int] = (),
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    world_size: int = 1,
) -> WarmUpReport:
    """Load the C kernels and, on a CUDA `device`, compile the Triton kernels, once.

    Args:
        device: the rank's device (None: the C kernels only).
        bucket_numels: element counts of the DDP buckets (and any tensor the replay checks), so
            that their Triton specializations compile now; a small bucket is always warmed.
        dtypes: the gradient dtypes of those buckets.
        world_size: what the averaged bucket is divided by in the comm hook.

    Returns:
        What was loaded, compiled or fell back (never raises for a kernel that cannot be
        built: the guard then runs the torch version, with a warning).
    """
    start = time.monotonic()
    native = {kernel.source: _native_state(kernel) for kernel in KERNELS}
    triton = "not used"
    variants: tuple[str, ...] = ()
    if device is not None and device.type == "cuda":
        if _tk.available(device):
            variants = warm_triton(device, bucket_numels, dtypes, world_size)
            triton = "compiled" if _tk.available(device) else "off: a kernel failed to compile"
        else:
            triton = "off: " + ("Triton not installed" if not _tk._import_triton() else "see log")
    report = WarmUpReport(str(device or "cpu"), native, triton, variants, time.monotonic() - start)
    logger.info("%s", report.summary())
    return report


def _native_state(kernel: _native.LazyKernel[Any]) -> str:
    if not _native.enabled():
        return "off"
    if kernel() is None or kernel.library is None:
        return "torch"
    return _native.how_loaded(kernel.library)


def warm_triton(
    device: torch.device,
    bucket_numels: Sequence[int] = (),
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    world_size: int = 1,
) -> tuple[str, ...]:
    """Launch every Triton kernel the guard uses once on `device` (CUDA; a CPU device under
    TRITON_INTERPRET=1 runs the same launches interpreted, which is how CI tests this). Returns
    the variants launched; a failure disables Triton for the process and returns those before."""
    done: list[str] = []
    try:
        path = _build.ensure_cache_dir() / "triton-warm.lock"
    except OSError:
        path = None
    try:
        if path is None:
            _launch_all(device, bucket_numels, dtypes, world_size, done)
        else:
            with _build.file_lock(path):  # one rank of the node compiles, the others then load
                _launch_all(device, bucket_numels, dtypes, world_size, done)
    except Exception as exc:  # a compile error, a missing ptxas: the torch versions run instead
        _tk.disable(f"warming {done[-1] if done else 'the first kernel'} failed: {exc!r}")
    return tuple(done)


def _specialization(n: int) -> tuple[int, bool, bool]:
    """What of a bucket's size Triton compiles into a kernel (plus its padded chunk count)."""
    chunks, padded = _sketch.padded_chunks(n)
    return (padded if padded <= _tk._FINISH_MAX else -1), n % 16 == 0, chunks == 1


def _launch_all(
    device: torch.device,
    bucket_numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    world_size: int,
    done: list[str],
) -> None:
    words = _sketch.seed_words(0)
    sizes: dict[tuple[int, bool, bool], int] = {}
    for n in (2 * _sketch.CHUNK, *bucket_numels):
        sizes.setdefault(_specialization(n), n)
    divisors = sorted({1, world_size} if world_size > 1 else {1})
    for dtype in dtypes:
        for n in sizes.values():
            for l1, divide_by in ((True, 1), (False, 1), *((False, d) for d in divisors[1:])):
                if divide_by > 1 and dtype not in _sketch.DIVIDABLE:
                    continue
                x = torch.ones(n, dtype=dtype, device=device)
                _tk.triton_check(x, words, l1=l1, divide_by=divide_by)
                done.append(f"bucket_check({dtype}, n={n}, l1={l1}, divide_by={divide_by})")
    keys = _ff.nh_keys(0).to(device)
    raw = torch.zeros(3 * _ff.BLOCK_BYTES + 100, dtype=torch.uint8, device=device)
    _tk.nh_blocks(raw, keys, _ff.NH_WORDS)  # whole blocks, then the ragged tail
    done.append("nh_blocks")
    _warm_abft(device, done)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_abft(device: torch.device, done: list[str]) -> None:
    n, d, block = 2 * _ABFT_BLOCK, 64, _ABFT_BLOCK
    a = torch.ones(n, d, dtype=torch.float32, device=device)
    row_sign = torch.ones(n, dtype=torch.float32, device=device)
    col_sign = torch.ones(d, dtype=torch.float32, device=device)
    st = at.stats(a, block, row_sign, col_sign)
    done.append("abft stats")
    assert st.rows is not None and st.a_sq is not None and st.s_sq is not None
    f = at.factors_on((1.0, 1.0, 1.0, 1.0, 1.0), device)  # the values compile nothing
    m_sq = torch.ones(d, dtype=torch.float64, device=device)
    bias = torch.zeros(d, dtype=torch.float32, device=device)
    for b in (None, bias):
        at.compare(a, block, row_sign, st.rows, b, st.a_sq, st.s_sq, m_sq, f)
    done.append("abft compare")
    assert st.cols is not None and st.ca_sq is not None and st.cs_sq is not None
    pred = torch.zeros(-(-d // block), n, dtype=torch.float32, device=device)
    m_sq_rows = torch.ones(n, dtype=torch.float64, device=device)
    at.compare_transposed(a, block, col_sign, pred, st.ca_sq, st.cs_sq, m_sq_rows, f)
    done.append("abft compare_transposed")


__all__ = ["KERNELS", "WarmUpReport", "warm_triton", "warm_up"]
