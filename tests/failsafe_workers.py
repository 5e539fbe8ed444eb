"""Guarded runs where one rank misbehaves (spawned processes import this module).

Each function returns what this rank saw: the error type, its message and how long after the
Guard was built it came, so that a test can assert that every rank stopped with the same named
error, and soon, instead of hanging.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode
from workers import SMALL

import slurm_guard as sg

# slurm_guard.comm.collective is imported where used, so that the hang scenarios also run against
# the code before it existed (to show that they hung there)
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss, make_batch
from slurm_guard.rundir.records import read_json_file


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _capture_logs() -> _Lines:
    handler = _Lines()
    logging.getLogger("slurm_guard").addHandler(handler)
    logging.getLogger("slurm_guard").setLevel(logging.INFO)
    return handler


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run fn; report a GuardError or alarm as data (a hang shows up as a lost rank)."""
    start = time.monotonic()
    out: dict[str, Any] = {"error": None, "message": None, "alarm": None, "value": None}
    try:
        out["value"] = fn()
    except sg.SilentDataCorruption as exc:
        out["alarm"] = exc.alarm.to_json()
    except sg.GuardError as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
    out["elapsed"] = time.monotonic() - start
    return out


def _guard(run_dir: str, config: sg.GuardConfig, loss_fn: Any = lm_loss) -> sg.Guard:
    torch.manual_seed(0)
    ddp = DDP(TinyGPT(SMALL))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return sg.Guard(ddp, opt, loss_fn, run_dir, config=config)


def _train(run_dir: str, config: sg.GuardConfig, steps: int) -> None:
    rank = dist.get_rank()
    guard = _guard(run_dir, config)
    for step in range(steps):
        guard.step(make_batch(step, rank, SMALL))


def mismatched_settings(run_dir: str, odd_rank: int) -> dict[str, Any]:
    """Rank `odd_rank` builds its Guard with five settings different from the others'."""
    config = sg.GuardConfig(replay_every=5)
    if dist.get_rank() == odd_rank:
        config = sg.GuardConfig(
            replay_every=6,
            deterministic=False,
            schedule="random",
            settle_buckets=False,
            finite_check=False,
        )
    return _outcome(lambda: _train(run_dir, config, 8))


def checkpoint_on_rank_zero_only(run_dir: str) -> dict[str, Any]:
    """The classic mistake: `if rank == 0: guard.save_checkpoint()`."""
    rank = dist.get_rank()

    def run() -> None:
        guard = _guard(run_dir, sg.GuardConfig(replay_every=5, vote_every=5))
        for step in range(8):
            guard.step(make_batch(step, rank, SMALL))
            if step == 2 and rank == 0:
                guard.save_checkpoint()

    return _outcome(run)


def rank_that_sleeps(run_dir: str, sleeper: int, seconds: float, watchdog: float) -> dict[str, Any]:
    """Rank `sleeper` stalls before step 3 (a stuck data loader) for longer than the watchdog."""
    rank = dist.get_rank()

    stalled_at: list[float] = []

    def run() -> None:
        guard = _guard(run_dir, sg.GuardConfig(watchdog_seconds=watchdog))
        for step in range(6):
            if step == 3:
                stalled_at.append(time.monotonic())
                if rank == sleeper:
                    time.sleep(seconds)
            guard.step(make_batch(step, rank, SMALL))

    out = _outcome(run)
    # seconds from reaching step 3 to the error (the sleeper: its sleep included)
    out["waited"] = time.monotonic() - stalled_at[0] if stalled_at else None
    return out


def replay_that_raises(run_dir: str, bad_rank: int) -> dict[str, Any]:
    """The user's loss_fn raises on one rank, only while it replays another rank's step."""
    rank = dist.get_rank()

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if sg.is_replaying() and rank == bad_rank:
            raise MemoryError("CUDA out of memory (simulated) in the replay")
        return lm_loss(model, batch)

    def run() -> None:
        guard = _guard(run_dir, sg.GuardConfig(replay_every=2), loss_fn)
        for step in range(6):
            guard.step(make_batch(step, rank, SMALL))

    return _outcome(run)


def agree_on_failure(failing_rank: int) -> dict[str, Any]:
    """collective.agree around work that raises on one rank only."""
    from slurm_guard.comm.collective import Collective

    comm = Collective(None, f"node{dist.get_rank() + 1}", watchdog_seconds=30)

    def work() -> int:
        if comm.rank == failing_rank:
            raise TypeError("torch.save could not pickle a lambda in the optimizer state")
        return 7

    return _outcome(lambda: comm.agree(work, "checkpoint files"))


def single_rank_nan(run_dir: str) -> dict[str, Any]:
    """World size 1 with a NaN injected: no replay can run, the verdict must say so."""
    logs = _capture_logs()
    fault = sg.Fault("nan", rank=0, step=2, param=10)
    out = _outcome(lambda: _train(run_dir, sg.GuardConfig(faults=(fault,)), 5))
    out["logs"] = logs.lines
    return out


def injected_from_env(run_dir: str) -> dict[str, Any]:
    """A fault from SLURM_GUARD_INJECT (set by the test): logged, recorded and marked."""
    logs = _capture_logs()
    out = _outcome(lambda: _train(run_dir, sg.GuardConfig(replay_every=2), 6))
    out["logs"] = logs.lines
    if dist.get_rank() == 0:
        out["run_json"] = read_json_file(Path(run_dir) / "run.json")
    return out


class HostReads(TorchFunctionMode):
    """Every conversion of a tensor to Python values (on CUDA: a device-to-host copy and sync)
    made while active, as "file:function" of the code that asked for it.

    The optimizer's reads are left out: torch's optimizers keep their step counter in a host
    tensor and read it with `.item()`, which is no device read on CUDA either.
    """

    READS = frozenset(
        {
            torch.Tensor.item,
            torch.Tensor.tolist,
            torch.Tensor.__float__,
            torch.Tensor.__int__,
            torch.Tensor.__bool__,
            torch.Tensor.__index__,
            torch.Tensor.numpy,
        }
    )

    # tensors made from Python values: on CUDA each is a host-to-device copy, which synchronises
    # the stream unless it comes from pinned memory without blocking
    UPLOADS = frozenset({torch.tensor, torch.as_tensor})

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []
        self.uploads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.READS or func in self.UPLOADS:
            caller = traceback.extract_stack(limit=2)[0]
            if f"{os.sep}optim{os.sep}" not in caller.filename:
                site = f"{Path(caller.filename).name}:{caller.name}"
                (self.sites if func in self.READS else self.uploads).append(site)
        return func(*args, **(kwargs or {}))


def step_host_reads(run_dir: str, fast_path_world: int = 32) -> dict[str, Any]:
    """The host reads of a replay step, a plain step and a vote step (replay_every=vote_every=3),
    and whether each step returned the loss the loss function computed (as a float)."""
    recorded: list[torch.Tensor] = []

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = lm_loss(model, batch)
        recorded.append(loss.detach().clone())
        return loss

    def run() -> dict[str, Any]:
        config = sg.GuardConfig(replay_every=3, vote_every=3, fast_path_world=fast_path_world)
        guard = _guard(run_dir, config, loss_fn)
        sites, uploads, exact = [], [], []
        for step in range(3):
            recorded.clear()
            batch = make_batch(step, dist.get_rank(), SMALL)
            with HostReads() as reads:
                loss = guard.step(batch)
            sites.append(reads.sites)
            uploads.append(reads.uploads)
            # the first call is this rank's own forward; a replay of another rank's comes later
            exact.append(type(loss) is float and loss == float(recorded[0]))
        verifier = guard.verifier
        return {
            "sites": sites,
            "uploads": uploads,
            "loss_exact": exact,
            "fast_steps": verifier.fast_steps,
            "fast_votes": verifier.fast_votes,
        }

    return _outcome(run)


def checked_devices(run_dir: str, declared: str) -> dict[str, Any]:
    """A whole verified step (ring replay, gather, vote) with the device check declared.

    Returns the collective's host reads per step, so that the test sees one device-to-host copy
    per round.
    """
    from slurm_guard.comm.devices import check_devices

    rank = dist.get_rank()

    def run() -> dict[str, Any]:
        with check_devices(declared):
            guard = _guard(run_dir, sg.GuardConfig(replay_every=2, vote_every=2))
            reads = []
            for step in range(4):
                before = guard.comm.host_reads
                guard.step(make_batch(step, rank, SMALL))
                reads.append(guard.comm.host_reads - before)
            return {"reads": reads, "device": str(guard.comm.device)}

    return _outcome(run)


def p2p_on_subgroup() -> dict[str, Any]:
    """A Collective on the subgroup of global ranks [1, 2]: group rank 0 sends to group rank 1.
    With global ranks passed through unmapped, global rank 1 would send to itself."""
    from slurm_guard.comm.collective import Collective

    sub = dist.new_group([1, 2])  # every rank creates it, members or not
    if dist.get_rank() == 0:
        return {"member": False}
    comm = Collective(sub, f"node{dist.get_rank() + 1}")
    box = torch.full((2,), float(comm.rank))
    peer = 1 - comm.rank
    comm.p2p([comm.send(box.clone(), peer), comm.recv(box, peer)], "subgroup exchange")
    return {"member": True, "group_rank": comm.rank, "got": box.tolist()}


class CountingStore(dist.Store):
    """Every request made through it, counted (`counts`): wrapped around the process group's
    TCPStore, it sees the guard's store traffic, its hang watch's own connections included."""

    def __init__(self, inner: dist.Store, counts: dict[str, int]) -> None:
        super().__init__()
        self.inner = inner
        self.counts = counts

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def set(self, key: str, value: Any) -> None:
        self._count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self._count("add")
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._count("wait")
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys")
        return self.inner.num_keys()

    def set_timeout(self, timeout: Any) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> CountingStore:
        return CountingStore(self.inner.clone(), self.counts)


def store_requests_per_step(run_dir: str, fast_path_world: int = 32) -> dict[str, Any]:
    """The process group rebuilt on a counting store around the same TCPStore; returns the
    store requests of Guard(), of each of 4 steps (replay at 0 and 3, vote at 2), of a save."""
    from torch.distributed import PrefixStore

    rank, world = dist.get_rank(), dist.get_world_size()
    base = dist.distributed_c10d._get_default_store()
    while isinstance(base, PrefixStore):
        base = base.underlying_store
    dist.barrier()
    dist.destroy_process_group()
    counts: dict[str, int] = {}
    store = CountingStore(PrefixStore("counted/", base), counts)  # referenced: see clone
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

    def requests() -> int:
        return sum(counts.values())

    def run() -> dict[str, Any]:
        config = sg.GuardConfig(replay_every=3, vote_every=3, fast_path_world=fast_path_world)
        before = requests()
        guard = _guard(run_dir, config)
        time.sleep(0.5)  # the hang watch's listener has issued its one blocking wait
        setup = requests() - before
        steps = []
        for step in range(4):
            before = requests()
            guard.step(make_batch(step, rank, SMALL))
            steps.append(requests() - before)
        before = requests()
        guard.save_checkpoint()
        return {"setup": setup, "steps": steps, "save": requests() - before}

    out = _outcome(run)
    out["store"] = store  # kept alive until the group is destroyed
    out.pop("store")
    return out
