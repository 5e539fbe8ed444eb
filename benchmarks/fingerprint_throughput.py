"""Fingerprint (and hook-check) throughput against the fastest read-only pass over the same tensor.

Fingerprinting reads every byte once, so `tensor.sum()` on the same tensor and device is its
floor. The fused bucket check of the DDP hook (sketch, L1 norm, finite flag in float64, one
pass) is measured beside it, with the three torch passes it replaced. Variants are interleaved
round by round (the machine is shared); figures are medians.

    python benchmarks/fingerprint_throughput.py            # 1e5..1e8 float32 elements
    python benchmarks/fingerprint_throughput.py --quick    # 1e5..1e7, fewer rounds
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import median, table, write_json

from slurm_guard.fingerprint import nh as ff
from slurm_guard.fingerprint.tree import Fingerprinter
from slurm_guard.kernels import bucket as kb
from slurm_guard.kernels import sketch as sk

GOAL = 0.80  # fraction of tensor.sum() bandwidth (issue 12)
GOAL_SIZES = (10**6, 10**7, 10**8)  # float32 elements, one thread
GOAL_THREADS = 1


def per_call(fn: Callable[[], object], budget_s: float) -> float:
    """Seconds per call, timing as many calls as fit in about budget_s (at least one)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return elapsed / calls


def _hook_variants(seed: int, largest: int) -> dict[str, Callable[[torch.Tensor], object]]:
    words = sk.seed_words(seed)
    signs = torch.randint(0, 2, (largest,), dtype=torch.int8).float() * 2 - 1

    def three_passes(t: torch.Tensor) -> object:  # the hook before the fused kernel
        s = (t * signs[: t.numel()]).sum(dtype=torch.float64)
        return s, torch.linalg.vector_norm(t, 1, dtype=torch.float64)

    backend = kb.backend(torch.device("cpu"))
    return {
        f"bucket check ({backend})": lambda t: kb.bucket_check(t, words),
        "bucket check before (3 torch passes)": three_passes,
    }


def _goal(records: list[dict[str, Any]], variant: str) -> dict[str, Any]:
    """The issue's goal, judged only where it is defined: the native fingerprint at 1e6, 1e7
    and 1e8 float32 elements on one thread. `met` is None when a size was not measured."""
    fractions: dict[str, float | None] = {}
    for n in GOAL_SIZES:
        found = [
            float(r["fraction_of_sum"])
            for r in records
            if r["variant"] == variant and r["elements"] == n and r["threads"] == GOAL_THREADS
        ]
        fractions[f"{n:.0e}"] = found[0] if found else None
    measured = [f for f in fractions.values() if f is not None]
    met = None if len(measured) < len(GOAL_SIZES) else all(f >= GOAL for f in measured)
    verdict = {None: "not fully measured", True: "met", False: "missed"}[met]
    parts = ", ".join(
        f"{size}: " + ("not measured" if f is None else f"{f:.2f}x" + (" ok" if f >= GOAL else ""))
        for size, f in fractions.items()
    )
    line = (
        f"goal: {variant} >= {GOAL:.2f}x of sum() at 1e6, 1e7, 1e8 elements, "
        f"{GOAL_THREADS} thread: {verdict} ({parts})"
    )
    return {"fractions": fractions, "met": met, "line": line}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 1e7, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--with-hook-check", action="store_true", help="also the hook's fused bucket check"
    )
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    args = parser.parse_args()
    sizes = [10**5, 10**6, 10**7] if args.quick else [10**5, 10**6, 10**7, 10**8]
    rounds = args.rounds or (5 if args.quick else 9)
    seed = 20240601
    fast = ff.FastFingerprinter(seed)
    old = Fingerprinter(seed)
    backend = ff.backend()
    variants: dict[str, Callable[[torch.Tensor], object]] = {
        "sum": lambda t: t.sum(),
        f"fast ({backend})": fast.tensor,
        "fast (torch path)": lambda t: ff.reference_fingerprint(t, fast, fast._keys),
        "reference (fingerprint.py)": old.tensor,
    }
    if hasattr(torch, "hash_tensor"):
        variants["torch.hash_tensor"] = lambda t: torch.hash_tensor(t)
    slow = {"fast (torch path)", "reference (fingerprint.py)"}
    if args.with_hook_check:
        variants.update(_hook_variants(seed, max(sizes)))
    records: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in sizes:
            t = torch.randn(n, generator=torch.Generator().manual_seed(n))
            nbytes = t.numel() * t.element_size()
            times: dict[str, list[float]] = {k: [] for k in variants}
            for r in range(rounds):
                names = list(variants)
                names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
                for name in names:
                    if name in slow and (n > 10**6 or r >= 3):
                        continue  # seconds per call: three rounds at small sizes say enough
                    call = functools.partial(variants[name], t)
                    times[name].append(per_call(call, 0.05 + nbytes / 4e9))
            for name, ts in times.items():
                if not ts:
                    continue
                sec = median(ts)
                # Per-round ratios against the sum() timed in the same round, then their median:
                # steadier than a ratio of medians when other jobs load the machine in bursts.
                ratios = [s / t for s, t in zip(times["sum"], ts, strict=False)]
                records.append(
                    {
                        "threads": threads,
                        "elements": n,
                        "bytes": nbytes,
                        "variant": name,
                        "seconds": sec,
                        "gb_per_s": nbytes / sec / 1e9,
                        "fraction_of_sum": median(ratios),
                        "rounds": len(ts),
                    }
                )
    rows = [
        (r["threads"], f"{r['elements']:.0e}", r["variant"], r["gb_per_s"], r["fraction_of_sum"])
        for r in records
    ]
    print(
        f"fast fingerprint backend: {backend}; float32 tensors on CPU; medians of {rounds} rounds"
    )
    print(table(["threads", "elements", "variant", "GB/s", "x sum()"], rows))
    goal = _goal(records, f"fast ({backend})")
    load_after = os.getloadavg()[0]
    print(f"\n{goal['line']}")
    print(
        f"load average (1 min) before/after the run: {load_before:.1f}/{load_after:.1f} on "
        f"{os.cpu_count()} CPUs; ratios from a loaded machine are noisy, so repeat before "
        "concluding"
    )
    path = write_json(
        "fingerprint_throughput",
        {
            "backend": backend,
            "goal_fraction": GOAL,
            "goal_threads": GOAL_THREADS,
            "goal_elements": list(GOAL_SIZES),
            "goal_fractions": goal["fractions"],
            "goal_met": goal["met"],
            "load_average_before_after": [load_before, load_after],
            "records": records,
        },
        args.json,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
