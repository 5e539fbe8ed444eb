"""The DDP communication hook: checks on each gradient bucket, in the pass DDP makes anyway.

Per bucket, before the all-reduce, one fused pass (`slurm_guard.kernels.bucket.bucket_check`:
C on CPU, Triton on CUDA, torch ops elsewhere, all bit-identical) computes in float64 a linear
sketch s(g) = <g, r> with a random +-1 vector r shared by all ranks (generated from a hash of the
run's seed and the element index: nothing stored, no temporary), and the bucket's L1 norm:
- the sketch is non-finite iff some gradient element is (multiplying by +-1 is exact and a float64
  sum of float32/bf16/fp16 values cannot overflow), so it *is* the finite check;
- averaging conserves it: the mean over ranks of s(g_local) must equal s(g_averaged) up to the
  rounding of the reduction, which the L1 norms bound (see `verdicts.conservation_bound`).
After the all-reduce, the sketch of the averaged bucket, by the same pass without the L1 norm
(`l1=False`, a quarter less kernel work) and fused with the division by the world size (one read
of the bucket for both): the bound needs only the local norms, since the averaged bucket's norm
is at most their mean. On verification steps
also the exact fingerprint of each parameter's local gradient (the reduction overwrites the
buffer).

Averaging follows DDP's default hook: float16/bfloat16 buckets are divided by the world size
before the all-reduce (so a sum that overflows the format but whose mean does not stays finite,
as in plain DDP), wider types after it.

The values stay on the device as tensors; the guard reads them once per step in its verdict
collective, so the hook adds no synchronisation.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from slurm_guard.comm.torch_support import unsupported_torch
from slurm_guard.comm.watchdog import HangWatch
from slurm_guard.fingerprint.tree import Fingerprinter
from slurm_guard.kernels.bucket import bucket_check
from slurm_guard.kernels.sketch import divide, seed_words, sign_bits

try:
    # Private, but the class DDP's register_comm_hook compares the annotation against (tested
    # on torch 2.13 and 2.14; docs/architecture.md, "Torch versions").
    from torch._C._distributed_c10d import GradBucket
except ImportError as exc:
    raise unsupported_torch(
        "The guard's DDP comm hook", "torch._C._distributed_c10d.GradBucket"
    ) from exc

PRE_DIVIDED = (torch.float16, torch.bfloat16)  # as DDP's default allreduce hook


class SignVectors:
    """The shared random +-1 vector r: `words` seed the hash the bucket kernels draw it from.

    `get` materialises the same r (for the per-parameter sketches of tolerance mode), grown on
    demand and cached per device and dtype; the hook's kernels never store it.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.words = seed_words(seed)
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        signs = self._cache.get(key)
        if signs is None or signs.numel() < numel:
            size = max(numel, 2 * (signs.numel() if signs is not None else 0))
            negative = sign_bits(size, self.words, torch.device("cpu"))
            signs = (1 - 2 * negative.to(torch.int8)).to(device=device, dtype=dtype)
            self._cache[key] = signs
        return signs[:numel]


@dataclass
class HookState:
    """Mutable per-step state shared by the guard and its hook."""

    group: dist.ProcessGroup | None
    world_size: int
    fingerprinter: Fingerprinter
    signs: SignVectors
    param_index: dict[int, int]  # id(param) -> position in the guard's parameter list
    corrupt_reduced: Callable[[torch.Tensor, int], None] | None = None  # fault injection
    watch: HangWatch | None = None  # gloo: DDP waits on futures a hang verdict can fail
    active: bool = True
    fingerprint_local: bool = False
    sketch_local: bool = False  # tolerance mode: per-parameter sketch and norm, not fingerprints
    local_sketches: list[torch.Tensor] = field(default_factory=list)
    local_l1: list[torch.Tensor] = field(default_factory=list)
    reduced_sketches: dict[int, torch.Tensor] = field(default_factory=dict)  # by bucket index
    local_fingerprints: dict[int, torch.Tensor] = field(default_factory=dict)
    largest_bucket: int = 0
    buckets: int = 0  # buckets checked this step: the rounding bound's bucket-sum term
    elements: int = 0  # elements checked this step: the bound's fp16/bf16 underflow term

    def reset(self, *, fingerprint_local: bool, sketch_local: bool = False) -> None:
        self.fingerprint_local = fingerprint_local
        self.sketch_local = sketch_local
        self.local_sketches = []
        self.local_l1 = []
        self.reduced_sketches = {}
        self.local_fingerprints = {}
        self.buckets = 0
        self.elements = 0


def param_sketch(signs: SignVectors, grad: torch.Tensor) -> torch.Tensor:
    """Tolerance mode: (<g, r>, ||g||_2) in float64 for one parameter's gradient."""
    r = signs.get(grad.numel(), grad.device, grad.dtype).view_as(grad)
    return torch.stack(
        [(grad * r).sum(dtype=torch.float64), torch.linalg.vector_norm(grad, dtype=torch.float64)]
    )


def _sketch(state: HookState, buffer: torch.Tensor, divisor: int) -> torch.Tensor:
    """The averaged bucket's sketch alone (float64 scalar on its device), after dividing the
    bucket in place by `divisor`: one read of the bucket for both where the kernel fuses them."""
    return bucket_check(buffer, state.signs.words, l1=False, divide_by=divisor)[0]


# No `from __future__ import annotations` in this module: DDP inspects the hook's signature and
# insists that the `bucket` annotation is the real dist.GradBucket class, not a string.
def guard_comm_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if state.active:
        check = bucket_check(buffer, state.signs.words)  # [sketch, L1, nonfinite], one read
        state.local_sketches.append(check[0])
        state.local_l1.append(check[1])
        state.largest_bucket = max(state.largest_bucket, buffer.numel())
        state.buckets += 1
        state.elements += buffer.numel()
        if state.fingerprint_local or state.sketch_local:
            for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                index = state.param_index[id(param)]
                state.local_fingerprints[index] = (
                    param_sketch(state.signs, grad)
                    if state.sketch_local
                    else state.fingerprinter.tensor(grad)
                )
    pre_divide = buffer.dtype in PRE_DIVIDED
    if pre_divide:
        buffer.div_(state.world_size)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    assert work is not None
    index = bucket.index()

    def average(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        divisor = 1 if pre_divide else state.world_size
        if not state.active:
            divide(reduced, divisor)
            return reduced
        if state.corrupt_reduced is not None:  # fault injection: corrupt the averaged values
            divide(reduced, divisor)
            state.corrupt_reduced(reduced, index)
            divisor = 1
        # keyed by bucket: callbacks may finish in any order, the total must not depend on it
        state.reduced_sketches[index] = _sketch(state, reduced, divisor)
        return reduced

    reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(average)
    if state.watch is None or buffer.device.type != "cpu":
        return reduced  # NCCL: the hang watch aborts the communicator, which fails this future
    # gloo cannot abort a pending operation: DDP waits on a future the hang watch can fail
    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def forward(done: torch.futures.Future[torch.Tensor]) -> None:
        with contextlib.suppress(RuntimeError):  # already failed by a verdict
            try:
                out.set_result(done.value())
            except Exception as exc:
                out.set_exception(exc)  # type: ignore[arg-type]

    reduced.add_done_callback(forward)
    state.watch.track(out)
    return out
