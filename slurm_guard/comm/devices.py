"""Which device a collective's tensors must be on, and the stricter check tests switch on.

NCCL takes CUDA tensors and gloo CPU ones; a tensor on the wrong device works by accident on one
backend and fails (or copies silently) on the other. `SLURM_GUARD_CHECK_DEVICE=cuda|cpu` or the
`check_devices` context manager makes every collective demand one device type, so CPU tests catch
a tensor that would have reached NCCL on the host.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ENV_CHECK_DEVICE = "SLURM_GUARD_CHECK_DEVICE"


def backend_device(backend: str) -> torch.device:
    """The device a backend's collectives take: CUDA for NCCL (also in "cpu:gloo,cuda:nccl")."""
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_checked_device: list[str] = []  # set by check_devices(); the environment variable otherwise


@contextlib.contextmanager
def check_devices(device_type: str) -> Iterator[None]:
    """Tests: every tensor handed to a collective must be on `device_type` ("cuda" or "cpu")."""
    _checked_device.append(device_type)
    try:
        yield
    finally:
        _checked_device.pop()


def required_device_type(backend_type: str) -> str:
    """The device type a collective tensor must have: the declared one in tests, else the
    backend's."""
    if _checked_device:
        return _checked_device[-1]
    return os.environ.get(ENV_CHECK_DEVICE) or backend_type
