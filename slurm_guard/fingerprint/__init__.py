"""Exact, order-sensitive, seeded fingerprints of tensors: the one API the guard uses.

`FastFingerprinter` is what the guard runs: an NH first level over the tensor's bytes (`nh`; C on
the CPU, Triton on CUDA, torch ops elsewhere) under the multilinear tree of `tree`. `Fingerprinter`
is the tree alone, in torch ops: slower, with the same false-match bound, kept as the
specification the tests hold the fast one to. Both return an int64 [2] of two 31-bit lanes on the
tensor's device; `as_int` and `as_hex` read one on the host.
"""

from __future__ import annotations

from slurm_guard.fingerprint.nh import FastFingerprinter, backend, fast_fingerprint
from slurm_guard.fingerprint.tree import Fingerprinter, as_hex, as_int, lanes_to_int

__all__ = [
    "FastFingerprinter",
    "Fingerprinter",
    "as_hex",
    "as_int",
    "backend",
    "fast_fingerprint",
    "lanes_to_int",
]
