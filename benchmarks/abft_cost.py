"""Cost of checked GEMMs (`GuardConfig(abft=True)`): step time with the checks vs without.

One process, one thread, fp32 on the CPU. Three copies of each model with the same weights run
round-robin (rotating the order every round), one training step (forward, backward, AdamW) each:

* plain: the unmodified model;
* wrapped: the layers routed through the checked GEMM function with the checks off (what the
  wrapper alone costs);
* abft: every GEMM checked, results reduced and read once per step (what the guard does).

Models: the TinyGPT of `benchmarks/step_overhead.py` (width 256, context 64, 4 layers, batch 8)
and the parameter-heavy MLP (6 x Linear(1024, 1024) + GELU, batch 64). Per model and variant:
the median over rounds of the step's thread CPU time (less disturbed by other processes on a
shared machine than wall time, which is reported too) and the ratio to plain. Goal: <= 1.05x
on TinyGPT.

    python benchmarks/abft_cost.py            # 12 rounds
    python benchmarks/abft_cost.py --quick    # 4 rounds
    python benchmarks/abft_cost.py --block 32 # checksum blocks of 32 rows
    python benchmarks/abft_cost.py --parts 10 # also: time inside each part of the checks
    SLURM_GUARD_NATIVE=0 python benchmarks/abft_cost.py   # the torch-op checks
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _common import median, table, write_json
from torch import nn

from slurm_guard.abft import Abft, attach, measure_coverage
from slurm_guard.abft.wrap import DEFAULT_BLOCK
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, make_batch
from slurm_guard.kernels import abft_native

MODEL = TinyGPTConfig(vocab=64, context=64, width=256, heads=4, layers=4, dropout=0.1)
BATCH = 8
VARIANTS = ("plain", "wrapped", "abft")


def backend() -> str:
    """Which implementation checks the float32 CPU GEMMs here: the C passes or torch ops."""
    return "native (C)" if abft_native.native() is not None else "torch"


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.GELU()]
    return nn.Sequential(*layers)


def _runners(
    name: str, block: int | None = None
) -> tuple[dict[str, Callable[[int], None]], Callable[[nn.Module], torch.Tensor], nn.Module]:
    make: Callable[[], nn.Module] = (lambda: TinyGPT(MODEL)) if name == "TinyGPT" else _mlp
    torch.manual_seed(0)
    models = {v: make() for v in VARIANTS}
    for v in VARIANTS[1:]:
        models[v].load_state_dict(models["plain"].state_dict())
    handles: dict[str, Abft | None] = {
        "plain": None,
        "wrapped": attach(models["wrapped"], checking=False),
        "abft": attach(models["abft"], block=block),
    }
    mlp_input = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))

    def loss_of(model: nn.Module, step: int = 0) -> torch.Tensor:
        if name == "TinyGPT":
            return lm_loss(model, make_batch(step, 0, MODEL, batch_size=BATCH))
        out: torch.Tensor = model(mlp_input).square().mean()
        return out

    runners = {}
    for v in VARIANTS:
        model, handle = models[v], handles[v]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def run(
            step: int,
            model: nn.Module = model,
            handle: Abft | None = handle,
            opt: torch.optim.Optimizer = opt,
        ) -> None:
            opt.zero_grad(set_to_none=True)
            loss_of(model, step).backward()  # type: ignore[no-untyped-call]
            if handle is not None and handle.sites[0].checking:
                failures = handle.findings(handle.collect())  # one read per step
                if failures:
                    raise SystemExit(f"{name}: false alarm {failures}")
            opt.step()

        runners[v] = run
    return runners, lambda m: loss_of(m), models["abft"]


PARTS = {  # what each timed call is, in the C path's order
    "stats": "operand passes (block sums, norms)",
    "weight_norms": "weight norms",
    "mm": "checksum GEMMs (torch.mm, MKL)",
    "compare": "product passes",
    "compare_transposed": "product passes (transposed weight gradient)",
}


@contextlib.contextmanager
def _timed_parts(seconds: dict[str, float], calls: dict[str, int]) -> Iterator[None]:
    """Wall time inside each C call of the checks and each checksum GEMM (`torch.mm`: the model's
    own GEMMs go through F.linear and autograd, not through it), accumulated per name."""
    targets = [(abft_native, name) for name in PARTS if name != "mm"] + [(torch, "mm")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    for mod, name, fn in saved:

        def timed(*args: Any, _fn: Callable[..., Any] = fn, _name: str = name) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                seconds[_name] += time.perf_counter() - start
                calls[_name] += 1

        setattr(mod, name, timed)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def parts(runner: Callable[[int], None], steps: int) -> dict[str, dict[str, float]]:
    """Per step: milliseconds inside each part of the checks, and calls, over `steps` steps."""
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    runner(0)
    with _timed_parts(seconds, calls):
        for step in range(steps):
            runner(step + 1)
    return {
        name: {"ms_per_step": 1e3 * seconds[name] / steps, "calls_per_step": calls[name] / steps}
        for name in PARTS
        if calls.get(name)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    parser.add_argument("--block", type=int, default=None, help="checksum block rows (default 64)")
    parser.add_argument(
        "--parts", type=int, default=0, help="also time each part of the checks over N steps"
    )
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 12)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    rows = []
    for name in ("TinyGPT", "MLP"):
        runners, loss_of, checked = _runners(name, args.block)
        cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
        wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for v in VARIANTS:  # warm-up
            runners[v](0)
        for r in range(rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for v in order:
                c0, w0 = time.thread_time(), time.perf_counter()
                runners[v](r + 1)
                cpu[v].append(time.thread_time() - c0)
                wall[v].append(time.perf_counter() - w0)
        coverage = measure_coverage(checked, lambda c=checked, f=loss_of: f(c))
        checked.zero_grad(set_to_none=True)
        base_cpu, base_wall = median(cpu["plain"]), median(wall["plain"])
        entry: dict[str, Any] = {"coverage": coverage.as_dict(), "variants": {}}
        for v in VARIANTS:
            c, w = median(cpu[v]), median(wall[v])
            entry["variants"][v] = {
                "median_cpu_s": c,
                "median_wall_s": w,
                "ratio_cpu": c / base_cpu,
                "ratio_wall": w / base_wall,
                "cpu_s": cpu[v],
                "wall_s": wall[v],
            }
            rows.append([name, v, c * 1e3, c / base_cpu, w * 1e3, w / base_wall])
        if args.parts:
            entry["parts"] = parts(runners["abft"], args.parts)
        results[name] = entry
    print(
        f"one process, 1 thread, fp32 CPU, {rounds} rounds interleaved; TinyGPT {MODEL}, "
        f"batch {BATCH}; MLP 6 x Linear(1024, 1024) + GELU, batch 64; checksum block "
        f"{args.block or DEFAULT_BLOCK} rows; checks by the {backend()} path"
    )
    print(
        table(
            ["model", "variant", "median step CPU (ms)", "x plain", "median wall (ms)", "x plain"],
            rows,
        )
    )
    tiny = results["TinyGPT"]["variants"]["abft"]["ratio_cpu"]
    print(f"\ngoal TinyGPT abft <= 1.05x: {'met' if tiny <= 1.05 else 'missed'} ({tiny:.3f}x)")
    for name, entry in results.items():
        cov = entry["coverage"]
        print(
            f"{name}: {100 * cov['checked_fraction']:.1f}% of matmul FLOPs checked "
            f"({100 * cov['checked_fraction_without_attention']:.1f}% without attention "
            "score/value products)"
        )
    for name, entry in results.items():
        if "parts" in entry:
            part_rows = [
                [name, PARTS[k], v["calls_per_step"], v["ms_per_step"]]
                for k, v in entry["parts"].items()
            ]
            total = sum(v["ms_per_step"] for v in entry["parts"].values())
            part_rows.append([name, "total", "", total])
            print("\n" + table(["model", "part", "calls per step", "ms per step"], part_rows))
    meta = {"rounds": rounds, "block": args.block or DEFAULT_BLOCK, "path": backend()}
    path = write_json("abft_cost", {**meta, "results": results}, args.json)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
