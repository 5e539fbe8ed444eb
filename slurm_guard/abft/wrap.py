"""Putting checked GEMMs into a model: which layers, and the per-step result.

`attach(model)` finds every GEMM layer it knows how to check, in module order:

* `torch.nn.Linear` (its forward is replaced on the instance, so DDP, FSDP2's `fully_shard` and
  hooks keep working);
* HuggingFace GPT-2's `Conv1D` (`torch.addmm(bias, x, weight)`), recognised by its name and
  weight layout, so transformers need not be installed;
* their tensor-parallel shards: DTensor weights and activations (`parallelize_module`'s
  ColwiseParallel and RowwiseParallel) are checked on each rank's local product (`shards.py`);
  a layout the local check cannot verify is refused by name;
* the input and output projections of `torch.nn.MultiheadAttention`, whose functional forward
  calls `F.linear` on its own parameters: those calls are routed through the check while that
  module's forward runs (self-attention's packed projection, or separate q/k/v weights; the
  split projections of cross-attention with a packed weight are not checked).

Per step, every check leaves a device scalar; `Abft.collect()` reduces them to one small tensor
per step (no host synchronisation per layer), and `Abft.findings()` reads it once.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from slurm_guard.abft.checked import CheckedGemm
from slurm_guard.abft.shards import ShardLayoutError, check_weight, is_dtensor
from slurm_guard.abft.site import PASSES, Injector, Site

ATTR = "_slurm_guard_abft"
DEFAULT_MARGIN = 10.0
DEFAULT_BLOCK = 64


def _autocast_args(
    x: torch.Tensor, m: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Do autocast's cast for it (outside the checked function, so gradients flow back through
    the casts as they would for an unchecked layer): linear and addmm run in the low dtype."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, m, b
    dtype = torch.get_autocast_dtype(device)
    return (
        x.to(dtype),
        m.to(dtype),
        None if b is None else b.to(dtype),
    )


def _run(site: Site, x: torch.Tensor, m: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    x, m, b = _autocast_args(x, m, b)
    out: torch.Tensor = CheckedGemm.apply(x, m, b, site)  # type: ignore[no-untyped-call]
    return out


def is_conv1d(module: nn.Module) -> bool:
    """HuggingFace's Conv1D: y = x @ weight + bias with weight (in, out) and attribute nf."""
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2  # type: ignore[operator]
        and getattr(module, "nf", None) == module.weight.shape[1]  # type: ignore[index]
    )


@dataclass
class Finding:
    """One failed check: layer, pass and how far over its bound (ratio > 1)."""

    layer: str
    gemm_pass: str
    ratio: float


class Abft:
    """The checked layers of one model and their results.

    Args:
        sites: the checked GEMM layers, in module order.
        suspended: called before each check; True skips it (replays, settling passes).
    """

    def __init__(self, sites: list[Site]) -> None:
        self.sites = sites
        self._worst: torch.Tensor | None = None
        self._layout: tuple[tuple[object, ...], torch.Tensor] | None = None
        self._restore: list[Callable[[], None]] = []

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sites]

    def set_checking(self, on: bool, margin: float | None = None) -> None:
        for s in self.sites:
            s.checking = on
            if margin is not None:
                s.margin = margin

    def set_suspended(self, fn: Callable[[], bool]) -> None:
        for s in self.sites:
            s.suspended = fn

    def reset(self) -> None:
        for s in self.sites:
            s.results.clear()
            s.norms = s.bias_norms = None

    def collect(self) -> torch.Tensor | None:
        """(layers, 3) worst ratio per layer and pass since the last reset, on the device; -1
        where that GEMM did not run; None if nothing was checked. Clears the pending results.

        A NaN (a non-finite GEMM result) counts as +inf: it must fail. The C path leaves host
        numbers (its tensors are on the CPU), the torch and Triton paths device tensors,
        reduced on the device with one scatter; the square root is taken once per step."""
        width = len(PASSES)
        host = [-1.0] * (len(self.sites) * width)
        values, index, sizes = [], [], []
        for s in self.sites:
            base = s.index * width
            for which, ratio2 in s.results:
                if isinstance(ratio2, float):
                    i = base + which
                    host[i] = max(host[i], ratio2 if ratio2 == ratio2 else math.inf)
                else:
                    values.append(ratio2.reshape(-1))
                    index.append(base + which)
                    sizes.append(ratio2.numel())
            s.results.clear()
            s.norms = s.bias_norms = None  # a new step: the optimizer may change the weights
        if not values:
            if all(v == -1.0 for v in host):
                return None
            rooted = [math.sqrt(v) if v > 0 else v for v in host]
            return torch.tensor(rooted).view(len(self.sites), width)
        device = values[0].device
        flat = torch.cat(values).float()
        segment = self._segment(index, sizes, device)
        if any(v != -1.0 for v in host):  # both paths ran (CPU only: the C path is CPU-only)
            worst = torch.tensor(host, device=device)
        else:  # a fill on the device: no host-to-device copy, which could wait for the GPU
            worst = torch.full((len(host),), -1.0, device=device)
        worst.scatter_reduce_(
            0, segment, flat.nan_to_num(nan=math.inf, posinf=math.inf), reduce="amax"
        )
        return torch.where(worst > 0, worst.sqrt(), worst).view(len(self.sites), width)

    def _segment(self, index: list[int], sizes: list[int], device: torch.device) -> torch.Tensor:
        """Which result slot each checked value goes to, on the device. The layout repeats from
        step to step (same layers, passes and shapes), so it is uploaded once, not per step: a
        blocking host-to-device copy would wait for the whole backward on CUDA."""
        key = (tuple(index), tuple(sizes), device)
        if self._layout is None or self._layout[0] != key:
            segment = torch.repeat_interleave(torch.tensor(index), torch.tensor(sizes))
            self._layout = (key, segment.to(device))
        return self._layout[1]

    def summary(self, worst: torch.Tensor | None) -> torch.Tensor:
        """[largest ratio, its flat (layer * 3 + pass) index] as float64 on the same device: the
        two numbers a step's verdict row needs (the index is -1 when nothing was checked)."""
        if worst is None:
            return torch.tensor([0.0, -1.0], dtype=torch.float64)
        flat = worst.reshape(-1).double()
        top, where = flat.max(0)
        return torch.stack([top, where.double()])

    def findings(self, worst: torch.Tensor | None) -> list[Finding]:
        """Failed checks (ratio > 1 or NaN), read from the device once."""
        if worst is None:
            return []
        rows = worst.cpu().tolist()
        out = []
        for s, row in zip(self.sites, rows, strict=True):
            for which, ratio in enumerate(row):
                if not ratio <= 1.0 and ratio != -1.0:
                    out.append(Finding(s.name, PASSES[which], float(ratio)))
        return out

    def where(self, flat_index: int) -> tuple[str, str]:
        """(layer name, pass) of a flat index from `summary`."""
        return self.sites[flat_index // len(PASSES)].name, PASSES[flat_index % len(PASSES)]

    def inject(self, layer: int, which: str, fn: Injector) -> str:
        """Add a fault to one pass of one layer (index modulo the number of layers)."""
        site = self.sites[layer % len(self.sites)]
        site.injectors.setdefault(PASSES.index(which), []).append(fn)
        return site.name

    def detach(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()


def _wrap_linear(module: nn.Module, site: Site) -> Callable[[], None]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return _run(site, x, self.weight.t(), self.bias)

    module.forward = types.MethodType(forward, module)
    return lambda: delattr(module, "forward")


def _wrap_conv1d(module: nn.Module, site: Site) -> Callable[[], None]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return _run(site, x, self.weight, self.bias)

    module.forward = types.MethodType(forward, module)
    return lambda: delattr(module, "forward")


def _param(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _wrap_attention(module: nn.MultiheadAttention, sites: dict[str, Site]) -> Callable[[], None]:
    """`F.multi_head_attention_forward` calls the module-level `linear` of torch.nn.functional on
    the attention's own weights; for the duration of this module's forward that name points to a
    function that sends those calls (and only those) through their checked sites. A
    torch-function mode cannot do this: it sees the whole attention call, not the linears in it.
    """
    original = module.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # looked up per call: FSDP2 swaps parameters between their sharded and unsharded forms
        live = {id(_param(self, path)): site for path, site in sites.items()}
        plain = F.linear

        def linear(x: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> torch.Tensor:
            site = live.get(id(weight))
            if site is None:
                return plain(x, weight, bias)
            return _run(site, x, weight.t(), bias)

        F.linear = linear  # type: ignore[assignment]
        try:
            return original(*args, **kwargs)
        finally:
            F.linear = plain

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    return lambda: delattr(module, "forward")


def attach(
    model: nn.Module,
    *,
    margin: float | None = None,
    block: int | None = None,
    checking: bool = True,
) -> Abft:
    """Check every supported GEMM of `model`; returns the handle (also kept on the model).

    Args:
        margin: lambda of the rounding bound (`bounds.py`); default 10.
        block: rows per checksum block; default 32. Smaller blocks detect smaller errors at the
            cost of a larger checksum GEMM (1/block of the checked one).
        checking: False wraps the layers for fault injection only.

    Attaching again returns the existing handle (settings given are applied; checking is only
    ever switched on), so fault injection and the guard's checks can be set up in either order.
    """
    existing: Abft | None = getattr(model, ATTR, None)
    if existing is not None:
        for s in existing.sites:
            s.margin = s.margin if margin is None else margin
            s.block = s.block if block is None else block
        if checking:
            existing.set_checking(True)
        return existing
    margin = DEFAULT_MARGIN if margin is None else margin
    block = DEFAULT_BLOCK if block is None else block
    if not (margin > 0 and isinstance(block, int) and block >= 1):
        raise ValueError(f"attach: margin={margin!r} must be > 0 and block={block!r} >= 1")
    sites: list[Site] = []
    restore: list[Callable[[], None]] = []
    claimed: set[int] = set()

    def new_site(name: str, kind: str) -> Site:
        site = Site(len(sites), name, kind, margin=margin, block=block, checking=checking)
        sites.append(site)
        return site

    for name, module in model.named_modules():
        if id(module) in claimed:
            continue
        if isinstance(module, nn.MultiheadAttention):
            if any(is_dtensor(p) for p in module.parameters()):
                raise ShardLayoutError(
                    f"abft: {name!r} is a MultiheadAttention with DTensor parameters; its "
                    "packed projections are not checked on shards (run it with abft=False)"
                )
            by_param: dict[str, Site] = {}
            if module.in_proj_weight is not None:
                by_param["in_proj_weight"] = new_site(f"{name}.in_proj", "linear")
            else:
                for p in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                    by_param[p] = new_site(f"{name}.{p[0]}_proj", "linear")
            by_param["out_proj.weight"] = new_site(f"{name}.out_proj", "linear")
            claimed.add(id(module.out_proj))
            restore.append(_wrap_attention(module, by_param))
        elif isinstance(module, nn.Linear):
            check_weight(name, module.weight, module.bias)
            restore.append(_wrap_linear(module, new_site(name, "linear")))
        elif is_conv1d(module):
            check_weight(name, module.weight, module.bias)
            restore.append(_wrap_conv1d(module, new_site(name, "addmm")))
    handle = Abft(sites)
    handle._restore = restore
    object.__setattr__(model, ATTR, handle)
    restore.append(lambda: object.__delattr__(model, ATTR))
    return handle
