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
import time
from collections.abc import Callable

import torch
from _common import median, table, write_json

from slurm_guard import fingerprint_fast as ff
from slurm_guard.fingerprint import Fingerprinter
from slurm_guard.kernels import bucket as kb
from slurm_guard.kernels import sketch as sk

GOAL = 0.80  # fraction of tensor.sum() bandwidth


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
    records = []
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
            floor = median(times["sum"])
            for name, ts in times.items():
                if not ts:
                    continue
                sec = median(ts)
                records.append(
                    {
                        "threads": threads,
                        "elements": n,
                        "bytes": nbytes,
                        "variant": name,
                        "seconds": sec,
                        "gb_per_s": nbytes / sec / 1e9,
                        "fraction_of_sum": floor / sec,
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
    fast_rows = [
        r for r in records if r["variant"].startswith("fast (") and "torch" not in r["variant"]
    ]
    met = all(r["fraction_of_sum"] >= GOAL for r in fast_rows)
    worst = min((r["fraction_of_sum"] for r in fast_rows), default=0.0)
    print(
        f"\ngoal >= {GOAL:.0%} of sum() bandwidth: {'met' if met else 'missed'} (worst {worst:.0%})"
    )
    path = write_json(
        "fingerprint_throughput",
        {"backend": backend, "goal_fraction": GOAL, "goal_met": met, "records": records},
        args.json,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
