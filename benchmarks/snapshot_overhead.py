"""What node-local snapshots cost the step: the default guard with and without them, interleaved.

Both variants vote every 10 steps (the default); with `snapshots=True` each passing vote also
copies the verified state to node-local memory (a clone on the CPU, written by a background
thread). Every process builds both variants of the model (same initial weights) and runs them
round-robin, K = 10 steps per window (one vote, so one snapshot, per window), rotating the order
each round. Printed: the median of the per-round ratios (goal <= 1.01x), their range, the bytes
each node's first rank writes per snapshot, the milliseconds from the copy to the seal (off the
step's path), and the time the step waited for a previous snapshot.

    python benchmarks/snapshot_overhead.py --models mlp     # the parameter-heavy model
    python benchmarks/snapshot_overhead.py --quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import median, table, write_json
from step_overhead import MODELS
from torch.nn.parallel import DistributedDataParallel as DDP

import slurm_guard as sg
from slurm_guard.local.launch import run_local

K = 10
GOAL = 1.01


def _worker(root: str, rounds: int, model_name: str) -> dict[str, Any]:
    rank = dist.get_rank()
    spec = MODELS[model_name]
    variants = {
        "default (vote every 10)": sg.GuardConfig(),
        "+ snapshots": sg.GuardConfig(snapshots=True, snapshot_dir=str(Path(root) / "shm")),
    }
    runners: dict[str, Callable[[Any], object]] = {}
    guards: dict[str, sg.Guard] = {}
    for i, (name, config) in enumerate(variants.items()):
        torch.manual_seed(0)
        ddp = DDP(spec.build())
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        run_dir = Path(root) / f"v{i}"
        run_dir.mkdir(exist_ok=True)
        guards[name] = sg.Guard(ddp, opt, spec.loss, run_dir, config=config)
        runners[name] = guards[name].step
    steps = dict.fromkeys(runners, 0)
    times: dict[str, list[float]] = {name: [] for name in runners}

    def window(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(K):
            runners[name](spec.batch(steps[name], rank))
            steps[name] += 1
        dist.barrier()
        return (time.perf_counter() - start) / K

    for name in runners:  # warm-up: bucket rebuild, kernel build, the first snapshot's files
        window(name)
    names = list(runners)
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            times[name].append(window(name))
    snapshots = guards["+ snapshots"].snapshots
    assert snapshots is not None
    snapshots.close()
    stats = snapshots.copier.stats
    return {
        "times": times,
        "snapshots_written": stats.written,
        "snapshots_failed": stats.failed,
        "snapshot_bytes": stats.bytes,
        "ms_per_snapshot": [s * 1e3 for s in stats.seconds_written],
        "seconds_waited": stats.seconds_waited,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--world", type=int, default=2, help="processes (one per fake node)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["mlp"])
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    nodes = [f"node{i + 1}" for i in range(args.world)]
    results: dict[str, Any] = {}
    rows = []
    for model_name in args.models:
        with tempfile.TemporaryDirectory() as root:
            out = run_local(
                _worker, args.world, args=(root, rounds, model_name), nodes=nodes, timeout=3600
            )
        failed = [o for o in out if o.status != "ok"]
        if failed:
            sys.exit("\n".join(f"rank {o.rank}: {o.status}: {o.value}" for o in failed))
        value = out[0].value
        base, snap = (value["times"][n] for n in ("default (vote every 10)", "+ snapshots"))
        ratios = [s / b for s, b in zip(snap, base, strict=True)]
        ratio = median(ratios)
        results[model_name] = {
            "model": MODELS[model_name].describe,
            "default_step_ms": median(base) * 1e3,
            "snapshot_step_ms": median(snap) * 1e3,
            "ratio": ratio,
            "round_ratios": ratios,
            "goal_met": ratio <= GOAL,
            **{k: v for k, v in value.items() if k != "times"},
        }
        r = results[model_name]
        rows.append(
            (
                MODELS[model_name].describe,
                f"{r['default_step_ms']:.1f}",
                f"{r['snapshot_step_ms']:.1f}",
                f"{ratio:.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                f"{r['snapshot_bytes'] / 2**20:.1f}",
                f"{median(r['ms_per_snapshot']):.1f}",
                f"{r['seconds_waited'] * 1e3:.1f}",
                f"{r['snapshots_written']} / {r['snapshots_failed']}",
            )
        )
    print(
        table(
            [
                "model",
                "default ms/step",
                "+ snapshots ms/step",
                f"ratio (goal <= {GOAL})",
                "MiB per snapshot",
                "ms copy to seal",
                "ms waited",
                "written / failed",
            ],
            rows,
        )
    )
    path = write_json("snapshot_overhead", {"rounds": rounds, "models": results}, args.json)
    print(f"written {path}")


if __name__ == "__main__":
    main()
