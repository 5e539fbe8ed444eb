"""Host-side time of a passing replay step at simulated world sizes 64 .. 2,048, one rank's view.

Why: issue 25's done-means is that a passing replay step's host-side Python is O(1) in the world
size W (the ratio of the figures at 2,048 and 64 ranks <= 1.5x), because the local decision
(`checks/local_replay.py`) replaces the gather of W rows and the Python loop over them. This
benchmark times the guard's real `Verifier.check_step(verify=True)` for one rank, at each W, on
both paths side by side in one interleaved run: the local decision (`fast_path_world` <= W) and
the row gather (`fast_path_world` above W), so the reader sees what the local decision saves.

What is real: one process runs a real DDP model on a real gloo process group of size 1 with a
real `Guard` (its comm hook, fingerprinter, replay function and config); each timed call is the
unmodified `Verifier.check_step` of that Guard's parts, with a real `Topology` of W ranks (8 per
node) and the step's real forward/backward (untimed) before it, so the hook's fingerprints and
sketches are this step's.

What is simulated (`SimulatedWorld`, used only here): the other W-1 ranks, as identical
replicas that hold this rank's values (a passing step).
  * `sum_and_max`: the real round on the size-1 group (tensors, all-reduces, the one host read,
    the call-tag check), then the sums multiplied by W: what W identical ranks would sum to.
  * `all_gather_rows`: the real round on the size-1 group, then the W-row result the real
    gather reads: a W x K int64 tensor of this row, read with one `tolist()` as `_read` does.
  * `p2p` (the replay exchange): loopback; this rank receives what it sent, i.e. its owner (an
    identical replica) sends the same batch, claim and RNG state. The replay runs for real.
The network time of the collectives is NOT in these figures (no wire): the local path's two
all-reduces cost O(log W) hops, the gather's ring W-1 hops; `benchmarks/scaling.py` measures
and extrapolates those. What is timed is the host-side work of the call, including the replay's
forward/backward of a small MLP, which is also given on its own ("replay" column) and
subtracted ("guard" columns).

    python benchmarks/replay_scaling.py            # W = 64 .. 2,048, 15 rounds
    python benchmarks/replay_scaling.py --quick    # W = 64, 512, 2,048, 5 rounds
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from _common import median, table, write_json
from torch import nn

from slurm_guard.checks.replay import Captured, ReplayOutput, capture
from slurm_guard.checks.verifier import Verifier
from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology
from slurm_guard.config import GuardConfig
from slurm_guard.guard import Guard
from slurm_guard.rundir.records import RankInfo

SIZES = (64, 128, 256, 512, 1024, 2048)
QUICK_SIZES = (64, 512, 2048)
GPUS_PER_NODE = 8
WIDTH, BATCH = 64, 16  # a small MLP: the replay's forward/backward stays near the guard's cost
CALLS = 10  # timed calls per (size, path) in each round


@dataclass
class Op:
    """A point-to-point operation as `replay.exchange` builds it, for the loopback."""

    tensor: torch.Tensor
    peer: int
    is_send: bool


class SimulatedWorld:
    """A Collective of W identical ranks seen from one rank (see the module docstring).

    Everything but the world's size and the three rounds below goes to the real size-1
    Collective (`arm`, the device, the causes, the counters)."""

    def __init__(self, inner: Collective, world: int, rank: int = 0) -> None:
        self.inner = inner
        self.world_size = world
        self.rank = rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sum_and_max(
        self, sums: torch.Tensor, maxima: torch.Tensor, own: torch.Tensor
    ) -> tuple[list[int], list[int], list[int]]:
        sum_bits, highs, mine = self.inner.sum_and_max(sums, maxima, own)
        total = torch.tensor(sum_bits, dtype=torch.int64).view(torch.float64) * self.world_size
        return total.view(torch.int64).tolist(), highs, mine

    def all_gather_rows(
        self, row: torch.Tensor | Sequence[int], what: str | None = None
    ) -> list[list[int]]:
        (mine,) = self.inner.all_gather_rows(row, what)
        rows: list[list[int]] = torch.tensor([mine]).repeat(self.world_size, 1).tolist()
        return rows

    def send(self, tensor: torch.Tensor, peer: int) -> Op:
        return Op(tensor, peer, is_send=True)

    def recv(self, tensor: torch.Tensor, peer: int) -> Op:
        return Op(tensor, peer, is_send=False)

    def p2p(self, ops: list[Op], what: str) -> None:
        sent = [op.tensor for op in ops if op.is_send]
        received = [op.tensor for op in ops if not op.is_send]
        for source, target in zip(sent, received, strict=True):
            target.copy_(source)


def simulated_topology(world: int) -> Topology:
    return Topology.build(
        [RankInfo(rank=r, node=f"node{r // GPUS_PER_NODE:04d}", hostname="h") for r in range(world)]
    )


class ReplayTimer:
    """The Guard's replay function, timed: its share is reported apart from the guard's."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.seconds = 0.0

    def __call__(self, captured: Captured) -> ReplayOutput:
        start = time.perf_counter()
        try:
            return self.guard._replay(captured)
        finally:
            self.seconds += time.perf_counter() - start


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@contextmanager
def single_rank_group() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Bench:
    """One real Guard; a Verifier of its parts per (W, path)."""

    def __init__(self, run_dir: str) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(self.ddp.parameters(), lr=0.0)
        self.guard = Guard(self.ddp, optimizer, loss_fn, run_dir, GuardConfig())
        self.replay = ReplayTimer(self.guard)
        self.batch = (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))
        self.step = 0

    def verifier(self, world: int, local: bool) -> Verifier:
        g = self.guard
        config = replace(g.config, fast_path_world=world if local else world + 1)
        return Verifier(
            comm=SimulatedWorld(g.comm, world),  # type: ignore[arg-type]
            topology=simulated_topology(world),
            fingerprinter=g.fingerprinter,
            hook=g.hook,
            replay=self.replay,
            config=config,
            ledger=lambda *_: None,  # the ledger line rank 0 appends is the same at any W
            params=g.params,
        )

    def one_call(self, verifier: Verifier) -> tuple[float, float]:
        """(check_step seconds, of which the replay's); the step's backward is untimed."""
        g = self.guard
        self.step += 1
        g.comm.arm(f"step {self.step}")
        captured = capture(self.batch)
        g.optimizer.zero_grad(set_to_none=True)
        g.hook.reset(fingerprint_local=True, sketch_local=False)
        loss = loss_fn(self.ddp, self.batch)
        loss.backward()  # type: ignore[no-untyped-call]
        self.replay.seconds = 0.0
        start = time.perf_counter()
        result = verifier.check_step(self.step, loss, captured, verify=True)
        elapsed = time.perf_counter() - start
        if result.finding is not None or not result.verified:
            sys.exit(f"the simulated replay step did not pass: {result}")
        return elapsed, self.replay.seconds


def run(sizes: Sequence[int], rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as run_dir, single_rank_group():
        bench = Bench(run_dir)
        bench.one_call(bench.verifier(2, local=False))  # the settling pass, first compiles
        verifiers = {(w, local): bench.verifier(w, local) for w in sizes for local in (1, 0)}
        for v in verifiers.values():  # warm-up: each path once at each size
            bench.one_call(v)
        samples: dict[tuple[int, int], list[tuple[float, float]]] = {k: [] for k in verifiers}
        for r in range(rounds):
            order = list(verifiers) if r % 2 == 0 else list(reversed(verifiers))
            for key in order:  # interleaved: every size and path in each round
                calls = [bench.one_call(verifiers[key]) for _ in range(CALLS)]
                samples[key].append((median([c[0] for c in calls]), median([c[1] for c in calls])))
        local_steps = sum(v.local_replays for (_, local), v in verifiers.items() if local)
    figures = []
    for w in sizes:
        row: dict[str, Any] = {"world": w}
        for local, name in ((1, "local"), (0, "gather")):
            total = median([s[0] for s in samples[(w, local)]])
            replay = median([s[1] for s in samples[(w, local)]])
            row[f"{name}_us"] = total * 1e6
            row[f"{name}_replay_us"] = replay * 1e6
            row[f"{name}_guard_us"] = (total - replay) * 1e6
        figures.append(row)
    return {"sizes": list(sizes), "rounds": rounds, "local_steps": local_steps, "rows": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="W = 64, 512, 2,048; 5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (15)")
    parser.add_argument("--json", default=None, help="where to write the JSON results")
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    rounds = args.rounds or (5 if args.quick else 15)
    torch.set_num_threads(1)
    result = run(sizes, rounds)
    rows = result["rows"]
    print(
        table(
            [
                "W",
                "local decision: check_step µs",
                "of which replay µs",
                "guard µs",
                "row gather: check_step µs",
                "guard µs",
                "gather / local (guard)",
            ],
            [
                [
                    r["world"],
                    r["local_us"],
                    r["local_replay_us"],
                    r["local_guard_us"],
                    r["gather_us"],
                    r["gather_guard_us"],
                    r["gather_guard_us"] / r["local_guard_us"],
                ]
                for r in rows
            ],
        )
    )
    first, last = rows[0], rows[-1]
    ratios = {
        name: last[f"{name}_guard_us"] / first[f"{name}_guard_us"] for name in ("local", "gather")
    }
    span = f"{last['world']}/{first['world']}"
    print(f"\nratio {span}, local decision (guard part): {ratios['local']:.2f}x (goal <= 1.5x)")
    print(f"ratio {span}, row gather (guard part):     {ratios['gather']:.2f}x")
    total_local = last["local_us"] / first["local_us"]
    print(f"ratio {span}, local decision (whole check_step): {total_local:.2f}x")
    print(f"replay steps passed by the local decision: {result['local_steps']}")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    result.update(ratio_local=ratios["local"], ratio_gather=ratios["gather"])
    result["load_average"] = list(os.getloadavg())
    print(f"wrote {write_json('replay_scaling', result, args.json)}")


if __name__ == "__main__":
    main()
