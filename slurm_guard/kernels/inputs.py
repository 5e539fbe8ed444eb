"""What every kernel entry point refuses before it reads a tensor's memory.

The C kernels take raw pointers and the Triton ones index storage directly: a tensor subclass
that wraps others (a DTensor: its own `data_ptr()` is no local shard's address) would be read as
garbage, or crash the process with a segmentation fault that no other rank hears of. Callers
hand the kernels local tensors (`abft.shards.local`); these checks turn a caller's mistake into
a named error on the rank that made it.
"""

from __future__ import annotations

import torch

from slurm_guard.errors import GuardError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch without distributed support has no DTensors
    DTensor = None  # type: ignore[assignment,misc]


class KernelInputError(GuardError):
    """A kernel was handed a tensor it cannot read (a DTensor, or a CPU kernel a GPU tensor)."""


def plain(where: str, *tensors: torch.Tensor | None, cpu: bool = False) -> None:
    """Raise KernelInputError unless every tensor given is a plain (local) tensor, and, with
    `cpu`, one in CPU memory (the C kernels read host pointers)."""
    for t in tensors:
        if t is None:
            continue
        if DTensor is not None and isinstance(t, DTensor):
            raise KernelInputError(
                f"{where}: received a DTensor; kernels read local tensors only (pass "
                ".to_local(): checked GEMMs under tensor parallel do, see abft/shards.py)"
            )
        if cpu and t.device.type != "cpu":
            raise KernelInputError(f"{where}: got a {t.device.type} tensor; it reads host memory")
