"""A deterministic known-answer burn-in of a node's devices: `slurm-guard diagnose`.

An alarm names a node; before it is returned to service an admin needs to know whether the fault
is still there. A GPU that computes wrong numbers silently does so in matrix multiplies, so the
burn-in runs seeded GEMMs (fp32, and tf32, bf16 and fp16 where the device has them) for a fixed
time and checks three things:

1. **Repeatability.** Every repeat of a case on the same device must be bit-identical to the
   first result. Deterministic kernels are forced for the run (`CUBLAS_WORKSPACE_CONFIG`,
   `torch.use_deterministic_algorithms`), so any difference is the hardware. Catches intermittent
   faults, the common kind.
2. **Column checksums.** `1^T C` must equal `(1^T A) B`, computed in float64, within a rigorous
   rounding bound. Catches gross errors even on the first node ever diagnosed, so a node that is
   wrong every time cannot pass and become the golden reference.
3. **Golden result.** The digest of each case must equal the one recorded the first time a node
   with the same device model, driver, torch/CUDA build and thread count passed (kept in the
   controller's state directory, see `slurm_guard.diagnose.evidence`). Catches a device that
   is wrong in the same way every time, below the checksum bound.

Each GEMM result is compared on the device; only the first result of each case is copied to the
host (for its digest), so the burn-in keeps the device busy rather than the PCIe bus.

Fault injection for tests and drills: `SLURM_GUARD_INJECT="kind=diagnose-gemm,node=node2,step=0,
persistent=1"` corrupts one element of every GEMM result on node2 from the first one on
(`rank=N` targets device N instead; a one-off fault at `step=K` corrupts the K-th GEMM only).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from slurm_guard.diagnose.evidence import CaseResult, Diagnosis
from slurm_guard.errors import GuardError
from slurm_guard.faults.injection import Fault, faults_from_env, scale_and_shift

logger = logging.getLogger(__name__)

FAULT_KIND = "diagnose-gemm"
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# Unit roundoff for the checksum bound: the worst case of a product sum accumulated in the
# operands' own precision (a kernel that accumulates wider only does better). tf32 rounds the
# fp32 operands to a 10-bit mantissa before multiplying.
_UNIT_ROUNDOFF = {"fp32": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-8, "fp16": 2.0**-11}
CHECKSUM_SAFETY = 2.0
"""Slack on the rounding bound. The bound is a worst case already: only a real error exceeds it."""


@dataclass(frozen=True)
class DiagnoseConfig:
    """What to run.

    Args:
        duration_s: how long to keep repeating the cases after the first pass over them.
        size: matrices are size x size.
        seeds: cases per precision (different inputs).
        precisions: which to run; None means every one the device supports.
        device: `auto` (every GPU when CUDA is available, else the CPU), `cuda` or `cpu`.
        node: the Slurm node name the evidence is recorded for.
        threads: CPU threads (part of the golden key: BLAS results depend on the split).
        min_repeats: repeats per case even when `duration_s` is already spent.
        faults: injected faults; only kind `diagnose-gemm` is used here.
    """

    node: str
    duration_s: float = 60.0
    size: int = 1024
    seeds: int = 2
    precisions: tuple[str, ...] | None = None
    device: str = "auto"
    threads: int | None = None
    min_repeats: int = 2
    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cuda", "cpu"):
            raise GuardError(f"device {self.device!r}: use auto, cuda or cpu")
        if self.size < 2 or self.seeds < 1 or self.min_repeats < 1 or self.duration_s < 0:
            raise GuardError("size must be >= 2, seeds and min_repeats >= 1, duration_s >= 0")
        for p in self.precisions or ():
            if p not in PRECISIONS:
                raise GuardError(f"precision {p!r}: use one of {', '.join(PRECISIONS)}")
        if self.threads is not None and self.threads < 1:
            raise GuardError("threads must be >= 1")


def default_node_name() -> str:
    """The Slurm node name inside a job step, else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _devices(kind: str) -> list[torch.device]:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise GuardError("--device cuda: torch sees no CUDA device on this node")
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def supported_precisions(device: torch.device) -> tuple[str, ...]:
    """fp32 always; tf32 on Ampere and newer; bf16 and fp16 where matmul supports them."""
    if device.type == "cuda":
        out = ["fp32"]
        if torch.cuda.get_device_capability(device) >= (8, 0):
            out.append("tf32")
        if torch.cuda.is_bf16_supported():
            out.append("bf16")
        out.append("fp16")
        return tuple(out)
    return ("fp32", "bf16", "fp16")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return "unknown"
    for token in first.split():
        if token[:1].isdigit() and "." in token:
            return token
    return first.strip()[:80] or "unknown"


def device_facts(device: torch.device, threads: int) -> dict[str, object]:
    """What the golden key is made of: anything that may change the bits of a correct result."""
    facts: dict[str, object] = {"kind": device.type, "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(
            model=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            driver=_nvidia_driver(),
            cuda=torch.version.cuda,
        )
    else:
        facts.update(model=_cpu_model(), threads=threads, machine=platform.machine())
    return facts


def device_key(facts: dict[str, object]) -> str:
    return "|".join(f"{k}={facts[k]}" for k in sorted(facts))


def _inputs(seed: int, size: int, precision: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Seeded on the CPU generator, so every node of every kind gets the same operands."""
    gen = torch.Generator().manual_seed(0x5EED0000 + seed)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    dtype = _DTYPES[precision]
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


@contextlib.contextmanager
def _precision_mode(precision: str) -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@contextlib.contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic cuBLAS for the run. CPU GEMMs already are, and switching the flag costs
    seconds of imports on the CPU build."""
    if device.type != "cuda":
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _digest(t: torch.Tensor) -> str:
    """sha256 of the exact bytes, with dtype and shape: equal iff bit-identical."""
    host = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{host.dtype}{tuple(host.shape)}".encode())
    h.update(host.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _checksum_excess(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, precision: str) -> float:
    """Worst |1^T C - (1^T A) B| over the columns, as a multiple of the rounding bound."""
    a64, b64, c64 = a.double(), b.double(), c.double()
    got = c64.sum(dim=0)
    want = a64.sum(dim=0) @ b64
    scale = a64.abs().sum(dim=0) @ b64.abs()
    n = a.shape[1]
    u = _UNIT_ROUNDOFF[precision]
    # per element: n*u*sum|a||b| for the product sum, u*sum|a||b| for rounding the output,
    # then the float64 sums here (negligible, covered by the safety factor).
    bound = CHECKSUM_SAFETY * (n + 1) * u * scale + torch.finfo(torch.float64).tiny
    return float(((got - want).abs() / bound).max())


class _Injector:
    """Corrupts GEMM results the way a broken multiplier would: one wrong element."""

    def __init__(self, faults: tuple[Fault, ...], node: str, device_index: int) -> None:
        self.faults = tuple(
            f for f in faults if f.kind == FAULT_KIND and f.targets(device_index, node)
        )
        self.count = 0

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        index = self.count
        self.count += 1
        for fault in self.faults:
            hit = index >= fault.step if fault.persistent else index == fault.step
            if hit:
                scale_and_shift(out, fault)
        return out


@dataclass
class _Case:
    name: str
    device_index: int
    precision: str
    seed: int
    a: torch.Tensor
    b: torch.Tensor
    first: torch.Tensor | None = None
    digest: str = ""
    repeats: int = 0
    mismatches: int = 0
    first_mismatch: dict[str, object] | None = None
    checksum_excess: float = 0.0


def _gemm(case: _Case, injector: _Injector) -> torch.Tensor:
    with _precision_mode(case.precision):
        out = torch.mm(case.a, case.b)
    return injector.apply(out)


def _compare(case: _Case, out: torch.Tensor) -> None:
    """Compare with the first result on the device; one bool crosses to the host."""
    assert case.first is not None
    case.repeats += 1
    if torch.equal(out, case.first):
        return
    case.mismatches += 1
    if case.first_mismatch is None:
        differ = out != case.first
        where = int(differ.view(-1).nonzero()[0].item())
        case.first_mismatch = {
            "repeat": case.repeats,
            "elements_differing": int(differ.sum().item()),
            "first_index": where,
            "expected": float(case.first.view(-1)[where].item()),
            "got": float(out.view(-1)[where].item()),
        }


def run_diagnosis(config: DiagnoseConfig) -> Diagnosis:
    """Run the burn-in on this node's devices and return the evidence (golden not yet compared).

    A device error (a CUDA exception, an out-of-memory) does not escape: it is recorded and
    fails the diagnosis, because a node that cannot finish its burn-in is not cleared.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    started = time.time()
    devices = _devices(config.device)
    threads = config.threads or torch.get_num_threads()
    previous_threads = torch.get_num_threads()
    if devices[0].type == "cpu":
        torch.set_num_threads(threads)
    facts = device_facts(devices[0], threads)
    if devices[0].type == "cuda":
        names = {torch.cuda.get_device_name(d) for d in devices}
        if len(names) > 1:  # one golden key per run: results of different models differ
            raise GuardError(
                f"this node mixes GPU models ({', '.join(sorted(names))}); diagnose each model "
                "separately, e.g. CUDA_VISIBLE_DEVICES=0,1 slurm-guard diagnose ..."
            )
    facts["count"] = len(devices)
    key_facts = {k: v for k, v in facts.items() if k != "count"}
    errors: list[str] = []
    cases: list[_Case] = []
    injectors = {i: _Injector(config.faults, config.node, i) for i in range(len(devices))}
    try:
        with _deterministic(devices[0]):
            for index, device in enumerate(devices):
                wanted = config.precisions or supported_precisions(device)
                available = supported_precisions(device)
                missing = [p for p in wanted if p not in available]
                if missing:
                    raise GuardError(
                        f"{device}: no {', '.join(missing)} matmul on this device; "
                        f"it supports {', '.join(available)}"
                    )
                for precision in wanted:
                    for seed in range(config.seeds):
                        a, b = _inputs(seed, config.size, precision, device)
                        name = f"{precision}-n{config.size}-s{seed}"
                        cases.append(_Case(name, index, precision, seed, a, b))
            # First pass: the reference result of each case, its digest and its checksum.
            for case in cases:
                out = _gemm(case, injectors[case.device_index])
                case.first = out
                case.digest = _digest(out)
                case.checksum_excess = _checksum_excess(case.a, case.b, out, case.precision)
            deadline = time.monotonic() + config.duration_s
            rounds = 0
            while rounds < config.min_repeats or time.monotonic() < deadline:
                for case in cases:
                    _compare(case, _gemm(case, injectors[case.device_index]))
                rounds += 1
    except GuardError:
        raise
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        logger.exception("diagnose: device error")
        errors.append(f"device error during the burn-in: {exc}")
    finally:
        if devices[0].type == "cpu":
            torch.set_num_threads(previous_threads)
    results = tuple(
        CaseResult(
            case=c.name,
            device_index=c.device_index,
            precision=c.precision,
            size=config.size,
            seed=c.seed,
            digest=c.digest,
            repeats=c.repeats,
            mismatches=c.mismatches,
            first_mismatch=c.first_mismatch,
            checksum_ok=c.checksum_excess <= 1.0,
            checksum_excess=c.checksum_excess,
        )
        for c in cases
        if c.first is not None
    )
    faults = tuple(f.describe() for inj in injectors.values() for f in inj.faults)
    return Diagnosis(
        node=config.node,
        hostname=socket.gethostname(),
        device=facts,
        device_key=device_key(key_facts),
        cases=results,
        errors=tuple(errors),
        faults=tuple(dict.fromkeys(faults)),
        started=started,
        finished=time.time(),
    )


def faults_for_diagnose(environ: dict[str, str] | None = None) -> tuple[Fault, ...]:
    """The `diagnose-gemm` faults of SLURM_GUARD_INJECT; training faults there are ignored."""
    return tuple(f for f in faults_from_env(environ) if f.kind == FAULT_KIND)
