"""Exact, order-sensitive fingerprints of tensors, computed where the tensor lives.

Why not `torch.hash_tensor` or a checksum: XOR-style hashes ignore element order and two equal
bit flips cancel. We need "these two gradients are bit-identical", with a false-match
probability we can state.

Construction: a tree of multilinear hashes over the prime P = 2^31 - 1.
- The tensor's bytes are read as 16-bit words (each < P, so reading them mod P loses nothing).
- Words are cut into rows of L = 1024; each row hashes to sum_j w_j * c_j mod P, with
  coefficients c_j drawn uniformly from [0, P) by a per-run seed (a fresh, independent vector per
  tree level). Products stay below 2^47 and a row sum below 2^57: exact in int64.
- Row hashes (31 bits) are split into 16-bit words again and hashed by the next level until one
  value is left; the tensor's length and dtype are hashed in at the end.
- Two lanes with independent coefficients make a 62-bit fingerprint.

False-match bound: for two different inputs, one level collides with probability <= 1/P over the
choice of coefficients (multilinear hashing is universal), and a tree of d levels with
probability <= d/P. Lanes are independent, so for d <= 5 (inputs up to 2^45 bytes)
Pr[false match] <= (5/P)^2 < 6e-18 per comparison. The seed is random per run, so no fixed pair of
inputs collides in every run.

The implementation is plain torch integer ops (CPU and CUDA alike). It is correct first; the
benchmarks measure its bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

PRIME = (1 << 31) - 1
ROW = 1024
LANES = 2
MAX_LEVELS = 8
_SLAB_ROWS = 4096  # bound the int64 working set: 4096 x 1024 words = 32 MiB at a time

_DTYPE_CODES: dict[torch.dtype, int] = {
    dt: i + 1
    for i, dt in enumerate(
        [
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        ]
    )
}


class Fingerprinter:
    """Fingerprints tensors under one run's seed; coefficients are cached per device."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._coefficients: dict[torch.device, torch.Tensor] = {}

    def _coeffs(self, device: torch.device) -> torch.Tensor:
        """[levels, ROW, LANES] int64 coefficients, identical on every rank with the same seed."""
        cached = self._coefficients.get(device)
        if cached is None:
            gen = torch.Generator().manual_seed(self.seed)
            cpu = torch.randint(0, PRIME, (MAX_LEVELS, ROW, LANES), generator=gen)
            cached = cpu.to(device)
            self._coefficients[device] = cached
        return cached

    def _compress(self, words: torch.Tensor, level: int) -> torch.Tensor:
        """One tree level: 16-bit words [n] -> row hashes [ceil(n/ROW), LANES] in [0, P)."""
        coeffs = self._coeffs(words.device)[level]
        pad = (-words.numel()) % ROW
        if pad:
            words = torch.nn.functional.pad(words, (0, pad))
        rows = words.view(-1, ROW)
        out = []
        for start in range(0, rows.shape[0], _SLAB_ROWS):
            slab = rows[start : start + _SLAB_ROWS]
            if slab.is_cuda:  # CUDA has no int64 matmul
                out.append((slab.unsqueeze(-1) * coeffs).sum(dim=1) % PRIME)
            else:
                out.append((slab @ coeffs) % PRIME)
        return torch.cat(out)

    @staticmethod
    def _split16(values: torch.Tensor) -> torch.Tensor:
        """31-bit values [m, LANES] -> 16-bit words [2 * m * LANES], lane-interleaved."""
        flat = values.reshape(-1)
        return torch.stack([flat & 0xFFFF, flat >> 16], dim=1).reshape(-1)

    def _reduce(self, words: torch.Tensor, tail: list[int]) -> torch.Tensor:
        """Hash 16-bit words down to one [LANES] value, mixing `tail` (length, dtype) in last."""
        level = 0
        hashed = self._compress(words, level)
        while hashed.shape[0] > 1:
            level += 1
            hashed = self._compress(self._split16(hashed), level)
        tail_words = torch.tensor(
            [w for v in tail for w in (v & 0xFFFF, (v >> 16) & 0xFFFF, (v >> 32) & 0xFFFF)],
            dtype=torch.int64,
            device=words.device,
        )
        final = torch.cat([self._split16(hashed), tail_words])
        return self._compress(final, MAX_LEVELS - 1)[0]

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Fingerprint of one tensor's bits, shape and dtype: an int64 [LANES] on t's device."""
        data = t.detach().contiguous()
        raw = data.reshape(-1).view(torch.uint8) if data.numel() else data.new_empty(0).byte()
        if raw.numel() % 2:
            raw = torch.nn.functional.pad(raw, (0, 1))
        words = raw.view(torch.int16).to(torch.int64) & 0xFFFF
        if words.numel() == 0:
            words = torch.zeros(1, dtype=torch.int64, device=t.device)
        shape_code = 0
        for dim in t.shape:
            shape_code = (shape_code * 1_000_003 + int(dim)) % PRIME
        return self._reduce(words, [t.numel(), _DTYPE_CODES.get(t.dtype, 99), shape_code])

    def combine(self, parts: Iterable[torch.Tensor]) -> torch.Tensor:
        """Order-sensitive fingerprint of a sequence of fingerprints (or of nothing)."""
        stacked = [p.reshape(1, LANES) for p in parts]
        if not stacked:
            return self._reduce(torch.zeros(1, dtype=torch.int64), [0, 0, 0])
        device = stacked[0].device
        values = torch.cat([s.to(device) for s in stacked])
        return self._reduce(self._split16(values), [len(stacked), 0, 0])

    def tensors(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """Fingerprint of an ordered collection of tensors (a state, a gradient list)."""
        return self.combine(self.tensor(t) for t in tensors)


def as_int(fp: torch.Tensor) -> int:
    """One 62-bit integer for records and display."""
    return lanes_to_int(fp.tolist())


LANE_BITS = 31  # a lane is a residue mod PRIME = 2^31 - 1


def lanes_to_int(lanes: Sequence[int]) -> int:
    """`as_int` of a fingerprint already read to the host (e.g. a row of a gather)."""
    return (int(lanes[0]) << LANE_BITS) | int(lanes[1])


def as_word(fp: torch.Tensor) -> torch.Tensor:
    """`as_int` without the host read: an int64 [1] on the fingerprint's device, so that a
    replay step's fingerprints reach its collective without a device-to-host copy each."""
    lanes = fp.reshape(-1).to(torch.int64)
    return ((lanes[0] << LANE_BITS) | lanes[1]).reshape(1)


def as_hex(fp: torch.Tensor) -> str:
    return f"{as_int(fp):016x}"
