"""Which GPU a rank computes on, as run.json and the alarm records carry it (torch-free).

A node has 4 to 8 GPUs; the node name alone tells the admin where to look, not which device to
send back. Each rank records its CUDA device at start (`comm.topology.local_rank_info`), and an
alarm carries the suspect ranks' entries, so the drain reason and `slurm-guard review` can name
the GPU. On CPU the entry is null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPU_FIELDS: dict[str, tuple[type, ...]] = {
    "index": (int,),
    "node_index": (int, type(None)),
    "uuid": (str, type(None)),
    "pci_bus_id": (str, type(None)),
}
MAX_FIELD_CHARS = 64


@dataclass(frozen=True)
class GpuIdentity:
    """The CUDA device of one rank.

    `index` is torch's index in the rank's process; `node_index` the node's (nvidia-smi's),
    through CUDA_VISIBLE_DEVICES when that lists indices (None when it lists UUIDs); `uuid`
    and `pci_bus_id` as `nvidia-smi -L` and `nvidia-smi --query-gpu=pci.bus_id` print them,
    which name the device whatever the numbering.
    """

    index: int
    node_index: int | None
    uuid: str | None
    pci_bus_id: str | None


def parse_gpus(value: Any, suspects: int) -> tuple[dict[str, Any] | None, ...]:
    """An alarm's `suspect_gpus`: one entry per suspect rank, null for a rank without a GPU.

    Optional in alarm schema 1 (older records have none, or an empty list: an empty tuple);
    otherwise it must be well-formed, as every other field. Raises ValueError saying what is
    wrong.
    """
    if value is None or value == []:
        return ()  # not recorded (an older writer, or an Alarm built without them)
    if not isinstance(value, list) or len(value) != suspects:
        raise ValueError("suspect_gpus must be a list with one entry per suspect rank")
    out: list[dict[str, Any] | None] = []
    for entry in value:
        if entry is not None:
            if not isinstance(entry, dict) or set(entry) != set(GPU_FIELDS):
                raise ValueError(f"suspect_gpus entries must be null or have {sorted(GPU_FIELDS)}")
            for key, types in GPU_FIELDS.items():
                v = entry[key]
                if isinstance(v, bool) or not isinstance(v, types):
                    raise ValueError(f"suspect_gpus: field {key!r} has the wrong type")
                if isinstance(v, str) and len(v) > MAX_FIELD_CHARS:
                    raise ValueError(f"suspect_gpus: field {key!r} is too long")
        out.append(entry)
    return tuple(out)


def gpu_label(gpus: Any) -> str | None:
    """`gpu 3` (or `gpus 1,3`) from an alarm's or a journal entry's suspect_gpus: the node's
    index where known, else the process's; None when no suspect rank recorded a GPU."""
    if not isinstance(gpus, (list, tuple)):
        return None
    found = []
    for g in gpus:
        if isinstance(g, dict):
            index = g.get("node_index") if g.get("node_index") is not None else g.get("index")
            if isinstance(index, int) and not isinstance(index, bool):
                found.append(str(index))
    if not found:
        return None
    return ("gpu " if len(found) == 1 else "gpus ") + ",".join(found)
