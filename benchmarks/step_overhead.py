"""Step overhead of the guard under DDP on local gloo processes, variants interleaved in one run.

Variants: plain DDP; finite check only; + weight vote every 10; + replay every 10; the default
configuration (replay and vote every 10). Every process builds all five (same initial weights),
then runs them round-robin, K = 10 consecutive steps per variant per round (one replay and one
vote per window), rotating the order each round. Per variant: median over rounds of the mean step
time in the window, the ratio to plain DDP, and the measured floor
1 + t(replay forward+backward) / (K * plain step time).

    python benchmarks/step_overhead.py                        # world 2, 8 rounds
    python benchmarks/step_overhead.py --fingerprint fast     # with fingerprint_fast.py
    python benchmarks/step_overhead.py --quick                # 3 rounds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import median, table, write_json
from torch.nn.parallel import DistributedDataParallel as DDP

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, make_batch
from slurm_guard.local_launch import run_local

K = 10
HUGE = 1_000_000
MODEL = TinyGPTConfig(vocab=64, context=64, width=256, heads=4, layers=4, dropout=0.1)
BATCH = 8
VARIANTS: dict[str, sg.GuardConfig | None] = {
    "plain DDP": None,
    "finite check only": sg.GuardConfig(replay_every=HUGE, vote_every=HUGE),
    "+ vote every 10": sg.GuardConfig(replay_every=HUGE, vote_every=K),
    "+ replay every 10": sg.GuardConfig(replay_every=K, vote_every=HUGE),
    "default": sg.GuardConfig(),
}


def _worker(root: str, rounds: int, fingerprint: str) -> dict[str, Any]:
    if fingerprint == "fast":  # what the wiring in slurm_guard/fingerprint.py will do
        import slurm_guard.guard
        from slurm_guard.fingerprint_fast import FastFingerprinter

        slurm_guard.guard.Fingerprinter = FastFingerprinter  # type: ignore[attr-defined]
    rank = dist.get_rank()
    runners: dict[str, Any] = {}
    for i, (name, config) in enumerate(VARIANTS.items()):
        torch.manual_seed(0)
        ddp = DDP(TinyGPT(MODEL))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        if config is None:

            def plain(batch: Any, ddp: DDP = ddp, opt: torch.optim.Optimizer = opt) -> float:
                opt.zero_grad(set_to_none=True)
                loss = lm_loss(ddp, batch)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                return float(loss.detach())

            runners[name] = plain
        else:
            run_dir = Path(root) / f"v{i}"
            run_dir.mkdir(exist_ok=True)
            runners[name] = sg.Guard(ddp, opt, lm_loss, run_dir, config=config).step
    steps = dict.fromkeys(runners, 0)
    times: dict[str, list[float]] = {name: [] for name in runners}

    def window(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(K):
            runners[name](make_batch(steps[name], rank, MODEL, batch_size=BATCH))
            steps[name] += 1
        dist.barrier()
        return (time.perf_counter() - start) / K

    for name in runners:  # warm-up window: DDP bucket rebuild, settle, allocator
        window(name)
    names = list(runners)
    fb: list[float] = []
    module = TinyGPT(MODEL)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(window(name))
        # the floor's numerator: one replay forward+backward on the plain module
        batch = make_batch(r, rank, MODEL, batch_size=BATCH)
        start = time.perf_counter()
        lm_loss(module, batch).backward()  # type: ignore[no-untyped-call]
        fb.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
    return {"times": times, "fb": fb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--world", type=int, default=2, help="processes (one per fake node)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--fingerprint",
        choices=["reference", "fast"],
        default="reference",
        help="fingerprint behind the guard: fingerprint.py (today) or fingerprint_fast.py",
    )
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 8)
    nodes = [f"node{i + 1}" for i in range(args.world)]
    with tempfile.TemporaryDirectory(prefix="sg-bench-") as root:
        outcomes = run_local(
            _worker, args.world, (root, rounds, args.fingerprint), nodes=nodes, timeout=1800
        )
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        sys.exit(f"rank {bad[0].rank} {bad[0].status}:\n{bad[0].value}")
    # a window's time is the slowest rank's (the barrier ends it); rank 0 measures it
    times: dict[str, list[float]] = outcomes[0].value["times"]
    fb = median([t for o in outcomes for t in o.value["fb"]])
    plain = median(times["plain DDP"])
    floor = 1 + fb / (K * plain)
    results: list[dict[str, Any]] = []
    for name, ts in times.items():
        step = median(ts)
        results.append({"variant": name, "median_step_s": step, "ratio": step / plain})
    ratio: dict[str, float] = {r["variant"]: r["ratio"] for r in results}
    goals = {
        "finite_check_le_1.01": ratio["finite check only"] <= 1.01,
        "default_le_floor_plus_0.02": ratio["default"] <= floor + 0.02,
    }
    rows = [(r["variant"], r["median_step_s"] * 1e3, r["ratio"]) for r in results]
    print(
        f"TinyGPT width={MODEL.width} layers={MODEL.layers} context={MODEL.context}, batch "
        f"{BATCH}, world {args.world} (gloo, 1 thread/process), K={K}, medians of {rounds} rounds, "
        f"{args.fingerprint} fingerprint"
    )
    print(table(["variant", "median step (ms)", "x plain"], rows))
    print(f"\nreplay forward+backward: {fb * 1e3:.1f} ms; floor = 1 + fb/(K*plain) = {floor:.3f}")
    print(f"goal finite check <= 1.01x: {'met' if goals['finite_check_le_1.01'] else 'missed'}")
    print(
        f"goal default <= floor + 0.02 = {floor + 0.02:.3f}: "
        f"{'met' if goals['default_le_floor_plus_0.02'] else 'missed'}"
    )
    path = write_json(
        f"step_overhead_{args.fingerprint}",
        {
            "model": MODEL.__dict__,
            "batch": BATCH,
            "world": args.world,
            "K": K,
            "fingerprint": args.fingerprint,
            "rounds": rounds,
            "replay_fwd_bwd_s": fb,
            "floor": floor,
            "results": results,
            "goals": goals,
            "raw_window_means_s": times,
        },
        args.json,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
