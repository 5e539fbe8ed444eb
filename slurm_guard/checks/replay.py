"""Ship a microbatch and its RNG state to another rank, and recompute it there.

The batch travels over the process group, so the guard makes no assumption about the user's data
pipeline: whatever `loss_fn` received, the replayer receives bit for bit, with the RNG state the
owner had just before its forward pass (dropout replays identically).

The replay must not disturb training: it uses the plain module (not DDP, whose reducer expects one
backward per forward), `torch.autograd.grad` (the real `.grad` fields stay untouched), and it
restores buffers (BatchNorm running statistics) and this rank's own RNG state afterwards.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from slurm_guard.errors import GuardError
from slurm_guard.kernels.bucket import bucket_check

if TYPE_CHECKING:
    from slurm_guard.comm.collective import Collective

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
ANY_SIGNS = (0, 0)  # sign-hash words for `any_nonfinite`: only the kernel's finite flag is read


class Microbatches(list[Any]):
    """Gradient accumulation: `guard.step(Microbatches([b1, b2, b3]))` runs the first ones
    under `no_sync()` and reduces once; replays cover the whole accumulated gradient."""


_replaying = False


def is_replaying() -> bool:
    """True while the guard recomputes another rank's step on this rank.

    Forward hooks with side effects outside tensors (counters, logging, caches) should skip
    them when this is true; buffers are restored by the guard on its own.
    """
    return _replaying


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Mark the passes inside as a replay of another rank's step (`is_replaying`)."""
    global _replaying
    _replaying = True
    try:
        yield
    finally:
        _replaying = False


@dataclass
class Captured:
    """What an owner keeps of its step so that it can be replayed elsewhere."""

    batch: Batch
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    reference: torch.Tensor | None = None  # tolerance mode: the owner's loss and sketches
    # `GuardCore.capture`: each microbatch's own RNG state, stacked (the user's loop may draw
    # from the RNG between microbatches, e.g. to sample the next batch); None: one state for all
    micro_cpu_rng: torch.Tensor | None = None
    micro_cuda_rng: torch.Tensor | None = None
    # exact mode, from `fast_path_world` ranks on: the owner's loss bits and gradient
    # fingerprint (int64 [2]), so that its replayer compares them itself (`local_replay`)
    claim: torch.Tensor | None = None


def capture(batch: Batch) -> Captured:
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return Captured(batch=batch, cpu_rng=torch.get_rng_state(), cuda_rng=cuda_rng)


def captured_microbatches(parts: Sequence[Captured]) -> Captured:
    """One step's captures (one per microbatch, in order) as the Captured a replay needs."""
    if len(parts) == 1:
        return parts[0]
    cuda = [p.cuda_rng for p in parts if p.cuda_rng is not None]
    return Captured(
        batch=Microbatches(p.batch for p in parts),
        cpu_rng=parts[0].cpu_rng,
        cuda_rng=parts[0].cuda_rng,
        micro_cpu_rng=torch.stack([p.cpu_rng for p in parts]),
        micro_cuda_rng=torch.stack(cuda) if cuda else None,
    )


def set_rng(cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
    # clone: a row of the stacked states is a view at an offset, which set_rng_state reads from
    # the start of its storage (a segmentation fault on torch 2.13)
    torch.set_rng_state(cpu.clone())
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda.clone())


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"t": len(tensors) - 1}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise GuardError("batch dicts must have string keys so the batch can be replayed")
        return {"d": {k: _flatten(v, tensors) for k, v in obj.items()}}
    if isinstance(obj, Microbatches):
        return {"m": [_flatten(v, tensors) for v in obj]}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "u": [_flatten(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise GuardError(
        f"batch contains a {type(obj).__name__}; a batch must be tensors, numbers and strings "
        "nested in dicts, lists and tuples, so that it can be sent to another rank for replay"
    )


def _unflatten(spec: Any, tensors: list[torch.Tensor]) -> Any:
    if "t" in spec:
        return tensors[spec["t"]]
    if "d" in spec:
        return {k: _unflatten(v, tensors) for k, v in spec["d"].items()}
    if "m" in spec:
        return Microbatches(_unflatten(v, tensors) for v in spec["m"])
    if "l" in spec:
        return [_unflatten(v, tensors) for v in spec["l"]]
    if "u" in spec:
        return tuple(_unflatten(v, tensors) for v in spec["u"])
    return spec["v"]


def pack(captured: Captured) -> torch.Tensor:
    """One uint8 buffer: JSON header (structure, dtypes, shapes, devices) then the raw bytes."""
    tensors: list[torch.Tensor] = []
    spec = _flatten(captured.batch, tensors)
    extra = [
        captured.cpu_rng,
        captured.cuda_rng,
        captured.reference,
        captured.micro_cpu_rng,
        captured.micro_cuda_rng,
        captured.claim,
    ]
    present = [t is not None for t in extra]
    extra_tensors = [t for t in extra if t is not None]
    meta = [
        {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "cuda": t.is_cuda}
        for t in tensors + extra_tensors
    ]
    header = json.dumps(
        {"spec": spec, "meta": meta, "n_batch": len(tensors), "extra": present}
    ).encode()
    parts = [torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8)]
    parts.append(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for t in tensors + extra_tensors:
        parts.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def unpack(buffer: torch.Tensor, device: torch.device) -> Captured:
    buffer = buffer.cpu()
    header_len = int(buffer[:8].view(torch.int64).item())
    header = json.loads(bytes(buffer[8 : 8 + header_len].tolist()).decode())
    offset = 8 + header_len
    tensors: list[torch.Tensor] = []
    for m in header["meta"]:
        dtype = getattr(torch, m["dtype"])
        count = 1
        for d in m["shape"]:
            count *= d
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        raw = buffer[offset : offset + nbytes].clone()
        offset += nbytes
        t = raw.view(dtype).reshape(m["shape"])
        tensors.append(t.to(device) if m["cuda"] else t)
    n = header["n_batch"]
    rest = iter(tensors[n:])
    cpu_rng, cuda_rng, reference, micro_cpu, micro_cuda, claim = (
        (next(rest).cpu() if p else None) for p in header["extra"]
    )
    assert cpu_rng is not None
    return Captured(
        batch=_unflatten(header["spec"], tensors[:n]),
        cpu_rng=cpu_rng,
        cuda_rng=cuda_rng,
        reference=reference,
        micro_cpu_rng=micro_cpu,
        micro_cuda_rng=micro_cuda,
        claim=claim,
    )


def exchange(
    pairs: Sequence[tuple[int, int]],
    mine: Captured | None,
    rank: int,
    comm: Collective,
) -> dict[int, Captured]:
    """Send my captured step to every rank that replays me; receive from every owner I replay.

    `pairs` are (owner, replayer), identical on all ranks. Two rounds of batched point-to-point
    operations on the backend's device: sizes first, then the buffers. Returns {owner: captured}
    for my replays.
    """
    device = comm.device
    sends = [rep for own, rep in pairs if own == rank and rep != rank]
    recvs = [own for own, rep in pairs if rep == rank and own != rank]
    payload = pack(mine).to(device) if sends and mine is not None else None
    size = torch.tensor([payload.numel() if payload is not None else 0], device=device)
    sizes = {own: torch.zeros(1, dtype=torch.int64, device=device) for own in recvs}
    ops = [comm.send(size, dst) for dst in sends]
    ops += [comm.recv(sizes[src], src) for src in recvs]
    comm.p2p(ops, "replay exchange: sizes")
    # one host read of all the sizes this rank receives
    counts = torch.cat([sizes[own] for own in recvs]).tolist() if recvs else []
    buffers = {
        own: torch.empty(int(n), dtype=torch.uint8, device=device)
        for own, n in zip(recvs, counts, strict=True)
    }
    ops = [comm.send(payload, dst) for dst in sends if payload is not None]
    ops += [comm.recv(buffers[src], src) for src in recvs]
    comm.p2p(ops, "replay exchange: batches")
    model_device = device if device.type == "cuda" else torch.device("cpu")
    received = {own: unpack(buf, model_device) for own, buf in buffers.items()}
    if mine is not None and any(own == rank and rep == rank for own, rep in pairs):
        received[rank] = mine
    return received


@dataclass
class ReplayOutput:
    loss: torch.Tensor
    grads: list[torch.Tensor]
    nonfinite: bool


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Run extra forward/backward passes without a trace: this rank's RNG states (CPU and CUDA)
    and the module's buffers (BatchNorm running statistics) are restored afterwards."""
    own_cpu_rng = torch.get_rng_state()
    own_cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    saved_buffers = [b.detach().clone() for b in module.buffers()]
    try:
        yield
    finally:
        torch.set_rng_state(own_cpu_rng)
        if own_cuda_rng is not None:
            torch.cuda.set_rng_state(own_cuda_rng)
        with torch.no_grad():
            for buf, saved in zip(module.buffers(), saved_buffers, strict=True):
                buf.copy_(saved)


def recompute(
    module: nn.Module,
    loss_fn: LossFn,
    captured: Captured,
    params: Sequence[nn.Parameter],
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ReplayOutput:
    """Forward and backward of someone else's step, leaving this rank's state untouched.

    Microbatches are replayed in order and their gradients summed the way autograd accumulates
    them into `.grad` (first assigned, then added), so the result matches bit for bit. `scale`
    is the GradScaler's `scale` when mixed precision is on: the owner's local gradients were
    computed from the scaled loss.
    """
    micro = list(captured.batch) if isinstance(captured.batch, Microbatches) else [captured.batch]
    losses: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    with preserved_state(module), replaying():
        set_rng(captured.cpu_rng, captured.cuda_rng)
        for i, mb in enumerate(micro):
            if captured.micro_cpu_rng is not None:
                cuda = captured.micro_cuda_rng
                set_rng(captured.micro_cpu_rng[i], cuda[i] if cuda is not None else None)
            loss = loss_fn(module, mb)
            raw = torch.autograd.grad(
                scale(loss) if scale else loss, list(params), allow_unused=True
            )
            step_grads = [
                torch.zeros_like(p) if g is None else g for p, g in zip(params, raw, strict=True)
            ]
            grads = (
                step_grads if not grads else [a + g for a, g in zip(grads, step_grads, strict=True)]
            )
            losses.append(loss.detach())
    total_loss = combined_loss(losses)
    return ReplayOutput(loss=total_loss, grads=grads, nonfinite=any_nonfinite(total_loss, grads))


def any_nonfinite(loss: torch.Tensor, grads: Sequence[torch.Tensor]) -> bool:
    """Whether the loss or any gradient element is NaN or infinite, in one device-to-host copy.

    Each gradient's flag comes from the hook's fused kernel in its sketch-only form (exact: a
    float64 sum of signed float32/16 values is non-finite iff an element is), at the speed of a
    float32 read; a float64-accumulating `sum` was ~28 ms of each 25 MB replay on CPU.
    """
    flags = [bucket_check(g, ANY_SIGNS, l1=False)[2] for g in grads]
    flags.append((~torch.isfinite(loss.detach())).to(torch.float64).reshape(()))
    return bool(torch.stack(flags).any().item())


def combined_loss(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """One value to compare for a step: the loss, or the float64 sum of the microbatch losses."""
    if len(losses) == 1:
        return losses[0]
    return torch.stack([loss.double() for loss in losses]).sum()
