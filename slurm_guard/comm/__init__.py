"""The guard's collectives: the only code that calls torch.distributed for the guard.

`Collective` (gathers and all-reduces on the backend's device, `agree(fn)`, the arrival
watchdog), the named errors every rank raises together (`errors`), the device rules (`devices`),
and who runs on which node (`topology`), and which torch the guard can run on (`torch_support`).
"""

from __future__ import annotations

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.devices import backend_device, check_devices
from slurm_guard.comm.errors import (
    CollectiveError,
    CollectiveMismatch,
    DeviceCheckError,
    RankFailed,
    RanksMissing,
)
from slurm_guard.comm.topology import Topology
from slurm_guard.comm.torch_support import UnsupportedTorch

__all__ = [
    "Collective",
    "CollectiveError",
    "CollectiveMismatch",
    "DeviceCheckError",
    "RankFailed",
    "RanksMissing",
    "Topology",
    "UnsupportedTorch",
    "backend_device",
    "check_devices",
]
