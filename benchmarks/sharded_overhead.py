"""Step-time ratio of ShardedGuard against plain HSDP / FSDP2, variants interleaved in one run.

Local gloo processes (default 4: a 2 x 2 HSDP mesh, or `--fsdp` for one group of 4). Every
process builds the tiny Llama-like model of `slurm_guard.examples.tiny_llama` three times with
the same initial weights: plain (`fully_shard` only), `ShardedGuard` with per-step checks only
(finite checks at the reduce-scatter and of the reduced shards, the verdict gather; replay and
vote off), and `ShardedGuard` with the default configuration (replay and vote every 10 steps,
under HSDP). They run round-robin, K = 10 steps per window (one replay and one vote per window
under the default), the order rotated each round. Per variant: the median over rounds of the
mean step time (the slowest rank's), and the median of each round's ratio to the plain window
of the same round, which is steadier under drifting load.

    python benchmarks/sharded_overhead.py                # HSDP 2 x 2, 5 rounds
    python benchmarks/sharded_overhead.py --fsdp --rounds 3
    python benchmarks/sharded_overhead.py --tp 2         # FSDP2 + TP: ("dp", "tp") = 2 x 2
    python benchmarks/sharded_overhead.py --fsdp --update-check   # and --tp 2 --update-check

`--update-check` (FSDP2, FSDP2 + TP): the default configuration with the update check off
(`GuardConfig(update_check=False)`), on at the default vote cadence (every 10 steps) and on
every step (`vote_every=1`), side by side; the last column is each variant's median ratio to
the window without the update check in the same round.
Under TP each TP group trains on its data-parallel index's batch (torchtitan's loader).
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

K = 10
HUGE = 1_000_000


def _batch(step: int, rank: int, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (8, width + 1), generator=gen)


def variants(update_check: bool) -> dict[str, Any]:
    """The variants measured, by name (None: plain FSDP, no guard)."""
    import slurm_guard as sg

    if update_check:
        return {
            "plain": None,
            WITHOUT: sg.GuardConfig(seed=1, update_check=False),
            "default + update check": sg.GuardConfig(seed=1, update_check=True),
            "update check every step": sg.GuardConfig(seed=1, vote_every=1, update_check=True),
        }
    return {
        "plain": None,
        "per-step checks": sg.GuardConfig(replay_every=HUGE, vote_every=HUGE, seed=1),
        "default": sg.GuardConfig(seed=1),
    }


WITHOUT = "default, no update check"


def worker(
    rounds: int, fsdp: bool, run_root: str, seq: int, tp: int = 1, update_check: bool = False
) -> dict[str, list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    import slurm_guard as sg
    from slurm_guard.examples.tiny_llama import (
        TinyLlama,
        next_token_loss,
        shard_model,
        shard_model_tp,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        rank //= tp  # the data-parallel index: its TP group shares the batch
    elif fsdp:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    configs: dict[str, sg.GuardConfig | None] = variants(update_check)
    steps: dict[str, Any] = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(0)
        model = shard_model_tp(TinyLlama(), mesh) if tp > 1 else shard_model(TinyLlama(), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if config is None:

            def plain(batch: torch.Tensor, m: Any = model, o: Any = optimizer) -> None:
                o.zero_grad(set_to_none=True)
                next_token_loss(m, batch).backward()
                o.step()

            steps[name] = plain
        else:
            run_dir = Path(run_root) / f"variant-{i}"
            run_dir.mkdir(exist_ok=True)  # every rank: one local filesystem here
            guard = sg.ShardedGuard(model, optimizer, next_token_loss, run_dir, config)
            steps[name] = guard.step
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    counters = dict.fromkeys(names, 0)
    for n in names:  # warm-up window, not measured
        for _ in range(2):
            steps[n](_batch(counters[n], rank, seq))
            counters[n] += 1
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(K):
                steps[n](_batch(counters[n], rank, seq))
                counters[n] += 1
            elapsed = torch.tensor([(time.perf_counter() - start) / K])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[n].append(float(elapsed.item()))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--fsdp", action="store_true", help="one shard group, no replicas")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree (FSDP2 + TP)")
    parser.add_argument(
        "--update-check", action="store_true", help="with / without the update check (no HSDP)"
    )
    parser.add_argument("--out", help="JSON output path (default benchmarks/results/)")
    args = parser.parse_args()
    if args.update_check and not (args.fsdp or args.tp > 1):
        parser.error("--update-check needs --fsdp or --tp: HSDP votes instead")
    from slurm_guard.local.launch import run_local

    with tempfile.TemporaryDirectory() as root:
        outcomes = run_local(
            worker,
            args.world,
            args=(args.rounds, args.fsdp, root, args.seq, args.tp, args.update_check),
            nodes=[f"node{r // args.tp}" for r in range(args.world)],  # a TP group per node
            timeout=1800,
        )
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        print(bad[0].value, file=sys.stderr)
        return 1
    times: dict[str, list[float]] = outcomes[0].value
    plain = times["plain"]
    rows = []
    for name, series in times.items():
        ratios = [t / p for t, p in zip(series, plain, strict=True)]
        row = [name, 1000 * median(series), median(series) / median(plain), median(ratios)]
        if args.update_check:
            row.append(median([t / w for t, w in zip(series, times[WITHOUT], strict=True)]))
        rows.append(row)
    if args.tp > 1:
        layout = f"FSDP2 {args.world // args.tp} x TP {args.tp}"
    else:
        layout = f"FSDP2 1 x {args.world}" if args.fsdp else f"HSDP 2 x {args.world // 2}"
    print(f"{layout}, {args.rounds} rounds of {K} steps per variant, interleaved")
    header = ["variant", "step ms (median)", "ratio of medians", "median ratio"]
    print(table(header + (["vs no update check"] if args.update_check else []), rows))
    name = "sharded_overhead_fsdp" if args.fsdp else "sharded_overhead_hsdp"
    if args.tp > 1:
        name = f"sharded_overhead_tp{args.tp}"
    if args.update_check:
        name += "_update_check"
    write_json(name, {"layout": layout, "rounds": args.rounds, "times_s": times}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
