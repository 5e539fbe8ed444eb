"""Scaling of the guard's checks with the world size: bytes sent and time per check per rank.

For each world size W (2..8 local gloo processes, each rank its own "node" via SLURMD_NODENAME)
the checks' communication is timed with the guard's own code paths and tensor sizes:

* verdict gather: `Collective.all_gather_rows` (slurm_guard.comm.collective) of the
  `check_step` row,
  ROW = 15 int64 per rank, every step: one all_gather_into_tensor and one host read of the W rows;
* watchdog arrival: `Collective.arrive` (every step, and before a verification's verdicts): per
  rank one set, one add, one wait and one get on the TCPStore that rank 0 hosts;
* weight vote: `Verifier.vote` (one int64 per rank through `all_gather_rows`, `judge_vote`; every
  `vote_every` steps);
* ring replay exchange: `replay.exchange` through the Collective with a real captured TinyGPT
  batch (point-to-point: 8-byte size, then the packed batch, to one replayer on another node;
  every `replay_every` steps);
* bucket check: the comm hook's fused kernel (`kernels.bucket.bucket_check`: sketch, L1 norm and
  finite flag in one pass) on the local bucket, and again (its sketch) on the averaged bucket, of
  the model's gradient size (local compute only: its numbers ride in the verdict gather's row);
* the per-step fast path: `Collective.sum_and_max`, the round `Verifier.check_step` runs on a
  step without replay instead of the verdict gather: one SUM all-reduce of 4 float64 (flag
  counts, local sketch, L1) and one MAX all-reduce of 3 int64 (averaged sketch bits and their
  complement, for min/max agreement; the largest checked-GEMM ratio), one host read; the row
  gather runs only after it fails, to attribute;
* the vote's fast path: `Verifier.vote` at `fast_path_world=1`: one MAX all-reduce of the
  fingerprint's 2 lanes and their complements, one host read (the gather only on disagreement).

Bytes per rank are computed from the code paths (ring all-gather: W-1 blocks sent and received
per rank, gloo and NCCL alike). The Python that decodes and judges the gathered rows (O(W) per
step: the host read's tolist(), `bits_to_float`, `Verifier._judge_reduction`, `_judge_replays`,
`judge_vote`) is timed in this process at the target world size itself (8,192 rows), and the
communication terms are extrapolated from the per-hop cost fitted to the measured 2..8 runs.

    python benchmarks/scaling.py             # W = 2..8, 7 rounds
    python benchmarks/scaling.py --quick     # W = 2, 4, 8, 3 rounds
    python benchmarks/scaling.py --store-load  # rank 0's store per round, N = 64..2,048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import median, table, write_json

from slurm_guard.checks import verifier as ver
from slurm_guard.checks.comm_hook import HookState, SignVectors
from slurm_guard.checks.consistency import judge_vote
from slurm_guard.checks.replay import Captured, ReplayOutput, capture, exchange, pack
from slurm_guard.checks.verdicts import bits_to_float, judge_reduced_nonfinite
from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology, gather_rank_infos, local_rank_info
from slurm_guard.config import GuardConfig
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, make_batch
from slurm_guard.fingerprint.tree import Fingerprinter
from slurm_guard.kernels.bucket import backend, bucket_check
from slurm_guard.rundir.records import RankInfo

# The step_overhead.py model and batch, so the replay payload is the one timed there.
MODEL = TinyGPTConfig(vocab=64, context=64, width=256, heads=4, layers=4, dropout=0.1)
BATCH = 8
CALLS = 20  # calls per timed window
TARGET_NODES, TARGET_GPUS = 1024, 8
TARGET_W = TARGET_NODES * TARGET_GPUS
I64 = 8
ASSUMED_HOP_S = 5e-6  # a typical inter-node small-message latency; NOT measured here
WATCHDOG_S = 300.0  # GuardConfig's default: the arrival check is on in every guarded run
STORE_REQUESTS = 4  # per rank and round: set, add, wait, get (the last arriver also compare_set)
# The per-step fast path (`Verifier._fast_step_passes`): SUM of [ranks with a non-finite local
# value, ranks with a non-finite averaged value, local sketch, local L1] in float64 and MAX of
# [averaged sketch bits, their complement, worst checked-GEMM ratio bits] in int64. Steps with a
# replay still gather rows (they compare fingerprints rank by rank). The vote as MAX of
# [fp, ~fp] (2 words) is not built: the vote is still a gather.
ALT_SUM_WORDS, ALT_MAX_WORDS, ALT_VOTE_WORDS = 4, 3, 2
CHECKS = (
    "verdict gather",
    "watchdog arrival",
    "weight vote",
    "ring replay exchange",
    "bucket check",
)


def _no_replay(captured: Captured) -> ReplayOutput:
    raise AssertionError("the benchmark's Verifier never replays")


def _no_ledger(step: int, check: object, ok: bool, detail: dict[str, object]) -> None:
    """The ledger is written on rank 0 only, outside the timed collectives."""


def _verifier(
    comm: Any,
    topology: Topology,
    params: list[torch.nn.Parameter],
    hook: HookState,
    config: GuardConfig | None = None,
) -> ver.Verifier:
    """A Verifier from the guard's own parts (no model: nothing is replayed here)."""
    return ver.Verifier(
        comm=comm,
        topology=topology,
        fingerprinter=Fingerprinter(1234),
        hook=hook,
        replay=_no_replay,
        config=config or GuardConfig(),
        ledger=_no_ledger,
        params=params,
    )


def _fast_path(comm: Collective) -> None:
    """The per-step fast path's round, through the guard's own code (`Collective.sum_and_max`)."""
    sums = torch.zeros(ALT_SUM_WORDS, dtype=torch.float64, device=comm.device)
    maxima = torch.zeros(ALT_MAX_WORDS, dtype=torch.int64, device=comm.device)
    comm.sum_and_max(sums, maxima, torch.zeros(1, dtype=torch.int64, device=comm.device))


def _worker(rounds: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    me = local_rank_info(rank)
    comm = Collective(None, me.node, WATCHDOG_S)
    topology = Topology.build(gather_rank_infos(me, comm=comm))
    pairs = [(o, topology.replayer[o]) for o in range(world)]
    captured = capture(make_batch(0, rank, MODEL, batch_size=BATCH))
    payload_bytes = int(pack(captured).numel())
    numel = sum(p.numel() for p in TinyGPT(MODEL).parameters())
    bucket = torch.randn(numel)
    signs = SignVectors(1234)
    fingerprinter = Fingerprinter(1234)
    hook = HookState(None, world, fingerprinter, signs, {})
    verifier = _verifier(comm, topology, [torch.nn.Parameter(torch.zeros(1))], hook)
    fast = GuardConfig(fast_path_world=1)
    fast_verifier = _verifier(comm, topology, [torch.nn.Parameter(torch.zeros(1))], hook, fast)
    fingerprint = torch.tensor([0, 1], device=comm.device)  # the same on every rank: it passes
    row = torch.full((ver.ROW,), rank, dtype=torch.int64, device=comm.device)
    step = [0]

    def arrival() -> None:
        step[0] += 1
        comm.arrive(f"step {step[0]}")

    def check() -> None:  # per step the hook checks the local and the averaged bucket
        bucket_check(bucket, signs.words)
        bucket_check(bucket, signs.words, l1=False)  # the averaged bucket: its sketch only

    ops: dict[str, Callable[[], object]] = {
        "verdict gather": lambda: comm.all_gather_rows(row),
        "watchdog arrival": arrival,
        "weight vote": lambda: verifier.vote(0, torch.tensor([0, rank], device=comm.device)),
        "ring replay exchange": lambda: exchange(pairs, captured, rank, comm),
        "bucket check": check,
        "step fast path (SUM+MAX)": lambda: _fast_path(comm),
        "vote fast path (MAX)": lambda: fast_verifier.vote(0, fingerprint),
        "barrier (floor)": lambda: dist.barrier(),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}

    def window(fn: Callable[[], object]) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        dist.barrier()
        return (time.perf_counter() - start) / CALLS

    names = list(ops)
    for name in names:  # warm-up: connections, allocator, kernel build
        window(ops[name])
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(window(ops[name]))
    return {
        "times": times,
        "payload_bytes": payload_bytes,
        "grad_numel": numel,
        "replayer": list(topology.replayer),
        "bucket_check_backend": backend(torch.device("cpu")),
    }


def arrival_bytes(rank: int, what: str = "step 1000000", node: str = "node1000") -> int:
    """Key and value bytes one rank sends to rank 0's TCPStore per arrival (no framing).

    Prefix "slurm-guard/<12 hex>/<instance>/" on every key; set at/<rank> = "<seq>\t<node>\t<what>",
    add <seq>/n (8-byte amount), wait <seq>/go, get <seq>/go.
    """
    prefix = len("slurm-guard/") + 12 + len("/0/")
    seq = len(str(1_000_000))
    keys = [f"at/{rank}", "x" * seq + "/n", "x" * seq + "/go", "x" * seq + "/go"]
    return sum(prefix + len(k) for k in keys) + seq + len(node) + len(what) + 2 + I64


def bytes_per_rank(world: int, payload: int) -> dict[str, dict[str, int]]:
    """Bytes each rank sends per call of each check (and receives: the same here)."""
    ring = world - 1  # ring all-gather: W-1 blocks through every rank
    return {
        "verdict gather": {"sent": ring * ver.ROW * I64, "per": 1},
        # to rank 0's store, which receives this from every rank: O(W) there
        "watchdog arrival": {"sent": arrival_bytes(world - 1), "per": 1},
        "weight vote": {"sent": ring * I64, "per": 1},
        # size (8 bytes) then the packed batch + RNG state to exactly one replayer
        "ring replay exchange": {"sent": I64 + payload, "per": 1},
        "bucket check": {"sent": 0, "per": 1},
    }


def alt_bytes_per_rank(words: int) -> dict[str, int]:
    """All-reduce of `words` int64: ring sends 2(W-1)/W x n < 2n; a binary tree <= 3n per rank."""
    n = words * I64
    return {"ring_max": 2 * n, "tree_max": 3 * n}


def verdict_python_at(world: int, nodes: int, repeats: int = 3) -> dict[str, float]:
    """Seconds per step of the O(W) Python the guard runs on the gathered rows, at `world` ranks.

    No communication: the rows are built as a clean verified step would gather them, and the
    guard's own code decodes and judges them: the gather's host read (`Collective._read`: one
    tolist() of the W x ROW tensor), then what `Verifier.check_step` runs on the rows (the
    replay-failed scan, the finite flags, the L1 total, `judge_reduced_nonfinite`,
    `Verifier._judge_reduction`, `Verifier._judge_replays`), and `judge_vote`.
    """
    per_node = world // nodes
    ranks = [
        RankInfo(rank=r, node=f"n{r // per_node}", hostname=f"n{r // per_node}")
        for r in range(world)
    ]
    t0 = time.perf_counter()
    topology = Topology.build(ranks)
    topology_s = time.perf_counter() - t0
    one = int(torch.tensor([1.0], dtype=torch.float64).view(torch.int64).item())
    row = [0] * ver.ROW
    row[ver.OWN_LOSS] = row[ver.REPLAY_LOSS] = one
    row[ver.OWN_GRAD] = row[ver.REPLAY_GRAD] = 12345
    row[ver.LOCAL_SKETCH] = row[ver.LOCAL_L1] = row[ver.REDUCED_SKETCH] = one
    row[ver.REDUCED_GRAD] = 6789
    row[ver.ABFT_WHERE] = -1
    param = torch.nn.Parameter(torch.zeros(1))
    hook = HookState(None, world, Fingerprinter(1234), SignVectors(1234), {})
    hook.largest_bucket, hook.buckets, hook.elements = 25_000_000, 1, 25_000_000
    # check_step reads only the world size (and rank) from the Collective once rows are gathered
    comm = types.SimpleNamespace(rank=0, world_size=world)
    verifier = _verifier(comm, topology, [param], hook)
    captured = capture(None)
    mine = torch.tensor(row, dtype=torch.int64)
    out: dict[str, list[float]] = {
        "gather lists": [],
        "verdicts": [],
        "vote": [],
        "bits_to_float share of verdicts": [],
    }
    for _ in range(repeats):
        t0 = time.perf_counter()
        gathered = torch.empty(world * ver.ROW, dtype=torch.int64)
        gathered.view(world, -1).copy_(mine)  # what all_gather_into_tensor writes
        rows: list[list[int]] = gathered.view(world, -1).cpu().tolist()  # Collective._read
        t1 = time.perf_counter()
        failed = [(r, rows[r][ver.REPLAYED]) for r in range(world)]
        assert not [(r, o) for r, o in failed if rows[r][ver.REPLAY_FAILED]]
        assert not any(r[ver.LOCAL_NONFINITE] for r in rows)
        l1_total = sum(bits_to_float(r[ver.LOCAL_L1]) for r in rows)
        assert (
            judge_reduced_nonfinite(
                [bool(r[ver.REDUCED_NONFINITE]) for r in rows],
                overflow_possible=l1_total >= torch.finfo(param.dtype).max,
            )
            is None
        )
        assert verifier._judge_reduction(rows, True) is None
        assert verifier._judge_replays(0, rows, captured) is None
        t2 = time.perf_counter()
        assert judge_vote([r[ver.REDUCED_GRAD] for r in rows]) is None
        t3 = time.perf_counter()
        for key in (ver.LOCAL_L1, ver.LOCAL_L1, ver.LOCAL_SKETCH):  # the 3W calls in `verdicts`
            [bits_to_float(r[key]) for r in rows]
        t4 = time.perf_counter()
        out["bits_to_float share of verdicts"].append(t4 - t3)
        out["gather lists"].append(t1 - t0)
        out["verdicts"].append(t2 - t1)
        out["vote"].append(t3 - t2)
    result = {k: median(v) for k, v in out.items()}
    result["topology_build_once"] = topology_s
    return result


def fit_per_hop(worlds: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least squares t = a + b (W - 1): fixed cost a and per-hop cost b of a ring collective."""
    xs = [w - 1 for w in worlds]
    if len(set(xs)) < 2:
        return seconds[0], 0.0
    b, a = statistics.linear_regression(xs, seconds)
    return a, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="W = 2, 4, 8 and 3 rounds")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    parser.add_argument(
        "--store-load",
        action="store_true",
        help="rank 0's TCPStore load per guard round, N simulated ranks (_store_load.py)",
    )
    args = parser.parse_args()
    if args.store_load:
        import _store_load

        sizes = args.worlds or [64, 256, 1024, 2048]
        results = _store_load.main(sizes, args.rounds or 3)
        write_json("scaling_store_load", {"store_load": results}, args.json)
        return
    worlds: list[int] = args.worlds or ([2, 4, 8] if args.quick else list(range(2, 9)))
    rounds = args.rounds or (3 if args.quick else 7)

    measured: dict[int, dict[str, Any]] = {}
    for world in worlds:
        nodes = [f"node{i + 1}" for i in range(world)]
        began = time.perf_counter()
        outcomes = run_local_checked(world, rounds, nodes)
        value = outcomes[0]  # windows end in a barrier: rank 0's time is the slowest rank's
        measured[world] = {
            "median_s": {k: median(v) for k, v in value["times"].items()},
            "raw_s": value["times"],
            "payload_bytes": value["payload_bytes"],
            "grad_numel": value["grad_numel"],
            "replayer": value["replayer"],
            "bucket_check_backend": value["bucket_check_backend"],
        }
        print(f"W={world}: measured in {time.perf_counter() - began:.1f} s", file=sys.stderr)

    payload = measured[worlds[-1]]["payload_bytes"]
    grad_numel = measured[worlds[-1]]["grad_numel"]
    rows: list[list[object]] = []
    for world in worlds:
        b = bytes_per_rank(world, measured[world]["payload_bytes"])
        med = measured[world]["median_s"]
        for check in CHECKS:
            rows.append([world, check, b[check]["sent"], med[check] * 1e6])
        rows.append(
            [world, "step fast path (SUM+MAX)", "< 112", med["step fast path (SUM+MAX)"] * 1e6]
        )
        rows.append([world, "vote fast path (MAX)", "< 64", med["vote fast path (MAX)"] * 1e6])
        rows.append([world, "barrier (floor)", "-", med["barrier (floor)"] * 1e6])

    # Extrapolation to 1,024 nodes x 8 GPUs. On 2 shared cores the 3..8-process timings measure
    # CPU oversubscription more than the collectives, so the per-hop cost is taken from W=2
    # (one ring hop, each rank on its own core) and also shown at an assumed interconnect hop.
    fits = {
        name: fit_per_hop(worlds, [measured[w]["median_s"][name] for w in worlds])
        for name in (
            "verdict gather",
            "watchdog arrival",
            "weight vote",
            "step fast path (SUM+MAX)",
            "barrier (floor)",
        )
    }
    python = verdict_python_at(TARGET_W, TARGET_NODES)
    big = bytes_per_rank(TARGET_W, payload)
    base = measured[min(worlds)]["median_s"]
    hop_here = base["verdict gather"] / (min(worlds) - 1)
    ar_here = base["step fast path (SUM+MAX)"] / 2  # two all-reduces per call
    # rank 0's store serves STORE_REQUESTS per rank and round, one after another
    request_here = base["watchdog arrival"] / (STORE_REQUESTS * min(worlds))
    store_requests = STORE_REQUESTS * TARGET_W
    ring_hops = TARGET_W - 1
    tree_hops = 2 * (TARGET_W - 1).bit_length()  # up and down a binary tree
    extrapolated = {
        "world": TARGET_W,
        "bytes_sent_per_rank": {k: v["sent"] for k, v in big.items()},
        "alt_bytes_sent_per_rank": {
            "step (SUM 4 float64 + MAX 3 int64)": alt_bytes_per_rank(ALT_SUM_WORDS + ALT_MAX_WORDS),
            "vote (MAX 2 int64)": alt_bytes_per_rank(ALT_VOTE_WORDS),
        },
        "ring_allgather_hops": ring_hops,
        "tree_allreduce_hops": tree_hops,
        "hop_s_measured_w2": hop_here,
        "allreduce_s_measured_w2": ar_here,
        "assumed_interconnect_hop_s": ASSUMED_HOP_S,
        "verdict_gather_s": {
            "at_measured_hop": ring_hops * hop_here,
            "at_assumed_hop": ring_hops * ASSUMED_HOP_S,
        },
        "watchdog_arrival": {
            "store_requests_at_rank0_per_round": store_requests,
            "bytes_received_at_rank0_per_round": sum(arrival_bytes(r) for r in range(TARGET_W)),
            "request_s_measured_w2": request_here,
            "at_measured_request_s": store_requests * request_here,
        },
        "alt_two_allreduces_s": {
            "at_measured_hop": 2 * tree_hops * ar_here,
            "at_assumed_hop": 2 * tree_hops * ASSUMED_HOP_S,
        },
        "linear_fit_fixed_and_per_hop_s": {
            k: {"fixed": a, "per_hop": b} for k, (a, b) in fits.items()
        },
        "python_on_rows_s": python,
        "ring_replay_exchange_bytes": I64 + payload,
    }
    print(
        f"\nScaling, TinyGPT width={MODEL.width} layers={MODEL.layers} ({grad_numel:,} gradient "
        f"elements), batch {BATCH}x{MODEL.context}; gloo on local processes, 1 thread each, "
        f"bucket check by the {measured[worlds[-1]]['bucket_check_backend']} kernel, "
        f"{CALLS} calls per window, medians of {rounds} rounds; bytes sent per rank per call\n"
    )
    print(table(["W", "check", "bytes sent / rank", "time / call (µs)"], rows))
    ms = 1e3
    gather_s = extrapolated["verdict_gather_s"]
    alt_s = extrapolated["alt_two_allreduces_s"]
    hops = f"{ring_hops} hops"
    xrows = [
        [
            "verdict gather (every step)",
            f"{big['verdict gather']['sent']:,} B",
            f"O(W): {hops}",
            f"{gather_s['at_measured_hop']:.1f} s",
            f"{gather_s['at_assumed_hop'] * ms:.0f} ms",
        ],
        [
            "weight vote (every vote_every)",
            f"{big['weight vote']['sent']:,} B",
            f"O(W): {hops}",
            f"{ring_hops * hop_here:.1f} s",
            f"{ring_hops * ASSUMED_HOP_S * ms:.0f} ms",
        ],
        ["ring replay exchange", f"{I64 + payload:,} B", "O(1): 1 peer", "as W=2..8", "-"],
        [
            "watchdog arrival (every step, TCPStore on rank 0)",
            f"~{big['watchdog arrival']['sent']} B to rank 0",
            f"O(1) per rank, O(W) at rank 0: {store_requests:,} requests",
            f"{store_requests * request_here:.1f} s",
            "not estimated",
        ],
        ["bucket check (fused kernel)", "0 (3 words of the row)", "O(1)", "as W=2..8", "-"],
        [
            "Python on the gathered rows (measured)",
            "-",
            "O(W)",
            f"{(python['gather lists'] + python['verdicts']) * ms:.0f} ms",
            "same",
        ],
        [
            "step fast path: SUM 4 float64 + MAX 3 int64",
            "<= 112 B ring, <= 168 B tree",
            f"O(1) B, {tree_hops} hops each",
            f"{alt_s['at_measured_hop'] * ms:.0f} ms",
            f"{alt_s['at_assumed_hop'] * ms:.2f} ms",
        ],
    ]
    print(f"\nExtrapolated to {TARGET_NODES} nodes x {TARGET_GPUS} GPUs = {TARGET_W} ranks:\n")
    print(
        table(
            [
                "check",
                "bytes sent / rank / call",
                "order",
                f"time at measured hop ({hop_here * 1e6:.0f} µs)",
                f"at {ASSUMED_HOP_S * 1e6:.0f} µs/hop (assumed)",
            ],
            xrows,
        )
    )
    print(
        f"\nPython on {TARGET_W} gathered rows per step (measured here): gather lists "
        f"{python['gather lists'] * ms:.0f} ms, verdicts {python['verdicts'] * ms:.0f} ms (of "
        f"which bits_to_float {python['bits_to_float share of verdicts'] * ms:.0f} ms), vote "
        f"{python['vote'] * ms:.1f} ms; Topology.build once per start "
        f"{python['topology_build_once']:.2f} s"
    )
    path = write_json(
        "scaling",
        {
            "model": MODEL.__dict__,
            "batch": BATCH,
            "calls_per_window": CALLS,
            "rounds": rounds,
            "worlds": worlds,
            "measured": {str(w): m for w, m in measured.items()},
            "bytes_sent_per_rank": {str(w): bytes_per_rank(w, payload) for w in worlds},
            "extrapolated": extrapolated,
        },
        args.json,
    )
    print(f"wrote {path}")


def run_local_checked(world: int, rounds: int, nodes: list[str]) -> list[dict[str, Any]]:
    from slurm_guard.local.launch import run_local

    outcomes = run_local(_worker, world, (rounds,), nodes=nodes, timeout=600)
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        sys.exit(f"W={world}: rank {bad[0].rank} {bad[0].status}:\n{bad[0].value}")
    return [o.value for o in outcomes]


if __name__ == "__main__":
    main()
