"""What the framework step-time benchmarks share: the variants, the interleaving, the report.

`hf_overhead.py` and `lightning_overhead.py` each time one framework's optimizer steps with and
without the guard's integration. Everything but the run of one variant is the same, and lives
here, so that the two ratios are measured the same way and can be read side by side: the guard
variants, the rounds in a rotating order (a machine whose load drifts penalises every variant
alike), the median of each round's ratio to the framework without the guard, and the JSON.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import median, table, write_json

import slurm_guard as sg
from slurm_guard.local.launch import run_local

HUGE = 1_000_000
GUARD_VARIANTS: dict[str, sg.GuardConfig] = {
    "per-step checks": sg.GuardConfig(replay_every=HUGE, vote_every=HUGE),
    "default": sg.GuardConfig(),
}
"""Per-step checks only (replay and vote off), and the default (replay and vote every 10)."""

SKIPPED_STEPS = 2
"""Left out of every run's mean: set-up and the first compiles (DDP's bucket rebuild)."""

OneRun = Callable[[str, Path, int, int], list[float]]
"""(variant, scratch folder, steps, width) -> the step times of one fresh run, in seconds."""


def add_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options both benchmarks take."""
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=22)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="2 rounds of 12 steps")
    p.add_argument("--out", help="JSON path (default benchmarks/results/<name>.json)")
    return p


def interleaved_means(
    names: list[str], one_run: OneRun, rounds: int, steps: int, width: int, scratch: str
) -> dict[str, list[float]]:
    """Every variant once a round, the order rotated each round; mean step time per run."""
    means: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            root = Path(scratch) / f"round{r}" / name.replace(" ", "-")
            times = one_run(name, root, steps, width)[SKIPPED_STEPS:]
            means[name].append(sum(times) / len(times))
    return means


def run_and_report(
    name: str, title: str, worker: Callable[..., dict[str, list[float]]], args: Any
) -> None:
    """Run `worker(rounds, steps, width, scratch)` on `args.world` local gloo ranks; print and
    write rank 0's means, each variant against the first one (the framework without the guard)."""
    rounds, steps = (2, 12) if args.quick else (args.rounds, args.steps)
    with tempfile.TemporaryDirectory() as scratch:
        outs = run_local(worker, args.world, (rounds, steps, args.width, scratch), timeout=3600)
    if any(o.status != "ok" for o in outs):
        raise SystemExit(f"a rank failed: {[o.value for o in outs if o.status != 'ok']}")
    means: dict[str, list[float]] = outs[0].value
    baseline = next(iter(means.values()))
    rows = []
    for variant, values in means.items():
        ratios = [v / p for v, p in zip(values, baseline, strict=True)]
        rows.append([variant, 1000 * median(values), median(ratios), min(ratios), max(ratios)])
    print(
        f"{title}, {args.world} gloo ranks, {rounds} rounds x {steps} steps "
        f"(first {SKIPPED_STEPS} left out), rank 0's clock:"
    )
    print(table(["variant", "step ms", "ratio to plain", "min", "max"], rows))
    payload = {
        "world": args.world,
        "rounds": rounds,
        "steps": steps,
        "width": args.width,
        "means": means,
    }
    print(f"wrote {write_json(name, payload, args.out)}")
