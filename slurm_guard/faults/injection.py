"""Software fault injection: proof that the guard catches what it claims to.

A fault is a kind, a target (one rank, or every rank on one node) and an onset step. A one-off
fault corrupts only the target's own computation at the onset step; a persistent fault stands for
broken hardware: from the onset on it corrupts everything the target computes, replays of other
ranks' microbatches included.

Set from the environment (`SLURM_GUARD_INJECT`, faults separated by ';'):

    SLURM_GUARD_INJECT="kind=grad-scale,node=node2,step=12,persistent=1"
    SLURM_GUARD_INJECT="kind=nan,rank=1,step=5;kind=weight-bitflip,rank=2,step=7,bit=22"

or in Python: `GuardConfig(faults=(Fault("activation", rank=1, step=3),))`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slurm_guard.errors import GuardError

ENV_VAR = "SLURM_GUARD_INJECT"

KINDS = {
    "grad-scale": "multiply one gradient element by `factor` (backward)",
    "grad-bitflip": "flip bit `bit` of one gradient element (backward)",
    "nan": "set one gradient element to NaN (backward)",
    "inf": "set one gradient element to +Inf (backward)",
    "activation": "turn one output element x of the first layer into x*factor+factor (forward)",
    "weight-bitflip": "flip bit `bit` of one weight element after the update (memory)",
    "replay-noise": "relative Gaussian noise of size `factor` on every replayed gradient "
    "(stands in for non-deterministic kernels)",
    "allreduce": "turn one averaged gradient element x into x*factor+factor (all-reduce result; "
    "under ShardedGuard, reduce-scatter `param`'s output)",
    "diagnose-gemm": "turn one element x of the `step`-th (persistent: every later) GEMM result "
    "of `slurm-guard diagnose` into x*factor+factor; `rank` selects the GPU",
    "gemm": "one output element of checked GEMM `layer` in pass `pass` (fwd, grad_x, grad_w) "
    "becomes x*(1+factor), or has bit `bit` flipped with flip=1 (inside the GEMM: the ABFT "
    "check sees it)",
}
BACKWARD_KINDS = ("grad-scale", "grad-bitflip", "nan", "inf")


@dataclass(frozen=True)
class Fault:
    """One injected fault. `rank` or `node` selects the target; `param` and `element` the value.

    Every field, and what each kind does with it: docs/user-guide.md, "The fault spec".
    """

    kind: str
    step: int
    rank: int | None = None
    node: str | None = None
    persistent: bool = False
    param: int = 0
    element: int = 0
    factor: float = 10.0
    bit: int = 22
    layer: int = 0
    gemm_pass: str = "fwd"
    flip: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GuardError(f"unknown fault kind {self.kind!r}; known kinds: {', '.join(KINDS)}")
        if (self.rank is None) == (self.node is None):
            raise GuardError(f"fault {self.kind!r}: give exactly one of rank=N or node=NAME")
        if self.step < 0 or self.param < 0 or self.element < 0 or self.layer < 0:
            raise GuardError(f"fault {self.kind!r}: step, param, element and layer must be >= 0")
        if self.gemm_pass not in ("fwd", "grad_x", "grad_w"):
            raise GuardError(
                f"fault {self.kind!r}: pass={self.gemm_pass!r}; must be fwd, grad_x or grad_w"
            )
        if not 0 <= self.bit < 64:
            raise GuardError(f"fault {self.kind!r}: bit must be in 0..63")

    def targets(self, rank: int, node: str) -> bool:
        return self.rank == rank if self.rank is not None else self.node == node

    def spec(self) -> str:
        """The fault as `SLURM_GUARD_INJECT` writes it: kind, target, step, then every field
        that differs from its default, so a warning can be pasted back into the variable."""
        parts = [f"kind={self.kind}"]
        parts.append(f"rank={self.rank}" if self.rank is not None else f"node={self.node}")
        parts.append(f"step={self.step}")
        default = Fault(kind=self.kind, step=self.step, rank=0)
        for name, key in _SPEC_FIELDS:
            value = getattr(self, name)
            if value != getattr(default, name):
                shown = int(value) if isinstance(value, bool) else value
                parts.append(f"{key}={shown:g}" if isinstance(value, float) else f"{key}={shown}")
        return ",".join(parts)

    def describe(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else f"node {self.node}"
        how = "persistent from" if self.persistent else "one-off at"
        if self.kind == "gemm":
            size = f"bit {self.bit} flipped" if self.flip else f"x(1+{self.factor:g})"
            where += f", layer {self.layer} {self.gemm_pass}, element {self.element}, {size}"
        return f"{self.kind} on {where}, {how} step {self.step}"


_INT_FIELDS = ("step", "rank", "param", "element", "bit", "layer")
_SPEC_FIELDS = (
    ("persistent", "persistent"),
    ("param", "param"),
    ("element", "element"),
    ("factor", "factor"),
    ("bit", "bit"),
    ("layer", "layer"),
    ("gemm_pass", "pass"),
    ("flip", "flip"),
)


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse SLURM_GUARD_INJECT; errors name the bad part and show the expected format."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields: dict[str, Any] = {}
        for item in filter(None, (i.strip() for i in part.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep:
                raise GuardError(
                    f"{ENV_VAR}: {item!r} is not key=value; expected e.g. "
                    "'kind=grad-scale,rank=1,step=10,persistent=1'"
                )
            try:
                if key in _INT_FIELDS:
                    fields[key] = int(value)
                elif key == "factor":
                    fields[key] = float(value)
                elif key in ("persistent", "flip"):
                    fields[key] = value.strip().lower() in ("1", "true", "yes")
                elif key == "pass":
                    fields["gemm_pass"] = value.strip()
                elif key in ("kind", "node"):
                    fields[key] = value.strip()
                else:
                    raise GuardError(f"{ENV_VAR}: unknown key {key!r} in {part!r}")
            except ValueError:
                raise GuardError(f"{ENV_VAR}: {key}={value!r} is not a number") from None
        if "kind" not in fields or "step" not in fields:
            raise GuardError(f"{ENV_VAR}: {part!r} needs at least kind=... and step=...")
        faults.append(Fault(**fields))
    return tuple(faults)


def faults_from_env(environ: dict[str, str] | None = None) -> tuple[Fault, ...]:
    env = os.environ if environ is None else environ
    return parse_faults(env.get(ENV_VAR, ""))


def flip_bit(t: torch.Tensor, element: int, bit: int) -> None:
    """Flip one bit of one element in place, whatever the float width."""
    flat = t.view(-1)
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = flat[element : element + 1].view(int_type)
    bits ^= torch.tensor(1, dtype=int_type, device=t.device) << min(bit, 8 * t.element_size() - 1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers: compares NaN with NaN and -0.0 with 0.0 by their bits."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def scale_and_shift(t: torch.Tensor, fault: Fault) -> None:
    """The wrong value of the value faults, in place: element `fault.element` (modulo the
    size) x becomes x*factor+factor. The shift makes a zero (a ReLU output, a gradient
    that happens to be 0) wrong too, where a product alone would leave it right."""
    flat = t.view(-1)
    i = fault.element % flat.numel()
    flat[i] = flat[i] * fault.factor + fault.factor


def flip_element(t: torch.Tensor, fault: Fault) -> None:
    """`weight-bitflip`: bit `fault.bit` of element `fault.element` (modulo the size)."""
    flip_bit(t, fault.element % t.numel(), fault.bit)


def corrupt_gradient(grad: torch.Tensor, fault: Fault) -> None:
    """A backward fault (`BACKWARD_KINDS`) on element `fault.element` of `grad`, in place."""
    flat = grad.view(-1)
    i = fault.element % flat.numel()
    if fault.kind == "grad-scale":
        flat[i] = flat[i] * fault.factor
    elif fault.kind == "grad-bitflip":
        flip_bit(grad, i, fault.bit)
    elif fault.kind == "nan":
        flat[i] = float("nan")
    else:
        flat[i] = float("inf")


def _gemm_error(out: torch.Tensor, fault: Fault) -> None:
    """`gemm`: x*(1+factor), or bit `bit` flipped with flip=1 (element `fault.element`)."""
    flat = out.view(-1)
    i = fault.element % flat.numel()
    if fault.flip:
        flip_bit(out, i, fault.bit)
    else:
        flat[i] = flat[i] * (1 + fault.factor)


class FaultInjector:
    """Applies this rank's faults through hooks on the real model, so replays see them too."""

    def __init__(
        self,
        faults: tuple[Fault, ...],
        rank: int,
        node: str,
        module: nn.Module,
        hooked: Collection[str] | None = None,
    ) -> None:
        """`hooked`: the kinds this injector applies through hooks on `module` (None: every
        kind); a guard that applies the others itself (ShardedGuard, in its reduce-scatter)
        still counts them through `apply`, so every fault is known here."""
        self.all_faults = faults  # every rank's, in the agreed order: the effects row's order
        self.faults = tuple(f for f in faults if f.targets(rank, node))
        hooks = tuple(f for f in self.faults if hooked is None or f.kind in hooked)
        self.step = -1
        self.replaying = False
        self._noise_draws = 0
        # What each of this rank's faults changed: element counts on the device (added to
        # without a host read; `effects` reads them once) and the first and last step it ran.
        self._changed: dict[int, torch.Tensor] = {}
        self._span: dict[int, tuple[int, int]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        params = [p for p in module.parameters() if p.requires_grad]
        for fault in hooks:
            if fault.kind in BACKWARD_KINDS:
                param = params[fault.param % len(params)]
                hook = self._grad_hook(fault)
                self._handles.append(param.register_hook(hook))  # type: ignore[no-untyped-call]
            elif fault.kind == "gemm":
                self._add_gemm_fault(module, fault)
            elif fault.kind == "activation":
                first = next(
                    m
                    for m in module.modules()
                    if next(m.parameters(recurse=False), None) is not None
                )
                self._handles.append(first.register_forward_hook(self._forward_hook(fault)))
        for fault in hooks:
            if fault.kind == "replay-noise":
                for index, param in enumerate(params):
                    hook = self._noise_hook(fault, index)
                    self._handles.append(param.register_hook(hook))  # type: ignore[no-untyped-call]
        self._weight_faults = [
            (f, params[f.param % len(params)]) for f in hooks if f.kind == "weight-bitflip"
        ]

    def apply(
        self, fault: Fault, t: torch.Tensor, corrupt: Callable[[torch.Tensor, Fault], None]
    ) -> None:
        """`corrupt(t, fault)` in place, counting whether element `fault.element` changed."""
        flat = t.view(-1)
        i = fault.element % flat.numel()
        before = flat[i : i + 1].clone()
        corrupt(t, fault)
        self._tally(fault, before, flat[i : i + 1])

    def _tally(self, fault: Fault, before: torch.Tensor, after: torch.Tensor) -> None:
        """Adds the number of elements whose bits differ, on the device: no sync per step."""
        index = self.faults.index(fault)
        changed = (_bits(before) != _bits(after)).sum()
        total = self._changed.get(index)
        self._changed[index] = changed if total is None else total + changed.to(total.device)
        first, _last = self._span.get(index, (self.step, self.step))
        self._span[index] = (first, self.step)

    def effects(self) -> list[int]:
        """For every fault of the run (`all_faults`, in order): values changed here, first and
        last step it ran here (-1: never), as one flat list. One device-to-host read."""
        mine = {f: i for i, f in reversed(list(enumerate(self.faults)))}
        counts: dict[int, int] = {}
        if self._changed:
            keys = sorted(self._changed)
            device = self._changed[keys[0]].device
            values = torch.stack([self._changed[k].to(device) for k in keys]).tolist()  # one read
            counts = dict(zip(keys, (int(v) for v in values), strict=True))
        row: list[int] = []
        for fault in self.all_faults:
            index = mine.get(fault)
            span = self._span.get(index, (-1, -1)) if index is not None else (-1, -1)
            row += [counts.get(index, 0) if index is not None else 0, *span]
        return row

    def _add_gemm_fault(self, module: nn.Module, fault: Fault) -> None:
        """Inside the layer's GEMM (before its check): wraps the model's GEMM layers, checked or
        not, so the fault exists whether or not abft is on."""
        from slurm_guard.abft.wrap import attach

        fired: set[int] = set()

        def corrupt(out: torch.Tensor) -> None:
            if not self.active(fault) or (not fault.persistent and self.step in fired):
                return
            fired.add(self.step)  # a one-off fault hits the first such GEMM of its step only
            self.apply(fault, out, _gemm_error)

        attach(module, checking=False).inject(fault.layer, fault.gemm_pass, corrupt)

    def active(self, fault: Fault) -> bool:
        """A one-off fault hits the target's own step once; a persistent one everything after."""
        if fault.persistent:
            return self.step >= fault.step
        return self.step == fault.step and not self.replaying

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False

    def _grad_hook(self, fault: Fault) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not self.active(fault):
                return None
            grad = grad.clone()
            self.apply(fault, grad, corrupt_gradient)
            return grad

        return hook

    def _noise_hook(self, fault: Fault, index: int) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not (self.replaying and self.active(fault)):
                return None
            # a private generator: the noise must not consume the training RNG
            self._noise_draws += 1
            gen = torch.Generator().manual_seed(self._noise_draws * 1_000_003 + index)
            noise = torch.randn(grad.shape, generator=gen).to(grad.device, grad.dtype)
            noisy = grad * (1 + fault.factor * noise)
            self._tally(fault, grad, noisy)
            return noisy

        return hook

    def _forward_hook(self, fault: Fault) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
            if not self.active(fault) or not isinstance(output, torch.Tensor):
                return None
            output = output.clone()
            self.apply(fault, output, scale_and_shift)
            return output

        return hook

    @property
    def corrupts_reduction(self) -> bool:
        return any(f.kind == "allreduce" for f in self.faults)

    def corrupt_reduced(self, reduced: torch.Tensor, bucket_index: int) -> None:
        """Called by the comm hook on the averaged bucket; corrupts the first bucket only."""
        if bucket_index != 0:
            return
        for fault in self.faults:
            if fault.kind == "allreduce" and self.active(fault):
                self.apply(fault, reduced, scale_and_shift)

    def after_update(self) -> None:
        """Memory faults: a one-off flip once, a stuck bit after every update from the onset."""
        with torch.no_grad():
            for fault, param in self._weight_faults:
                if self.active(fault):
                    self.apply(fault, param.data, flip_element)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
