"""Copying the verified state to host memory without making the training step wait.

On a GPU, the state's tensors are copied into pinned host buffers (allocated once, reused) on a
side stream that first waits for the step's work; the training stream waits for the copy only
where it would overwrite what is being copied: at `fence()`, which the guard calls when the next
step's checks are done, before any update. A background thread waits for the copy to land and
writes the snapshot (`rundir.snapshots`). On the CPU there is no stream to overlap with: the
state is copied on the spot (into the reused buffers) and the thread writes it.

The step waits on a snapshot only when the next one starts while the previous one is still
being written: the store keeps two, and the copier never runs two at once. Host buffers are
allocated once and reused (pinned on a GPU), since a snapshot starts only after the previous one
was written.

A snapshot that fails to write is logged and dropped: it is a cache, and the shared-filesystem
checkpoint is still there. `last_error` says why, for a test or a status line.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from slurm_guard.rundir.snapshots import SnapshotSeal, SnapshotStore, SnapshotsUnavailable

logger = logging.getLogger(__name__)

__all__ = ["CopyStats", "SnapshotCopier", "host_copy"]


def host_copy(obj: Any, copy: Callable[[torch.Tensor, str], torch.Tensor], path: str = "") -> Any:
    """`obj` with every tensor replaced by `copy(tensor, path)`; dicts, lists, tuples walked."""
    if isinstance(obj, torch.Tensor):
        return copy(obj, path)
    if isinstance(obj, dict):
        return {k: host_copy(v, copy, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [host_copy(v, copy, f"{path}/{i}") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


@dataclass
class CopyStats:
    """What the snapshots cost: for the benchmark and `slurm-guard status`."""

    written: int = 0
    failed: int = 0
    bytes: int = 0  # of the last snapshot's tensors
    seconds_waited: float = 0.0  # the step's total wait for a previous snapshot
    seconds_written: list[float] = field(default_factory=list)  # per snapshot, copy to seal


class SnapshotCopier:
    """Takes one snapshot at a time, off the training step's path."""

    def __init__(self, store: SnapshotStore, device: torch.device) -> None:
        self.store = store
        self.device = device
        self.stats = CopyStats()
        self.last_error: str | None = None
        self.last_seal: SnapshotSeal | None = None
        self.on_written: Callable[[SnapshotSeal], None] | None = None  # on the writer thread
        self._thread: threading.Thread | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # pinned host buffers, by state path
        self._stream: Any = None
        self._event: Any = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # The writer is a daemon thread (a hung write must not keep a finished job alive), so
        # a process that ends right after a snapshot would cut it off: wait for it at exit.
        atexit.register(self.wait)

    def start(
        self,
        state: dict[str, Any],
        write: Callable[[Any], SnapshotSeal] | None = None,
        **seal: Any,
    ) -> None:
        """Snapshot `state` (the module, optimizer ... as they are now); returns at once.

        `seal` holds `SnapshotStore.write`'s keywords (step, run id, fingerprint, seed, world
        size); a callable value is called on the writer thread, after the copy has landed.
        Or `write(host_state)` writes it (the sharded guard also writes its peers' copies) and
        returns the seal of this rank's own snapshot.
        The tensors are captured before this returns (enqueued on the copy stream on a GPU,
        cloned on the CPU), so the caller may go on training.
        """
        began = time.perf_counter()
        self.wait()
        self.stats.seconds_waited += time.perf_counter() - began
        copied = time.perf_counter()
        if self._stream is not None:
            host = self._enqueue_device_copy(state)
        else:
            host = host_copy(state, self._cpu_copy)
        self.stats.bytes = _nbytes(host)
        self._thread = threading.Thread(
            target=self._write,
            args=(host, write, seal, copied),
            name="slurm-guard-snapshot",
            daemon=True,
        )
        self._thread.start()

    def _cpu_copy(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        """Into the buffer of the last snapshot (its write has finished: `start` waited): no
        fresh allocation, whose page faults cost the step more than the copy itself."""
        if tensor.layout != torch.strided:
            return tensor.detach().clone()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
            self._buffers[path] = buffer
        return buffer.copy_(tensor.detach())

    def _enqueue_device_copy(self, state: dict[str, Any]) -> Any:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))

        def copy(tensor: torch.Tensor, path: str) -> torch.Tensor:
            if tensor.device.type != "cuda":
                return tensor.detach().clone()
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._buffers[path] = buffer
            buffer.copy_(tensor.detach(), non_blocking=True)
            # a temporary (a received peer copy) may be freed when `start` returns: its memory
            # must not be handed to the training stream before this stream has read it
            tensor.record_stream(stream)
            return buffer

        with torch.cuda.stream(stream):
            host = host_copy(state, copy)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(stream)
        return host

    def fence(self) -> None:
        """Before the state changes again (the optimizer step): the copy must have read it.

        A wait of the training stream on the copy's event, on the device: no host sync.
        """
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)

    def _write(
        self,
        host: Any,
        write: Callable[[Any], SnapshotSeal] | None,
        seal: dict[str, Any],
        began: float,
    ) -> None:
        try:
            if self._event is not None:
                self._event.synchronize()  # this thread waits for the copy, not the step
            if write is not None:
                self.last_seal = write(host)
            else:
                # a value still on the device (the fingerprint) is read here, off the step's path
                fields = {k: v() if callable(v) else v for k, v in seal.items()}
                self.last_seal = self.store.write(host, **fields)
            self.stats.written += 1
            if self.on_written is not None:
                self.on_written(self.last_seal)
            self.stats.seconds_written.append(time.perf_counter() - began)
        except Exception as exc:  # a cache that failed: logged, never the run's failure
            self.stats.failed += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, SnapshotsUnavailable):  # that one was named once already
                logger.warning("snapshot at step %s not written: %s", seal.get("step"), exc)

    def wait(self) -> None:
        """Until the snapshot in flight (if any) is written or has failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.wait()
        self._buffers.clear()


def _nbytes(obj: Any) -> int:
    total = 0

    def count(tensor: torch.Tensor, _: str) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    host_copy(obj, count)
    return total
