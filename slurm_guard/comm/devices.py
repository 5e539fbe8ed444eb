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

from slurm_guard.rundir.gpus import GpuIdentity

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


def gpu_identity(device: torch.device | None) -> GpuIdentity | None:
    """The CUDA device `device` names, as admins see it (index, UUID, PCI bus id); None for
    anything but a CUDA device.

    Each lookup is guarded: a torch whose device properties lack `uuid` or the PCI ids still
    records the index (the fields are then None), because an alarm must never fail for want of
    a label.
    """
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "") or None
    if uuid is not None and not uuid.startswith(("GPU-", "MIG-")):
        uuid = f"GPU-{uuid}"  # nvidia-smi -L's spelling
    pci = None
    bus, dev, domain = (getattr(props, f"pci_{k}_id", None) for k in ("bus", "device", "domain"))
    if all(isinstance(v, int) for v in (bus, dev, domain)):
        pci = f"{domain:08X}:{bus:02X}:{dev:02X}.0"  # nvidia-smi's pci.bus_id
    return GpuIdentity(index, node_gpu_index(index), uuid, pci)


def node_gpu_index(index: int) -> int | None:
    """The node's index of the process's CUDA device `index`: CUDA_VISIBLE_DEVICES renumbers
    (Slurm's GPU binding sets it per task), so device 0 of a task may be the node's GPU 5.
    None when the variable lists UUIDs or is malformed; `index` when it is unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(items) or not items[index].isdigit():
        return None
    return int(items[index])
